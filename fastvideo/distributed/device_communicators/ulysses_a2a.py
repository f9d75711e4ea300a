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

This is the one module of the FastVideo surface that imports the op's helper registry (``ulysses/registry.py``:
``get_default_helper`` and the functions beside it). Importing it registers ``ulysses_a2a``'s provider
with ``base_device_communicator`` (which sits below the helper and cannot import it).
"""

from __future__ import annotations

from typing import Any

from fastvideo import envs
from fastvideo.distributed import parallel_state
from fastvideo.distributed.device_communicators import base_device_communicator as _base
from fastvideo.distributed.ulysses.helper import UlyssesHelper
from fastvideo.distributed.ulysses.registry import (
    current_default_helper,
    destroy_default_helper,
    get_default_helper,
    install_default_helper,
)

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
    """FALLBACK until ``UlyssesHelper.close`` exists: the helper with upstream's ``close()`` (= ``destroy()``,
    collective) added; every other attribute, ``try_all_to_all_4D`` included, is the helper's own.
    ``with_upstream_methods`` stops wrapping as soon as the helper has both of upstream's methods."""

    def __init__(self, helper: UlyssesHelper) -> None:
        self.helper = helper

    def __getattr__(self, name: str) -> Any:
        return getattr(self.helper, name)

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
