"""Entry point of the harness case ``tune``: fused-route plans swept per geometry, ``TunedRow`` entries to paste
(docs/benchmarks.md).

    python benchmarks/tune_ulysses_a2a.py --nproc 2 [flags]                # the harness starts 2 ranks
    torchrun --standalone --nproc_per_node=2 benchmarks/tune_ulysses_a2a.py [flags]
    python benchmarks/tune_ulysses_a2a.py --device cpu --nproc 2 --quick   # gloo smoke run (timings mean nothing)

The same as ``python -m benchmarks.run tune [flags]``; ``--help`` lists the flags.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (torchrun, --compare-revs): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.main import main

if __name__ == "__main__":
    sys.exit(main(case_name="tune", entry=str(Path(__file__).resolve())))
