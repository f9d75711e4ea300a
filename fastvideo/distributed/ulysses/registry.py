"""Which route a call takes (``route``, the one function that selects it), the default helpers, and what the SP
communicator's ``ulysses_a2a`` is.

The agreed route follows the settings the SP group agreed (``initialize_sequence_parallel``, or a later
``agree_ulysses_settings()`` on every rank), never the environment read per call:

========================================  =================================================================
agreed settings                           route
========================================  =================================================================
``FASTVIDEO_ULYSSES_A2A=off``             the NCCL route, no helper, no vote (``route()`` is None)
``off`` in checked mode                   ``UlyssesHelper(disabled=True)``: every call votes, never fused
``auto``                                  the default helper, built collectively at the first call
========================================  =================================================================

Resolved once and kept. Helpers are built under ``torch.inference_mode(False)`` (the helper sees to it), so the
first call's grad mode never leaks into reusable state. The SP group tears the route and its helpers down
(collectively) before its process groups, and when a re-agreement changes the settings.
"""

from __future__ import annotations

from typing import Any

from fastvideo import envs
from fastvideo.distributed import settings as _settings
from fastvideo.distributed.communicator import DeviceCommunicatorBase, register_ulysses_a2a_provider
from fastvideo.distributed.sp_groups import get_sp_group, model_parallel_is_initialized
from fastvideo.distributed.ulysses.helper import UlyssesHelper, live_helper

_UNRESOLVED = object()
_agreed: Any = _UNRESOLVED  # None (the NCCL route) or the helper the agreed settings select, once resolved
# The helpers the routes vote through: ``default`` (``auto``) and ``checked_off`` (``off`` in checked mode).
_helpers: dict[str, UlyssesHelper | None] = {"default": None, "checked_off": None}


def route(route_id: int = 0, backward: bool = False) -> UlyssesHelper | None:
    """The helper a call votes through, or None for the NCCL route over the SP group without a vote: ``route_id``
    > 0 is that helper (``HelperDisposedError`` once it is gone); 0 is the agreed route for a forward (collective
    the first time and after its helper was destroyed: it may build one, then a lookup) and no helper for a
    backward (its forward ran without one)."""
    if route_id:
        return live_helper(route_id)
    if backward:
        return None
    helper = _agreed
    if helper is _UNRESOLVED:  # a destroyed route's helper resets it (``on_destroy``)
        helper = _resolve()
    return helper


def resolved() -> tuple[bool, UlyssesHelper | None]:
    """Local, never builds anything: ``(True, the helper or None)`` once the agreed route is resolved (the first
    call does it), else ``(False, None)``."""
    return (False, None) if _agreed is _UNRESOLVED else (True, _agreed)


def enabled() -> bool:
    """Whether the fused route is opted in (``FASTVIDEO_ULYSSES_A2A=auto``). Local, never collective: the SP
    group's agreed value once the SP groups exist, this rank's environment before."""
    if model_parallel_is_initialized():
        agreed = get_sp_group().settings
        if agreed is not None:
            return agreed[_settings.ROUTE] == "auto"
    return envs.get(_settings.ROUTE) == "auto"


def install() -> None:
    """Make ``device_communicator.ulysses_a2a`` answer with the SP group's helper (the op's own default helper
    under ``auto``, else None). Local, idempotent; upstream's init entry points and the route's resolution call it."""
    register_ulysses_a2a_provider(helper_for)


def helper_for(groups: DeviceCommunicatorBase | Any) -> UlyssesHelper | None:
    """The op's default helper where ``groups`` (a communicator, or anything with its ``cpu_group`` and
    ``device_group``) is the SP group's and the agreed route is ``auto`` (collective the first time: it may build
    it); None otherwise (local, and the same on every rank: the groups and the agreed route are)."""
    if not model_parallel_is_initialized():
        return None
    sp = get_sp_group()
    ours = groups.cpu_group is sp.cpu_group or groups.device_group is sp.device_group
    if not ours or sp.world_size == 1 or not enabled():
        return None
    return get_default_helper()


