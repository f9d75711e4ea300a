"""The Ulysses helper: one object per SP group that owns the fused route's runtime and decides every call.

Layers go one way: the op (``ops.py``) calls the helper; the helper calls the routes below it (the transports, the
NCCL route), which import nothing above them. Construction (``construction.py``) agrees collectively on
capability, host identity and settings; every call then exchanges its 12-field contract (``contract.py``) and acts
on the verdict every rank computes from the same votes: run the agreed plan, decline together to the NCCL route,
or raise the same error on every rank. A helper acts on the settings agreed at its construction (and
re-agreements it follows), never on the environment read per call. A vote that fails (timeout, dead peer) disposes
the helper: its vote group is unusable, and every later call raises.

The helper's state lives with the objects it owns and names: ``TagCounter`` (``sequence.py``: tagged SEQ words),
``Runtime`` (``runtime.py``: transport, vote channels, watchdog, the failure rules; disposed or destroyed), ``HotLane``
(``hot.py``), ``CallStats`` (``stats.py``) and the ``Planner`` (``planner.py``).

    helper = UlyssesHelper(get_sp_group())           # collective
    y = helper.all_to_all(x, mode=0)                  # collective, host-blocking vote (the op is differentiable)
    helper.stats()                                    # counts, declines by reason, plans that ran
    helper.destroy()                                  # collective
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from fastvideo.distributed import settings as _settings
from fastvideo.distributed.all_to_all import EVEN, Splits, mode_for_dims, nccl_route, validate_input
from fastvideo.distributed.sp_groups import GroupCoordinator, get_sp_group
from fastvideo.distributed.ulysses import contract, mismatch, planner
from fastvideo.distributed.ulysses.construction import construct, default_transport, host_identity, limits
from fastvideo.distributed.ulysses.contract import DeclineReason, Field, Phase, Verdict
from fastvideo.distributed.ulysses.hot import HotLane
from fastvideo.distributed.ulysses.planner import PlanConfig, Planner, Proposal, Signature
from fastvideo.distributed.ulysses.policy import CAPTURE_ENGINES, TUNED_TABLE, Choice, Geometry, TunedRow
from fastvideo.distributed.ulysses.runtime import HelperDisposedError, Runtime, stream_capturing
from fastvideo.distributed.ulysses.sequence import TagCounter
from fastvideo.distributed.ulysses.stats import CallRecord, CallStats
from fastvideo.distributed.ulysses.transport import Transport
from fastvideo.distributed.ulysses.vote import GlooVote, VoteError
from fastvideo.distributed.ulysses.watchdog import InFlight, end_process

__all__ = ["CallRecord", "HelperDisposedError", "UlyssesHelper", "host_identity", "live_helper"]

_IDS = itertools.count(1)
# Read on every call: module constants, not enum attribute lookups.
_FORWARD_NO_GRAD, _FORWARD_GRAD, _BACKWARD = Phase.FORWARD_NO_GRAD, Phase.FORWARD_GRAD, Phase.BACKWARD
_PLAN, _SEQ = int(Field.PLAN), int(Field.SEQ)
_LIVE: weakref.WeakValueDictionary[int, UlyssesHelper] = weakref.WeakValueDictionary()


def live_helper(helper_id: int) -> UlyssesHelper:
    """The helper with ``helper_id`` (``UlyssesHelper.id``), or HelperDisposedError when it no longer exists (a
    destroyed or disposed one that still exists raises at its call)."""
    helper = _LIVE.get(helper_id)
    if helper is not None:
        return helper
    raise HelperDisposedError(
        f"Ulysses helper #{helper_id} no longer exists. A backward must run before the helper (or the SP groups) "
        "it ran its forward on is rebuilt; a helper's calls must be made while it lives.")


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
        capturing: whether a call is being captured into a CUDA graph (default: its device's current stream is
            capturing); rank-local (simulations force it on CPU).
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
        capturing: Callable[[torch.Tensor], bool] = stream_capturing,
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
                "initialize_sequence_parallel() on every rank to rebuild it.")
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
        self._capturing = capturing
        self._calls = 0  # every call takes one number, whatever its route or outcome (``stats()["calls"]``)
        self._tags = TagCounter(self.generation)
        self._stats = CallStats(history)
        # Reusable state must not depend on the grad mode of the call that builds the helper lazily: buffers
        # made under inference mode are inference tensors, which no later call outside it may update.
        with torch.inference_mode(False):
            # Construction always runs over the SP group's vote group (created once with the group: rebuilding
            # helpers creates no process group); the per-call vote may move to shared memory.
            vote_group = GlooVote(self.sp.ranks, timeout, group=self.sp.vote_group)
            self._runtime = Runtime(self.sp, self.generation, self.transport, vote_group, self._stats,
                                    self.watchdog_timeout_s, on_watchdog_timeout or end_process)
            try:
                built = construct(self.sp, self.transport, vote_group, disabled=disabled,
                                  window_bytes=self.window_bytes, gpu_name=self.gpu_name,
                                  generation=self.generation, identity=identity, vote_request=vote)
            except VoteError as exc:
                self._runtime.dispose(str(exc))
                raise
        self.capability = cap = built.capability
        self.construction_reason, self.construction_detail = built.reason, built.detail
        self.construction_per_rank = built.per_rank
        self._stats.logged(built.reason)  # logged once at construction, never again per call
        self._runtime.built, self._runtime.call_vote = built.built, built.call_vote
        agreed = self.sp.settings  # as construction agreed them
        self.checked = bool(agreed[_settings.CHECKED])
        # A helper that declined at construction votes only in checked mode (that vote is the check; the default
        # under the `auto` route, FASTVIDEO_ULYSSES_A2A_CHECKED=0 turns it off).
        self._votes = built.built or self.checked
        self._voted_launch = built.voted_launch
        self._hot = HotLane(self.transport, built.call_vote, built.hot_decline, self.generation)
        self.planner = Planner(
            PlanConfig(self.world_size, self.generation, self.gpu_name, self.window_bytes,
                       agreed[_settings.LONG_TRAINING], (), (), CAPTURE_ENGINES, cap.dtypes, self.device,
                       self.construction_reason,
                       self.transport.capture_decline if self.transport is not None else None),
            tuned_table, cap.entry_points if cap.present else None)
        self.planner.on_replan = self._hot.forget  # the hot lane holds proposals: they may change
        _LIVE[self.id] = self

    def follow(self, agreed: _settings.AgreedSettings) -> bool:
        """Local; called on every rank alike after a re-agreement changed the settings: take the new checked mode
        and long-training policy (a replan). Returns False when this helper cannot follow (its window came from the
        settings and changed: it must be rebuilt)."""
        if self._window_from_settings and agreed[_settings.WINDOW] != self.window_bytes:
            return False
        self.checked = bool(agreed[_settings.CHECKED])
        self._votes = self._runtime.built or self.checked
        self.planner.long_training = agreed[_settings.LONG_TRAINING]
        return True

    # ------------------------------------------------------------------ the call

    def call(self, x: torch.Tensor, mode: int, grad: bool = False, outcome: tuple[int, int] | None = None,
             splits: Splits = EVEN, tag: str | None = None) -> tuple[torch.Tensor | None, tuple[int, int]]:
        """One call on validated input: propose, vote, decide, execute, record. Collective; blocks the host for the
        vote; capture-safe (one vote at capture, see the class). Not differentiable (the op is).

        ``grad``: the call is recorded by autograd (the vote's PHASE; the long-training policy). ``outcome``: for a
        backward, its forward's ``(outcome code, SEQ word)`` (it runs that plan, never a re-decision, and votes that
        word). ``splits``: the tables ``validate_input`` returned (part of the vote: ranks whose tables differ raise
        together). ``tag``: the call site; the vote's SEQ is then the tag's own count for this phase. Returns
        ``(output, (outcome code, SEQ word))``; the output is None where every rank declined (the caller runs the
        NCCL route). A call that raises is not counted for its tag (on every rank alike)."""
        runtime = self._runtime
        if runtime.disposed is not None or runtime.destroyed:
            runtime.check()  # raises
        seq = self._calls  # an untagged forward votes its call number
        self._calls = seq + 1
        if outcome is None:
            phase, code, word = _FORWARD_GRAD if grad else _FORWARD_NO_GRAD, None, seq
        else:
            phase, (code, word) = _BACKWARD, outcome
        if tag is not None:
            word = self._tags.word(phase, tag, word)
        if not self._votes:  # declined at construction (agreed), checked mode off: no call needs a vote
            return self._declined(seq, phase, mode, self.construction_reason, word, None, tag)
        run = self._hot.run  # 1-2 in one native call for a signature launched fused before (hot.py); else None
        hit = (run(x, mode, word) if run is not None and phase is _FORWARD_NO_GRAD and splits is EVEN
               and self._capturing is stream_capturing else None)  # (a simulated capture: the Python path)
        if hit is not None:
            capturing, proposal = False, self._hot.proposal(hit[1])
            self._stats.hot += 1
        else:
            capturing = self._capturing(x)
            # 1. propose: pure, cached per signature (the key holds a Signature's fields: equal to it, hashed alike)
            key = (x.shape, x.dtype, x.device, mode, phase, code, capturing, x.is_contiguous(),
                   x.data_ptr() % x.element_size() == 0, splits)
            proposal = self.planner.cache.get(key) or self.planner.propose(Signature._make(key))
        # 2. vote (and, where the transport fuses them, launch in the same library call)
        if hit is not None or (proposal.plan is not None and self._voted_launch and not capturing):
            out, rows, error = self._runtime.voted_launch(x, proposal, word, seq, self._hot, hit)
            if (out is not None and hit is None and phase is _FORWARD_NO_GRAD and splits is EVEN
                    and not self._hot.decline):  # a lane that may learn
                self._hot.learn(x, proposal)  # its later calls take the hot lane
        else:
            out, rows, error = None, self._runtime.exchange(contract.with_seq(proposal.fields, word)), proposal.error
        if out is None:
            # 3. decide: the same verdict on every rank. A RAISE raises here, on every rank: counted, the call not
            # counted for its tag, raised ``from error`` with the detail the votes lacked (``mismatch.with_detail``:
            # collective for the three kinds it names).
            decision = contract.decide(rows)
            if decision.verdict is Verdict.RAISE:
                self._stats.raised += 1
                count = self._tags.rollback(tag, phase, word)
                raise mismatch.with_detail(self._runtime.gather, decision.error, proposal, word, phase, tag, count,
                                           error) from error
            if decision.verdict is Verdict.DECLINE:
                return self._declined(seq, phase, mode, decision.reason, word, proposal, tag)
            # 4. execute: every rank runs (or captures) this plan: the capture bit is in the agreed fields
            out = self._runtime.execute(x, proposal, seq, capturing)
        # 5. record (after the launch: the device is already moving the data)
        self._stats.ran(seq, phase, proposal, capturing, tag)
        if not capturing:  # a capture runs nothing: the graph's replays are unseen by the watchdog
            marker = self.transport.completion_marker()
            if marker is not None:
                self._runtime.watch(InFlight(
                    seq, self.generation, lambda: f"{phase.name.lower()}{f', tag {tag!r}' if tag else ''}, "
                    f"{proposal.geom}", lambda: proposal.plan.describe(proposal.geom), marker, time.monotonic()))
        return out, (proposal.fields[_PLAN], word)

    def _declined(self, seq: int, phase: Phase, mode: int, reason: DeclineReason, word: int,
                  proposal: Proposal | None, tag: str | None) -> tuple[None, tuple[int, int]]:
        self._stats.declined(seq, phase, mode, reason, tag, proposal)
        return None, (contract.outcome_code(0, reason), word)

    def vote_caller_error(self, mode: int, grad: bool, error: BaseException) -> NoReturn:
        """Always raises ``error``, a caller error found on this rank before any collective (invalid input). In
        checked mode, outside ``torch.compile``'s tracing, first the vote of ``LOCAL_ERROR`` for it (collective: one
        vote, then the exchange of the errors; blocking), so that every peer raises ``PeerCallError`` for this same
        call, naming ``error``, instead of waiting in it or pairing it with this rank's next call; otherwise local,
        as with any torch collective. ``mode``: -1 for an invalid dim pair; ``grad``: the call autograd would
        record."""
        if not self.checked or torch.compiler.is_compiling():
            raise error
        self.check_alive()
        phase, seq = _FORWARD_GRAD if grad else _FORWARD_NO_GRAD, self._calls
        self._calls = seq + 1
        self._stats.raised += 1
        # Nothing is known of the input but the mode and the grad flag: no dtype (DTYPE 0), no shape.
        fields = contract.fields(self.generation, seq, DeclineReason.LOCAL_ERROR.bit, mode, None, (0, 0, 0, 0), phase)
        try:
            rows = self._runtime.exchange(fields)
        except VoteError as exc:
            raise error from exc
        # Every rank reached the same verdict, a PeerCallError (this rank's LOCAL_ERROR bit decides before any other
        # field): all enter the exchange of the errors.
        peers = mismatch.peer_errors(self._runtime.gather, contract.decide(rows).error, error)
        if hasattr(error, "add_note"):  # Python 3.11+
            others = "; ".join(f"rank {r}: {t}" for r, t in sorted(peers.errors.items()) if r != self.sp.rank_in_group)
            error.add_note(f"Ulysses: voted on SP ranks {self.sp.ranks}; every peer raises PeerCallError for this "
                           f"call{f' (other ranks that raised: {others})' if others else ''}.")
        raise error

    # ------------------------------------------------------------------ public calls

    def _invalid(self, x: torch.Tensor, mode: int, error: BaseException) -> NoReturn:
        """``vote_caller_error`` for a caller error this helper's own entry points found, ``x`` giving the grad flag
        (it may not even be a tensor)."""
        self.vote_caller_error(mode, torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad,
                               error)

    def all_to_all(self, x: torch.Tensor, mode: int, *, seq_splits: Sequence[int] | None = None,
                   head_splits: Sequence[int] | None = None, tag: str | None = None) -> torch.Tensor:
        """The Ulysses all-to-all through this helper: collective; blocks the host for the vote; capture-safe.

        ``seq_splits`` / ``head_splits``: every rank's shares, the same on every rank (None: even); ``tag``: the
        call site (``call``). Not differentiable itself: autograd goes through the one op (the public function, or
        ``ops.all_to_all(x, mode, helper=this)`` for this helper), whose backward runs the inverse with the plan its
        forward ran and still votes. A call autograd would record raises instead of losing the gradient."""
        try:  # this entry point's one validation (``validate_input``; a caller error: ``_invalid``)
            splits = validate_input(x, mode, self.world_size, self.sp.rank_in_group, seq_splits, head_splits, tag)
        except (TypeError, ValueError, RuntimeError) as exc:
            self._invalid(x, mode, exc)
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(
                "UlyssesHelper.all_to_all is not differentiable and x requires grad: call "
                "fastvideo.distributed.ulysses.ops.all_to_all(x, mode, helper=helper) (or the public "
                "sequence_model_parallel_all_to_all_4D), or run it under torch.no_grad().")
        out = self.call(x, mode, False, None, splits, tag)[0]  # (positional: the cheaper call on the hot lane)
        return out if out is not None else nccl_route(x, mode, self.sp.device_group, splits=splits)

    def try_all_to_all_4D(self, x: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1, *,
                          seq_splits: Sequence[int] | None = None, head_splits: Sequence[int] | None = None,
                          tag: str | None = None) -> torch.Tensor | None:
        """The fused route or nothing: collective; blocks the host for the vote; capture-safe; not differentiable.
        Returns the output, or None on every rank when every rank declined (the caller then runs the NCCL
        route). Every rank must call it with matching tensors, split tables and tags, in the same order."""
        mode = -1  # what an invalid dim pair votes
        try:
            mode = mode_for_dims(scatter_dim, gather_dim)
            splits = validate_input(x, mode, self.world_size, self.sp.rank_in_group, seq_splits, head_splits, tag)
        except (TypeError, ValueError, RuntimeError) as exc:
            self._invalid(x, mode, exc)
        return self.call(x, mode, torch.is_grad_enabled() and x.requires_grad, splits=splits, tag=tag)[0]

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
        return planner.choose(self.planner.config, geom, grad=grad, capturing=capturing, long_training=long_training)

    # ------------------------------------------------------------------ reporting and lifecycle

    @property
    def history(self):
        """The last ``history`` call records (``CallRecord``), oldest first."""
        return self._stats.history

    @property
    def fused_available(self) -> bool:
        """True when construction succeeded collectively (per-call votes still decide each call)."""
        return self._runtime.built and self._runtime.alive

    @property
    def alive(self) -> bool:
        """False once destroyed or disposed (every later call raises ``HelperDisposedError``). Local."""
        return self._runtime.alive

    def stats(self) -> dict:
        """Local: what the helper is (construction, vote channel, settings) and its counts since construction
        (calls, fused runs, declines by reason, plans that ran, vote cost, the hot lane, tags, calls in flight)."""
        reason, runtime, tags = self.construction_reason, self._runtime, self._tags.tag_counts()
        return {
            "id": self.id,
            "generation": self.generation,
            "world_size": self.world_size,
            "transport": self.capability.name,
            "construction": reason.label if reason is not None else ("ok" if runtime.built else "n/a"),
            "construction_detail": self.construction_detail,
            "construction_per_rank": dict(self.construction_per_rank),
            "calls": self._calls,  # every call takes one SEQ number, whatever its route or outcome
            **self._stats.report(),
            "vote": type(runtime.call_vote).__name__.removesuffix("Vote").lower(),
            "vote_timeout_s": runtime.vote.timeout_s,
            "voted_launch": self.fused_available and self._voted_launch,  # the vote and the launch in one call
            **self._hot.report(),
            "checked": self.checked,
            "tags": len(tags),  # distinct call tags seen
            "tag_counts": tags,  # each tag's calls so far, per phase (``Phase`` order)
            "long_training": self.long_training,
            "in_flight": runtime.in_flight(),
            "disposed": runtime.disposed is not None,
            "destroyed": runtime.destroyed,
            "capture_detail": self._stats.capture_detail,
        }

    def use_hot_path(self, on: bool) -> str:
        """Local, rank-local (the hot path makes the Python path's own proposals, votes and verdicts): turn the hot
        path off, or on where this transport and build can (returns why not, "" when on). For A/B measurements."""
        return self._hot.switch(on)

    def vote_seconds(self, last: int | None = None) -> list[float]:
        """Local: host seconds of the most recent ``last`` votes (all kept, up to 4096), for benchmarks."""
        votes = list(self._stats.vote_s)
        return votes if last is None else votes[-last:]

    def check_alive(self) -> None:
        """Local: raise ``HelperDisposedError`` for a disposed or destroyed helper, else nothing."""
        self._runtime.check()

    def destroy(self) -> None:
        """Release the transport and the vote channel. Collective over the SP group; blocking; not capture-safe;
        a second call is a no-op."""
        self._runtime.destroy()

    def on_destroy(self, hook: Callable[[], None]) -> None:
        """Local: call ``hook`` when this helper is destroyed (the registry forgets a route it resolved to it)."""
        if hook not in self._runtime.on_destroy:
            self._runtime.on_destroy.append(hook)

    close = destroy  # upstream FastVideo's name for it
