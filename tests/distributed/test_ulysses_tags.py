"""Call-site tags (``tag=`` on the public op, the ``torch.library`` op, ``ops.all_to_all`` and the helper's entry
points): a tagged call's SEQ field is its tag's own per-phase count (``contract.tag_seq``), so a rank that skips or
repeats a tagged call raises ``ContractMismatchError`` on every rank naming the tag, where calls of one shape would
otherwise pair with the wrong peer calls and move wrong data silently.

On gloo ranks at P = 2 and 3, in checked mode on the ``off`` route (the checked-off helper votes) and on the CPU
fused route (``auto`` with ``GlooPlanTransport``):

* a skipped and a repeated tagged call raise on every rank, the same message everywhere naming both ranks' tags and
  counts and the hint "a rank skipped or repeated a call tagged ..."; the calls before ran the expected route and
  plan (asserted from the helper's records, tags included), bit-exact; a matching call after the error is exact
  (no rank was left inside a collective, and the raised call was not counted for its tag on any rank);
* the negative control: the same tagged sequence with no fault passes, bit-exact against the NCCL route;
* untagged calls behave as before: the same skip is not seen, and the skipping rank's next call returns the data
  of the peers' skipped call (asserted bit for bit: what tags are for);
* the backward carries its forward's tag with a count of its own (phase BACKWARD); the digest is computed once per
  tag, never per call;
* ``DistributedAttention``: two layers with different prefixes, one rank skipping the first layer, raises on every
  rank naming both layers' tags; without the skip, every call is recorded with its layer's tag, backward included;
* ``torch.compile(fullgraph=True)``: the tag is a constant of the graph (the same tag), one frame, and a compiled
  skip raises on every rank;
* a tag that is not a non-empty str raises before any collective from every entry point.
"""

from __future__ import annotations

import pytest
import torch

from fastvideo.distributed.all_to_all import check_tag
from fastvideo.distributed.ulysses import contract
from fastvideo.distributed.ulysses.contract import ContractMismatchError, Field, Phase
from tests.distributed.conftest import SHM_VOTE_ENV, SHM_VOTE_SKIP, bit_equal, build_helper, rank_input

A2A, CHECKED = "FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_CHECKED"
TIMEOUTS = {"FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"}
ROUTES = {  # route -> the ranks' environment
    "checked": {A2A: "off", CHECKED: "1", **TIMEOUTS},  # the off route's checker votes every call
    "fused": {A2A: "auto", CHECKED: "0", **TIMEOUTS},  # the CPU fused route votes without checked mode
    # The fused route over the same-host shared-memory vote, through the voted launch (the library's verdict
    # first, as the native transport's hot path: fvk_vote_would_run refuses any table whose rows differ).
    "voted-shm": {A2A: "auto", CHECKED: "0", **TIMEOUTS, **SHM_VOTE_ENV},
}
VOTED_SHM = pytest.param("voted-shm", marks=pytest.mark.skipif(SHM_VOTE_SKIP is not None, reason=SHM_VOTE_SKIP or ""))
SHAPE = (2, 4, 12, 8)  # [B, S_local, H, D]: H = 12, D = 8 have the CPU fixture's tuned rows (fused, 144 CTAs)
TAGS = ("blocks.0.attn.qkv", "blocks.1.attn.qkv", "blocks.2.attn.qkv", "blocks.3.attn.qkv")


def _got(exc: BaseException) -> tuple:
    field = getattr(exc, "field", None)
    return (type(exc).__name__, str(exc), field.name if field is not None else None, list(getattr(exc, "tags", ())))


def _route(route: str):
    """The helper the route's calls vote through (installed for ``fused``, the checked-off one for ``checked``)."""
    from fastvideo.distributed.ulysses import registry

    if route == "voted-shm":
        from tests.distributed.test_ulysses_shm_vote import voted_transport

        registry.install_default_helper(build_helper(vote="shm", transport=voted_transport()))
        return registry.current_default_helper()
    if route == "fused":
        registry.install_default_helper(build_helper())
        return registry.current_default_helper()
    registry.route()  # resolves the checked-off helper (collective, on every rank alike)
    return registry.current_checked_off_helper()


