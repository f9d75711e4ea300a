"""The Ulysses helper: collective agreement, the per-call vote, plans, fallbacks and "why".

Layers go one way: the public op (``communication_op``) calls the helper; the helper calls the
routes below it (``nccl.py``, the transports in ``transport.py`` / ``native.py``), which import
nothing above them; input validation lives in ``layout.py``. ``parallel_state`` never imports this
module: the default helper registers its teardown with the SP coordinator.

Nothing rank-local decides a collective. Construction agrees over the SP group's vote group on
capability, host identity and the settings (``fastvideo/distributed/settings.py``: a mismatch raises
on every rank), and enters each construction step only after every rank voted
that the step before it succeeded. Every call then exchanges the 12-field contract
(``contract.py``) and acts on the verdict every rank computes identically: run the agreed plan,
decline together to the NCCL route, or raise the same error on every rank.

    helper = UlyssesHelper(get_sp_group())           # collective
    y = helper.all_to_all(x, mode=0)                  # collective, differentiable, host-blocking vote
    helper.stats()                                    # counts, declines by reason, plans that ran
    helper.destroy()                                  # collective

A construction-time decline (no kernel, multi-host, not NVLink, ...) is itself agreed, so calls of a
helper that declined at construction take the NCCL route without a vote, except in checked mode
(``FASTVIDEO_ULYSSES_A2A_CHECKED``, or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), where every call still votes
its 12 fields and a caller bug (ranks passing different shapes, dtypes, modes, grad flags) raises on
every rank. ``UlyssesHelper(disabled=True)`` is such a helper for the ``off`` route: no transport, it
only votes (``get_checked_off_helper``). A vote that fails (timeout, dead peer) disposes the helper: its
gloo group is unusable, and every later call raises.

The per-call exchange runs over a same-host shared-memory segment instead of gloo when every rank
loads the kernel library's vote and all ranks are on one host (``vote="auto"``, agreed at
construction; construction itself always runs over gloo). ``stats()["vote"]`` says which.
"""

from __future__ import annotations

import functools
import logging
import socket
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, NoReturn

import torch

from fastvideo import envs
from fastvideo.distributed import settings as _settings
from fastvideo.distributed.parallel_state import GroupCoordinator, get_sp_group
from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import (
    WINDOW_CAPTURED,
    ContractMismatchError,
    DeclineReason,
    Field,
    Phase,
    Verdict,
)
from fastvideo.distributed.ulysses.layout import validate_input
from fastvideo.distributed.ulysses.nccl import nccl_route
from fastvideo.distributed.ulysses.policy import (
    CAPTURE_ENGINES,
    ENGINE_CE,
    ENGINES,
    MAX_CTAS,
    MAX_WORLD_SIZE,
    MIN_WORLD_SIZE,
    TUNED_TABLE,
    Choice,
    Geometry,
    Plan,
    TunedRow,
    choose_plan,
)
from fastvideo.distributed.ulysses.transport import (
    ENTRY_CE,
    ENTRY_CE_CAPTURE,
    ENTRY_TUNED,
    Capability,
    ConstructionContext,
    Transport,
    VoteNotStarted,
)
from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote, VoteTimeoutError, load_vote_library
from fastvideo.distributed.ulysses.watchdog import FusedCallWatchdog, InFlight, StoreProbe, end_process

logger = logging.getLogger(__name__)

CHECKED = _settings.CHECKED


class HelperDisposedError(RuntimeError):
    """The helper was destroyed, or disposed itself after a failed vote; build a new one."""


class CallRecord(NamedTuple):
    """What one call did, kept in ``helper.history`` so gates can assert the plans that actually ran.
    (A named tuple: one is built per call, and a frozen dataclass costs ~1.4 us more to build.)"""

    seq: int
    phase: Phase
    mode: int
    route: str  # "fused" or "nccl"
    plan: Plan | None
    reason: DeclineReason | None
    chunks: int
    captured: bool = False  # the fused launch was captured into a CUDA graph (its replays are not recorded)


