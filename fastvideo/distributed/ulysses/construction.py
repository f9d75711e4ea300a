"""Building a helper: the collective agreement on capability, host and settings, and the transport's steps; the
agreed outcome (``Construction``) is what the helper takes.

Nothing rank-local decides a collective (``docs/ulysses_contract.md``). One exchange over the SP group's vote
group carries every rank's capability, host identity, window, GPU model, generation, shared-memory vote
support and settings report; every rank computes the same verdict from it:

* settings invalid or different, or generations out of step: raise on every rank (before any step);
* a capability missing or different, another host (hostname or boot id), SP size out of range: decline
  at construction, named, with each rank's part; every call then takes the NCCL route;
* otherwise the transport's construction steps run, each entered only after every rank voted that the
  step before it succeeded (a rank that failed to allocate never leaves its peers inside a registration),
  then a topology check (LSA coverage, NVLink), also voted.

Where the helper is built (or declined but votes its calls in checked mode) on one host, the per-call vote
runs over same-host shared memory when every rank loads it (``vote.ShmVote``), else over gloo.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fastvideo.distributed import settings as _settings
from fastvideo.distributed.sp_groups import GroupCoordinator
from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import ContractMismatchError, DeclineReason, Field
from fastvideo.distributed.ulysses.policy import MAX_CTAS, MAX_WORLD_SIZE, MIN_WORLD_SIZE
from fastvideo.distributed.ulysses.transport import Capability, ConstructionContext, TopologyReport, Transport
from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote, load_vote_library
from fastvideo.envs import env_or_default

logger = logging.getLogger("fastvideo.distributed.ulysses.helper")
_NO_DEVICE_TRANSPORT = "no transport for this device"  # a CPU job's: no fused route exists for its device


def host_identity() -> tuple[str, str]:
    """(hostname, boot id): the fused route needs every rank on one host, and LSA is not locality."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return socket.gethostname(), boot_id


def _default_transport(device: torch.device) -> Transport | None:
    if device.type != "cuda":
        return None
    from fastvideo.distributed.ulysses.native import NativeTransport

    return NativeTransport()


_TRANSPORT_FACTORY: Callable[[torch.device], Transport | None] = _default_transport


def default_transport(device: torch.device) -> Transport | None:
    """The transport a helper on ``device`` uses when none is given (the native one on CUDA)."""
    return _TRANSPORT_FACTORY(device)


def set_transport_factory(factory: Callable[[torch.device], Transport | None] | None) -> None:
    """Override how helpers find their transport (``None`` restores the default: native on CUDA)."""
    global _TRANSPORT_FACTORY
    _TRANSPORT_FACTORY = factory if factory is not None else _default_transport


def limits(window_bytes: int | None, vote_timeout_s: float | None, watchdog_timeout_s: float | None,
           group_timeout_s: float | None = None) -> tuple[int, float, float]:
    """(window bytes, vote timeout, watchdog timeout) of a helper: the arguments, else the settings' values. A vote
    timeout of 0 follows the SP group's timeout (``group_timeout_s``, the job's by default), a watchdog timeout of
    0 the vote timeout. Local; raises ValueError naming the argument for a bad one."""
    window = int(window_bytes if window_bytes is not None else env_or_default(_settings.WINDOW))
    if window < 1:
        raise ValueError(f"UlyssesHelper: window_bytes={window} must be positive.")
    if vote_timeout_s is not None and vote_timeout_s <= 0:
        raise ValueError(f"UlyssesHelper: vote_timeout_s={vote_timeout_s!r} must be positive (or None: the settings').")
    vote = float(vote_timeout_s) if vote_timeout_s is not None else _settings.agreement_timeout_s(group_timeout_s)
    if watchdog_timeout_s is None:
        watchdog_timeout_s = float(env_or_default("FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S")) or vote
    if watchdog_timeout_s <= 0:
        raise ValueError(f"UlyssesHelper: watchdog_timeout_s={watchdog_timeout_s!r} must be positive.")
    return window, vote, watchdog_timeout_s


@dataclass
class Construction:
    """The agreed outcome of a helper's construction (identical on every rank but ``call_vote``'s object and the
    rank-local ``voted_launch`` / ``hot_decline``). The settings agreed with it are the SP group's (``sp.settings``,
    never re-read per call)."""

    capability: Capability
    call_vote: GlooVote | ShmVote  # the per-call vote channel
    built: bool = False  # the transport's steps and topology check succeeded on every rank
    reason: DeclineReason | None = None  # the construction decline, if any
    detail: str = ""
    per_rank: dict[int, str] = field(default_factory=dict)  # global rank -> its part in the decline
    # The vote and the launch in one library call where the transport offers it; rank-local (both paths are the
    # same exchange and the same verdict).
    voted_launch: bool = False
    hot_decline: str = ""  # why the hot lane is off ("" where it may learn signatures); rank-local