def _schedule(rank: int, world: int, fault: str) -> list[int]:
    """Indices into TAGS this rank calls: the last rank skips index 1, or repeats it, or does as the others."""
    if rank != world - 1 or fault == "none":
        return [0, 1, 2, 3]
    return {"skip": [0, 2, 3], "repeat": [0, 1, 1, 2, 3], "skip+extra": [0, 2, 3, 3]}[fault]


def _expected(x_of, mode: int = 0):
    """What this rank must get when every rank passes ``x_of(rank)``: the NCCL route computed locally."""
    from fastvideo.distributed.all_to_all import reference_all_to_all
    from fastvideo.distributed.parallel_state import get_sp_group

    sp = get_sp_group()
    return reference_all_to_all([x_of(r) for r in range(sp.world_size)], mode)[sp.rank_in_group]


def _tagged_sequence(rank, world, route, fault, tagged=True):
    """Call TAGS in this rank's schedule (input k seeded by its tag's index); stop at the first error, then make one
    matching call tagged ``after``. Returns (per call: index, outcome, exact, record), the error, the after call's
    exactness and record, and the helper's per-tag counts."""
    from fastvideo.distributed.communication_op import nccl_route
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op
    from fastvideo.distributed.parallel_state import get_sp_group

    helper = _route(route)
    calls, error = [], None
    for k in _schedule(rank, world, fault):
        x = rank_input(rank, SHAPE, seed=k)
        try:
            y = op(x, 2, 1, tag=TAGS[k] if tagged else None)
        except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
            error = _got(exc)
            break
        rec = helper.history[-1]
        intended = _expected(lambda r, k=k: rank_input(r, SHAPE, seed=k))
        reason = rec.reason.label if rec.reason is not None else None  # DISABLED is 0: test for None
        calls.append((k, bit_equal(y, intended), bit_equal(y, nccl_route(x, 0, get_sp_group().device_group)),
                      (rec.route, rec.plan.word if rec.plan else 0, reason, rec.phase.name, rec.tag), y))
    x = rank_input(rank, SHAPE, seed=9)
    after = op(x, 2, 1, tag="after" if tagged else None)
    after_ok = bit_equal(after, _expected(lambda r: rank_input(r, SHAPE, seed=9)))
    rec = helper.history[-1]
    counts = {t: list(c) for t, c in helper.stats()["tag_counts"].items()}
    from fastvideo.distributed.ulysses.policy import Geometry

    choice = helper.plan_for(Geometry.from_input(SHAPE, 0, world, torch.float32), grad=False)
    word = choice.plan.word if choice.plan is not None else 0
    # Tensors do not travel back to the parent: exactness flags only (and the faulty rank's wrong data, untagged).
    peer_data = None
    if not tagged and rank == world - 1 and fault == "skip+extra":
        # Its call for index 2 (its second) met the peers' index 1 call: its data, bit for bit.
        mixed = _expected(lambda r: rank_input(r, SHAPE, seed=1 if r != world - 1 else 2))
        peer_data = bit_equal(calls[1][4], mixed)
    stats = helper.stats()
    voted = (stats["vote"], stats["voted_launch"], helper.transport.voted) if route == "voted-shm" else None
    return ([c[:4] for c in calls], error, after_ok, (rec.route, rec.tag), counts, word, peer_data, voted)


def _record(route: str, word: int, tag: str | None) -> tuple:
    if route != "checked":
        return ("fused", word, None, "FORWARD_NO_GRAD", tag)
    return ("nccl", 0, "disabled", "FORWARD_NO_GRAD", tag)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("route", ["checked", "fused", VOTED_SHM])
