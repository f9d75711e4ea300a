"""Process setup: the ranks a case runs on, and how they were launched.

A case runs on every rank of one SP group spanning the world: ranks that ``torchrun`` started, ranks the harness
starts itself (``--nproc N``: it relaunches its own command under ``torch.distributed.run``), or one plain process
(SP1). On CUDA the device group is NCCL and each rank takes ``cuda:LOCAL_RANK``; on CPU, or for a case that only
measures the host (``backend = "gloo"``), everything is gloo. A process group that exists already (the test
launcher's ranks) is used as it is and left for its owner to destroy.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

COMMAND_ENV = "FASTVIDEO_BENCH_COMMAND"  # the command the user ran, when the harness launched the ranks itself


@dataclass
class Ranks:
    rank: int
    world: int
    device: torch.device
    owned: bool  # this process created the process group (and destroys it)


def under_launcher() -> bool:
    """Whether this process is a rank that ``torch.distributed.run`` started."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


def relaunch(nproc: int, entry: str, argv: list[str]) -> int:
    """Run ``entry argv`` on ``nproc`` local ranks under ``torch.distributed.run`` and return its exit status.

    Blocks until every rank exits. The ranks record this process's command line as the run's command."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", entry, *argv]
    env = dict(os.environ, **{COMMAND_ENV: shlex.join(sys.orig_argv)})
    return subprocess.run(cmd, env=env).returncode


def command_line() -> tuple[str, str]:
    """(the command that started this run, how it is known: ``exact`` or ``reconstructed``)."""
    exact = os.environ.get(COMMAND_ENV)
    if exact:
        return exact, "exact"
    if under_launcher():
        nproc = os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
        return f"torchrun --nproc_per_node={nproc} {shlex.join(sys.argv)}", "reconstructed from torchrun's environment"
    return shlex.join(sys.orig_argv), "exact"


def init(device: str, backend: str = "device") -> Ranks:
    """Initialize the process group (NCCL on CUDA, gloo on CPU; gloo alone for ``backend="gloo"``) and one SP
    group over the world. Collective over the launched ranks; works as one plain process too (SP1)."""
    from fastvideo.distributed.parallel_state import initialize_sequence_parallel, model_parallel_is_initialized

    if backend == "gloo":
        device = "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu for a gloo run.")
    if dist.is_initialized():  # ranks started by someone else (the test launcher): theirs to tear down
        if not model_parallel_is_initialized():
            initialize_sequence_parallel(dist.get_world_size())
        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        return Ranks(dist.get_rank(), dist.get_world_size(), dev, owned=False)
    # One rank (a plain process, or WORLD_SIZE=1 set by hand): a store in this process, no port. A free port picked
    # here and bound later by the store could be taken in between by any other process on a busy host.
    plain = os.environ.get("WORLD_SIZE", "1") == "1"
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    store = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if plain else {}
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=dev, **store)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", **store)
    initialize_sequence_parallel(dist.get_world_size())
    return Ranks(dist.get_rank(), dist.get_world_size(), dev, owned=True)


def shutdown(ranks: Ranks | None) -> None:
    """Destroy the SP group and the process group this process created (close the line-up first:
    ``lineup.close``). Collective."""
    if ranks is None or not ranks.owned:
        return
    from fastvideo.distributed.parallel_state import destroy_sequence_parallel

    destroy_sequence_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_group():
    """The SP group's gloo group (host-side reductions of timings never touch the device)."""
    from fastvideo.distributed.parallel_state import get_sp_group

    return get_sp_group().cpu_group


def set_route(route: str) -> None:
    """Select the public op's route for the following calls (``off``: the NCCL route; ``auto``: fused where
    agreed). Collective: every rank makes the same change at the same point, and the SP group agrees it."""
    from benchmarks.harness import product

    os.environ["FASTVIDEO_ULYSSES_A2A"] = route
    product.agree_settings()
