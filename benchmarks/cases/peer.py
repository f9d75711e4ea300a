"""The peer library, fast-ulysses 0.2.1, as contenders of the a2a case, where it is installed.

It is never a dependency and none of its code is here: the module is imported by name at run time, and where
it is absent or fails to import or to construct (on any rank), its rows are skipped with the reason. The API
used is the one its README documents: ``UlyssesGroup(process_group=None)``, ``group.all_to_all_4d(x, mode=0|1,
out=None)`` (mode 0 scatters heads and gathers the sequence, as ours), ``group.empty_output(x, mode=...)`` (a
buffer for ``out=``, which removes its copy-out) and ``group.destroy()`` (collective).

Two contenders: ``fast-ulysses`` (an output the caller owns, allocated per call) and ``fast-ulysses-out`` (into
one ``empty_output`` buffer per row, reused by every call of the row).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.harness import timing
from benchmarks.harness.header import sha256_file

MODULE = "fast_ulysses"
DISTRIBUTION = "fast-ulysses"
ROUTES = ("fast-ulysses", "fast-ulysses-out")


def _joined(whys: list[str]) -> str:
    """One reason where every rank gave the same, else each rank's."""
    if len(set(whys)) == 1:
        return f"{whys[0]} (every rank)"
    return "; ".join(f"rank {r}: {w}" for r, w in enumerate(whys) if w)


class Peer:
    """One ``UlyssesGroup`` over the world for the whole run. Build it with ``Peer.open`` (collective)."""

    def __init__(self, module, group) -> None:
        self.module, self.group = module, group

    @classmethod
    def open(cls) -> tuple[Peer | None, str]:
        """Every rank gets a ``Peer``, or every rank ``(None, why)``. Collective: the import is agreed first (a
        rank that cannot import must not leave its peers inside the group's construction), then the group is
        built and its construction agreed."""
        try:
            module, why = importlib.import_module(MODULE), ""
        except Exception as exc:  # noqa: BLE001 - absent or broken: a skip, never an import error
            module, why = None, ("not installed" if isinstance(exc, ModuleNotFoundError) and exc.name == MODULE
                                 else f"import failed: {type(exc).__name__}: {exc}")
        whys = timing.gather(why)
        if any(whys):
            return None, _joined(whys)
        group, why = None, ""
        try:
            group = module.UlyssesGroup(process_group=None)
        except Exception as exc:  # noqa: BLE001 - reported and agreed below
            why = f"UlyssesGroup(process_group=None) failed: {type(exc).__name__}: {exc}"
        whys = timing.gather(why)
        if any(whys):
            return None, _joined(whys)
        return cls(module, group), ""

    def contender(self, route: str, x: torch.Tensor, mode: int) -> Callable[[], torch.Tensor]:
        """One call of ``route`` on ``x`` (the ``out=`` buffer, for ``fast-ulysses-out``, made here, once)."""
        if route == "fast-ulysses":
            return lambda: self.group.all_to_all_4d(x, mode=mode)
        out = self.group.empty_output(x, mode=mode)

        def call() -> torch.Tensor:
            self.group.all_to_all_4d(x, mode=mode, out=out)
            return out

        return call

    def info(self) -> dict:
        """Version, package path and every shared object it ships with its SHA-256: the binary that ran."""
        try:
            version = importlib.metadata.version(DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            version = getattr(self.module, "__version__", None)
        where = Path(self.module.__file__).resolve().parent
        libs = [{"path": str(p), "sha256": sha256_file(p)} for p in sorted(where.rglob("*.so"))]
        return {"package": DISTRIBUTION, "version": version, "path": str(where), "libraries": libs}

    def close(self) -> None:
        """Release its windows. Collective."""
        self.group.destroy()
