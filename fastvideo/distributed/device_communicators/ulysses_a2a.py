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
once the SP groups exist (what the op does), from this rank's environment before that.

This is the one module that imports the op's helper registry (``get_default_helper`` and the functions beside
it), so that where the registry lives is a one-line change. Importing it registers ``ulysses_a2a``'s provider
with ``base_device_communicator`` (which sits below the helper and cannot import it).
"""

from __future__ import annotations

from typing import Any

import torch

from fastvideo import envs
from fastvideo.distributed import parallel_state
from fastvideo.distributed.device_communicators import base_device_communicator as _base
from fastvideo.distributed.ulysses.helper import (
    UlyssesHelper,
    current_default_helper,
    destroy_default_helper,
    get_default_helper,
    install_default_helper,
)
from fastvideo.distributed.ulysses.layout import mode_for_dims, validate_input

__all__ = [
    "UlyssesHelper",
    "current_default_helper",
    "destroy_default_helper",
    "get_default_helper",
    "install_default_helper",
    "is_enabled",
    "with_upstream_methods",
]

ROUTE = "FASTVIDEO_ULYSSES_A2A"


def is_enabled() -> bool:
    """Whether the fused route is opted in (``FASTVIDEO_ULYSSES_A2A=auto``). Local, never collective: the SP
    group's agreed value once the SP groups exist, this rank's environment before."""
    if parallel_state.model_parallel_is_initialized():
        agreed = parallel_state.get_sp_group().settings
        if agreed is not None:
            return agreed[ROUTE] == "auto"
    return envs.get(ROUTE) == "auto"


class _UpstreamMethods:
    """FALLBACK until ``UlyssesHelper.try_all_to_all_4D`` and ``UlyssesHelper.close`` exist: the helper with
    upstream's two methods added; every other attribute is the helper's. ``with_upstream_methods`` stops
    wrapping as soon as the helper has both."""

    def __init__(self, helper: UlyssesHelper) -> None:
        self.helper = helper

    def __getattr__(self, name: str) -> Any:
        return getattr(self.helper, name)

    def try_all_to_all_4D(self, x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1) -> torch.Tensor | None:
        """The fused all-to-all, or None when it did not run (the caller then takes the NCCL route). Collective;
        differentiable. A helper that declined at construction returns None at once (that decline was agreed);
        otherwise the call votes, and where every rank declined it, the helper has already run the NCCL route
        internally: this fallback drops that result (one NCCL all-to-all more than the helper's own method)."""
        helper = self.helper
        mode = mode_for_dims(scatter_dim, gather_dim)
        validate_input(x, mode, helper.world_size)
        if not helper.fused_available:
            return None
        out = helper.all_to_all(x, mode)
        return out if helper.history[-1].route == "fused" else None

    def close(self) -> None:
        """Collective over the SP group: destroy the helper (a second call is a no-op)."""
        self.helper.destroy()


def with_upstream_methods(helper: UlyssesHelper) -> Any:
    """``helper`` itself once it has ``try_all_to_all_4D`` and ``close``; until then the marked fallback wrapper."""
    if callable(getattr(helper, "try_all_to_all_4D", None)) and callable(getattr(helper, "close", None)):
        return helper
    return _UpstreamMethods(helper)


def _provider(comm: _base.DeviceCommunicatorBase) -> Any:
    """What ``comm.ulysses_a2a`` is (see the module docstring)."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    sp = parallel_state.get_sp_group()
    if comm.device_group is not sp.device_group or sp.world_size == 1 or not is_enabled():
        return None
    return with_upstream_methods(get_default_helper())


_base.register_ulysses_a2a_provider(_provider)
