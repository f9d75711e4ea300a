"""The route a training step's all-to-alls took, read from the Ulysses helper the public op called.

    probe = RouteProbe(sp_size)
    probe.mark()                 # before the step
    ...                          # forward and backward (every all-to-all goes through the public op)
    route = probe.taken()        # {"kind", "calls", "fused", "reasons", "source"}

``kind`` is ``fused`` (every call on the fused transport), ``nccl`` (every call on the NCCL route's code path,
which runs the process group's all-to-all: NCCL's, or gloo's on a CPU run), ``mixed``, or ``identity`` (SP1). The
counts are the helper's own (``UlyssesHelper.stats()``: calls, fused runs, declines by reason), taken as the
difference across the step. With ``FASTVIDEO_ULYSSES_A2A=off`` (and checked mode off) the op resolves to the NCCL
route with no helper at all; the probe reads that resolved route, and says that no helper counted the calls.
Local: no collective.
"""

from __future__ import annotations

from typing import Any

from fastvideo.distributed.ulysses import registry

__all__ = ["RouteProbe"]

NO_HELPER = "switch off: the op resolved to the NCCL route, no helper counts its calls"


class RouteProbe:
    """Counts one step's all-to-alls by route from the helper of the op's resolved route (rank-local)."""

    def __init__(self, sp_size: int) -> None:
        self.sp_size = sp_size
        self._before: tuple[int, int, dict[str, int]] | None = None

    def _counts(self) -> tuple[int, int, dict[str, int]] | None:
        _, helper = registry.resolved()
        if helper is None:
            return None
        stats = helper.stats()  # type: ignore[union-attr]
        return stats["calls"], stats["fused"], dict(stats["declines"])

    def mark(self) -> None:
        """Remember the helper's counts before a step."""
        self._before = self._counts()

    def taken(self) -> dict[str, Any]:
        """The route the calls since ``mark()`` took (call after the step's backward)."""
        if self.sp_size == 1:
            return {"kind": "identity", "calls": None, "fused": None, "reasons": [], "source": "SP1"}
        resolved, helper = registry.resolved()
        if not resolved:
            raise RuntimeError("RouteProbe.taken: no all-to-all ran through the public op since the SP group "
                               "was set up (is the model's attention the sequence-parallel one?)")
        if helper is None:
            return {"kind": "nccl", "calls": None, "fused": None, "reasons": [], "source": NO_HELPER}
        after = self._counts()
        assert after is not None
        calls0, fused0, declines0 = self._before or (0, 0, {})
        calls, fused = after[0] - calls0, after[1] - fused0
        reasons = sorted(r for r, n in after[2].items() if n > declines0.get(r, 0))
        if calls == 0:
            raise RuntimeError("RouteProbe.taken: the helper counted no call in this step")
        kind = "fused" if fused == calls else ("nccl" if fused == 0 else "mixed")
        return {"kind": kind, "calls": calls, "fused": fused, "reasons": reasons, "source": "helper stats"}