def construct(sp: GroupCoordinator, transport: Transport | None, vote: GlooVote, *, disabled: bool,
              window_bytes: int, gpu_name: str, generation: int, identity: Callable[[], tuple[str, str]],
              vote_request: str) -> Construction:
    """Collective over the SP group (several exchanges over ``vote``); blocks the host; not capture-safe.
    Raises on every rank for invalid or different settings and out-of-step generations; any other failure
    is a named decline."""
    if disabled:
        cap = Capability("off", False, decline=DeclineReason.DISABLED,
                         detail=f"{_settings.ROUTE}=off: this helper only votes (checked mode)")
    elif transport is not None:
        cap = transport.capability()
    else:
        cap = Capability("none", False, decline=DeclineReason.TRANSPORT_MISSING, detail=_NO_DEVICE_TRANSPORT)
    host, boot = identity()
    shm_ok = vote_request != "gloo" and load_vote_library() is not None
    info = (cap.agreement_key(), cap.decline, cap.detail, host, boot, window_bytes, gpu_name, shm_ok, generation,
            _settings.local_report())
    peers = vote.all_gather_object(info)
    _agree_settings_and_generation(sp, peers)  # raises on every rank, before any construction step
    result = Construction(cap, vote)
    reason, detail, per_rank = _capability_verdict(sp.world_size, peers)
    if reason is None:
        assert transport is not None  # a missing transport declined at the capability exchange
        reason, detail, per_rank = _run_steps(sp, transport, vote, window_bytes)
        if reason is None:
            reason, detail, per_rank = _topology_verdict(transport, vote)
            if reason is not None:
                transport.destroy()  # built on every rank: torn down together
    result.built = reason is None
    if not result.built:
        _record_decline(sp, result, reason, detail, per_rank)
    # The per-call channel: shared memory on one host where every rank loads it, else the vote group (gloo). A
    # declined helper votes only in checked mode (the default under `auto`), but chooses the same way whatever the
    # mode, so that a re-agreement that turns checked mode on (``UlyssesHelper.follow``) votes over the same channel.
    if len({(p[3], p[4]) for p in peers}) == 1:  # one host
        result.call_vote = _choose_vote(vote, sp.rank_in_group, peers, vote_request)
    result.voted_launch = (result.built and env_or_default("FASTVIDEO_ULYSSES_A2A_VOTED_LAUNCH") == "1"
                           and transport.fuses_vote(result.call_vote))
    # The hot lane (hot.py) where the launch is voted in the library and the extension is built for this torch.
    if not result.voted_launch:
        result.hot_decline = "the vote and the launch are not one library call here"
    elif env_or_default("FASTVIDEO_ULYSSES_A2A_HOT_PATH") != "1":
        result.hot_decline = "FASTVIDEO_ULYSSES_A2A_HOT_PATH=0"
    else:
        result.hot_decline = transport.hot_decline()
    return result


def _agree_settings_and_generation(sp: GroupCoordinator, peers: list[tuple]) -> None:
    """Settings (validated, identical) and helper generation, from the construction exchange. Same verdict on
    every rank: raise everywhere, or refresh the SP group's agreed settings."""
    agreed = _settings.decide([p[9] for p in peers], sp.ranks, sp.rank_in_group,
                              "checked at UlyssesHelper construction")
    generations = [p[8] for p in peers]
    if any(g != generations[0] for g in generations):
        # Resynchronise so that the next collective construction agrees, then fail this one everywhere.
        sp.resync_generation(max(generations))
        raise ContractMismatchError(Field.HEADER, [contract.header(g) for g in generations])
    sp.settings = agreed


def _capability_verdict(world_size: int, peers: list[tuple]) -> tuple[DeclineReason | None, str, list[str]]:
    """(reason, detail, each rank's own part in it) from the construction exchange; reason None: go on."""
    if not MIN_WORLD_SIZE <= world_size <= MAX_WORLD_SIZE:
        why = f"SP size {world_size} outside {MIN_WORLD_SIZE}..{MAX_WORLD_SIZE}"
        return DeclineReason.WORLD_SIZE, why, [why] * len(peers)
    declines = [(i, p[1], p[2]) for i, p in enumerate(peers) if p[1] is not None]
    if declines:
        per_rank = [f"{p[1].label} ({p[2]})" if p[1] is not None else "ok" for p in peers]
        return (min(d for _, d, _ in declines), "; ".join(f"rank {i}: {d.label} ({why})" for i, d, why in declines),
                per_rank)
    for index, what in ((0, "transport capability"), (5, "window bytes"), (6, "GPU model")):
        values = [p[index] for p in peers]
        if any(v != values[0] for v in values):
            return DeclineReason.PEER_DISAGREEMENT, f"ranks differ in {what}: {values}", [f"{what} {v}" for v in values]
    if len({(p[3], p[4]) for p in peers}) > 1:
        hosts = [f"{p[3]}/{p[4][:8]}" for p in peers]
        return (DeclineReason.MULTI_HOST, f"ranks are on more than one host (hostname/boot id): {hosts}",
                [f"host {h}" for h in hosts])
    return None, "", []