def _resolve() -> UlyssesHelper | None:
    """Resolve the agreed route from the agreed settings. Collective: may build a helper."""
    install()
    sp = get_sp_group()
    sp.add_teardown("ulysses.route", reset)
    sp.on_settings_change("ulysses.route", _settings_changed)
    if enabled():
        helper: UlyssesHelper | None = get_default_helper()
    elif sp.settings is not None and sp.settings[_settings.CHECKED]:
        helper = get_checked_off_helper()
    else:
        helper = None
    use_route(helper)
    return helper


def _settings_changed(previous: _settings.AgreedSettings, agreed: _settings.AgreedSettings) -> None:
    """A re-agreement changed the settings (on every rank alike): resolve the route again; the helpers follow the
    new values, and one that cannot (its window changed) is destroyed collectively and rebuilt at its next use."""
    for kind, helper in list(_helpers.items()):
        if helper is not None and helper.alive and not helper.follow(agreed):
            _destroy(kind)
    reset()


def reset() -> None:
    """Forget the resolved route (local): the next call resolves it from the agreed settings."""
    global _agreed
    _agreed = _UNRESOLVED


def _get(kind: str) -> UlyssesHelper:
    """The ``kind`` helper (``_HELPERS``), built (collectively) on first use or after a destroy."""
    helper = _helpers[kind]
    if helper is None or not helper.alive or helper.sp is not get_sp_group():  # none for the current SP group
        _keep(kind, UlyssesHelper(get_sp_group(), disabled=kind == "checked_off"))
    return _helpers[kind]


def _keep(kind: str, helper: UlyssesHelper | None) -> None:
    _helpers[kind] = helper
    reset()
    if helper is not None:  # its SP group destroys it (collectively) in ``destroy_sequence_parallel``
        helper.sp.add_teardown(f"ulysses.{kind}_helper", lambda: _destroy(kind))
        helper.sp.on_settings_change("ulysses.route", _settings_changed)


def _destroy(kind: str) -> None:
    helper = _helpers[kind]
    if helper is not None:
        helper.destroy()
    _keep(kind, None)


def get_default_helper() -> UlyssesHelper:
    """The helper the public op uses under ``auto``; built (collectively) on first use or after a destroy."""
    return _get("default")


def current_default_helper() -> UlyssesHelper | None:
    """The helper the public op uses under ``auto``, if one exists (never builds one). Local."""
    return _helpers["default"]


def install_default_helper(helper: UlyssesHelper | None) -> None:
    """Make ``helper`` the one the public op uses under ``auto`` (tests inject one built on a CPU transport).
    Local; call it on every rank. Its SP group destroys it (collectively) in ``destroy_sequence_parallel``."""
    _keep("default", helper)


def use_route(helper: UlyssesHelper | None) -> None:
    """Make ``helper`` (None: the NCCL route without a vote) the agreed route of this process until the next
    resolution (``reset``, the helper's destroy, a re-agreement, the SP groups' teardown). Local; call it on every
    rank (tests and benchmarks drive one helper through the public op with it)."""
    global _agreed
    _agreed = helper
    if helper is not None:
        helper.on_destroy(reset)


def destroy_default_helper() -> None:
    """Collective: destroy the op's ``auto`` helper, if any."""
    _destroy("default")


def get_checked_off_helper() -> UlyssesHelper:
    """The helper that votes the ``off`` route's calls in checked mode (``disabled=True``: no transport, never
    fused); built (collectively: one exchange) on first use, destroyed with its SP group."""
    return _get("checked_off")


def current_checked_off_helper() -> UlyssesHelper | None:
    """The ``off`` route's checked-mode helper, if one exists (never builds one). Local."""
    return _helpers["checked_off"]
