#!/usr/bin/env python3
"""One GPU: the hot path (``fastvideo/distributed/ulysses/hot.py``) on the real kernel library, against the Python
path, through a one-rank helper over the shared-memory vote (P = 1: every share is the rank's own, so the output
is the input, bit for bit).

For each plan kind (SM 144 CTAs; copy engine 66 CTAs in 1 and 2 row chunks) and both modes, on one helper with
the hot path on and one with it off, it checks:
* every output equals the input, bit for bit, and the hot helper's outputs equal the Python path's;
* which path ran: the hot helper made every call after the first of a signature on the hot path
  (``stats()["hot_calls"]``), the Python-path helper none; both ran the same plan (the call records);
* a call on a side stream (``torch.cuda.stream``) is launched on that stream: its output is complete after that
  stream's synchronize, and the completion event is recorded there;
* a CUDA-graph capture of a held signature is left to the Python path (one vote at capture, the plan frozen,
  no hot call counted), and its replays are exact;
* the hot table's bookkeeping: a replan empties it, destroy closes it.

Needs the kernel library and the hot-path extension built beside it (``FASTVIDEO_KERNEL_LIBRARY``;
``python fastvideo-kernel/build_hot.py --out DIR``). Exits non-zero on any failure.

    FASTVIDEO_KERNEL_LIBRARY=build/kernel/libfastvideo_ulysses_a2a.so python tests/distributed/check_hot_path.py
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

try:
    import fastvideo_kernel  # noqa: F401
except ImportError:  # the loader is pure Python: use it from the source tree
    sys.path.insert(0, str(REPO / "fastvideo-kernel"))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

failures: list[str] = []
KINDS = (("sm", 144, 1), ("ce", 66, 1), ("ce", 66, 2))
SHAPE = (1, 4096, 12, 128)  # [B, S, H, D] at P = 1, bf16


def check(ok: bool, what: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        failures.append(what)


def one_rank() -> None:
    """A one-rank process group, SP group and the policy's SP-size bound lowered to 1 (as the benchmarks do)."""
    from fastvideo.distributed.parallel_state import initialize_sequence_parallel
    from fastvideo.distributed.ulysses import construction, policy

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    # As the benchmarks' one-rank runs: a store in this process, no port another process could take first.
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0), store=dist.HashStore(), rank=0, world_size=1)
    initialize_sequence_parallel(1)
    policy.MIN_WORLD_SIZE = construction.MIN_WORLD_SIZE = 1


def helper_for(engine: str, ctas: int, chunks: int, hot: bool):
    from fastvideo.distributed.ulysses.helper import UlyssesHelper
    from fastvideo.distributed.ulysses.policy import TunedRow, normalize_gpu_name

    os.environ["FASTVIDEO_ULYSSES_A2A_HOT_PATH"] = "1" if hot else "0"  # read when the helper is built
    gpu = normalize_gpu_name(torch.cuda.get_device_name(0))
    table = (TunedRow(gpu, 1, torch.bfloat16, SHAPE[2], SHAPE[3], ctas=ctas, planes_per_chunk=1, row_chunks=chunks,
                      engine=engine, source="check_hot_path (P = 1)"),)
    helper = UlyssesHelper(tuned_table=table, vote="shm")
    if not helper.fused_available:
        raise SystemExit(f"the one-rank helper declined: {helper.stats()['construction_detail']}")
    return helper


def calls(helper, x: torch.Tensor, mode: int, n: int) -> list[torch.Tensor]:
    with torch.no_grad():
        outs = [helper.all_to_all(x, mode) for _ in range(n)]
    torch.cuda.synchronize()
    return outs


def check_kind(engine: str, ctas: int, chunks: int) -> None:
    name = f"{engine} {ctas} CTAs x{chunks}"
    x = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    hot, python = helper_for(engine, ctas, chunks, True), helper_for(engine, ctas, chunks, False)
    try:
        check(hot.stats()["hot_path"] == "on", f"{name}: the hot path is on ({hot.stats()['hot_path']})")
        for mode in (0, 1):
            mark = hot.stats()["hot_calls"]
            outs_hot, outs_python = calls(hot, x, mode, 6), calls(python, x, mode, 6)
            check(all(torch.equal(o.view(torch.int16), x.view(torch.int16)) for o in outs_hot + outs_python),
                  f"{name} mode {mode}: every output is the input, bit for bit (hot and Python path)")
            check(hot.stats()["hot_calls"] - mark == 5, f"{name} mode {mode}: 5 of 6 calls on the hot path "
                  f"({hot.stats()['hot_calls'] - mark})")
            check(python.stats()["hot_calls"] == 0, f"{name} mode {mode}: none on the Python-path helper")
            plans = {(r.route, r.plan.word) for r in list(hot.history)[-6:] + list(python.history)[-6:]}
            check(len(plans) == 1 and next(iter(plans))[0] == "fused", f"{name} mode {mode}: one fused plan ({plans})")
        side = torch.cuda.Stream()
        y, fresh = torch.zeros_like(x), torch.randn_like(x)
        torch.cuda.synchronize()
        with torch.no_grad(), torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # the side stream busy for tens of ms: the call queues behind it there
            y.copy_(fresh)  # y holds the data only once the side stream gets here: another stream would read zeros
            mark = hot.stats()["hot_calls"]
            out = hot.all_to_all(y, 0)
            recorded = hot.transport.completion_marker()
            pending = not recorded.query()  # recorded on the busy side stream, not on an idle one
        side.synchronize()
        check(hot.stats()["hot_calls"] == mark + 1 and torch.equal(out.view(torch.int16), fresh.view(torch.int16)),
              f"{name}: a side-stream call on the hot path launched on that stream (it read what the stream wrote)")
        check(pending and recorded.query(), f"{name}: its completion event is recorded on the side stream (pending "
              "behind that stream's work, complete with it)")
        graph = torch.cuda.CUDAGraph()
        mark, captured = hot.stats()["hot_calls"], hot.stats()["captured"]
        with torch.no_grad(), torch.cuda.graph(graph):
            graphed = hot.all_to_all(x, 0)
        check(hot.stats()["hot_calls"] == mark and hot.stats()["captured"] == captured + 1,
              f"{name}: a capture of a held signature takes the Python path and is captured fused")
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        check(torch.equal(graphed.view(torch.int16), x.view(torch.int16)), f"{name}: the graph's replay is exact")
        held = hot.stats()["hot_signatures"]
        hot.long_training = "chunked"
        check(held == 2 and hot.stats()["hot_signatures"] == 0 and len(hot.transport.hot_path(None)) == 0,
              f"{name}: a replan empties the table ({held} held before)")
        calls(hot, x, 0, 2)  # held again, so that destroy has something to close
        table = hot.transport.hot_path(None)  # the transport's table (None: build none, return the one it has)
        check(len(table) == 1, f"{name}: the signature held again after the replan")
    finally:
        hot.destroy()
        python.destroy()
    check(table.run(x, 0, 0) is None, f"{name}: the table holds nothing after destroy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", flush=True)
        return 2
    one_rank()
    from fastvideo_kernel import library_path

    from fastvideo.distributed.ulysses import hot

    module, why = hot.load(library_path().parent)
    check(module is not None, f"the hot-path extension loads beside {library_path()} ({why or 'ok'})")
    if module is None:
        return 1
    print(f"extension: torch {module.TORCH_VERSION}, CUDA {module.CUDA}", flush=True)
    for kind in KINDS:
        check_kind(*kind)
    dist.destroy_process_group()
    print(f"{len(failures)} failure(s)" + (": " + "; ".join(failures) if failures else ""), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
