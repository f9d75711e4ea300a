"""The Ulysses all-to-all as ``torch.library`` ops: each op's schema, fake impl and autograd formula side by side,
each body one call into the core (``exchange.py``).

    torch.ops.fastvideo.ulysses_all_to_all_4d(x, mode, grad, outcome, helper, *, seq_splits=None,
                                              head_splits=None, tag=None) -> (out, outcome_out)
    torch.ops.fastvideo.ulysses_all_to_all_4d_start(x, mode, grad, outcome, helper, *, seq_splits=None,
                                                    head_splits=None, tag=None, own_input=False) -> (token, outcome_out)
    torch.ops.fastvideo.ulysses_all_to_all_4d_wait(token, outcome, mode, shape, dtype, device, *,
                                                   seq_splits=None, head_splits=None, tag=None) -> out

* ``mode``: 0 = ``(scatter_dim, gather_dim) = (2, 1)``, 1 = ``(1, 2)``. ``grad``: autograd records this call
  (the vote's PHASE; the long-training policy); callers pass ``torch.is_grad_enabled() and x.requires_grad``.
* ``outcome`` (None for a forward): what the call being differentiated ran, ``[helper id, outcome code, SEQ
  word]`` (``contract.outcome_code``; the word its forward voted), so that a backward runs the inverse with the
  same plan on the same helper and votes its forward's SEQ word: ranks whose autograd orders two backwards
  differently raise together. ``outcome_out`` is this call's own, an int64 CPU tensor made by the op body, which
  travels as an autograd saved tensor in eager and compiled graphs alike (never in ``ctx`` or an int argument:
  ``torch.compile`` would bake those in at trace time).
* ``helper``: 0 = the route the SP group's agreed settings select (``registry.route``), else the id of a live
  ``UlyssesHelper``. A process group cannot be an op argument.
* ``seq_splits`` / ``head_splits``: every rank's sequence and head shares, the same on every rank (None: even).
  ``SymInt[]``: shares derived from a dynamic size stay symbolic under ``torch.compile``. The backward runs the
  inverse with the same tables.
* ``tag`` (``str?``): the call site (e.g. ``"blocks.3.attn.qkv"``), None for an untagged call. Where the call
  votes, a forward's SEQ field is then the tag's own count, so a rank that skips or repeats a tagged call raises
  ``ContractMismatchError`` on every rank naming the tag. Under ``torch.compile`` it is a constant of the graph.
* The start and wait are torch's functional-collective pattern (``all_to_all_single`` then ``wait_tensor``): the
  compiler sees two nodes joined by ``token`` (a one-element float64 CPU tensor naming the exchange in flight in
  this process), so it may schedule compute between them; the output exists only as the wait's result.
  ``own_input`` (set where the caller is traced, baked into the graph, or not eager: a subclass, a dispatch
  mode): the start owns its input (``exchange.py``).

Collective over the SP group; blocks the host for the vote where there is one. **Autograd**: the synchronous op's
backward is this same op in the inverse mode with the forward's outcome, so it is itself differentiable; the
wait's backward *starts* the reverse exchange and hands its token back as the token's gradient, and the start's
backward waits for it, so the gradient exchange is in flight across the backward of what ran in between. **Fake
impls**: shapes, no collective; a meta tensor outside tracing raises instead (a meta output would leave the peers
waiting). Tagged ``torch.Tag.cudagraph_unsafe``: inductor's CUDA-graph trees run them between captured partitions,
so they vote on every replay; under a manual ``torch.cuda.graph`` capture the vote runs once, at capture
(``docs/compile_and_cuda_graphs.md``).

``call`` is the entry of the public function and of ``all_to_all`` / ``all_to_all_async``: plain tensors that
autograd does not record skip the dispatcher and call the core directly (the dispatcher costs more than the rest of
such a call's host path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from fastvideo.distributed.all_to_all import Splits, output_shape, validate_input
from fastvideo.distributed.sp_groups import get_sp_group
from fastvideo.distributed.ulysses import exchange
from fastvideo.distributed.ulysses.contract import OUTCOME_LEN
from fastvideo.distributed.ulysses.exchange import AllToAllHandle
from fastvideo.distributed.ulysses.helper import UlyssesHelper

OP = "fastvideo::ulysses_all_to_all_4d"
START = "fastvideo::ulysses_all_to_all_4d_start"
WAIT = "fastvideo::ulysses_all_to_all_4d_wait"
SCHEMA = ("(Tensor x, int mode, bool grad, Tensor? outcome, int helper, *, SymInt[]? seq_splits=None, "
          "SymInt[]? head_splits=None, str? tag=None) -> (Tensor, Tensor)")
START_SCHEMA = ("(Tensor x, int mode, bool grad, Tensor? outcome, int helper, *, SymInt[]? seq_splits=None, "
                "SymInt[]? head_splits=None, str? tag=None, bool own_input=False) -> (Tensor, Tensor)")
WAIT_SCHEMA = ("(Tensor token, Tensor outcome, int mode, SymInt[] shape, ScalarType dtype, "
               "Device device, *, SymInt[]? seq_splits=None, SymInt[]? head_splits=None, str? tag=None) -> Tensor")
# Inductor's CUDA-graph trees capture around ops with this tag (graph partition) instead of into them: the op
# runs, votes and may take the fused route on every replay. Absent on an older torch: no tag.
_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
# The compilation under way: its graph, and per pass (fake mode) its traced starts less its traced waits.
_TRACED: dict[str, object] = {}


_UNWRAPPED = (torch.Tensor, torch.nn.Parameter)  # the tensor itself reaches the op body: checked as it is


def _eager(x: torch.Tensor) -> bool:
    """A plain ``torch.Tensor`` outside compilation and every dispatch mode (FakeTensorMode, make_fx,
    functionalization): what the eager path may take without the dispatcher."""
    return not torch.compiler.is_compiling() and type(x) is torch.Tensor and torch._C._len_torch_dispatch_stack() == 0


def _saved(saved: tuple[int, int, int]) -> torch.Tensor:
    return torch.tensor(saved, dtype=torch.int64)


def _outcome(outcome: torch.Tensor | None) -> tuple[int, int, int] | None:
    return None if outcome is None else tuple(outcome.tolist())


class TracedHandle(AllToAllHandle):
    """The handle of a start through the op (autograd records it, or a compiler traces it): ``wait()`` is the wait
    op, which the compiler sees as the second node and autograd differentiates."""

    __slots__ = ("_args", "_token")

    def __init__(self, token: tuple[torch.Tensor, torch.Tensor], args: tuple) -> None:
        self._token, self._args = token, args  # the token and outcome; (mode, input shape, dtype, device, keywords)

    def wait(self) -> torch.Tensor:
        if self._token is None:
            raise RuntimeError("Ulysses all-to-all wait: this handle was waited already. Wait once per start.")
        mode, shape, dtype, device, kw = self._args
        sp = get_sp_group()  # the start validated the tables (its body, or its fake impl under tracing)
        splits = Splits(*(None if kw[k] is None else tuple(kw[k]) for k in ("seq_splits", "head_splits")))
        out_shape = list(output_shape(shape, mode, sp.world_size, rank=sp.rank_in_group, splits=splits))
        (token, outcome), self._token = self._token, None  # taken once nothing before the op can raise
        return torch.ops.fastvideo.ulysses_all_to_all_4d_wait(token, outcome, mode, out_shape, dtype, device, **kw)


def call(x: torch.Tensor, mode: int, route_id: int, seq_splits: Sequence[int] | None = None,
         head_splits: Sequence[int] | None = None, tag: str | None = None,
         async_op: bool = False) -> torch.Tensor | AllToAllHandle:
    """The Ulysses all-to-all on ``x`` in ``mode`` through route ``route_id`` (0: the agreed route; a helper's
    ``id``): collective; blocks the host for the vote; differentiable. Validated in the core (the op body, or the
    eager path's ``exchange.issue``), and a plain tensor's or a Parameter's call through the dispatcher (autograd
    records it, or a dispatch mode is active) before it as well (its schema parse would raise a caller's error
    unvoted, leaving the peers in the vote). SP size 1 returns ``x`` (or a handle whose ``wait`` does; a traced
    start's wait is the wait op's copy). The eager path (a plain tensor autograd does not
    record, at any SP size 1 call but a traced start) skips the dispatcher: the core directly."""
    eager = _eager(x)  # before the SP group: the call leaves this module once
    sp = get_sp_group()
    grad = torch.is_grad_enabled() and (eager or isinstance(x, torch.Tensor)) and x.requires_grad
    # Through the ops: what autograd records or a compiler traces (at SP size 1 too for a traced start: its wait
    # must be a node of the graph)
    if (grad or not eager) and (sp.world_size > 1 or (async_op and not eager)):
        # Validated before the dispatcher, whose parse raises unvoted: a plain tensor or a Parameter (under a
        # dispatch mode too, CommDebugMode's) or none; another subclass (a fake or functional one while tracing, a
        # wrapper whose op body sees what it wraps) in the op body and the fake
        if not isinstance(x, torch.Tensor) or (type(x) in _UNWRAPPED and not torch.compiler.is_compiling()):
            seq_splits, head_splits = exchange.validated(sp, x, mode, grad, seq_splits, head_splits, tag)
        kw = {"seq_splits": None if seq_splits is None else list(seq_splits),
              "head_splits": None if head_splits is None else list(head_splits), "tag": tag}
        if not async_op:
            return torch.ops.fastvideo.ulysses_all_to_all_4d(x, mode, grad, None, route_id, **kw)[0]
        token = torch.ops.fastvideo.ulysses_all_to_all_4d_start(x, mode, grad, None, route_id, **kw,
                                                                own_input=not eager)
        return TracedHandle(token, (mode, tuple(x.shape), x.dtype, x.device, kw))
    return exchange.issue(sp, x, mode, grad, None, route_id, seq_splits, head_splits, tag, in_flight=async_op,
                          eager=True)[0]


def all_to_all(x: torch.Tensor, mode: int, helper: UlyssesHelper | None = None, *,
               seq_splits: Sequence[int] | None = None, head_splits: Sequence[int] | None = None,
               tag: str | None = None) -> torch.Tensor:
    """The op through ``helper`` (same on every rank: one built collectively; None: the agreed route):
    collective; blocks the host for the vote; capture-safe; differentiable."""
    return call(x, mode, 0 if helper is None else helper.id, seq_splits, head_splits, tag)


def all_to_all_async(x: torch.Tensor, mode: int, helper: UlyssesHelper | None = None, *,
                     seq_splits: Sequence[int] | None = None, head_splits: Sequence[int] | None = None,
                     tag: str | None = None) -> AllToAllHandle:
    """``all_to_all`` in flight: collective; blocks the host only for the vote; its handle's ``wait()`` returns
    the output."""
    return call(x, mode, 0 if helper is None else helper.id, seq_splits, head_splits, tag, async_op=True)


# ----------------------------------------------------------------------------------------- the synchronous op


@torch.library.custom_op(OP, mutates_args=(), schema=SCHEMA, tags=_TAGS)
def _op(x: torch.Tensor, mode: int, grad: bool, outcome: torch.Tensor | None, helper: int, *,
        seq_splits: list[int] | None = None, head_splits: list[int] | None = None,
        tag: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out, saved = exchange.issue(get_sp_group(), x, mode, grad, _outcome(outcome), helper, seq_splits, head_splits,
                                tag)
    return out, _saved(saved)


@_op.register_fake
def _op_fake(x, mode, grad, outcome, helper, *, seq_splits=None, head_splits=None, tag=None):
    return x.new_empty(_fake_shape(x, mode, seq_splits, head_splits, tag)), torch.empty(OUTCOME_LEN, dtype=torch.int64)


def _inverse_input(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """What a backward's inverse exchange takes: ``(the forward's saved outcome, grad_out made contiguous, whether
    autograd records the exchange)``."""
    grad_out = grad_out.contiguous()
    return ctx.saved_tensors[0], grad_out, torch.is_grad_enabled() and grad_out.requires_grad


def _op_setup(ctx, inputs: tuple, output: tuple, keyword_only_inputs: dict) -> None:
    ctx.mode, ctx.kw = inputs[1], dict(keyword_only_inputs)
    ctx.save_for_backward(output[1])


def _op_backward(ctx, grad_out: torch.Tensor, _grad_outcome: torch.Tensor | None):
    """The inverse all-to-all with the forward's outcome, split tables and tag, through this same op: differentiable
    again (under ``create_graph=True`` autograd records it, and its own backward is the forward's direction)."""
    outcome, grad_out, grad = _inverse_input(ctx, grad_out)
    if not grad and _eager(grad_out):
        out = exchange.issue(get_sp_group(), grad_out, 1 - ctx.mode, False, _outcome(outcome), 0,
                             ctx.kw["seq_splits"], ctx.kw["head_splits"], ctx.kw["tag"])[0]
    else:
        out = torch.ops.fastvideo.ulysses_all_to_all_4d(grad_out, 1 - ctx.mode, grad, outcome, 0, **ctx.kw)[0]
    return out, None, None, None, None


_op.register_autograd(_op_backward, setup_context=_op_setup)


# ------------------------------------------------------------------------------------------ the op in flight


@torch.library.custom_op(START, mutates_args=(), schema=START_SCHEMA, tags=_TAGS)
def _start(x: torch.Tensor, mode: int, grad: bool, outcome: torch.Tensor | None, helper: int, *,
           seq_splits: list[int] | None = None, head_splits: list[int] | None = None, tag: str | None = None,
           own_input: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    started, saved = exchange.issue(get_sp_group(), x, mode, grad, _outcome(outcome), helper, seq_splits, head_splits,
                                    tag, in_flight=True, own=own_input)
    token = torch.tensor([float(started.ident)], dtype=torch.float64)
    exchange.release_when_dropped(token, started)
    return token, _saved(saved)


@_start.register_fake
def _start_fake(x, mode, grad, outcome, helper, *, seq_splits=None, head_splits=None, tag=None, own_input=False):
    _fake_shape(x, mode, seq_splits, head_splits, tag)
    token = torch.empty(1, dtype=torch.float64)
    # Not gated on torch.compiler.is_compiling(): torch 2.11 answers False inside a fake impl that dynamo runs.
    _refuse_unwaited(token)
    return token, torch.empty(OUTCOME_LEN, dtype=torch.int64)


@torch.library.custom_op(WAIT, mutates_args=(), schema=WAIT_SCHEMA, tags=_TAGS)
def _wait(token: torch.Tensor, outcome: torch.Tensor, mode: int, shape: list[int], dtype: torch.dtype,
          device: torch.device, *, seq_splits: list[int] | None = None, head_splits: list[int] | None = None,
          tag: str | None = None) -> torch.Tensor:
    return exchange.pending(int(token.item())).wait()


@_wait.register_fake
def _wait_fake(token, outcome, mode, shape, dtype, device, *, seq_splits=None, head_splits=None, tag=None):
    _count(token, -1)
    return torch.empty(shape, dtype=dtype, device=device)


def _start_setup(ctx, inputs: tuple, output: tuple, keyword_only_inputs: dict) -> None:
    x = inputs[0]
    ctx.mode, ctx.shape, ctx.dtype, ctx.device = inputs[1], tuple(x.shape), x.dtype, x.device
    ctx.kw = {k: v for k, v in keyword_only_inputs.items() if k != "own_input"}  # the wait's keywords
    ctx.save_for_backward(output[1])


def _start_backward(ctx, grad_token: torch.Tensor | None, _grad_outcome):
    """The reverse exchange was started by the wait's backward (its token is ``grad_token``): wait for it here."""
    if grad_token is None:
        return None, None, None, None, None
    (outcome,) = ctx.saved_tensors
    grad_x = torch.ops.fastvideo.ulysses_all_to_all_4d_wait(grad_token, outcome, 1 - ctx.mode, list(ctx.shape),
                                                            ctx.dtype, ctx.device, **ctx.kw)
    return grad_x, None, None, None, None


def _wait_setup(ctx, inputs: tuple, output, keyword_only_inputs: dict) -> None:
    ctx.mode, ctx.kw = inputs[2], dict(keyword_only_inputs)
    ctx.save_for_backward(inputs[1])


def _wait_backward(ctx, grad_out: torch.Tensor):
    """Start the inverse exchange of ``grad_out`` with the forward's outcome (its plan and SEQ word; it votes as the
    synchronous backward does) and pass its token on: the start's backward waits for it. Traced (the backward graph
    of ``torch.compile``, compiled autograd, ``make_fx``), the start owns ``grad_out`` as the forward's does."""
    outcome, grad_out, grad = _inverse_input(ctx, grad_out)
    token = torch.ops.fastvideo.ulysses_all_to_all_4d_start(grad_out, 1 - ctx.mode, grad, outcome, 0, **ctx.kw,
                                                            own_input=not _eager(grad_out))[0]
    return token, None, None, None, None, None


_start.register_autograd(_start_backward, setup_context=_start_setup)
_wait.register_autograd(_wait_backward, setup_context=_wait_setup)


# ---------------------------------------------------------------------------------------------- trace time


def _fake_shape(x: torch.Tensor, mode: int, seq_splits, head_splits, tag) -> tuple[int, int, int, int]:
    """The output shape of a traced call (no collective). The Meta dispatch key outside any tracing (a real meta
    tensor) is refused instead, voted in checked mode as the op's own validation is: a meta output here would leave
    the peers waiting."""
    sp = get_sp_group()
    try:
        splits = validate_input(x, mode, sp.world_size, sp.rank_in_group, seq_splits, head_splits, tag=tag)
    except (TypeError, ValueError, RuntimeError) as exc:
        if is_fake(x):
            raise
        exchange.fail(sp, mode, torch.is_grad_enabled() and x.requires_grad, exc)
    return output_shape(x.shape, mode, sp.world_size, rank=sp.rank_in_group, splits=splits)


def _refuse_unwaited(token: torch.Tensor) -> None:
    """A compiled region's start must have its wait in the same region: a start the compiler saw without its wait
    would run (or be removed) alone on every rank. Every pass of a compilation over the region (dynamo's trace, AOT
    autograd's, inductor's) runs the fake impls of its starts and waits on the pass's own fake tensors, so each
    pass's starts and waits are counted apart (by its fake mode); at the end of the compilation a pass with more
    starts than waits refuses the region. A restarted trace (a new graph) replaces the counts before it."""
    from torch._dynamo.callback import callback_handler
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:  # dynamo's trace only: AOT autograd's and inductor's passes (a lazily compiled backward too) have none
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # no trace on this thread (or a torch without the method)
        return
    if tx is None:
        return
    if _check_waits not in callback_handler.end_callbacks:  # registered at the first traced start, then kept
        callback_handler.register_end_callback(_check_waits)
    graph, counts = _TRACED.get("graph"), _TRACED.setdefault("counts", {})
    if graph is not tx.output:
        counts.clear()  # an earlier attempt's graph (dynamo restarted its trace), or another compilation
        _TRACED["graph"] = tx.output
    _count(token, 1)


def _count(token: torch.Tensor, step: int) -> None:
    mode = getattr(token, "fake_mode", None)
    counts = _TRACED.get("counts")
    if mode is not None and counts is not None:
        counts[id(mode)] = (mode, counts.get(id(mode), (mode, 0))[1] + step)


def _check_waits(*_args) -> None:
    counts = _TRACED.pop("counts", {})
    _TRACED.pop("graph", None)
    unwaited = max((n for _, n in counts.values()), default=0)
    if unwaited > 0:
        raise RuntimeError(
            "Ulysses all-to-all: an exchange started with async_op=True in this compiled region has no wait() in "
            "it. Call handle.wait() on every handle before the region ends (a graph break between a start and its "
            "wait is refused too).")
