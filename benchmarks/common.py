"""Shared pieces of the benchmarks: process setup, the environment header, timing, bandwidth.

Not a script. ``benchmark_ulysses_a2a.py``, ``benchmark_dit_step.py`` and ``tune_ulysses_a2a.py``
import it as ``common`` (their own directory is first on ``sys.path`` when they run as scripts).

The ONE bandwidth definition every benchmark uses (``docs/benchmarks.md``):

    GB/s = bytes moved per rank / time,  bytes moved per rank = operand bytes x (P - 1) / P

i.e. the bytes each rank sends to its peers (its 1/P self-share never crosses the fabric), divided by
the measured time, in 1e9 bytes per second. With P = 1 nothing moves and the bandwidth is 0.

The FastVideo tree under test is the one named by ``FASTVIDEO_BENCH_TREE`` (set by
``benchmark_ulysses_a2a.py --compare-revs``), else the repository this file lives in.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
TREE_ENV = "FASTVIDEO_BENCH_TREE"


def add_tree_to_path() -> Path:
    """Put the FastVideo tree under test on ``sys.path`` (after this directory) and return it."""
    tree = Path(os.environ.get(TREE_ENV) or REPO_ROOT).resolve()
    if str(tree) not in sys.path:
        sys.path.insert(1, str(tree))
    return tree


add_tree_to_path()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------- process setup


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """``init_process_group`` from torchrun's env (NCCL on CUDA, gloo on CPU) and one SP group over the world.

    Works without torchrun too (a single process, SP1). Returns (rank, world size, device).
    """
    from fastvideo.distributed.parallel_state import initialize_sequence_parallel

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu for a gloo smoke run.")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    initialize_sequence_parallel(dist.get_world_size())
    return dist.get_rank(), dist.get_world_size(), dev


def shutdown() -> None:
    from fastvideo.distributed.parallel_state import destroy_sequence_parallel

    close_lineup()
    destroy_sequence_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def cpu_group():
    """The SP group's gloo group (host-side reductions of timings never touch the device)."""
    from fastvideo.distributed.parallel_state import get_sp_group

    return get_sp_group().cpu_group


def install_cpu_transport_helper():
    """On CPU, build a helper on ``GlooPlanTransport`` and make it the op's default (collective).

    Without it, ``auto`` on CPU declines at construction (TRANSPORT_MISSING) and every call takes the
    NCCL route; with it the whole fused pipeline (vote, plans, chunks, window) runs over gloo.
    """
    from fastvideo.distributed.ulysses.helper import UlyssesHelper
    from fastvideo.distributed.ulysses.registry import install_default_helper
    from fastvideo.distributed.ulysses.transport import GlooPlanTransport

    helper = UlyssesHelper(transport=GlooPlanTransport())
    install_default_helper(helper)
    return helper


def set_route(route: str) -> None:
    """Select the op's route for the following calls (``off`` = NCCL baseline, ``auto`` = fused where agreed).
    Collective: the SP group agrees it (a tree that agrees settings once needs the explicit agreement; an older
    tree under --compare-revs re-read the environment per call)."""
    os.environ["FASTVIDEO_ULYSSES_A2A"] = route
    from fastvideo.distributed import parallel_state

    agree = getattr(parallel_state, "agree_ulysses_settings", None)
    if agree is not None and parallel_state.model_parallel_is_initialized():
        agree()


# ---------------------------------------------------------------------------------------------- environment header


def tree_commit(tree: Path) -> str:
    """The commit ``tree`` holds: its ``COMMIT`` stamp when present, else ``git rev-parse HEAD`` (plus
    ``-dirty`` for uncommitted changes), else "unknown".

    The stamp wins: on the device hosts the working tree is copied over a checkout of some other
    commit, so git there names the wrong one (seen 2026-11-29: 8912e8a reported for a later tree).
    """
    stamp = tree / "COMMIT"
    if stamp.is_file() and stamp.read_text().strip():
        return stamp.read_text().strip()
    try:
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        top = subprocess.run(["git", "-C", str(tree), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        if Path(top).resolve() == tree.resolve():
            dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def fastvideo_tree() -> Path:
    import fastvideo

    return Path(fastvideo.__file__).resolve().parent.parent


def nccl_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build or a broken NCCL: report it as missing
        return None
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def native_library(helper=None) -> dict | None:
    """Path and SHA-256 of the native communication library the fused route loaded, if any.

    Looked for on the helper's transport (``library_path`` / ``lib_path`` / ``path``), in its capability
    (``NativeTransport`` puts the path in ``detail``), from ``fastvideo_kernel.library_path()`` when the
    transport imported it, then among the shared objects this process has mapped (``/proc/self/maps``)
    whose name mentions fastvideo or ulysses.
    """
    candidates: list[str] = []
    transport = getattr(helper, "transport", None)
    for attr in ("library_path", "lib_path", "path"):
        value = getattr(transport, attr, None)
        if isinstance(value, (str, os.PathLike)) and value:
            candidates.append(str(value))
    capability = getattr(helper, "capability", None)
    if capability is not None and capability.present and capability.detail:
        candidates.append(capability.detail)  # NativeTransport reports the loaded library's path here
    kernel = sys.modules.get("fastvideo_kernel")  # only if the transport already imported it
    if kernel is not None and hasattr(kernel, "library_path"):
        candidates.append(str(kernel.library_path()))
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if path.endswith(".so") or ".so." in path:
                    name = os.path.basename(path).lower()
                    if "fastvideo" in name or "ulysses" in name:
                        candidates.append(path)
    except OSError:
        pass
    for path in candidates:
        if os.path.isfile(path):
            return {"path": os.path.realpath(path), "sha256": sha256_file(path)}
    return None


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'host'})"


