"""The main job: upstream FastVideo's own Wan DiT (``WanTransformer3DModel``) trained with sequence parallelism on
this package's Ulysses all-to-all, and the closing table of its runs.

    torchrun --standalone --nproc_per_node=N -m sp_recipes.train_wan train --out-dir D [options]
    python -m sp_recipes.train_wan compare OFF/run.json AUTO/run.json [--resumed R/run.json] [--plot P]

with ``examples/`` on ``PYTHONPATH`` after the overlay's (``examples/training/wan/train.sh`` puts it there).

``train`` runs inside the overlay (upstream ``fastvideo==0.2.1`` unpacked, this package's ``fastvideo/`` copied
over it): the model, its config class, the forward context and the attention layer are upstream's, imported
from the overlay; every all-to-all of its ``DistributedAttention`` goes through this package's public op. The
model is a tiny embedded config with random weights (``TINY``); the data are synthetic latent clips and caption
embeddings (``examples/sp_recipes/data.py``), the loss flow matching (velocity ``noise - x0`` at a uniform
``t``, timestep ``1000 t``). One rank per GPU over NCCL (bf16 compute, fp32 master weights), or over gloo on
the CPU (fp32). FSDP2 shards every block and the root over the world (``fsdp.py``); its reduce-scatter
averages the SP ranks' gradients, upstream's convention for SP training. Checkpoints are safetensors
(``checkpoint.py``); ``--resume`` continues from one. The loop, the progress line and ``run.json``:
``loop.py``.

Upstream's CPU platform selects no attention backend, so on the CPU this names torch SDPA for it (the one
patch, ``_cpu_attention_backend``); on GPUs ``FASTVIDEO_ATTENTION_BACKEND=TORCH_SDPA`` (exported by the recipe
script) selects the same backend.

``compare``: the closing table (``report.py``): asserts identical losses across the runs and for the resumed
steps (exit 1 otherwise), names the backend and the route each run took, and writes the plot.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from sp_recipes.data import LatentGeometry, SyntheticVideoLatents

# The tiny Wan config (upstream's WanVideoArchConfig fields): 2 blocks, 4 heads of 16, patch (1, 2, 2).
TINY: dict[str, Any] = {"num_attention_heads": 4, "attention_head_dim": 16, "in_channels": 4, "out_channels": 4,
                        "text_dim": 32, "freq_dim": 32, "ffn_dim": 128, "num_layers": 2, "patch_size": (1, 2, 2),
                        "rope_max_seq_len": 64, "text_len": 8}
# Latent clips of 4 frames of 10 x 12: 4 * 5 * 6 = 120 video tokens per clip; SP2 and SP3 divide it, SP4
# pads it (upstream's sequence_model_parallel_shard pads, and the gather unpads).
CLIP = {"frames": 4, "height": 10, "width": 12}
DEFAULTS = {"cpu": (30, 2), "cuda": (50, 2)}  # steps, clips per DP rank and step
OVERLAY_HELP = ("sp_recipes.train_wan needs upstream FastVideo 0.2.1 under this package (the overlay): "
                "run `bash scripts/run_demo.sh`, which builds it and launches this inside it")


class _NoNpuProbeError(logging.Filter):
    """Upstream logs its NPU probe's ImportError as an ERROR on every machine without an NPU; not an error here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("NPU detection failed")


def _upstream() -> dict[str, Any]:
    """Upstream's classes, from the overlay; a clear error where this package runs without upstream."""
    logging.getLogger("fastvideo.platforms").addFilter(_NoNpuProbeError())
    # FSDP2 warns that the model returns a view (upstream's unpatchify): the loss reads it, nothing writes in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    # requests (under huggingface_hub) warns when no charset detector is installed; nothing here decodes text.
    warnings.filterwarnings("ignore", message=r"Unable to find acceptable character detection dependency")
    try:
        from fastvideo.configs.models.dits.wanvideo import WanVideoArchConfig, WanVideoConfig
        from fastvideo.forward_context import set_forward_context
        from fastvideo.models.dits.wanvideo import WanTransformer3DModel
        from fastvideo.platforms import current_platform
    except ImportError as exc:
        raise SystemExit(f"{OVERLAY_HELP} ({type(exc).__name__}: {exc}).") from exc
    return {"arch": WanVideoArchConfig, "config": WanVideoConfig, "model": WanTransformer3DModel,
            "context": set_forward_context, "platform": current_platform}


