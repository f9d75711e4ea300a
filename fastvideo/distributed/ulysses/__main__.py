"""Ask the Ulysses helper why, without running anything.

    python -m fastvideo.distributed.ulysses explain --world-size 4 --shape 3,62500,56,128 \\
        --dtype bfloat16 --gpu GB200 [--mode 0] [--grad] [--long-training chunked] [--window-bytes N]
    python -m fastvideo.distributed.ulysses doctor

``explain`` applies the same pure policy the helper applies on every call and prints the plan
(route, CTAs, chunking, window bytes) or the decline reason; no GPU or process group is needed.
``doctor`` prints versions, the kernel library and its entry points, GPUs and peer access, the
host identity and the environment variables.
"""

from __future__ import annotations

import argparse
import sys

import torch

from fastvideo import envs
from fastvideo.distributed.ulysses.policy import DEFAULT_WINDOW_BYTES, Geometry, choose_plan

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
}


def _shape(text: str) -> tuple[int, int, int, int]:
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected four integers B,S,H,D") from None
    if len(dims) != 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: expected four positive integers B,S,H,D")
    return dims  # type: ignore[return-value]


def explain(args: argparse.Namespace) -> int:
    from fastvideo.distributed.communication_op import validate_input

    mode, p = args.mode, args.world_size
    dtype = _DTYPES[args.dtype]
    try:
        validate_input(torch.empty(args.shape, device="meta"), mode, p)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    geom = Geometry.from_input(args.shape, mode, p, dtype)
    choice = choose_plan(
        geom, gpu=args.gpu, window_bytes=args.window_bytes, grad=args.grad, long_training=args.long_training
    )
    print(f"input      {list(args.shape)} {dtype} mode {mode} ({'scatter heads' if mode == 0 else 'scatter sequence'})")
    print(
        f"geometry   SP {p}, B={geom.B} planes, S_local={geom.S}, H={geom.H}, D={geom.D}, plane {geom.plane_bytes} B, "
        f"operand {geom.operand_bytes} B"
    )
    print(f"policy     gpu={args.gpu} grad={args.grad} long_training={args.long_training} window={args.window_bytes} B")
    if choice.plan is None:
        assert choice.reason is not None
        print(f"route      nccl (declined: {choice.reason.label})")
    else:
        print(f"route      fused ({choice.plan.describe(geom)})")
    print(f"why        {choice.why}")
    return 0


def doctor(_: argparse.Namespace) -> int:
    import platform

    from fastvideo.distributed.ulysses.helper import host_identity

    print(f"python     {platform.python_version()}  torch {torch.__version__}")
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    print(f"nccl       torch's: {'.'.join(map(str, nccl)) if nccl else 'n/a (no CUDA build or no GPU)'}")
    host, boot = host_identity()
    print(f"host       {host} boot_id {boot}")
    for name, var in envs.registry().items():
        print(f"env        {name}={envs.get(name)!r}  (default {var.default!r})")
    try:
        import fastvideo_kernel

        info = fastvideo_kernel.info()
        for key, value in info.items():
            print(f"kernel     {key}: {value}")
    except Exception as exc:  # noqa: BLE001 - doctor reports, never fails
        print(f"kernel     not available: {exc}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"gpus       {count}")
    for i in range(count):
        peers = [j for j in range(count) if j != i and torch.cuda.can_device_access_peer(i, j)]
        print(f"gpu {i}      {torch.cuda.get_device_name(i)}; peer access to {peers}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastvideo.distributed.ulysses", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="print the plan or the decline reason for one call")
    ex.add_argument("--world-size", type=int, required=True, help="SP size")
    ex.add_argument("--shape", type=_shape, required=True, help="input shape B,S,H,D as passed to the op")
    ex.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    ex.add_argument("--gpu", default="H200", help="GPU model, e.g. GB200, H200")
    ex.add_argument("--mode", type=int, choices=(0, 1), default=0, help="0: scatter heads (2,1); 1: the inverse (1,2)")
    ex.add_argument("--grad", action="store_true", help="the operand is grad-tracked (training)")
    ex.add_argument(
        "--long-training",
        choices=("auto", "chunked"),
        default=None,
        help="default: FASTVIDEO_ULYSSES_A2A_LONG_TRAINING",
    )
    ex.add_argument("--window-bytes", type=int, default=None, help=f"default: env or {DEFAULT_WINDOW_BYTES}")
    sub.add_parser("doctor", help="versions, kernel library, GPUs, host, env")
    args = parser.parse_args(argv)
    if args.command == "explain":
        if args.long_training is None:
            args.long_training = envs.get("FASTVIDEO_ULYSSES_A2A_LONG_TRAINING")
        if args.window_bytes is None:
            args.window_bytes = envs.get("FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES")
        return explain(args)
    return doctor(args)


if __name__ == "__main__":
    sys.exit(main())
