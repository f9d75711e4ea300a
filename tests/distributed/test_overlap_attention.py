"""``DistributedAttention(overlap_chunks=N)``: heads in N groups, each group's exchanges in flight under its
neighbours' attention (``DistributedAttention._run_groups``, planned in ``distributed/ulysses/overlap_plan.py``).

* The stream-schedule model: for each consumer, the event it waits on; one wait dropped is flagged.
* Over gloo at P = 2, 3, 4: the pipelined layer's forward and backward against the unpipelined one, with uneven
  sequence shards, head counts the groups and the SP size do not divide, padding and replicated tokens. Exact:
  attention does not mix heads, and SDPA on CPU computes each head alike whatever the number of heads in the call
  (so no tolerance is needed here; none is used). Each rank's gradient of the replicated tokens covers the heads
  it attended, which the grouping changes: their sum over the ranks is compared (a sum of disjoint supports,
  exact). Every run asserts the exchanges the pipeline made (per-group tags, ``async_op=True``); the control shows
  the comparison catches a head grouping put back in the wrong order.
* The agreed setting: a layer without ``overlap_chunks`` follows it; ranks that disagree on it take the smallest
  value together, warning. Ranks that pass different ``overlap_chunks`` raise on every rank wherever the calls vote.
* Errors: a subclass names itself; a batch of 0 is refused before any exchange; the exchanges a pipelined forward
  that raised leaves in flight are released naming where the layer was called, not the layer.
"""

from __future__ import annotations

import pytest
import torch

from fastvideo.distributed.ulysses.overlap_plan import Step, check_chunks, head_groups, schedule, schedule_model
from tests.distributed.conftest import bit_equal, log_lines, rank_input, script_env

OVERLAP = "FASTVIDEO_ULYSSES_A2A_OVERLAP"

# ------------------------------------------------------------------------------------- the schedule model


@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
def test_every_consumer_waits_on_its_own_event(chunks):
    """Each attention waits on its group's q/k/v event, the join on every output event; nothing reads unlanded
    data; and (N > 1) group g+1's q/k/v and group g-1's output exchange are in flight under group g's attention."""
    report = schedule_model(schedule(chunks))
    assert report.unsafe == [] and report.unwaited == []
    for g in range(chunks):
        assert report.waits_on[f"attend {g}"] == f"event qkv{g}"
        assert report.waits_on[f"join out{g}"] == f"event out{g}"
    for g in range(chunks - 1):
        assert f"qkv{g + 1} under attend {g}" in report.overlapped
        assert f"out{g} under attend {g + 1}" in report.overlapped


@pytest.mark.parametrize("dropped", [Step("wait", "qkv", 1), Step("wait", "qkv", 2), Step("wait", "out", 0),
                                     Step("wait", "out", 2)])
def test_one_wait_dropped_is_flagged(dropped):
    """The negative control: without one wait, the consumer of that exchange waits on no event of its own; where no
    later wait covers it on the in-order communication stream (all but output 0, which group 2's q/k/v wait
    covers), it reads unlanded data."""
    steps = [s for s in schedule(3) if s != dropped]
    consumer = f"attend {dropped.group}" if dropped.role == "qkv" else f"join out{dropped.group}"
    report = schedule_model(steps)
    assert consumer in report.unwaited and consumer not in report.waits_on
    assert (consumer in report.unsafe) == (dropped != Step("wait", "out", 0))


def test_a_wait_too_early_loses_the_overlap_but_stays_safe():
    """Waiting for group 1 before group 0's attention is safe but hides nothing under it: the model says so."""
    steps = list(schedule(2))
    steps.remove(Step("wait", "qkv", 1))
    steps.insert(steps.index(Step("attend", "", 0)), Step("wait", "qkv", 1))
    report = schedule_model(steps)
    assert report.unsafe == [] and "qkv1 under attend 0" not in report.overlapped


def test_head_groups_and_bad_chunk_counts():
    assert head_groups(7, 3) == (3, 2, 2) and head_groups(8, 8) == (1,) * 8
    for bad in (-1, 13, 2.0, True):
        with pytest.raises(ValueError, match="overlap_chunks"):
            check_chunks("DistributedAttention", 12, bad)
    assert check_chunks("DistributedAttention", 12, None) is None and check_chunks("DistributedAttention", 12, 0) == 0


