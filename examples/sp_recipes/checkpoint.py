"""Training checkpoints in one safetensors file: the full model and optimizer state, plus JSON metadata.

    save_checkpoint(path, model, optimizer, step=100, metadata={"config": cfg.to_dict()})   # collective
    step, metadata = load_checkpoint(path, model, optimizer)                               # collective

The model may be FSDP2-sharded: the full (unsharded) state is gathered to rank 0, which writes it, and loading
reads it on rank 0 and scatters each rank's shards (``torch.distributed.checkpoint.state_dict`` with
``full_state_dict`` and ``broadcast_from_rank0``), so a checkpoint does not depend on the world size it was
written at. Tensors are named ``model/<parameter>`` and ``optim/<parameter>/<state>``; the optimizer's param
groups, the step and the caller's metadata are the file's ``fastvideo`` metadata entry (JSON). Rank 0 writes a
temporary file and renames it, so an interrupted save never leaves a truncated checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["load_checkpoint", "save_checkpoint"]

FORMAT = "fastvideo-training-checkpoint/1"
_SAVE = StateDictOptions(full_state_dict=True, cpu_offload=True)
_LOAD = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
                    metadata: dict[str, Any] | None = None) -> Path:
    """Write ``path`` (rank 0). Collective over the world (the state is gathered); blocks the host until written."""
    path = Path(path)
    model_sd = get_model_state_dict(model, options=_SAVE)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=_SAVE)
    if _rank() == 0:
        tensors = {f"model/{name}": t.detach().contiguous() for name, t in model_sd.items()}
        for name, state in optim_sd["state"].items():
            for key, value in state.items():
                tensors[f"optim/{name}/{key}"] = torch.as_tensor(value).detach().contiguous()
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_sd["param_groups"]]
        meta = {"format": FORMAT, "step": step, "param_groups": groups, "metadata": metadata or {}}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"fastvideo": json.dumps(meta)})
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()  # every rank returns once the file exists
    return path


def _read(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get("fastvideo")
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    meta = json.loads(raw) if raw else {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: {path} is not a {FORMAT} file (format {meta.get('format')!r}).")
    return meta, tensors


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> tuple[int, dict[str, Any]]:
    """Load ``path`` into ``model`` (and ``optimizer``): ``(step, metadata)``. Collective over the world; rank 0
    reads the file. A missing or foreign file raises on every rank (the outcome is shared before anything loads)."""
    path = Path(path)
    meta: dict[str, Any] | None = None
    tensors: dict[str, torch.Tensor] = {}
    error = ""
    if _rank() == 0:
        try:
            meta, tensors = _read(path)
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    shared = [meta, error]
    if dist.is_initialized():
        dist.broadcast_object_list(shared, src=0)
    meta, error = shared
    if error:
        raise ValueError(f"load_checkpoint: cannot read {path} ({error}).")
    assert meta is not None
    model_sd = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
    set_model_state_dict(model, model_sd, options=_LOAD)
    if optimizer is not None:
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith("optim/"):
                name, _, field = key[len("optim/"):].rpartition("/")
                state.setdefault(name, {})[field] = value
        groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
        optim_sd = {"state": state, "param_groups": groups} if _rank() == 0 else {}
        set_optimizer_state_dict(model, optimizer, optim_sd, options=_LOAD)
    return int(meta["step"]), dict(meta["metadata"])
