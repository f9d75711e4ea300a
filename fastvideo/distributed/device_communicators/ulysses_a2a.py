"""The SP group's Ulysses helper as upstream FastVideo exposes it: ``device_communicator.ulysses_a2a``.

    helper = get_sp_group().device_communicator.ulysses_a2a   # the helper, or None
    y = helper.try_all_to_all_4D(x, 2, 1)                     # the fused result, or None: take the NCCL route
    helper.close()                                            # collective: destroys the helper

``ulysses_a2a`` is the public op's own default helper (the one ``sequence_model_parallel_all_to_all_4D`` votes
through under ``auto``), so what a test learns from it is what the op does. It is None where no helper applies:
the agreed route is ``off``, the SP size is 1, or the communicator is not the SP group's. Upstream builds a
helper object without any collective and registers its window on first use; here the helper's construction is
itself collective (it agrees capability and settings), so the first ``ulysses_a2a`` under ``auto`` is collective
on the SP group, like the op's first call. Private attributes of upstream's helper (``_handle``,
``_disabled_reason``) are not kept: ``stats()`` says whether construction succeeded and what each call ran.

``is_enabled()`` is upstream's switch: whether the route is ``auto``, read from the SP group's agreed settings
once the SP groups exist (what the op does), from this rank's environment before that (``registry.enabled``).

Upstream's module-level API maps onto the same helper: ``maybe_create_helper(cpu_group, device_group, world_size,
device, pynccl_comm)`` (what upstream's ``CudaCommunicator`` assigns to ``ulysses_a2a``) returns a
``UlyssesA2AHelper`` bound to the op's helper when those are the SP group's groups on CUDA under ``auto`` and its
construction succeeded, None otherwise; ``SUPPORTED_WORLD_SIZES`` and ``MAX_WINDOW_BYTES`` say what this
package's route takes (``docs/fastvideo_migration.md``).

What ``device_communicator.ulysses_a2a`` returns is ``ulysses/registry.py``'s to say (``registry.install``, called
by upstream's init entry points and at the op's first call); importing this module has no side effect.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from fastvideo.distributed.all_to_all import mode_for_dims
from fastvideo.distributed.ulysses import ops as _ops
from fastvideo.distributed.ulysses.helper import UlyssesHelper
from fastvideo.distributed.ulysses.policy import MAX_WORLD_SIZE, MIN_WORLD_SIZE
from fastvideo.distributed.ulysses.registry import (
    current_default_helper,
    destroy_default_helper,
    enabled,
    get_default_helper,
    helper_for,
    install_default_helper,
)

__all__ = [
    "MAX_WINDOW_BYTES",
    "SUPPORTED_WORLD_SIZES",
    "UlyssesA2AHelper",
    "UlyssesHelper",
    "current_default_helper",
    "destroy_default_helper",
    "get_default_helper",
    "install_default_helper",
    "is_enabled",
    "maybe_create_helper",
    "with_upstream_methods",
]

logger = logging.getLogger(__name__)

# The SP sizes the fused route serves (upstream's kernel: 2, 4, 6, 8); others decline ``world_size`` to NCCL.
SUPPORTED_WORLD_SIZES = tuple(range(MIN_WORLD_SIZE, MAX_WORLD_SIZE + 1))
# The registered window's default size per rank (``FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES``, agreed at construction).
# Upstream grows its window on demand up to this cap; here the window is fixed, and an operand larger than it is
# chunked through it or declines ``window`` to NCCL. Assigning this constant changes nothing: set the variable.
MAX_WINDOW_BYTES = 1 << 30


# Upstream's name for ``registry.enabled``: whether the fused route is opted in (``FASTVIDEO_ULYSSES_A2A=auto``).
# Local, never collective: the SP group's agreed value once the SP groups exist, this rank's environment before.
is_enabled = enabled


def with_upstream_methods(helper: UlyssesHelper) -> UlyssesHelper:
    """``helper`` itself: it has upstream's ``try_all_to_all_4D`` and ``close``."""
    return helper


