"""Entry point of the harness case ``dit_step``: a full DiT step per route (docs/benchmarks.md).

    torchrun --standalone --nproc_per_node=2 benchmarks/benchmark_dit_step.py --json dit.json --plot dit.png
    python benchmarks/benchmark_dit_step.py --nproc 2 --attention sparse --tokens 32k,128k --long-training auto,chunked
    python benchmarks/benchmark_dit_step.py --device cpu --nproc 2 --hidden 64 --heads 4 --blocks 2 --tokens 256
    python benchmarks/benchmark_dit_step.py --estimate --tokens 32k,128k --attention sparse --blocks 2
    python benchmarks/benchmark_dit_step.py --plot-from a.json b.json --plot dit.png
    python benchmarks/check_results.py dit.json                      # the targets and verdicts

The model is ``benchmarks/dit/model.py``, the procedure ``benchmarks/dit/runner.py``, the tables and plot
``benchmarks/dit/report.py``. The same as ``python -m benchmarks.run dit_step [flags]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (torchrun, --compare-revs): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.main import main

if __name__ == "__main__":
    sys.exit(main(case_name="dit_step", entry=str(Path(__file__).resolve())))