@pytest.mark.parametrize("fault", ["skip", "repeat", "none"])
def test_a_skipped_or_repeated_tagged_call_raises_on_every_rank(ranks, world, route, fault):
    """The last rank skips (or repeats) the second of four same-shape tagged calls: every rank raises
    ContractMismatchError on SEQ at the first call that differs, the same message everywhere naming each rank's tag
    and count and "a rank skipped or repeated a call tagged ..."; the calls before it ran the expected plan, exact.
    ``none`` is the negative control: no error, every call exact against the NCCL route. ``voted-shm``: the same
    over the shared-memory vote through the voted launch, whose library verdict declines to launch every mismatch
    (every call went through it: one voted exchange per call)."""
    results = ranks(world, _tagged_sequence, route, fault, env=ROUTES[route], timeout_s=120)
    messages = set()
    for rank, (calls, error, after_ok, after, counts, word, _, voted) in enumerate(results):
        assert after_ok and after == ("nccl" if route == "checked" else "fused", "after")
        if route == "voted-shm":
            assert voted == ("shm", True, len(calls) + 1 + (error is not None)), voted
        for k, intended, oracle_ok, record in calls:
            assert intended and oracle_ok, (rank, k)
            assert record == _record(route, word, TAGS[k]), (rank, k, record)
        if fault == "none":
            assert error is None and [c[0] for c in calls] == [0, 1, 2, 3]
            assert counts == {**{t: [1, 0, 0] for t in TAGS}, "after": [1, 0, 0]}
            continue
        kind, message, field, tags = error
        assert (kind, field) == ("ContractMismatchError", "SEQ"), message
        # skip: the last rank's index 2 met the others' index 1; repeat: its second index 1 met their index 2
        faulty_at, others_at = {"skip": ((2, 0), (1, 0)), "repeat": ((1, 1), (2, 0))}[fault]
        assert [c[0] for c in calls] == ([0] if fault == "skip" else [0, 1])  # the calls before the error
        for r in range(world):
            at = faulty_at if r == world - 1 else others_at
            assert f"rank {r}: tag {TAGS[at[0]]!r}, forward_no_grad call {at[1]}" in message, message
        assert sorted(tags) == sorted({TAGS[faulty_at[0]], TAGS[others_at[0]]})
        assert "a rank skipped or repeated a call tagged " in message
        assert f"{TAGS[1]!r}" in message and f"{TAGS[2]!r}" in message
        messages.add(message)
        # The raised call was not counted for its tag: the counts are those of the calls that ran.
        ran = {TAGS[k]: [sum(1 for c in calls if c[0] == k), 0, 0] for k in {c[0] for c in calls}}
        assert {t: c for t, c in counts.items() if any(c)} == {**ran, "after": [1, 0, 0]}, counts
    if fault != "none":
        assert len(messages) == 1  # the same message on every rank


@pytest.mark.parametrize("route", ["checked", "fused"])
def test_untagged_calls_behave_as_before_a_skip_is_not_seen(ranks, route):
    """The documented limit of untagged calls: the last rank skips index 1 and makes one more call at the end (so
    that no rank waits): no error on any rank, every rank's untagged SEQ moved alike, and its call for index 2
    returned the data of the peers' index 1 call, bit for bit. The same schedule tagged raises (above)."""
    results = ranks(2, _tagged_sequence, route, "skip+extra", False, env=ROUTES[route], timeout_s=120)
    for rank, (calls, error, after_ok, after, counts, word, peer_data, _) in enumerate(results):
        assert error is None and after_ok and counts == {} and after[1] is None
        assert all(record == _record(route, word, None) for *_, record in calls)
        # Rank 1 called indices 0, 2, 3, 3 against rank 0's 0, 1, 2, 3: the middle two pairs moved wrong data,
        # silently, on both ranks (the last pair happens to match again).
        assert [c[0] for c in calls] == ([0, 2, 3, 3] if rank == 1 else [0, 1, 2, 3])
        assert [c[1] for c in calls] == [True, False, False, True]
        assert peer_data is (True if rank == 1 else None)


# ------------------------------------------------------------------------------------- backward, counts, digest