class UlyssesA2AHelper:
    """Upstream's helper API over this package's: ``try_all_to_all_4D``, ``close`` and ``run_armed`` for one group.

    Constructing it is local and builds nothing (upstream's is too). Its calls use the public op's own helper
    (``get_default_helper()``, built collectively at first use) when ``cpu_group`` / ``device_group`` are the SP
    group's and the agreed route is ``auto``; for any other group they decline (None: the caller's NCCL route).
    Other attributes (``stats()``, ``history``) are the bound helper's once it is bound.
    """

    def __init__(self, cpu_group: ProcessGroup, device_group: ProcessGroup, world_size: int, device: torch.device,
                 pynccl_comm: Any) -> None:
        self.cpu_group = cpu_group
        self.device_group = device_group
        self.world_size = world_size
        self.device = device
        self.pynccl_comm = pynccl_comm  # upstream's NCCL communicator, unused: the SP group's own carries the route
        self._helper: UlyssesHelper | None = None

    def __getattr__(self, name: str) -> Any:
        helper = self.__dict__.get("_helper")
        if helper is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}"
                                 + ("" if helper is not None else " (no helper is bound to it yet)"))
        return getattr(helper, name)

    def _bound(self) -> UlyssesHelper | None:
        """The op's helper when this is the SP group under ``auto`` (collective the first time: it may build it);
        None otherwise (local, and the same on every rank: the groups and the agreed route are)."""
        helper = helper_for(self)
        if helper is not None:
            self._helper = helper
        return helper

    def try_all_to_all_4D(self, x: torch.Tensor, scatter_dim: int, gather_dim: int, *,
                          tag: str | None = None) -> torch.Tensor | None:
        """The fused route or None (upstream's contract: the caller then runs the NCCL route). Collective over the
        SP group, host-blocking (one vote), as the op's helper's. Under ``torch.compile`` it declines at once, before
        any distributed state, as upstream's does. A grad-tracked ``x`` goes through the public op's autograd with
        this helper (differentiable, as upstream's is; the op takes the NCCL route itself if the ranks decline)."""
        helper = None if torch.compiler.is_compiling() else self._bound()
        if helper is None:
            return None
        if torch.is_grad_enabled() and x.requires_grad:
            return _ops.call(x, mode_for_dims(scatter_dim, gather_dim), helper.id, tag=tag)
        return helper.try_all_to_all_4D(x, scatter_dim, gather_dim, tag=tag)

    def run_armed(self, x: torch.Tensor, mode: int) -> torch.Tensor:
        """The fused route for ``mode`` (0: scatter heads, 1: gather heads), or RuntimeError if it did not run.
        Collective; still votes (every call does here)."""
        if mode not in (0, 1):
            raise ValueError(f"run_armed: mode={mode!r} must be 0 (scatter_dim=2, gather_dim=1) or 1 (1, 2).")
        out = self.try_all_to_all_4D(x, *((2, 1) if mode == 0 else (1, 2)))
        if out is None:
            raise RuntimeError("run_armed: the fused route did not run (no helper for this group, or every rank "
                               "declined; see stats()['declines']).")
        return out

    def close(self) -> bool:
        """Collective over the SP group when a helper is bound: destroy it (the op builds a new one at its next
        ``auto`` call). Returns True (teardown here is collective or raises on every rank)."""
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.destroy()
        return True


def maybe_create_helper(cpu_group: ProcessGroup | None, device_group: ProcessGroup | None, world_size: int,
                        device: torch.device | None, pynccl_comm: Any) -> UlyssesA2AHelper | None:
    """Upstream's factory: a ``UlyssesA2AHelper`` when every rank can use the fused route, None otherwise. None at
    once (local, the same on every rank) for a group of one, missing groups, a device that is not CUDA, no default
    process group, a group that is not the SP group, or a route that is not ``auto``; else collective over the SP
    group the first time (it builds the op's helper) and None when that helper's construction declined."""
    if (world_size <= 1 or cpu_group is None or device_group is None or device is None or device.type != "cuda"
            or not dist.is_initialized()):
        return None
    candidate = UlyssesA2AHelper(cpu_group, device_group, world_size, device, pynccl_comm)
    helper = candidate._bound()
    if helper is None or not helper.fused_available:
        if helper is not None:
            logger.info("Ulysses fused all-to-all unavailable: %s", helper.stats().get("construction_detail", ""))
        return None
    return candidate
