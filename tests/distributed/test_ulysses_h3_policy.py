"""Pure policy and contract tests (no processes, no GPU): the plan table, chunking, and the verdict.

Every geometry here is described, never allocated: 250k-token H3 operands are computed with
``Geometry`` only (CI must never allocate real H3 shapes on CPU).
"""

from __future__ import annotations

import re

import pytest
import torch

from fastvideo import envs
from fastvideo.distributed.ulysses import policy
from fastvideo.distributed.ulysses.contract import (
    CONTRACT_VERSION,
    DTYPE_CODES,
    MUST_MATCH,
    NUM_FIELDS,
    WIRE_FIELDS,
    ContractMismatchError,
    DeclineReason,
    Field,
    Phase,
    Verdict,
    decide,
    fields,
    header,
    mode_phase,
    reasons_from_bits,
)
from fastvideo.distributed.ulysses.policy import (
    DEFAULT_WINDOW_BYTES,
    LONG_TRAINING_PLANE_BYTES,
    MAX_CTAS,
    ORIGINAL_CTAS,
    Geometry,
    Plan,
    TunedRow,
    choose_plan,
    even_rows,
    lookup,
    normalize_gpu_name,
)

GIB = 1 << 30
BF16 = torch.bfloat16
H3_SP4_250K = (3, 62500, 56, 128)  # packed QKV, S_local = 250000 / 4
H3_SP2_250K = (3, 125000, 56, 128)  # packed QKV, S_local = 250000 / 2
ONE_PLANE = re.compile(r"\b(one|1) plane per chunk")  # Plan.describe's wording for planes_per_chunk == 1
GB200_SP2_ROW = TunedRow("GB200", 2, BF16, 56, 128, ctas=144, planes_per_chunk=1, source="test fixture")


def geom(shape, world_size, dtype=BF16, mode=0) -> Geometry:
    return Geometry.from_input(shape, mode, world_size, dtype)


# ------------------------------------------------------------------------------------- original policy


def test_original_plan_runs_whole_operand_in_one_launch_when_it_fits():
    """No tuned row (H200 has none): the 36-CTA original plan moves the whole operand in one chunk."""
    g = geom((3, 1024, 56, 128), 4)
    choice = choose_plan(g, gpu="NVIDIA H200")
    assert choice.reason is None
    assert choice.plan == Plan(ORIGINAL_CTAS, 3, 1024, tuned=False)
    assert choice.plan.num_chunks(g) == 1
    assert choice.plan.window_bytes(g) == g.operand_bytes
    assert "whole operand in one chunk" in choice.plan.describe(g)


def test_original_plan_declines_window_when_the_operand_does_not_fit():
    """Untuned and the whole operand exceeds the 1 GiB window: the NCCL route (WINDOW), never chunks."""
    g = geom(H3_SP4_250K, 4)
    assert g.operand_bytes > DEFAULT_WINDOW_BYTES
    choice = choose_plan(g, gpu="NVIDIA H200")
    assert choice.plan is None and choice.reason is DeclineReason.WINDOW
    assert "exceeds the window" in choice.why


def test_original_plan_of_more_planes_than_the_plan_word_holds_moves_them_in_chunks():
    """B = 65536 planes (the plan word's plane field holds 65535): the original plan moves them in chunks of
    65535, the last one short (the kernel clamps it), where the plan raised "Plan out of range" and the helper
    raised on every rank instead of moving or declining the call. One plane fewer stays one chunk."""
    for planes, chunks in ((65535, 1), (65536, 2), (2 * 65535 + 1, 3)):
        g = geom((planes, 1, 2, 8), 2)
        choice = choose_plan(g, gpu="NVIDIA H200")
        assert choice.plan == Plan(ORIGINAL_CTAS, min(planes, 65535), 1, tuned=False), choice
        assert choice.plan.num_chunks(g) == chunks and choice.plan.window_bytes(g) <= g.operand_bytes


