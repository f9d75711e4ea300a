"""The harness case ``dit_step``: a full DiT step per route and LONG_TRAINING value (``benchmarks.dit.runner``).

The model is ``benchmarks.dit.model``; the tables and the plot ``benchmarks.dit.report``; the targets are judged by
``benchmarks/check_results.py`` from the JSON this case writes (rewritten after every token count, so a run stopped
by a time limit keeps what it finished). Without ranks: ``--estimate`` prints the run's wall-time estimate,
``--plot-from JSON... --plot PNG`` plots saved runs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import ClassVar

import torch

from benchmarks.dit import estimate, report, runner
from benchmarks.dit.model import SparseAttention, attention_backend, build_model, dense_attention
from benchmarks.harness import product
from benchmarks.harness.case import Case, Context
from benchmarks.harness.cli import DTYPES

DTYPE_CHOICES = ("bf16", "fp16")
DEFAULT_ROUTES = "off,auto"  # without --routes: auto may drop out (with a note) where its helper cannot be built


def estimate_of(args, tokens: list[int], longs: list[str], routes: list[str], world: int) -> dict:
    return estimate.estimate_seconds(
        hidden=args.hidden, heads=args.heads, blocks=args.blocks, tokens=tokens, world=world,
        sparse=args.attention == "sparse", n_long=len(longs) if "auto" in routes else 0, trials=args.repeat,
        share=not args.skip_share, offload=lambda n: runner.offload_for(args, n), op_iters=args.iters,
        op_warmup=args.warmup)


def long_values(args) -> list[str]:
    from fastvideo import envs

    return runner.parse_long_training(args.long_training, envs.get(runner.LONG_VAR))


class DitStepCase(Case):
    name = "dit_step"
    summary = "a full DiT step (FSDP2, checkpointing, AdamW) per route: share, op in and out of the step, gains"
    key = ("tokens", "route", "long_training", "kind")
    metric = "median_s"
    defaults: ClassVar[dict] = {"iters": 10, "warmup": 2, "repeat": 3}
    quick: ClassVar[dict] = {"iters": 2, "warmup": 1}

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("dit_step")
        g.add_argument("--hidden", type=int, default=7168)
        g.add_argument("--heads", type=int, default=56)
        g.add_argument("--blocks", type=int, default=4, help="DiT blocks (4 at hidden 7168: ~2.5B params)")
        g.add_argument("--tokens", help="comma list of global sequence lengths, Nk = N x 1024 "
                                        "(default 32k,64k,128k; plus 250000 with --offload-activations)")
        g.add_argument("--routes", default=None,
                       help="'off,auto' or 'off' (the NCCL route alone); default: off,auto, auto dropped with a note "
                            "where its helper cannot be built; named here, auto must run")
        g.add_argument("--trials", dest="repeat", type=int, help="rotated trials per variant (>= 3): --repeat")
        g.add_argument("--op-iters", dest="iters", type=int, help="op-level calls per round: --iters")
        g.add_argument("--op-warmup", dest="warmup", type=int, help="op-level warm-up calls per round: --warmup")
        g.add_argument("--attention", choices=("dense", "sparse"), default="dense", help="sparse needs CUDA")
        g.add_argument("--offload-activations", action="store_true")
        g.add_argument("--offload-above", type=int, default=0, metavar="TOKENS",
                       help="with --offload-activations, offload only token counts above this")
        g.add_argument("--no-checkpointing", action="store_true", help="disable full activation checkpointing")
        g.add_argument("--long-training", help="comma list of FASTVIDEO_ULYSSES_A2A_LONG_TRAINING values (auto, "
                                               "chunked): one auto variant each (default: the environment's value)")
        g.add_argument("--engine", choices=("table", "sm", "ce"), default="table",
                       help="fused-route plans from TUNED_TABLE as it is (default), or from its rows of one engine")
        g.add_argument("--grad-factor", type=float, default=4.0,
                       help="gradient threshold = factor x max abs diff of two repeated NCCL-route steps")
        g.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max norm")
        g.add_argument("--overlap", type=int, default=None, metavar="N",
                       help="attention head groups pipelined under their exchanges (DistributedAttention's "
                            "overlap_chunks; default: the agreed FASTVIDEO_ULYSSES_A2A_OVERLAP; 0: off); the "
                            "check pass then times the synchronous calls only")
        g.add_argument("--skip-share", action="store_true", help="skip the all-to-all share (no ideal gain then)")
        g.add_argument("--plot", help="PNG of step time per route against tokens (skipped without matplotlib)")
        g.add_argument("--plot-from", nargs="+", metavar="JSON", help="no run: plot these saved runs into --plot")
        g.add_argument("--estimate", action="store_true", help="no run: print the wall-time estimate of this run")
        g.add_argument("--estimate-world", type=int, default=2, help="SP size for --estimate")
        g.add_argument("--save", help="directory: per-rank safetensors of inference outputs and gradients")

    def offline(self, args) -> int | None:
        """``--plot-from`` and ``--estimate`` answer without ranks."""
        if args.plot_from:
            if not args.plot:
                raise SystemExit("--plot-from needs --plot PATH")
            result = report.write_plot([json.loads(Path(p).read_text()) for p in args.plot_from], args.plot)
            print(f"# plot: {result['path'] or 'skipped: ' + str(result['skipped'])}")
            return 0
        if args.estimate:
            routes = [r.strip() for r in (args.routes or DEFAULT_ROUTES).split(",")]
            est = estimate_of(args, runner.default_tokens(args), long_values(args), routes, args.estimate_world)
            estimate.print_estimate(est, args)
            return 0
        return None

    def report(self, ctx: Context) -> list[str]:
        lines = [*report.step_table(ctx.rows), *report.gain_table(ctx.rows), *report.detail_lines(ctx.rows)]
        plot = ctx.extra.get("plot") or {}
        lines.append(f"# plot: {plot.get('path') or 'skipped: ' + str(plot.get('skipped'))}")
        if ctx.args.json:
            lines.append(f"# targets and verdicts: python benchmarks/check_results.py {ctx.args.json}")
        return lines

    def run(self, ctx: Context) -> None:
        args, device, world = ctx.args, ctx.device, ctx.world
        t_main = time.perf_counter()
        if args.repeat < 3:
            raise SystemExit("--trials/--repeat must be >= 3 (a median of fewer is no measurement)")
        if args.dtype not in DTYPE_CHOICES:
            raise SystemExit(f"--dtype {args.dtype}: the DiT step computes in {' or '.join(DTYPE_CHOICES)}")
        if args.hidden % args.heads or args.heads % world:
            raise SystemExit(f"--hidden {args.hidden} / --heads {args.heads}: heads must divide hidden and SP{world} "
                             "must divide heads")
        tokens, longs = runner.default_tokens(args), long_values(args)
        routes = [r.strip() for r in (args.routes or DEFAULT_ROUTES).split(",")]
        attn = dense_attention
        if args.attention == "sparse":
            if device.type != "cuda":  # never the default: always asked for by name
                ctx.unavailable("--attention sparse", "it needs CUDA (flex_attention kernels)", named=True)
            attn = SparseAttention(device)
        probe_t = torch.empty(1, 1, 1, 1, device=device, dtype=DTYPES[args.dtype])
        backend = "flex_attention (90% block-sparse)" if attn is not dense_attention else attention_backend(probe_t)
        helper = None
        if "auto" in routes and world > 1:
            try:
                helper = product.default_helper(device)
                if device.type == "cpu":
                    ctx.note("CPU: GlooPlanTransport injected for the auto route (timings mean nothing)")
                if args.engine != "table":
                    helper.tuned_table = runner.restrict_engine(helper.tuned_table, args.engine)
                    ctx.note(f"--engine {args.engine}: the helper plans from TUNED_TABLE's {args.engine} rows only")
            except Exception as exc:  # noqa: BLE001 - reported; auto rows are dropped, or the run fails
                ctx.unavailable("--routes auto", f"helper construction failed: {type(exc).__name__}: {exc}",
                                named=args.routes is not None)
                routes = [r for r in routes if r != "auto"]
        variants = [runner.Variant("off", longs[0], infer=True)]
        if "auto" in routes:
            variants += [runner.Variant("auto", lt, infer=i == 0) for i, lt in enumerate(longs)]
        if len(longs) > 1 and "auto" in routes:
            ctx.note(f"inference rows only for long={longs[0]}: no-grad operands ignore LONG_TRAINING")
        probe = runner.Probe(device)
        dispatch = runner.Dispatch(probe)
        model = build_model(args, device, attn, dispatch)
        from fastvideo.distributed.ulysses.overlap_plan import check_chunks

        for block in model.blocks:
            block.attn.overlap_chunks = check_chunks("--overlap", args.heads, args.overlap)
        overlap = model.blocks[0].attn.overlap_groups()
        steps = runner.Runner(args, model, device, probe)
        ctx.header.update(
            hidden=args.hidden, heads=args.heads, blocks=args.blocks, params=sum(p.numel() for p in model.parameters()),
            attention=backend, offload_activations=args.offload_activations, offload_above=args.offload_above,
            engine=args.engine, overlap=overlap, checkpointing=not args.no_checkpointing, trials=args.repeat,
            long_training=longs,
            op_iters=args.iters, helper=helper.stats() if helper is not None else None,
            window_bytes=getattr(helper, "window_bytes", None),
            timing_note="CPU run over gloo: timings and memory are not measurements" if device.type != "cuda" else None,
            a2a_share_method="1 - t(op replaced by a local slice+repeat of the same shape) / t(NCCL route), both in "
                             "the same rotated trials",
            ideal_gain_rule="share x (1 - op_fused / op_nccl), op = isolated per-call medians x the step's calls",
            measured_gain_rule="1 - t_fused / t_nccl (step medians)",
            memory_rule="fused peak (+ window when outside torch's allocator) vs NCCL peak + window",
            grad_threshold_rule=f"{args.grad_factor} x max abs diff of two repeated NCCL-route steps",
            # The estimate beside the wall time (wall_s) calibrates the next run's planning.
            estimate_s=round(estimate_of(args, tokens, longs, routes, world)["total_s"], 1)
            if device.type == "cuda" else None)
        bench = runner.Bench(args, ctx.rank, world, device, helper, steps, variants, ctx.notes, dispatch)
        shares, op_levels = [], []
        ctx.extra.update(a2a_share=shares, op_level=op_levels,
                         plot={"path": None, "skipped": "not requested" if not args.plot else "run not finished"})
        ctx.progress.total = len(tokens)
        for n_tok in tokens:
            if n_tok % world:
                ctx.note(f"tokens {n_tok} skipped: not divisible by SP{world}")
                continue
            new_rows, share, ops = bench.run_tokens(n_tok)
            for row in new_rows:
                ctx.add_row(row)
            shares.append(share)
            op_levels.append(ops)
            ctx.log(report.share_line(share)[2:])
            ctx.log(report.op_level_line(ops)[2:])
            ctx.header["wall_s"] = round(time.perf_counter() - t_main, 1)
            ctx.advance(f"{n_tok} tokens")
            ctx.checkpoint()
        if args.save:
            from safetensors.torch import save_file

            Path(args.save).mkdir(parents=True, exist_ok=True)
            save_file(bench.saved, str(Path(args.save) / f"dit_rank{ctx.rank}.safetensors"))
        if helper is not None:
            ctx.header["helper_after"] = helper.stats()
        if ctx.is_main and args.plot:
            ctx.extra["plot"] = report.write_plot([{"header": ctx.header, "rows": ctx.rows}], args.plot)
        ctx.header["wall_s"] = round(time.perf_counter() - t_main, 1)


CASE = DitStepCase()
