"""Both plan kinds' addressing on the host, against the all-to-all's definition (CPU, runs in CI).

``fvk_check_addressing`` (csrc/ulysses_a2a/testing/addressing.cu, in the test library) runs one call's data
movement for P simulated ranks in host memory through the kernels' own code compiled for the host: the SM
kind's ``store_chunk`` and ``copy_out_chunk`` for every CTA, the copy-engine kind's pushes as its launcher
issues them (``ce_push_copies``) and its kernels' bodies (``ce_own_chunk``, ``ce_copy_out_chunk``), every store
of a chunk before its copy-outs (an order the barriers allow). Then it compares every output byte with the
definition, computed from the call's shares alone (mode 0: rank r's output holds every rank's rows of r's
heads; mode 1: r's rows of every rank's heads), and counts any access outside a rank's tensors or windows.
Calls are described as the native transport describes them (``launch.call_description``).

Negative controls: the even-only layout (the split tables ignored) and the pre-fix moving layout on uneven
tables, and copy-outs reading the other buffer, each give wrong bytes.
"""

from __future__ import annotations

import random

import pytest
import torch

from fastvideo.distributed.ulysses.policy import ENGINE_CE, Geometry, Plan
from tests.kernel.built import kernel_testing
from tests.kernel.host_checks import CE, EVEN_ONLY, MOVING, SM, addressing, uneven_geometry


@pytest.fixture(scope="module")
def lib(testing_lib):
    return testing_lib


# (B, S, H, D) x plans (planes, rows per chunk): whole, planes then a smaller last, uneven rows, one row per
# chunk; fp32 (4 bytes) and bf16 (2) so runs are 32..1024 bytes.
SHAPES = [(1, 7, 8, 8), (3, 5, 16, 4), (4, 9, 8, 16), (2, 16, 24, 8)]
DTYPES = (torch.float32, torch.bfloat16)
KINDS = {SM: "sm", CE: "ce"}


def chunkings(b: int, s: int) -> tuple[tuple[int, int], ...]:
    return (b, s), (2, s), (1, s), (1, 3), (2, 2), (1, 1)


def plan(kind: int, ctas: int, planes: int, rows: int) -> Plan:
    return Plan(ctas, planes, rows, tuned=True, engine=ENGINE_CE if kind == CE else "sm")


@pytest.mark.parametrize("kind", [SM, CE], ids=KINDS.get)
@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("mode", [0, 1])
def test_even_addressing_is_the_all_to_all(lib, kind, world, mode):
    """Every byte of every rank's output equals the definition, for plans with chunks of different sizes."""
    for b, s, h, d in SHAPES:
        h = h // 8 * world if h % world else h  # H divisible by P
        for dtype in DTYPES:
            geom = Geometry(mode, dtype, b, s, h, d, world)
            for planes, rows in chunkings(b, s):
                wrong, first = addressing(lib, geom, plan(kind, 5, planes, rows), kind)
                assert wrong == 0, f"{geom} plan {planes}x{rows}: {first}"


def uneven_cases(world: int, seed: int = 20261201) -> list[Geometry]:
    """Uneven geometries at P = ``world``: both modes, sequence and head shares uneven alone and together, shares
    of 0, rows only 2 bytes aligned (D = 3) and 16-byte rows (D = 8 in fp32)."""
    rng = random.Random(seed + world)
    geoms = []
    for mode in (0, 1):
        for n, (seq, head) in enumerate(((True, True), (True, False), (False, True), (True, True))):
            dtype, d = ((torch.float32, 8), (torch.bfloat16, 3))[n % 2]
            heads = world * rng.randint(1, 3) if not head else rng.randint(world + 1, 3 * world)
            geoms.append(uneven_geometry(rng, mode, dtype, world, rng.randint(1, 3), rng.randint(3, 11), heads, d,
                                         zero=n != 3, seq=seq, head=head))
    return geoms