def _many_planes(rank, p, planes):
    from tests.distributed.conftest import bit_equal, build_helper, last, oracle, rank_input

    helper = build_helper(window_bytes=1 << 24, tuned=False)
    x = rank_input(rank, (planes, 1, 2, 1))
    exact = bit_equal(helper.all_to_all(x, 0), oracle(x, 0))
    record = last(helper)
    helper.destroy()
    return exact, record[0], Plan.from_word(record[1]) if record[1] else None, record[3]


def test_a_call_of_more_planes_than_the_plan_word_holds_is_exact_through_the_helper(ranks):
    """65537 planes at P = 2 through the helper and the CPU plan transport: fused, in the original plan's 2
    chunks of 65535 and 2 planes, bit-exact against the NCCL route's output."""
    for exact, route, plan, chunks in ranks(2, _many_planes, 65537, timeout_s=120):
        assert exact and route == "fused" and chunks == 2, (exact, route, plan, chunks)
        assert plan == Plan(ORIGINAL_CTAS, 65535, 1, tuned=False)


@pytest.mark.parametrize("shape", [(3, 0, 8, 16), (0, 4, 8, 16), (2, 4, 8, 0)], ids=["S0", "B0", "D0"])
def test_an_operand_of_no_element_declines_empty(shape):
    """Nothing to move: the NCCL route (``empty``), on the tuned and the untuned path (it raised "Plan out of
    range" untuned, ZeroDivisionError where a tuned row applies)."""
    for gpu in ("NVIDIA H200", "B200"):
        choice = choose_plan(geom(shape, 2), gpu=gpu)
        assert choice.plan is None and choice.reason is DeclineReason.EMPTY, choice


def _empty(rank, p, shape):
    import torch

    from tests.distributed.conftest import bit_equal, build_helper, last, oracle

    helper = build_helper()
    x = torch.zeros(shape)
    out = helper.all_to_all(x, 0)
    record = last(helper)
    helper.destroy()
    return bit_equal(out, oracle(x, 0)), tuple(out.shape), record[0], record[2]


def test_an_empty_call_through_the_helper_takes_the_nccl_route_on_every_rank(ranks):
    """An all-to-all of an empty sequence (S_local 0 on every rank) and of a zero batch at P = 2: the NCCL route's
    empty output of the call's shape on every rank, declined ``empty`` (it raised PeerCallError on every rank)."""
    for shape, expected in (((3, 0, 4, 8), (3, 0, 2, 8)), ((0, 5, 4, 8), (0, 10, 2, 8))):
        for exact, out_shape, route, reason in ranks(2, _empty, shape, timeout_s=60):
            assert exact and out_shape == expected and (route, reason) == ("nccl", "empty"), (shape, route, reason)


def test_original_plan_boundary_is_inclusive():
    """An operand of exactly the window's size fits; one byte of window less declines."""
    g = geom((2, 4, 8, 16), 2, torch.float32)
    assert choose_plan(g, gpu="H200", window_bytes=g.operand_bytes).plan is not None
    assert choose_plan(g, gpu="H200", window_bytes=g.operand_bytes - 1).reason is DeclineReason.WINDOW


# ------------------------------------------------------------------------------------- tuned table


def test_gb200_sp4_inference_250k_runs_144_ctas_one_plane_per_chunk():
    """The upstream-measured row: 250k tokens, SP4, bf16, H56/D128, no grad -> 144 CTAs, one plane a chunk."""
    g = geom(H3_SP4_250K, 4)
    assert g.plane_bytes == 62500 * 56 * 128 * 2 == 896_000_000
    choice = choose_plan(g, gpu="NVIDIA GB200")
    assert choice.plan == Plan(MAX_CTAS, 1, 62500, tuned=True)
    assert choice.plan.num_chunks(g) == 3
    assert choice.plan.window_bytes(g) == g.plane_bytes <= DEFAULT_WINDOW_BYTES
    text = choice.plan.describe(g)
    assert "144 CTAs" in text and ONE_PLANE.search(text) and text.startswith("tuned")


def test_gb200_packed_qkvg_also_one_plane_per_chunk():
    """Four packed planes (QKVG) at 250k: still one plane per chunk, four chunks."""
    g = geom((4, 62500, 56, 128), 4)
    choice = choose_plan(g, gpu="GB200")
    assert choice.plan == Plan(MAX_CTAS, 1, 62500, tuned=True)
    assert choice.plan.num_chunks(g) == 4


