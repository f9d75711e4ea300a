"""2-GPU check: a rank SIGKILLed in the middle of a fused stream; the survivor must not spin forever.

    python tests/distributed/check_ulysses_watchdog_sigkill.py [--timeout 20] [--calls 100] [--kill-at 50]
    python tests/distributed/check_ulysses_watchdog_sigkill.py --cpu-dry-run --timeout 3   # plumbing, no GPU

Needs 2 GPUs on one host, NVLink, and the kernel wheel (the fused route must construct). Not
collected by pytest (``check_*``); CI has no GPU.

What it does: starts two workers (this script with ``--worker``; the environment torchrun would give
them: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Each runs a stream
of ``--calls`` fused calls through the public op (``FASTVIDEO_ULYSSES_A2A=auto``), synchronising
after each (as a training step reading its loss would). At call ``--kill-at``, rank 1 passes the
vote, records the time and SIGKILLs itself *before launching*: rank 0 launches that call and its
CTAs wait at the LSA barrier for rank 1's, which never come, while its host blocks in
``torch.cuda.synchronize()``. Only the watchdog can end it. PASS when rank 0 exits with the
watchdog's exit code (87) and its message, naming rank 1 as the missing peer, within
``--timeout`` + 10 s of the kill. The vote timeout is set to 3x the watchdog timeout so the vote
cannot be what ends it.

Why it launches the workers itself instead of running under torchrun: torchrun's elastic agent
stops every other worker (SIGTERM) as soon as one fails, so under torchrun the survivor is killed
by the agent before its watchdog could be observed. ``torchrun --nproc_per_node=2 <this> --worker``
still runs the worker side (useful to see the stream run), but cannot judge the survivor.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WATCHDOG_MESSAGE = "Ulysses fused all-to-all watchdog"
SHAPE = (3, 8192, 16, 128)  # packed QKV, S_local 8192, 16 heads: 24 MiB bf16 a rank, several ms of barriers


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from fastvideo.distributed import parallel_state
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.ulysses import construction, registry

    rank = int(os.environ["RANK"])
    victim = 1
    state = {"calls": 0, "stuck": False}

    def before_launch() -> bool:
        """Count the call; the victim dies here at ``kill_at`` (after the vote, before launching)."""
        if rank == victim and state["calls"] == args.kill_at:
            Path(args.kill_file).write_text(f"{time.time()}\n")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        state["calls"] += 1
        return state["calls"] > args.kill_at

    if args.cpu_dry_run:
        # The launcher, the environment, the store probe and the default action, without a GPU: the CPU
        # transport stands in for the kernel; from kill_at on, the survivor's "launch" never completes
        # and its host blocks as torch.cuda.synchronize() would.
        from fastvideo.distributed.ulysses.transport import output_shape
        from tests.plan_transport import GlooPlanTransport

        class Never:
            def query(self) -> bool:
                return False

        class KillBeforeLaunch(GlooPlanTransport):
            def execute(self, x, geom, plan, **kw):
                if before_launch():
                    state["stuck"] = True
                    return torch.empty(output_shape(geom), dtype=x.dtype)
                return super().execute(x, geom, plan)

            def completion_marker(self):
                return Never() if state["stuck"] else None

        backend, device, dtype = "gloo", "cpu", torch.float32

        def synchronize() -> None:
            while state["stuck"]:
                time.sleep(1.0)
    else:
        from fastvideo.distributed.ulysses.native import NativeTransport

        class KillBeforeLaunch(NativeTransport):  # type: ignore[no-redef]
            def execute(self, x, geom, plan, **kw):
                before_launch()
                return super().execute(x, geom, plan)

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        backend, device, dtype = "nccl", "cuda", torch.bfloat16
        synchronize = torch.cuda.synchronize

    construction.set_transport_factory(lambda device: KillBeforeLaunch())
    dist.init_process_group(backend)
    parallel_state.initialize_sequence_parallel(dist.get_world_size())
    helper = registry.get_default_helper()
    if not helper.fused_available:
        print(f"[rank {rank}] fused route declined at construction: {helper.construction_reason} "
              f"({helper.construction_detail}); this check needs it", flush=True)
        return 2
    torch.manual_seed(rank)
    shape = SHAPE if not args.cpu_dry_run else (3, 64, 16, 8)
    x = torch.randn(shape, dtype=dtype, device=device)
    for i in range(args.calls):
        y = a2a(x, 2, 1)
        synchronize()  # the survivor blocks here on call kill_at: only the watchdog can end it
        if i % 10 == 0:
            print(f"[rank {rank}] call {i}: {helper.history[-1].route}", flush=True)
    print(f"[rank {rank}] finished {args.calls} calls ({tuple(y.shape)}); the kill did not happen", flush=True)
    return 3


def launch(args: argparse.Namespace) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp(prefix="watchdog-sigkill-"))
    kill_file = tmp / "killed_at"
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "PYTHONPATH": str(ROOT),
        "NCCL_NVLS_ENABLE": "0",
        "FASTVIDEO_ULYSSES_A2A": "auto",
        "FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S": str(args.timeout),
        "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": str(3 * args.timeout),
    }
    cmd = [sys.executable, __file__, "--worker", "--calls", str(args.calls), "--kill-at", str(args.kill_at),
           "--kill-file", str(kill_file), "--timeout", str(args.timeout),
           *(["--cpu-dry-run"] if args.cpu_dry_run else [])]
    logs = [open(tmp / f"rank{r}.log", "w") for r in range(2)]  # closed below
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=logs[r],
                              stderr=subprocess.STDOUT) for r in range(2)]
    limit = args.timeout + 10
    overall = time.time() + 300 + limit
    survivor_exit = None
    while time.time() < overall:
        if procs[0].poll() is not None:
            survivor_exit = time.time()
            break
        if kill_file.exists() and time.time() - float(kill_file.read_text()) > limit + 5:
            break  # well past the deadline: stop waiting
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for f in logs:
        f.close()
    out0 = (tmp / "rank0.log").read_text()
    out1 = (tmp / "rank1.log").read_text()
    print(f"--- rank 0 ({procs[0].returncode})\n{out0[-6000:]}\n--- rank 1 ({procs[1].returncode})\n{out1[-3000:]}")
    problems = []
    if not kill_file.exists():
        problems.append("rank 1 never reached the kill point (see its log)")
    else:
        killed = float(kill_file.read_text())
        if survivor_exit is None:
            problems.append(f"rank 0 was still running {limit + 5} s after the kill (killed by this script)")
        elif survivor_exit - killed > limit:
            problems.append(f"rank 0 exited {survivor_exit - killed:.1f} s after the kill, limit {limit} s")
        else:
            print(f"rank 0 exited {survivor_exit - killed:.1f} s after the kill (limit {limit} s)")
    if procs[0].returncode != 87:
        problems.append(f"rank 0 exit code {procs[0].returncode}, expected 87 (the watchdog's)")
    if WATCHDOG_MESSAGE not in out0:
        problems.append("rank 0's output lacks the watchdog message")
    elif "ranks [1] did not report" not in out0:
        problems.append("the watchdog message does not name rank 1 as the missing peer")
    if procs[1].returncode != -signal.SIGKILL:
        problems.append(f"rank 1 exit code {procs[1].returncode}, expected -9 (SIGKILL)")
    print(f"logs: {tmp}")
    if problems:
        print("FAIL: " + "; ".join(problems))
        return 1
    print("PASS: the survivor ended itself through the watchdog, naming the dead peer")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="run one rank (torchrun-style environment)")
    parser.add_argument("--timeout", type=float, default=20.0, help="watchdog timeout, seconds")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--kill-at", type=int, default=50)
    parser.add_argument("--kill-file", default=os.devnull)
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="gloo and the CPU transport (a launch that never completes) instead of GPUs")
    args = parser.parse_args()
    if not 0 <= args.kill_at < args.calls:
        parser.error("--kill-at must be a call index below --calls")
    return worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    sys.exit(main())