def env_header(device: torch.device, sp_size: int, helper=None, extra: dict | None = None) -> dict:
    """The header every benchmark prints and writes: what exactly ran, where and when."""
    tree = fastvideo_tree()
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu_name(device),
        "device": str(device),
        "sp_size": sp_size,
        "torch": torch.__version__,
        "nccl": nccl_version(),
        "commit": tree_commit(tree),
        "fastvideo_tree": str(tree),
        "argv": list(sys.argv),
        "host": platform.node(),
        "python": platform.python_version(),
        "native_library": native_library(helper),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("FASTVIDEO_")},
    }
    header.update(extra or {})
    return header


def print_header(header: dict) -> None:
    lib = header.get("native_library")
    lib_text = f"{lib['path']} sha256={lib['sha256']}" if lib else "none loaded"
    print(f"# date {header['date']}  host {header['host']}  gpu {header['gpu']}  SP{header['sp_size']}")
    print(f"# torch {header['torch']}  nccl {header['nccl']}  commit {header['commit']}  "
          f"tree {header['fastvideo_tree']}")
    print(f"# native library: {lib_text}")
    print(f"# argv: {' '.join(header['argv'])}")
    for key, value in header.items():
        if key not in {"date", "host", "gpu", "sp_size", "torch", "nccl", "commit", "fastvideo_tree", "native_library",
                       "argv", "device", "python", "env"}:
            print(f"# {key}: {value}")
    if header.get("env"):
        print("# env: " + " ".join(f"{k}={v}" for k, v in header["env"].items()))


def write_json(path: str | None, header: dict, rows: Sequence[dict], **extra) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    header = {**header, "lineup": header.get("lineup") or lineup()}  # how the timed loops lined the ranks up
    with open(path, "w") as f:
        json.dump({"header": header, "rows": list(rows), **extra}, f, indent=2, default=str)
        f.write("\n")


# ---------------------------------------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The line-up before each timed iteration. A gloo barrier leaves the ranks tens of microseconds apart when it
# returns (its exit skew: median 39 us, p90 90 us at 2 ranks on the 2-core CI VM, 2026-12-01,
# docs/benchmarks.md), and a collective timed from there bills that skew to the op: the first rank out waits in
# the op's vote (or at its device barrier) for the last. On one host a shared-memory spin barrier (the kernel
# library's same-host vote, used as a barrier) returns within a microsecond. `auto` takes it where every rank
# is on one host and loads the library, else gloo; every rank makes the same choice (``ShmVote.create`` is
# collective and fails everywhere or nowhere).
LINEUPS = ("auto", "shm", "gloo")
_lineup: dict = {"request": "auto", "kind": None, "vote": None, "why": ""}


def set_lineup(request: str) -> None:
    """Choose the line-up (``auto``, ``shm`` or ``gloo``) before the first ``barrier()``; local, call it on every
    rank with the same value."""
    if request not in LINEUPS:
        raise ValueError(f"lineup {request!r}: choose one of {', '.join(LINEUPS)}")
    if _lineup["kind"] is not None:
        raise RuntimeError("set_lineup after the first barrier(): the line-up is fixed for the run")
    _lineup["request"] = request


def _same_host() -> bool:
    """Every rank on one host (hostname and boot id). Collective over the SP group's gloo group at the first
    call, cached after it (every rank caches the same answer)."""
    if "same_host" not in _lineup:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        ids: list = [None] * dist.get_world_size()
        dist.all_gather_object(ids, (platform.node(), boot), group=cpu_group())
        _lineup["same_host"] = len(set(ids)) == 1
    return _lineup["same_host"]


def _open_lineup() -> None:
    """Collective, once: the shared-memory barrier where the request and the hosts allow it, else gloo."""
    request, why = _lineup["request"], ""
    if request != "gloo":
        if not _same_host():
            why = "ranks on more than one host"
        else:
            try:  # a tree under test (--compare-revs) older than the shared-memory vote has none
                from fastvideo.distributed.ulysses.vote import GlooVote, ShmVote, load_vote_library
            except ImportError as exc:
                vote, why = None, f"the tree under test has no shared-memory vote ({exc})"
            else:
                ranks = list(range(dist.get_world_size()))
                vote, why = ShmVote.create(GlooVote(ranks, 600.0), dist.get_rank(), load_vote_library())
            if vote is not None:
                _lineup.update(kind="shm", vote=vote, fields=[0] * 12)
                return
        if request == "shm":
            raise SystemExit(f"--lineup shm: the shared-memory barrier is unavailable ({why})")
    _lineup.update(kind="gloo", why=why)