def test_gb200_grad_tracked_250k_keeps_original_policy_and_declines_window():
    """Grad-tracked with a plane > 512 MiB and LONG_TRAINING=auto: original policy, so WINDOW (NCCL route)."""
    g = geom(H3_SP4_250K, 4)
    assert g.plane_bytes > LONG_TRAINING_PLANE_BYTES
    choice = choose_plan(g, gpu="NVIDIA GB200", grad=True, long_training="auto")
    assert choice.plan is None and choice.reason is DeclineReason.WINDOW
    assert "long training" in choice.why


def test_gb200_grad_tracked_250k_long_training_chunked_opts_into_tuned():
    """The same grad-tracked operand with long_training='chunked': 144 CTAs, one plane per chunk."""
    g = geom(H3_SP4_250K, 4)
    choice = choose_plan(g, gpu="NVIDIA GB200", grad=True, long_training="chunked")
    assert choice.plan == Plan(MAX_CTAS, 1, 62500, tuned=True)


def test_grad_plane_up_to_512mib_uses_tuned_and_one_row_more_does_not():
    """The 512 MiB rule looks at one plane: S=37449 rows (<= 512 MiB) is tuned, 37450 keeps the original."""
    row_bytes = 56 * 128 * 2
    s_max = LONG_TRAINING_PLANE_BYTES // row_bytes
    small, big = geom((3, s_max, 56, 128), 4), geom((3, s_max + 1, 56, 128), 4)
    assert small.plane_bytes <= LONG_TRAINING_PLANE_BYTES < big.plane_bytes
    assert choose_plan(small, gpu="GB200", grad=True).plan == Plan(MAX_CTAS, 1, s_max, tuned=True)
    big_choice = choose_plan(big, gpu="GB200", grad=True)
    assert big_choice.plan is None and big_choice.reason is DeclineReason.WINDOW  # 3 planes > 1 GiB


def test_no_grad_uses_tuned_row_for_small_operands_too():
    """Inference uses the tuned row directly even when the original plan would also fit."""
    g = geom((3, 1024, 56, 128), 4)
    assert choose_plan(g, gpu="GB200").plan == Plan(MAX_CTAS, 1, 1024, tuned=True)
    assert choose_plan(g, gpu="GB200", grad=True).plan == Plan(MAX_CTAS, 1, 1024, tuned=True)


def test_sub_plane_chunking_when_one_plane_exceeds_the_window():
    """SP2 250k: a plane is 1.79 GB > 1 GiB, so tuned plans chunk along S_local into the fewest even row
    ranges that fit (62500 + 62500 rather than 74898 + 50102: every CTA stays busy in every chunk)."""
    g = geom(H3_SP2_250K, 2)
    assert g.plane_bytes == 125000 * 56 * 128 * 2 > GIB
    choice = choose_plan(g, gpu="GB200", table=(GB200_SP2_ROW,))
    max_rows = GIB // g.row_bytes
    assert max_rows == 74898
    assert choice.plan == Plan(144, 1, 62500, tuned=True)
    assert choice.plan.sub_plane(g)
    chunks = list(choice.plan.chunks(g))
    assert len(chunks) == 3 * 2 == choice.plan.num_chunks(g)
    assert [r1 - r0 for _, _, r0, r1 in chunks[:2]] == [62500, 62500]
    assert choice.plan.window_bytes(g) == 62500 * g.row_bytes <= GIB
    assert "sub-plane chunks of" in choice.plan.describe(g)


@pytest.mark.parametrize("S,max_rows,rows", [(125000, 74898, 62500), (10, 3, 3), (10, 4, 4), (7, 7, 7), (7, 100, 7),
                                             (9, 4, 3), (1, 1, 1), (37800, 9450, 9450)])
