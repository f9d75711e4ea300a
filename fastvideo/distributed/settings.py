"""FastVideo settings agreed across an SP group: validated on every rank, one exchange, and a mismatch
raises the same error on every rank instead of hanging later.

What is agreed, and when (``docs/env_vars.md``, "Agreement"):

* ``initialize_sequence_parallel`` validates every registered ``FASTVIDEO_*`` variable on every rank
  and agrees the ``agreed`` ones (``envs.agreed_names()``: the route, the long-training policy, the
  window) in one exchange over the SP group's CPU group. The snapshot lives on the SP coordinator.
* The helper's construction exchange carries the same report (no extra round) and refreshes it.
* Nothing reads the environment per call. A change takes effect at the next explicit agreement,
  ``parallel_state.agree_ulysses_settings()`` (or ``override_ulysses_settings``), collective: every rank
  changed the same way, the new values apply; ranks now differ, ``SettingsMismatchError`` on every rank;
  a rank that re-agrees alone raises ``SettingsAgreementError`` after the timeout, saying its settings
  changed after agreement.

Invalid values are exchanged as errors and raised on every rank, so a typo on one rank never leaves
its peers waiting inside a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fastvideo import envs
from fastvideo.distributed.host_exchange import all_gather_objects, job_timeout_s

logger = logging.getLogger(__name__)

AGREED = envs.agreed_names()
CHECKED = "FASTVIDEO_ULYSSES_A2A_CHECKED"
ROUTE = "FASTVIDEO_ULYSSES_A2A"


class SettingsError(ValueError):
    """Some rank holds an invalid value. Raised on every rank, naming the rank, variable, value and choices."""


class SettingsMismatchError(ValueError):
    """Ranks of one SP group hold different values of an agreed variable. Raised on every rank."""

    def __init__(self, message: str, differing: dict[str, list[Any]]):
        super().__init__(message)
        self.differing = differing  # name -> value by SP rank


class SettingsAgreementError(RuntimeError):
    """The settings exchange did not complete (a peer is dead, or never joined the re-agreement)."""


def raw_now() -> tuple[object, ...]:
    """A snapshot of this rank's raw values of the agreed variables (what a change check compares; opaque)."""
    return envs.snapshot(AGREED)


@dataclass(frozen=True)
class LocalReport:
    """What one rank sends: a snapshot of its raw agreed values, their parsed values, and every invalid variable."""

    raw: tuple[object, ...]  # envs.snapshot of the agreed variables
    values: dict[str, Any]
    errors: tuple[str, ...]


def local_report() -> LocalReport:
    values, errors = envs.read_all()
    agreed = {n: values[n] for n in AGREED if n in values}
    if CHECKED in agreed:
        # What is agreed is the effect (on or off), not the spelling: `1` on one rank and `auto` at torch's
        # DETAIL debug level on another both vote every call (and `auto` under the `auto` route is on).
        agreed[CHECKED] = checked_mode(agreed[CHECKED], values.get(ROUTE, "off"))  # invalid: raised at decide
    return LocalReport(raw_now(), agreed, tuple(errors))


@dataclass(frozen=True)
class AgreedSettings:
    """Values every rank of the SP group holds, and a snapshot of this rank's raw values when they were agreed.

    ``FASTVIDEO_ULYSSES_A2A_CHECKED`` holds the effective checked mode (a bool; ``checked_mode``)."""

    raw: tuple[object, ...]  # envs.snapshot when agreed
    values: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def changed(self) -> bool:
        """Has this rank's environment changed since the agreement? (No parsing: a tuple compare.)"""
        return raw_now() != self.raw


