"""The Ulysses all-to-all as one ``torch.library`` op: its schema, fake impl and autograd formula side by side.

    torch.ops.fastvideo.ulysses_all_to_all_4d(x, mode, grad, outcome, helper, *, seq_splits=None,
                                              head_splits=None, tag=None) -> (out, outcome_out)

* ``mode``: 0 = ``(scatter_dim, gather_dim) = (2, 1)``, 1 = ``(1, 2)``. ``grad``: autograd records this call
  (the vote's PHASE; the long-training policy); callers pass ``torch.is_grad_enabled() and x.requires_grad``.
* ``outcome`` (None for a forward): what the call being differentiated ran, ``[helper id, outcome code]``
  (``contract.outcome_code``), so that a backward runs the inverse with the same plan on the same helper, and
  still votes. ``outcome_out`` is this call's own, an int64 CPU tensor that travels as an autograd saved
  tensor in eager and compiled graphs alike; nothing is kept per call on the side.
* ``helper``: 0 = the route the SP group's agreed settings select (``registry.route()``), else the id of a
  live ``UlyssesHelper`` (``UlyssesHelper.all_to_all``). A process group cannot be an op argument.
* ``seq_splits`` / ``head_splits``: every rank's sequence and head shares, the same on every rank (None: even;
  ``layout``). ``SymInt[]``: shares derived from a dynamic size stay symbolic under ``torch.compile``. The
  backward runs the inverse with the same tables.
* ``tag`` (``str?``): the call site (e.g. ``"blocks.3.attn.qkv"``), None for an untagged call. Where the call
  votes, its SEQ field is then the tag's own count, kept per phase by the helper (eager side, as the untagged
  count is), so a rank that skips or repeats a tagged call raises ``ContractMismatchError`` on every rank
  naming the tag. Under ``torch.compile`` it is a constant of the graph. The backward calls this op with the
  same tag (its phase, BACKWARD, has a count of its own).

Collective over the SP group; blocks the host for the vote where there is one. **One autograd formula**:
the backward calls this same op (the inverse mode, the forward's outcome), so it is itself differentiable
and double backward works on every route. **Fake impl** (``torch.compile``, FakeTensorMode): the output shape,
no collective; a meta tensor outside tracing raises instead (a meta output would leave the peers waiting).
Tagged ``torch.Tag.cudagraph_unsafe``: inductor's CUDA-graph trees run it between captured partitions, so it
votes on every replay; under a manual ``torch.cuda.graph`` capture it votes once at capture and every rank
captures the fused launch with the agreed plan frozen (``docs/compile_and_cuda_graphs.md``).

The eager shortcut: plain tensors that autograd does not record skip the dispatcher and call ``run``, the
op's own body, directly (the dispatcher costs more than the rest of such a call's host path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch
from torch._subclasses.fake_tensor import is_fake

from fastvideo.distributed.parallel_state import get_sp_group
from fastvideo.distributed.ulysses import registry
from fastvideo.distributed.ulysses.contract import check_tag
from fastvideo.distributed.ulysses.helper import UlyssesHelper, live_helper
from fastvideo.distributed.ulysses.layout import EVEN, Splits, output_shape, validate_input
from fastvideo.distributed.ulysses.nccl import nccl_route

OP = "fastvideo::ulysses_all_to_all_4d"
SCHEMA = ("(Tensor x, int mode, bool grad, Tensor? outcome, int helper, *, SymInt[]? seq_splits=None, "
          "SymInt[]? head_splits=None, str? tag=None) -> (Tensor, Tensor)")
# Inductor's CUDA-graph trees capture around ops with this tag (graph partition) instead of into them: the op
# runs, votes and may take the fused route on every replay. Absent on an older torch: no tag.
_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)


def run(x: torch.Tensor, mode: int, grad: bool, outcome: tuple[int, int] | None, helper: int,
        splits: Splits = EVEN, tag: str | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
    """The op's body on validated input: ``(output, (helper id, outcome code))``. Collective."""
    if outcome is None:
        if helper:
            target = live_helper(helper)
        else:  # the agreed route: one global read, resolved (collectively) only on first use
            target = registry.ROUTE
            if target is registry.UNRESOLVED or (target is not None and target._destroyed):
                target = registry.resolve()
        code = None
    else:
        helper, code = outcome
        target = live_helper(helper) if helper else None  # id 0: the forward ran without a helper
    if target is None:
        return nccl_route(x, mode, get_sp_group().device_group, splits=splits), (0, 0)
    out, code = target.call(x, mode, grad, code, splits=splits, tag=tag)
    return out, (target.id, code)


def is_plain(x: torch.Tensor) -> bool:
    """A plain ``torch.Tensor`` (not a FakeTensor or other subclass) with no dispatch mode active (FakeTensorMode,
    make_fx, functionalization): what the eager shortcut may take without the dispatcher."""
    return type(x) is torch.Tensor and torch._C._len_torch_dispatch_stack() == 0


def _splits(seq_splits: Sequence[int] | None, head_splits: Sequence[int] | None) -> Splits:
    if seq_splits is None and head_splits is None:
        return EVEN
    return Splits(None if seq_splits is None else tuple(seq_splits),
                  None if head_splits is None else tuple(head_splits))


def _listed(table: tuple[int, ...] | None) -> list[int] | None:
    return None if table is None else list(table)