def host_identity() -> tuple[str, str]:
    """(hostname, boot id): the fused route needs every rank on one host, and LSA is not locality."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return socket.gethostname(), boot_id


def stream_capturing(x: torch.Tensor) -> bool:
    """Whether this call is being captured into a CUDA graph (its device's current stream is capturing)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _default_transport(device: torch.device) -> Transport | None:
    if device.type != "cuda":
        return None
    from fastvideo.distributed.ulysses.native import NativeTransport

    return NativeTransport()


_TRANSPORT_FACTORY: Callable[[torch.device], Transport | None] = _default_transport


def _default_store():
    """The default process group's key-value store (the watchdog's peer probe), or None."""
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - the probe is optional: without it the watchdog still ends the process
        return None


def _env_or_default(name: str):
    """The variable's value, or its default when invalid: the construction exchange then reports the invalid
    value on every rank (raising here alone would leave the peers waiting in that exchange)."""
    try:
        return envs.get(name)
    except ValueError:
        return envs.registry()[name].default


class UlyssesHelper:
    """Decides, identically on every SP rank, whether each call takes the fused route and how.

    Construction and ``destroy()`` are collective over the SP group. ``all_to_all`` is collective
    and blocks the host for the vote. Under CUDA-graph capture every rank votes once, at capture, and
    where every rank's transport can freeze the agreed plan (``Transport.capture_decline``), the fused
    launch is captured with that plan; otherwise every rank declines ``cuda_graph_capture`` together and
    the NCCL route is captured. Replays do no host work (``docs/compile_and_cuda_graphs.md``).
    """

    def __init__(
        self,
        sp: GroupCoordinator | None = None,
        *,
        transport: Transport | None = None,
        window_bytes: int | None = None,
        vote_timeout_s: float | None = None,
        tuned_table: Sequence[TunedRow] = TUNED_TABLE,
        gpu_name: str | None = None,
        identity: Callable[[], tuple[str, str]] = host_identity,
        history: int = 1024,
        vote: str = "auto",
        watchdog_timeout_s: float | None = None,
        on_watchdog_timeout: Callable[[str], None] | None = None,
        disabled: bool = False,
    ) -> None:
        if vote not in ("gloo", "shm", "auto"):
            raise ValueError(f"UlyssesHelper: vote={vote!r} must be 'gloo', 'shm' or 'auto'.")
        if disabled and transport is not None:
            raise ValueError("UlyssesHelper: disabled=True builds a helper without a transport; pass no transport.")
        # True: the `off` route's helper. It never takes the fused route (construction declines DISABLED
        # on every rank) and exists so that checked mode can vote each call.
        self.disabled = disabled
        self.sp = sp if sp is not None else get_sp_group()
        self.world_size = self.sp.world_size
        self.device = self.sp.device
        if self.sp.vote_failure is not None:
            raise HelperDisposedError(
                f"UlyssesHelper: the vote group of SP ranks {self.sp.ranks} failed earlier ({self.sp.vote_failure}) "
                "and a gloo group is unusable after a failure: call destroy_sequence_parallel() and "
                "initialize_sequence_parallel() on every rank to rebuild it."
            )
        # Per SP group, so identical on every rank (helpers are built collectively; the construction
        # exchange checks it). It is in every vote's HEADER: a stale helper on one rank is a loud mismatch.
        self.generation = self.sp.next_generation()
        self.window_bytes = int(
            window_bytes if window_bytes is not None else _env_or_default("FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES")
        )
        if self.window_bytes < 1:
            raise ValueError(f"UlyssesHelper: window_bytes={self.window_bytes} must be positive.")
        timeout = float(
            vote_timeout_s if vote_timeout_s is not None else _env_or_default("FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S")
        )
        self._plan_cache: dict[tuple, Choice] = {}
        # Per call signature, like the plan cache: geometries, and the fused proposal's vote fields.
        self._geometries: dict[tuple, Geometry] = {}
        self._proposals: dict[tuple, list[int]] = {}
        self.tuned_table = tuple(tuned_table)
        self.capture_engines = CAPTURE_ENGINES
        if gpu_name is None:
            gpu_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.gpu_name = gpu_name
        if disabled:
            self.transport: Transport | None = None
        else:
            self.transport = transport if transport is not None else _TRANSPORT_FACTORY(self.device)
        self.capability: Capability | None = None
        self.construction_reason: DeclineReason | None = None
        self.construction_detail = ""
        self.construction_per_rank: dict[int, str] = {}  # global rank -> its part in a construction decline
        self._seq = 0
        self._destroyed = False
        self._disposed_error: str | None = None
        self._built = False
        self._logged: set[DeclineReason] = set()
        self._declines: Counter[DeclineReason] = Counter()
        self._plans: Counter[tuple[int, Geometry]] = Counter()  # (plan word, geometry): described in stats()
        self._calls = self._fused = self._raised = self._captured = 0
        # Whether a call is being captured into a CUDA graph (tests force it on CPU); why the last capture
        # on this rank could not freeze its plan (logged with the decline).
        self._capturing: Callable[[torch.Tensor], bool] = stream_capturing
        self._capture_detail = ""
        self._vote_s: deque[float] = deque(maxlen=4096)
        self.history: deque[CallRecord] = deque(maxlen=history)
        if watchdog_timeout_s is None:
            watchdog_timeout_s = float(_env_or_default("FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S")) or timeout
        if watchdog_timeout_s <= 0:
            raise ValueError(f"UlyssesHelper: watchdog_timeout_s={watchdog_timeout_s!r} must be positive.")
        self.watchdog_timeout_s = watchdog_timeout_s
        self._on_watchdog_timeout = on_watchdog_timeout or end_process
        self._watchdog: FusedCallWatchdog | None = None  # built at the first launch that leaves work in flight
        # Construction, and the per-call vote unless shm: the SP group's vote group, created once with the
        # group (no process group per helper: rebuilding helpers leaks nothing).
        self._vote = GlooVote(self.sp.ranks, timeout, group=self.sp.vote_group)
        self._call_vote: GlooVote | ShmVote = self._vote
        # See _voted_launch. Rank-local: the voted launch and the plain path are the same exchange and verdict.
        self._voted: bool | None = None if _env_or_default("FASTVIDEO_ULYSSES_A2A_VOTED_LAUNCH") == "1" else False
        self._vote_request = vote
        try:
            self._construct(identity)
        except VoteTimeoutError as exc:
            self._dispose(str(exc))
            raise

    # ------------------------------------------------------------------ construction

    def _construct(self, identity: Callable[[], tuple[str, str]]) -> None:
        if self.disabled:
            cap = Capability("off", False, decline=DeclineReason.DISABLED,
                             detail="FASTVIDEO_ULYSSES_A2A=off: this helper only votes (checked mode)")
        elif self.transport is not None:
            cap = self.transport.capability()
        else:
            cap = Capability("none", False, decline=DeclineReason.TRANSPORT_MISSING,
                             detail="no transport for this device")
        self.capability = cap
        host, boot = identity()
        shm_ok = self._vote_request != "gloo" and load_vote_library() is not None
        info = (cap.agreement_key(), cap.decline, cap.detail, host, boot, self.window_bytes, self.gpu_name, shm_ok,
                self.generation, _settings.local_report())
        peers = self._vote.all_gather_object(info)
        self._agree_settings_and_generation(peers)  # raises on every rank, before any construction step
        reason, detail, per_rank = self._capability_verdict(peers)
        if reason is None:
            reason, detail, per_rank = self._run_steps()
        if reason is None:
            assert self.transport is not None  # a missing transport declined at the capability exchange
            try:
                report = self.transport.topology()
                mine = (report.decline, report.detail)
            except Exception as exc:  # noqa: BLE001 - voted below, never raised alone
                mine = (DeclineReason.CONSTRUCTION_FAILED, f"topology check: {type(exc).__name__}: {exc}")
            reports = self._vote.all_gather_object(mine)
            bad = [(r, d) for r, d in reports if r is not None]
            if bad:
                reason = min(r for r, _ in bad)
                detail = "; ".join(f"rank {i}: {d}" for i, (r, d) in enumerate(reports) if r is not None)
                per_rank = [f"{r.label} ({d})" if r is not None else "ok" for r, d in reports]
                self.transport.destroy()  # built on every rank: tear down together
            else:
                self._built = True
                self._choose_vote(peers)
        if reason is not None:
            self._decline_construction(reason, detail, per_rank)
            # Checked mode votes every call of this helper: on one host, over shared memory where every rank
            # loads it (the same choice as a built helper's; the agreed settings make it on every rank).
            if self.sp.settings is not None and self.sp.settings[CHECKED] and len({(p[3], p[4]) for p in peers}) == 1:
                self._choose_vote(peers)

    def _agree_settings_and_generation(self, peers: list[tuple]) -> None:
        """Settings (validated, identical) and helper generation, from the construction exchange. Same verdict
        on every rank: raise everywhere, or refresh the SP group's agreed settings."""
        agreed = _settings.decide([p[9] for p in peers], self.sp.ranks, self.sp.rank_in_group,
                                  "checked at UlyssesHelper construction")
        generations = [p[8] for p in peers]
        if any(g != generations[0] for g in generations):
            # Resynchronise so that the next collective construction agrees, then fail this one everywhere.
            self.sp._generation = max(generations)
            raise ContractMismatchError(Field.HEADER, [contract.header(g) for g in generations])
        self.sp.settings = agreed

    def _choose_vote(self, peers: list[tuple]) -> None:
        """The per-call vote channel, decided from the construction exchange (so identically everywhere):
        shared memory when every rank asked for it and loads it, else gloo. Only called when every rank is on
        one host: after construction succeeded (``_capability_verdict`` declined ``multi_host`` otherwise), or
        for a declined helper in checked mode after comparing the hosts."""
        if not all(p[7] for p in peers):
            if self._vote_request == "shm":
                logger.warning("Ulysses shared-memory vote requested but the library with the vote is missing on "
                               "some rank (per rank: %s); voting over gloo.", [p[7] for p in peers])
            return
        shm, why = ShmVote.create(self._vote, self.sp.rank_in_group, load_vote_library())
        if shm is None:  # the open failed somewhere: every rank saw the same errors and keeps gloo
            logger.warning("Ulysses shared-memory vote could not be set up (%s); voting over gloo.", why)
            return
        self._call_vote = shm

    def _capability_verdict(self, peers: list[tuple]) -> tuple[DeclineReason | None, str, list[str]]:
        """(reason, detail, each rank's own part in it) from the construction exchange; reason None: go on."""
        if not MIN_WORLD_SIZE <= self.world_size <= MAX_WORLD_SIZE:
            why = f"SP size {self.world_size} outside {MIN_WORLD_SIZE}..{MAX_WORLD_SIZE}"
            return DeclineReason.WORLD_SIZE, why, [why] * len(peers)
        declines = [(i, p[1], p[2]) for i, p in enumerate(peers) if p[1] is not None]
        if declines:
            per_rank = [f"{p[1].label} ({p[2]})" if p[1] is not None else "ok" for p in peers]
            return (min(d for _, d, _ in declines), "; ".join(f"rank {i}: {d.label} ({why})" for i, d, why in declines),
                    per_rank)
        for index, what in ((0, "transport capability"), (5, "window bytes"), (6, "GPU model")):
            values = [p[index] for p in peers]
            if any(v != values[0] for v in values):
                return (DeclineReason.PEER_DISAGREEMENT, f"ranks differ in {what}: {values}",
                        [f"{what} {v}" for v in values])
        if len({(p[3], p[4]) for p in peers}) > 1:
            hosts = [f"{p[3]}/{p[4][:8]}" for p in peers]
            return (DeclineReason.MULTI_HOST, f"ranks are on more than one host (hostname/boot id): {hosts}",
                    [f"host {h}" for h in hosts])
        return None, "", []

    def _run_steps(self) -> tuple[DeclineReason | None, str, list[str]]:
        assert self.transport is not None
        ctx = ConstructionContext(
            rank=self.sp.rank_in_group,
            world_size=self.world_size,
            device=self.device,
            window_bytes=self.window_bytes,
            max_ctas=MAX_CTAS,
            device_group=self.sp.device_group,
            all_gather_object=self._vote.all_gather_object,
        )
        error = ""
        try:
            steps = self.transport.construction_steps(ctx)
        except Exception as exc:  # noqa: BLE001 - reported collectively below
            steps, error = [], f"construction_steps: {exc}"
        names = [step.name for step in steps]
        for index, step in enumerate([*steps, None]):
            # Enter the next step only if every rank succeeded at the one before it.
            results = self._vote.all_gather_object(error)
            failed = [(i, e) for i, e in enumerate(results) if e]
            if failed:
                self.transport.abort()
                detail = "; ".join(f"rank {i}: {e}" for i, e in failed)
                where = f"step {index}/{len(names)} ({names[index - 1]})" if index else "preparing the steps"
                return (DeclineReason.CONSTRUCTION_FAILED, f"failed at {where}: {detail}",
                        [f"failed: {e}" if e else "ok" for e in results])
            if step is None:
                break
            try:
                step.run()
            except Exception as exc:  # noqa: BLE001 - a local failure is voted on, never raised alone
                error = f"{step.name}: {type(exc).__name__}: {exc}"
        return None, "", []

    def _decline_construction(self, reason: DeclineReason, detail: str, per_rank: list[str]) -> None:
        """Record the agreed decline. Logged once for the SP group, by its first rank, at WARNING, naming every
        rank's part (every rank holds the same exchange, so the others would only repeat it)."""
        self.construction_reason, self.construction_detail = reason, detail
        self.construction_per_rank = {rank: why for rank, why in zip(self.sp.ranks, per_rank, strict=True)}
        if self.sp.rank_in_group == 0 and reason is not DeclineReason.DISABLED:  # `off` is a choice, not news
            logger.warning(
                "Ulysses fused all-to-all declined at construction on SP ranks %s (%s); every call takes the NCCL "
                "route. Per rank: %s.",
                self.sp.ranks,
                reason.label,
                "; ".join(f"rank {rank}: {why}" for rank, why in self.construction_per_rank.items()),
            )
        self._logged.add(reason)  # and never again per call, on any rank

    # ------------------------------------------------------------------ per call

    @property
    def fused_available(self) -> bool:
        """True when construction succeeded collectively (per-call votes still decide each call)."""
        return self._built and not self._destroyed and self._disposed_error is None

    def _mark_vote_failed(self, why: str) -> None:
        if not self._vote.owns_group:
            self.sp.vote_failure = why  # the shared group is dead too: later helpers must not use it

    def _check_alive(self) -> None:
        if self._disposed_error is not None:
            raise HelperDisposedError(
                f"Ulysses helper gen{self.generation} was disposed after a failed vote ({self._disposed_error}); "
                "its vote group is unusable. Tear down and rebuild the process groups."
            )
        if self._destroyed:
            self._declines[DeclineReason.DISPOSED] += 1
            raise HelperDisposedError(
                f"Ulysses helper gen{self.generation} was destroyed; construct a new UlyssesHelper (collective)."
            )

    @property
    def capture_engines(self) -> tuple[str, ...]:
        """The plan kinds a CUDA-graph capture may freeze (``policy.CAPTURE_ENGINES`` by default): a capture
        plans from those rows, and a captured call whose plan is of another kind (a backward's, which is its
        forward's) declines ``cuda_graph_capture``. Set it identically on every rank (a rank that differs
        proposes another plan: every rank then declines ``peer_disagreement`` together); assigning it drops
        the plan cache."""
        return self._capture_engines

    @capture_engines.setter
    def capture_engines(self, engines: Sequence[str]) -> None:
        unknown = [e for e in engines if e not in ENGINES]
        if unknown:
            raise ValueError(f"capture_engines: {unknown} not among {ENGINES}")
        self._capture_engines = tuple(engines)
        self._plan_cache.clear()
        self._proposals.clear()

    @property
    def tuned_table(self) -> tuple[TunedRow, ...]:
        """The measured rows this helper's policy uses; assigning a new table drops the plan cache."""
        return self._tuned_table

    @tuned_table.setter
    def tuned_table(self, table: Sequence[TunedRow]) -> None:
        self._tuned_table = tuple(table)
        self._plan_cache.clear()
        self._proposals.clear()

    def plan_for(self, geom: Geometry, *, grad: bool, long_training: str | None = None,
                 capturing: bool = False) -> Choice:
        """The policy's choice for ``geom`` on this helper (pure; no vote), cached per call signature.

        The policy is a pure function of the signature and of what is fixed per helper (GPU, window,
        table, entry points), so every DiT layer after the first gets its plan from one dict lookup.
        """
        if long_training is None:
            long_training = envs.get("FASTVIDEO_ULYSSES_A2A_LONG_TRAINING")
        key = (geom, grad, long_training, capturing)
        choice = self._plan_cache.get(key)
        if choice is None:
            table = self.tuned_table
            if self.capability is not None:
                entries = self.capability.entry_points
                if ENTRY_TUNED not in entries:
                    table = ()  # an older build with only the original entry point runs the original plan
                elif ENTRY_CE not in entries or (capturing and not (
                        ENGINE_CE in self.capture_engines and ENTRY_CE_CAPTURE in entries)):
                    # A build without the copy-engine kind, or a CUDA-graph capture that may not freeze it
                    # (``capture_engines``, or a build without fvk_a2a_ce_captured): the table's SM rows
                    # apply (it lists a key's copy-engine row first, then its SM row).
                    table = tuple(row for row in table if row.engine != ENGINE_CE)
            choice = choose_plan(geom, gpu=self.gpu_name, window_bytes=self.window_bytes, grad=grad,
                                 long_training=long_training, table=table)
            if len(self._plan_cache) >= 4096:  # bounded: shapes in one job are few; a pathological job re-plans
                self._plan_cache.clear()
            self._plan_cache[key] = choice
        return choice

    def _voted_launch(self) -> bool:
        """Whether the transport takes the vote and the launch in one call over this helper's vote channel
        (decided once: both are fixed at construction)."""
        if self._voted is None:
            self._voted = self.transport is not None and self.transport.voted_launch(self._call_vote)
        return self._voted

    def _fields(self, geom: Geometry, phase: Phase, seq: int, bits: int, plan: Plan | None, capturing: bool
                ) -> list[int]:
        """This rank's 12 vote fields (``contract.py``); ``plan`` only when this rank proposes to run it."""
        fields = [0] * contract.NUM_FIELDS
        fields[Field.HEADER] = contract.header(self.generation)
        fields[Field.SEQ] = seq
        fields[Field.ELIGIBILITY] = bits
        fields[Field.MODE] = geom.mode
        fields[Field.DTYPE] = contract.dtype_code(geom.dtype)
        fields[Field.B], fields[Field.S_LOCAL], fields[Field.H], fields[Field.D] = geom.B, geom.S, geom.H, geom.D
        fields[Field.PHASE] = int(phase)
        if plan is not None:
            # A rank capturing while a peer runs eagerly differs here: every rank declines together.
            fields[Field.WINDOW_BYTES] = plan.window_bytes(geom) | (WINDOW_CAPTURED if capturing else 0)
            fields[Field.PLAN] = plan.word
        return fields

    def _geometry(self, x: torch.Tensor, mode: int) -> Geometry:
        """``Geometry.from_input`` for ``x``, cached per (shape, mode, dtype) (a dataclass build costs ~2 us)."""
        key = (x.shape, mode, x.dtype)
        geom = self._geometries.get(key)
        if geom is None:
            if len(self._geometries) >= 4096:
                self._geometries.clear()
            geom = self._geometries[key] = Geometry.from_input(x.shape, mode, self.world_size, x.dtype)
        return geom

    def _local_bits(self, x: torch.Tensor, geom: Geometry) -> int:
        bits = 0
        cap = self.capability
        if cap is not None and x.dtype not in cap.dtypes:
            bits |= DeclineReason.DTYPE.bit
        if not x.is_contiguous():
            bits |= DeclineReason.NON_CONTIGUOUS.bit
        if x.device != self.device:
            bits |= DeclineReason.DEVICE.bit
        if not bits and self.transport is not None:
            bits |= self.transport.eligibility(x)
        return bits

    def _run(
        self, x: torch.Tensor, mode: int, phase: Phase, saved: tuple[Plan | None, DeclineReason | None] | None
    ) -> tuple[torch.Tensor, Plan | None, DeclineReason | None]:
        """One call: vote, then the fused plan or the NCCL route. Returns (output, plan, decline reason)."""
        self._check_alive()
        capturing = self._capturing(x)
        if self._watchdog is not None and not capturing:
            # The background thread does this too; here it costs one event query. Not while this
            # thread captures a CUDA graph: an event query there would invalidate the capture.
            self._watchdog.poll()
        compiling = torch.compiler.is_compiling()
        # Before the sequence number moves: a settings error is raised on every rank, a re-agreement is a
        # collective every rank enters at this same call. Not inside a compile region (no host collective).
        agreed = None if compiling else self.sp.agreed_settings()
        checked = agreed is not None and agreed[CHECKED]
        geom = self._geometry(x, mode)
        seq = self._seq
        self._seq += 1
        self._calls += 1
        if self.construction_reason is not None and not checked:
            return self._decline(x, geom, seq, phase, self.construction_reason)
        if compiling:
            # A host-side vote cannot be traced; every rank traces the same region, so every rank
            # takes the (traceable) NCCL route here.
            return self._decline(x, geom, seq, phase, DeclineReason.TORCH_COMPILE)
        plan: Plan | None = None
        local_error: Exception | None = None
        if self.construction_reason is not None:
            # Checked mode on a helper that declined at construction: the call still votes (that is the
            # check), and every rank declines together with the construction's reason.
            bits = self.construction_reason.bit
        else:
            try:
                bits = self._local_bits(x, geom)
                if saved is not None:  # backward: the forward's plan, never a re-decision
                    plan, forward_reason = saved
                    if plan is None:
                        bits |= (DeclineReason.PEER_DISAGREEMENT if forward_reason is None else forward_reason).bit
                elif not bits:
                    assert agreed is not None
                    choice = self.plan_for(geom, grad=phase == Phase.FORWARD_GRAD,
                                           long_training=agreed["FASTVIDEO_ULYSSES_A2A_LONG_TRAINING"],
                                           capturing=capturing)
                    plan = choice.plan
                    if plan is None:
                        bits |= (DeclineReason.WINDOW if choice.reason is None else choice.reason).bit
                if capturing and plan is not None and not bits:
                    # Capture: the plan is frozen into the graph when its kind may be captured
                    # (``capture_engines``: also for a backward, whose plan is its forward's, chosen eagerly)
                    # and this rank's transport can capture it (no host work per call); else decline, named,
                    # on every rank.
                    assert self.transport is not None
                    why = (None if plan.engine in self.capture_engines else
                           f"the {plan.engine} plan kind is not among capture_engines {self.capture_engines}")
                    why = why or self.transport.capture_decline(geom, plan)
                    if why is not None:
                        bits |= DeclineReason.CUDA_GRAPH_CAPTURE.bit
                        self._capture_detail = why
            except Exception as exc:  # noqa: BLE001 - raised on every rank after the vote, never alone
                # Raising here alone would leave this rank a call ahead and its peers inside the vote:
                # vote the failure instead, so every rank raises together.
                local_error, plan, bits = exc, None, DeclineReason.LOCAL_ERROR.bit
        if plan is not None and not bits:
            # The fused proposal: the same 12 fields for every call of this signature but the sequence number.
            key = (geom, phase, plan, capturing)
            template = self._proposals.get(key)
            if template is None:
                if len(self._proposals) >= 4096:
                    self._proposals.clear()
                template = self._proposals[key] = self._fields(geom, phase, 0, 0, plan, capturing)
            fields = template.copy()
            fields[Field.SEQ] = seq
        else:
            fields = self._fields(geom, phase, seq, bits, None, capturing)
        out: torch.Tensor | None = None
        votes = None
        if plan is not None and not bits and not capturing and self._voted_launch():
            # The hot path: one library call exchanges the fields and, where every rank proposed this same
            # call, launches it (the one verdict that runs a plan: a launch decided there is the launch the
            # verdict below would order). Otherwise the gathered rows go to the verdict as always.
            assert self.transport is not None
            try:
                out, stage, status, seconds = self.transport.execute_voted(x, geom, plan, self._call_vote, fields)
            except VoteNotStarted as exc:
                # Nothing exchanged yet: vote this rank's failure below, so that every rank raises together.
                local_error, plan, bits = exc, None, DeclineReason.LOCAL_ERROR.bit
                fields = self._fields(geom, phase, seq, bits, None, capturing)
            except Exception as exc:
                self._launch_failed(seq, exc)
                raise
            else:
                if stage == 0:
                    error = self._call_vote.failure(status)
                    self._dispose(str(error))
                    raise error
                self._vote_s.append(seconds)
                votes = self._call_vote.rows
        if votes is None:
            start = time.perf_counter()
            try:
                votes = self._call_vote.exchange(fields)
            except VoteTimeoutError as exc:
                self._dispose(str(exc))
                raise
            self._vote_s.append(time.perf_counter() - start)
        if out is None:
            decision = contract.decide(votes)
            if decision.verdict is Verdict.RAISE:
                self._raised += 1
                assert decision.error is not None
                raise decision.error from local_error
            if decision.verdict is Verdict.DECLINE:
                assert decision.reason is not None
                return self._decline(x, geom, seq, phase, decision.reason)
            word = decision.plan_word
            plan = _plan_from_word(word)
            assert self.transport is not None
            try:
                # Every rank captures (the capture bit is in the agreed WINDOW_BYTES), or none does.
                out = (self.transport.execute_captured(x, geom, plan) if capturing
                       else self.transport.execute(x, geom, plan))
            except Exception as exc:
                self._launch_failed(seq, exc)
                raise
        else:
            word = fields[Field.PLAN]  # every rank proposed it: the agreed plan
        assert plan is not None
        if capturing:
            # Nothing ran: the graph's replays run it, unseen by the watchdog and by this helper.
            self._captured += 1
        else:
            marker = self.transport.completion_marker()
            if marker is not None:
                self._watch(InFlight(seq, self.generation, lambda: f"{phase.name.lower()}, {geom}",
                                     lambda: plan.describe(geom), marker, time.monotonic()))
        self._fused += 1
        self._plans[(word, geom)] += 1  # the agreed word: Plan.word would rebuild it
        self.history.append(CallRecord(seq, phase, mode, "fused", plan, None, plan.num_chunks(geom), capturing))
        return out, plan, None

    def _launch_failed(self, seq: int, exc: Exception) -> None:
        """A launch failed on this rank after every rank agreed to run call ``seq``: its peers have launched (or
        will launch) it and may wait at its barriers, and a later launch here could pair with their stuck call.
        This helper takes no further call (the peers' watchdogs end the processes that are stuck)."""
        self._dispose(f"the fused launch of call {seq} failed on this rank after the vote: {type(exc).__name__}: {exc}")

    def vote_caller_error(self, mode: int, phase: Phase, error: BaseException) -> NoReturn:
        """Checked mode: this rank's call failed before any collective (invalid input, a meta tensor). Vote
        ``LOCAL_ERROR`` so that every peer raises ``PeerCallError`` for this same call instead of waiting in
        it, then raise ``error`` here. Collective (one vote); always raises."""
        self._check_alive()
        seq = self._seq
        self._seq += 1
        self._calls += 1
        self._raised += 1
        fields = [0] * contract.NUM_FIELDS
        fields[Field.HEADER] = contract.header(self.generation)
        fields[Field.SEQ] = seq
        fields[Field.ELIGIBILITY] = DeclineReason.LOCAL_ERROR.bit
        fields[Field.MODE] = mode
        fields[Field.PHASE] = int(phase)
        try:
            self._call_vote.exchange(fields)
        except VoteTimeoutError as exc:
            self._dispose(str(exc))
            raise error from exc
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"Ulysses checked mode: voted on SP ranks {self.sp.ranks}; every peer raises "
                           "PeerCallError for this call.")
        raise error

    def _watch(self, call: InFlight) -> None:
        if self._watchdog is None:
            store = _default_store()
            probe = None
            if store is not None:
                probe = StoreProbe(store, self.sp.ranks, self.sp.ranks[self.sp.rank_in_group],
                                   key="-".join(map(str, self.sp.ranks)),
                                   wait_s=min(5.0, max(2.0, self.watchdog_timeout_s / 2)))
            self._watchdog = FusedCallWatchdog(self.watchdog_timeout_s, rank=self.sp.ranks[self.sp.rank_in_group],
                                               ranks=self.sp.ranks, on_timeout=self._on_watchdog_timeout, probe=probe,
                                               thread_setup=getattr(self.transport, "watchdog_thread_setup", None))
        self._watchdog.track(call)

    def _decline(
        self, x: torch.Tensor, geom: Geometry, seq: int, phase: Phase, reason: DeclineReason
    ) -> tuple[torch.Tensor, None, DeclineReason]:
        self._declines[reason] += 1
        if reason not in self._logged and reason is not DeclineReason.DISABLED:
            self._logged.add(reason)
            logger.warning(
                "Ulysses fused all-to-all declined (%s) for %s; using the NCCL route. %s",
                reason.label,
                geom,
                f"Under CUDA-graph capture the plan could not be frozen on some rank (here: "
                f"{self._capture_detail or 'a peer could not'}); the NCCL route is captured."
                if reason is DeclineReason.CUDA_GRAPH_CAPTURE
                else "Run `python -m fastvideo.distributed.ulysses explain` for details.",
            )
        self.history.append(CallRecord(seq, phase, geom.mode, "nccl", None, reason, 0))
        return nccl_route(x, geom.mode, self.sp.device_group), None, reason

    def all_to_all(self, x: torch.Tensor, mode: int) -> torch.Tensor:
        """The Ulysses all-to-all through this helper. Collective; differentiable.

        The backward runs the inverse with the plan its forward ran and still votes.
        """
        validate_input(x, mode, self.world_size)
        if torch.is_grad_enabled() and x.requires_grad:
            return _HelperAllToAll.apply(x, mode, self)
        return self._run(x, mode, Phase.FORWARD_NO_GRAD, None)[0]

    # ------------------------------------------------------------------ reporting and lifecycle

    def stats(self) -> dict:
        """Counts since construction: calls, fused runs, declines by reason, plans that ran, vote cost."""
        votes = sorted(self._vote_s)
        return {
            "generation": self.generation,
            "world_size": self.world_size,
            "transport": self.capability.name if self.capability else None,
            "construction": self.construction_reason.label
            if self.construction_reason is not None
            else ("ok" if self._built else "n/a"),
            "construction_detail": self.construction_detail,
            "construction_per_rank": dict(self.construction_per_rank),
            "calls": self._calls,
            "fused": self._fused,
            "captured": self._captured,  # fused launches captured into CUDA graphs (counted in "fused")
            "raised": self._raised,
            "declines": {r.label: n for r, n in sorted(self._declines.items())},
            "plans": dict(Counter({Plan.from_word(w).describe(g): n for (w, g), n in self._plans.items()})),
            "vote": "shm" if isinstance(self._call_vote, ShmVote) else "gloo",
            "voted_launch": self.fused_available and self._voted_launch(),  # the vote and the launch in one call
            "vote_us_median": statistics.median(votes) * 1e6 if votes else None,
            "vote_us_p90": votes[int(0.9 * (len(votes) - 1))] * 1e6 if votes else None,
            "in_flight": self._watchdog.in_flight() if self._watchdog is not None else 0,
            "disposed": self._disposed_error is not None,
            "destroyed": self._destroyed,
        }

    def vote_seconds(self, last: int | None = None) -> list[float]:
        """Host seconds of the most recent ``last`` votes (all kept, up to 4096): for benchmarks."""
        votes = list(self._vote_s)
        return votes if last is None else votes[-last:]

    def _dispose(self, why: str) -> None:
        self._disposed_error = why
        self._mark_vote_failed(why)
        if self.transport is not None:
            self.transport.abort()
        self._declines[DeclineReason.DISPOSED] += 1

    def destroy(self) -> None:
        """Release the transport and the vote group. Collective over the SP group; a second call is a no-op."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._built and self._disposed_error is None and self.transport is not None:
            self.transport.destroy()
        self._built = False
        if self._call_vote is not self._vote:
            self._call_vote.destroy()
        self._vote.destroy()


@functools.lru_cache(maxsize=1024)
def _plan_from_word(word: int) -> Plan:
    """Plans are immutable: one object per agreed word (no validation and allocation per call)."""
    return Plan.from_word(word)


def forward_code(plan: Plan | None, reason: DeclineReason | None) -> int:
    """What a forward ran, as one int for its backward: the fused plan word (> 0), or ``-1 - reason`` (< 0)
    when it declined. (0 is the public op's ``off`` route, which has no helper.)"""
    if plan is not None:
        return plan.word
    return -1 - int(reason if reason is not None else DeclineReason.PEER_DISAGREEMENT)


def forward_from_code(code: int) -> tuple[Plan | None, DeclineReason | None]:
    """The inverse of ``forward_code`` (``code`` != 0): ``_run``'s ``saved`` argument for the backward."""
    if code > 0:
        return _plan_from_word(code), None
    return None, DeclineReason(-1 - code)


class _HelperAllToAll(torch.autograd.Function):
    """Forward saves the plan it ran (or its decline reason); backward runs the inverse with it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mode: int, helper: UlyssesHelper) -> torch.Tensor:  # type: ignore[override]
        out, plan, reason = helper._run(x, mode, Phase.FORWARD_GRAD, None)
        ctx.helper, ctx.mode, ctx.saved_plan = helper, mode, (plan, reason)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out, _, _ = ctx.helper._run(grad.contiguous(), 1 - ctx.mode, Phase.BACKWARD, ctx.saved_plan)
        return out, None, None


# ---------------------------------------------------------------------- the op's default helpers

_DEFAULT: UlyssesHelper | None = None
_CHECKED_OFF: UlyssesHelper | None = None  # the `off` route's helper in checked mode: votes only


def get_default_helper() -> UlyssesHelper:
    """The helper the public op uses under ``auto``; built (collectively) on first use."""
    global _DEFAULT
    sp = get_sp_group()
    if _DEFAULT is None or _DEFAULT._destroyed or _DEFAULT.sp is not sp:
        install_default_helper(UlyssesHelper(sp))
    assert _DEFAULT is not None
    return _DEFAULT


def current_default_helper() -> UlyssesHelper | None:
    """The helper the public op uses under ``auto``, if one exists (never builds one)."""
    return _DEFAULT


def get_checked_off_helper() -> UlyssesHelper:
    """The helper that votes the ``off`` route's calls in checked mode (``disabled=True``: no transport, never
    fused); built (collectively: one exchange) on first use, destroyed with its SP group."""
    global _CHECKED_OFF
    sp = get_sp_group()
    if _CHECKED_OFF is None or _CHECKED_OFF._destroyed or _CHECKED_OFF.sp is not sp:
        _CHECKED_OFF = UlyssesHelper(sp, disabled=True)
        sp.add_teardown("ulysses.checked_off_helper", destroy_checked_off_helper)
    return _CHECKED_OFF


def destroy_checked_off_helper() -> None:
    """Collective: destroy the ``off`` route's checked-mode helper, if any."""
    global _CHECKED_OFF
    if _CHECKED_OFF is not None:
        _CHECKED_OFF.destroy()
    _CHECKED_OFF = None


def install_default_helper(helper: UlyssesHelper | None) -> None:
    """Make ``helper`` the one the public op uses (tests inject one built on a CPU transport).

    Its SP group destroys it (collectively) in ``destroy_sequence_parallel``, before the groups go.
    """
    global _DEFAULT
    _DEFAULT = helper
    if helper is not None:
        helper.sp.add_teardown("ulysses.default_helper", destroy_default_helper)


def destroy_default_helper() -> None:
    """Collective: destroy the op's helper, if any."""
    global _DEFAULT
    if _DEFAULT is not None:
        _DEFAULT.destroy()
    _DEFAULT = None


def set_transport_factory(factory: Callable[[torch.device], Transport | None] | None) -> None:
    """Override how helpers find their transport (``None`` restores the default: native on CUDA)."""
    global _TRANSPORT_FACTORY
    _TRANSPORT_FACTORY = factory if factory is not None else _default_transport
