"""Ask the Ulysses helper why, without running anything.

    python -m fastvideo.distributed.ulysses explain --world-size 4 --shape 3,62500,56,128 \\
        --dtype bfloat16 [--gpu GB200] [--a2a auto] [--mode 0] [--grad] [--long-training chunked] \\
        [--window-bytes N] \\
        [--seq-splits 62500,62500,62500,62499 --head-splits 14,14,14,14 --rank 0] [--overlap N]
    python -m fastvideo.distributed.ulysses doctor

``explain`` applies the switch (``FASTVIDEO_ULYSSES_A2A`` or ``--a2a``: ``off`` is the NCCL route) and the
same pure policy the helper applies on every call, and prints the plan (route, kind, CTAs, chunking, window
bytes) or the decline reason; no GPU or process group is needed (without a GPU and ``--gpu`` it plans for an
H200 and says so). With ``--seq-splits`` / ``--head-splits`` (every rank's shares) ``--shape`` is rank
``--rank``'s input. ``--overlap N`` (N > 1): ``--shape`` is a ``DistributedAttention``'s packed q/k/v; it adds
its head groups' plans.
Bad arguments are argparse errors (exit 2) that name the argument and the fix.
``doctor`` prints versions, the kernel library (every place it looked), GPUs and peer access, the
host identity and the environment variables. It reports problems (an invalid ``FASTVIDEO_*`` value,
a ``FASTVIDEO_KERNEL_LIBRARY`` that cannot be loaded, no kernel library while ``FASTVIDEO_ULYSSES_A2A=auto``,
a check that raised) as findings, goes on,
and exits 1 at the end if there were any.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from fastvideo import envs
from fastvideo.distributed.ulysses.explain import ASSUMED_GPU, DTYPES, ROUTE_VAR, default_gpu, explain
from fastvideo.distributed.ulysses.policy import DEFAULT_WINDOW_BYTES

_WINDOW_VAR = "FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES"
_LONG_VAR = "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING"
# Kept in step with fastvideo_kernel.LIBRARY_NAME / ENV_LIBRARY; doctor must work without that package.
_LIBRARY_NAME = "libfastvideo_ulysses_a2a.so"
_ENV_LIBRARY = "FASTVIDEO_KERNEL_LIBRARY"
_BUILD_HINT = "bash scripts/build_kernel.sh 2.28.9 build/kernel"


# ----------------------------------------------------------------------------------- argument types


def _shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    try:
        dims = tuple(int(v) for v in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected four positive integers B,S,H,D") from None
    if len(dims) != 4:
        raise argparse.ArgumentTypeError(f"{text!r}: expected four positive integers B,S,H,D, got {len(dims)} value(s)")
    bad = [f"{name}={v}" for name, v in zip("BSHD", dims) if v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: shapes are positive; {', '.join(bad)} (use e.g. 3,62500,56,128)")
    return dims  # type: ignore[return-value]


def _bounded_int(minimum: int, expected: str, below: str):
    """An argparse type: an int >= ``minimum``; ``expected`` and ``below`` say what a bad value should have been."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: {below}")
        return value

    return parse


_world_size = _bounded_int(1, "a positive integer (the SP size)",
                           "the SP size must be a positive integer (1, 2, 4, ...)")
_rank = _bounded_int(0, "a rank, 0 <= rank < the SP size", "a rank is non-negative (0 <= rank < the SP size)")


