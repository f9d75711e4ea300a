"""The harness's driver: parse, set up the ranks, run one case, print, write, exit.

    python -m benchmarks.run CASE [flags]            # or an entry point: benchmarks/benchmark_ulysses_a2a.py ...
    torchrun --standalone --nproc_per_node=2 benchmarks/run.py CASE [flags]
    python -m benchmarks.run CASE --nproc 2 [flags]  # the harness starts the ranks itself

Exit status: 0, or 1 when any row has ``wrong > 0`` or the case reported a failure (2: bad usage).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.harness import lineup, process, report, turns
from benchmarks.harness.case import CASES, Context, get_case
from benchmarks.harness.cli import child_argv, common_parser
from benchmarks.harness.progress import Progress
from benchmarks.harness.tree import LIBRARY_ENV, LIBRARY_NAME, select_tree, use_kernel_library

RUN_PY = str(Path(__file__).resolve().parents[1] / "run.py")


def _early(argv: list[str]) -> argparse.Namespace:
    """The flags needed before anything imports fastvideo (the tree, the library)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--tree")
    pre.add_argument("--kernel-library")
    pre.add_argument("--compare-revs", nargs=2)
    return pre.parse_known_args([a for a in argv if a != "--"])[0]


def parse(case, argv: list[str]) -> argparse.Namespace:
    parser = common_parser(f"{case.name}: {case.summary}")
    case.add_arguments(parser)
    parser.set_defaults(**case.defaults)
    args = parser.parse_args([a for a in argv if a != "--"])
    if args.quick:
        for key, value in case.quick.items():
            setattr(args, key, value)
    for name in ("iters", "repeat", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def main(argv: list[str] | None = None, *, case_name: str | None = None, entry: str | None = None) -> int:
    """Run one case. ``case_name`` None: the first argument names it (``benchmarks/run.py``). ``entry``: the
    script the ranks run when the harness starts them (``--nproc``, ``--compare-revs``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prefix: list[str] = []
    if case_name is None:
        if not argv or argv[0].startswith("-"):
            print("usage: python -m benchmarks.run CASE [flags]   (CASE --help for its flags)\ncases: "
                  + ", ".join(sorted(CASES)), file=sys.stderr)
            return 2
        case_name, argv = argv[0], argv[1:]
        prefix = [case_name]
    entry = entry or RUN_PY
    early = _early(argv)
    if early.compare_revs and early.tree:
        raise SystemExit("--tree and --compare-revs exclude each other (--compare-revs names both trees)")
    tree = select_tree(early.tree)
    case = get_case(case_name)
    args = parse(case, argv)
    if args.compare_merge:
        if args.compare_revs:
            raise SystemExit("--compare-merge and --compare-revs exclude each other (a merge runs nothing)")
        from benchmarks.harness import revs

        return revs.merge(case, args)
    status = case.offline(args)
    if status is not None:
        return status
    if args.compare_revs:
        from benchmarks.harness import revs

        return revs.compare(case, args, argv, entry, prefix)
    if args.nproc and not process.under_launcher():
        return process.relaunch(args.nproc, entry, [*prefix, *child_argv(argv, {"--nproc": 1})])
    library = args.kernel_library
    if library is None and case.backend == "gloo" and LIBRARY_ENV not in os.environ and \
            (tree / "build" / "kernel" / LIBRARY_NAME).is_file():
        library = "dev"  # the host-only measurements use the tree's development build where one exists
    use_kernel_library(tree, library)
    return run(case, args)


def run(case, args: argparse.Namespace) -> int:
    """Set up the ranks, run ``case``, report. Collective over the launched ranks."""
    from benchmarks.harness.header import build_header, native_library, print_header

    ranks = process.init(args.device, case.backend)
    lineup.choose(args.lineup)
    ctx = Context(case, args, ranks.rank, ranks.world, ranks.device)
    ctx.header = build_header(ranks.device, ranks.world, case=case.name, extra={
        "dtype": args.dtype, "iters": args.iters, "warmup": args.warmup, "repeat": args.repeat, "quick": args.quick,
        "seed": args.seed,
        "bandwidth_definition": "bytes moved per rank / time; bytes moved per rank = operand bytes x (P-1)/P",
        "timing": "host-to-completion: perf_counter around the call + device synchronize, after a line-up, "
                  "rank-max per iteration; device: CUDA events (perf_counter on CPU), rank-max",
    })
    ctx.progress = Progress(0, every_s=args.progress_every, enabled=ctx.is_main)

    def finish(complete: bool) -> dict:
        header = ctx.header
        header.update(lineup=lineup.describe(), notes=list(ctx.notes), failures=list(ctx.failures),
                      complete=complete)
        if turns.taken():
            header["turns_taken"] = turns.taken()  # this run took turns with another (--compare-revs)
            if hasattr(os, "sched_getaffinity"):
                header["cpus"] = sorted(os.sched_getaffinity(0))  # where it ran (turns pin both runs alike)
        return report.document(header, ctx.rows, ctx.extra)

    def checkpoint() -> None:
        if ctx.is_main:
            report.write_json(args.json, finish(False))

    ctx.checkpoint_hook = checkpoint
    if ctx.is_main:
        print_header(ctx.header)
    try:
        case.run(ctx)
        if ctx.header.get("native_library") is None:
            try:
                from benchmarks.harness import product

                ctx.header["native_library"] = native_library(product.current_default_helper())
            except ImportError:  # a tree under test without the registry: name what is mapped
                ctx.header["native_library"] = native_library()
        wrong = [r for r in ctx.rows if r.get("wrong")]
        if ctx.is_main:
            for line in case.report(ctx):
                print(line)
            for r in wrong:
                print(f"# WRONG: {r['wrong']} element(s): " + ", ".join(f"{k}={r.get(k)}" for k in case.key))
            for why in ctx.failures:
                print(f"# FAILED: {why}")
            lib = ctx.header.get("native_library")
            print(f"# native library: {lib['path']} sha256={lib['sha256']}" if lib else "# native library: none loaded")
            report.write_json(args.json, finish(True))
            sys.stdout.flush()
        return 1 if wrong or ctx.failures else 0
    finally:
        process.set_route("off")
        lineup.close()  # its shared channel before the groups it was made over
        turns.finish()
        process.shutdown(ranks)