def all_to_all(x: torch.Tensor, mode: int, helper: UlyssesHelper | None = None, *,
               seq_splits: Sequence[int] | None = None, head_splits: Sequence[int] | None = None,
               tag: str | None = None) -> torch.Tensor:
    """The op on validated input (SP size > 1; the split tables ``validate_input`` accepted): collective; blocks
    the host for the vote; capture-safe; differentiable. ``helper`` None: the route the agreed settings select;
    else that helper (same on every rank: one built collectively). ``tag``: the call site (``contract.check_tag``;
    the same on every rank)."""
    if tag is not None:
        check_tag(tag, "ops.all_to_all")
    return call(x, mode, 0 if helper is None else helper.id, _splits(seq_splits, head_splits), tag)


def call(x: torch.Tensor, mode: int, helper_id: int, splits: Splits, tag: str | None = None) -> torch.Tensor:
    """``all_to_all`` with a helper id (0: the agreed route), ``validate_input``'s tables and a checked tag: the
    public function's path (positional arguments, no conversion: it runs on every call)."""
    grad = torch.is_grad_enabled() and x.requires_grad
    if not torch.compiler.is_compiling() and not grad and is_plain(x):
        return run(x, mode, False, None, helper_id, splits, tag)[0]
    return torch.ops.fastvideo.ulysses_all_to_all_4d(x, mode, grad, None, helper_id, seq_splits=_listed(splits.seq),
                                                     head_splits=_listed(splits.heads), tag=tag)[0]


def fail(x: object, mode: int, error: BaseException) -> NoReturn:
    """Raise ``error``, a caller error found before any collective (invalid input, a meta tensor). In checked mode
    (the default under ``auto``) first vote it, so that every peer raises for this same call, naming it, instead of
    waiting inside it or pairing it with this rank's next call. Collective in checked mode; always raises."""
    if torch.compiler.is_compiling() or get_sp_group().world_size == 1:
        raise error
    target = registry.route()
    if target is None or not target.checked:
        raise error  # as with any torch collective: the peers of a rank that raised alone wait for it
    target.vote_caller_error(mode, torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad, error)


@torch.library.custom_op(OP, mutates_args=(), schema=SCHEMA, tags=_TAGS)
def _op(x: torch.Tensor, mode: int, grad: bool, outcome: torch.Tensor | None, helper: int, *,
        seq_splits: list[int] | None = None, head_splits: list[int] | None = None,
        tag: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    sp = get_sp_group()
    try:  # a direct caller of the op skipped the public function's checks
        splits = validate_input(x, mode, sp.world_size, rank=sp.rank_in_group, seq_splits=seq_splits,
                                head_splits=head_splits)
        if tag is not None:
            check_tag(tag, OP)
    except (TypeError, ValueError, RuntimeError) as exc:
        fail(x, mode, exc)
    out, saved = run(x, mode, grad, None if outcome is None else tuple(outcome.tolist()), helper, splits, tag)
    return out, torch.tensor(saved, dtype=torch.int64)


@_op.register_fake
def _op_fake(x: torch.Tensor, mode: int, grad: bool, outcome: torch.Tensor | None, helper: int, *,
             seq_splits: list[int] | None = None, head_splits: list[int] | None = None,
             tag: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    sp = get_sp_group()
    if not is_fake(x):
        # The Meta dispatch key, outside any tracing: a meta output here would leave the peers waiting.
        try:
            validate_input(x, mode, sp.world_size, rank=sp.rank_in_group, seq_splits=seq_splits,
                           head_splits=head_splits)
        except ValueError as exc:
            fail(x, mode, exc)
    shape = output_shape(x.shape, mode, sp.world_size, rank=sp.rank_in_group, splits=_splits(seq_splits, head_splits))
    return x.new_empty(shape), torch.empty(2, dtype=torch.int64, device="cpu")


def _setup_context(ctx, inputs: tuple, output: tuple, keyword_only_inputs: dict) -> None:
    ctx.mode = inputs[1]
    ctx.splits = (keyword_only_inputs.get("seq_splits"), keyword_only_inputs.get("head_splits"))
    ctx.tag = keyword_only_inputs.get("tag")
    ctx.save_for_backward(output[1])


def _backward(ctx, grad_out: torch.Tensor, _grad_outcome: torch.Tensor | None):
    """The inverse all-to-all with the forward's outcome, split tables and tag, through this same op: differentiable
    again (under ``create_graph=True`` autograd records it, and its own backward is the forward's direction). The
    tag's BACKWARD count is its own: the forward's count is not moved."""
    (outcome,) = ctx.saved_tensors
    seq_splits, head_splits = ctx.splits
    grad_out = grad_out.contiguous()
    grad = torch.is_grad_enabled() and grad_out.requires_grad
    if not grad and is_plain(grad_out):
        out = run(grad_out, 1 - ctx.mode, False, tuple(outcome.tolist()), 0, _splits(seq_splits, head_splits),
                  ctx.tag)[0]
    else:
        out = torch.ops.fastvideo.ulysses_all_to_all_4d(grad_out, 1 - ctx.mode, grad, outcome, 0,
                                                        seq_splits=seq_splits, head_splits=head_splits,
                                                        tag=ctx.tag)[0]
    return out, None, None, None, None


_op.register_autograd(_backward, setup_context=_setup_context)
