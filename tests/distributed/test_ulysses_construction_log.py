"""A construction decline is logged once for the SP group: by its first rank, through ``logging`` at
WARNING, naming every rank's part (the construction exchange already holds every rank's report).
Other ranks log nothing about it, and no call logs it again."""

from __future__ import annotations

import logging

import pytest

from tests.distributed.conftest import a2a, build_helper, construction_fault, rank_input


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))


def _declined(rank, world_size, scenario):
    transport, kw = construction_fault(rank, scenario, faulty_rank=2 if scenario == "alloc" else 1)
    handler = _Records()
    logger = logging.getLogger("fastvideo.distributed.ulysses")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        h = build_helper(transport=transport, **kw)
        for seed in range(3):
            a2a(h, rank_input(rank, (3, 16, 12, 8), seed=seed), 0)
        per_rank = h.stats()["construction_per_rank"]
        h.destroy()
    finally:
        logger.removeHandler(handler)
    return [r for r in handler.records if "declined" in r[1]], per_rank


@pytest.mark.parametrize(
    "scenario, label, parts",
    [
        ("missing", "transport_missing", ["rank 0: ok", "rank 1: transport_missing (no kernel library on this rank)",
                                          "rank 2: ok"]),
        ("alloc", "construction_failed", ["rank 0: ok", "rank 1: ok", "rank 2: failed: alloc_window: RuntimeError"]),
        ("nvlink", "not_nvlink", ["rank 0: ok", "rank 1: not_nvlink (PCIe only)", "rank 2: ok"]),
        ("window", "peer_disagreement", ["rank 0: window bytes 4096", "rank 1: window bytes 8192",
                                         "rank 2: window bytes 12288"]),
        ("hosts", "multi_host", ["rank 0: host host0/boot", "rank 1: host host1/boot", "rank 2: host host2/boot"]),
    ],
)
def test_construction_decline_is_logged_once_by_rank_0_naming_every_rank(ranks, scenario, label, parts):
    results = ranks(3, _declined, scenario, timeout_s=60)
    (records0, per_rank0), *others = results
    assert len(records0) == 1, records0
    level, message = records0[0]
    assert level == "WARNING"
    assert f"declined at construction on SP ranks [0, 1, 2] ({label})" in message and "NCCL route" in message
    for part in parts:
        assert part in message, part
    for records, per_rank in others:
        assert records == [] and per_rank == per_rank0  # silent, yet every rank knows every rank's part
    assert sorted(per_rank0) == [0, 1, 2]


def _fine(rank, world_size):
    return _declined(rank, world_size, "none")


def test_no_decline_no_log(ranks):
    """Negative control: a construction that succeeds logs no decline on any rank."""
    for records, per_rank in ranks(2, _fine, timeout_s=60):
        assert records == [] and per_rank == {}


def _default_helper_on_cpu(rank, world_size):
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D

    handler = _Records()
    logger = logging.getLogger("fastvideo.distributed.ulysses")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        sequence_model_parallel_all_to_all_4D(rank_input(rank, (3, 16, 12, 8)), 2, 1)  # builds the default helper
    finally:
        logger.removeHandler(handler)
    return [r for r in handler.records if "declined" in r[1]]


def test_a_cpu_jobs_decline_is_information_not_a_warning(ranks):
    """``auto`` on CPU ranks: no device of theirs has a fused route, so there is nothing to fix and the decline is
    logged once at INFO (a log of a CPU job carries no warning of ours). The control is the test above: a decline
    where a fused route could run (a rank without the library, without NVLink, ...) is a WARNING."""
    records0, records1 = ranks(2, _default_helper_on_cpu, env={"FASTVIDEO_ULYSSES_A2A": "auto"}, timeout_s=60)
    assert records1 == [] and len(records0) == 1, records0
    level, message = records0[0]
    assert level == "INFO" and "(transport_missing)" in message and "no transport for this device" in message
