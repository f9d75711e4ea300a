"""``python -m fastvideo.distributed.ulysses explain``: one call's route, plan and reasons as ``(label, text)`` rows.

Pure: the switch, the GPU model, the window and the long-training setting come in resolved (``__main__`` reads
them); nothing here touches a process group or a GPU, except ``default_gpu`` asking torch which GPU 0 is. New
kinds of output (a row per concern) are added to ``explain_rows``.
"""

from __future__ import annotations

import argparse

import torch

from fastvideo.distributed.all_to_all import Shape, validate_input
from fastvideo.distributed.settings import ROUTE as ROUTE_VAR
from fastvideo.distributed.ulysses.overlap_plan import describe_plan
from fastvideo.distributed.ulysses.policy import (
    ENGINE_CE,
    ENGINE_SM,
    TUNED_TABLE,
    Geometry,
    Plan,
    TunedRow,
    choose_plan,
    lookup,
    normalize_gpu_name,
)
from fastvideo.distributed.ulysses.transport import ENTRY_UNEVEN

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
}
ASSUMED_GPU = "H200"  # explain's model on a machine without a GPU (printed as an assumption)

# The two plan kinds by the names the docs use: what moves the data across NVLink, and the window rule each obeys.
KIND_NAMES = {ENGINE_SM: "SM kind", ENGINE_CE: "copy-engine kind"}
_KIND_HOW = {
    ENGINE_SM: "the fused kernel's CTAs store into the peers' windows over NVLink",
    ENGINE_CE: "the copy engines move the data across NVLink, CTAs copy on the device",
}


def tuned_row_note(gpu: str, geom: Geometry, table: tuple[TunedRow, ...] = TUNED_TABLE) -> str:
    """Which tuned row the policy will use, or why none applies (an unknown GPU must not pass silently)."""
    row = lookup(table, gpu, geom)
    if row is not None:
        chunking = f"{row.planes_per_chunk} plane(s) per chunk"
        if row.row_chunks > 1:
            chunking += f", {row.row_chunks} row chunks per plane"
        return f"{row.gpu}/SP{row.world_size}: {KIND_NAMES[row.engine]}, {row.ctas} CTAs, {chunking} ({row.source})"
    name = normalize_gpu_name(gpu)
    listed = ", ".join(sorted({r.gpu for r in table})) or "none"
    same_gpu = [r for r in table if r.gpu == name]
    if not name:
        why = f"none: no GPU model given (--gpu {gpu!r}); GPUs with tuned rows: {listed}"
    elif not same_gpu:
        why = f"none: no tuned row exists for GPU {gpu!r} (model {name!r}); GPUs with tuned rows: {listed}"
    else:
        rows = "; ".join(f"SP{r.world_size} {r.dtype} H={r.heads} D={r.head_dim} ({KIND_NAMES[r.engine]})"
                         for r in same_gpu)
        why = f"none for {name} at SP{geom.world_size} {geom.dtype} H={geom.H} D={geom.D}; {name} rows: {rows}"
    return f"{why}. Where the call is eligible (route, below), the original policy applies."


def kind_note(plan: Plan, geom: Geometry, window_bytes: int) -> str:
    """The plan's kind, how it moves data, and the window rule it obeys, with the numbers."""
    how = f"{KIND_NAMES[plan.engine]}: {_KIND_HOW[plan.engine]}"
    if plan.engine == ENGINE_CE:
        return (f"{how}; two chunk buffers, so each chunk must fit half the window ({window_bytes // 2} of "
                f"{window_bytes} B); this plan's chunks take {plan.window_bytes(geom) // 2} B each")
    return f"{how}; each chunk must fit the window ({window_bytes} B); this plan's take {plan.window_bytes(geom)} B"


def default_gpu() -> tuple[str, str]:
    """The GPU model explain plans for when ``--gpu`` is not given, and where it came from (said in the output)."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.get_device_name(0), "GPU 0 of this machine"
    return ASSUMED_GPU, "assumed: this machine has no GPU; pass --gpu to plan for another model"


def rank_shape(glob: Shape, mode: int, p: int, rank: int, table: list[int] | None) -> Shape:
    """Rank ``rank``'s input to the op for the global ``glob``: its share of S (mode 0) or of H (mode 1), even or
    ``table``'s. Pure; a ValueError names the fix."""
    dim, name, flag = (1, "S", "--seq-splits") if mode == 0 else (2, "H", "--head-splits")
    if table is None and glob[dim] % p:
        raise ValueError(f"{name}={glob[dim]} does not divide by the SP size {p}: pass {flag} or another --world-size")
    if table is not None and sum(table) != glob[dim]:
        raise ValueError(f"{flag} sums to {sum(table)}, not {name}={glob[dim]}")
    out = list(glob)
    out[dim] = glob[dim] // p if table is None else table[rank] if rank < len(table) else 0
    return tuple(out)  # type: ignore[return-value]


