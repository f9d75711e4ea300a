"""The library's verdict for the voted launch (``fvk_vote_would_run``) against the contract's (CPU, in CI).

The voted form of ``fvk_launch`` (a non-null ``fvk_vote``) exchanges a call's 12 fields and launches at once
where ``fvk_vote_would_run`` says so, skipping the Python verdict (``contract.decide``). That is right only if
the two agree: the library must say "run" exactly when ``decide`` runs a plan, for every rank's view of every
table, and the same on every rank (or one rank would launch while its peers decline). Checked here over random
vote tables built to sit near the boundary (identical rows with one field changed on one rank, eligibility
bits, no plan), P 1..8, with the contract's field indices, on the product library. The voted form's refusals
before the exchange (stage ``STAGE_REFUSED``: this rank has not voted) are checked too; its exchange over a real
two-rank vote is ``tests/distributed/test_ulysses_shm_vote.py``'s, its launch needs a GPU
(``benchmarks/measure_fused_host_overhead.py``).
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import NUM_FIELDS, DeclineReason, Field, Verdict
from tests.kernel.built import fastvideo_kernel

I64 = ctypes.c_int64


@pytest.fixture(scope="module")
def lib(product_lib):
    return product_lib


def would_run(lib, table: list[list[int]], rank: int) -> bool:
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
def test_the_library_runs_exactly_where_the_contract_runs(lib, world):
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


def test_the_library_reads_the_contracts_eligibility_and_plan_fields(lib):
    """Negative controls at the two fields the library reads: a bit in ELIGIBILITY, a zero PLAN."""
    row = base_row(random.Random(7))
    assert would_run(lib, [row, list(row)], 0)
    for field, value in ((Field.ELIGIBILITY, DeclineReason.NON_CONTIGUOUS.bit), (Field.PLAN, 0)):
        changed = list(row)
        changed[field] = value
        assert not would_run(lib, [changed, list(changed)], 0), field


def voted(lib, vote, **call) -> tuple[int, str]:
    """(status, error) of the voted form of fvk_launch with a null context and the given call fields."""
    desc = fastvideo_kernel.Call(size=ctypes.sizeof(fastvideo_kernel.Call), kind=fastvideo_kernel.KIND_SM, mode=0,
                                 dtype=3, ctas=144, B=1, S=8, H=8, D=8, planes_per_chunk=1, rows_per_chunk=8)
    for name, value in call.items():
        setattr(desc, name, value)
    status = lib.fvk_launch(None, ctypes.byref(desc), None, None, None, ctypes.byref(vote))
    return status, fastvideo_kernel.last_error(lib) if status else ""


def test_the_voted_launch_refuses_before_any_exchange(lib):
    """Each refusal leaves stage REFUSED (this rank has not voted) and no exchange time: a closed vote, then the
    call description's own errors, which the voted form checks before the vote; the voted form is eager and
    unchecked, so the capture and debug flags are refused too."""
    fields = (I64 * NUM_FIELDS)()
    votes = (I64 * (2 * NUM_FIELDS))()

    def fresh() -> fastvideo_kernel.Vote:
        return fastvideo_kernel.Vote(size=ctypes.sizeof(fastvideo_kernel.Vote), stage=9, handle=None,
                                     fields=ctypes.addressof(fields), votes=ctypes.addressof(votes),
                                     timeout_ns=10**9, vote_ns=-1)

    cases = [
        ({}, 5, "is not open"),
        ({"kind": 3}, 1, "kind 3"),
        ({"flags": fastvideo_kernel.CALL_CAPTURE}, 1, "eager and unchecked"),
        ({"flags": fastvideo_kernel.CALL_DEBUG}, 1, "eager and unchecked"),
        ({"flags": 64}, 1, "unknown bits"),
        # Split tables are no refusal (ABI 5): the call reaches the vote (ABI 4 refused them here).
        ({"seq_split": ctypes.addressof(fields), "head_split": ctypes.addressof(fields)}, 5, "is not open"),
        ({"size": 8}, 1, "fvk_call.size 8"),
    ]
    for call, code, message in cases:
        vote = fresh()
        status, error = voted(lib, vote, **call)
        assert (status, vote.stage, vote.vote_ns) == (code, fastvideo_kernel.STAGE_REFUSED, 0), (call, error)
        assert message in error, (call, error)
    short = fresh()
    short.size = 8  # a vote of another layout is refused without being written to
    status, error = voted(lib, short)
    assert status == 1 and "fvk_vote.size 8" in error and short.stage == 9
