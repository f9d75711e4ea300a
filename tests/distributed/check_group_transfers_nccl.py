"""Upstream FastVideo's coordinator transfers over NCCL with CUDA tensors, on 2+ GPUs of one host:

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed/check_group_transfers_nccl.py \
        --json /tmp/transfers.json
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed/check_group_transfers_nccl.py \
        --cpu-dry-run          # the same logic over gloo on CPU

What the gloo tests (``test_group_transfers.py``) cannot reach: device tensors travel over the device group (NCCL)
and arrive on each rank's own GPU, CPU tensors of the same dictionary over the CPU group; ``graph_capture`` gives a
side stream a CUDA graph captures on; the node group of one host; and under ``FASTVIDEO_ULYSSES_A2A=auto``
``maybe_create_helper`` on the SP group (a ``UlyssesA2AHelper`` when the fused route is built, else None) and its
``try_all_to_all_4D`` against the NCCL route. Each check prints one line; rank 0 writes ``--json``; the exit status
is 1 if any check failed on any rank. Not a test module.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from tests.distributed.check_launch import init_check_group


def _value(rank: int, shape: tuple[int, ...], device: torch.device, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def run_checks(cpu: bool, expect_fused: bool) -> list[dict]:
    from fastvideo.distributed import maybe_init_distributed_environment_and_model_parallel
    from fastvideo.distributed import parallel_state as ps
    from fastvideo.distributed.device_communicators import ulysses_a2a

    world = dist.get_world_size()
    maybe_init_distributed_environment_and_model_parallel(1, world)
    sp, wg = ps.get_sp_group(), ps.get_world_group()
    rank, device = sp.rank_in_group, sp.device
    results: list[dict] = []

    def check(name: str, fn) -> None:
        try:
            ok, detail = fn()
        except Exception:  # noqa: BLE001 - reported as a failed check
            ok, detail = False, traceback.format_exc(limit=4)
        results.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"[rank {rank}] {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

    def broadcast():
        x = _value(rank, (64, 33), device, torch.bfloat16)
        sp.broadcast(x, src=world - 1)
        return _equal(x, _value(world - 1, (64, 33), device, torch.bfloat16)), str(x.device)

    def point_to_point():
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        t = _value(rank, (1000,), device)
        if rank % 2 == 0:
            sp.send(t)
            got = sp.recv(torch.Size([1000]), torch.float32)
        else:
            got = sp.recv(torch.Size([1000]), torch.float32)
            sp.send(t)
        return _equal(got, _value(prv, (1000,), device)), f"{got.device}, to {nxt}, from {prv}"

    def objects():
        if wg.rank_in_group == 0:
            got = [wg.recv_object(src=r) for r in range(1, world)]
            ok = got == [{"from": r, "videos": list(range(r))} for r in range(1, world)]
        else:
            wg.send_object({"from": wg.rank_in_group, "videos": list(range(wg.rank_in_group))}, dst=0)
            ok = True
        return ok, "world group, to rank 0 (upstream's validation pattern)"

    def mixed():
        return {"dev": _value(0, (4, 8), device, torch.float16), "cpu": _value(1, (3,), torch.device("cpu")),
                "empty": torch.empty(0, device=device), "strided": _value(2, (6, 4), device).t(), "n": 5}

    def tensor_dict_broadcast():
        got = sp.broadcast_tensor_dict(mixed() if rank == 0 else None, src=0)
        want = mixed()
        ok = list(got) == list(want) and got["n"] == 5 and all(
            _equal(got[k].contiguous(), want[k].contiguous()) for k in ("dev", "cpu", "empty", "strided"))
        return ok, f"dev on {got['dev'].device}, cpu on {got['cpu'].device}"

    def tensor_dict_p2p():
        if rank == 0:
            return sp.send_tensor_dict(mixed(), dst=1) is None, "sent"
        if rank == 1:
            got = sp.recv_tensor_dict(src=0)
            want = mixed()
            return all(_equal(got[k].contiguous(), want[k].contiguous()) for k in ("dev", "cpu", "strided")), "recv"
        return True, "idle"

    def capture():
        with sp.graph_capture() as ctx:
            if cpu:
                return ctx.stream is None, "no stream off CUDA"
            side = torch.cuda.current_stream(device) == ctx.stream
            x = torch.ones(16, device=device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=ctx.stream):
                y = x * 3
        x.fill_(2)
        graph.replay()
        torch.cuda.synchronize(device)
        return side and bool((y == 6).all()), "captured on the side stream and replayed"

    def node():
        node_group = ps.get_node_group()
        return node_group.ranks == list(range(world)), f"node ranks {node_group.ranks}"

    def helper():
        made = ulysses_a2a.maybe_create_helper(sp.cpu_group, sp.device_group, world, device, None)
        if made is None:
            built = ulysses_a2a.current_default_helper()
            detail = built.stats()["construction_detail"] if built is not None else "no helper (route off)"
            return not expect_fused, f"None: {detail}"
        x = _value(rank, (3, 64, 8 * world, 64), device, torch.bfloat16)
        y = made.try_all_to_all_4D(x, 2, 1)
        ref = sp.device_communicator.all_to_all_4D(x, 2, 1)
        route = made.history[-1].route
        return y is not None and _equal(y, ref) and (route == "fused" or not expect_fused), f"route {route}"

    for name, fn in (("broadcast (device)", broadcast), ("send/recv (device)", point_to_point),
                     ("send_object/recv_object", objects), ("broadcast_tensor_dict (mixed)", tensor_dict_broadcast),
                     ("send/recv_tensor_dict (mixed)", tensor_dict_p2p), ("graph_capture", capture),
                     ("node group", node), ("maybe_create_helper", helper)):
        check(name, fn)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=pathlib.Path, help="write every rank's results here (rank 0)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="the same logic over gloo on CPU")
    parser.add_argument("--expect-fused", action="store_true",
                        help="maybe_create_helper must return a helper and its call must run fused (kernel installed)")
    args = parser.parse_args()
    os.environ.setdefault("FASTVIDEO_ULYSSES_A2A", "auto")
    if not init_check_group("check_group_transfers_nccl", args.cpu_dry_run):
        return 2
    from fastvideo.distributed import cleanup_dist_env_and_memory

    results = run_checks(args.cpu_dry_run, args.expect_fused)
    failed = sum(not r["ok"] for r in results)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, results)
    total_failed = sum(not r["ok"] for per_rank in everyone for r in per_rank)
    if dist.get_rank() == 0:
        print(f"{sum(len(r) for r in everyone) - total_failed} passed, {total_failed} failed", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"ranks": everyone, "failed": total_failed}, indent=1))
    cleanup_dist_env_and_memory()
    return 1 if total_failed or failed else 0


if __name__ == "__main__":
    sys.exit(main())