def _window_bytes(text: str) -> int:
    """Parsed by the env variable's own rule, so the flag and the variable accept the same values."""
    var = envs.registry()[_WINDOW_VAR]
    try:
        return int(var.parse(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected an integer number of bytes >= {var.minimum:g} (the same rule as {_WINDOW_VAR}; "
            f"default {var.default})"
        ) from None


def _splits(text: str) -> list[int]:
    """``5,3,4``: one non-negative int per SP rank (``validate_input`` checks the count against the SP size)."""
    try:
        table = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected one non-negative integer per SP rank (5,3,4)") from None
    negative = [f"[{r}]={v}" for r, v in enumerate(table) if v < 0]
    if negative:
        raise argparse.ArgumentTypeError(f"{text!r}: shares are non-negative (0: an idle rank); {', '.join(negative)}")
    return table




def _dtype(text: str) -> str:
    low = text.strip().lower()
    if low not in DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of {', '.join(sorted(DTYPES))} (any case)")
    return low


def _negative_values_as_values(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``--shape -1,2,3,4`` -> ``--shape=-1,2,3,4``: argparse otherwise takes ``-1,...`` for an option and
    says only "expected one argument"; joined, the value reaches its type check and gets a real message."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in options and i + 1 < len(argv) and re.match(r"-\d", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


# ----------------------------------------------------------------------------------- doctor


class _Doctor:
    """Prints ``label  text`` lines and collects findings; a check that raises becomes a finding."""

    def __init__(self) -> None:
        self.findings: list[str] = []

    def line(self, label: str, text: str) -> None:
        print(f"{label:10s} {text}")

    def finding(self, label: str, text: str) -> None:
        self.findings.append(f"{label}: {text}")
        self.line(label, f"PROBLEM: {text}")

    def check(self, label: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - doctor reports, goes on, and fails at the end
            self.finding(label, f"check raised {type(exc).__name__}: {exc}")


def _loader() -> ModuleType:
    """The kernel loader package (``fastvideo-kernel``); raises ImportError when it is not installed."""
    import fastvideo_kernel

    return fastvideo_kernel


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[3]  # <root>/fastvideo/distributed/ulysses/__main__.py


def kernel_places(repo_root: Path, loader: ModuleType | None) -> list[tuple[str, Path | None, str]]:
    """Every place a kernel library is looked for, in the loader's order, then the development builds.

    Returns ``(label, path or None, state)``. ``fastvideo_kernel.load`` opens
    ``$FASTVIDEO_KERNEL_LIBRARY`` when it is set, else the installed wheel's library; a development
    build (``<repo>/build/kernel*/``, what ``scripts/build_kernel.sh`` writes) is opened only when
    ``FASTVIDEO_KERNEL_LIBRARY`` points at it.
    """
    loaded = "found; the loader opens this one"
    places: list[tuple[str, Path | None, str]] = []
    override = os.environ.get(_ENV_LIBRARY, "")
    if override:
        places.append((f"${_ENV_LIBRARY}", Path(override), loaded if Path(override).is_file() else "MISSING"))
    else:
        places.append((f"${_ENV_LIBRARY}", None, "unset"))
    if loader is not None:
        wheel = Path(loader.__file__).resolve().parent / "lib" / _LIBRARY_NAME
        state = loaded if not override else "found; not loaded while the variable is set"
        places.append(("the wheel's library", wheel, state if wheel.is_file() else "missing"))
    else:
        places.append(("the wheel's library", None, "the loader package fastvideo_kernel is not importable"))
    builds = sorted((repo_root / "build").glob(f"kernel*/{_LIBRARY_NAME}"))
    for build in builds:
        chosen = override and Path(override).resolve() == build.resolve()
        places.append(("development build", build, loaded if chosen else f"found; loaded only via ${_ENV_LIBRARY}"))
    if not builds:
        places.append(("development build", repo_root / "build" / "kernel" / _LIBRARY_NAME, "missing"))
    return places


def _doctor_kernel(doc: _Doctor, repo_root: Path, switch: str | None) -> None:
    """The kernel library's places and state. Missing is a problem under ``switch == "auto"`` (every call would
    take the NCCL route, declining ``transport_missing``), a note otherwise."""

    def unavailable(text: str) -> None:
        if switch == "auto":
            doc.finding("kernel", f"not available while {ROUTE_VAR}=auto, so every call takes the NCCL route "
                                  f"(declined: transport_missing): {text}")
        else:
            doc.line("kernel", f"not available: {text} (not needed while {ROUTE_VAR}={switch or 'off'})")

    try:
        loader: ModuleType | None = _loader()
    except ImportError:
        loader = None
    override = os.environ.get(_ENV_LIBRARY, "")
    places = kernel_places(repo_root, loader)
    doc.line("kernel", "looked for the library in (the loader's order, then development builds):")
    for label, path, state in places:
        doc.line("kernel", f"  {label}: {path if path is not None else '-'}  [{state}]")
    dev = [path for label, path, state in places if label == "development build" and state.startswith("found")]
    if loader is None:
        fix = (
            "pip install --no-build-isolation --no-deps ./fastvideo-kernel, or put its source on the path: "
            f"export PYTHONPATH={repo_root / 'fastvideo-kernel'}:$PYTHONPATH"
        )
        if override:
            doc.finding(
                "kernel",
                f"${_ENV_LIBRARY} is set but the loader package fastvideo_kernel is not "
                f"importable, so nothing can load it: {fix}",
            )
        else:
            unavailable(f"the loader package fastvideo_kernel is not importable ({fix})")
    else:
        info = loader.info()
        if "error" not in info:
            for key, value in info.items():
                doc.line("kernel", f"{key}: {value}")
            from fastvideo.distributed.ulysses import hot  # loads torch: doctor runs in the user's environment

            why = hot.load(Path(str(info.get("path", ""))).parent)[1]  # beside the library the loader opens
            doc.line("kernel", f"hot-path extension: {why or 'built for this torch, loaded'}")
        elif override:
            doc.finding("kernel", f"${_ENV_LIBRARY} is set but unusable: {info['error']}")
        else:
            unavailable(info["error"])
    if dev and not override:
        doc.line("kernel", f"to use a development build: export {_ENV_LIBRARY}={dev[0]}")
    elif not dev and not override:
        doc.line("kernel", f"to make a development build: {_BUILD_HINT} (then set {_ENV_LIBRARY} to its path)")


def doctor(_: argparse.Namespace, repo_root: Path | None = None) -> int:
    import platform

    doc = _Doctor()
    try:
        switch: str | None = envs.get(ROUTE_VAR)
    except ValueError:
        switch = None  # reported by the environment check

    def versions() -> None:
        doc.line("python", f"{platform.python_version()}  torch {torch.__version__}")
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        # torch reports the NCCL it was built against; the one the kernel library runs is in its own lines below.
        doc.line("nccl", f"torch built against {'.'.join(map(str, nccl))}" if nccl else "n/a (no CUDA build or no GPU)")

    def host() -> None:
        from fastvideo.distributed.ulysses.construction import host_identity

        name, boot = host_identity()
        doc.line("host", f"{name} boot_id {boot}")

    def environment() -> None:
        registry = envs.registry()
        for name, var in registry.items():
            raw = os.environ.get(name)
            try:
                value = var.parse(raw)
            except ValueError as exc:
                doc.finding("env", str(exc))
                continue
            doc.line("env", f"{name}={value!r}  (default {var.default!r}{'' if raw else ', unset'})")
            if name == "FASTVIDEO_ULYSSES_A2A_CHECKED" and value == "auto":
                from fastvideo.distributed.settings import checked_mode

                try:
                    route = envs.get("FASTVIDEO_ULYSSES_A2A")
                except ValueError:
                    route = "off"  # reported on its own line
                level = torch.distributed.get_debug_level().name
                why = ("the route is auto (every call votes on every route)" if route == "auto" else
                       f"the route is off and torch's distributed debug level is {level} (on at DETAIL: "
                       "TORCH_DISTRIBUTED_DEBUG=DETAIL)")
                doc.line("env", f"  checked mode {'on' if checked_mode(value, route) else 'off'}: {why}")
        # A misspelt setting is otherwise ignored silently (build and test knobs share the prefix: only
        # names close to a real setting are pointed out).
        for name in sorted(n for n in os.environ if n.startswith("FASTVIDEO_") and n not in registry):
            close = difflib.get_close_matches(name, registry, n=1, cutoff=0.85)
            if close:
                doc.line("env", f"{name} is set but is not a setting: did you mean {close[0]}?")

    def kernel() -> None:
        _doctor_kernel(doc, repo_root if repo_root is not None else _repo_root(), switch)

    def gpus() -> None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        doc.line("gpus", str(count))
        for i in range(count):
            peers = [j for j in range(count) if j != i and torch.cuda.can_device_access_peer(i, j)]
            doc.line(f"gpu {i}", f"{torch.cuda.get_device_name(i)}; peer access to {peers}")

    for label, fn in (("versions", versions), ("host", host), ("env", environment), ("kernel", kernel), ("gpus", gpus)):
        doc.check(label, fn)
    if doc.findings:
        doc.line("result", f"{len(doc.findings)} problem(s) found:")
        for text in doc.findings:
            doc.line("result", f"  {text}")
        return 1
    doc.line("result", "no problems found")
    return 0


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastvideo.distributed.ulysses", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="print the plan or the decline reason for one call")
    ex.add_argument("--world-size", type=_world_size, required=True, help="SP size (a positive integer)")
    ex.add_argument("--shape", type=_shape, required=True, help="input shape B,S,H,D as passed to the op")
    ex.add_argument(
        "--dtype", type=_dtype, default="bfloat16", metavar="DTYPE", help=f"one of {', '.join(sorted(DTYPES))}"
    )
    ex.add_argument("--gpu", default=None,
                    help=f"GPU model, e.g. GB200, H200 (default: GPU 0's model; without a GPU, {ASSUMED_GPU}, "
                         "printed as an assumption)")
    ex.add_argument("--a2a", type=str.lower, choices=("off", "auto"), default=None,
                    help=f"the route switch (default: {ROUTE_VAR}, as the helper reads it)")
    ex.add_argument("--mode", type=int, choices=(0, 1), default=0, help="0: scatter heads (2,1); 1: the inverse (1,2)")
    ex.add_argument("--grad", action="store_true", help="the operand is grad-tracked (training)")
    ex.add_argument(
        "--long-training",
        type=str.lower,
        choices=("auto", "chunked"),
        default=None,
        help=f"default: {_LONG_VAR}",
    )
    ex.add_argument(
        "--window-bytes", type=_window_bytes, default=None, help=f"default: {_WINDOW_VAR} or {DEFAULT_WINDOW_BYTES}"
    )
    ex.add_argument("--seq-splits", type=_splits, default=None, metavar="S0,S1,...",
                    help="every rank's sequence rows (default: even)")
    ex.add_argument("--head-splits", type=_splits, default=None, metavar="H0,H1,...",
                    help="every rank's heads (default: even)")
    ex.add_argument("--rank", type=_rank, default=0, help="the rank whose input --shape is (with splits; default 0)")
    ex.add_argument("--overlap", type=int, default=None, metavar="N",
                    help="head groups of a DistributedAttention's pipeline (default: FASTVIDEO_ULYSSES_A2A_OVERLAP)")
    sub.add_parser("doctor", help="versions, kernel library, GPUs, host, env; exits 1 if it found a problem")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_negative_values_as_values(
        argv, ("--shape", "--world-size", "--window-bytes", "--seq-splits", "--head-splits", "--rank")))
    if args.command == "explain":
        args.a2a_source = "--a2a" if args.a2a is not None else "from the environment"
        for attr, flag, var in (
            ("a2a", "--a2a", ROUTE_VAR),
            ("long_training", "--long-training", _LONG_VAR),
            ("window_bytes", "--window-bytes", _WINDOW_VAR),
            ("overlap", "--overlap", "FASTVIDEO_ULYSSES_A2A_OVERLAP"),
        ):
            if getattr(args, attr) is None:  # the flag's default is the setting's value, refused as doctor does
                try:
                    setattr(args, attr, envs.get(var))
                except ValueError as exc:
                    ex.error(f"{exc} Fix the variable or pass {flag}.")
        if args.gpu is None:
            args.gpu, args.gpu_source = default_gpu()
        else:
            args.gpu_source = "--gpu"
        return explain(args)
    return doctor(args)


if __name__ == "__main__":
    sys.exit(main())
