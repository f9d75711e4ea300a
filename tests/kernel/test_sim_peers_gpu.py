"""GPU pytest wrapper of check_sim_peers.py: the quick subset, one assertion over all cases.

Skips cleanly without CUDA or without a loadable kernel library (installed wheel or
``FASTVIDEO_KERNEL_LIBRARY``). The full matrix is ``python tests/kernel/check_sim_peers.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernel import check_sim_peers as sim

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lib():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        return sim.fastvideo_kernel.load()
    except sim.fastvideo_kernel.KernelUnavailable as exc:
        pytest.skip(f"kernel library unavailable: {exc}")


def test_sim_peers_quick_matrix(lib):
    results = sim.run_all(sim.build_cases(quick=True), lib, torch.device("cuda", torch.cuda.current_device()),
                          log=lambda line: None)
    failed = [f"{r.label}: {r.detail}" for r in results if not r.ok]
    assert not failed, f"{len(failed)} of {len(results)} failed, e.g. {failed[:5]}"
    assert any(r.label.startswith("negative control") for r in results)