# ------------------------------------------------------------------------------------- pipelined against unpipelined


def _layer_pair(rank, p, heads, chunks, replicated, seq_splits, original):
    import torch.distributed as dist

    from fastvideo.attention.layer import DistributedAttention
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D
    from fastvideo.distributed.parallel_state import get_sp_group

    d = 4
    rows = seq_splits[rank] if seq_splits else 5
    q, k, v = (rank_input(rank, (2, rows, heads, d), seed=s, requires_grad=True) for s in (1, 2, 3))
    rep = [rank_input(0, (2, 3, heads, d), seed=s, requires_grad=True) for s in (4, 5, 6)] if replicated else []
    kw = {"seq_splits": seq_splits} if seq_splits else {"original_seq_len": original}
    if rep:
        kw.update(replicated_q=rep[0], replicated_k=rep[1], replicated_v=rep[2])
    calls = []

    def counted(x, sd, gd, name, **kwargs):
        calls.append((name, kwargs.get("tag"), kwargs.get("async_op", False)))
        return sequence_model_parallel_all_to_all_4D(x, sd, gd, **kwargs)

    results = []
    for n in (0, chunks):
        layer = DistributedAttention(heads, d, overlap_chunks=n, prefix="blk", all_to_all=counted)
        out, rep_out = layer(q, k, v, **kw)
        loss = (out * rank_input(rank, out.shape, seed=9)).sum()
        if rep_out is not None:
            loss = loss + (rep_out * rank_input(0, rep_out.shape, seed=10)).sum()
        grads = list(torch.autograd.grad(loss, [q, k, v, *rep]))
        for i in range(3, len(grads)):  # each rank's share of the replicated tokens' gradient: summed over ranks
            dist.all_reduce(grads[i], group=get_sp_group().device_group)
        results.append([out.detach(), *([] if rep_out is None else [rep_out.detach()]), *grads])
    exact = [bit_equal(a, b) for a, b in zip(*results, strict=True)]
    # The control: the pipelined output with its head groups put back in reverse order is not the reference.
    groups = list(results[1][0].split(list(head_groups(heads, chunks)), dim=2))
    control = bit_equal(torch.cat(groups[::-1], dim=2), results[0][0]) if rows else None  # an idle rank: no rows
    return exact, calls, control