def _backward(rank, world):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op

    digests = []
    real = contract.tag_bases

    def counting(tag):
        digests.append(tag)
        return real(tag)

    contract.tag_bases = counting  # the helper hashes through contract.tag_bases: count the calls
    helper = _route("fused")
    exact = []
    for step in range(3):
        x = rank_input(rank, SHAPE, seed=step, requires_grad=True)
        y = op(x, 2, 1, tag="a.qkv")
        z = op(y * 2, 1, 2, tag="a.out")
        (z * 3).sum().backward()
        exact.append(bit_equal(z, 2 * x.detach()) and bool(torch.all(x.grad == 6)))
    records = [(r.phase.name, r.mode, r.route, r.tag) for r in helper.history]
    counts = {t: list(c) for t, c in helper.stats()["tag_counts"].items()}
    return exact, records, counts, digests, helper.stats()["tags"]


def test_the_backward_carries_the_tag_with_a_count_of_its_own_and_the_digest_is_computed_once(ranks):
    """Three forward + backward steps of two tagged calls on the fused route: the backward calls carry their
    forward's tag in phase BACKWARD, each phase counting on its own ([0, 3, 3] per tag); two tags, hashed once each
    for 12 calls."""
    for exact, records, counts, digests, tags in ranks(2, _backward, env=ROUTES["fused"], timeout_s=120):
        assert exact == [True] * 3
        step = [("FORWARD_GRAD", 0, "fused", "a.qkv"), ("FORWARD_GRAD", 1, "fused", "a.out"),
                ("BACKWARD", 0, "fused", "a.out"), ("BACKWARD", 1, "fused", "a.qkv")]
        assert records == step * 3
        assert counts == {"a.qkv": [0, 3, 3], "a.out": [0, 3, 3]}
        assert digests == ["a.qkv", "a.out"] and tags == 2


# ------------------------------------------------------------------------------------- DistributedAttention


def _attention(rank, world, route, skip):
    from fastvideo.attention.layer import DistributedAttention

    helper = _route(route)
    layers = [DistributedAttention(6, 8, prefix=f"blocks.{i}.attn") for i in range(2)]
    untagged = DistributedAttention(6, 8)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float32).requires_grad_() for _ in range(3))
    try:
        out = (q, k, v)
        for i, layer in enumerate(layers):
            if skip and rank == world - 1 and i == 0:
                continue  # this rank skips the first layer's call
            out = layer(*out)[0], k, v
        out[0].sum().backward()
        error = None
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        error = _got(exc)
    untagged(q.detach(), k.detach(), v.detach())
    records = [(r.phase.name, r.tag) for r in helper.history]
    return error, records, layers[0].tags, untagged.tags


@pytest.mark.parametrize("route", ["checked", "fused"])
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_attention_tags_its_calls_and_a_skipped_layer_raises_on_every_rank(ranks, route, world):
    """Two layers of one shape, prefixes blocks.0.attn and blocks.1.attn: the last rank skips the first layer, and
    every rank raises at its first call, naming both layers' qkv tags. An empty prefix leaves the calls untagged."""
    results = ranks(world, _attention, route, True, env=ROUTES[route], timeout_s=120)
    messages = set()
    for rank, (error, records, tags, untagged) in enumerate(results):
        assert tags == {"qkv": "blocks.0.attn.qkv", "out": "blocks.0.attn.out"}
        assert untagged == {"qkv": None, "out": None}
        kind, message, field, named = error
        assert (kind, field) == ("ContractMismatchError", "SEQ"), message
        mine = "blocks.1.attn.qkv" if rank == world - 1 else "blocks.0.attn.qkv"
        assert f"rank {rank}: tag {mine!r}, forward_grad call 0" in message
        assert "a rank skipped or repeated a call tagged 'blocks." in message
        assert sorted(named) == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
        # Nothing ran before the error; the untagged layer's two calls ran after it (every rank in step).
        assert records == [("FORWARD_NO_GRAD", None)] * 2
        messages.add(message)
    assert len(messages) == 1


