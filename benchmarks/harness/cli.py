"""The command line every case shares, and the geometries.

Common flags (each case adds its own; ``python -m benchmarks.run CASE --help`` lists both):

* ``--device cuda|cpu``; ``--nproc N`` (start N local ranks under ``torch.distributed.run``);
  ``--tree DIR`` (measure another tree's fastvideo); ``--kernel-library PATH|dev``;
* ``--geometry NAME|B,S,H,D`` (repeatable), ``--dtype``;
* ``--iters``, ``--warmup``, ``--repeat`` (rotated rounds), ``--quick`` (a smoke run);
* ``--lineup auto|shm|gloo``; ``--seed``; ``--json PATH``; ``--progress-every S``;
* ``--compare-revs DIR_A DIR_B`` with ``--rounds``, ``--tree-libraries``, ``--compare-out`` (cases with a row key);
  ``--compare-merge FILE...``: several such comparisons' JSONs as one.

Geometries are ``(B, S_global, H, D)``: the presets (``fastvideo/distributed/ulysses/geometries.py``), or
``B,S,H,D``. Mode 0 feeds ``[B, S/P, H, D]`` (before attention), mode 1 ``[B, S, H/P, D]`` (after); the ``h3``
presets are packed QKV (B = 3 planes).
"""

from __future__ import annotations

import argparse
import runpy

import torch

from benchmarks.harness.lineup import LINEUPS
from benchmarks.harness.tree import BENCH_ROOT
from benchmarks.harness.turns import DEFAULT_CPUS

# The package owns the named geometries (``explain --geometry`` reads them too); loaded by path, since importing
# fastvideo here would choose the tree under test before ``--tree`` is parsed.
PRESETS: dict[str, tuple[int, int, int, int]] = runpy.run_path(
    str(BENCH_ROOT / "fastvideo" / "distributed" / "ulysses" / "geometries.py"))["GEOMETRIES"]
GPU_GEOMETRIES = ("wan720p", "h3-32k", "h3-128k", "h3-250k")
CPU_GEOMETRIES = ("toy",)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
MODE_DIMS = {0: (2, 1), 1: (1, 2)}  # mode -> (scatter_dim, gather_dim) of the public op


def parse_geometry(text: str) -> tuple[str, tuple[int, int, int, int]]:
    if text in PRESETS:
        return text, PRESETS[text]
    try:
        b, s, h, d = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--geometry {text!r}: use a preset ({', '.join(PRESETS)}) or B,S_global,H,D") from None
    if min(b, s, h, d) < 1:
        raise argparse.ArgumentTypeError(f"--geometry {text!r}: every size must be >= 1")
    return f"{b}x{s}x{h}x{d}", (b, s, h, d)