CASES = [  # (P, heads, chunks, replicated, seq_splits, original_seq_len)
    (2, 4, 2, False, None, None),
    (2, 6, 4, True, None, 9),  # padding; groups of 2, 2, 1, 1 heads: uneven head splits per group
    (3, 7, 3, True, (4, 0, 6), None),  # an idle rank, uneven shards, 7 heads in groups of 3, 2, 2 over 3 ranks
    (4, 5, 2, True, None, None),  # groups of 3 and 2 heads over 4 ranks: some ranks hold no head of a group
    (4, 8, 4, False, (3, 5, 4, 4), None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"P{c[0]}-H{c[1]}-N{c[2]}")
def test_pipelined_layer_equals_unpipelined_forward_and_backward(ranks, case):
    p, heads, chunks, replicated, seq_splits, original = case
    for exact, calls, control in ranks(p, _layer_pair, heads, chunks, replicated, seq_splits, original,
                                       timeout_s=120):
        assert all(exact), exact
        assert control is not True  # the comparison sees heads in the wrong place
        # the unpipelined layer: two synchronous calls; the pipelined one: 2 per group, async, tagged per group
        assert calls[:2] == [("qkv", "blk.qkv", False), ("out", "blk.out", False)]
        pipelined = calls[2:]
        assert sorted(pipelined) == sorted([(r, f"blk.{r}.g{g}", True) for g in range(chunks) for r in ("qkv", "out")])
        assert pipelined[:2] == [("qkv", "blk.qkv.g0", True), ("qkv", "blk.qkv.g1", True)]  # g1 started before attend 0


def _zero_heads(rank, p, heads, chunks):
    from fastvideo.attention.dense import attention
    from fastvideo.attention.layer import DistributedAttention

    seen = []

    def strict(q, k, v):  # what older torch's CPU SDPA kernel does with no head (SIGFPE), as an error
        if q.shape[2] == 0:
            raise RuntimeError("attention kernel called with no head")
        seen.append(q.shape[2])
        return attention(q, k, v)

    d = 4
    q, k, v = (rank_input(rank, (2, 5, heads, d), seed=s, requires_grad=True) for s in (1, 2, 3))
    rep = [rank_input(0, (2, 3, heads, d), seed=s, requires_grad=True) for s in (4, 5, 6)]
    results, per_layer = [], []
    for n in (0, chunks):
        layer = DistributedAttention(heads, d, overlap_chunks=n, prefix="z", attend=strict)
        out, rep_out = layer(q, k, v, replicated_q=rep[0], replicated_k=rep[1], replicated_v=rep[2])
        loss = (out * rank_input(rank, out.shape, seed=9)).sum() + (rep_out * rank_input(0, rep_out.shape,
                                                                                          seed=10)).sum()
        grads = list(torch.autograd.grad(loss, [q, k, v, *rep]))
        for g in grads[3:]:  # each rank's share of the replicated tokens' gradient: summed over ranks
            torch.distributed.all_reduce(g)
        results.append([out.detach(), rep_out.detach(), *grads])
        per_layer.append(list(seen))
        seen.clear()
    exact = [bit_equal(a, b) for a, b in zip(*results, strict=True)]
    try:  # the control: the strict kernel does refuse an empty head dim
        strict(q[:, :, :0], k[:, :, :0], v[:, :, :0])
        refused = False
    except RuntimeError:
        refused = True
    return exact, per_layer, refused


def test_a_rank_with_no_head_runs_no_attention_kernel_synchronous_and_pipelined(ranks):
    """2 heads over 3 ranks: the synchronous layer gives rank 2 no head; pipelined in 2 groups of 1 head, ranks 1
    and 2 hold no head of either group. Their empty outputs are built without the attention kernel (older torch's
    CPU SDPA dies of SIGFPE on no head; the kernel here refuses it), forward and backward equal, replicated tokens
    included."""
    expected = [[[1], [1, 1]], [[1], []], [[], []]]  # per rank: the head counts the kernel saw, sync then pipelined
    for rank, (exact, per_layer, refused) in enumerate(ranks(3, _zero_heads, 2, 2, timeout_s=120)):
        assert all(exact), (rank, exact)
        assert per_layer == expected[rank]
        assert refused


# ------------------------------------------------------------------------------------- the agreed setting


def _follows_setting(rank, p):
    from fastvideo.attention.layer import DistributedAttention
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D

    calls = []

    def counted(x, sd, gd, name, **kwargs):
        calls.append(kwargs.get("tag"))
        return sequence_model_parallel_all_to_all_4D(x, sd, gd, **kwargs)

    q = rank_input(rank, (1, 3, 4, 2), seed=1)
    DistributedAttention(4, 2, prefix="a", all_to_all=counted)(q, q, q)
    DistributedAttention(4, 2, prefix="b", all_to_all=counted, overlap_chunks=0)(q, q, q)
    return calls


def test_a_layer_follows_the_agreed_setting_unless_told(ranks):
    for calls in ranks(2, _follows_setting, env={OVERLAP: "2"}):
        assert calls == ["a.qkv.g0", "a.qkv.g1", "a.out.g0", "a.out.g1", "b.qkv", "b.out"]


def _agreed_overlap(rank, p):
    from fastvideo.distributed.parallel_state import get_sp_group

    return get_sp_group().settings[OVERLAP], get_sp_group().settings.differing


def _different_chunks(rank, p, prefix):
    from fastvideo.attention.layer import DistributedAttention

    q = rank_input(rank, (1, 3, 4, 2), seed=1)
    try:
        DistributedAttention(4, 2, prefix=prefix, overlap_chunks=2 if rank == 0 else 0)(q, q, q)
    except Exception as exc:  # noqa: BLE001 - the rank's outcome is the result
        return type(exc).__name__, getattr(getattr(exc, "field", None), "name", None), str(exc)
    return None


AUTO = {"FASTVIDEO_ULYSSES_A2A": "auto", "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"}
OFF_CHECKED = {"FASTVIDEO_ULYSSES_A2A": "off", "FASTVIDEO_ULYSSES_A2A_CHECKED": "1",
               "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"}


@pytest.mark.parametrize("env", [AUTO, OFF_CHECKED], ids=["auto", "off-checked"])
@pytest.mark.parametrize("prefix", ["blk", ""], ids=["tagged", "untagged"])
def test_ranks_that_pass_different_overlap_chunks_raise_on_every_rank(ranks, env, prefix):
    """Rank 0 pipelines in 2 groups, rank 1 not: their first exchanges differ (a group's ``.g0`` tag against the
    layer's, or 2 heads against 4), which the vote names on every rank (the docstring's promise)."""
    for rank, result in enumerate(ranks(2, _different_chunks, prefix, env=env, timeout_s=60)):
        assert result is not None, rank
        name, field, text = result
        assert name == "ContractMismatchError", result
        assert (field, "blk.qkv.g0" in text) == (("SEQ", True) if prefix else ("H", False)), result


def _subclass_and_batch_errors(rank, p):
    from fastvideo.attention.layer import DistributedAttention, DistributedAttention_VSA

    errors = []
    try:
        DistributedAttention_VSA(4, 2, overlap_chunks=5, attend=lambda q, k, v, g: q)
    except ValueError as exc:
        errors.append(str(exc))
    layer = DistributedAttention(4, 2, prefix="b", overlap_chunks=2)
    empty = rank_input(rank, (0, 3, 4, 2))
    try:
        layer(empty, empty, empty)
    except ValueError as exc:
        errors.append(str(exc))
    q = rank_input(rank, (1, 3, 4, 2))
    return errors, bit_equal(layer(q, q, q)[0], DistributedAttention(4, 2, prefix="c")(q, q, q)[0])


def test_a_subclass_names_itself_and_a_batch_of_zero_is_refused_before_any_exchange(ranks):
    """The VSA layer's bad ``overlap_chunks`` names ``DistributedAttention_VSA`` (it named its base); a batch of 0
    raises a ValueError naming B on every rank (it raised ZeroDivisionError after the first exchange), and the next
    call, pipelined, is exact against the synchronous layer."""
    for errors, exact in ranks(2, _subclass_and_batch_errors, env=AUTO, timeout_s=60):
        assert errors[0].startswith("DistributedAttention_VSA: overlap_chunks=5 must be an int in 0..num_heads")
        assert errors[1].startswith("DistributedAttention: q is (0, 3, 4, 2), expected [B, S/P, 4, 2] (B >= 1;")
        assert exact


def _raised_mid_pipeline(rank, p):
    import gc
    import warnings

    from fastvideo.attention.layer import DistributedAttention
    from fastvideo.distributed.ulysses import exchange

    lines = log_lines(exchange.__name__)
    before = exchange.in_flight()
    q = rank_input(rank, (1, 3, 4, 2))
    bad_rotary = (torch.ones(7, 1), torch.ones(7, 1))  # tables that do not fit: attend 0 raises on every rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            DistributedAttention(4, 2, prefix="r", overlap_chunks=2)(q, q, q, freqs_cis=bad_rotary)  # the site
            raised = None
        except ValueError as exc:
            raised = type(exc).__name__
        gc.collect()
    resource = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    return raised, before, exchange.in_flight(), resource, lines


def test_a_pipelined_forward_that_raised_releases_its_exchanges_naming_the_layers_caller(ranks):
    """Attention of group 0 raises (rotary tables of the wrong length) with group 1's exchange in flight: it is
    released, and the warning names the line that called the layer (this file), not the layer's own start line."""
    for raised, before, after, resource, lines in ranks(2, _raised_mid_pipeline, env=AUTO, timeout_s=60):
        assert raised == "ValueError" and after == before
        assert resource and all("test_overlap_attention.py" in w and "layer.py" not in w for w in resource), resource
        assert len(lines) == 1 and "a pipelined DistributedAttention's too" in lines[0], lines


def test_ranks_that_disagree_on_the_setting_take_the_smallest_together(ranks):
    assert ranks(2, _agreed_overlap, rank_env={0: {OVERLAP: "2"}, 1: {OVERLAP: "0"}}, timeout_s=20) == [
        (0, (OVERLAP,))] * 2
    assert ranks(2, _agreed_overlap, env={OVERLAP: "2"}, timeout_s=20) == [(2, ())] * 2  # agreeing: kept


# ------------------------------------------------------------------------------------- the recipe's model trains alike

STEPS = 4


def _train_losses(rank, p, runs):
    """The recipe's tiny video DiT trained ``STEPS`` AdamW steps (the recipe's loss, data and optimiser; gradients
    summed over the SP ranks, as the recipe's sharding does) ``runs`` times from the same seed: losses per run, and
    which exchanges the attention made (per-group tags or not)."""
    import torch.distributed as dist

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D
    from sp_recipes.data import SyntheticVideoLatents
    from sp_recipes.video_dit import CONFIGS, VideoDiT, flow_matching_loss

    tags = set()

    def counted(x, sd, gd, name, **kwargs):
        tags.add(kwargs.get("tag"))
        return sequence_model_parallel_all_to_all_4D(x, sd, gd, **kwargs)

    cfg = CONFIGS["tiny"]
    out = []
    for _ in range(runs):
        torch.manual_seed(0)
        model = VideoDiT(cfg)
        for block in model.blocks:
            block.attn.all_to_all = counted
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.01)
        data = SyntheticVideoLatents(cfg, seed=0)
        losses = []
        for step in range(1, STEPS + 1):
            batch = data.batch(step, batch_size=2)
            loss = flow_matching_loss(model(batch.xt, batch.t, batch.text), batch.x0, batch.noise)
            loss.backward()
            for param in model.parameters():
                dist.all_reduce(param.grad)
                param.grad /= p
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out.append(losses)
    return out, sorted(t for t in tags if t)


