"""The harness's functions under the names a script outside ``benchmarks/`` imports as ``common``.

``tests/distributed/check_ulysses_graphs.py`` puts ``benchmarks/`` on ``sys.path`` and imports this module; new
code imports ``benchmarks.harness`` instead. Importing it chooses the tree under test (``harness.tree``: the
``FASTVIDEO_BENCH_TREE`` tree, else this repository), as the scripts expect.
"""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import product, timing
from benchmarks.harness.header import build_header, native_library, print_header
from benchmarks.harness.stats import summarize
from benchmarks.harness.tree import select_tree

select_tree()

host_latencies = timing.host_latencies
__all__ = ["env_header", "host_latencies", "install_cpu_transport_helper", "native_library", "print_header",
           "summarize"]


def env_header(device, sp_size: int, helper=None, extra: dict | None = None) -> dict:
    """The run header (``harness.header.build_header``) of a script that is not a case."""
    return build_header(device, sp_size, helper, extra, case=None)


def install_cpu_transport_helper():
    """On CPU, a helper on ``GlooPlanTransport`` made the op's default (collective)."""
    import torch

    return product.default_helper(torch.device("cpu"))
