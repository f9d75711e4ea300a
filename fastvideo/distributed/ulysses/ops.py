"""The Ulysses all-to-all as a ``torch.library`` op, and the one eager implementation behind it.

    torch.ops.fastvideo.ulysses_all_to_all_4d(x, mode, grad) -> (out, saved)
    torch.ops.fastvideo.ulysses_all_to_all_4d_backward(grad_out, mode, saved) -> grad_in

Declared once, here, at import (registering a library op at import is the standard pattern; this
module does nothing else at import), with its fake impl and its autograd formula beside it. A graph
compiled by ``torch.compile`` holds one opaque call per all-to-all: the settings check, the vote, the
policy, the plan cache and the route all run inside the eager implementation each time the graph
runs, so a compiled call votes exactly as an eager one does (under ``auto``, and in checked mode on
every route). Collective over the SP group; blocks the host for the vote where there is one.

* **Process group**: a process group cannot be an op argument, so the op runs over the registered SP
  group (``parallel_state.get_sp_group()``) and its default helper (``helper.get_default_helper``, or
  ``get_checked_off_helper`` for the ``off`` route in checked mode).
* ``mode``: 0 = ``(scatter_dim, gather_dim) = (2, 1)``, 1 = ``(1, 2)``. ``grad``: autograd records this
  call (the vote's PHASE field); the public function passes ``torch.is_grad_enabled() and x.requires_grad``.
* ``saved``: an int64 CPU tensor ``[generation, code]`` naming what the forward ran, so that its backward
  runs the inverse with the same plan on the same helper and still votes: ``code`` > 0 the fused plan
  word, < 0 a decline (``helper.forward_code``), 0 the ``off`` route. It travels as an autograd saved
  tensor, in eager and in compiled graphs alike; nothing is kept per call on the side. The backward of a
  helper that was destroyed or replaced in between raises ``HelperDisposedError`` (on every rank: helpers
  are built and destroyed collectively).
* **Fake impl** (``torch.compile``, FakeTensorMode, ``make_fx``): the output shape
  (``[B, S*P, H/P, D]`` for mode 0, ``[B, S/P, H*P, D]`` for mode 1), contiguous, the input's dtype and
  device, symbolic sizes allowed; no collective. **A meta tensor outside tracing** (a plain meta tensor,
  not a FakeTensor) raises ``ValueError`` instead of returning a meta output, which would have left the
  peers waiting in the collective (in checked mode it first votes, so the peers raise too). A meta or
  fake tensor never reaches a collective.
* Tagged ``torch.Tag.cudagraph_unsafe``: inductor's CUDA-graph trees (``mode="reduce-overhead"``) run it
  between captured partitions, so it votes on every replay. Under a manual ``torch.cuda.graph`` capture it
  votes once at capture and every rank captures the fused launch with the agreed plan frozen (or, for a plan
  that cannot be frozen, the NCCL route); ``docs/compile_and_cuda_graphs.md`` has the rules.
* Not twice differentiable (the backward op has no autograd formula).

The public function (``communication_op``) calls the op, except on the eager hot path: plain
``torch.Tensor`` input, no dispatch mode active, not compiling. There it runs the same implementation
(``forward_impl`` / ``backward_impl``, or the NCCL route for ``off`` without checked mode) without the
dispatcher, which would add about 7 us a call (15 us with autograd) on the 2-core CI VM.
"""

from __future__ import annotations

from typing import NoReturn

import torch
from torch._subclasses.fake_tensor import is_fake

from fastvideo.distributed.parallel_state import get_sp_group
from fastvideo.distributed.settings import CHECKED
from fastvideo.distributed.ulysses.contract import DeclineReason, Phase
from fastvideo.distributed.ulysses.helper import (
    HelperDisposedError,
    current_default_helper,
    forward_code,
    forward_from_code,
    get_checked_off_helper,
    get_default_helper,
)
from fastvideo.distributed.ulysses.layout import output_shape, validate_input
from fastvideo.distributed.ulysses.nccl import nccl_route

OP = "fastvideo::ulysses_all_to_all_4d"
# Inductor's CUDA-graph trees capture around ops with this tag (graph partition) instead of into them: the op
# runs, votes and may take the fused route on every replay. Absent on an older torch: no tag.
_TAGS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)
BACKWARD_OP = "fastvideo::ulysses_all_to_all_4d_backward"
CODE_OFF = 0  # ``saved`` code of a forward that took the public op's ``off`` route (no helper)

# ---------------------------------------------------------------------- the eager implementation


def forward_impl(x: torch.Tensor, mode: int, grad: bool) -> tuple[torch.Tensor, tuple[int, int]]:
    """One forward call on the route the SP group agreed: ``(output, (generation, code))``. Collective;
    ``x`` must be validated. Votes under ``auto``, and under ``off`` in checked mode."""
    sp = get_sp_group()
    settings = sp.agreed_settings()
    phase = Phase.FORWARD_GRAD if grad else Phase.FORWARD_NO_GRAD
    if settings["FASTVIDEO_ULYSSES_A2A"] == "off":
        if settings[CHECKED]:
            checker = get_checked_off_helper()
            return checker._run(x, mode, phase, None)[0], (checker.generation, CODE_OFF)
        return nccl_route(x, mode, sp.device_group), (0, CODE_OFF)
    helper = get_default_helper()
    out, plan, reason = helper._run(x, mode, phase, None)
    return out, (helper.generation, forward_code(plan, reason))


