"""Entry point of the harness case ``a2a``: the transport benchmark, the all-to-all's routes side by side
(docs/benchmarks.md).

    python benchmarks/benchmark_ulysses_a2a.py --nproc 2 [flags]           # the harness starts 2 ranks
    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_ulysses_a2a.py [flags]
    python benchmarks/benchmark_ulysses_a2a.py --device cpu --nproc 2 --quick   # gloo smoke (timings mean nothing)
    python benchmarks/benchmark_ulysses_a2a.py --compare-revs /tmp/rev_a /tmp/rev_b --nproc 2 -- --geometry h3-32k

The same as ``python -m benchmarks.run a2a [flags]``; ``--help`` lists the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (torchrun, --compare-revs): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.main import main

if __name__ == "__main__":
    sys.exit(main(case_name="a2a", entry=str(Path(__file__).resolve())))
