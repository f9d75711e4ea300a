"""FastVideo settings agreed across an SP group: validated on every rank, one exchange, and one value of each
setting used identically by every rank (a mismatch declines together to its conservative value, with a warning
on every rank) instead of hanging later.

What is agreed, and when (``docs/env_vars.md``, "Agreement"):

* ``initialize_sequence_parallel`` validates every registered ``FASTVIDEO_*`` variable on every rank
  and agrees the ``agreed`` ones (``envs.agreed_names()``: the route, the long-training policy, the
  window) in one exchange over the SP group's CPU group. The snapshot lives on the SP coordinator.
* The helper's construction exchange carries the same report (no extra round) and refreshes it.
* Nothing reads the environment per call. A change takes effect at the next explicit agreement,
  ``parallel_state.agree_ulysses_settings()`` (or ``override_ulysses_settings``), collective: every rank
  changed the same way, the new values apply; ranks now differ, they decline together again; a rank that
  re-agrees alone raises ``SettingsAgreementError`` after the timeout, saying its settings changed after
  agreement.

Ranks that hold different values of a setting decline together, as upstream FastVideo's ranks do: every rank
takes the setting's conservative value (``CONSERVATIVE``), warns naming the setting and each rank's value, and
the job runs on, exact (the NCCL route when the route differs); a later agreement on which the ranks agree
restores their values. Invalid values are exchanged as errors and raised on every rank, so a typo on one rank
never leaves its peers waiting inside a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from fastvideo import envs
from fastvideo.distributed.host_exchange import all_gather_objects, job_timeout_s

logger = logging.getLogger(__name__)

AGREED = envs.agreed_names()
# The agreed variables' names, for the modules that read their agreed values.
CHECKED = "FASTVIDEO_ULYSSES_A2A_CHECKED"
LONG_TRAINING = "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING"
OVERLAP = "FASTVIDEO_ULYSSES_A2A_OVERLAP"
ROUTE = "FASTVIDEO_ULYSSES_A2A"
WINDOW = "FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES"
# What ranks that differ on a setting agree on, from every rank's value (each safe whatever the others hold):
# the NCCL route (exact, needs no capability), the untuned long-training policy (chunks need a validated
# activation-memory budget), the smallest window and overlap (memory and streams every rank can give), and
# checked mode on (ranks already disagree: every call is then checked).
CONSERVATIVE: dict[str, Callable[[list[Any]], Any]] = {
    ROUTE: lambda values: "off",
    LONG_TRAINING: lambda values: "auto",
    WINDOW: min,
    CHECKED: lambda values: True,
    OVERLAP: min,
}


# Per SP group (its ranks): the decline last warned about, so that the exchanges that repeat it (a helper's
# construction after the initialisation's) do not warn again; an agreement without a difference forgets it.
_WARNED: dict[tuple[int, ...], str] = {}


class SettingsError(ValueError):
    """Some rank holds an invalid value. Raised on every rank, naming the rank, variable, value and choices."""


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
    differing: tuple[str, ...] = ()  # the settings the ranks differed on (each took its conservative value)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def decide(reports: Sequence[LocalReport], ranks: Sequence[int], rank_in_group: int, where: str) -> AgreedSettings:
    """The agreed settings from every rank's report (identical on every rank), or the SettingsError every rank
    raises for an invalid value. Pure but for the warning every rank logs when ranks differ (they then take each
    differing setting's conservative value).

    ``ranks`` are the global ranks of the group, in group order; messages name ranks by global rank.
    """
    bad = [(ranks[i], e) for i, r in enumerate(reports) for e in r.errors]
    if bad:
        # Each error is a sentence of its own (envs' messages end with a full stop): joined as clauses.
        detail = "; ".join(f"rank {rank}: {error.rstrip().rstrip('.')}" for rank, error in bad)
        raise SettingsError(
            f"Invalid FastVideo settings ({where}, SP ranks {list(ranks)}): {detail}. Fix the value on that rank "
            "(every rank raises this error, so none is left waiting in a collective)."
        )
    mine = reports[rank_in_group]
    values = dict(mine.values)
    differing = [name for name in AGREED if any(r.values[name] != reports[0].values[name] for r in reports)]
    for name in differing:
        values[name] = CONSERVATIVE[name]([r.values[name] for r in reports])
    key = tuple(ranks)
    if not differing:
        _WARNED.pop(key, None)
        return AgreedSettings(mine.raw, values)
    per_var = "; ".join(
        f"{name} is " + ", ".join(f"rank {ranks[i]}: {r.values[name]!r}" for i, r in enumerate(reports))
        + f", all now use {values[name]!r}" for name in differing
    )
    if CHECKED in differing:
        per_var += (f" ({CHECKED} is the effective checked mode: the variable, or where it is auto, on under "
                    f"{ROUTE}=auto and, under off, whether torch's distributed debug level is DETAIL, i.e. "
                    "TORCH_DISTRIBUTED_DEBUG=DETAIL)")
    if _WARNED.get(key) != per_var:  # the same decline again (a helper's construction exchange) warns once
        _WARNED[key] = per_var
        logger.warning(
            "Ulysses settings differ between the ranks of SP group %s (%s): %s. Every rank declined to these "
            "conservative values and the job goes on, exact. Set %s identically on every rank; they apply at the "
            "next agreement (parallel_state.agree_ulysses_settings() on every rank).",
            list(ranks), where, per_var, ", ".join(differing))
    return AgreedSettings(mine.raw, values, tuple(differing))


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
        ) or "none"
        raise SettingsAgreementError(
            f"Ulysses settings: rank {ranks[rank_in_group]} re-agrees after SP ranks {list(ranks)} agreed on them "
            f"(changed here: {changes}), and its peers did not join within {timeout_s:g} s ({exc}). Change these "
            "settings on every rank before the same call (e.g. envs.override on every rank), or call "
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
    value = envs.env_or_default("FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S")
    if value > 0:
        return value
    return group_timeout_s if group_timeout_s is not None else job_timeout_s()
