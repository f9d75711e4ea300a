"""Which route the public op takes on this process's SP group, and the default helpers: in one place.

The route follows the settings the SP group agreed (``parallel_state.initialize_sequence_parallel``, or a
later ``agree_ulysses_settings()`` on every rank), never the environment read per call:

========================================  =================================================================
agreed settings                           route
========================================  =================================================================
``FASTVIDEO_ULYSSES_A2A=off``             the NCCL route, no helper, no vote (``route()`` is None)
``off`` in checked mode                   ``UlyssesHelper(disabled=True)``: every call votes, never fused
``auto``                                  the default helper, built collectively at the first call
========================================  =================================================================

Resolved once and kept: the hot path reads one module global. Helpers are built under
``torch.inference_mode(False)`` (the helper sees to it), so the first call's grad mode never leaks into
reusable state. The SP group tears the route and its helpers down (collectively) before its process
groups, and when a re-agreement changes the settings.
"""

from __future__ import annotations

from fastvideo.distributed import settings as _settings
from fastvideo.distributed.parallel_state import get_sp_group
from fastvideo.distributed.ulysses.helper import UlyssesHelper

UNRESOLVED = object()
# None (the NCCL route), or the helper the op calls. The op's hot path reads it directly (one global read);
# ``resolve()`` fills it in.
ROUTE: object = UNRESOLVED
_default: UlyssesHelper | None = None
_checked_off: UlyssesHelper | None = None


def route() -> UlyssesHelper | None:
    """The helper the public op calls on the current SP group, or None for the NCCL route. Collective the first
    time (it may build a helper) and after the route's helper was destroyed; then a lookup."""
    helper = ROUTE
    if helper is UNRESOLVED or (helper is not None and helper._destroyed):  # type: ignore[union-attr]
        helper = resolve()
    return helper  # type: ignore[return-value]


def resolve() -> UlyssesHelper | None:
    """Resolve the route from the agreed settings (``route()``'s slow path). Collective: may build a helper."""
    global ROUTE
    sp = get_sp_group()
    sp.add_teardown("ulysses.route", reset)
    sp.on_settings_change("ulysses.route", _settings_changed)
    agreed = sp.settings
    if agreed is not None and agreed["FASTVIDEO_ULYSSES_A2A"] == "auto":
        helper: UlyssesHelper | None = get_default_helper()
    elif agreed is not None and agreed[_settings.CHECKED]:
        helper = get_checked_off_helper()
    else:
        helper = None
    ROUTE = helper
    return helper


def _settings_changed(previous: _settings.AgreedSettings, agreed: _settings.AgreedSettings) -> None:
    """A re-agreement changed the settings (on every rank alike): resolve the route again; the helpers follow the
    new values, and one that cannot (its window changed) is destroyed collectively and rebuilt at its next use."""
    for helper, destroy in ((_default, destroy_default_helper), (_checked_off, destroy_checked_off_helper)):
        if helper is not None and not helper._destroyed and not helper.follow(agreed):
            destroy()
    reset()


def reset() -> None:
    """Forget the resolved route (local): the next call resolves it from the agreed settings."""
    global ROUTE
    ROUTE = UNRESOLVED


def get_default_helper() -> UlyssesHelper:
    """The helper the public op uses under ``auto``; built (collectively) on first use or after a destroy."""
    sp = get_sp_group()
    if _default is None or _default._destroyed or _default.sp is not sp:
        install_default_helper(UlyssesHelper(sp))
    assert _default is not None
    return _default


def current_default_helper() -> UlyssesHelper | None:
    """The helper the public op uses under ``auto``, if one exists (never builds one). Local."""
    return _default


def install_default_helper(helper: UlyssesHelper | None) -> None:
    """Make ``helper`` the one the public op uses under ``auto`` (tests inject one built on a CPU transport).
    Local; call it on every rank. Its SP group destroys it (collectively) in ``destroy_sequence_parallel``."""
    global _default
    _default = helper
    reset()
    if helper is not None:
        helper.sp.add_teardown("ulysses.default_helper", destroy_default_helper)
        helper.sp.on_settings_change("ulysses.route", _settings_changed)


def destroy_default_helper() -> None:
    """Collective: destroy the op's ``auto`` helper, if any."""
    global _default
    if _default is not None:
        _default.destroy()
    _default = None
    reset()


def get_checked_off_helper() -> UlyssesHelper:
    """The helper that votes the ``off`` route's calls in checked mode (``disabled=True``: no transport, never
    fused); built (collectively: one exchange) on first use, destroyed with its SP group."""
    global _checked_off
    sp = get_sp_group()
    if _checked_off is None or _checked_off._destroyed or _checked_off.sp is not sp:
        _checked_off = UlyssesHelper(sp, disabled=True)
        sp.add_teardown("ulysses.checked_off_helper", destroy_checked_off_helper)
        sp.on_settings_change("ulysses.route", _settings_changed)
    return _checked_off


def current_checked_off_helper() -> UlyssesHelper | None:
    """The ``off`` route's checked-mode helper, if one exists (never builds one). Local."""
    return _checked_off


def destroy_checked_off_helper() -> None:
    """Collective: destroy the ``off`` route's checked-mode helper, if any."""
    global _checked_off
    if _checked_off is not None:
        _checked_off.destroy()
    _checked_off = None
    reset()
