"""The test library's host checks from Python: each call described as the native transport describes it
(``launch.call_description``: geometry, split tables, plan), and split tables for the plan spaces.

    from tests.kernel.host_checks import window_sync, ce_sync, addressing, uneven_geometry
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Sequence

import torch

from fastvideo.distributed.ulysses.launch import call_description
from fastvideo.distributed.ulysses.policy import ENGINE_CE, Geometry, Plan
from tests.kernel.built import fastvideo_kernel, kernel_testing

STATIC, MOVING, EVEN_ONLY = kernel_testing.LAYOUT_STATIC, kernel_testing.LAYOUT_MOVING, kernel_testing.LAYOUT_EVEN_ONLY
SM, CE = fastvideo_kernel.KIND_SM, fastvideo_kernel.KIND_CE


def describe(calls: Sequence[tuple[Geometry, Plan]], kinds: Sequence[int] | None = None) -> tuple[ctypes.Array, list]:
    """The ``fvk_call`` array of ``calls`` (each (geometry, plan); the kind from the plan's engine unless
    ``kinds`` says), and the split tables it points at (keep them alive as long as the array)."""
    descs, keep = [], []
    for n, (geom, plan) in enumerate(calls):
        kind = kinds[n] if kinds is not None else (CE if plan.engine == ENGINE_CE else SM)
        desc, tables = call_description(fastvideo_kernel, geom, geom.dtype, kind=kind, ctas=plan.ctas,
                                        planes=plan.planes_per_chunk, rows=plan.rows_per_chunk)
        descs.append(desc)
        keep.append(tables)
    return (fastvideo_kernel.Call * len(descs))(*descs), keep


def _result(lib, status: int, count: ctypes.c_int64, msg) -> tuple[int, str]:
    assert status == 0, fastvideo_kernel.last_error(lib)
    return count.value, msg.value.decode()


def window_sync(lib, calls: Sequence[tuple[Geometry, Plan]], window: int, *, layout: int = STATIC,
                schedule: int = kernel_testing.SYNC_KERNEL) -> tuple[int, str]:
    """(violations, first) of ``fvk_check_window_sync`` for consecutive SM-kind calls."""
    array, keep = describe(calls, [SM] * len(calls))
    violations, msg = ctypes.c_int64(-1), ctypes.create_string_buffer(1024)
    status = lib.fvk_check_window_sync(calls[0][0].world_size, len(calls), array, window, layout, schedule,
                                       ctypes.byref(violations), msg, len(msg))
    del keep
    return _result(lib, status, violations, msg)


def ce_sync(lib, calls: Sequence[tuple[Geometry, Plan]], *, kinds: Sequence[int] | None = None, layout: int = STATIC,
            drop: int = 0) -> tuple[int, str]:
    """(violations, first) of ``fvk_check_ce_sync`` for consecutive calls (copy-engine ones, SM-kind ones between
    them where ``kinds`` says)."""
    array, keep = describe(calls, kinds if kinds is not None else [CE] * len(calls))
    violations, msg = ctypes.c_int64(-1), ctypes.create_string_buffer(1024)
    status = lib.fvk_check_ce_sync(calls[0][0].world_size, len(calls), array, layout, drop, ctypes.byref(violations),
                                   msg, len(msg))
    del keep
    return _result(lib, status, violations, msg)


def addressing(lib, geom: Geometry, plan: Plan, kind: int, *, layout: int = STATIC, flags: int = 0) -> tuple[int, str]:
    """(wrong bytes, first) of one call's data movement on the host (``fvk_check_addressing``)."""
    array, keep = describe([(geom, plan)], [kind])
    wrong, msg = ctypes.c_int64(-1), ctypes.create_string_buffer(1024)
    status = lib.fvk_check_addressing(geom.world_size, array, layout, flags, ctypes.byref(wrong), msg, len(msg))
    del keep
    return _result(lib, status, wrong, msg)


def seq_table(rng: random.Random, world: int, largest: int, *, zero: bool) -> tuple[int, ...]:
    """Uneven sequence shares in [0, ``largest``], one of them ``largest`` (the chunks' row extent), one 0 where
    ``zero``."""
    while True:
        table = [rng.randint(0, largest) for _ in range(world)]
        top = rng.randrange(world)
        table[top] = largest
        if zero:
            table[rng.choice([r for r in range(world) if r != top])] = 0
        if len(set(table)) > 1:
            return tuple(table)


def head_table(rng: random.Random, world: int, heads: int, *, zero: bool) -> tuple[int, ...]:
    """``heads`` split into ``world`` uneven shares: one of them 0 and the others >= 1 where ``zero``, else all
    >= 1 (``heads`` > ``world``)."""
    parts = world - 1 if zero else world
    assert heads >= parts + (0 if zero else 1), (heads, world, zero)
    while True:
        cuts = sorted(rng.sample(range(1, heads), parts - 1))  # distinct: every part >= 1
        table = [b - a for a, b in zip([0, *cuts], [*cuts, heads], strict=True)]
        if zero:
            table.insert(rng.randrange(world), 0)
        if len(set(table)) > 1:
            return tuple(table)


def uneven_geometry(rng: random.Random, mode: int, dtype: torch.dtype, world: int, b: int, largest: int, heads: int,
                    d: int, *, zero: bool, seq: bool = True, head: bool = True) -> Geometry:
    """A geometry with uneven sequence shares (the largest ``largest`` rows) where ``seq`` and uneven head shares
    (``heads`` in all) where ``head``; one share of each uneven table is 0 where ``zero``. An even head table
    needs ``heads`` divisible by ``world``."""
    seq_splits = seq_table(rng, world, largest, zero=zero) if seq else None
    head_splits = head_table(rng, world, heads, zero=zero) if head else None
    return Geometry(mode, dtype, b, largest, heads, d, world, seq_splits, head_splits)
