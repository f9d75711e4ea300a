"""The training loop both recipes share: process groups, the timed step, the progress line, checkpoints and
the run record (``run.json``) that ``report.py`` reads.

    device = init_groups(device="auto", sp=None)
    opt, first = prepare_training(model, device, lr=..., resume=..., resume_problem=...)
    records, checkpoints = train_steps(model, opt, step_loss, steps=..., first=..., ...)
    write_run(out_dir, run_record(...))

A step: the learning rate of the step (linear warm-up, a function of the step alone, so a resume continues it),
the forward and loss (``step_loss(step)``), backward, clip, AdamW step. It is timed between two barriers (the
slowest rank's time is recorded), the loss is averaged over the world (SP ranks hold the same loss: this is the
mean over DP), and the route its all-to-alls took is read from the helper (``route_probe.py``). Rank 0 draws
the progress line and writes ``run.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fastvideo.distributed import parallel_state as ps
from sp_recipes.checkpoint import load_checkpoint, save_checkpoint
from sp_recipes.fsdp import shard_dit, world_mesh
from sp_recipes.progress import ProgressBar
from sp_recipes.report import step_route_text
from sp_recipes.route_probe import RouteProbe

__all__ = ["init_groups", "prepare_training", "run_record", "train_steps", "write_run"]

SWITCH, LONG, OVERLAP = "FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING", "FASTVIDEO_ULYSSES_A2A_OVERLAP"


def init_groups(device: str, sp: int | None) -> torch.device:
    """World, TP1 and SP groups: gloo on the CPU (``device="cpu"``, or ``auto`` without CUDA), else NCCL with one
    rank per GPU. Collective over the world. Returns this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        ps.init_distributed_environment(world, rank, "env://", local, backend="gloo")
        ps.initialize_model_parallel(1, sp or world)
    else:
        ps.maybe_init_distributed_environment_and_model_parallel(1, sp or world)
    return ps.get_local_torch_device()


def prepare_training(model: torch.nn.Module, device: torch.device, *, lr: float, resume: str | Path | None,
                     resume_problem: Callable[[dict[str, Any]], str | None]) -> tuple[torch.optim.Optimizer, int]:
    """Shard ``model`` (its ``blocks``) over the world, bf16 parameters on CUDA; its AdamW; and, with ``resume``, the
    checkpoint's weights, optimizer state and step. Collective over the world; every rank passes the same values.
    ``resume_problem(meta)`` says why the checkpoint does not belong to this model (``ValueError``), or None.
    Returns the optimizer and the last step done (0 without ``resume``)."""
    shard_dit(model, world_mesh(device), blocks=model.blocks,
              param_dtype=torch.bfloat16 if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    if not resume:
        return opt, 0
    first, meta = load_checkpoint(resume, model, opt)
    problem = resume_problem(meta)
    if problem:
        raise ValueError(f"--resume {resume}: {problem}.")
    return opt, first


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, step_loss: Callable[[int], torch.Tensor], *,
                first: int, steps: int, lr: float, warmup_steps: int, clip: float, every: int, out_dir: Path,
                checkpoint_meta: dict[str, Any], device: torch.device, label: str
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Steps ``first + 1`` to ``steps``; checkpoints every ``every`` steps and at the last. Collective over the
    world. Returns the step records and the checkpoints written."""
    world, sp = ps.get_world_group(), ps.get_sp_group()
    backend = dist.get_backend()
    probe = RouteProbe(sp.world_size)
    bar = ProgressBar(steps, label, first=first) if world.rank_in_group == 0 else None
    records: list[dict[str, Any]] = []
    checkpoints: list[dict[str, Any]] = []
    for step in range(first + 1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, step / warmup_steps)
        probe.mark()
        _sync(device)
        dist.barrier(group=world.cpu_group)
        start = time.perf_counter()
        loss = step_loss(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        seconds = time.perf_counter() - start
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total, group=world.cpu_group)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=world.cpu_group)
        route = probe.taken()
        record = {"step": step, "loss": total.item() / world.world_size, "step_ms": slowest.item() * 1e3,
                  "route": route}
        records.append(record)
        if bar is not None:
            bar.update(step, record["loss"], record["step_ms"], step_route_text(route, backend))
        if step % every == 0 or step == steps:
            path = out_dir / "checkpoints" / f"step_{step:06d}.safetensors"
            save_checkpoint(path, model, opt, step=step, metadata=checkpoint_meta)
            checkpoints.append({"step": step, "path": str(path)})
    if bar is not None:
        bar.close()
    return records, checkpoints


def helper_summary() -> dict[str, Any] | None:
    """The op's helper's construction and counts (None: no helper, the switch is off)."""
    from fastvideo.distributed.ulysses import registry

    _, helper = registry.resolved()
    if helper is None:
        return None
    stats = helper.stats()  # type: ignore[union-attr]
    return {k: stats[k] for k in ("construction", "construction_detail", "calls", "fused", "declines", "plans")}


def run_record(*, model: str, device: torch.device, steps: list[dict[str, Any]],
               checkpoints: list[dict[str, Any]], resumed_from: dict[str, Any] | None,
               **extra: Any) -> dict[str, Any]:
    """The run record ``report.py`` reads: the agreed switches, the groups, the backend, every step."""
    world, sp, dp = ps.get_world_group(), ps.get_sp_group(), ps.get_dp_group()
    agreed = sp.settings
    assert agreed is not None
    return {"switch": agreed[SWITCH], "long_training": agreed[LONG], "overlap": agreed[OVERLAP], "model": model,
            "world_size": world.world_size, "sp_size": sp.world_size, "dp_size": dp.world_size,
            "device": device.type, "backend": dist.get_backend(), "torch": torch.__version__,
            "steps": steps, "checkpoints": checkpoints, "resumed_from": resumed_from,
            "helper": helper_summary(), **extra}


def write_run(out_dir: Path, run: dict[str, Any]) -> Path:
    """Write ``out_dir/run.json`` and say so on stderr, with the run's steps, groups and backend (rank 0 only; the
    caller checks)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "run.json"
    path.write_text(json.dumps(run, indent=1) + "\n")
    print(f"[{run['switch']}] {len(run['steps'])} steps on {run['world_size']} ranks (SP{run['sp_size']} x "
          f"DP{run['dp_size']}, {run['backend']} on {run['device']}); run record {path}", file=sys.stderr)
    return path
