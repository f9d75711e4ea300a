"""The hot path (``ulysses/hot.py``, ``csrc/ulysses_hot/hot_calls.cpp``) makes the same library calls, votes and
outcomes as the Python path, on 2 gloo ranks over the real shared-memory vote.

Each rank runs one script of calls twice, on two helpers built one after the other: with the hot path off
(``FASTVIDEO_ULYSSES_A2A_HOT_PATH=0``: every call on the Python path) and on. The native transport drives a C
stand-in for ``fvk_launch`` (a ctypes callback, so the extension calls it through its address as it calls the
library's): it runs the real exchange (the product library's ``fvk_vote_exchange``) and the library's own verdict
(``fvk_vote_would_run``), records what it received (the call description, the 12 voted fields with SEQ), and for a
launch copies the input's bytes into the output (the all-to-all at the library boundary is out of reach on a CPU;
what is checked is that the library read the call's input and wrote the output handed back). The script covers
held and new signatures, both modes, a held shape in another dtype, tagged calls, a non-contiguous input, an
autograd-recorded call, a replan, and a call on which the ranks disagree. Both runs must agree on every record,
output and outcome, and the hot run must have taken the hot path for the calls it holds (``stats()["hot_calls"]``);
a negative control shows that check fails for the Python-path run. A GPU runs the real library through the same
path (``tests/distributed/check_hot_path.py``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from tests.distributed.conftest import SHM_VOTE_ENV, SHM_VOTE_SKIP, catch, rank_input, stand_in_native_helper
from tests.kernel.built import unavailable

pytestmark = pytest.mark.skipif(SHM_VOTE_SKIP is not None, reason=SHM_VOTE_SKIP or "")

SHAPE0, SHAPE1 = (2, 8, 12, 8), (2, 16, 6, 8)  # mode 0 and mode 1 inputs at P = 2 (fixture rows: 12 heads)
TAG = "blocks.0.attn.qkv"
_ELEMENT = {1: 4, 2: 2, 3: 2}  # fvk_call.dtype -> bytes


def _hot_unavailable() -> str | None:
    """Why the hot-path extension beside the built kernel library cannot be loaded here, or None."""
    from fastvideo.distributed.ulysses import hot

    return hot.load(Path(SHM_VOTE_ENV["FASTVIDEO_KERNEL_LIBRARY"]).parent)[1] or None


def _stand_in(world: int, records: list):
    """A C-callable ``fvk_launch``: the real exchange and verdict, a recorded call, the input's bytes copied out."""
    import fastvideo_kernel as fvk

    real = fvk.load()
    i64 = ctypes.c_int64
    proto = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 6))

    def launch(ctx, call, x, out, stream, vote):
        desc = fvk.Call.from_address(call)
        v = fvk.Vote.from_address(vote)
        fields = tuple((i64 * 12).from_address(v.fields))
        status = real.fvk_vote_exchange(v.handle, v.fields, v.votes, v.timeout_ns)
        v.vote_ns = 1000
        if status != 0:
            v.stage = fvk.STAGE_EXCHANGE_FAILED
            return status
        votes = ctypes.cast(v.votes, ctypes.POINTER(i64))
        if not real.fvk_vote_would_run(votes, world, ctypes.cast(v.fields, ctypes.POINTER(i64))):
            v.stage = fvk.STAGE_NOT_LAUNCHED
            records.append(("not launched", fields))
            return 0
        described = (desc.kind, desc.flags, desc.mode, desc.dtype, desc.ctas, desc.B, desc.S, desc.H, desc.D,
                     desc.planes_per_chunk, desc.rows_per_chunk, desc.seq_split, desc.head_split)
        records.append(("launched", fields, described, x, stream))
        ctypes.memmove(out, x, desc.B * desc.S * desc.H * desc.D * _ELEMENT[desc.dtype])
        v.stage = fvk.STAGE_LAUNCHED
        return 0

    return proto(launch)


def _script(rank: int, helper):
    """The calls, each one's outcome: the output's bytes (or the error), and where it ran."""
    import torch

    from fastvideo.distributed import sequence_model_parallel_all_to_all_4D as a2a

    x0, x1 = rank_input(rank, SHAPE0), rank_input(rank, SHAPE1, seed=1)
    steps = []

    def step(name, fn):
        got = catch(fn)
        if got[0] == "ok":
            got = ("ok", tuple(got[1].shape), got[1].detach().contiguous().view(torch.uint8).tolist())
        steps.append((name, got, helper.history[-1].route if helper.history else None))

    with torch.no_grad():
        for i in range(3):
            step(f"mode 0 #{i}", lambda: a2a(x0, 2, 1))
        for i in range(2):
            step(f"mode 1 #{i}", lambda: a2a(x1, 1, 2))
        for i in range(2):  # a held shape and mode in another dtype: another signature
            step(f"bf16 #{i}", lambda: a2a(x0.to(torch.bfloat16), 2, 1))
        for i in range(2):
            step(f"tagged #{i}", lambda: a2a(x0, 2, 1, tag=TAG))
        strided = rank_input(rank, (SHAPE0[0], SHAPE0[2], SHAPE0[1], SHAPE0[3])).transpose(1, 2)
        step("non-contiguous", lambda: a2a(strided, 2, 1))
        step("held again", lambda: a2a(x0, 2, 1))
    step("autograd-recorded", lambda: a2a(x0.clone().requires_grad_(True), 2, 1))
    with torch.no_grad():
        helper.long_training = "chunked"  # a replan: the Python path proposes again, and the table learns again
        for i in range(2):
            step(f"after replan #{i}", lambda: a2a(x0, 2, 1))
        # The ranks disagree: rank 0 calls a held signature, rank 1 another shape. Both raise together.
        odd = x0 if rank == 0 else rank_input(rank, (SHAPE0[0], SHAPE0[1] + 2, SHAPE0[2], SHAPE0[3]))
        step("disagree", lambda: a2a(odd, 2, 1))
        step("after disagreeing", lambda: a2a(x0, 2, 1))
    return steps


