"""Upstream FastVideo's Wan DiT on the overlay: forward and backward under sequence parallelism, per route, for the
parity test (``tests/test_upstream_overlay.py``), which reads what this writes and makes every assertion.

Run by that test with the overlay's ``PYTHONPATH`` (``tests/overlay/build.py``), never imported by the suite:

    python tests/overlay/wan_parity.py --out results.pkl

The model, its initialisation and the loss are upstream's own (``fastvideo/tests/distributed/test_sp_wan.py``'s
helpers: its tiny config with 6 heads instead of 4 so that SP = 3 divides them, ``_initialize_model_parameters``,
``_seed_everything``, the gradients averaged over the SP ranks as that test does). Ranks are forked from this
process after upstream is imported (one import, not one per rank) and run over gloo on the CPU. Routes:

* ``off``: ``FASTVIDEO_ULYSSES_A2A=off``, the NCCL route (gloo here), no helper;
* ``auto``: ``FASTVIDEO_ULYSSES_A2A=auto`` as a CPU job meets it: the op's helper declines at construction;
* ``host``: ``auto`` with a helper on the CPU plan transport (``GlooPlanTransport``) installed as the op's
  default, so every all-to-all takes the fused route's code path (vote, plan, chunked execution);
* ``corrupt``: ``host`` with one exchange corrupted (rank 0's first fused output, one element +1): the negative
  control, which the test requires to fail the parity check.

Written: a pickle of ``{"reference": {...}, "runs": {(world, route): {...}}}`` with each run's output and
gradients (rank 0, as numpy) and every rank's route record (the helper's ``stats()`` and call history).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import socket
import sys
import time
import traceback

# Patch "cpu-attention-backend": upstream's CpuPlatform.get_attn_backend_cls returns "" (no backend), so no
# attention layer can be built on a CPU machine. On the CPU it now returns upstream's own SDPA backend, as upstream's
# MPS platform does; the test sets FASTVIDEO_ATTENTION_BACKEND=TORCH_SDPA as upstream's SP tests do.
SDPA_BACKEND = "fastvideo.attention.backends.sdpa.SDPABackend"

HEADS = 6  # upstream's tiny config has 4; 6 lets SP = 3 divide them (Wan asserts that SP divides the heads)
# (frames, height, width) of the latent; patch (1, 2, 2). "even": 3*4*4 = 48 tokens, which 2 and 3 divide;
# "padded": 5*5*7 = 175 tokens, which neither divides (upstream pads the shard and trims after the gather).
GEOMETRIES = {"even": (3, 8, 8), "padded": (5, 10, 14)}
SEED = 2026
VOTE_TIMEOUT_S = 30.0


def patch_cpu_attention_backend() -> None:
    from fastvideo.platforms.cpu import CpuPlatform

    CpuPlatform.get_attn_backend_cls = classmethod(lambda cls, selected_backend, head_size, dtype: SDPA_BACKEND)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _upstream_test():
    import fastvideo.tests.distributed.test_sp_wan as up

    return up


def _config():
    from fastvideo.configs.models.dits.wanvideo import WanVideoArchConfig, WanVideoConfig

    return WanVideoConfig(arch_config=WanVideoArchConfig(
        num_attention_heads=HEADS, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
        ffn_dim=64, num_layers=2, patch_size=(1, 2, 2), rope_max_seq_len=64))


def _step(geometry: tuple[int, int, int], dtype, world: int):
    """One forward and backward of upstream's Wan (upstream's test's worker, with this geometry and dtype)."""
    import torch
    import torch.distributed as dist
    from fastvideo.forward_context import set_forward_context
    from fastvideo.models.dits.wanvideo import WanTransformer3DModel
    from fastvideo.pipelines.pipeline_batch_info import ForwardBatch

    up = _upstream_test()
    up._seed_everything(SEED)
    config = _config()
    model = WanTransformer3DModel(config=config, hf_config=up._build_hf_config(config)).to(dtype=dtype)
    up._initialize_model_parameters(model)
    model.train()
    model.zero_grad(set_to_none=True)
    gen = torch.Generator(device="cpu").manual_seed(SEED + 1)
    x = torch.randn(1, config.in_channels, *geometry, generator=gen, dtype=torch.float64).to(dtype)
    enc = torch.randn(1, 8, config.text_dim, generator=gen, dtype=torch.float64).to(dtype)
    t = torch.tensor([10], dtype=torch.long)
    with set_forward_context(current_timestep=0, attn_metadata=None, forward_batch=ForwardBatch(data_type="dummy")):
        out = model(hidden_states=x, encoder_hidden_states=enc, timestep=t)
    loss = out.double().square().mean()
    loss.backward()
    if world > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().numpy().copy()
             for name, p in model.named_parameters()}
    return out.detach().double().numpy().copy(), grads


