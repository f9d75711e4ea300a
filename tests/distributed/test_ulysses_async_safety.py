"""The all-to-all in flight cannot be silently wrong: backward order, the input until ``wait()``, dropped handles.

* **Order.** Two exchanges of one shape in flight, waited in opposite orders on the two ranks, then a loss over both
  outputs: autograd reaches the two backward exchanges in opposite orders. Each backward votes the SEQ word of the
  forward it differentiates, so every rank raises ``ContractMismatchError`` on SEQ (within 30 s) instead of swapping
  the gradients; untagged and with one tag on both calls, under ``auto`` and under ``off`` in checked mode, at
  P = 2 and 3. The negative control waits in the same order on every rank: exact gradients, with the route of every
  start (``nccl-async``) and of every call the route's helper recorded (the NCCL route) asserted (``nccl_route_ran``).
* **The input.** Mode (1, 2) with B = 1 is the layout where gloo would send ``x`` itself: an in-place write between
  the start and ``wait()`` raises ``InputModifiedError`` at the wait, on every one of 20 runs; where one rank alone
  writes, its peers' outputs are exact (in flight on CPU the exchange sends a copy in that layout); without the
  write the output is exact (the control). Under ``torch.inference_mode`` tensors carry no version counter: no
  check, and on CPU the output is the input as it stood at the start. Every start's route is asserted (gloo's
  threads, ``nccl-async``); its negative control runs the same starts (and the same-order exchanges) through a
  helper on the CPU plan transport, where they run fused and the assertions fail.
* **Dropped handles.** A start whose handle (eager) or token (autograd) is dropped without ``wait()`` gives a
  ``ResourceWarning`` and one log line naming where it started (the user's own frame, even where its file lies in the
  temporary folder), and the count of exchanges in flight returns to its prior value after ``gc.collect()``.
* **Compiled regions.** A start without its wait in the region is refused at trace time; the control traces.
* **A failed wait.** A recorded start's wait that fails before its wait op keeps the exchange: a second wait
  returns the exact output, and the start's route is asserted (``nccl-async``; fused in the negative control).
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.distributed.conftest import (
    bit_equal,
    build_helper,
    in_flight_routes,
    log_lines,
    nccl_reference,
    oracle,
    rank_input,
)

B, S, H, D = 2, 4, 6, 3
AUTO = {"FASTVIDEO_ULYSSES_A2A": "auto", "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"}
OFF_CHECKED = {"FASTVIDEO_ULYSSES_A2A": "off", "FASTVIDEO_ULYSSES_A2A_CHECKED": "1",
               "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "20"}


def _two_in_flight(rank, p, opposite, tag, fused=False):
    """Two same-shape exchanges in flight (tagged ``tag``; a pair: each its own), waited in issue order, or
    (``opposite``) in the reverse order on rank 0; the loss uses both outputs. Returns ("ok", gradients exact, what
    ran) or (error type, field, seconds, message). What ran: the route of each start in flight (the forwards' and the
    backwards', ``in_flight_routes``) and the (route, decline reason) of each call the route's helper recorded
    (``recorded_calls``). ``fused`` (the route assertion's negative control): through a helper on the CPU plan
    transport."""
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.ulysses import registry
    from tests.distributed.conftest import recorded_calls

    if fused:
        registry.install_default_helper(build_helper())
    xs = [rank_input(rank, (B, S, H, D), seed=10 + i, requires_grad=True) for i in range(2)]
    ws = [rank_input(rank, (B, S * p, H // p, D), seed=20 + i) for i in range(2)]
    with in_flight_routes() as started, recorded_calls() as recorded:
        tags = tag if isinstance(tag, tuple) else (tag, tag)
        handles = [a2a(x, 2, 1, tag=t, async_op=True) for x, t in zip(xs, tags, strict=True)]
        order = [1, 0] if opposite and rank == 0 else [0, 1]
        ys = {i: handles[i].wait() for i in order}
        loss = sum((ys[i] * ws[i]).sum() for i in range(2))
        start = time.monotonic()
        try:
            grads = torch.autograd.grad(loss, xs)
        except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
            field = getattr(exc, "field", None)
            return type(exc).__name__, field.name if field is not None else None, time.monotonic() - start, str(exc)
    expected = [nccl_reference(x, w, 0)[1] for x, w in zip(xs, ws, strict=True)]
    return "ok", all(bit_equal(g, e) for g, e in zip(grads, expected, strict=True)), (started, recorded)


@pytest.mark.parametrize("env", [AUTO, OFF_CHECKED], ids=["auto", "off-checked"])
@pytest.mark.parametrize("tag", [None, "blocks.0.attn.qkv"], ids=["untagged", "same-tag"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_backwards_in_opposite_orders_raise_on_every_rank(ranks, world_size, tag, env):
    for result in ranks(world_size, _two_in_flight, True, tag, env=env, timeout_s=90):
        assert result[:2] == ("ContractMismatchError", "SEQ"), result
        assert result[2] < 30.0, result
        assert "backward of different calls" in result[3], result


@pytest.mark.parametrize("env", [AUTO, OFF_CHECKED], ids=["auto", "off-checked"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_tagged_and_an_untagged_backward_in_opposite_orders_name_their_forwards(ranks, world_size, env):
    """One exchange tagged, one untagged, waited in opposite orders on rank 0: every rank raises on SEQ, and the
    message names each rank's backward by its forward (the untagged one's is forward call 1, the SEQ word it voted,
    not the backward's own call number)."""
    for result in ranks(world_size, _two_in_flight, True, ("blocks.0.attn.qkv", None), env=env, timeout_s=90):
        assert result[:2] == ("ContractMismatchError", "SEQ") and result[2] < 30.0, result
        assert "the backward of untagged call 1" in result[3], result
        assert "'blocks.0.attn.qkv', the backward of its forward call 0" in result[3], result
        assert "untagged call 2" not in result[3], result


def nccl_route_ran(env) -> tuple:
    """What ``_two_in_flight`` reports as ran where the NCCL route ran every call: each of the 4 starts in flight (2
    forwards, their 2 backwards) on gloo's threads (``nccl-async``), and the 4 calls recorded on the NCCL route by the
    route's helper: under ``auto`` the default helper, declined at construction (no transport on CPU), under ``off``
    in checked mode the checked-off helper (``disabled``)."""
    reason = "transport_missing" if env["FASTVIDEO_ULYSSES_A2A"] == "auto" else "disabled"
    return ["nccl-async"] * 4, [("nccl", reason)] * 4


@pytest.mark.parametrize("env", [AUTO, OFF_CHECKED], ids=["auto", "off-checked"])
@pytest.mark.parametrize("tag", [None, "blocks.0.attn.qkv"], ids=["untagged", "same-tag"])
def test_negative_control_the_same_order_is_exact(ranks, tag, env):
    """Waited in the same order on every rank: the gradients equal the NCCL reference, and every call ran on the
    NCCL route (``nccl_route_ran``)."""
    for result in ranks(2, _two_in_flight, False, tag, env=env, timeout_s=90):
        assert result == ("ok", True, nccl_route_ran(env)), result


def _write_between(rank, p, writers, runs, fused=False, parameter=False):
    """``runs`` exchanges of a [1, S * p, H / p, D] input in mode (1, 2) (the layout where gloo would send ``x``'s
    own memory), each followed on the ranks in ``writers`` by an in-place write to ``x`` before ``wait()``: what
    each run gave, the route each start took (gloo's threads in flight, ``nccl-async``: the route still running
    after the start returns), and what the same write gave under ``torch.inference_mode`` (no version counter).
    ``fused`` (the route assertions' negative control): through a helper on the CPU plan transport. ``parameter``:
    ``x`` is an ``nn.Parameter`` (no grad, so that it may be written in place), which takes the op path."""
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.ulysses import registry
    from fastvideo.distributed.ulysses.exchange import InputModifiedError, in_flight

    if fused:
        registry.install_default_helper(build_helper())
    outcomes, routes = [], set()
    for run in range(runs + 1):
        inference = run == runs
        with torch.inference_mode(inference):
            x = rank_input(rank, (1, S * p, H // p, D), seed=run)
            x = torch.nn.Parameter(x, requires_grad=False) if parameter and not inference else x
            expected = oracle(x, 1)
            handle = a2a(x, 1, 2, async_op=True)
            routes.add(getattr(handle, "route", type(handle).__name__))  # the op path's handle: its type
            if rank in writers:
                x.add_(1.0)
            try:
                outcomes.append("exact" if bit_equal(handle.wait(), expected) else "wrong")
            except InputModifiedError as exc:
                outcomes.append("raised" if "input_" in str(exc) else str(exc))
    return outcomes[:-1], in_flight(), outcomes[-1], routes


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_write_between_start_and_wait_raises_every_time(ranks, world_size):
    """Every rank writes: every run raises on every rank. Under inference mode nothing can see the write, and on CPU
    nothing needs to: the exchange sent a copy, so the output is the input as it stood at the start."""
    for outcomes, left, inference, routes in ranks(world_size, _write_between, range(world_size), 20, env=AUTO,
                                                    timeout_s=120):
        assert outcomes == ["raised"] * 20 and left == 0 and inference == "exact" and routes == {"nccl-async"}


@pytest.mark.parametrize("env", [AUTO, OFF_CHECKED], ids=["auto", "off-checked"])
def test_a_parameters_start_owns_a_copy_so_its_write_is_no_error(ranks, env):
    """An ``nn.Parameter`` takes the op path (its handle a ``TracedHandle``), whose start copies its input: every
    rank writes it between start and wait, every run returns the input as it stood at the start, on every rank,
    with no error."""
    for outcomes, left, inference, routes in ranks(2, _write_between, range(2), 20, False, True, env=env,
                                                    timeout_s=120):
        # the Parameter's runs: the op path; the inference-mode run (a plain tensor): gloo's threads
        assert outcomes == ["exact"] * 20 and left == 0 and inference == "exact"
        assert routes == {"TracedHandle", "nccl-async"}, routes


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_write_on_one_rank_raises_there_and_reaches_no_peer(ranks, world_size):
    """Rank 0 alone writes: it raises on every run; its peers' outputs are exact on every run (on CPU the exchange
    never reads ``x`` after the start). Every start on every rank ran on gloo's threads (``nccl-async``)."""
    results = ranks(world_size, _write_between, (0,), 20, env=AUTO, timeout_s=120)
    assert results[0][0] == ["raised"] * 20
    for outcomes, left, inference, _ in results[1:]:
        assert outcomes == ["exact"] * 20 and left == 0 and inference == "exact"
    assert [routes for *_, routes in results] == [{"nccl-async"}] * world_size


def test_negative_control_without_the_write_the_output_is_exact(ranks):
    for outcomes, left, _, routes in ranks(2, _write_between, (), 5, env=AUTO, timeout_s=120):
        assert outcomes == ["exact"] * 5 and left == 0 and routes == {"nccl-async"}


def test_negative_control_the_route_assertions_fail_where_another_route_ran(ranks):
    """Through a helper on the CPU plan transport the same starts run fused: the outputs and gradients are exact, and
    the route assertions of the write tests, of the failed wait (every start ``nccl-async``) and of the same-order
    exchanges (``nccl_route_ran``) fail on them."""
    for outcomes, left, inference, routes in ranks(2, _write_between, (), 3, True, env=AUTO, timeout_s=120):
        assert outcomes == ["exact"] * 3 and left == 0 and inference == "exact" and routes == {"fused"}
        assert routes != {"nccl-async"}
    for result in ranks(2, _wait_that_failed_before_the_op, True, env=AUTO, timeout_s=60):
        assert result == ("TracedHandle", "no SP group here", True, 0, ["fused"]), result
        assert result[-1] != ["nccl-async"]
    for result in ranks(2, _two_in_flight, False, None, True, env=AUTO, timeout_s=90):
        assert result == ("ok", True, (["fused"] * 4, [("fused", None)] * 4)), result
        assert result[2] != nccl_route_ran(AUTO)


def _dropped(rank, p, grad):
    """Drop a started exchange's handle without waiting (``grad``: through the op, so the token carries it)."""
    import gc
    import warnings

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.ulysses import exchange

    lines = log_lines(exchange.__name__)
    before = exchange.in_flight()
    x = rank_input(rank, (B, S, H, D), seed=5, requires_grad=grad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = a2a(x, 2, 1, async_op=True)  # the start site the warning names: this line
        during = exchange.in_flight()
        del handle
        gc.collect()
    after = exchange.in_flight()
    resource = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    return before, during, after, resource, lines


@pytest.mark.parametrize("grad", [False, True], ids=["eager", "autograd"])
def test_a_dropped_handle_warns_and_is_released(ranks, grad):
    for before, during, after, resource, lines in ranks(2, _dropped, grad, env=AUTO, timeout_s=60):
        assert during == before + 1 and after == before
        assert len(resource) == 1 and "test_ulysses_async_safety.py" in resource[0], resource
        assert len(lines) == 1 and "never waited for" in lines[0]


USER_STEP = """from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a


def step(x):
    a2a(x, 2, 1, async_op=True)  # dropped at once
"""


def _dropped_by_code_in_the_temporary_folder(rank, p, name):
    """Drop a start made by module ``name`` whose file lies in the temporary folder (a project checked out under
    /tmp): the warnings that name the start site, and the site that is."""
    import importlib.util
    import shutil
    import tempfile
    import warnings
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="fastvideo-user-project-"))
    try:
        path = folder / f"{name}.py"
        path.write_text(USER_STEP)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module.step(rank_input(rank, (B, S, H, D), seed=6))
    finally:
        shutil.rmtree(folder)
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)], f"{path}:5"


@pytest.mark.parametrize("name", ["user_step", "torch_user_step", "fastvideo_user_step"])
def test_a_dropped_start_is_named_by_user_code_in_the_temporary_folder(ranks, name):
    """Only torch's files and modules, this package's modules and inductor's generated code are skipped when naming
    a start: not the whole temporary folder, nor a user module whose name merely begins like torch's or the
    package's."""
    for resource, site in ranks(2, _dropped_by_code_in_the_temporary_folder, name, env=AUTO, timeout_s=60):
        assert len(resource) == 1 and f"started at {site} " in resource[0], (resource, site)

def _compiled(rank, p, wait):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a

    def f(x):
        handle = a2a(x * 2, 2, 1, async_op=True)
        return handle.wait().sum() if wait else x.sum()

    torch._dynamo.reset()
    try:
        torch.compile(f, backend="aot_eager", fullgraph=True)(rank_input(rank, (B, S, H, D)))
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        return "no wait() in it" in str(exc)
    return "traced"


def test_a_compiled_start_without_its_wait_is_refused_at_trace_time(ranks):
    assert ranks(2, _compiled, False, timeout_s=180) == [True, True]
    assert ranks(2, _compiled, True, timeout_s=180) == ["traced", "traced"]  # the control


def _wait_that_failed_before_the_op(rank, p, fused=False):
    """A recorded start's wait that fails before its wait op (here: the SP group lookup raises once), then waited
    again: what each wait gave, the exchanges left in flight and the route of the start (a recorded start's handle
    does not carry it). ``fused`` (the route assertion's negative control): through a helper on the CPU plan
    transport."""
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.ulysses import exchange, ops, registry

    if fused:
        registry.install_default_helper(build_helper())
    x = rank_input(rank, (B, S, H, D), seed=7, requires_grad=True)
    with in_flight_routes() as started:
        handle = a2a(x, 2, 1, async_op=True)
    def unavailable():
        raise RuntimeError("no SP group here")

    real, ops.get_sp_group = ops.get_sp_group, unavailable
    try:
        handle.wait()
        first = "returned"
    except RuntimeError as exc:
        first = str(exc)
    finally:
        ops.get_sp_group = real
    second = bit_equal(handle.wait(), oracle(x.detach(), 0))
    return type(handle).__name__, first, second, exchange.in_flight(), started


def test_a_wait_that_fails_before_its_op_can_be_waited_again(ranks):
    """The handle keeps its exchange until its wait op is entered: the second wait returns the exact output and
    nothing stays in flight (no 'waited already', no dropped-start warning). The start ran on gloo's threads."""
    for result in ranks(2, _wait_that_failed_before_the_op, env=AUTO, timeout_s=60):
        assert result == ("TracedHandle", "no SP group here", True, 0, ["nccl-async"]), result
