"""The library's verdict for the voted launch (``fvk_vote_would_run``) against the contract's (CPU, in CI).

``fvk_voted_launch`` exchanges a call's 12 fields and launches at once where ``fvk_vote_would_run`` says
so, skipping the Python verdict (``contract.decide``). That is right only if the two agree: the library
must say "run" exactly when ``decide`` runs a plan, for every rank's view of every table, and the same on
every rank (or one rank would launch while its peers decline). Checked here over random vote tables built
to sit near the boundary (identical rows with one field changed on one rank, eligibility bits, no plan),
P 1..8, with the contract's field indices. The argument checks of ``fvk_voted_launch`` that run before any
CUDA call are checked too; its launch needs a GPU (``benchmarks/measure_fused_host_overhead.py``).
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import NUM_FIELDS, DeclineReason, Field, Verdict
from tests.kernel.test_window_sync import fastvideo_kernel, lib  # noqa: F401  - the built library, or skip/fail

I64 = ctypes.c_int64


def would_run(lib, table: list[list[int]], rank: int) -> bool:  # noqa: F811
    flat = (I64 * (len(table) * NUM_FIELDS))(*(v for row in table for v in row))
    mine = (I64 * NUM_FIELDS)(*table[rank])
    return bool(lib.fvk_vote_would_run(flat, len(table), mine))


def base_row(rng: random.Random) -> list[int]:
    row = [0] * NUM_FIELDS
    row[Field.HEADER] = contract.header(rng.randrange(1, 5))
    row[Field.SEQ] = rng.randrange(0, 1000)
    row[Field.MODE_PHASE] = contract.mode_phase(rng.randrange(2), rng.randrange(3))
    row[Field.DTYPE] = rng.choice((1, 2, 3))
    row[Field.B], row[Field.S], row[Field.H], row[Field.D] = (rng.randrange(1, 5), rng.randrange(1, 9999),
                                                              8 * rng.randrange(1, 8), 128)
    row[Field.SPLITS] = rng.choice((0, contract.splits_digest((3, 5), (4, 4))))
    row[Field.WINDOW_BYTES] = rng.randrange(1, 1 << 30)
    row[Field.PLAN] = rng.randrange(1, 1 << 40)
    return row


def table_near_the_boundary(rng: random.Random, world: int) -> list[list[int]]:
    row = base_row(rng)
    kind = rng.randrange(6)
    if kind == 1:  # eligible nowhere: a decline bit on every rank
        row[Field.ELIGIBILITY] = rng.choice([r.bit for r in DeclineReason])
    elif kind == 2:  # no plan
        row[Field.PLAN] = 0
    table = [list(row) for _ in range(world)]
    if kind >= 3 and world > 1:  # one rank differs in one field (any field), or in its eligibility alone
        r = rng.randrange(world)
        field = rng.randrange(NUM_FIELDS) if kind != 5 else Field.ELIGIBILITY
        table[r][field] = table[r][field] + rng.choice((1, -1, 1 << 33)) if field != Field.ELIGIBILITY else \
            DeclineReason.DTYPE.bit
    return table


@pytest.mark.parametrize("world", range(1, 9))
def test_the_library_runs_exactly_where_the_contract_runs(lib, world):  # noqa: F811
    rng = random.Random(1000 + world)
    runs = 0
    for case in range(1500):
        table = table_near_the_boundary(rng, world)
        decision = contract.decide(torch.tensor(table, dtype=torch.int64))
        expected = decision.verdict is Verdict.RUN
        views = [would_run(lib, table, r) for r in range(world)]
        assert views == [expected] * world, (case, table, decision)
        if expected:
            assert decision.plan_word == table[0][Field.PLAN]  # the plan launched is the one agreed
        runs += expected
    assert 0 < runs < 1500  # both sides of the boundary were exercised


def test_the_library_reads_the_contracts_eligibility_and_plan_fields(lib):  # noqa: F811
    """Negative controls at the two fields the library reads: a bit in ELIGIBILITY, a zero PLAN."""
    row = base_row(random.Random(7))
    assert would_run(lib, [row, list(row)], 0)
    for field, value in ((Field.ELIGIBILITY, DeclineReason.NON_CONTIGUOUS.bit), (Field.PLAN, 0)):
        changed = list(row)
        changed[field] = value
        assert not would_run(lib, [changed, list(changed)], 0), field


def test_voted_launch_refuses_bad_arguments_before_any_exchange(lib):  # noqa: F811
    stage, ns = ctypes.c_int(-1), I64(-1)
    fields = (I64 * NUM_FIELDS)()
    votes = (I64 * (2 * NUM_FIELDS))()
    args = (0, 1, 1, 8, 8, 8, 144, 1, 8, None)  # mode, dtype, B, S, H, D, ctas, planes, rows, stream
    status = lib.fvk_voted_launch(None, fields, votes, 10**9, ctypes.byref(stage), ctypes.byref(ns), None, 1, None,
                                  None, *args)
    assert status == 5 and "is not open" in fastvideo_kernel.last_error(lib) and stage.value == -1
    status = lib.fvk_voted_launch(None, fields, votes, 10**9, ctypes.byref(stage), ctypes.byref(ns), None, 3, None,
                                  None, *args)
    assert status == 1 and "entry 3" in fastvideo_kernel.last_error(lib) and stage.value == -1
    status = lib.fvk_voted_launch(None, fields, votes, 10**9, None, ctypes.byref(ns), None, 1, None, None, *args)
    assert status == 1 and "null stage" in fastvideo_kernel.last_error(lib)