def test_even_rows_is_the_fewest_most_even_split(S, max_rows, rows):
    assert even_rows(S, max_rows) == rows
    pieces = -(-S // rows)
    assert rows <= max_rows and pieces == -(-S // max_rows)  # as few chunks as the limit allows
    assert S - (pieces - 1) * rows > 0  # no empty chunk


def test_row_chunks_split_a_plane_that_fits():
    """A measured row with ``row_chunks`` cuts each plane into that many even row ranges (H200 SP2 rows:
    copy-engine plans, wan720p in 2 row chunks, h3-32k one plane per chunk)."""
    wan = geom((1, 37800, 40, 128), 2)
    assert choose_plan(wan, gpu="NVIDIA H200").plan == Plan(132, 1, 18900, tuned=True, engine="ce")
    h3 = geom((3, 16384, 56, 128), 2)
    plan = choose_plan(h3, gpu="NVIDIA H200").plan
    assert plan == Plan(132, 2, 16384, tuned=True, engine="ce") and plan.num_chunks(h3) == 2
    # A plane above half the window (the ce kind's buffer): even row chunks that fit it.
    h3_128k = geom((3, 65536, 56, 128), 2)
    plan = choose_plan(h3_128k, gpu="NVIDIA H200").plan
    assert plan == Plan(132, 1, 32768, tuned=True, engine="ce") and plan.window_bytes(h3_128k) <= 1 << 30
    row = TunedRow("T100", 2, torch.float32, 4, 8, ctas=72, planes_per_chunk=2, row_chunks=3, source="test")
    g = geom((2, 10, 4, 8), 2, torch.float32)
    assert choose_plan(g, gpu="T100", table=(row,)).plan == Plan(72, 1, 4, tuned=True)  # 4 + 4 + 2 rows
    with pytest.raises(ValueError, match="TunedRow out of range"):
        TunedRow("T100", 2, torch.float32, 4, 8, ctas=72, planes_per_chunk=1, row_chunks=0, source="test")


def test_sub_plane_grad_follows_long_training():
    """SP2 250k grad-tracked: auto keeps the original policy (WINDOW); chunked takes the sub-plane plan."""
    g = geom(H3_SP2_250K, 2)
    auto = choose_plan(g, gpu="GB200", grad=True, long_training="auto", table=(GB200_SP2_ROW,))
    chunked = choose_plan(g, gpu="GB200", grad=True, long_training="chunked", table=(GB200_SP2_ROW,))
    assert auto.reason is DeclineReason.WINDOW
    assert chunked.plan == Plan(144, 1, 62500, tuned=True)


def test_tuned_planes_per_chunk_bounded_by_window_and_batch():
    """A row asking for 4 planes per chunk gets what the window holds (2) and never more than B."""
    row = TunedRow("T100", 2, torch.float32, 4, 8, ctas=72, planes_per_chunk=4, source="test")
    g = geom((3, 16, 4, 8), 2, torch.float32)
    assert choose_plan(g, gpu="T100", window_bytes=2 * g.plane_bytes, table=(row,)).plan == Plan(72, 2, 16, True)
    assert choose_plan(g, gpu="T100", window_bytes=10 * g.plane_bytes, table=(row,)).plan == Plan(72, 3, 16, True)


def test_tuned_declines_window_when_one_row_does_not_fit():
    """Sub-plane chunking cannot go below one S_local row: a smaller window declines WINDOW."""
    row = TunedRow("T100", 2, torch.float32, 4, 8, ctas=72, planes_per_chunk=1, source="test")
    g = geom((3, 16, 4, 8), 2, torch.float32)
    choice = choose_plan(g, gpu="T100", window_bytes=g.row_bytes - 1, table=(row,))
    assert choice.plan is None and choice.reason is DeclineReason.WINDOW


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.int32])
def test_dtype_the_kernel_does_not_move_declines(dtype):
    """Only bf16/fp16/fp32 are moved by the kernel; anything else declines DTYPE before any table lookup."""
    choice = choose_plan(geom((3, 16, 8, 8), 2, dtype), gpu="GB200")
    assert choice.plan is None and choice.reason is DeclineReason.DTYPE


@pytest.mark.parametrize("world_size", [1, 16])
def test_world_size_outside_2_to_8_declines(world_size):
    """SP sizes outside 2..8 decline WORLD_SIZE (the device communicator is built for that range)."""
    choice = choose_plan(geom((3, 16, 16, 8), world_size), gpu="GB200")
    assert choice.plan is None and choice.reason is DeclineReason.WORLD_SIZE


