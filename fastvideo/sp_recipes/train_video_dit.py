"""The training recipe: the video DiT (``fastvideo/sp_recipes/video_dit.py``) trained with sequence parallelism under
FSDP2 on synthetic video latents, and the comparison of the two all-to-all routes.

    torchrun --standalone --nproc_per_node=N -m fastvideo.sp_recipes.train_video_dit train --out-dir D [options]
    python -m fastvideo.sp_recipes.train_video_dit compare OFF/run.json AUTO/run.json [--resumed R/run.json]

``examples/training/video_dit/`` holds the recipe scripts (they export ``FASTVIDEO_ULYSSES_A2A`` and
``FASTVIDEO_ULYSSES_A2A_LONG_TRAINING`` and launch this), and ``scripts/run_demo.sh`` runs the whole recipe.

``train``: one rank per GPU over NCCL (bf16 compute, fp32 master weights), or over gloo on the CPU (fp32). The
SP group spans ``--sp`` ranks (default: all), DP groups run across them; FSDP2 shards every block and the root
over the whole world. Each step draws its batch from ``(seed, step, DP rank)``, takes one AdamW step, and
rank 0 draws a progress line with the loss (mean over DP ranks), the step time (rank max) and the route the
step's all-to-alls took. Checkpoints (safetensors, ``fastvideo/sp_recipes/checkpoint.py``) every ``--ckpt-every``
steps and at the end; ``--resume`` continues from one. ``run.json`` in ``--out-dir`` records every step.

``compare``: the closing table of the runs, an assertion that every run's losses equal the first run's (the
routes move the same bytes, so the losses must be identical; exit 1 if not), the same for a resumed run against
the run it resumed, and a PNG plot of loss and step time per route (skipped with a note without matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fastvideo.attention.dense import attention_backend
from fastvideo.distributed import parallel_state as ps
from fastvideo.distributed.communication_op import warmup_sequence_parallel_communication
from fastvideo.distributed.device_communicators.ulysses_a2a import current_default_helper
from fastvideo.sp_recipes.checkpoint import load_checkpoint, save_checkpoint
from fastvideo.sp_recipes.data import SyntheticVideoLatents
from fastvideo.sp_recipes.fsdp import shard_dit, world_mesh
from fastvideo.sp_recipes.progress import ProgressBar
from fastvideo.sp_recipes.video_dit import CONFIGS, VideoDiT, VideoDiTConfig, flow_matching_loss

ROUTE, LONG = "FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING"
# Per device: the config, steps and batch a run takes unless told (tiny: 2 CPU ranks in seconds).
DEFAULTS = {"cpu": ("tiny", 30, 2), "cuda": ("small", 50, 1)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _next_seq(helper) -> int:
    return helper.history[-1].seq + 1 if helper is not None and helper.history else 0


def route_taken(sp_size: int, route: str, first_seq: int) -> tuple[str, int, int]:
    """``(label, fused calls, calls)`` for the all-to-alls since call ``first_seq`` (the helper's records)."""
    if sp_size == 1:
        return "identity (SP1)", 0, 0
    helper = current_default_helper()
    if route == "off" or helper is None:
        return "nccl", 0, 0
    records = [r for r in helper.history if r.seq >= first_seq]
    fused = sum(r.route == "fused" for r in records)
    reasons = sorted({r.reason.label for r in records if r.reason is not None})
    if fused == len(records):
        return f"fused {fused}/{len(records)}", fused, len(records)
    label = f"nccl {len(records) - fused}/{len(records)}" + (f" ({', '.join(reasons)})" if reasons else "")
    return label, fused, len(records)


def _init(args) -> torch.device:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    sp = args.sp or world
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        ps.init_distributed_environment(world, rank, "env://", local, backend="gloo")
        ps.initialize_model_parallel(1, sp)
    else:
        ps.maybe_init_distributed_environment_and_model_parallel(1, sp)
    return ps.get_local_torch_device()


def train(args) -> int:
    device = _init(args)
    sp, dp = ps.get_sp_group(), ps.get_dp_group()
    world = ps.get_world_group()
    name, steps, batch_size = DEFAULTS[device.type]
    cfg = CONFIGS[args.config or name]
    steps, batch_size = args.steps or steps, args.batch or batch_size
    agreed = sp.settings
    assert agreed is not None
    route, long_training = agreed[ROUTE], agreed[LONG]
    rank0 = world.rank_in_group == 0
    out_dir = Path(args.out_dir)
    try:
        torch.manual_seed(args.seed)  # the same initial weights on every rank before sharding
        with torch.device(device):
            model = VideoDiT(cfg, seq_shard=args.seq_shard)
        if device.type == "cuda":
            # Runs on both routes must give the same losses: flash-attn's default backward accumulates with atomics.
            for block in model.blocks:
                block.attn.deterministic = True
            torch.use_deterministic_algorithms(True, warn_only=True)
        shard_dit(model, world_mesh(device), blocks=model.blocks,
                  param_dtype=torch.bfloat16 if device.type == "cuda" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
        first = 0
        if args.resume:
            first, meta = load_checkpoint(args.resume, model, opt)
            if VideoDiTConfig.from_dict(meta["config"]) != cfg:
                raise ValueError(f"--resume {args.resume}: it holds config {meta['config']}, not {cfg.to_dict()}.")
        warmup_sequence_parallel_communication()  # under auto: builds the helper before the first step
        data = SyntheticVideoLatents(cfg, seed=args.seed)
        every = args.ckpt_every or max(1, steps // 2)
        bar = ProgressBar(steps, route, first=first) if rank0 else None
        records, checkpoints = [], []
        for step in range(first + 1, steps + 1):
            for group in opt.param_groups:  # linear warm-up, a function of the step alone (resumable)
                group["lr"] = args.lr * min(1.0, step / args.warmup_steps)
            batch = data.batch(step, batch_size=batch_size, dp_rank=dp.rank_in_group, dp_size=dp.world_size)
            batch = batch.to(device)
            mark = _next_seq(current_default_helper())
            _sync(device)
            dist.barrier(group=world.cpu_group)
            start = time.perf_counter()
            loss = flow_matching_loss(model(batch.xt, batch.t, batch.text), batch.x0, batch.noise)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            seconds = time.perf_counter() - start
            total = torch.tensor([loss.item()], dtype=torch.float64)
            dist.all_reduce(total, group=world.cpu_group)  # SP ranks hold the same loss: this is the mean over DP
            slowest = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=world.cpu_group)
            label, fused, calls = route_taken(sp.world_size, route, mark)
            record = {"step": step, "loss": total.item() / world.world_size, "step_ms": slowest.item() * 1e3,
                      "route": label, "fused_calls": fused, "calls": calls}
            records.append(record)
            if bar is not None:
                bar.update(step, record["loss"], record["step_ms"], label)
            if step % every == 0 or step == steps:
                path = out_dir / "checkpoints" / f"step_{step:06d}.safetensors"
                save_checkpoint(path, model, opt, step=step, metadata={"config": cfg.to_dict(), "route": route})
                checkpoints.append({"step": step, "path": str(path)})
        if bar is not None:
            bar.close()
        if rank0:
            run = {
                "route": route, "long_training": long_training, "overlap": agreed["FASTVIDEO_ULYSSES_A2A_OVERLAP"],
                "config": args.config or name,
                "model": cfg.to_dict(), "seq_shard": args.seq_shard, "world_size": world.world_size,
                "sp_size": sp.world_size, "dp_size": dp.world_size, "device": device.type,
                "backend": dist.get_backend(),
                "attention": attention_backend(torch.empty(1, device=device,
                                                           dtype=torch.bfloat16 if device.type == "cuda" else None)),
                "torch": torch.__version__, "steps": records, "checkpoints": checkpoints,
                "resumed_from": {"path": args.resume, "step": first} if args.resume else None,
                "helper": _helper_summary(),
            }
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "run.json").write_text(json.dumps(run, indent=1) + "\n")
            print(f"[{route}] {len(records)} steps on {world.world_size} ranks (SP{sp.world_size} x DP{dp.world_size},"
                  f" {dist.get_backend()} on {device.type}); run record {out_dir / 'run.json'}", file=sys.stderr)
    finally:
        ps.cleanup_dist_env_and_memory()
    return 0


def _helper_summary() -> dict | None:
    helper = current_default_helper()
    if helper is None:
        return None
    stats = helper.stats()
    return {k: stats[k] for k in ("construction", "construction_detail", "calls", "fused", "declines", "plans")}


# ---------------------------------------------------------------------------------------------- compare


def _load(path: str) -> dict:
    run = json.loads(Path(path).read_text())
    run["path"] = path
    return run


def _losses(run: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run["steps"]}


def _median_ms(run: dict) -> float:
    times = [r["step_ms"] for r in run["steps"]]
    warm = times[1:] or times  # the first step pays for lazy set-up
    return statistics.median(warm)


def _routes(run: dict) -> str:
    return ", ".join(sorted({r["route"] for r in run["steps"]}))


def write_plot(runs: list[dict], path: Path) -> str:
    """Loss and step time per step, one line per run. Returns what happened (written, or why skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib, or the package's dev extras)"
    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    styles = [{"linewidth": 3.5, "alpha": 0.45}, {"linewidth": 1.5, "linestyle": "--"},
              {"linewidth": 1, "linestyle": ":"}]
    for i, run in enumerate(runs):  # identical losses overlap: a wide pale line under a dashed one shows both
        steps = [r["step"] for r in run["steps"]]
        label, style = run.get("label", run["route"]), styles[i % len(styles)]
        ax_loss.plot(steps, [r["loss"] for r in run["steps"]], label=label, **style)
        ax_time.plot(steps, [r["step_ms"] for r in run["steps"]], label=label, **style)
    ax_loss.set(xlabel="step", ylabel="loss", title="loss per route")
    ax_time.set(xlabel="step", ylabel="ms", title="step time per route (slowest rank)")
    for ax in (ax_loss, ax_time):
        ax.legend()
        ax.grid(alpha=0.3)
    first = runs[0]
    fig.suptitle(f"video DiT {first['config']}: SP{first['sp_size']} x DP{first['dp_size']}, {first['backend']} on "
                 f"{first['device']}, torch {first['torch']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def compare(args) -> int:
    runs = [_load(p) for p in args.runs]
    reference = runs[0]
    ref_losses = _losses(reference)
    rows, ok = [], True
    for run in runs:
        same = _losses(run) == ref_losses
        ok &= same
        rows.append((run["route"], len(run["steps"]), run["steps"][0]["loss"], run["steps"][-1]["loss"],
                     _median_ms(run), _routes(run), "identical" if same else "DIFFER"))
    print(f"video DiT ({reference['config']}), {reference['world_size']} ranks: SP{reference['sp_size']} x "
          f"DP{reference['dp_size']}, {reference['backend']} on {reference['device']}, attention "
          f"{reference['attention']}, torch {reference['torch']}")
    print(f"{'route':6s} {'steps':>5s} {'first loss':>12s} {'final loss':>12s} {'median ms/step':>15s}  "
          f"{'losses vs ' + reference['route']:18s} all-to-all route")
    for route, n, first, final, ms, taken, same in rows:
        print(f"{route:6s} {n:5d} {first:12.6f} {final:12.6f} {ms:15.1f}  {same:18s} {taken}")
    if args.resumed:
        resumed = _load(args.resumed)
        start = resumed["resumed_from"]["step"]
        base = next((r for r in runs if r["route"] == resumed["route"]), reference)
        base_losses = _losses(base)
        mine = _losses(resumed)
        same = bool(mine) and all(base_losses.get(s) == v for s, v in mine.items())
        ok &= same
        print(f"resumed {resumed['route']} run from the step {start} checkpoint: steps {start + 1}-{max(mine)} "
              f"{'identical to' if same else 'DIFFER from'} the uninterrupted run")
    if args.plot:
        labelled = [{**r, "label": r["route"]} for r in runs]
        print(write_plot(labelled, Path(args.plot)))
    print("OK: every route trained to the same losses" if ok else "FAIL: the losses differ")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="one training run (under torchrun)")
    t.add_argument("--out-dir", required=True, help="run.json and checkpoints/ go here")
    t.add_argument("--config", choices=sorted(CONFIGS), help="model preset (default: tiny on CPU, small on CUDA)")
    t.add_argument("--steps", type=int, help="last step (default: 30 on CPU, 50 on CUDA)")
    t.add_argument("--batch", type=int, help="samples per DP rank and step (default: 2 on CPU, 1 on CUDA)")
    t.add_argument("--sp", type=int, help="SP size (default: every rank)")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup-steps", type=int, default=5)
    t.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--seq-shard", choices=("uneven", "pad"), default="uneven",
                   help="video tokens the SP size does not divide: uneven shares, no padding (default), or padded")
    t.add_argument("--ckpt-every", type=int, help="checkpoint every N steps (default: half the steps) and at the end")
    t.add_argument("--resume", help="a checkpoint to continue from (its step is the last one done)")
    c = sub.add_parser("compare", help="the closing table of runs; asserts equal losses")
    c.add_argument("runs", nargs="+", help="run.json files; the first is the reference")
    c.add_argument("--resumed", help="a run.json of a resumed run, checked against the run of its route")
    c.add_argument("--plot", help="write the loss / step-time PNG here")
    args = parser.parse_args(argv)
    if args.command == "compare":
        return compare(args)
    for name in ("steps", "batch", "sp", "ckpt_every", "warmup_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value}: must be >= 1")
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