def explain_rows(args: argparse.Namespace) -> tuple[int, list[tuple[str, str]]]:
    """``explain``'s output as ``(label, text)`` rows, and its exit status (2: no route can serve the input)."""
    rows: list[tuple[str, str]] = []
    mode, p = args.mode, args.world_size
    dtype = DTYPES[args.dtype]
    try:
        splits = validate_input(torch.empty(args.shape, device="meta"), mode, p, rank=args.rank,
                                seq_splits=args.seq_splits, head_splits=args.head_splits, allow_meta=True)
    except (ValueError, RuntimeError) as exc:  # RuntimeError: torch's, for a shape whose size overflows
        return 2, [("error:", str(exc))]
    geom = Geometry.from_input(args.shape, mode, p, dtype, seq_splits=splits.seq, head_splits=splits.heads)
    glob = [geom.B, geom.S_global, geom.H, geom.D]  # the global operand: every rank's share of S or H
    named = f" ({args.geometry[0]})" if getattr(args, "geometry", None) else ""
    rows.append(("input", f"global {glob}{named}, per rank {list(args.shape)} (rank {args.rank}'s input to "
                          f"the op) {dtype} mode {mode} "
                          f"({'scatter heads' if mode == 0 else 'scatter sequence'})"))
    if p == 1:
        # sequence_model_parallel_all_to_all_4D returns x itself at SP1: no route, no vote, no plan.
        rows.append(("route", "identity (SP size 1: the op returns its input unchanged; no collective, no vote)"))
        return 0, rows
    choice = choose_plan(geom, gpu=args.gpu, window_bytes=args.window_bytes, grad=args.grad,
                         long_training=args.long_training)
    share = "S_local" if geom.seq_splits is None else "largest S_local share"
    rows.append(("geometry", f"SP {p}, B={geom.B} planes, {share}={geom.S}, H={geom.H}, D={geom.D}, "
                             f"plane {geom.plane_bytes} B, operand {geom.operand_bytes} B"))
    if geom.uneven:
        rows.append(("splits", f"seq {list(geom.seq_table)}, heads {list(geom.head_table)} (uneven: chunks and the "
                               "window are sized by the largest share)"))
    else:
        rows.append(("splits", f"even ({geom.S} rows and {geom.H // p} heads per rank)"))
    rows.append(("gpu", f"{args.gpu} ({args.gpu_source})"))
    src = getattr(args, "sources", {})
    rows.append(("policy", f"grad={args.grad} long_training={args.long_training} ({src.get('long_training', '')}) "
                           f"window={args.window_bytes} B ({src.get('window_bytes', '')})"))
    rows.append(("switch", f"{ROUTE_VAR}={args.a2a} ({src.get('a2a', '')})"))
    rows.append(("tuned row", tuned_row_note(args.gpu, geom)))
    if choice.plan is None:
        assert choice.reason is not None
        fused = f"nccl (declined: {choice.reason.label})"
    else:
        fused = f"fused ({choice.plan.describe(geom)})"
    if args.a2a == "off":
        # The helper is never built under off: every call takes the NCCL route, whatever the policy would choose.
        rows.append(("route", f"nccl ({ROUTE_VAR}=off: every call takes the NCCL route, voting only in checked mode; "
                              f"{ROUTE_VAR}=auto would choose the plan below)"))
        rows.append(("with auto", fused))
    else:
        rows.append(("route", fused))
    if choice.plan is not None:
        rows.append(("kind", kind_note(choice.plan, geom, args.window_bytes)))
    rows.append(("why", choice.why))
    if choice.plan is not None and args.a2a == "auto":
        rows.append(("needs", "every SP rank on one host, NVLink between them and the kernel library (doctor checks "
                              "this host); where any rank lacks one, every rank takes the NCCL route together"))
    if geom.uneven and choice.plan is not None:
        # The policy's plan runs only on a transport that offers uneven plans (the planner requires it).
        rows.append(("transport", f"uneven splits need a transport offering '{ENTRY_UNEVEN}': the native one with a "
                                  "kernel build of ABI 5 or later; on an older build every rank declines "
                                  "uneven_splits and the NCCL route runs"))
    return 0, rows


def explain(args: argparse.Namespace) -> int:
    rc, rows = explain_rows(args)
    for label, text in rows:
        print(f"{label:10s} {text}")
    if rc == 0 and getattr(args, "overlap", 0) > 1:  # a DistributedAttention's head groups (overlap_plan)
        rc, lines = describe_plan(args, args.world_size, DTYPES[args.dtype])
        print("\n".join(lines))
    return rc
