"""Shared fixtures for the Ulysses CPU suites.

Ambient environment: every test must pass whatever the caller's shell sets for
``FASTVIDEO_ULYSSES_A2A`` and ``FASTVIDEO_ULYSSES_A2A_LONG_TRAINING``. CI runs the suite once per
combination (``FASTVIDEO_ULYSSES_A2A=off|auto`` x ``..._LONG_TRAINING=auto|chunked`` in the shell);
``pytest --ulysses-ambient=all`` runs every test under all four combinations in one session instead.
Tests that depend on either variable set it explicitly (``envs.override`` in-process, the ``env``
argument of ``ranks`` for the gloo ranks).

``ranks`` runs a module-level function on N gloo ranks (``tests/distributed/mp.py``) and forwards
the ambient values of the two variables to the ranks (a forkserver child otherwise keeps the
environment the forkserver started with), so the ambient setting really reaches the code under test.
"""

from __future__ import annotations

import itertools
import os

import pytest

from tests.distributed import mp

AMBIENT_VARS = ("FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING")
AMBIENT_COMBOS = [
    {"FASTVIDEO_ULYSSES_A2A": a2a, "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": lt}
    for a2a, lt in itertools.product(("off", "auto"), ("auto", "chunked"))
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--ulysses-ambient",
        choices=("inherit", "all"),
        default="inherit",
        help="inherit: use the shell's FASTVIDEO_ULYSSES_A2A*; all: run every test under all four combinations",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Only with --ulysses-ambient=all: otherwise test ids stay unchanged and the shell's values apply.
    if "ulysses_ambient" in metafunc.fixturenames and metafunc.config.getoption("--ulysses-ambient") == "all":
        ids = [f"{c['FASTVIDEO_ULYSSES_A2A']}-{c['FASTVIDEO_ULYSSES_A2A_LONG_TRAINING']}" for c in AMBIENT_COMBOS]
        metafunc.parametrize("ulysses_ambient", AMBIENT_COMBOS, ids=ids, indirect=True)


@pytest.fixture(autouse=True)
def ulysses_ambient(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Applies one ambient combination of the two env vars (or leaves the shell's) for the test."""
    combo = getattr(request, "param", None)
    if combo:
        for name, value in combo.items():
            monkeypatch.setenv(name, value)
    return {name: os.environ.get(name) for name in AMBIENT_VARS}


@pytest.fixture
def ranks(ulysses_ambient):
    """``ranks(world_size, fn, *args, env=..., timeout_s=...)``: run ``fn`` on gloo ranks, ambient env forwarded."""

    def run(world_size: int, fn, *args, env: dict[str, str | None] | None = None, timeout_s: float = 60.0, **kw):
        merged: dict[str, str | None] = dict(ulysses_ambient)
        merged.update(env or {})
        return mp.run_ranks(world_size, fn, *args, env=merged, timeout_s=timeout_s, **kw)

    return run


# ---------------------------------------------------------------------------------------------------
# Rank-side building blocks (imported by the test modules' module-level rank functions).

GPU_NAME = "NVIDIA T100"  # a made-up model: normalises to "T100", which only the fixture rows below name
FIXTURE_GPU = "T100"
VOTE_TIMEOUT_S = 10.0  # short enough that a hang fails fast, long enough for 4 ranks on 2 cores


def fixture_rows(world_sizes=(2, 3, 4), heads=(12,), head_dims=(8,), dtypes=None, *, ctas=144, planes_per_chunk=1):
    """Tuned rows for the test geometries only (the gate-style fixture: tuned and original plans differ)."""
    import torch

    from fastvideo.distributed.ulysses.policy import TunedRow

    dtypes = dtypes or (torch.float32, torch.bfloat16)
    return tuple(
        TunedRow(FIXTURE_GPU, p, dt, h, d, ctas=ctas, planes_per_chunk=planes_per_chunk, source="test fixture")
        for p in world_sizes for dt in dtypes for h in heads for d in head_dims
    )


def build_helper(*, window_bytes: int = 1 << 20, transport=None, tuned: bool = True, table=None,
                 vote_timeout_s: float = VOTE_TIMEOUT_S, **kw):
    """A UlyssesHelper on the SP group with the CPU plan transport, a small window and the fixture rows."""
    from fastvideo.distributed.parallel_state import get_sp_group
    from fastvideo.distributed.ulysses.helper import UlyssesHelper
    from fastvideo.distributed.ulysses.transport import GlooPlanTransport

    if table is None:
        table = fixture_rows() if tuned else ()
    return UlyssesHelper(
        get_sp_group(),
        transport=transport if transport is not None else GlooPlanTransport(),
        window_bytes=window_bytes,
        vote_timeout_s=vote_timeout_s,
        gpu_name=GPU_NAME,
        tuned_table=table,
        **kw,
    )


def rank_input(rank: int, shape, dtype=None, seed: int = 0, requires_grad: bool = False):
    """Deterministic, rank-distinct input (any rank can rebuild any other rank's input)."""
    import torch

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x.requires_grad_(requires_grad)


def oracle(x, mode: int):
    """The NCCL route over the SP device group (gloo on CPU): the correctness oracle."""
    from fastvideo.distributed.communication_op import nccl_route
    from fastvideo.distributed.parallel_state import get_sp_group

    return nccl_route(x.detach(), mode, get_sp_group().device_group)


def bit_equal(a, b) -> bool:
    """Same shape, dtype and bits (NaN-safe: compares the raw bytes)."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8))


def last(helper):
    """The last CallRecord as a plain tuple (route, plan word or 0, reason label or None, chunks, phase)."""
    rec = helper.history[-1]
    return (rec.route, rec.plan.word if rec.plan else 0, rec.reason.label if rec.reason else None, rec.chunks,
            rec.phase.name)


def catch(fn, *args, **kw):
    """Run ``fn``; return ("ok", result) or (exception type name, message, field name or None)."""
    try:
        return ("ok", fn(*args, **kw))
    except Exception as exc:  # noqa: BLE001 - the test asserts on what came back
        field = getattr(exc, "field", None)
        return (type(exc).__name__, str(exc), field.name if field is not None else None)