def lineup() -> dict:
    """Which line-up the timed loops used (``kind``: shm, gloo or none at one rank) and why not shm."""
    return {"kind": _lineup["kind"] or "none", "request": _lineup["request"], "why_not_shm": _lineup["why"]}


def close_lineup() -> None:
    vote = _lineup.get("vote")
    if vote is not None:
        vote.destroy()
    _lineup.update(kind=None, vote=None)
    _lineup.pop("same_host", None)


def barrier() -> None:
    """Line the ranks up, outside any timed region. Collective; opens the line-up at its first call."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    if _lineup["kind"] is None:
        _open_lineup()
    if _lineup["kind"] == "shm":
        _lineup["vote"].exchange(_lineup["fields"])
    else:
        dist.barrier(group=cpu_group())


def rank_max(values: Sequence[float]) -> list[float]:
    """Element-wise max over ranks of a list of timings (every rank passes the same length)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    return t.tolist()


def rank_sum(value: int) -> int:
    t = torch.tensor([int(value)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=cpu_group())
    return int(t.item())


def summarize(values: Sequence[float]) -> dict:
    """median / p10 / p90 (nearest rank) of a list of seconds, returned in milliseconds."""
    v = sorted(values)
    if not v:
        return {"median_ms": None, "p10_ms": None, "p90_ms": None}

    def pick(q: float) -> float:
        return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))] * 1e3

    return {"median_ms": statistics.median(v) * 1e3, "p10_ms": pick(0.10), "p90_ms": pick(0.90)}


def host_timings(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> dict[str, list[float]]:
    """Host-to-completion of ``fn`` per iteration, seconds: ``perf_counter`` around the call + device sync,
    the ranks lined up (``barrier``) before each iteration. Collective. Returns

    * ``rank_max``: the slowest rank's own start-to-end time, per iteration (what ``host_latencies`` returns);
    * ``aligned``: from the LAST rank's start to the last rank's end (``max end - max start``): the op's cost
      without the line-up's exit skew. ``perf_counter`` is ``CLOCK_MONOTONIC``, one clock for every process of
      a host, so this is only kept where every rank is on one host (else empty);
    * ``entry_skew``: ``max start - min start``, what the line-up left (empty where ``aligned`` is).
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    starts, ends = [], []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        fn()
        synchronize(device)
        starts.append(start)
        ends.append(time.perf_counter())
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        own = [e - s for s, e in zip(starts, ends, strict=True)]
        return {"rank_max": own, "aligned": own, "entry_skew": [0.0] * len(starts)}
    # One gather serves all three: each rank's own durations need no common clock, the other two do.
    both = torch.tensor([starts, ends], dtype=torch.float64)
    gathered = [torch.empty_like(both) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, both, group=cpu_group())
    stacked = torch.stack(gathered)  # [rank, start|end, iteration]
    rank_max_times = (stacked[:, 1] - stacked[:, 0]).max(dim=0).values.tolist()
    if not _same_host():
        return {"rank_max": rank_max_times, "aligned": [], "entry_skew": []}
    aligned, skew = aligned_times(stacked[:, 0], stacked[:, 1])
    return {"rank_max": rank_max_times, "aligned": aligned, "entry_skew": skew}


def aligned_times(starts: torch.Tensor, ends: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per iteration, from ``[rank, iteration]`` start and end times on one clock: (last end - last start,
    last start - first start). A collective cannot finish before its last rank arrives, so the first is its
    cost from that arrival; the second is the skew the line-up left."""
    last_start = starts.max(dim=0).values
    return (ends.max(dim=0).values - last_start).tolist(), (last_start - starts.min(dim=0).values).tolist()


def host_latencies(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> list[float]:
    """Host-to-completion seconds of ``fn`` per iteration: the rank-max of ``host_timings``. Collective."""
    return host_timings(fn, device, iters, warmup)["rank_max"]


def device_times(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> list[float]:
    """Device seconds of ``fn`` per iteration: CUDA events around it (perf_counter + sync on CPU); rank-max."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        barrier()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return rank_max(times)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------- bandwidth


def bytes_moved_per_rank(operand_bytes: int, world_size: int) -> int:
    """Bytes one rank sends to its peers in one all-to-all of an ``operand_bytes`` per-rank operand."""
    return operand_bytes * (world_size - 1) // world_size


def bandwidth_gbps(operand_bytes: int, world_size: int, seconds: float | None) -> float | None:
    """THE bandwidth definition: bytes moved per rank / time, in GB/s (1e9 B/s)."""
    if not seconds or world_size < 2:
        return 0.0 if world_size < 2 else None
    return bytes_moved_per_rank(operand_bytes, world_size) / seconds / 1e9


# ---------------------------------------------------------------------------------------------- comparisons


def count_bitwise_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of ``a`` and ``b`` whose bits differ (NaN payloads included); shapes must match."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(ints) != b.contiguous().view(ints)).sum().item())


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (bit-for-bit identity of large outputs without keeping them)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(memoryview(flat.numpy())).hexdigest()