def input_shape(shape_global: tuple[int, int, int, int], mode: int, world: int) -> tuple[int, int, int, int]:
    """One rank's input of the all-to-all in ``mode`` at SP ``world`` for a global ``(B, S, H, D)``."""
    b, s, h, d = shape_global
    return (b, s // world, h, d) if mode == 0 else (b, s, h // world, d)


def divisible(shape_global: tuple[int, int, int, int], world: int) -> str | None:
    """Why the geometry cannot run at SP ``world`` (H and S must divide), or None."""
    _, s, h, _ = shape_global
    return f"H={h} or S={s} not divisible by SP{world}" if h % world or s % world else None


def parse_modes(text: str) -> list[int]:
    modes = [int(m) for m in text.split(",") if m.strip()]
    if not modes or any(m not in MODE_DIMS for m in modes):
        raise SystemExit(f"--modes {text!r}: a comma list of 0 (scatter heads) and 1 (scatter sequence)")
    return modes


def parse_bound(text: str) -> tuple[float, float]:
    """``--within ABS,PCT`` as ``(ABS, PCT)``: both non-negative numbers."""
    try:
        absolute, percent = (float(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--within {text!r}: pass ABS,PCT, e.g. 0.5,10 (B no worse than A by more than max(0.5, "
                         "10 % of A), in the compared metric's units)") from None
    if absolute < 0 or percent < 0:
        raise SystemExit(f"--within {text!r}: both bounds must be >= 0")
    return absolute, percent


def common_parser(description: str = "") -> argparse.ArgumentParser:
    """The flags every case takes (module docstring); a case adds its own to the returned parser."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("harness")
    g.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--nproc", type=int, default=0,
                   help="start this many local ranks under torch.distributed.run (plain python, not under torchrun)")
    g.add_argument("--tree", help="measure this tree's fastvideo package (an exported revision); default: this one")
    g.add_argument("--kernel-library", metavar="PATH|dev",
                   help="the kernel library to load (dev: TREE/build/kernel's development build)")
    g.add_argument("--geometry", action="append", type=parse_geometry,
                   help=f"preset ({', '.join(PRESETS)}) or B,S_global,H,D; repeatable (default: "
                        f"{', '.join(GPU_GEOMETRIES)} on CUDA, toy on CPU)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    g.add_argument("--iters", type=int, default=50, help="timed iterations per contender and round")
    g.add_argument("--warmup", type=int, default=5, help="untimed calls before each timed block")
    g.add_argument("--repeat", type=int, default=1,
                   help="rotated rounds: each round times every contender once, in an order rotated by one")
    g.add_argument("--quick", action="store_true", help="smoke run: few iterations (timings mean nothing)")
    g.add_argument("--lineup", choices=LINEUPS, default="auto",
                   help="the barrier before each timed iteration: same-host shared-memory spin (shm; auto where "
                        "every rank is on one host and loads the kernel library) or gloo")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--json", help="write the header and rows here (rank 0)")
    g.add_argument("--progress-every", type=float, default=30.0, metavar="S", help="seconds between progress lines")
    r = p.add_argument_group("revision comparison (cases with a row key)")
    r.add_argument("--compare-revs", nargs=2, metavar=("DIR_A", "DIR_B"),
                   help="run this case with identical argv against two exported trees, A/B/A/B, and compare "
                        "(plain python, not torchrun)")
    r.add_argument("--rounds", type=int, default=2, help="--compare-revs: A/B rounds")
    r.add_argument("--compare-merge", nargs="+", metavar="FILE",
                   help="compare the rounds of several --compare-revs JSONs of this case (the same two commits, the "
                        "same argv: an A/B split over several runs) as one comparison; runs nothing (takes --within, "
                        "--json)")
    r.add_argument("--tree-libraries", action="store_true",
                   help="--compare-revs: each tree runs its own kernel loader (TREE/fastvideo-kernel first on "
                        "PYTHONPATH) and its own build (TREE/build/kernel/libfastvideo_ulysses_a2a.so, which must "
                        "exist): for revisions whose Python cannot drive the other's library ABI")
    r.add_argument("--compare-out", help="--compare-revs: where runs keep their JSON and outputs (default: a temp dir)")
    r.add_argument("--within", type=parse_bound, metavar="ABS,PCT",
                   help="--compare-revs: mark each row whose B is no worse than A by more than max(ABS, PCT %% of A), "
                        "in the compared metric's units (a lower B always is), and count them per lane")
    r.add_argument("--turn-cpus", type=int, default=DEFAULT_CPUS, metavar="N",
                   help="--compare-revs of a case that takes turns: pin both runs of a round to the same N CPUs, the "
                        "highest this process may use (0: no pinning)")
    return p


# Options only the --compare-revs parent (or the launcher) uses, with how many values each takes: left out of the
# argv the child runs get.
PARENT_ONLY = {"--compare-revs": 2, "--rounds": 1, "--json": 1, "--compare-out": 1, "--tree-libraries": 0,
               "--nproc": 1, "--turn-cpus": 1, "--within": 1}


def child_argv(argv: list[str], drop: dict[str, int] | None = None) -> list[str]:
    """``argv`` without the options in ``drop`` (default ``PARENT_ONLY``) and without a bare ``--``."""
    drop = PARENT_ONLY if drop is None else drop
    out, skip = [], 0
    for token in argv:
        if skip:
            skip -= 1
            continue
        name = token.split("=", 1)[0]
        if name in drop:
            skip = 0 if "=" in token else drop[name]
            continue
        if token == "--":
            continue
        out.append(token)
    return out