# float32 ulps of the loss allowed per step after the first (see the test): the bound, not a fit to one run.
ULPS_PER_STEP = 64


def test_the_recipe_model_trains_to_the_same_losses_with_overlap(ranks):
    """The recipe's tiny DiT (6 heads; 2 groups of 3 heads, split 2 + 1 over 2 ranks) with overlap on against off.

    Calibration: repeated runs with overlap off are bit-identical (asserted: a spread of 0). The first step's loss
    (the forward alone) is then exact. Later steps may differ in the last bits, and only there: the replicated text
    tokens' gradient is partial per rank over the heads it attended (another partition when grouped), and the
    RMSNorm on q and k sums it over all heads before the ranks' gradients are summed, so float32 rounds in another
    order. Allowed: ``ULPS_PER_STEP`` float32 ulps of the loss per step after the first."""
    off = ranks(2, _train_losses, 2, env={OVERLAP: "0"}, timeout_s=120)
    on = ranks(2, _train_losses, 1, env={OVERLAP: "2"}, timeout_s=120)
    (first, again), tags_off = off[0]
    (pipelined,), tags_on = on[0]
    assert first == again  # the calibration run: no spread at all
    assert tags_off == ["blocks.0.attn.out", "blocks.0.attn.qkv", "blocks.1.attn.out", "blocks.1.attn.qkv"]
    assert tags_on == sorted(f"blocks.{b}.attn.{r}.g{g}" for b in (0, 1) for r in ("qkv", "out") for g in (0, 1))
    assert pipelined[0] == first[0]
    for step in range(1, STEPS):
        ulp = abs(first[step]) * 2.0 ** -23
        assert abs(pipelined[step] - first[step]) <= ULPS_PER_STEP * step * ulp, (step, pipelined, first)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_gpu_overlap_check_passes_its_cpu_dry_run(nproc):
    """tests/distributed/check_overlap.py (scripts/gpu_overlap_smoke.sh at SP 1, gpu_overlap_sp2.sh at SP 2) over
    gloo: every check it can run on CPU passes, the CUDA-only ones say they were skipped, and the compiled block's
    every start owns its input (the check fails where one does not)."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).with_name("check_overlap.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(script), "--cpu-dry-run"], env=script_env(), capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "FAIL" not in proc.stdout and "PASS graph replay N=4: skipped on CPU" in proc.stdout
    assert "PASS compile fullgraph" in proc.stdout and "starts=8 (owning their input: 8) waits=8" in proc.stdout
