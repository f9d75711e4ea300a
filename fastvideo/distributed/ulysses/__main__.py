"""Ask the Ulysses helper why, without running anything.

    python -m fastvideo.distributed.ulysses explain --world-size 4 (--shape 3,62500,56,128 | --geometry h3-250k) \\
        --dtype bfloat16 [--gpu GB200] [--a2a auto] [--mode 0] [--grad] [--long-training chunked] \\
        [--window-bytes N] \\
        [--seq-splits 62500,62500,62500,62499 --head-splits 14,14,14,14 --rank 0] [--overlap N]
    python -m fastvideo.distributed.ulysses doctor

``explain`` applies the switch (``FASTVIDEO_ULYSSES_A2A`` or ``--a2a``: ``off`` is the NCCL route) and the
same pure policy the helper applies on every call, and prints the plan (route, kind, CTAs, chunking, window
bytes) or the decline reason; no GPU or process group is needed (without a GPU and ``--gpu`` it plans for an
H200 and says so). ``--shape`` is one rank's input, as the op takes it; with ``--seq-splits`` /
``--head-splits`` (every rank's shares) rank ``--rank``'s. ``--geometry`` (a name of ``geometries.py``, or
B,S,H,D) is the global operand instead, ``--rank``'s share of it the input. ``--overlap N`` (N > 1): the input is
a ``DistributedAttention``'s packed q/k/v; it adds its head groups' plans.
Bad arguments are argparse errors (exit 2) that name the argument and the fix.
``doctor`` prints versions, the host identity, the environment variables, GPUs and peer access, the kernel
library (every place it looked), then the first thing that blocks the fused route, in the order a user must
fix them: 1 no CUDA GPU, 2 one GPU only, 3 no NVLink peer, 4 no kernel library, 5 a kernel library too old
for this package or built for another NCCL, 6 the setting; with advice only where this host can change it. It
reports problems (an invalid ``FASTVIDEO_*`` value, a ``FASTVIDEO_KERNEL_LIBRARY`` that cannot be loaded, no
usable kernel library while ``FASTVIDEO_ULYSSES_A2A=auto`` on GPUs that could run it, a check that raised) as
findings, goes on, and exits 1 at the end if there were any. It runs from a checkout or an installed wheel.
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
from fastvideo.distributed.settings import CHECKED, LONG_TRAINING, OVERLAP, ROUTE, WINDOW, checked_mode
from fastvideo.distributed.ulysses.explain import ASSUMED_GPU, DTYPES, default_gpu, explain, rank_shape
from fastvideo.distributed.ulysses.geometries import GEOMETRIES

_WINDOW = envs.registry()[WINDOW]  # --window-bytes parses and defaults by its rule
# Kept in step with fastvideo_kernel.LIBRARY_NAME / ENV_LIBRARY; doctor must work without that package.
_LIBRARY_NAME = "libfastvideo_ulysses_a2a.so"
_ENV_LIBRARY = "FASTVIDEO_KERNEL_LIBRARY"
# A development build against the NCCL the process runs, where the library reports it, else the pinned release.
_BUILD_HINT, _BUILD_NCCL = "bash scripts/build_kernel.sh {}.{}.{} build/kernel", (2, 28, 9)


# ----------------------------------------------------------------------------------- argument types


def _ints(text: str, expected: str) -> list[int]:
    """``text``'s comma-separated integers; where one is not an integer, an argparse error saying ``expected``."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}") from None


def _shape(text: str) -> tuple[int, int, int, int]:
    dims = tuple(_ints(text, "four positive integers B,S,H,D"))
    if len(dims) != 4:
        raise argparse.ArgumentTypeError(f"{text!r}: expected four positive integers B,S,H,D, got {len(dims)} value(s)")
    bad = [f"{name}={v}" for name, v in zip("BSHD", dims) if v < (name != "S")]  # S: an idle rank's share may be 0
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: shapes are positive; {', '.join(bad)} (use e.g. 3,62500,56,128)")
    return dims  # type: ignore[return-value]


def _geometry(text: str) -> tuple[str, tuple[int, int, int, int]]:
    if text in GEOMETRIES:
        return text, GEOMETRIES[text]
    if "," not in text:
        raise argparse.ArgumentTypeError(f"{text!r}: choose one of {', '.join(GEOMETRIES)} or give B,S_global,H,D")
    return text, _shape(text)


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
_groups = _bounded_int(0, "a number of head groups", "head groups are non-negative (0 or 1: no pipeline)")