def test_invalid_long_training_value_is_an_error():
    with pytest.raises(ValueError, match="long_training"):
        choose_plan(geom((3, 16, 8, 8), 2), gpu="GB200", long_training="always")


@pytest.mark.parametrize(
    "name, expected",
    [("NVIDIA GB200", "GB200"), ("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"), ("gb200", "GB200"),
     ("NVIDIA_H200-NVL", "H200"), ("", "")],
)
def test_gpu_name_normalisation(name, expected):
    """torch's device names map onto the table's model names."""
    assert normalize_gpu_name(name) == expected


def test_lookup_matches_on_all_five_key_fields():
    """Only GB200/SP4/bf16/H56/D128 hits the measured row; changing any one key misses."""
    g = geom(H3_SP4_250K, 4)
    assert lookup(policy.TUNED_TABLE, "NVIDIA GB200", g) is not None
    assert lookup(policy.TUNED_TABLE, "NVIDIA H200", g) is None
    assert lookup(policy.TUNED_TABLE, "GB200", geom(H3_SP4_250K, 4, torch.float16)) is None
    assert lookup(policy.TUNED_TABLE, "GB200", geom((3, 62500, 48, 128), 4)) is None
    assert lookup(policy.TUNED_TABLE, "GB200", geom((3, 62500, 56, 64), 4)) is None
    assert lookup(policy.TUNED_TABLE, "GB200", geom((3, 125000, 56, 128), 2)) is None


# ------------------------------------------------------------------------------------- plans and geometry


@pytest.mark.parametrize(
    "plan",
    [Plan(36, 3, 62500, False), Plan(144, 1, 74898, True), Plan(1, 1, 1, False),
     Plan((1 << 10) - 1, (1 << 16) - 1, (1 << 35) - 1, True), Plan(132, 1, 37800, True, engine="ce"),
     Plan((1 << 10) - 1, (1 << 16) - 1, (1 << 35) - 1, True, engine="ce")],
)
def test_plan_word_round_trip(plan):
    """Plan.word packs into one non-negative int64 and unpacks to the same plan."""
    assert 0 < plan.word < 1 << 63
    assert Plan.from_word(plan.word) == plan


def test_plan_fields_out_of_range_are_rejected():
    for bad in [(0, 1, 1), (1 << 10, 1, 1), (1, 0, 1), (1, 1 << 16, 1), (1, 1, 0), (1, 1, 1 << 35)]:
        with pytest.raises(ValueError):
            Plan(*bad, tuned=True)
    with pytest.raises(ValueError, match="engine"):
        Plan(1, 1, 1, tuned=True, engine="dma")


def test_copy_engine_rows_double_buffer_the_window():
    """A ``ce`` row's chunks fit half the window (two buffers); the plan says so, and its word carries the engine."""
    geom = Geometry(0, torch.bfloat16, 1, 37800, 40, 128, 2)  # wan720p at SP2: a 387 MB plane
    sm = TunedRow("H200", 2, torch.bfloat16, 40, 128, ctas=132, planes_per_chunk=1, source="test")
    ce = TunedRow("H200", 2, torch.bfloat16, 40, 128, ctas=132, planes_per_chunk=1, source="test", engine="ce")
    window = 512 << 20
    sm_plan = choose_plan(geom, gpu="H200", window_bytes=window, table=[sm]).plan
    ce_choice = choose_plan(geom, gpu="H200", window_bytes=window, table=[ce])
    assert sm_plan is not None and sm_plan.engine == "sm" and sm_plan.num_chunks(geom) == 1
    assert ce_choice.plan is not None and ce_choice.plan.engine == "ce" and "copy engine" in ce_choice.why
    assert ce_choice.plan.num_chunks(geom) == 2 and ce_choice.plan.window_bytes(geom) <= window
    assert Plan.from_word(ce_choice.plan.word) == ce_choice.plan
    assert "copy engine" in ce_choice.plan.describe(geom)


