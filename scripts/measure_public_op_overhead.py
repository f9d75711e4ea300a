"""The public op's own per-call host cost, and checked mode's: the harness case ``public_op_overhead``.

    python scripts/measure_public_op_overhead.py [--iters 20000] [--root CHECKOUT] [--in-process] [--json OUT]

Runs ``python -m benchmarks.run public_op_overhead`` on 2 gloo ranks (one process with ``--in-process``);
``--root`` measures another checkout's package with this same code (``--tree``), ``--kernel-library`` votes over
the shared-memory vote of that build. docs/benchmarks.md describes the rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.main import main


def translate(argv: list[str]) -> list[str]:
    """This script's flags as the case's: ``--root`` is ``--tree``; 2 ranks unless ``--in-process``."""
    out = ["--tree" if a == "--root" else a.replace("--root=", "--tree=") for a in argv]
    if "--in-process" not in out and not any(a.split("=")[0] == "--nproc" for a in out):
        out += ["--nproc", "2"]
    return out


if __name__ == "__main__":
    sys.exit(main(["public_op_overhead", *translate(sys.argv[1:])]))
