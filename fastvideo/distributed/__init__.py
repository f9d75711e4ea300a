"""Upstream FastVideo's ``fastvideo.distributed``: the initialisation, group accessors and collectives that its
models, pipelines and tests import from here.

    from fastvideo.distributed import (cleanup_dist_env_and_memory, get_local_torch_device,
                                       maybe_init_distributed_environment_and_model_parallel)

Names resolve on first access (PEP 562), so that importing a submodule (``fastvideo.distributed.ulysses.policy``
needs no ``torch.distributed``) loads nothing else. Resolving one loads ``parallel_state``, ``communication_op``
and ``utils``, as upstream's eager imports do.
"""

from __future__ import annotations

from typing import Any

_PARALLEL_STATE = (
    "cleanup_dist_env_and_memory", "get_dp_group", "get_dp_rank", "get_dp_world_size", "get_local_torch_device",
    "get_sp_group", "get_sp_parallel_rank", "get_sp_world_size", "get_tp_group", "get_tp_rank", "get_tp_world_size",
    "get_world_group", "get_world_rank", "get_world_size", "init_distributed_environment",
    "initialize_model_parallel", "maybe_init_distributed_environment_and_model_parallel",
    "model_parallel_is_initialized",
)
_COMMUNICATION_OP = (
    "sequence_model_parallel_all_gather", "sequence_model_parallel_all_gather_with_unpad",
    "sequence_model_parallel_all_to_all_4D", "sequence_model_parallel_shard", "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce", "warmup_sequence_parallel_communication",
)
_UTILS = (
    "StatelessProcessGroup", "compute_padding_for_sp", "divide", "ensure_divisibility", "pad_sequence_tensor",
    "split_tensor_along_last_dim", "unpad_sequence_tensor",
)
__all__ = sorted((*_PARALLEL_STATE, *_COMMUNICATION_OP, *_UTILS))


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # communication_op also loads the Ulysses layer that device_communicator.ulysses_a2a reaches.
    from fastvideo.distributed import communication_op, parallel_state, utils

    module = parallel_state if name in _PARALLEL_STATE else communication_op if name in _COMMUNICATION_OP else utils
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
