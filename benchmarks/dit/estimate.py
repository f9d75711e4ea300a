"""Wall-time estimate of a DiT step run without running it (``benchmark_dit_step.py --estimate``): a FLOP model
calibrated on one measured step, the procedure's step counts (``steps_per_tokens``, which the CPU test checks
against the steps a run made), op-level calls at the NCCL route's measured rate, and assumed start-up and
compile times. A planning tool: each run's header carries its estimate beside its wall time."""

from __future__ import annotations

from collections.abc import Callable, Sequence

# Calibration: the SP1 32k dense step measured on one H200 (docs/results/2026-11-29-h200-one-gpu-1c4193e/run.json):
# its forward FLOPs (forward_flops) over its inference time, and its training / inference time ratio.
EST_FLOPS_PER_S = 2.85e14 / 0.460
EST_TRAIN_OVER_INFER = 2.018 / 0.460  # forward + recompute + backward (2 forwards) + clip + AdamW
EST_SPARSE_ATTN_COST = 0.2  # assumption, not measured: 90% sparse = 10% of the FLOPs at half SDPA's rate
EST_OP_BYTES_PER_S = 2.69e9 / 10.856e-3  # assumption: the NCCL route's packed-QKV 128k call, 2.69 GB in 10.856 ms
EST_STARTUP_S = 40.0  # assumption: interpreter, process groups, model init, FSDP, helper construction
EST_COMPILE_S = 60.0  # assumption: flex_attention forward + backward compile per sequence length
EST_OFFLOAD = 1.1  # assumption: save_on_cpu copies of the checkpointed block inputs


def forward_flops(hidden: int, blocks: int, tokens: int, sparse: bool) -> float:
    """FLOPs of one forward of the whole model over ``tokens`` (all ranks together).

    Per token per block: QKV 3h^2 + proj h^2 + MLP 8h^2 multiply-adds = 24 h^2 FLOPs; attention (full,
    non-causal): QK^T and PV, 2 x 2 x S x h FLOPs per token.
    """
    linear = 24 * hidden * hidden * tokens * blocks
    attention = 4 * tokens * tokens * hidden * blocks
    return linear + attention * (EST_SPARSE_ATTN_COST if sparse else 1.0)


def steps_per_tokens(n_long: int, trials: int, local: bool) -> tuple[int, int]:
    """(inference forwards, training steps) that one token count runs (the procedure in the docstring):
    warm-up of the NCCL route and the first auto variant, trials x (variants + local), the check pass
    per variant, one calibration step."""
    infer_variants = 1 + (1 if n_long else 0)
    variants = 1 + n_long
    n_infer = infer_variants + trials * (infer_variants + int(local)) + infer_variants
    n_train = infer_variants + trials * (variants + int(local)) + variants + 1
    return n_infer, n_train


def estimate_seconds(*, hidden: int, heads: int, blocks: int, tokens: Sequence[int], world: int, sparse: bool,
                     n_long: int, trials: int, share: bool, offload: Callable[[int], bool], op_iters: int,
                     op_warmup: int, itemsize: int = 2) -> dict:
    """Wall-time estimate of one run (per token count and total), from the FLOP model above."""
    per: list[dict] = []
    for n_tok in tokens:
        infer_s = forward_flops(hidden, blocks, n_tok, sparse) / world / EST_FLOPS_PER_S
        train_s = infer_s * EST_TRAIN_OVER_INFER * (EST_OFFLOAD if offload(n_tok) else 1.0)
        n_infer, n_train = steps_per_tokens(n_long, trials, share and world > 1)
        # Op level: per round and variant, qkv (3 planes) and out (1 plane): nograd (infer variants),
        # grad and fwdbwd (2 calls) per (iters + warmup).
        plane = n_tok // world * hidden * itemsize
        call_s = 4 * plane / EST_OP_BYTES_PER_S
        op_s = trials * (op_iters + op_warmup) * call_s * ((1 + (1 if n_long else 0)) * 1 + (1 + n_long) * 3)
        seconds = n_infer * infer_s + n_train * train_s + op_s + (EST_COMPILE_S if sparse else 0.0)
        per.append({"tokens": n_tok, "infer_s": infer_s, "train_s": train_s, "infer_steps": n_infer,
                    "train_steps": n_train, "op_level_s": op_s, "seconds": seconds})
    return {"per_tokens": per, "startup_s": EST_STARTUP_S,
            "total_s": EST_STARTUP_S + sum(p["seconds"] for p in per)}


def print_estimate(est: dict, args) -> None:
    print(f"# estimate: hidden {args.hidden}, {args.blocks} blocks, {args.attention}, SP{args.estimate_world}, "
          f"{args.repeat} trials (calibration: {EST_FLOPS_PER_S / 1e12:.0f} TFLOP/s effective, train = "
          f"{EST_TRAIN_OVER_INFER:.2f} x inference; sparse attention at {EST_SPARSE_ATTN_COST:g} of dense)")
    for p in est["per_tokens"]:
        print(f"#   {p['tokens']:>7} tokens: inference {p['infer_s']:.3f} s x {p['infer_steps']}, training "
              f"{p['train_s']:.3f} s x {p['train_steps']}, op level {p['op_level_s']:.1f} s -> {p['seconds']:.0f} s")
    print(f"#   startup {est['startup_s']:.0f} s; total {est['total_s']:.0f} s")