@pytest.mark.parametrize("kind", [SM, CE], ids=KINDS.get)
@pytest.mark.parametrize("world", range(2, 9))
def test_uneven_addressing_is_the_all_to_all(lib, kind, world):
    """Uneven sequence and head shares (shares of 0 among them), both modes, chunks of different sizes (the
    largest share's rows cut in ranges a shorter share ends inside), several CTA counts: every output byte
    equals the definition, and nothing is read or written outside a rank's tensors or windows."""
    geoms = uneven_cases(world)
    assert any(0 in (g.seq_splits or ()) + (g.head_splits or ()) for g in geoms)
    for geom in geoms:
        s, b = geom.S, geom.B
        for ctas, planes, rows in ((1, b, s), (3, 1, (s + 1) // 2), (7, 2, 3), (144, 1, 1), (5, 2, s - 1)):
            wrong, first = addressing(lib, geom, plan(kind, ctas, planes, rows), kind)
            assert wrong == 0, f"{geom} plan {ctas} CTAs {planes}x{rows}: {first}"


@pytest.mark.parametrize("kind", [SM, CE], ids=KINDS.get)
def test_negative_control_even_only_layout_gives_wrong_bytes_on_uneven_tables(lib, kind):
    """The layout before uneven splits applied to uneven tables moves the wrong bytes (or leaves the tensors);
    on even tables it is the kernels' layout and exact."""
    for world in (2, 3, 8):
        for geom in uneven_cases(world):
            wrong, _ = addressing(lib, geom, plan(kind, 5, 1, 2), kind, layout=EVEN_ONLY)
            assert wrong > 0, f"{geom}: the even-only layout must be caught"
        even = Geometry(0, torch.bfloat16, 2, 5, 2 * world, 8, world)
        assert addressing(lib, even, plan(kind, 5, 1, 2), kind, layout=EVEN_ONLY) == (0, "")


def test_negative_control_moving_layout_gives_wrong_bytes_on_uneven_tables(lib):
    """The pre-fix layout (regions at the current block's stride): with uneven tables the blocks of different
    senders overlap in a receiver's window, so bytes are lost even when every store precedes every copy-out."""
    geoms = [geom for world in (2, 3, 8) for geom in uneven_cases(world)]
    caught = sum(addressing(lib, geom, plan(SM, 5, geom.B, geom.S), SM, layout=MOVING)[0] > 0 for geom in geoms)
    assert caught > len(geoms) // 5, f"the moving layout lost bytes on {caught} of {len(geoms)} uneven calls"
    even = Geometry(0, torch.bfloat16, 2, 5, 8, 8, 2)
    assert addressing(lib, even, plan(SM, 5, 2, 5), SM, layout=MOVING) == (0, "")  # one block size: no overlap


def test_swapped_buffers_are_caught(lib):
    """Negative control: copy-outs that read the other buffer give wrong bytes, with one chunk and with many,
    even and uneven."""
    uneven = Geometry(0, torch.bfloat16, 3, 5, 9, 8, 2, (5, 2), (4, 5))
    for geom in (Geometry(0, torch.bfloat16, 3, 5, 8, 8, 2), uneven):
        for planes, rows in ((3, 5), (1, 2)):
            wrong, first = addressing(lib, geom, plan(CE, 5, planes, rows), CE,
                                      flags=kernel_testing.CE_CHECK_SWAP_BUFFERS)
            assert wrong > 0 and "wrong bytes" in first


def test_addressing_check_rejects_bad_input(lib):
    geom = Geometry(0, torch.bfloat16, 1, 4, 8, 8, 2)
    with pytest.raises(AssertionError, match="H=7"):
        addressing(lib, Geometry(0, torch.bfloat16, 1, 4, 7, 8, 2), plan(CE, 1, 1, 4), CE)  # H % P, no table
    with pytest.raises(AssertionError, match="unknown flags"):
        addressing(lib, geom, plan(CE, 1, 1, 4), CE, flags=2)
    with pytest.raises(AssertionError, match="copy-engine kind"):
        addressing(lib, geom, plan(SM, 1, 1, 4), SM, flags=kernel_testing.CE_CHECK_SWAP_BUFFERS)
    with pytest.raises(AssertionError, match="layout 1"):
        addressing(lib, geom, plan(CE, 1, 1, 4), CE, layout=MOVING)
    with pytest.raises(AssertionError, match="256 MiB"):
        addressing(lib, Geometry(0, torch.bfloat16, 64, 1 << 20, 8, 64, 2), plan(CE, 1, 1, 4), CE)