@pytest.mark.parametrize(
    "shape, plan",
    [((3, 16, 4, 8), Plan(36, 3, 16, False)), ((3, 16, 4, 8), Plan(144, 1, 16, True)),
     ((3, 16, 4, 8), Plan(144, 1, 5, True)), ((4, 7, 4, 8), Plan(144, 3, 3, True)),
     ((1, 1, 4, 8), Plan(8, 2, 9, True))],
)
def test_plan_chunks_cover_every_row_of_every_plane_exactly_once(shape, plan):
    """Chunks tile the [B, S_local] grid with no gap and no overlap, in launch order, and match num_chunks."""
    g = geom(shape, 2, torch.float32)
    seen = torch.zeros(g.B, g.S, dtype=torch.int64)
    chunks = list(plan.chunks(g))
    for p0, p1, r0, r1 in chunks:
        assert p0 < p1 <= g.B and r0 < r1 <= g.S
        assert (p1 - p0) * (r1 - r0) * g.row_bytes <= plan.window_bytes(g)
        seen[p0:p1, r0:r1] += 1
    assert torch.equal(seen, torch.ones_like(seen))
    assert len(chunks) == plan.num_chunks(g)


def test_mode1_geometry_is_the_inverse_of_mode0():
    """Mode 1 input [B, S_global, H/P, D] maps to the same (S_local, global H) as mode 0's input."""
    g0 = geom(H3_SP4_250K, 4, mode=0)
    g1 = geom((3, 250000, 14, 128), 4, mode=1)
    assert (g1.B, g1.S, g1.H, g1.D, g1.mode) == (3, 62500, 56, 128, 1)
    assert g1.plane_bytes == g0.plane_bytes and g1.row_bytes == g0.row_bytes
    assert choose_plan(g1, gpu="GB200").plan == choose_plan(g0, gpu="GB200").plan


def test_chosen_plans_always_fit_their_window():
    """Property over a grid: whatever plan the policy picks, its largest chunk fits the window."""
    row = TunedRow("T100", 2, torch.float32, 4, 8, ctas=144, planes_per_chunk=2, source="test")
    for s in (1, 3, 16, 33):
        for b in (1, 3, 4):
            g = geom((b, s, 4, 8), 2, torch.float32)
            for window in (g.row_bytes, 3 * g.row_bytes + 1, g.plane_bytes, g.operand_bytes, 1 << 20):
                for table in ((), (row,)):
                    choice = choose_plan(g, gpu="T100", window_bytes=window, table=table)
                    assert (choice.plan is None) == (choice.reason is not None)
                    if choice.plan is not None:
                        assert choice.plan.window_bytes(g) <= window


# ------------------------------------------------------------------------------------- contract


def votes(rows: int = 2, **fields: list[int] | int) -> torch.Tensor:
    """[rows, 12] votes that agree on everything and run a plan, with per-field overrides (list = per rank)."""
    plan = Plan(144, 1, 16, True)
    base = [0] * NUM_FIELDS
    base[Field.HEADER], base[Field.DTYPE] = header(1), DTYPE_CODES[torch.float32]
    base[Field.MODE_PHASE] = mode_phase(0, Phase.FORWARD_NO_GRAD)
    base[Field.B], base[Field.S], base[Field.H], base[Field.D] = 3, 32, 4, 8
    base[Field.WINDOW_BYTES], base[Field.PLAN] = 1536, plan.word
    out = torch.tensor([base] * rows, dtype=torch.int64)
    for name, value in fields.items():
        out[:, Field[name]] = torch.tensor(value if isinstance(value, list) else [value] * rows)
    return out