def _rank_main(rank: int, world: int, port: int, route: str, dtypes: tuple[str, ...], threads: int, conn) -> None:
    import torch

    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      FASTVIDEO_ULYSSES_A2A="off" if route == "off" else "auto")
    try:
        conn.send(("ok", _run(rank, world, route, dtypes)))
    except BaseException:  # noqa: BLE001 - the parent reports every rank's traceback
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _plan_transport():
    """The tests' CPU plan transport (``tests/plan_transport.py``), loaded from its file: this script runs on the
    overlay's path, which holds no tree but the overlay."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "plan_transport.py"
    spec = importlib.util.spec_from_file_location("plan_transport", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(rank: int, world: int, route: str, dtypes: tuple[str, ...]) -> dict:
    import torch

    from fastvideo.distributed import cleanup_dist_env_and_memory, maybe_init_distributed_environment_and_model_parallel
    from fastvideo.distributed.device_communicators import ulysses_a2a
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses import registry
    from fastvideo.distributed.ulysses.helper import UlyssesHelper
    GlooPlanTransport = _plan_transport().GlooPlanTransport

    class CorruptOnce(GlooPlanTransport):
        """The CPU plan transport with rank 0's first output of each step off by one in one element."""

        done = False

        def execute(self, x, geom, plan, **kw):
            out = super().execute(x, geom, plan, **kw)
            if rank == 0 and not CorruptOnce.done:
                CorruptOnce.done = True
                out.view(-1)[0] += 1
            return out

    maybe_init_distributed_environment_and_model_parallel(1, world)
    try:
        if route in ("host", "corrupt"):
            transport = GlooPlanTransport() if route == "host" else CorruptOnce()
            registry.install_default_helper(UlyssesHelper(
                get_sp_group(), transport=transport, window_bytes=1 << 20, vote_timeout_s=VOTE_TIMEOUT_S,
                gpu_name="CPU", tuned_table=()))
        result: dict = {"steps": {}}
        for dtype_name in dtypes:
            for geom_name, geometry in GEOMETRIES.items():
                helper = registry.current_default_helper()
                mark = len(helper.history) if helper is not None else 0
                CorruptOnce.done = False
                t0 = time.perf_counter()
                out, grads = _step(geometry, getattr(torch, dtype_name), world)
                helper = registry.current_default_helper()
                history = list(helper.history)[mark:] if helper is not None else []
                result["steps"][(dtype_name, geom_name)] = {
                    "out": out if rank == 0 else None, "grads": grads if rank == 0 else None,
                    "routes": [rec.route for rec in history], "seconds": time.perf_counter() - t0}
        helper = registry.current_default_helper()
        stats = helper.stats() if helper is not None else None
        result.update(route_setting=get_sp_group().settings["FASTVIDEO_ULYSSES_A2A"] if world > 1 else None,
                      enabled=ulysses_a2a.is_enabled() if world > 1 else False,
                      helper=None if stats is None else {"construction": stats["construction"],
                                                         "calls": stats["calls"], "fused": stats["fused"]})
        return result
    finally:
        cleanup_dist_env_and_memory()


def run_world(world: int, route: str, dtypes: tuple[str, ...], timeout_s: float, threads: int = 1) -> list[dict]:
    """``world`` forked ranks running ``route``; every rank's result, or an error naming each failed rank."""
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    pipes, procs = [], []
    for rank in range(world):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, args=(rank, world, port, route, dtypes, threads, child), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    deadline = time.monotonic() + timeout_s
    results, errors = [], []
    for rank, pipe in enumerate(pipes):
        if pipe.poll(max(0.0, deadline - time.monotonic())):
            status, value = pipe.recv()
            (results if status == "ok" else errors).append(value if status == "ok" else f"rank {rank}:\n{value}")
        else:
            errors.append(f"rank {rank}: no result within {timeout_s:.0f} s")
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    if errors:
        raise RuntimeError(f"world {world}, route {route}:\n" + "\n".join(errors))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--worlds", default="2,3")
    parser.add_argument("--routes", default="off,auto,host")
    parser.add_argument("--corrupt-world", type=int, default=2, help="the world size of the negative control (0: none)")
    parser.add_argument("--timeout", type=float, default=240.0)
    args = parser.parse_args(argv)
    os.environ["FASTVIDEO_ATTENTION_BACKEND"] = "TORCH_SDPA"
    t0 = time.monotonic()
    _upstream_test()  # upstream imported once, here: the forked ranks share it
    import fastvideo.models.dits.wanvideo  # noqa: F401

    patch_cpu_attention_backend()
    print(f"wan_parity: upstream imported in {time.monotonic() - t0:.1f} s", flush=True)
    # The one-process reference, three times: twice on one thread (one process is deterministic: bit-equal) and
    # once on two (another blocking of the same sums), from which the test calibrates its tolerance.
    data = {"reference": run_world(1, "off", ("float32",), args.timeout)[0], "runs": {},
            "reference_repeat": run_world(1, "off", ("float32",), args.timeout)[0],
            "reference_threads": run_world(1, "off", ("float32",), args.timeout, threads=2)[0]}
    todo = [(int(w), r) for w in args.worlds.split(",") for r in args.routes.split(",")]
    if args.corrupt_world:
        todo.append((args.corrupt_world, "corrupt"))
    for world, route in todo:
        t1 = time.monotonic()
        data["runs"][(world, route)] = run_world(world, route, ("float32",), args.timeout)
        print(f"wan_parity: SP={world} {route}: {time.monotonic() - t1:.1f} s", flush=True)
    with open(args.out, "wb") as f:
        pickle.dump(data, f)
    print(f"wan_parity: done in {time.monotonic() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