def _window_bytes(text: str) -> int:
    """Parsed by the env variable's own rule, so the flag and the variable accept the same values."""
    try:
        return int(_WINDOW.parse(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected an integer number of bytes >= {_WINDOW.minimum:g} (the same rule as {_WINDOW.name}; "
            f"default {_WINDOW.default})"
        ) from None


def _splits(text: str) -> list[int]:
    """``5,3,4``: one non-negative int per SP rank (``validate_input`` checks the count against the SP size)."""
    table = _ints(text, "one non-negative integer per SP rank (5,3,4)")
    negative = [f"[{r}]={v}" for r, v in enumerate(table) if v < 0]
    if negative:
        raise argparse.ArgumentTypeError(f"{text!r}: shares are non-negative (0: an idle rank); {', '.join(negative)}")
    return table




def _negative_values_as_values(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``--shape -1,2,3,4`` -> ``--shape=-1,2,3,4``: argparse otherwise takes ``-1,...`` for an option and
    says only "expected one argument"; joined, the value reaches its type check and gets a real message."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in options and re.match(r"-\d", arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
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


def _checkout() -> Path | None:
    """The repository checkout this package runs from, or None where it is installed (a wheel in site-packages)."""
    root = Path(__file__).resolve().parents[3]  # <root>/fastvideo/distributed/ulysses/__main__.py
    return root if (root / "fastvideo-kernel" / "pyproject.toml").is_file() else None


_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # the driver's GPUs, which a CPU build of torch cannot see
_NONE_HERE = "nothing on this host can change that"
Blocker = tuple[int, str]  # doctor's blockers in the order a user must fix them (1-6) and what to say


def host_blocker(gpus: int, peers: bool) -> Blocker | None:
    """Blockers 1-3, the host's GPUs, with advice only where this host can change them; None: none."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")  # what may hide the driver's GPUs, in either case below
    if gpus == 0:
        listed = _NVIDIA_GPUS.is_dir() and any(_NVIDIA_GPUS.iterdir())
        fix = ("this torch is a CPU build and the driver lists GPUs: install a CUDA build of torch" if listed and
               torch.version.cuda is None else f"the driver lists GPUs: CUDA_VISIBLE_DEVICES={hidden!r} hides them"
               if listed and hidden is not None else _NONE_HERE)
        return 1, f"no CUDA GPU: the fused route runs on 2+ CUDA GPUs of one host; {fix}"
    if gpus == 1:
        fix = f"CUDA_VISIBLE_DEVICES={hidden} may hide the others" if hidden else _NONE_HERE
        return 2, f"one GPU only: the fused route needs 2+ (one SP rank each); {fix}"
    return None if peers else (3, f"no NVLink peer: no two of this host's GPUs have peer access; {_NONE_HERE}")


def kernel_places(checkout: Path | None, loader: ModuleType | None) -> list[tuple[str, Path | None, str]]:
    """Every place a kernel library is looked for, in the loader's order, then the development builds.

    Returns ``(label, path or None, state)``. ``fastvideo_kernel.load`` opens
    ``$FASTVIDEO_KERNEL_LIBRARY`` when it is set, else the installed wheel's library; a development
    build (``<checkout>/build/kernel*/``, what ``scripts/build_kernel.sh`` writes) is opened only when
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
    if checkout is None:
        return [*places, ("development build", None, "none: this package is installed, not run from a checkout")]
    builds = sorted((checkout / "build").glob(f"kernel*/{_LIBRARY_NAME}"))
    for build in builds:
        chosen = override and Path(override).resolve() == build.resolve()
        places.append(("development build", build, loaded if chosen else f"found; loaded only via ${_ENV_LIBRARY}"))
    if not builds:
        places.append(("development build", checkout / "build" / "kernel" / _LIBRARY_NAME, "missing"))
    return places


def _doctor_kernel(doc: _Doctor, checkout: Path | None, switch: str | None, fixable: bool) -> Blocker | None:
    """The kernel library's places and state, and blocker 4 (none loads) or 5 (an ABI this package cannot drive,
    or a build for another NCCL than the process runs). Under ``switch == "auto"`` on GPUs that could run the fused
    route (``fixable``) that is a problem (every call would decline ``transport_missing``), else a note; how to
    get a library is said only where it would help."""
    from fastvideo.distributed.ulysses.nccl_runtime import nccl_mismatch

    try:
        loader: ModuleType | None = _loader()
    except ImportError:
        loader = None
    override = os.environ.get(_ENV_LIBRARY, "")
    places = kernel_places(checkout, loader)
    doc.line("kernel", "looked for the library in (the loader's order, then development builds):")
    for label, path, state in places:
        doc.line("kernel", f"  {label}: {path if path is not None else '-'}  [{state}]")
    dev = [path for label, path, state in places if label == "development build" and state.startswith("found")]
    info = loader.info() if loader else {"error": "the loader package fastvideo_kernel is not importable"}
    if "error" not in info:
        for key, value in info.items():
            doc.line("kernel", f"{key}: {value}")
        from fastvideo.distributed.ulysses import hot  # loads torch: doctor runs in the user's environment

        why = hot.load(Path(str(info.get("path", ""))).parent)[1]  # beside the library the loader opens
        doc.line("kernel", f"hot-path extension: {why or 'built for this torch, loaded'}")
    why = info.get("problem") or info.get("nccl_runtime_error") or (
        nccl_mismatch(info["nccl_build"], info["nccl_runtime"]) if "nccl_runtime" in info else None)
    if "error" not in info and not why:
        return None
    if checkout is None:
        fix = "install the fastvideo-kernel wheel built from the repository's fastvideo-kernel/ for this torch"
    elif loader is None:
        fix = ("pip install --no-build-isolation --no-deps ./fastvideo-kernel, or put its source on the path: "
               f"export PYTHONPATH={checkout / 'fastvideo-kernel'}:$PYTHONPATH")
    elif dev and not override:
        fix = f"to use a development build: export {_ENV_LIBRARY}={dev[0]}"
    else:
        runs = loader.nccl_version_tuple(info["nccl_runtime"]) if "nccl_runtime" in info else _BUILD_NCCL
        fix = f"to make a development build: cd {checkout} && {_BUILD_HINT.format(*runs)}; set {_ENV_LIBRARY} to it"
    index, text = (4, f"no kernel library: {info['error']}") if "error" in info else \
        (5, f"kernel library unusable: {why}")
    text += f"; {fix}" if fixable else ""
    if override and index == 4:  # the user named a library: whatever the host, that is a mistake to fix
        doc.finding("kernel", f"${_ENV_LIBRARY} is set but unusable: {text}")
    elif switch == "auto" and fixable:
        doc.finding("kernel", f"{text}; while {ROUTE}=auto every call takes the NCCL route"  # the reason: index 4's
                              f"{' (declined: transport_missing)' if index == 4 else ''}")
    else:
        need = f"not needed while {ROUTE}=off" if switch == "off" else f"{ROUTE} is invalid (above)"
        doc.line("kernel", f"not available: {text} ({need if fixable else 'of no use on this host: fused, below'})")
    return index, text


def doctor(_: argparse.Namespace) -> int:
    """Local, blocking: prints what this host runs and the first thing that blocks the fused route; 1 on a problem."""
    import platform

    doc = _Doctor()
    raw = os.environ.get(ROUTE)
    try:
        switch: str | None = envs.get(ROUTE)
    except ValueError:
        switch = None  # invalid: reported as such by the environment check and the verdict, never read as off
    facts: dict[str, Blocker | None] = {}

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
            doc.line("env", f"{name}={value!r}  ({'default' if raw is None else f'default {var.default!r}'})")
            if name == CHECKED and value == "auto":
                level = torch.distributed.get_debug_level().name
                if switch is None:
                    doc.line("env", f"  checked mode unknown: {ROUTE} is invalid (above)")
                    continue
                why = ("the route is auto (every call votes on every route)" if switch == "auto" else
                       f"the route is off and torch's distributed debug level is {level} (on at DETAIL: "
                       "TORCH_DISTRIBUTED_DEBUG=DETAIL)")
                doc.line("env", f"  checked mode {'on' if checked_mode(value, switch) else 'off'}: {why}")
        # A misspelt setting is otherwise ignored silently (build and test knobs share the prefix: only
        # names close to a real setting are pointed out).
        for name in sorted(n for n in os.environ if n.startswith("FASTVIDEO_") and n not in registry):
            close = difflib.get_close_matches(name, registry, n=1, cutoff=0.85)
            if close:
                doc.line("env", f"{name} is set but is not a setting: did you mean {close[0]}?")

    def gpus() -> None:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        doc.line("gpus", str(count))
        any_peer = False
        for i in range(count):
            peers = [j for j in range(count) if j != i and torch.cuda.can_device_access_peer(i, j)]
            any_peer = any_peer or bool(peers)
            doc.line(f"gpu {i}", f"{torch.cuda.get_device_name(i)}; peer access to {peers}")
        facts["host"] = host_blocker(count, any_peer)

    def kernel() -> None:
        facts["kernel"] = _doctor_kernel(doc, _checkout(), switch, fixable="host" in facts and not facts["host"])

    def fused() -> None:
        if len(facts) < 2:
            doc.line("fused", "unknown: a check above raised")
            return
        setting = f"the setting: {ROUTE}="
        blocker = facts["host"] or facts["kernel"] or (None if switch == "auto" else (6, setting + (
            f"{raw!r} is invalid (off or auto): a job refuses to start" if switch is None else
            f"off{' (default)' if raw is None else ''}: every call takes the NCCL route; export {ROUTE}=auto")))
        doc.line("fused", f"blocked at {blocker[0]} of 6: {blocker[1]}" if blocker else "available: every requirement "
                          "is met (under auto each call takes it where the policy plans it and every rank agrees)")

    for label, fn in (("versions", versions), ("host", host), ("env", environment), ("gpus", gpus),
                      ("kernel", kernel), ("fused", fused)):
        doc.check(label, fn)
    doc.line("result", f"{len(doc.findings)} problem(s) found:" if doc.findings else "no problems found")
    for text in doc.findings:
        doc.line("result", f"  {text}")
    return 1 if doc.findings else 0


# ----------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastvideo.distributed.ulysses", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="print the plan or the decline reason for one call")
    ex.add_argument("--world-size", type=_world_size, required=True, help="SP size (a positive integer)")
    shape = ex.add_mutually_exclusive_group(required=True)
    shape.add_argument("--shape", type=_shape, help="one rank's input B,S_local,H,D (mode 0) as passed to the op")
    shape.add_argument("--geometry", type=_geometry, metavar="NAME|B,S,H,D",
                       help=f"the global operand: {', '.join(GEOMETRIES)} or B,S_global,H,D (--rank's share is "
                            "its input)")
    ex.add_argument("--dtype", type=str.lower, choices=sorted(DTYPES), default="bfloat16", metavar="DTYPE",
                    help=f"one of {', '.join(sorted(DTYPES))} (any case)")
    ex.add_argument("--gpu", help=f"GPU model, e.g. GB200, H200 (default: GPU 0's model; without a GPU, "
                                  f"{ASSUMED_GPU}, printed as an assumption)")
    ex.add_argument("--a2a", type=str.lower, choices=("off", "auto"),
                    help=f"the route switch (default: {ROUTE}, as the helper reads it)")
    ex.add_argument("--mode", type=int, choices=(0, 1), default=0, help="0: scatter heads (2,1); 1: the inverse (1,2)")
    ex.add_argument("--grad", action="store_true", help="the operand is grad-tracked (training)")
    ex.add_argument("--long-training", type=str.lower, choices=("auto", "chunked"), help=f"default: {LONG_TRAINING}")
    ex.add_argument("--window-bytes", type=_window_bytes, help=f"default: {_WINDOW.name} or {_WINDOW.default}")
    for flag, meta, what in (("--seq-splits", "S0,S1,...", "sequence rows"), ("--head-splits", "H0,H1,...", "heads")):
        ex.add_argument(flag, type=_splits, metavar=meta, help=f"every rank's {what} (default: even)")
    ex.add_argument("--rank", type=_rank, default=0, help="the rank whose input --shape is (with splits; default 0)")
    ex.add_argument("--overlap", type=_groups, metavar="N",
                    help=f"head groups of a DistributedAttention's pipeline (default: {OVERLAP})")
    sub.add_parser("doctor", help="versions, kernel library, GPUs, host, env; exits 1 if it found a problem")
    args = parser.parse_args(_negative_values_as_values(sys.argv[1:] if argv is None else argv, (
        "--shape", "--geometry", "--world-size", "--window-bytes", "--seq-splits", "--head-splits", "--rank",
        "--overlap")))
    if args.command == "explain":
        if args.rank >= args.world_size:
            ex.error(f"--rank: rank={args.rank} is outside the SP group of size {args.world_size} (0 <= rank < it)")
        if args.geometry is not None:
            table = args.seq_splits if args.mode == 0 else args.head_splits
            try:
                args.shape = rank_shape(args.geometry[1], args.mode, args.world_size, args.rank, table)
            except ValueError as exc:
                ex.error(f"--geometry {args.geometry[0]}: {exc}")
        args.sources = {}
        for flag, var in (("--a2a", ROUTE), ("--long-training", LONG_TRAINING), ("--window-bytes", _WINDOW.name),
                          ("--overlap", OVERLAP)):
            attr = flag[2:].replace("-", "_")
            args.sources[attr] = flag
            if getattr(args, attr) is None:  # the flag's default is the setting's value, refused as doctor does
                args.sources[attr] = "from the environment" if os.environ.get(var) else "default"
                try:
                    setattr(args, attr, envs.get(var))
                except ValueError as exc:
                    ex.error(f"{exc} Fix the variable or pass {flag}.")
        args.gpu, args.gpu_source = default_gpu() if args.gpu is None else (args.gpu, "--gpu")
        return explain(args)
    return doctor(args)


if __name__ == "__main__":
    sys.exit(main())