def test_contract_wire_format_is_frozen():
    """Exactly 12 int64 fields in this order (v4); the header packs CONTRACT_VERSION and the generation, MODE_PHASE
    the mode and the phase; ELIGIBILITY and PLAN stay at 2 and 11 (where the library's fvk_vote_would_run reads
    them); MODE and PHASE are names for MODE_PHASE's parts, never wire slots."""
    assert NUM_FIELDS == 12 and [f.value for f in WIRE_FIELDS] == list(range(12))
    assert [f.name for f in WIRE_FIELDS] == ["HEADER", "SEQ", "ELIGIBILITY", "MODE_PHASE", "DTYPE", "B", "S", "H",
                                             "D", "SPLITS", "WINDOW_BYTES", "PLAN"]
    assert (Field.ELIGIBILITY, Field.PLAN) == (2, 11) and Field.MODE >= NUM_FIELDS and Field.PHASE >= NUM_FIELDS
    assert CONTRACT_VERSION == 4
    assert header(7) >> 32 == CONTRACT_VERSION and header(7) & 0xFFFFFFFF == 7
    assert mode_phase(1, Phase.BACKWARD) == 1 | 2 << 4 and mode_phase(0, Phase.FORWARD_GRAD) == 16
    row = fields(5, 9, 0, 1, torch.bfloat16, (2, 37, 12, 64), Phase.BACKWARD, 4096, 77, splits=123)
    assert row == [header(5), 9, 0, 1 | 2 << 4, DTYPE_CODES[torch.bfloat16], 2, 37, 12, 64, 123, 4096, 77]
    assert {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}.items() <= DTYPE_CODES.items()
    assert len(set(DTYPE_CODES.values())) == len(DTYPE_CODES)


def test_decide_all_agree_runs_the_plan():
    d = decide(votes(4))
    assert d.verdict is Verdict.RUN and Plan.from_word(d.plan_word) == Plan(144, 1, 16, True)


@pytest.mark.parametrize("field", MUST_MATCH, ids=lambda f: f.name)
def test_decide_raises_naming_the_field_and_per_rank_values(field):
    """A MUST_MATCH field that differs is a caller bug: RAISE, naming the field and every rank's value (MODE_PHASE
    names its mode part, which differs here)."""
    v = votes(3)
    v[2, field] += 1
    d = decide(v)
    assert d.verdict is Verdict.RAISE and isinstance(d.error, ContractMismatchError)
    named = Field.MODE if field is Field.MODE_PHASE else field
    expected = [value & 15 for value in v[:, field].tolist()] if named is Field.MODE else v[:, field].tolist()
    assert d.error.field is named and d.error.values == expected
    message = str(d.error)
    assert f"field {named.name} " in message and "rank 0:" in message and "rank 2:" in message


def test_decide_names_phase_when_only_the_phase_differs_and_mode_first():
    """MODE_PHASE is decoded: the phase alone differing names PHASE with phase names; mode and phase both
    differing names MODE (checked first)."""
    grad, no_grad = mode_phase(0, Phase.FORWARD_GRAD), mode_phase(0, Phase.FORWARD_NO_GRAD)
    err = decide(votes(MODE_PHASE=[grad, no_grad])).error
    assert err.field is Field.PHASE and err.values == [1, 0]
    assert "field PHASE" in str(err) and "forward_grad" in str(err) and "forward_no_grad" in str(err)
    err = decide(votes(MODE_PHASE=[grad, mode_phase(1, Phase.BACKWARD)])).error
    assert err.field is Field.MODE and err.values == [0, 1]


def test_decide_dtype_and_phase_errors_are_readable():
    """DTYPE values print as torch dtypes, PHASE values as phase names."""
    dtype_err = decide(votes(DTYPE=[DTYPE_CODES[torch.float32], DTYPE_CODES[torch.bfloat16]])).error
    assert "torch.float32" in str(dtype_err) and "torch.bfloat16" in str(dtype_err)
    # Dtypes outside the wire table (voted as a digest of their name) print by name too.
    from fastvideo.distributed.ulysses.contract import dtype_code

    named = decide(votes(DTYPE=[dtype_code(torch.complex64), dtype_code(torch.uint64)])).error
    assert "rank 0: torch.complex64, rank 1: torch.uint64" in str(named)
    phases = [mode_phase(0, Phase.FORWARD_GRAD), mode_phase(0, Phase.FORWARD_NO_GRAD)]
    phase_err = decide(votes(MODE_PHASE=phases)).error
    assert "forward_grad" in str(phase_err) and "forward_no_grad" in str(phase_err)