def decide(reports: Sequence[LocalReport], ranks: Sequence[int], rank_in_group: int, where: str) -> AgreedSettings:
    """The agreed settings from every rank's report (pure; identical on every rank), or the error every rank raises.

    ``ranks`` are the global ranks of the group, in group order; errors name ranks by global rank.
    """
    bad = [(ranks[i], e) for i, r in enumerate(reports) for e in r.errors]
    if bad:
        # Each error is a sentence of its own (envs' messages end with a full stop): joined as clauses.
        detail = "; ".join(f"rank {rank}: {error.rstrip().rstrip('.')}" for rank, error in bad)
        raise SettingsError(
            f"Invalid FastVideo settings ({where}, SP ranks {list(ranks)}): {detail}. Fix the value on that rank "
            "(every rank raises this error, so none is left waiting in a collective)."
        )
    differing = {
        name: [r.values[name] for r in reports]
        for name in AGREED
        if any(r.values[name] != reports[0].values[name] for r in reports)
    }
    if differing:
        per_var = "; ".join(
            f"{name} is " + ", ".join(f"rank {ranks[i]}: {v!r}" for i, v in enumerate(values))
            for name, values in differing.items()
        )
        if CHECKED in differing:
            per_var += (f" ({CHECKED} is the effective checked mode: the variable, or where it is auto, on under "
                        f"{ROUTE}=auto and, under off, whether torch's distributed debug level is DETAIL, i.e. "
                        "TORCH_DISTRIBUTED_DEBUG=DETAIL)")
        raise SettingsMismatchError(
            f"Ulysses settings differ between the ranks of SP group {list(ranks)} ({where}): {per_var}. Set "
            f"{', '.join(differing)} identically on every rank: these decide which collectives each rank runs, "
            "and ranks that disagree would hang.",
            differing,
        )
    mine = reports[rank_in_group]
    return AgreedSettings(mine.raw, dict(mine.values))


def agree(
    group: dist.ProcessGroup,
    ranks: Sequence[int],
    rank_in_group: int,
    *,
    where: str,
    timeout_s: float,
    previous: AgreedSettings | None = None,
) -> AgreedSettings:
    """Collective over ``group``: one exchange of every rank's report, then ``decide``.

    ``previous`` is the snapshot this re-agreement replaces (its values name the change in errors).
    """
    report = local_report()
    try:
        reports = all_gather_objects(group, len(ranks), report, timeout_s=timeout_s)
    except RuntimeError as exc:
        if previous is None:
            raise SettingsAgreementError(
                f"Ulysses settings agreement over SP ranks {list(ranks)} ({where}) did not complete within "
                f"{timeout_s:g} s ({exc}). A peer is dead or did not reach the same point."
            ) from exc
        changes = ", ".join(
            f"{name} agreed {previous.values.get(name)!r}, now {report.values.get(name, '<invalid>')!r}"
            for name, old, new in zip(AGREED, previous.raw, report.raw, strict=True)
            if old != new
        )
        raise SettingsAgreementError(
            f"Ulysses settings changed on rank {ranks[rank_in_group]} after SP ranks {list(ranks)} agreed on them "
            f"({changes}), and its peers did not re-agree within {timeout_s:g} s ({exc}). Change these settings on "
            "every rank before the same call (e.g. envs.override on every rank), or call "
            "parallel_state.agree_ulysses_settings() on every rank after changing them."
        ) from exc
    agreed = decide(reports, ranks, rank_in_group, where)
    if previous is not None and previous.values != agreed.values:
        logger.debug("Ulysses settings re-agreed on SP ranks %s: %s -> %s", list(ranks), previous.values, agreed.values)
    return agreed


def checked_mode(value: str | None = None, route: str | None = None) -> bool:
    """The effective checked mode (every call votes on every route): ``FASTVIDEO_ULYSSES_A2A_CHECKED`` (``value``,
    its parsed value, or read now) under the route ``route`` (``FASTVIDEO_ULYSSES_A2A``'s parsed value, or read
    now). ``1`` on, ``0`` off; ``auto`` (the default) on under the ``auto`` route, and under ``off`` on exactly when
    torch checks its own collectives' shapes, at debug level DETAIL.

    torch reads ``TORCH_DISTRIBUTED_DEBUG`` once, when ``torch.distributed`` is imported (or at
    ``torch.distributed.set_debug_level``); this follows torch's level, not the variable, so the two never
    disagree. Resolved when the settings are agreed: a later ``set_debug_level`` takes effect at the next
    agreement (a change of a FASTVIDEO_* variable, or ``parallel_state.agree_ulysses_settings()``)."""
    if value is None:
        value = envs.get(CHECKED)
    if value == "auto":
        if route is None:
            route = envs.get(ROUTE)
        return route == "auto" or dist.get_debug_level() == dist.DebugLevel.DETAIL
    return value == "1"


def agreement_timeout_s(group_timeout_s: float | None = None) -> float:
    """The bound on one settings exchange, and the vote timeout: ``FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S`` when set
    above 0, else ``group_timeout_s`` (the SP group's), else the default process group's timeout. An invalid value
    counts as unset here (the exchange then reports it on every rank)."""
    try:
        value = float(envs.get("FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S"))
    except ValueError:
        value = 0.0
    if value > 0:
        return value
    return group_timeout_s if group_timeout_s is not None else job_timeout_s()
