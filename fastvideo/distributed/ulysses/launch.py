"""One signature's library call, as data: which entry a plan runs on, and its call description (``fvk_call``).

Built once per signature by ``NativeTransport`` (``build_launch``) and reused by every call of it; pure apart
from reading the loaded library's symbols. The kernel library's ABI is ``csrc/ulysses_a2a/ulysses_a2a.h``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fastvideo.distributed.ulysses.contract import dtype_code
from fastvideo.distributed.ulysses.policy import ENGINE_CE, MAX_CTAS, ORIGINAL_CTAS, Geometry, Plan
from fastvideo.distributed.ulysses.transport import (
    ENTRY_CAPTURE,
    ENTRY_CE,
    ENTRY_CE_CAPTURE,
    ENTRY_ORIGINAL,
    ENTRY_TUNED,
    ENTRY_UNEVEN,
    output_shape,
)


class Launch(NamedTuple):
    """One signature's launch: the library call every call of the signature makes, ``fn(ctx, call, x, out, stream,
    vote)``, with its call description (an ``fvk_call``, passed by reference) and the split tables it points at
    (kept alive with it), this rank's output shape, and the offering it runs on (for messages)."""

    fn: Callable[..., int]
    call: Any  # ctypes.byref of ``desc``
    desc: Any  # the fvk_call (None for a build older than the one entry)
    out_shape: tuple[int, ...]
    entry: str
    tables: tuple[Any, Any] = (None, None)  # fastvideo_kernel.split_table arrays ``desc`` points at


def call_description(fvk: Any, geom: Geometry, dtype: torch.dtype, *, kind: int, ctas: int, planes: int, rows: int,
                     flags: int = 0) -> tuple[Any, tuple[Any, Any]]:
    """Local, pure, host-only. The ``fvk_call`` of a call on ``geom`` (``fvk``: the ``fastvideo_kernel`` loader
    module) and the split tables it points at: ``geom``'s, or none where a table is the even one. The caller
    keeps the tables alive as long as the description (it holds their addresses)."""
    seq, heads = fvk.split_table(geom.seq_splits), fvk.split_table(geom.head_splits)
    desc = fvk.Call(size=ctypes.sizeof(fvk.Call), flags=flags, kind=kind, mode=geom.mode, dtype=dtype_code(dtype),
                    ctas=ctas, B=geom.B, S=geom.S, H=geom.H, D=geom.D, planes_per_chunk=planes, rows_per_chunk=rows,
                    seq_split=None if seq is None else ctypes.addressof(seq),
                    head_split=None if heads is None else ctypes.addressof(heads))
    return desc, (seq, heads)


def refusal(plan: Plan, geom: Geometry, entries: frozenset[str], entry: str) -> str | None:
    """Local, pure. Why a build offering ``entries`` cannot launch ``plan`` on ``geom`` through its offering
    ``entry`` (None: it can): an offering it lacks (``entry``, and ``uneven`` for uneven split tables), named with
    the rebuild that adds it, or more CTAs than the device communicator reserves."""
    for needed in (entry, ENTRY_UNEVEN) if geom.uneven else (entry,):
        if needed not in entries:
            return (f"plan {plan} needs the {needed!r} offering, which this kernel build lacks "
                    f"(it offers {sorted(entries)}): rebuild fastvideo-kernel")
    return f"plan asks for {plan.ctas} CTAs, at most {MAX_CTAS}" if plan.ctas > MAX_CTAS else None


def build_launch(fvk: Any, lib: Any, offerings: frozenset[str], entries: frozenset[str], geom: Geometry, plan: Plan,
                 dtype: torch.dtype, capture: bool, rank: int) -> Launch:
    """Local, host-only. The launch of ``plan`` on ``geom`` for this rank on the loaded library ``lib`` (``fvk``:
    its loader module; ``offerings`` / ``entries``: what the build offers, ``fastvideo_kernel.probe``). The
    original plan (36 CTAs over the whole (B, S)) runs on ``fvk_a2a_original`` where the build has no
    ``fvk_launch``. Raises ValueError, naming the fix, for a plan this build does not offer."""
    ce = plan.engine == ENGINE_CE
    original = not ce and plan.ctas == ORIGINAL_CTAS and plan.planes_per_chunk >= geom.B \
        and plan.rows_per_chunk >= geom.S
    if capture:
        entry = ENTRY_CE_CAPTURE if ce else ENTRY_CAPTURE
    else:
        entry = ENTRY_CE if ce else ENTRY_ORIGINAL if original else ENTRY_TUNED
    why = refusal(plan, geom, entries, entry)
    if why:
        raise ValueError(why)
    ctas, planes, rows = ((ORIGINAL_CTAS, geom.B, geom.S) if original
                          else (plan.ctas, plan.planes_per_chunk, plan.rows_per_chunk))
    out_shape = output_shape(geom, rank)
    if fvk.LAUNCH in offerings:
        desc, tables = call_description(fvk, geom, dtype, kind=fvk.KIND_CE if ce else fvk.KIND_SM, ctas=ctas,
                                        planes=planes, rows=rows, flags=fvk.CALL_CAPTURE if capture else 0)
        return Launch(lib.fvk_launch, ctypes.byref(desc), desc, out_shape, entry, tables)
    # A build older than the one entry offers the original plan alone (its entry has no call description).
    fixed = (geom.mode, dtype_code(dtype), geom.B, geom.S, geom.H, geom.D)
    original_entry = lib.fvk_a2a_original

    def fn(handle, call, x, out, stream, vote, fixed=fixed) -> int:
        return original_entry(handle, x, out, *fixed, stream)

    return Launch(fn, None, None, out_shape, entry)