def test_decide_eligibility_disagreement_declines_together():
    """One rank with a decline bit, the other without: every rank declines PEER_DISAGREEMENT."""
    d = decide(votes(ELIGIBILITY=[0, DeclineReason.ALIGNMENT.bit]))
    assert d.verdict is Verdict.DECLINE and d.reason is DeclineReason.PEER_DISAGREEMENT


def test_decide_common_bit_declines_with_that_reason():
    """Every rank has the same bit: decline with that reason (the lowest, when several)."""
    assert decide(votes(ELIGIBILITY=DeclineReason.TORCH_COMPILE.bit)).reason is DeclineReason.TORCH_COMPILE
    both = DeclineReason.WINDOW.bit | DeclineReason.DTYPE.bit
    assert decide(votes(ELIGIBILITY=both)).reason is DeclineReason.DTYPE


@pytest.mark.parametrize("field", [Field.WINDOW_BYTES, Field.PLAN], ids=lambda f: f.name)
def test_decide_plan_or_window_disagreement_declines(field):
    v = votes(2)
    v[1, field] += 1
    d = decide(v)
    assert d.verdict is Verdict.DECLINE and d.reason is DeclineReason.PEER_DISAGREEMENT


def test_decide_eligible_without_plan_never_runs():
    d = decide(votes(PLAN=0, WINDOW_BYTES=0))
    assert d.verdict is Verdict.DECLINE and d.reason is DeclineReason.WINDOW


def test_decide_rejects_malformed_votes():
    with pytest.raises(ValueError):
        decide(torch.zeros(2, 11, dtype=torch.int64))


def test_decline_reason_bits_round_trip():
    """Each reason is one distinct bit; reasons_from_bits recovers any set of them in enum order."""
    assert len({r.bit for r in DeclineReason}) == len(DeclineReason)
    chosen = [DeclineReason.DTYPE, DeclineReason.WINDOW, DeclineReason.CONSTRUCTION_FAILED]
    assert reasons_from_bits(sum(r.bit for r in chosen)) == chosen
    assert all(r.label == r.name.lower() for r in DeclineReason)


# ------------------------------------------------------------------------------------- env registry


def test_env_invalid_choice_names_the_variable_and_choices():
    with envs.override(FASTVIDEO_ULYSSES_A2A_LONG_TRAINING="sometimes"), pytest.raises(ValueError) as info:
        envs.get("FASTVIDEO_ULYSSES_A2A_LONG_TRAINING")
    assert "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING" in str(info.value) and "auto, chunked" in str(info.value)


def test_env_override_restores_previous_values():
    import os

    before = os.environ.get("FASTVIDEO_ULYSSES_A2A")
    with envs.override(FASTVIDEO_ULYSSES_A2A="auto"):
        assert envs.get("FASTVIDEO_ULYSSES_A2A") == "auto"
        with envs.override(FASTVIDEO_ULYSSES_A2A=None):
            assert envs.get("FASTVIDEO_ULYSSES_A2A") == "off"  # the default
    assert os.environ.get("FASTVIDEO_ULYSSES_A2A") == before


# ------------------------------------------------------------------------------------- hashing


def test_geometry_and_plan_hash_their_fields_once_and_never_pickle_the_hash():
    """Both key per-call dicts (the transport's launches, the stats): equal objects hash alike, the hash is kept on
    the object after its first use, and a pickled copy carries none (a str's hash differs between processes)."""
    import copy
    import dataclasses
    import pickle

    g, p = geom((1, 64, 8, 16), 2), Plan(144, 1, 64, True)
    assert hash(g) == hash(geom((1, 64, 8, 16), 2)) and {(g, p): 1}[(geom((1, 64, 8, 16), 2), Plan(144, 1, 64, True))]
    assert "_hash" in g.__dict__ and "_hash" in p.__dict__
    assert hash(g) != hash(geom((1, 64, 8, 16), 4)) and hash(p) != hash(Plan(144, 1, 32, True))
    for obj in (g, p):
        clone = pickle.loads(pickle.dumps(obj))
        assert clone == obj and "_hash" not in clone.__dict__ and hash(clone) == hash(obj)
        assert copy.deepcopy(obj) == obj
    assert hash(dataclasses.replace(p, ctas=12)) == hash(Plan(12, 1, 64, True))