def test_distributed_attention_without_a_skip_records_every_call_with_its_layers_tag(ranks):
    """The control: forward and backward of the two layers, every call recorded with its layer's and role's tag
    (the backward in reverse order), then the untagged layer's two calls."""
    for error, records, _, _ in ranks(2, _attention, "fused", False, env=ROUTES["fused"], timeout_s=120):
        assert error is None
        fwd = [("FORWARD_GRAD", f"blocks.{i}.attn.{role}") for i in (0, 1) for role in ("qkv", "out")]
        bwd = [("BACKWARD", tag) for _, tag in reversed(fwd)]
        assert records == fwd + bwd + [("FORWARD_NO_GRAD", None)] * 2


# ------------------------------------------------------------------------------------- torch.compile


def _compiled(rank, world):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op

    helper = _route("fused")
    seen = []

    def f(x):
        y = op(x, 2, 1, tag="c.qkv")
        return op(y * 2, 1, 2, tag="c.out")

    inner = CompileCounterWithBackend("aot_eager")

    def backend(gm, example_inputs):
        seen.extend(n.kwargs.get("tag") for n in gm.graph.nodes
                    if n.op == "call_function" and "ulysses_all_to_all_4d" in str(n.target))
        return inner(gm, example_inputs)

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    exact = []
    for seed in range(2):
        x = rank_input(rank, SHAPE, seed=seed, requires_grad=True)
        out = compiled(x)
        (gx,) = torch.autograd.grad(out.sum(), x)
        exact.append(bit_equal(out, 2 * x.detach()) and bool(torch.all(gx == 2)))
    records = [(r.phase.name, r.tag) for r in helper.history]

    # A compiled skip: the last rank's compiled function leaves out the first call.
    def g(x):
        if rank == world - 1:
            return op(x, 2, 1, tag="d.second")
        return op(op(x, 2, 1, tag="d.first"), 1, 2, tag="d.second")

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(g, backend="aot_eager", fullgraph=True)(rank_input(rank, SHAPE, seed=3))
        error = None
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        error = _got(exc)
    return exact, seen, inner.frame_count, records, error


def test_fullgraph_compile_keeps_the_tag_as_a_constant_and_a_compiled_skip_raises(ranks):
    """``torch.compile(fullgraph=True)``: one frame for two calls, each op node carrying its tag as a constant;
    forward and backward exact, every call recorded with its tag (the backward's too); a rank whose compiled
    function skips the first of two tagged calls raises on every rank, naming the tags."""
    for exact, seen, frames, records, error in ranks(2, _compiled, env=ROUTES["fused"], timeout_s=240):
        assert exact == [True, True] and frames == 1
        assert seen == ["c.qkv", "c.out"]
        step = [("FORWARD_GRAD", "c.qkv"), ("FORWARD_GRAD", "c.out"), ("BACKWARD", "c.out"), ("BACKWARD", "c.qkv")]
        assert records == step * 2
        kind, message, field, tags = error
        assert (kind, field) == ("ContractMismatchError", "SEQ"), message
        assert sorted(tags) == ["d.first", "d.second"] and "a rank skipped or repeated a call tagged" in message


# ------------------------------------------------------------------------------------- entry points


