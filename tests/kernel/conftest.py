"""Shared fixture of the GPU kernel tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def gpu_lib():
    """The kernel library on a CUDA machine (ABI >= 2), or skip saying why it cannot be used here."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.kernel.check_sim_peers import fastvideo_kernel

    try:
        library = fastvideo_kernel.load()
    except fastvideo_kernel.KernelUnavailable as exc:
        pytest.skip(f"kernel library unavailable: {exc}")
    if "sim" not in fastvideo_kernel.entry_points(library):
        pytest.skip("kernel library older than ABI 2 (no one-launch simulation)")
    return library
