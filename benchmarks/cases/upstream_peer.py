"""Upstream FastVideo 0.2.1's own fused Ulysses route as a contender of the a2a case, where it has been built.

Upstream ships the route as ``fastvideo/distributed/device_communicators/ulysses_a2a.py`` (its
``UlyssesA2AHelper``, ``maybe_create_helper``) driving the communication extension of ``fastvideo-kernel==0.3.5``
(``csrc/comm/ulysses_all_to_all.cu``, through ``fastvideo_kernel.comm_ops``). Neither is part of this
repository: ``scripts/build_upstream_comm.py`` builds the extension from the sdist and copies the two Python
files beside it, into a folder named by ``FASTVIDEO_UPSTREAM_PEER``. This module loads them from there under
private names, so they never collide with this package's modules of the same paths, with three import lines
pointed at what they stand for here (each substitution must match exactly, so another upstream version fails
loudly instead of running something else):

- ``from fastvideo_kernel._C import fastvideo_kernel_ops as _ops``: the built extension;
- ``from fastvideo_kernel import comm_ops`` (in the helper's methods): the loaded ``comm_ops``;
- ``from fastvideo.logger import init_logger``: ``logging.getLogger`` (upstream's logger module is not here).

Upstream reads ``envs.FASTVIDEO_ULYSSES_A2A`` (this package's envs gives the same value) and takes a PyNccl
communicator; here it gets the SP group's own NCCL communicator (``ProcessGroupNCCL._comm_ptr()``), the one the NCCL
route uses, so torch and the extension must run on one NCCL: with more than one libnccl in the process the peer
declines, naming them (``nccl_conflict``), before the communicator's first collective. One contender,
``upstream-0.2.1``: ``helper.try_all_to_all_4D(x, scatter, gather)``, upstream's per-call vote included. Where
upstream declines a geometry (it returns None), the row is skipped with its reason. At P = 1 upstream builds no
helper (its world sizes are 2, 4, 6, 8): the rows are skipped with that reason, and ``info()`` records the
extension's own smoke check (``is_available``, one window allocated and released).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness import header, timing

ENV = "FASTVIDEO_UPSTREAM_PEER"
ROUTES = ("upstream-0.2.1",)
EXT_IMPORT = "from fastvideo_kernel._C import fastvideo_kernel_ops as _ops"
COMM_OPS_IMPORT = "from fastvideo_kernel import comm_ops"
LOGGER_IMPORT = "from fastvideo.logger import init_logger"
_MODE_DIMS = {0: (2, 1), 1: (1, 2)}


def _substituted(path: Path, substitutions: dict[str, tuple[str, int | None]]) -> str:
    """``path``'s source with each ``old -> (new, count)`` applied; ``count`` None: at least once."""
    source = path.read_text()
    for old, (new, count) in substitutions.items():
        found = source.count(old)
        if found == 0 or (count is not None and found != count):
            raise RuntimeError(f"{path}: {old!r} found {found} times, expected {count or 'at least 1'}: not the "
                               "upstream 0.2.1 / fastvideo-kernel 0.3.5 file this loader knows")
        source = source.replace(old, new)
    return source


def _module(name: str, path: Path, source: str, namespace: dict) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(path)
    module.__dict__.update(namespace)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    exec(compile(source, str(path), "exec"), module.__dict__)  # upstream's file, loaded on purpose
    return module


def load(folder: Path) -> tuple[types.ModuleType, types.ModuleType, Path]:
    """``(ulysses_a2a, comm_ops, extension path)`` from a ``build_upstream_comm.py`` output folder. Local."""
    ext_paths = sorted((folder / "build").glob("fastvideo_kernel_ops*.so"))
    if not ext_paths:
        raise FileNotFoundError(f"no fastvideo_kernel_ops*.so under {folder / 'build'} (run "
                                "scripts/build_upstream_comm.py --out that folder)")
    loader = importlib.machinery.ExtensionFileLoader("fastvideo_kernel_ops", str(ext_paths[0]))
    spec = importlib.util.spec_from_file_location("fastvideo_kernel_ops", ext_paths[0], loader=loader)
    assert spec is not None
    ext = importlib.util.module_from_spec(spec)
    loader.exec_module(ext)
    comm_path = folder / "src" / "comm_ops.py"
    comm_ops = _module("_upstream_fastvideo_kernel_comm_ops", comm_path,
                       _substituted(comm_path, {EXT_IMPORT: ("_ops = _UPSTREAM_EXTENSION", 1)}),
                       {"_UPSTREAM_EXTENSION": ext})
    a2a_path = folder / "src" / "ulysses_a2a.py"
    a2a = _module("_upstream_fastvideo_ulysses_a2a", a2a_path,
                  _substituted(a2a_path, {COMM_OPS_IMPORT: ("comm_ops = _UPSTREAM_COMM_OPS", None),
                                          LOGGER_IMPORT: ("from logging import getLogger as init_logger", 1)}),
                  {"_UPSTREAM_COMM_OPS": comm_ops})
    return a2a, comm_ops, ext_paths[0]


class _GroupComm:
    """What upstream's helper reads of its PyNccl communicator: ``comm`` (the ncclComm_t) and ``disabled``."""

    def __init__(self, comm_ptr: int) -> None:
        self.comm, self.disabled = comm_ptr, False


def _nccl_comm_ptr(group, device: torch.device) -> int:
    """The ncclComm_t of ``group`` (a NCCL process group), created eagerly by one all-reduce."""
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1, device=device), group=group)
    return int(group._get_backend(device)._comm_ptr())


