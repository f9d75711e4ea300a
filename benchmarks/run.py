"""Run one benchmark case: ``python -m benchmarks.run CASE [flags]`` (``CASE --help`` lists its flags).

Cases: a2a, tune, floor, host_path, launch_host, fused_host_overhead, vote_cost, lineup_skew, public_op_overhead,
copy_engine, dit_step (docs/benchmarks.md). Under torchrun: ``torchrun --nproc_per_node=2 benchmarks/run.py CASE``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (torchrun, the harness's own launches): make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.main import main

if __name__ == "__main__":
    sys.exit(main())
