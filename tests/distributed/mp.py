"""Run a function on N gloo ranks in separate processes, with a hard timeout (no hang eats CI).

    results = run_ranks(4, my_module_level_fn, arg, sp_size=4)

``fn(rank, world_size, *args)`` runs after ``init_process_group("gloo")`` and
``initialize_sequence_parallel(sp_size)``; its return values come back as a list by rank. With
``initialize=False`` it runs before either, in torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` naming this harness's store), so that ``env://``
initialisation (upstream FastVideo's ``maybe_init_distributed_environment_and_model_parallel``) is what
the test exercises; ``fn`` then cleans up itself (what it leaves is torn down after it). An
exception on any rank is re-raised in the parent as ``RankError`` carrying every failed rank's
traceback. Processes are forked from a forkserver that has torch preloaded, so a rank starts in
well under a second.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import sys
import traceback
from collections.abc import Callable

DEFAULT_TIMEOUT_S = 120.0
GLOO_TIMEOUT_S = 30.0
# Forwarded from the parent's environment to every rank (unset there: unset on the ranks).
FORWARDED_VARS = ("FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING", "FASTVIDEO_ULYSSES_A2A_CHECKED",
                  "FASTVIDEO_ULYSSES_A2A_OVERLAP", "TORCH_DISTRIBUTED_DEBUG")

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed"])


class RankError(AssertionError):
    """One or more ranks raised; ``errors`` maps rank -> (exception type name, message, traceback)."""

    def __init__(self, errors: dict[int, tuple[str, str, str]]):
        self.errors = errors
        text = "\n".join(f"--- rank {r}: {t}: {m}\n{tb}" for r, (t, m, tb) in sorted(errors.items()))
        super().__init__(f"ranks {sorted(errors)} failed:\n{text}")


def _store_server():
    """The rendezvous store, served by this (parent) process on a port the OS picks while it binds.

    Ranks connect to it as clients. Picking a "free" port and letting rank 0 bind it later raced with
    other jobs (pytest -n workers, neighbours on a CI machine) that could take the port in between.
    """
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)


def _entry(rank, world_size, port, sp_size, module, name, args, env, paths, out, job_timeout_s,
           initialize=True) -> None:
    try:
        sys.path[:0] = [p for p in paths if p not in sys.path]
        os.environ.update({k: v for k, v in env.items() if v is not None})
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # torch read TORCH_DISTRIBUTED_DEBUG when the forkserver preloaded it: read it again from this rank's
        # environment, as a fresh process would (it decides torch's collective checks and the Ulysses
        # checked mode's `auto`).
        dist.set_debug_level_from_env()
        timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
        if not initialize:
            _run_uninitialized(rank, world_size, port, module, name, args, out)
            return
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        from fastvideo.distributed import parallel_state

        if job_timeout_s is None:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
            parallel_state.initialize_sequence_parallel(sp_size or world_size, timeout=timeout)
        else:  # the job's timeout, which the SP groups must follow on their own
            job = datetime.timedelta(seconds=job_timeout_s)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=job)
            parallel_state.initialize_sequence_parallel(sp_size or world_size)
        fn = getattr(importlib.import_module(module), name)
        try:
            result = fn(rank, world_size, *args)
        finally:
            try:
                parallel_state.destroy_sequence_parallel()
            except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
                pass
        out.put((rank, "ok", result))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put((rank, "err", (type(exc).__name__, str(exc), traceback.format_exc())))


def _run_uninitialized(rank, world_size, port, module, name, args, out) -> None:
    """``fn`` under torchrun's variables. The agent-store flag makes ``env://`` connect to this harness's store
    as a client (as torchrun's workers connect to its agent's) instead of rank 0 starting one."""
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "TORCHELASTIC_USE_AGENT_STORE": "True"})
    fn = getattr(importlib.import_module(module), name)
    try:
        result = fn(rank, world_size, *args)
    finally:
        try:
            from fastvideo.distributed import parallel_state

            parallel_state.cleanup_dist_env_and_memory()
        except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
            if dist.is_initialized():
                dist.destroy_process_group()
    out.put((rank, "ok", result))


def run_ranks(
    world_size: int,
    fn: Callable,
    *args,
    sp_size: int | None = None,
    env: dict[str, str | None] | None = None,
    rank_env: dict[int, dict[str, str | None]] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    job_timeout_s: float | None = None,
    results_from: set[int] | None = None,
    initialize: bool = True,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``env`` applies to every rank; ``rank_env[r]`` is applied on top of it on rank ``r`` only (settings
    that differ between ranks). ``job_timeout_s``: ``init_process_group``'s timeout, with the SP groups left
    to follow it (default: both a fixed 30 s). ``results_from``: the ranks whose results to wait for (default
    all); the others may stop or exit without reporting (their result is None) and are killed at the end.
    """
    # The forkserver keeps the environment it started with (some earlier test's): pass this test's
    # transport settings explicitly unless the caller sets them.
    env = {**{name: os.environ.get(name) for name in FORWARDED_VARS}, **(env or {})}
    server = _store_server()  # kept alive until every rank has finished
    port = server.port
    out = _CTX.Queue()
    procs = [
        _CTX.Process(
            target=_entry,
            args=(r, world_size, port, sp_size, fn.__module__, fn.__qualname__, args,
                  {**env, **(rank_env or {}).get(r, {})}, list(sys.path), out, job_timeout_s, initialize),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    import time

    deadline = time.monotonic() + timeout_s
    wanted = set(range(world_size)) if results_from is None else set(results_from)
    try:
        while not wanted <= set(results):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{fn.__qualname__}: ranks {sorted(set(range(world_size)) - set(results))} did not finish "
                    f"within {timeout_s:g} s (results so far: {results})"
                )
            try:
                rank, status, value = out.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in results and i in wanted]
                if dead:
                    raise RuntimeError(
                        f"{fn.__qualname__}: ranks {dead} died (exit codes "
                        f"{[procs[i].exitcode for i in dead]}) without reporting"
                    ) from None
                continue
            results[rank] = (status, value)
    finally:
        for i, p in enumerate(procs):
            p.join(timeout=5 if i in wanted else 0)
            if p.is_alive():
                p.kill()  # SIGKILL ends a stopped process too
                p.join()
    errors = {r: v for r, (s, v) in results.items() if s == "err"}
    if errors:
        raise RankError(errors)
    return [results[r][1] if r in results else None for r in range(world_size)]
