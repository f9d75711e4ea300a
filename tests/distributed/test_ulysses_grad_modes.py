"""The op under every grad mode, on every route: twice differentiable, and reusable state independent of the
grad mode of the call that built it.

* **Double backward.** ``g = autograd.grad((y * y).sum(), x, create_graph=True)`` must itself be
  differentiable: a gradient penalty ``(g * v).sum() + (x * x).sum()`` backpropagates ``2v + 2x``. (A backward
  that is not differentiable gives ``g == 2x`` with ``requires_grad`` False, and then ``2x`` silently.)
* **Inference mode first.** The helper and its vote buffers are built lazily at the first call; built under
  ``torch.inference_mode()`` they would be inference tensors, and the next call outside it would fail on every
  rank. Both orders, inference first then training and the reverse.

Every route: ``off`` (the NCCL route, no helper), ``off`` in checked mode (a helper that only votes), ``auto``
with a CPU fused transport (every call votes and runs fused: asserted), and ``auto`` in checked mode.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import bit_equal, oracle, rank_input

SHAPE = (2, 8, 4, 6)  # [B, S_local, H, D]; H divisible by 2 and 4
ROUTES = {
    "off": {"FASTVIDEO_ULYSSES_A2A": "off"},
    "off-checked": {"FASTVIDEO_ULYSSES_A2A": "off", "FASTVIDEO_ULYSSES_A2A_CHECKED": "1"},
    "auto-fused": {"FASTVIDEO_ULYSSES_A2A": "auto"},
    "auto-checked": {"FASTVIDEO_ULYSSES_A2A": "auto", "FASTVIDEO_ULYSSES_A2A_CHECKED": "1"},
}
BASE = {"FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "auto", "FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES": str(1 << 20),
        "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "10"}


def _cpu_fused_transport() -> None:
    """Helpers built lazily on this rank get the CPU plan transport (so ``auto`` runs fused on CPU)."""
    from fastvideo.distributed.ulysses import construction
    from tests.plan_transport import GlooPlanTransport

    construction.set_transport_factory(lambda device: GlooPlanTransport())


def _fused_calls() -> int:
    from fastvideo.distributed.ulysses import registry

    helper = registry.current_default_helper()
    return 0 if helper is None else helper.stats()["fused"]


def _phases() -> list[str]:
    """The PHASE each call of the voting helper (the default one, else the checked ``off`` one) voted, in order."""
    from fastvideo.distributed.ulysses import registry

    helper = registry.current_default_helper() or registry.current_checked_off_helper()
    return [] if helper is None else [record.phase.name for record in helper.history]


def _double_backward(rank, world_size):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a

    _cpu_fused_transport()
    x = rank_input(rank, SHAPE, torch.float32, seed=1, requires_grad=True)
    v = rank_input(rank, SHAPE, torch.float32, seed=2)
    y = a2a(x, 2, 1)
    z = a2a(y * y, 1, 2)  # both modes, so the double backward runs both directions
    (g,) = torch.autograd.grad(z.sum(), x, create_graph=True)
    first = (bit_equal(g, 2 * x), g.requires_grad)
    (gg,) = torch.autograd.grad((g * v).sum() + (x * x).sum(), x)
    return first, bit_equal(gg, 2 * v + 2 * x), bit_equal(y, oracle(x, 0)), _fused_calls(), _phases()


@pytest.mark.parametrize("route", list(ROUTES))
def test_double_backward_is_exact_on_every_route(ranks, route):
    """The gradient penalty backpropagates 2v + 2x exactly (the all-to-all moves bits; doubling is exact);
    under ``auto`` (a fused transport) every call (2 forward, 2 backward, 2 double-backward) ran fused. Every
    backward votes PHASE ``BACKWARD``, also the two that autograd records (``create_graph=True``: their grad flag is
    set, and a forward's phase there would pair them with a forward of another rank)."""
    voted = route != "off"
    for first, penalty, forward, fused, phases in ranks(2, _double_backward, env={**BASE, **ROUTES[route]}):
        assert first == (True, True) and penalty and forward
        assert fused == (6 if route.startswith("auto") else 0)
        assert phases == (["FORWARD_GRAD"] * 2 + ["BACKWARD"] * 4 if voted else [])


def _grad_modes(rank, world_size, order):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a

    _cpu_fused_transport()
    x = rank_input(rank, SHAPE, torch.float32, seed=3)
    w = rank_input(rank, (SHAPE[0], SHAPE[1] * world_size, SHAPE[2] // world_size, SHAPE[3]), seed=4)

    def inference() -> bool:
        with torch.inference_mode():
            return bit_equal(a2a(x, 2, 1), oracle(x, 0))

    def training() -> bool:
        xg = x.clone().requires_grad_()
        y = a2a(xg, 2, 1)
        (y * w).sum().backward()
        return bit_equal(y, oracle(x, 0)) and bit_equal(xg.grad, oracle(w, 1))

    steps = [inference, training] if order == "inference-first" else [training, inference]
    return [step() for step in steps for _ in range(2)], _fused_calls()


@pytest.mark.parametrize("order", ["inference-first", "training-first"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_the_first_calls_grad_mode_never_breaks_later_calls(ranks, route, order):
    """Two calls in one grad mode, then two in the other, exact on every route in both orders (the first call
    builds the helper); under ``auto`` (a fused transport) all 6 all-to-alls (4 forward, 2 backward) ran fused."""
    for exact, fused in ranks(2, _grad_modes, order, env={**BASE, **ROUTES[route]}):
        assert exact == [True] * 4
        assert fused == (6 if route.startswith("auto") else 0)
