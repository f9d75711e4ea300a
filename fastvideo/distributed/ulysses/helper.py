"""The Ulysses helper: one object per SP group that owns the fused route's runtime and decides every call.

Layers go one way: the op (``ops.py``) calls the helper; the helper calls the routes below it (``nccl.py``, the
transports), which import nothing above them. Construction (``construction.py``) agrees collectively on
capability, host identity and settings; every call then exchanges its 12-field contract (``contract.py``) and
acts on the verdict every rank computes from the same votes: run the agreed plan, decline together to the
NCCL route, or raise the same error on every rank. A helper acts on the settings agreed at its construction
(and re-agreements it follows), never on the environment read per call. A vote that fails (timeout, dead
peer) disposes the helper: its vote group is unusable, and every later call raises.

    helper = UlyssesHelper(get_sp_group())           # collective
    y = helper.all_to_all(x, mode=0)                  # collective, host-blocking vote (the op is differentiable)
    helper.stats()                                    # counts, declines by reason, plans that ran
    helper.destroy()                                  # collective
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from fastvideo.distributed import settings as _settings
from fastvideo.distributed.parallel_state import GroupCoordinator, get_sp_group
from fastvideo.distributed.ulysses import contract, lifecycle, mismatch, planner
from fastvideo.distributed.ulysses import hot as hot_path
from fastvideo.distributed.ulysses.construction import (
    adopt,
    construct,
    default_transport,
    host_identity,
    limits,
)
from fastvideo.distributed.ulysses.contract import DeclineReason, Field, Phase, Verdict
from fastvideo.distributed.ulysses.layout import EVEN, Splits, mode_for_dims, validate_input
from fastvideo.distributed.ulysses.lifecycle import HelperDisposedError
from fastvideo.distributed.ulysses.nccl import nccl_route
from fastvideo.distributed.ulysses.planner import PlanConfig, Planner, Proposal, Signature
from fastvideo.distributed.ulysses.policy import CAPTURE_ENGINES, TUNED_TABLE, Choice, Geometry, TunedRow
from fastvideo.distributed.ulysses.stats import CallRecord, CallStats, report
from fastvideo.distributed.ulysses.transport import Transport, VoteNotStarted
from fastvideo.distributed.ulysses.vote import GlooVote, VoteError
from fastvideo.distributed.ulysses.watchdog import FusedCallWatchdog, InFlight, end_process

logger = logging.getLogger(__name__)

__all__ = ["CallRecord", "HelperDisposedError", "UlyssesHelper", "host_identity", "live_helper"]


_IDS = itertools.count(1)
# Read on every call: module constants, not enum attribute lookups.
_FORWARD_NO_GRAD, _FORWARD_GRAD, _BACKWARD = Phase.FORWARD_NO_GRAD, Phase.FORWARD_GRAD, Phase.BACKWARD
_PLAN = int(Field.PLAN)
# The current stream's capture status in one call (``torch.cuda.is_current_stream_capturing`` wraps it). Asked only
# for CUDA tensors: a CPU build's placeholder for it is never called; a build without it takes the wrapper.
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
TAGS_WARN = 4096  # distinct call tags per helper past which a warning says tags name call sites, not calls
_LIVE: weakref.WeakValueDictionary[int, UlyssesHelper] = weakref.WeakValueDictionary()


def live_helper(helper_id: int) -> UlyssesHelper:
    """The helper with ``helper_id`` (``UlyssesHelper.id``); HelperDisposedError when it was destroyed."""
    helper = _LIVE.get(helper_id)
    if helper is not None:
        helper._check_alive()  # a destroyed or disposed helper raises (and counts it)
        return helper
    raise HelperDisposedError(
        f"Ulysses helper #{helper_id} no longer exists. A backward must run before the helper (or the SP groups) "
        "it ran its forward on is rebuilt; a helper's calls must be made while it lives."
    )


def stream_capturing(x: torch.Tensor) -> bool:
    """Whether this call is being captured into a CUDA graph (its device's current stream is capturing)."""
    return x.is_cuda and _is_capturing()


class UlyssesHelper:
    """Decides, identically on every SP rank, whether each call takes the fused route and how.

    Construction and ``destroy()`` are collective over the SP group, blocking, not capture-safe; every
    argument must be the same on every rank unless it says otherwise. Under CUDA-graph capture every rank
    votes once, at capture, and where every rank's transport can freeze the agreed plan the fused launch is
    captured with it; otherwise every rank declines ``cuda_graph_capture`` together and the NCCL route is
    captured. Replays do no host work (``docs/compile_and_cuda_graphs.md``).

    Args:
        sp: the SP group (default: the registered one).
        transport: the fused transport (default: the native one on CUDA, none on CPU). Rank-local object; its
            capability must match on every rank or construction declines.
        window_bytes: registered window per rank (default ``FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES``).
        vote_timeout_s: bound on each construction exchange and per-call vote (default
            ``FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S``). May differ per rank.
        tuned_table: the measured rows the policy plans from.
        gpu_name: the GPU model (default: the device's name).
        identity: (hostname, boot id) of this rank; rank-local by nature (tests fake hosts with it).
        history: call records kept (rank-local).
        vote: per-call vote channel, ``auto`` (shared memory on one host where every rank loads it), ``shm``,
            ``gloo``.
        watchdog_timeout_s: a launched call incomplete for longer ends the process (default
            ``FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S``, else the vote timeout). May differ per rank.
        on_watchdog_timeout: the watchdog's action (default: log and exit); rank-local.
        disabled: the ``off`` route's helper: no transport, it only votes (checked mode).
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
        self.sp = sp if sp is not None else get_sp_group()
        if self.sp.vote_failure is not None:
            raise HelperDisposedError(
                f"UlyssesHelper: the vote group of SP ranks {self.sp.ranks} failed earlier ({self.sp.vote_failure}) "
                "and a gloo group is unusable after a failure: call destroy_sequence_parallel() and "
                "initialize_sequence_parallel() on every rank to rebuild it."
            )
        self.disabled = disabled
        self.id = next(_IDS)  # process-wide: the op's saved outcome names the helper its backward must use
        self.world_size = self.sp.world_size
        self.device = self.sp.device
        # Per SP group, so identical on every rank; in every vote's HEADER: a stale helper is a loud mismatch.
        self.generation = self.sp.next_generation()
        self._window_from_settings = window_bytes is None
        self.window_bytes, timeout, self.watchdog_timeout_s = limits(window_bytes, vote_timeout_s, watchdog_timeout_s,
                                                                     self.sp.timeout_s)
        self.gpu_name = gpu_name if gpu_name is not None else (
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu")
        self.transport = None if disabled else (transport if transport is not None else default_transport(self.device))
        self._stats = CallStats(history)
        self._seq = 0
        # Per call-site tag: [count per phase (3), SEQ word of call 0 per phase (3)] (``contract.tag_bases``, hashed
        # once per tag). A tagged call's SEQ is its tag's own count, so a rank that skips or repeats one differs.
        self._tags: dict[str, list[int]] = {}
        self._destroyed = False
        self._disposed_error: str | None = None
        self._logged: set[DeclineReason] = set()
        self._capture_detail = ""  # why the last capture on this rank could not freeze its plan (for the log)
        # Whether a call is being captured into a CUDA graph (tests force it on CPU); rank-local.
        self._capturing: Callable[[torch.Tensor], bool] = stream_capturing
        self._on_watchdog_timeout = on_watchdog_timeout or end_process
        self._watchdog: FusedCallWatchdog | None = None  # built at the first launch that leaves work in flight
        self._hot = None  # the transport's hot path (hot.HotPath) once it holds a signature; None: every call Python
        # Reusable state must not depend on the grad mode of the call that builds the helper lazily: buffers
        # made under inference mode are inference tensors, which no later call outside it may update.
        with torch.inference_mode(False):
            # Construction always runs over the SP group's vote group (created once with the group: rebuilding
            # helpers creates no process group); the per-call vote may move to shared memory.
            self._vote = GlooVote(self.sp.ranks, timeout, group=self.sp.vote_group)
            try:
                built = construct(self.sp, self.transport, self._vote, disabled=disabled,
                                  window_bytes=self.window_bytes, gpu_name=self.gpu_name,
                                  generation=self.generation, identity=identity, vote_request=vote)
            except VoteError as exc:
                self._dispose(str(exc))
                raise
        adopt(self, built)  # capability, construction outcome, checked mode, per-call vote channel
        cap = self.capability
        self.planner = Planner(
            PlanConfig(self.world_size, self.generation, self.gpu_name, self.window_bytes, self._long_training, (),
                       (), CAPTURE_ENGINES, cap.dtypes, self.device, self.construction_reason,
                       self.transport.capture_decline if self.transport is not None else None),
            tuned_table, cap.entry_points if cap.present else None)
        self.planner.on_replan = lambda: hot_path.forget(self)  # the hot path holds proposals: they may change
        _LIVE[self.id] = self

    def follow(self, agreed: _settings.AgreedSettings) -> bool:
        """Local; called on every rank alike after a re-agreement changed the settings: take the new checked mode
        and long-training policy (a replan). Returns False when this helper cannot follow (its window came from the
        settings and changed: it must be rebuilt)."""
        if self._window_from_settings and agreed["FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES"] != self.window_bytes:
            return False
        self.checked = bool(agreed[_settings.CHECKED])
        self._votes = self._built or self.checked
        self.planner.long_training = agreed["FASTVIDEO_ULYSSES_A2A_LONG_TRAINING"]
        return True

    # ------------------------------------------------------------------ the call

    def call(self, x: torch.Tensor, mode: int, grad: bool = False, outcome: int | None = None, *,
             fallback: bool = True, splits: Splits = EVEN, tag: str | None = None) -> tuple[torch.Tensor | None, int]:
        """One call on validated input: propose, vote, decide (``_decide``), execute, record. Collective; blocks the
        host for the vote; capture-safe (one vote at capture, see the class). Not differentiable (the op is).

        ``grad``: the call is recorded by autograd (the vote's PHASE; the long-training policy). ``outcome``: for a
        backward, its forward's ``contract.outcome_code`` (it runs that plan, never a re-decision). ``splits``: the
        tables ``validate_input`` returned (part of the vote: ranks whose tables differ raise together). Returns
        ``(output, outcome code)``; with ``fallback=False`` a declined call returns ``(None, code)`` instead of
        running the NCCL route. ``tag`` (a non-empty str, ``contract.check_tag``): the call site; the vote's SEQ is
        then the tag's own count for this phase, so a rank that skips or repeats a tagged call raises on every rank.
        A call that raises is not counted for its tag (on every rank alike)."""
        if self._disposed_error is not None or self._destroyed:
            self._check_alive()  # raises
        phase = _BACKWARD if outcome is not None else _FORWARD_GRAD if grad else _FORWARD_NO_GRAD
        seq = word = self._seq
        self._seq += 1  # also the call count (``stats()["calls"]``)
        if tag is not None:  # one dict lookup; the digest was computed at the tag's first call
            entry = self._tags.get(tag) or self._new_tag(tag)
            count = entry[phase]
            entry[phase] = count + 1
            word = entry[phase + 3] ^ count
        if not self._votes:  # declined at construction (agreed), checked mode off: no call needs a vote
            return self._declined(x, mode, seq, phase, self.construction_reason, fallback, splits, tag=tag)
        hot = self._hot  # 1-2 in one native call for a signature launched fused before (hot.py); else None
        hit = (hot.run(x, mode, word) if hot is not None and phase is _FORWARD_NO_GRAD and splits is EVEN
               and self._capturing is stream_capturing else None)  # (a test's capture stand-in: the Python path)
        if hit is not None:
            capturing, proposal = False, hot.proposal(hit[1])
            self._stats.hot += 1
            out, rows, error = self._vote_and_launch(x, proposal, word, seq, hit)
        else:
            capturing = self._capturing(x)
            # 1. propose: pure, cached per signature (the key holds a Signature's fields: equal to it, hashed alike)
            key = (x.shape, x.dtype, x.device, mode, phase, outcome, capturing, x.is_contiguous(),
                   x.data_ptr() % x.element_size() == 0, splits)
            proposal = self.planner.cache.get(key) or self._propose(Signature._make(key))
            # 2. vote (and, where the transport fuses them, launch in the same library call)
            out, error = None, proposal.error
            if proposal.plan is not None and self._fused_vote and not capturing:
                out, rows, error = self._vote_and_launch(x, proposal, word, seq)
                if out is not None and self._hot_ok and phase is _FORWARD_NO_GRAD and splits is EVEN:
                    hot_path.learn(self, x, proposal)  # its later calls take the hot path
            else:
                rows = self._exchange(contract.with_seq(proposal.fields, word))
        if out is None:
            # 3. decide: the same verdict on every rank (a RAISE raises here, on every rank)
            decision = self._decide(rows, proposal, seq, phase, tag, error)
            if decision.verdict is Verdict.DECLINE:
                return self._declined(x, mode, seq, phase, decision.reason, fallback, splits, proposal.why, tag)
            # 4. execute: every rank runs (or captures) this plan: the capture bit is in the agreed fields
            out = self._execute(x, proposal, seq, capturing)
        # 5. record (after the launch: the device is already moving the data)
        self._stats.ran(seq, phase, proposal, capturing, tag)
        if not capturing:  # a capture runs nothing: the graph's replays are unseen by the watchdog
            marker = self.transport.completion_marker()
            if marker is not None:
                self._watch(InFlight(seq, self.generation,
                                     lambda: f"{phase.name.lower()}{f', tag {tag!r}' if tag else ''}, {proposal.geom}",
                                     lambda: proposal.plan.describe(proposal.geom), marker, time.monotonic()))
        return out, proposal.fields[_PLAN]

    def _decide(self, rows: torch.Tensor, proposal: Proposal, seq: int, phase: Phase, tag: str | None,
                error: BaseException | None) -> contract.Decision:
        """Step 3 of a call, where its gathered votes become the verdict every rank computes alike: RUN or DECLINE
        is returned, RAISE raised (``mismatch.raised``; ``error``: this rank's own, if it voted ``LOCAL_ERROR``)."""
        decision = contract.decide(rows)
        if decision.verdict is not Verdict.RAISE:
            return decision
        raise mismatch.raised(self, decision.error, proposal, seq, phase, tag, error) from error

    def _new_tag(self, tag: str) -> list[int]:
        """The first call tagged ``tag``: its counts and per-phase SEQ words (hashed here, once per tag)."""
        contract.check_tag(tag, "UlyssesHelper.call")
        entry = [0, 0, 0, *contract.tag_bases(tag)]
        self._tags[tag] = entry
        if len(self._tags) == TAGS_WARN:
            logger.warning("Ulysses helper gen%d has seen %d distinct call tags: a tag should name a call site "
                           "(e.g. 'blocks.3.attn.qkv'), not a call; each one is kept for the helper's life.",
                           self.generation, TAGS_WARN)
        return entry

    def _propose(self, sig: Signature) -> Proposal:
        try:
            return self.planner.propose(sig)
        except Exception as exc:  # noqa: BLE001 - voted, raised on every rank after the vote, never alone
            row = contract.fields(self.generation, 0, DeclineReason.LOCAL_ERROR.bit, sig.mode, sig.dtype,
                                  tuple(sig.shape), sig.phase)
            return Proposal(None, None, tuple(row), "", exc)

    def _exchange(self, fields: list[int]) -> torch.Tensor:
        """Gather every rank's fields (collective); a failed vote disposes the helper and raises."""
        try:
            rows = self._call_vote.exchange(fields)
        except VoteError as exc:
            self._dispose(str(exc))
            raise
        self._stats.vote_s.append(self._call_vote.last_s)
        return rows

    def _vote_and_launch(self, x: torch.Tensor, proposal: Proposal, word: int, seq: int, hit: tuple | None = None
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None, BaseException | None]:
        """One library call votes (the proposal's fields, SEQ = ``word``) and, where every rank proposed this same
        call, launches: the transport's voted ``execute``, or (``hit``) the hot path's, already made. Returns
        (output, None, None) when it launched, else (None, the gathered votes, a local error)."""
        try:
            out = (self.transport.execute(x, proposal.geom, proposal.plan, vote=self._call_vote,
                                          fields=proposal.fields, seq=word) if hit is None
                   else self._hot.finish(x, hit, self._call_vote))
        except VoteNotStarted as exc:
            # This rank has not voted yet: vote its failure, so that every rank raises together.
            fields = contract.with_seq(proposal.fields, word)
            fields[Field.ELIGIBILITY] = DeclineReason.LOCAL_ERROR.bit
            fields[Field.WINDOW_BYTES] = fields[Field.PLAN] = 0
            return None, self._exchange(fields), exc
        except VoteError as exc:
            self._dispose(str(exc))
            raise
        except Exception as exc:
            lifecycle.launch_failed(self, seq, exc)
            raise
        self._stats.vote_s.append(self._call_vote.last_s)
        return out, (None if out is not None else self._call_vote.rows), None

    def _execute(self, x: torch.Tensor, proposal: Proposal, seq: int, capture: bool) -> torch.Tensor:
        try:
            return self.transport.execute(x, proposal.geom, proposal.plan, capture=capture)
        except Exception as exc:
            lifecycle.launch_failed(self, seq, exc)
            raise

    def _declined(self, x: torch.Tensor, mode: int, seq: int, phase: Phase, reason: DeclineReason, fallback: bool,
                  splits: Splits, why: str = "", tag: str | None = None) -> tuple[torch.Tensor | None, int]:
        self._stats.declined(seq, phase, mode, reason, tag)
        if why:
            self._capture_detail = why
        if reason not in self._logged and reason is not DeclineReason.DISABLED:
            self._logged.add(reason)
            logger.warning(
                "Ulysses fused all-to-all declined (%s) for input %s %s, mode %d; using the NCCL route. %s",
                reason.label, tuple(x.shape), x.dtype, mode,
                f"Under CUDA-graph capture the plan could not be frozen on some rank (here: {why or 'a peer could not'}"
                "); the NCCL route is captured." if reason is DeclineReason.CUDA_GRAPH_CAPTURE
                else "Run `python -m fastvideo.distributed.ulysses explain` for details.")
        code = contract.outcome_code(0, reason)
        if not fallback:
            return None, code
        return nccl_route(x, mode, self.sp.device_group, splits=splits), code

    # Checked mode: this rank's call failed before any collective (invalid input); every peer raises for it too.
    vote_caller_error = mismatch.vote_caller_error

    def _watch(self, call: InFlight) -> None:
        if self._watchdog is None:
            self._watchdog = FusedCallWatchdog.for_group(
                self.watchdog_timeout_s, self.sp.ranks, self.sp.rank_in_group, self._on_watchdog_timeout,
                self.transport.watchdog_thread_setup)
        self._watchdog.track(call)
        self._watchdog.poll()  # the background thread polls too; this drops what completed and catches a stuck
        # earlier call at the next one (never under capture: an event query would invalidate it)

    # ------------------------------------------------------------------ public calls

    def all_to_all(self, x: torch.Tensor, mode: int, *, seq_splits: Sequence[int] | None = None,
                   head_splits: Sequence[int] | None = None, tag: str | None = None) -> torch.Tensor:
        """The Ulysses all-to-all through this helper: collective; blocks the host for the vote; capture-safe.

        ``seq_splits`` / ``head_splits``: every rank's shares, the same on every rank (None: even; see
        ``layout``); ``tag``: the call site (``call``). Not differentiable itself: autograd goes through the one op
        (the public function, or ``ops.all_to_all(x, mode, helper=this)`` for this helper), whose backward runs the
        inverse with the plan its forward ran and still votes. A call autograd would record raises instead of losing
        the gradient."""
        try:  # a caller error is voted in checked mode (mismatch.caller_error), so that every rank raises
            splits = validate_input(x, mode, self.world_size, self.sp.rank_in_group, seq_splits, head_splits)
            contract.check_tag(tag, "UlyssesHelper.all_to_all")
        except (TypeError, ValueError, RuntimeError) as exc:
            mismatch.caller_error(self, x, mode, exc)
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(
                "UlyssesHelper.all_to_all is not differentiable and x requires grad: call "
                "fastvideo.distributed.ulysses.ops.all_to_all(x, mode, helper=helper) (or the public "
                "sequence_model_parallel_all_to_all_4D), or run it under torch.no_grad()."
            )
        return self.call(x, mode, splits=splits, tag=tag)[0]

    def try_all_to_all_4D(self, x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1, *,
                          seq_splits: Sequence[int] | None = None, head_splits: Sequence[int] | None = None,
                          tag: str | None = None) -> torch.Tensor | None:
        """The fused route or nothing: collective; blocks the host for the vote; capture-safe; not differentiable.
        Returns the output, or None on every rank when every rank declined (the caller then runs the NCCL
        route). Every rank must call it with matching tensors, split tables and tags, in the same order."""
        mode = -1  # in the vote of an invalid dim pair
        try:
            mode = mode_for_dims(scatter_dim, gather_dim)
            splits = validate_input(x, mode, self.world_size, self.sp.rank_in_group, seq_splits, head_splits)
            contract.check_tag(tag, "UlyssesHelper.try_all_to_all_4D")
        except (TypeError, ValueError, RuntimeError) as exc:
            mismatch.caller_error(self, x, mode, exc)
        return self.call(x, mode, torch.is_grad_enabled() and x.requires_grad, fallback=False, splits=splits,
                         tag=tag)[0]

    # ------------------------------------------------------------------ configuration (set identically on every rank)

    tuned_table = planner.delegate("table", "The measured rows this helper's policy plans from.")
    capture_engines = planner.delegate(
        "capture_engines", "The plan kinds a CUDA-graph capture may freeze (``policy.CAPTURE_ENGINES`` by default): a "
        "capture plans from those rows, and a captured call whose plan is of another kind (a backward's, which is "
        "its forward's) declines ``cuda_graph_capture``.")
    long_training = planner.delegate(
        "long_training", "The long-training policy this helper plans with (``auto`` or ``chunked``): the agreed "
        "``FASTVIDEO_ULYSSES_A2A_LONG_TRAINING`` by default, and again after each re-agreement.")

    def plan_for(self, geom: Geometry, *, grad: bool, long_training: str | None = None,
                 capturing: bool = False) -> Choice:
        """The policy's choice for ``geom`` on this helper: local, pure, no vote (``long_training``: default the
        helper's)."""
        return self.planner.choose(geom, grad=grad, capturing=capturing, long_training=long_training)

    # ------------------------------------------------------------------ reporting and lifecycle

    @property
    def history(self):
        """The last ``history`` call records (``CallRecord``), oldest first."""
        return self._stats.history

    @property
    def fused_available(self) -> bool:
        """True when construction succeeded collectively (per-call votes still decide each call)."""
        return self._built and not self._destroyed and self._disposed_error is None

    def stats(self) -> dict:
        """Local: counts since construction (calls, fused runs, declines by reason, plans that ran, vote cost)."""
        return report(self)

    def vote_seconds(self, last: int | None = None) -> list[float]:
        """Local: host seconds of the most recent ``last`` votes (all kept, up to 4096), for benchmarks."""
        votes = list(self._stats.vote_s)
        return votes if last is None else votes[-last:]

    def _check_alive(self) -> None:
        lifecycle.check_alive(self)

    def _dispose(self, why: str) -> None:
        lifecycle.dispose(self, why)

    def destroy(self) -> None:
        """Release the transport and the vote channel. Collective over the SP group; blocking; not capture-safe;
        a second call is a no-op."""
        lifecycle.destroy(self)

    close = destroy  # upstream FastVideo's name for it