def _entries(rank, world, bad):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses import ops

    h = build_helper()
    x = rank_input(rank, SHAPE)
    comm = get_sp_group().device_communicator
    calls = {
        "public op": lambda: op(x, 2, 1, tag=bad),
        "helper.all_to_all": lambda: h.all_to_all(x, 0, tag=bad),
        "try_all_to_all_4D": lambda: h.try_all_to_all_4D(x, 2, 1, tag=bad),
        "ops.all_to_all": lambda: ops.all_to_all(x, 0, helper=h, tag=bad),
        "the op": lambda: torch.ops.fastvideo.ulysses_all_to_all_4d(x, 0, False, None, h.id, tag=bad),
        "all_to_all_4D": lambda: comm.all_to_all_4D(x, 2, 1, tag=bad),
    }
    got = {}
    for name, call in calls.items():
        try:
            call()
            got[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
            got[name] = (type(exc).__name__, str(exc))
    good = [h.try_all_to_all_4D(x, 2, 1, tag="t.try") is not None, h.all_to_all(x, 0, tag="t.helper") is not None,
            bit_equal(comm.all_to_all_4D(x, 2, 1, tag="t.comm"), _expected(lambda r: rank_input(r, SHAPE)))]
    return got, h.stats()["calls"], [r.tag for r in h.history], good


@pytest.mark.parametrize("bad", [3, ""], ids=["int", "empty"])
def test_a_tag_that_is_not_a_non_empty_str_raises_before_any_collective_from_every_entry_point(ranks, bad):
    """Every entry point refuses ``tag=3`` (TypeError; the op's schema refuses it at the dispatcher) and ``tag=''``
    (ValueError) on every rank before any collective: the helper counted no call. Good tags pass through the
    helper's entry points (recorded) and ``all_to_all_4D`` (the NCCL route, which never votes)."""
    for got, calls, tags, good in ranks(2, _entries, bad, env={A2A: "off", CHECKED: "0"}, timeout_s=60):
        for name, outcome in got.items():
            assert outcome != "ok", name
            kind, message = outcome
            if bad == "":
                assert kind == "ValueError" and "tag='' is empty" in message, (name, outcome)
            elif name == "the op":
                assert kind in ("TypeError", "RuntimeError"), outcome
            else:
                assert kind == "TypeError" and "tag=3 must be a str" in message, (name, outcome)
        assert calls == 2 and tags == ["t.try", "t.helper"] and good == [True, True, True]


# ------------------------------------------------------------------------------------- pure: the SEQ word


def test_tag_seq_words_are_distinct_per_tag_phase_and_count_and_never_an_untagged_count():
    """For one tag, (phase, count) -> word is injective (phase in bits 60-61, count in 0-59); every word has bit 62
    set (an untagged count never does) and is a positive int64; the bases are the words of call 0; other tags'
    words differ."""
    words = {contract.tag_seq("blocks.0.attn.qkv", p, n) for p in Phase for n in range(2000)}
    assert len(words) == 3 * 2000
    assert all(w & contract.TAGGED and 0 < w < 1 << 63 for w in words)
    assert all(contract.is_tagged(w) for w in words) and not contract.is_tagged(123456)
    assert contract.tag_bases("x") == tuple(contract.tag_seq("x", p, 0) for p in Phase)
    others = {contract.tag_seq(f"blocks.{i}.attn.{r}", p, n) for i in range(1, 40) for r in ("qkv", "out")
              for p in Phase for n in range(20)}
    assert len(others) == 39 * 2 * 3 * 20 and not others & words
    assert contract.tag_digest("é") == contract.tag_digest("é")  # stable, UTF-8
    assert contract.tag_digest("a") != contract.tag_digest("b")


def test_the_digests_alone_name_seq_and_say_a_tagged_call_was_skipped_or_repeated():
    """Pure: the verdict on the votes (what every rank sees of the others before the helper exchanges the tags)
    names SEQ, shows each rank's value as a tagged call's digest and says a tagged call was skipped or repeated; an
    untagged mismatch shows the counts and says that a rank made more or fewer calls, and that a tag would name it."""
    rows = torch.zeros(2, contract.NUM_FIELDS, dtype=torch.int64)
    rows[:, Field.HEADER] = contract.header(1)
    rows[0, Field.SEQ] = contract.tag_seq("a", 0, 1)
    rows[1, Field.SEQ] = contract.tag_seq("b", 0, 0)
    err = contract.decide(rows).error
    assert isinstance(err, ContractMismatchError) and err.field is Field.SEQ
    assert f"rank 0: tagged call {rows[0, Field.SEQ].item():#018x}" in str(err)
    assert "a rank skipped or repeated a tagged call" in str(err)
    rows[0, Field.SEQ], rows[1, Field.SEQ] = 1, 0
    err = contract.decide(rows).error
    assert err.field is Field.SEQ and "rank 0: 1, rank 1: 0" in str(err) and "more or fewer calls" in str(err)
    assert "a call-site tag names the call" in str(err)
    named = ContractMismatchError(Field.SEQ, [1, 2], ["tag 'a', forward_no_grad call 1", "untagged call 7"],
                                  tags=["a"], hint=contract.tag_hint(["a"]))
    assert "a rank skipped or repeated a call tagged 'a'" in str(named) and named.tags == ("a",)


def test_check_tag():
    check_tag(None)
    check_tag("blocks.0.attn.qkv")
    with pytest.raises(TypeError, match="tag=b'x' must be a str"):
        check_tag(b"x")
    with pytest.raises(ValueError, match="tag='' is empty"):
        check_tag("")


def test_the_video_dit_names_every_blocks_attention():
    """The package's video DiT gives each block's attention its own prefix: every all-to-all of the model is tagged,
    each tag once."""
    from sp_recipes.video_dit import CONFIGS, VideoDiT

    model = VideoDiT(CONFIGS["tiny"])
    tags = [tag for block in model.blocks for tag in block.attn.tags.values()]
    assert tags == [f"blocks.{i}.attn.{role}" for i in range(len(model.blocks)) for role in ("qkv", "out")]


def _override(rank, world):
    from fastvideo.attention.layer import DistributedAttention
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op

    helper = _route("fused")
    got: list[tuple[str, dict]] = []

    def override(x, scatter_dim, gather_dim, name, **kwargs):  # what a benchmark's stand-in does: record, forward
        got.append((name, dict(kwargs)))
        return op(x, scatter_dim, gather_dim, **kwargs)

    q = rank_input(rank, (2, 4, 6, 8))
    for prefix in ("blocks.0.attn", ""):
        DistributedAttention(6, 8, prefix=prefix, all_to_all=override)(q, q, q)
    return got, [r.tag for r in helper.history]


def test_an_all_to_all_override_gets_the_layers_tag_only_where_it_has_one(ranks):
    """``DistributedAttention``'s override receives ``tag`` only where the layer has a prefix (an override that takes
    no tag keeps serving untagged layers), and what it forwards is voted with that tag."""
    for got, recorded in ranks(2, _override, env=ROUTES["fused"], timeout_s=120):
        assert got == [("qkv", {"tag": "blocks.0.attn.qkv"}), ("out", {"tag": "blocks.0.attn.out"}), ("qkv", {}),
                       ("out", {})]
        assert recorded == ["blocks.0.attn.qkv", "blocks.0.attn.out", None, None]


def test_the_benchmark_dit_names_its_blocks_as_the_video_dit_does():
    """The DiT benchmark's model (its all-to-all an override) tags every call as the package's video DiT would."""
    from benchmarks.dit.model import TokenDiT
    from sp_recipes.video_dit import CONFIGS

    model = TokenDiT(CONFIGS["tiny"], None, lambda x, *a, **k: x)
    assert [t for b in model.blocks for t in b.attn.tags.values()] == [
        f"blocks.{i}.attn.{role}" for i in range(len(model.blocks)) for role in ("qkv", "out")]


def _caller_error(rank, world, route):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as op

    helper = _route(route)
    x = rank_input(rank, SHAPE)
    bad = x.to("meta") if rank == 1 else x  # rank 1's call fails before any collective: voted LOCAL_ERROR
    try:
        op(bad, 2, 1, tag="e.qkv")
        got = None
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        got = type(exc).__name__
    y = op(x, 2, 1, tag="e.qkv")  # the same tag again: every rank's count of it is still 0
    return got, bit_equal(y, _expected(lambda r: rank_input(r, SHAPE))), helper.history[-1].tag, list(
        list(helper.stats()["tag_counts"]["e.qkv"]))


def test_a_tagged_call_that_fails_on_one_rank_is_not_counted_on_any(ranks):
    """Checked mode: rank 1's tagged call fails before any collective (a meta tensor; it votes LOCAL_ERROR and
    raises ValueError, rank 0 raises PeerCallError). Neither rank counts the call for its tag, so the next call
    with that tag matches and runs exactly."""
    results = ranks(2, _caller_error, "checked", env=ROUTES["checked"], timeout_s=60)
    assert [r[0] for r in results] == ["PeerCallError", "ValueError"]
    for _, exact, tag, counts in results:
        assert exact and tag == "e.qkv" and counts == [1, 0, 0]