def _smoke(comm_ops, device: torch.device) -> dict:
    """The extension on this GPU without peers: available, one window allocated and released."""
    out: dict = {"is_available": bool(comm_ops.is_available())}
    try:
        handle = comm_ops.allocate(1 << 20, 0, 2, device.index or 0)
        comm_ops.dispose(handle)
        out["allocate_dispose"] = "ok (1 MiB window for a 2-rank group, local)"
    except Exception as exc:  # noqa: BLE001 - recorded: it is what the smoke check is for
        out["allocate_dispose"] = f"{type(exc).__name__}: {exc}"
    return out


def nccl_conflict(torch_built: str, libraries: dict[str, str]) -> str:
    """Why this process cannot hand torch's communicator to upstream's extension, or ``""``. Pure.

    Each libnccl keeps its own globals and its own ``ncclComm`` layout: with two loaded, torch's communicator was
    made by one while the extension's calls may reach the other, which is undefined behaviour, not a slow path.
    """
    if len(libraries) <= 1:
        return ""
    listing = ", ".join(f"{path} ({version})" for path, version in sorted(libraries.items()))
    return (f"{len(libraries)} NCCL libraries loaded ({listing}; torch built against {torch_built}): torch's "
            "communicator and upstream's extension must share one (scripts/gpu_upstream_peer.sh loads the same NCCL "
            "for both)")


def nccl_check() -> tuple[dict, str]:
    """``({"torch_built_against": ..., "loaded": {path: version}}, why)``: the NCCL libraries in this process and
    ``nccl_conflict``'s verdict on them. Local; CUDA torch."""
    libraries = header.nccl_libraries()
    torch_built = ".".join(map(str, torch.cuda.nccl.version()))
    return {"torch_built_against": torch_built, "loaded": libraries}, nccl_conflict(torch_built, libraries)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class UpstreamPeer:
    """Upstream's helper over the SP group. Build it with ``UpstreamPeer.open`` (collective)."""

    def __init__(self, module, helper, info: dict) -> None:
        self.module, self.helper, self._info = module, helper, info

    @classmethod
    def open(cls, device: torch.device) -> tuple[UpstreamPeer | None, str, dict]:
        """``(peer, "", info)`` on every rank, or ``(None, why, info)`` on every rank. Collective."""
        from fastvideo import envs
        from fastvideo.distributed.parallel_state import get_sp_group

        info: dict = {"package": "fastvideo 0.2.1 ulysses_a2a.py + fastvideo-kernel 0.3.5 comm extension"}
        why, module, comm_ops = "", None, None
        folder = os.environ.get(ENV, "")
        if not folder:
            why = f"not built ({ENV} unset: scripts/build_upstream_comm.py builds it)"
        elif device.type != "cuda":
            why = "needs CUDA (upstream's route is NCCL's device API)"
        else:
            try:
                module, comm_ops, ext = load(Path(folder))
                info.update(path=folder, extension={"path": str(ext), "sha256": _sha256(ext)},
                            smoke=_smoke(comm_ops, device))
            except Exception as exc:  # noqa: BLE001 - a skip with the reason, never an import error
                why = f"load failed: {type(exc).__name__}: {exc}"
        whys = timing.gather(why)
        if any(whys):
            return None, _joined(whys), info
        sp = get_sp_group()
        if sp.world_size > 1:
            # Agreed before the communicator's first collective, so that no rank enters it alone.
            info["nccl"], why = nccl_check()
            whys = timing.gather(why)
            if any(whys):
                return None, _joined(whys), info
        helper, why = None, ""
        try:
            comm = _GroupComm(_nccl_comm_ptr(sp.device_group, device)) if sp.world_size > 1 else None
            with envs.override(FASTVIDEO_ULYSSES_A2A="auto"):  # upstream reads its switch at construction
                helper = module.maybe_create_helper(sp.cpu_group, sp.device_group, sp.world_size, device, comm)
            if helper is None:
                why = (f"upstream's maybe_create_helper built no helper (world size {sp.world_size}; upstream "
                       f"supports {module.SUPPORTED_WORLD_SIZES}, NVLink peers and the extension)")
        except Exception as exc:  # noqa: BLE001 - agreed below
            why = f"maybe_create_helper failed: {type(exc).__name__}: {exc}"
        whys = timing.gather(why)
        if any(whys):
            return None, _joined(whys), info
        return cls(module, helper, info), "", info

    def contender(self, route: str, x: torch.Tensor, mode: int) -> tuple[Callable[[], torch.Tensor] | None, str]:
        """``(call, "")``, or ``(None, why)`` where upstream declines this operand (its first call returns None,
        on every rank alike: upstream votes each call)."""
        scatter, gather = _MODE_DIMS[mode]
        if self.helper.try_all_to_all_4D(x, scatter, gather) is not None:
            return (lambda: self.helper.try_all_to_all_4D(x, scatter, gather)), ""
        reason = getattr(self.helper, "_disabled_reason", None) or "declined this operand (NCCL fallback)"
        return None, f"upstream 0.2.1: {reason}"

    def info(self) -> dict:
        return self._info

    def close(self) -> None:
        """Release upstream's window. Collective."""
        self.helper.close()


def _joined(whys: list[str]) -> str:
    if len(set(whys)) == 1:
        return f"{whys[0]} (every rank)"
    return "; ".join(f"rank {r}: {w}" for r, w in enumerate(whys) if w)