def _run(rank: int, world: int, hot_on: bool):
    from fastvideo.distributed.ulysses import registry

    records: list = []
    helper, native = stand_in_native_helper(rank, world, lambda lib: _stand_in(world, records), hot_on)
    registry.use_route(helper)
    try:
        steps = _script(rank, helper)
        stats = helper.stats()
        table = native.hot_path(None)  # the transport's table (None: build none, return the one it has)
    finally:
        registry.reset()
        helper.destroy()
        native._reset()
    closed = table is None or table.run(rank_input(rank, SHAPE0), 0, 0) is None  # after teardown: nothing held
    history = [(r.route, r.phase, getattr(r, "tag", None), r.plan.word if r.plan is not None else 0)
               for r in helper.history]
    counts = {k: stats[k] for k in ("calls", "fused", "raised", "declines", "plans")}
    return steps, records, history, counts, stats["hot_path"], stats["hot_calls"], stats["hot_signatures"], closed


def _both(rank: int, world: int):
    return _run(rank, world, False), _run(rank, world, True)


# Calls of the script the hot path makes: mode 0 #1-2, mode 1 #1, bf16 #1, tagged #0-1, held again, after replan
# #1, the disagreeing call on rank 0 (a held signature: the vote runs in the hot call, the verdict in Python), after.
HOT_CALLS = {0: 10, 1: 9}


def hot_ran(result, rank: int) -> None:
    """Raise unless ``result`` (one ``_run``) took the hot path for the script's held calls."""
    _, _, _, _, state, calls, signatures, _ = result
    if state != "on" or calls != HOT_CALLS[rank] or signatures != 1:
        raise AssertionError(f"hot path {state!r}: {calls} calls, {signatures} signatures held")


def test_the_hot_path_makes_the_python_paths_library_calls_votes_and_outcomes(ranks):
    why = _hot_unavailable()
    if why is not None:
        unavailable(f"hot-path extension: {why}")
    for rank, (off, on) in enumerate(ranks(2, _both, env=SHM_VOTE_ENV, timeout_s=120.0)):
        steps_off, records_off, history_off, counts_off = off[:4]
        steps_on, records_on, history_on, counts_on = on[:4]
        for (name, got_off, route_off), (_, got_on, route_on) in zip(steps_off, steps_on, strict=True):
            assert got_on == got_off, name
            assert route_on == route_off, name
        assert [s[1][0] for s in steps_on].count("ContractMismatchError") == 1  # the disagreeing call, on each rank
        # Every library call alike: the voted fields (SEQ included; the header's generation is each helper's
        # own) and the description. The input's address differs between the runs (its bytes are in the outputs
        # compared above); the stream is the stand-in transport's on the Python path, none for a CPU tensor on
        # the hot path (the GPU check compares real streams).
        def strip(records):
            return [(r[0], r[1][1:], *r[2:3]) for r in records]

        assert strip(records_on) == strip(records_off)
        assert len(records_on) == len(steps_on) - 1  # every call but the non-contiguous one voted in the library
        assert history_on == history_off
        assert counts_on == counts_off
        hot_ran(on, rank)
        with pytest.raises(AssertionError, match="hot path"):  # the negative control: the Python-path run
            hot_ran(off, rank)
        assert off[4] == "FASTVIDEO_ULYSSES_A2A_HOT_PATH=0" and off[5] == 0
        assert on[7], "the table still answered after the helper was destroyed"


def test_negative_control_a_run_that_took_the_hot_path_too_rarely_fails_the_check():
    """The check above fails for a run that took the hot path one call short (the Python-path run is the test's
    own negative control)."""
    too_rarely = ([], [], [], {}, "on", HOT_CALLS[0] - 1, 1, True)
    with pytest.raises(AssertionError, match="hot path"):
        hot_ran(too_rarely, 0)
    hot_ran(([], [], [], {}, "on", HOT_CALLS[1], 1, True), 1)


def test_the_loader_refuses_a_missing_stale_or_foreign_build_with_its_reason(tmp_path: Path):
    """``hot.load`` reads the build record before loading anything: no record, another torch, another interface,
    the other CUDA kind, or a file that is not the extension each come back as (None, why), never an error."""
    import json

    import torch

    from fastvideo.distributed.ulysses import hot

    def attempt(record: dict | None, name: str) -> str:
        directory = tmp_path / name
        directory.mkdir()
        if record is not None:
            hot.build_record(directory).write_text(json.dumps(record))
            (directory / "fastvideo_ulysses_hot.so").write_bytes(b"not an extension")
        module, why = hot.load(directory)
        assert module is None
        return why

    here = {"file": "fastvideo_ulysses_hot.so", "interface": hot.INTERFACE, "torch": list(hot.torch_version()),
            "cuda": torch.version.cuda is not None}
    assert "not built beside the kernel library" in attempt(None, "none")
    assert "built for torch [1, 0, 0]" in attempt({**here, "torch": [1, 0, 0]}, "torch")
    assert f"this code needs {hot.INTERFACE}" in attempt({**here, "interface": hot.INTERFACE + 1}, "interface")
    assert "this torch is the other kind" in attempt({**here, "cuda": not here["cuda"]}, "cuda")
    assert "cannot load" in attempt(here, "garbage")  # the record matches; the file is no extension
    assert hot.check_record(here) == ""