def _run_steps(sp: GroupCoordinator, transport: Transport, vote: GlooVote,
               window_bytes: int) -> tuple[DeclineReason | None, str, list[str]]:
    """The transport's construction steps, each entered only after every rank succeeded at the one before."""
    ctx = ConstructionContext(rank=sp.rank_in_group, world_size=sp.world_size, device=sp.device,
                              window_bytes=window_bytes, max_ctas=MAX_CTAS, device_group=sp.device_group,
                              all_gather_object=vote.all_gather_object)
    error = ""
    try:
        steps = transport.construction_steps(ctx)
    except Exception as exc:  # noqa: BLE001 - reported collectively below
        steps, error = [], f"construction_steps: {exc}"
    for index, step in enumerate([*steps, None]):
        results = vote.all_gather_object(error)
        if any(results):
            transport.abort()
            detail = "; ".join(f"rank {i}: {e}" for i, e in enumerate(results) if e)
            where = f"step {index}/{len(steps)} ({steps[index - 1].name})" if index else "preparing the steps"
            return (DeclineReason.CONSTRUCTION_FAILED, f"failed at {where}: {detail}",
                    [f"failed: {e}" if e else "ok" for e in results])
        if step is None:
            break
        try:
            step.run()
        except Exception as exc:  # noqa: BLE001 - a local failure is voted on, never raised alone
            error = f"{step.name}: {type(exc).__name__}: {exc}"
    return None, "", []


def _topology_verdict(transport: Transport, vote: GlooVote) -> tuple[DeclineReason | None, str, list[str]]:
    """Every rank's topology check (LSA coverage, NVLink), exchanged: one failing rank declines everywhere."""
    try:
        mine = transport.topology()
    except Exception as exc:  # noqa: BLE001 - voted below, never raised alone
        mine = TopologyReport(DeclineReason.CONSTRUCTION_FAILED, f"topology check: {type(exc).__name__}: {exc}")
    reports = [(r.decline, r.detail) for r in vote.all_gather_object(mine)]
    bad = [r for r, _ in reports if r is not None]
    if not bad:
        return None, "", []
    detail = "; ".join(f"rank {i}: {d}" for i, (r, d) in enumerate(reports) if r is not None)
    return min(bad), detail, [f"{r.label} ({d})" if r is not None else "ok" for r, d in reports]


def _choose_vote(vote: GlooVote, rank: int, peers: list[tuple], request: str) -> GlooVote | ShmVote:
    """The per-call vote channel, decided from the construction exchange (so identically everywhere): shared
    memory when every rank asked for it and loads it, else gloo. Only for ranks on one host."""
    if not all(p[7] for p in peers):
        if request == "shm":
            logger.warning("Ulysses shared-memory vote requested but the library with the vote is missing on some "
                           "rank (per rank: %s); voting over gloo.", [p[7] for p in peers])
        return vote
    shm, why = ShmVote.create(vote, rank, load_vote_library())
    if shm is None:  # the open failed somewhere: every rank saw the same errors and keeps gloo
        logger.warning("Ulysses shared-memory vote could not be set up (%s); voting over gloo.", why)
        return vote
    return shm


def _record_decline(sp: GroupCoordinator, result: Construction, reason: DeclineReason, detail: str,
                    per_rank: list[str]) -> None:
    """Record the agreed decline. Logged once for the SP group, by its first rank, at WARNING, naming every
    rank's part (every rank holds the same exchange, so the others would only repeat it); at INFO where every rank
    is a CPU one (no transport for its device)."""
    result.reason, result.detail = reason, detail
    result.per_rank = {rank: why for rank, why in zip(sp.ranks, per_rank, strict=True)}
    if sp.rank_in_group == 0 and reason is not DeclineReason.DISABLED:  # `off` is a choice, not news
        # A CPU job had no fused route to lose (nothing to fix): said at INFO. A decline on GPUs is news.
        level = logging.INFO if all(_NO_DEVICE_TRANSPORT in why for why in per_rank) else logging.WARNING
        logger.log(
            level, "Ulysses fused all-to-all declined at construction on SP ranks %s (%s); every call takes the NCCL "
            "route. Per rank: %s.", sp.ranks, reason.label,
            "; ".join(f"rank {rank}: {why}" for rank, why in result.per_rank.items()))
