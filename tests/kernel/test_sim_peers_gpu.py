"""GPU pytest of check_sim_peers.py: the faithful one-launch check's quick matrix and its negative controls.

Skips cleanly without CUDA or without a loadable test library (``fastvideo_kernel.testing.load``:
``$FASTVIDEO_KERNEL_TESTING_LIBRARY``, or the one beside the product library). The full matrix is
``python tests/kernel/check_sim_peers.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel import check_sim_peers as sim

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lib(gpu_lib):
    return gpu_lib


@pytest.fixture(scope="module")
def coresident(lib):
    return sim.coresident_sim_ctas(lib)


def test_sim_peers_quick_matrix(lib, coresident):
    device = torch.device("cuda", torch.cuda.current_device())
    results = sim.run_all(sim.build_cases(quick=True, coresident=coresident), lib, device, coresident,
                          log=lambda line: None)
    failed = [f"{r.label}: {r.detail}" for r in results if not r.ok]
    assert not failed, f"{len(failed)} of {len(results)} failed, e.g. {failed[:5]}"
    assert sum(r.label.startswith("negative control") for r in results) >= 5


def test_epoch_checker_flags_the_pre_fix_layout_and_passes_the_fix(lib):
    device = torch.device("cuda", torch.cuda.current_device())
    runner = sim.SimRunner(lib, device)
    call = sim.Call(sim.Operand(torch.bfloat16, 0, 2, 3, 64, 28, 128), sim.Plan(36, 2, 64, tuned=True), "planes2")
    case = sim.Case((call,))
    inputs, refs = sim.data(case, torch.Generator().manual_seed(7), device)
    moving = runner.run(case, inputs, sim.SKEW | sim.EPOCH | sim.MOVING, seed=3)
    assert moving.status == 0 and moving.violations > 0, "the pre-fix layout must be reported"
    fixed = runner.run(case, inputs, sim.SKEW | sim.EPOCH, seed=3)
    assert fixed.status == 0 and fixed.violations == 0, fixed.first_violation()
    assert not sim.compare(fixed.outs[0], refs[0], torch.bfloat16)