def backward_impl(grad: torch.Tensor, mode: int, saved: tuple[int, int]) -> torch.Tensor:
    """The inverse all-to-all of ``grad``, with the plan its forward ran (``saved``), still voted. Collective."""
    grad = grad.contiguous()
    generation, code = saved
    inverse = 1 - mode
    sp = get_sp_group()
    if code == CODE_OFF:
        if sp.agreed_settings()[CHECKED]:
            return get_checked_off_helper()._run(grad, inverse, Phase.BACKWARD, (None, DeclineReason.DISABLED))[0]
        return nccl_route(grad, inverse, sp.device_group)
    helper = current_default_helper()
    if helper is None or helper.generation != generation:
        raise HelperDisposedError(
            f"Ulysses all-to-all backward: its forward ran on helper gen{generation}, which was destroyed or "
            f"replaced (now {'none' if helper is None else f'gen{helper.generation}'}). Run the backward before "
            "rebuilding the helper or the SP groups."
        )
    return helper._run(grad, inverse, Phase.BACKWARD, forward_from_code(code))[0]


class _EagerAllToAll(torch.autograd.Function):
    """The eager hot path's autograd (the op's own formula, without the dispatcher)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mode: int) -> torch.Tensor:  # type: ignore[override]
        out, saved = forward_impl(x, mode, True)
        ctx.mode, ctx.saved = mode, saved
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return backward_impl(grad, ctx.mode, ctx.saved), None


def is_plain(x: torch.Tensor) -> bool:
    """A plain ``torch.Tensor`` (not a FakeTensor or other subclass) with no dispatch mode active (no
    FakeTensorMode, make_fx, functionalization): what the eager hot path may take without the dispatcher.
    ``x`` is validated (``validate_input`` refused meta tensors)."""
    return type(x) is torch.Tensor and torch._C._len_torch_dispatch_stack() == 0


def all_to_all(x: torch.Tensor, mode: int) -> torch.Tensor:
    """The op on validated input (SP size > 1), differentiable. Collective."""
    grad = torch.is_grad_enabled() and x.requires_grad
    if is_plain(x):
        if grad:
            return _EagerAllToAll.apply(x, mode)
        return forward_impl(x, mode, False)[0]
    return torch.ops.fastvideo.ulysses_all_to_all_4d(x, mode, grad)[0]


def fail(x: object, mode: int, error: BaseException) -> NoReturn:
    """Raise ``error``, a caller error found before any collective (invalid input, a meta tensor). In checked
    mode, first vote it (``UlyssesHelper.vote_caller_error``), so that every peer raises for this same call
    instead of waiting inside it. Collective in checked mode; always raises."""
    sp = get_sp_group()
    if sp.world_size == 1 or torch.compiler.is_compiling():
        raise error
    settings = sp.agreed_settings()
    if not settings[CHECKED]:
        raise error  # as with any torch collective: the peers of a rank that raised alone wait for it
    grad = torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad
    phase = Phase.FORWARD_GRAD if grad else Phase.FORWARD_NO_GRAD
    helper = get_checked_off_helper() if settings["FASTVIDEO_ULYSSES_A2A"] == "off" else get_default_helper()
    helper.vote_caller_error(mode, phase, error)


# ---------------------------------------------------------------------- the torch.library op


@torch.library.custom_op(OP, mutates_args=(), schema="(Tensor x, int mode, bool grad) -> (Tensor, Tensor)",
                         tags=_TAGS)
def _op(x: torch.Tensor, mode: int, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    try:  # a direct caller of the op skipped the public function's checks
        validate_input(x, mode, get_sp_group().world_size)
    except (TypeError, ValueError, RuntimeError) as exc:
        fail(x, mode, exc)
    out, saved = forward_impl(x, mode, grad)
    return out, torch.tensor(saved, dtype=torch.int64)


@_op.register_fake
def _op_fake(x: torch.Tensor, mode: int, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    world_size = get_sp_group().world_size
    if not is_fake(x):
        # The Meta dispatch key, outside any tracing: a meta output here would leave the peers waiting.
        try:
            validate_input(x, mode, world_size)
        except ValueError as exc:
            fail(x, mode, exc)
    out = x.new_empty(output_shape(x.shape, mode, world_size))
    return out, torch.empty(2, dtype=torch.int64, device="cpu")


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    ctx.mode = inputs[1]
    ctx.save_for_backward(output[1])


def _op_backward(ctx, grad: torch.Tensor, _grad_saved: torch.Tensor | None):
    (saved,) = ctx.saved_tensors
    return torch.ops.fastvideo.ulysses_all_to_all_4d_backward(grad, ctx.mode, saved), None, None


_op.register_autograd(_op_backward, setup_context=_setup_context)


@torch.library.custom_op(BACKWARD_OP, mutates_args=(), schema="(Tensor grad, int mode, Tensor saved) -> Tensor",
                         tags=_TAGS)
def _backward_op(grad: torch.Tensor, mode: int, saved: torch.Tensor) -> torch.Tensor:
    generation, code = saved.tolist()
    return backward_impl(grad, mode, (generation, code))


@_backward_op.register_fake
def _backward_op_fake(grad: torch.Tensor, mode: int, saved: torch.Tensor) -> torch.Tensor:
    world_size = get_sp_group().world_size
    if not is_fake(grad):
        fail(grad, 1 - mode, ValueError("ulysses_all_to_all_4d_backward: grad is a meta tensor outside tracing; "
                                        "the all-to-all moves data between ranks and needs real tensors."))
    return grad.new_empty(output_shape(grad.shape, 1 - mode, world_size))
