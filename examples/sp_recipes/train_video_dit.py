"""The benchmark training recipe: this repository's own video DiT (``examples/sp_recipes/video_dit.py``) trained with
sequence parallelism under FSDP2 on synthetic video latents, and the comparison of the two all-to-all routes. It
needs no upstream FastVideo, so it serves the offline GPU hosts' benchmarks; the main job trains upstream's Wan DiT
(``train_wan.py``).

    torchrun --standalone --nproc_per_node=N -m sp_recipes.train_video_dit train --out-dir D [options]
    python -m sp_recipes.train_video_dit compare OFF/run.json AUTO/run.json [--resumed R/run.json]

with ``examples/`` on ``PYTHONPATH`` (the recipe scripts put it there).

``examples/training/video_dit/`` holds the recipe scripts (they export ``FASTVIDEO_ULYSSES_A2A`` and
``FASTVIDEO_ULYSSES_A2A_LONG_TRAINING`` and launch this; ``compare_routes.sh`` runs the whole recipe).

``train``: one rank per GPU over NCCL (bf16 compute, fp32 master weights), or over gloo on the CPU (fp32). The
SP group spans ``--sp`` ranks (default: all), DP groups run across them; FSDP2 shards every block and the root
over the whole world. Each step draws its batch from ``(seed, step, DP rank)``, takes one AdamW step, and
rank 0 draws a progress line with the loss (mean over DP ranks), the step time (rank max) and the route the
step's all-to-alls took (the shared loop: ``loop.py``). Checkpoints (safetensors, ``checkpoint.py``) every
``--ckpt-every`` steps and at the end; ``--resume`` continues from one. ``run.json`` in ``--out-dir`` records
every step.

``compare``: the closing table of the runs (``report.py``, shared with the Wan recipe): asserts that every run's
losses equal the first run's (the routes move the same bytes; exit 1 if not) and a resumed run's the run it
resumed, names the backend and the route each run took, says when a timing difference is noise, and plots loss
and step time per run (skipped with a note without matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from fastvideo.attention.dense import attention_backend
from fastvideo.distributed import parallel_state as ps
from fastvideo.distributed.communication_op import warmup_sequence_parallel_communication
from sp_recipes.data import SyntheticVideoLatents
from sp_recipes.loop import init_groups, prepare_training, run_record, train_steps, write_run
from sp_recipes.recipe_cli import compare, parser_for
from sp_recipes.video_dit import CONFIGS, VideoDiT, VideoDiTConfig, flow_matching_loss

# Per device: the config, steps and batch a run takes unless told (tiny: 2 CPU ranks in seconds).
DEFAULTS = {"cpu": ("tiny", 30, 2), "cuda": ("small", 50, 1)}


def train(args: argparse.Namespace) -> int:
    device = init_groups(args.device, args.sp)
    try:
        dp, world = ps.get_dp_group(), ps.get_world_group()
        name, steps, batch_size = DEFAULTS[device.type]
        cfg = CONFIGS[args.config or name]
        steps, batch_size = args.steps or steps, args.batch or batch_size
        torch.manual_seed(args.seed)  # the same initial weights on every rank before sharding
        with torch.device(device):
            model = VideoDiT(cfg, seq_shard=args.seq_shard)
        if device.type == "cuda":
            # Runs on both routes must give the same losses: flash-attn's default backward accumulates with atomics.
            for block in model.blocks:
                block.attn.deterministic = True
            torch.use_deterministic_algorithms(True, warn_only=True)
        opt, first = prepare_training(model, device, lr=args.lr, resume=args.resume, resume_problem=lambda meta: (
            None if VideoDiTConfig.from_dict(meta["config"]) == cfg
            else f"it holds config {meta['config']}, not {cfg.to_dict()}"))
        warmup_sequence_parallel_communication()  # under auto: builds the helper before the first step
        data = SyntheticVideoLatents(cfg, seed=args.seed)

        def step_loss(step: int) -> torch.Tensor:
            batch = data.batch(step, batch_size=batch_size, dp_rank=dp.rank_in_group, dp_size=dp.world_size)
            batch = batch.to(device)
            return flow_matching_loss(model(batch.xt, batch.t, batch.text), batch.x0, batch.noise)

        out_dir = Path(args.out_dir)
        switch = ps.get_sp_group().settings["FASTVIDEO_ULYSSES_A2A"]  # type: ignore[index]
        records, checkpoints = train_steps(
            model, opt, step_loss, first=first, steps=steps, lr=args.lr, warmup_steps=args.warmup_steps,
            clip=args.clip, every=args.ckpt_every or max(1, steps // 2), out_dir=out_dir,
            checkpoint_meta={"config": cfg.to_dict(), "route": switch}, device=device, label=switch)
        if world.rank_in_group == 0:
            attention = attention_backend(torch.empty(1, device=device,
                                                      dtype=torch.bfloat16 if device.type == "cuda" else None))
            run = run_record(model=f"video DiT ({args.config or name})", device=device, steps=records,
                             checkpoints=checkpoints,
                             resumed_from={"path": args.resume, "step": first} if args.resume else None,
                             config=args.config or name, config_fields=cfg.to_dict(), seq_shard=args.seq_shard,
                             attention=attention)
            write_run(out_dir, run)
    finally:
        ps.cleanup_dist_env_and_memory()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, t = parser_for(__doc__.split("\n")[0], defaults="30 on CPU, 50 on CUDA",
                           batch_default="default: 2 on CPU, 1 on CUDA", config_choices=sorted(CONFIGS))
    t.add_argument("--seq-shard", choices=("uneven", "pad"), default="uneven",
                   help="video tokens the SP size does not divide: uneven shares, no padding (default), or padded")
    args = parser.parse_args(argv)
    return compare(args) if args.command == "compare" else train(args)


if __name__ == "__main__":
    sys.exit(main())