def _cpu_attention_backend(platform: Any) -> None:
    """Upstream's CPU platform names no attention backend (``get_attn_backend_cls`` returns ""): torch SDPA."""
    if platform.is_cpu() and not platform.get_attn_backend_cls(None, 16, torch.float32):
        platform.get_attn_backend_cls = classmethod(
            lambda cls, *args, **kwargs: "fastvideo.attention.backends.sdpa.SDPABackend").__get__(platform)


def build_model(up: dict[str, Any], device: torch.device, seed: int) -> torch.nn.Module:
    """Upstream's ``WanTransformer3DModel`` of ``TINY``, the same random weights on every rank (seeded)."""
    fields = {k: v for k, v in TINY.items() if k != "text_len"}
    config = up["config"](arch_config=up["arch"](**fields))
    hf_config = {**fields, "text_len": TINY["text_len"]}
    torch.manual_seed(seed)
    with torch.device(device):
        model = up["model"](config=config, hf_config=hf_config)
    # Upstream allocates its linear layers' weights uninitialised (its loaders fill them): initialise all here.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                torch.nn.init.xavier_uniform_(p)
            elif name.endswith("weight") and "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model


def geometry() -> LatentGeometry:
    return LatentGeometry(in_channels=TINY["in_channels"], text_len=TINY["text_len"], text_dim=TINY["text_dim"],
                          **CLIP)


def train(args: argparse.Namespace) -> int:
    from fastvideo.distributed import parallel_state as ps
    from sp_recipes.loop import init_groups, prepare_training, run_record, train_steps, write_run

    up = _upstream()
    device = init_groups(args.device, args.sp)
    try:
        _cpu_attention_backend(up["platform"])
        steps, batch = DEFAULTS[device.type]
        steps, batch = args.steps or steps, args.batch or batch
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = build_model(up, device, args.seed)
        model.train()
        opt, first = prepare_training(model, device, lr=args.lr, resume=args.resume, resume_problem=lambda meta: (
            None if meta.get("model") == TINY_NAME else f"it holds model {meta.get('model')!r}, not {TINY_NAME!r}"))
        data = SyntheticVideoLatents(geometry(), seed=args.seed)
        dp = ps.get_dp_group()
        context = up["context"]  # no forward batch: nothing on the DiT's training path reads one

        def step_loss(step: int) -> torch.Tensor:
            b = data.batch(step, batch_size=batch, dp_rank=dp.rank_in_group, dp_size=dp.world_size).to(device)
            with context(current_timestep=step, attn_metadata=None):
                pred = model(hidden_states=b.xt.to(dtype), encoder_hidden_states=b.text.to(dtype),
                             timestep=(b.t * 1000).to(dtype))
            return torch.nn.functional.mse_loss(pred.float(), b.noise - b.x0)

        out_dir = Path(args.out_dir)
        records, checkpoints = train_steps(
            model, opt, step_loss, first=first, steps=steps, lr=args.lr, warmup_steps=args.warmup_steps,
            clip=args.clip, every=args.ckpt_every or max(1, steps // 2), out_dir=out_dir,
            checkpoint_meta={"model": TINY_NAME}, device=device,
            label=ps.get_sp_group().settings["FASTVIDEO_ULYSSES_A2A"])  # type: ignore[index]
        if ps.get_world_group().rank_in_group == 0:
            run = run_record(model=f"upstream {TINY_NAME}", device=device, steps=records, checkpoints=checkpoints,
                             resumed_from={"path": args.resume, "step": first} if args.resume else None,
                             config=TINY, clip=CLIP, batch=batch, attention_layer=_attention_layer(model))
            write_run(out_dir, run)
    finally:
        ps.cleanup_dist_env_and_memory()
    return 0


TINY_NAME = "WanTransformer3DModel (tiny)"


def _attention_layer(model: torch.nn.Module) -> str:
    """The module path of the blocks' self-attention layer (upstream's DistributedAttention, from the overlay)."""
    attn = model.blocks[0].attn1
    return f"{type(attn).__module__}.{type(attn).__qualname__}"


def main(argv: list[str] | None = None) -> int:
    from sp_recipes.recipe_cli import compare, parser_for

    parser, _ = parser_for(__doc__.split("\n")[0], defaults="30 steps on CPU, 50 on CUDA",
                        batch_default="2 clips per DP rank")
    args = parser.parse_args(argv)
    return compare(args) if args.command == "compare" else train(args)


if __name__ == "__main__":
    sys.exit(main())
