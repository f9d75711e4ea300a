"""The all-to-all in flight and the pipelined attention block on a GPU: waits, CUDA graphs, torch.compile.

    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --standalone --nproc_per_node=1 \\
        tests/distributed/check_overlap.py --json OUT.json

Runs at any SP size (one rank per GPU; SP 1 on one GPU). At SP 1 the public op returns its input, so every
exchange here goes through the op's own start/wait and synchronous bodies (``forced``), which run the agreed
route on a one-rank group: the communication stream, its events and the allocator bookkeeping are exercised
as at SP > 1. Each check prints PASS/FAIL on rank 0, every verdict agreed over the ranks; exit 1 when any failed.

(a) ``late data``: the communication stream is kept busy (``torch.cuda._sleep``) before an exchange starts; the
    output returned by ``wait()`` equals the synchronous exchange bit for bit, while the control reads the
    in-flight output buffer on the caller's stream without the wait and sees unlanded bytes (the buffer was
    poisoned first).
(b) ``graph replay``: the pipelined block (``overlap_chunks=N``, N = 2 and 4; forward and backward) captured
    with ``torch.cuda.graph`` (the communication stream forked and joined inside the capture), then replayed
    with fresh inputs each time: output and input gradients bit-exact against the eager synchronous block.
    Controls: the eager reference is deterministic; a perturbed output is caught.
(c) ``compile``: ``torch.compile(fullgraph=True)`` (inductor on CUDA, aot_eager on CPU) of the async op with
    compute between start and wait, and of the pipelined block: one graph each, the start and wait nodes
    present (2 x N of each for the block, every start baked with ``own_input``), outputs against eager (the block
    on each of 20 runs of the compiled graph): the op's waited output bit-exact (data movement;
    control: a perturbed output is caught), the arithmetic around it and the block within bf16's rounding (inductor
    fuses that math and keeps its bf16 intermediates in fp32, eager rounds each one).

Attention is SDPA pinned to the math kernel (deterministic forward and backward). ``--cpu-dry-run``: the same
logic over gloo on CPU (no graphs: (a) and (b) say so and are skipped), never a result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys
import traceback

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.commit import tree_commit  # noqa: E402
from fastvideo.attention.layer import DistributedAttention  # noqa: E402
from fastvideo.distributed import parallel_state  # noqa: E402
from fastvideo.distributed.all_to_all import mode_for_dims  # noqa: E402
from fastvideo.distributed.ulysses import exchange, ops  # noqa: E402


def forced(x, scatter_dim, gather_dim, name="", *, async_op=False, seq_splits=None, head_splits=None, tag=None):
    """The exchange through the ops themselves even at SP 1, where the public op returns its input
    (``DistributedAttention``'s ``all_to_all``)."""
    mode = mode_for_dims(scatter_dim, gather_dim)
    grad = torch.is_grad_enabled() and x.requires_grad
    kw = {"seq_splits": seq_splits, "head_splits": head_splits, "tag": tag}
    if not async_op:
        return torch.ops.fastvideo.ulysses_all_to_all_4d(x, mode, grad, None, 0, **kw)[0]
    # Traced, the start owns its input, as ops.call's does (the compile check below asserts it of every start).
    token, outcome = torch.ops.fastvideo.ulysses_all_to_all_4d_start(x, mode, grad, None, 0, **kw,
                                                                     own_input=torch.compiler.is_compiling())
    return ops.TracedHandle((token, outcome), (mode, tuple(x.shape), x.dtype, x.device, kw))


def sdpa_math(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def wrong(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    return int((a.detach().contiguous().view(torch.uint8) != b.detach().contiguous().view(torch.uint8)).sum())


class Check:
    def __init__(self, dry_run: bool) -> None:
        self.sp = parallel_state.get_sp_group()
        self.p, self.rank, self.device = self.sp.world_size, self.sp.rank_in_group, self.sp.device
        self.cuda = self.device.type == "cuda"
        self.dry_run = dry_run
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.heads, self.head_dim, self.seq = (8, 64, 1024) if self.cuda else (8, 8, 16)
        self.results: list[dict] = []

    def log(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def agree(self, ok: bool) -> bool:
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(flag, group=self.sp.cpu_group)
        return int(flag) == 0

    def run(self, name: str, fn) -> None:
        try:
            detail = fn()
            ok, note = (True, detail) if not isinstance(detail, tuple) else detail
        except Exception as exc:  # noqa: BLE001 - reported as a failure
            ok, note = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        ok = self.agree(ok)
        self.results.append({"check": name, "pass": ok, "detail": str(note)})
        self.log(f"{'PASS' if ok else 'FAIL'} {name}: {note}")

    def inputs(self, seed: int, grad: bool = False):
        g = torch.Generator(device=self.device).manual_seed(seed * 31 + self.rank)
        shape = (1, self.seq, self.heads, self.head_dim)
        return [torch.randn(shape, generator=g, device=self.device).to(self.dtype).requires_grad_(grad)
                for _ in range(3)]

    # ------------------------------------------------------------------ (a)

    def late_data(self):
        if not self.cuda:
            return True, "skipped on CPU (no streams); tests/distributed/test_ulysses_async.py covers it over gloo"
        x = self.inputs(1)[0].repeat(3, 1, 1, 1).contiguous()
        expected = forced(x, 2, 1)
        torch.cuda.synchronize()
        comm = exchange.comm_stream(self.device)
        with torch.cuda.stream(comm):  # poison the side stream's free blocks of the output's size
            poison = torch.full((expected.numel() * expected.element_size(),), 255, dtype=torch.uint8,
                                device=self.device)
            del poison
            torch.cuda._sleep(200_000_000)  # ~0.1 s of busy side stream before the exchange
        real, started = exchange.issue, []
        exchange.issue = lambda *args, **kw: started.append(real(*args, **kw)) or started[-1]
        try:
            handle = forced(x, 2, 1, async_op=True)
        finally:
            exchange.issue = real
        early = started[0][0].out.clone()  # the control: read without the wait
        landed = handle.wait().clone()
        torch.cuda.synchronize()
        bad, early_bad = wrong(landed, expected), wrong(early, expected)
        return bad == 0 and early_bad > 0, f"waited output wrong={bad}; unwaited read wrong={early_bad} (must be > 0)"

    # ------------------------------------------------------------------ (b)

    def layer(self, chunks: int) -> DistributedAttention:
        return DistributedAttention(self.heads, self.head_dim, overlap_chunks=chunks, prefix="chk", all_to_all=forced,
                                    attend=sdpa_math)

    def eager(self, chunks: int, q, k, v, gy):
        ins = [t.detach().requires_grad_() for t in (q, k, v)]
        out = self.layer(chunks)(*ins)[0]
        return [out.detach(), *torch.autograd.grad(out, ins, gy)]

    def graph_replay(self, chunks: int):
        if not self.cuda:
            return True, "skipped on CPU (no CUDA graphs)"
        layer = self.layer(chunks)
        static = self.inputs(10, grad=True)
        gy = self.inputs(11)[0]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                out = layer(*static)[0]
                torch.autograd.grad(out, static, gy)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(*static)[0]
            grads = torch.autograd.grad(out, static, gy)
        left = exchange.in_flight()
        replays, bad = 20, 0
        for i in range(replays):
            fresh = self.inputs(100 + i)
            fresh_gy = self.inputs(200 + i)[0]
            with torch.no_grad():
                for s, f in zip(static, fresh, strict=True):
                    s.copy_(f)
                gy.copy_(fresh_gy)
            graph.replay()
            reference = self.eager(0, *fresh, fresh_gy)
            bad += sum(wrong(a, b) for a, b in zip([out, *grads], reference, strict=True))
        again = self.eager(0, *fresh, fresh_gy)
        deterministic = all(wrong(a, b) == 0 for a, b in zip(reference, again, strict=True))
        perturbed = out.clone()
        perturbed.view(-1)[0] += 1
        caught = wrong(perturbed, reference[0]) > 0
        torch.cuda.synchronize()
        ok = bad == 0 and deterministic and caught and left == 0
        return ok, (f"N={chunks}: {replays} replays, wrong={bad}; reference deterministic={deterministic}; "
                    f"perturbation caught={caught}; exchanges left in flight after capture={left}")

    # ------------------------------------------------------------------ (c)

    def compiled(self):
        from torch._dynamo.testing import CompileCounterWithBackend

        backend = "inductor" if self.cuda else "aot_eager"
        notes = []
        x = self.inputs(20)[0]
        w = self.inputs(21)[0]

        def op(x, w):
            handle = forced(x, 2, 1, async_op=True)
            z = torch.sin(w).mean() * 2  # compute between the start and the wait
            y = handle.wait()
            return y, y * z

        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        got_y, got_prod = torch.compile(op, backend=counter, fullgraph=True)(x, w)
        exp_y, exp_prod = op(x, w)
        nodes = [str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
        # The exchange moves data only: its waited output is bit-exact (and at SP 1 equals x). The product with
        # the surrounding arithmetic is not: inductor fuses sin/mean/mul and keeps bf16 intermediates in fp32
        # (eager rounds each), so that part is held to bf16's rounding, separately.
        moved = wrong(got_y, exp_y) == 0 and (self.p > 1 or wrong(exp_y, x) == 0)
        caught = wrong(got_y.clone().view(-1).index_add_(0, torch.tensor([0], device=x.device),
                                                          torch.ones(1, dtype=x.dtype, device=x.device)).view_as(got_y),
                       exp_y) > 0  # control: a perturbed exchange output is caught
        prod_diff = float((got_prod.float() - exp_prod.float()).abs().max())
        prod_tol = (2e-2 if self.dtype == torch.bfloat16 else 1e-5) * max(1.0, float(exp_prod.float().abs().max()))
        op_ok = (counter.frame_count == 1 and moved and caught and prod_diff <= prod_tol
                 and nodes.count("fastvideo.ulysses_all_to_all_4d_start") == 1
                 and nodes.count("fastvideo.ulysses_all_to_all_4d_wait") == 1)
        notes.append(f"op: frames={counter.frame_count} exchange bit-exact={moved} (perturbation caught={caught}); "
                     f"fused arithmetic max|diff|={prod_diff:.3g} (<= {prod_tol:.3g})")
        chunks = 4
        layer = self.layer(chunks)
        layer._set_compile_forward_enabled(True)  # traced whole, as a regional compile does
        q, k, v = self.inputs(22)

        def block(q, k, v):
            return layer(q, k, v)[0]

        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(block, backend=counter, fullgraph=True)
        expected = block(q, k, v)
        # Every run: inductor reuses the exchanges' input buffers before their waits, and only the start's own
        # copy (own_input, baked in at trace time) keeps a run from reading a reused buffer.
        diff = max(float((compiled(q, k, v).float() - expected.float()).abs().max()) for _ in range(20))
        nodes = [n for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
        starts = [n for n in nodes if str(n.target) == "fastvideo.ulysses_all_to_all_4d_start"]
        owned = sum(n.kwargs.get("own_input") is True for n in starts)
        waits = sum(str(n.target) == "fastvideo.ulysses_all_to_all_4d_wait" for n in nodes)
        tol = 2e-2 if self.dtype == torch.bfloat16 else 1e-5
        block_ok = (counter.frame_count == 1 and len(starts) == waits == 2 * chunks and owned == len(starts)
                    and diff <= tol)
        notes.append(f"block N={chunks}: frames={counter.frame_count} starts={len(starts)} (owning their input: "
                     f"{owned}) waits={waits} max|diff| over 20 runs={diff:.3g} (<= {tol})")
        return op_ok and block_ok, "; ".join(notes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the verdicts here (rank 0)")
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    cuda = not args.cpu_dry_run and torch.cuda.is_available()
    timeout = datetime.timedelta(minutes=5)
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    parallel_state.initialize_sequence_parallel(dist.get_world_size())
    check = Check(args.cpu_dry_run)
    check.run("late data", check.late_data)
    for chunks in (2, 4):
        check.run(f"graph replay N={chunks}", lambda chunks=chunks: check.graph_replay(chunks))
    check.run("compile fullgraph", check.compiled)
    ok = all(r["pass"] for r in check.results)
    if args.json and check.rank == 0:
        commit = tree_commit(ROOT)  # the COMMIT stamp, else this tree's own checkout, else unknown
        doc = {"commit": commit, "torch": torch.__version__, "world": check.p, "device": str(check.device),
               "gpu": torch.cuda.get_device_name() if cuda else None, "dry_run": args.cpu_dry_run,
               "results": check.results}
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    parallel_state.destroy_sequence_parallel()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
