"""Settings agreed across the SP group (``fastvideo/distributed/settings.py``), over gloo ranks.

A setting that is invalid on one rank raises the same error on every rank at ``initialize_sequence_parallel`` (or
at helper construction, or at the agreement after a change); ranks that differ on a setting decline together to
its conservative value (``settings.CONSERVATIVE``), each warning with every rank's value, and run on exact; a later
agreement on which they agree restores their values. Never a hang. Every scenario sets both ambient variables
itself on every rank, so the tests pass whatever the shell sets; ``run_ranks(timeout_s=...)`` bounds each one.
"""

from __future__ import annotations

import time

import pytest

from fastvideo import envs
from fastvideo.distributed.settings import (
    AGREED,
    CHECKED,
    CONSERVATIVE,
    AgreedSettings,
    LocalReport,
    SettingsError,
    decide,
)
from tests.distributed.conftest import a2a, bit_equal, build_helper, catch, last, oracle, rank_input
from tests.distributed.mp import RankError

A2A, LONG, WINDOW = "FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING", "FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES"
OVERLAP = "FASTVIDEO_ULYSSES_A2A_OVERLAP"
BASE = {A2A: "off", LONG: "auto", WINDOW: None, "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S": "5"}
SHAPE = (3, 16, 12, 8)


def _noop(rank, world_size):
    return "ran"


def _init_errors(ranks, rank_env, world_size=2):
    """Run initialisation with per-rank settings; return (every rank's (type, message), seconds)."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        ranks(world_size, _noop, env=BASE, rank_env=rank_env, timeout_s=10)
    elapsed = time.monotonic() - start
    return {r: (kind, message) for r, (kind, message, _) in info.value.errors.items()}, elapsed


def _declined_at_init(rank, world_size):
    """Upstream's entry point with this rank's settings, the settings module's warnings recorded: the agreed
    values, what differed, the warnings, the SP group's helper, and whether the op's result is the NCCL route's."""
    import logging

    from fastvideo.distributed import maybe_init_distributed_environment_and_model_parallel
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D
    from fastvideo.distributed.parallel_state import get_sp_group

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("fastvideo.distributed.settings").addHandler(handler)
    maybe_init_distributed_environment_and_model_parallel(1, world_size)
    sp = get_sp_group()
    x = rank_input(rank, SHAPE)
    exact = bit_equal(sequence_model_parallel_all_to_all_4D(x, 2, 1), oracle(x, 0))
    return (dict(sp.settings.values), sp.settings.differing, warnings, sp.device_communicator.ulysses_a2a is None,
            exact)


def _declined(ranks, rank_env, world_size=2):
    start = time.monotonic()
    results = ranks(world_size, _declined_at_init, env=BASE, rank_env=rank_env, initialize=False, timeout_s=30)
    return results, time.monotonic() - start


@pytest.mark.parametrize("first, second", [("off", "auto"), ("auto", "off")])
def test_a2a_mismatch_declines_to_nccl_together_at_initialization(ranks, first, second):
    """off on one rank, auto on the other (both orders): every rank agrees on off (the NCCL route) at
    initialisation, warns naming each rank's value and the fix, and runs on exact (it used to hang, then raise)."""
    results, elapsed = _declined(ranks, {0: {A2A: first}, 1: {A2A: second}})
    assert elapsed < 30
    for values, differing, warnings, no_helper, exact in results:
        # The checked mode's effective value follows the route (on under auto, off under off): it differs too.
        assert (values[A2A], values[CHECKED], differing) == ("off", True, (A2A, CHECKED))
        assert no_helper and exact
        assert len(warnings) == 1
        assert f"{A2A} is rank 0: {first!r}, rank 1: {second!r}, all now use 'off'" in warnings[0]
        assert "identically on every rank" in warnings[0] and "initialize_sequence_parallel" in warnings[0]
    assert results[0][:3] == results[1][:3]  # one value of every setting, and the same warning, everywhere


def test_agreeing_ranks_neither_decline_nor_warn(ranks):
    """Negative control for the decline: the same values on both ranks (one spelt differently) keep them, silently."""
    results, _ = _declined(ranks, {0: {A2A: "auto"}, 1: {A2A: " AUTO "}})
    for values, differing, warnings, no_helper, exact in results:
        assert (values[A2A], differing, warnings, no_helper, exact) == ("auto", (), [], False, True)


def test_long_training_mismatch_declines_to_auto_on_every_rank(ranks):
    results, elapsed = _declined(ranks, {0: {LONG: "chunked"}, 1: {LONG: "auto"}}, world_size=3)
    assert elapsed < 30
    for values, differing, warnings, _, exact in results:
        assert (values[LONG], values[A2A], differing, exact) == ("auto", "off", (LONG,), True)
        assert f"{LONG} is rank 0: 'chunked', rank 1: 'auto', rank 2: 'auto', all now use 'auto'" in warnings[0]


@pytest.mark.parametrize("bad", ["yes", "1", "on"])
def test_invalid_long_training_on_one_rank_raises_on_every_rank(ranks, bad):
    """LONG_TRAINING=yes|1|on on rank 1 under FASTVIDEO_ULYSSES_A2A=off (a route that never reads it): every
    rank raises SettingsError naming rank 1, the variable, the value and the choices."""
    errors, elapsed = _init_errors(ranks, {1: {LONG: bad}})
    assert sorted(errors) == [0, 1] and elapsed < 10
    for kind, message in errors.values():
        assert kind == "SettingsError"
        assert f"rank 1: {LONG}={bad!r} is not valid: choose one of auto, chunked" in message


def test_invalid_timeout_on_one_rank_is_reported_on_every_rank(ranks):
    """Per-rank (not agreed) variables are validated too."""
    errors, _ = _init_errors(ranks, {0: {"FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S": "soon"}})
    for kind, message in errors.values():
        assert kind == "SettingsError" and "rank 0: FASTVIDEO_ULYSSES_A2A_WATCHDOG_TIMEOUT_S='soon'" in message


def test_case_and_space_differences_are_the_same_value(ranks):
    """Choices are case- and whitespace-insensitive everywhere: ' AUTO ' on one rank agrees with 'auto'."""
    assert ranks(2, _noop, env=BASE, rank_env={0: {LONG: " AUTO "}, 1: {LONG: "auto"}}, timeout_s=30) == ["ran"] * 2


def test_decide_declines_each_differing_setting_to_its_conservative_value():
    """The verdict: identical values are kept; a difference in any agreed variable gives every rank the same
    conservative value of it (the same whichever rank decides), and the rest unchanged; an invalid value raises."""
    values = {A2A: "auto", LONG: "chunked", WINDOW: 1 << 30, CHECKED: False, OVERLAP: 4}
    assert set(values) == set(AGREED) == set(CONSERVATIVE)
    same = [LocalReport((None,) * len(AGREED), dict(values), ()) for _ in range(2)]
    kept = decide(same, [0, 1], 0, "test")
    assert isinstance(kept, AgreedSettings) and kept.values == values and kept.differing == ()
    other = {A2A: "off", LONG: "auto", WINDOW: 4096, CHECKED: True, OVERLAP: 0}
    expected = {A2A: "off", LONG: "auto", WINDOW: 4096, CHECKED: True, OVERLAP: 0}
    for name in AGREED:
        reports = [same[0], LocalReport(same[0].raw, dict(values, **{name: other[name]}), ())]
        for mine in (0, 1):
            agreed = decide(reports, [4, 5], mine, "test")
            assert agreed.values == dict(values, **{name: expected[name]}) and agreed.differing == (name,), name
    with pytest.raises(SettingsError, match="rank 5: boom"):
        decide([same[0], LocalReport(same[0].raw, {}, ("boom",))], [4, 5], 0, "test")


def test_settings_error_joins_each_ranks_error_as_one_sentence():
    """Errors from envs end with a full stop; joined, no stray '.;' or '..' is left (the control: the raw errors
    do end with one, so the test would see it)."""
    errors = []
    for raw in ("on", "sometimes"):
        with pytest.raises(ValueError) as info:
            envs.registry()[A2A].parse(raw)
        errors.append(str(info.value))
    assert all(e.endswith(".") for e in errors)
    with pytest.raises(SettingsError) as info:
        decide([LocalReport((), {}, (errors[0],)), LocalReport((), {}, (errors[1],))], [0, 1], 0, "test")
    message = str(info.value)
    assert ".;" not in message and ".." not in message and ".)." not in message
    assert "(default 'off'); rank 1: FASTVIDEO_ULYSSES_A2A='sometimes'" in message
    assert "(default 'off'). Fix the value on that rank" in message


# ------------------------------------------------------------------------------------- after initialization


def _change_on_every_rank(rank, world_size):
    """A change of the environment on every rank applies at ``agree_ulysses_settings()``, never per call; a helper
    follows the settings it was built on."""
    from fastvideo import envs
    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.parallel_state import agree_ulysses_settings, get_sp_group, override_ulysses_settings
    from fastvideo.distributed.ulysses import registry

    h = build_helper()
    registry.install_default_helper(h)
    x = rank_input(rank, SHAPE)
    a2a(x)  # off (agreed at initialisation): the helper is not involved
    with envs.override(FASTVIDEO_ULYSSES_A2A="auto"):
        a2a(x)  # not re-read per call: still off
        unread = len(h.history)
        agree_ulysses_settings()  # every rank: the route changes; the helper's own settings did not
        a2a(x)
        route, kept = last(h)[0], not h.stats()["destroyed"]
    agree_ulysses_settings()  # back to off
    a2a(x)
    calls = len(h.history)
    with override_ulysses_settings(FASTVIDEO_ULYSSES_A2A="auto", FASTVIDEO_ULYSSES_A2A_LONG_TRAINING="chunked"):
        followed = (h.long_training, not h.alive)  # the helper plans with the new policy
    after = h.long_training  # and with the restored one after the block
    with override_ulysses_settings(FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES="2048"):
        replaced = not h.alive  # its window came from... an argument: it keeps it (build_helper passes one)
    return (unread, route, kept, calls, followed, after, replaced, get_sp_group().settings[A2A],
            get_sp_group().settings[LONG])


def test_a_change_on_every_rank_applies_at_the_next_agreement(ranks):
    for result in ranks(2, _change_on_every_rank, env=BASE, timeout_s=60):
        assert result == (0, "fused", True, 1, ("chunked", False), "auto", False, "off", "auto")


def _window_change(rank, world_size):
    from fastvideo.distributed.parallel_state import override_ulysses_settings
    from fastvideo.distributed.ulysses import registry
    from fastvideo.distributed.ulysses.helper import UlyssesHelper
    from tests.plan_transport import GlooPlanTransport

    h = UlyssesHelper(transport=GlooPlanTransport(), vote_timeout_s=10.0)  # window from the settings
    registry.install_default_helper(h)
    with override_ulysses_settings(FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES="4096"):
        destroyed, current = h.stats()["destroyed"], registry.current_default_helper()
    return destroyed, current is None


def test_a_helper_whose_window_setting_changed_is_destroyed_together(ranks):
    assert ranks(2, _window_change, env=BASE, timeout_s=60) == [(True, True)] * 2


def _change_on_one_rank(rank, world_size):
    import os

    from fastvideo.distributed.communication_op import sequence_model_parallel_all_to_all_4D as a2a
    from fastvideo.distributed.parallel_state import agree_ulysses_settings

    x = rank_input(rank, SHAPE)
    if rank == 1:
        os.environ[A2A] = "auto"  # after the agreement, on this rank only
    calls = catch(a2a, x)[0]  # the agreed route still: both ranks in step
    declined = agree_ulysses_settings()
    exact = bit_equal(a2a(x), oracle(x, 0))
    os.environ[A2A] = "auto"  # now on every rank: the next agreement takes it
    recovered = agree_ulysses_settings()
    return calls, declined[A2A], declined.differing, exact, recovered[A2A], recovered.differing


def test_a_change_on_one_rank_is_not_read_per_call_and_declines_together_until_every_rank_agrees(ranks):
    """Rank 1 alone switches to auto after initialisation: its calls keep the agreed route (nothing re-reads the
    environment); the next agreement declines to off on every rank, exact; once every rank says auto, the
    agreement after that takes it."""
    for result in ranks(2, _change_on_one_rank, env=BASE, timeout_s=60):
        assert result == ("ok", "off", (A2A, CHECKED), True, "auto", ())


def _agreement_on_one_rank(rank, world_size):
    import os

    from fastvideo.distributed.parallel_state import agree_ulysses_settings

    if rank == 0:
        return None
    os.environ[A2A] = "auto"
    start = time.monotonic()
    got = catch(agree_ulysses_settings)  # its peer never joins
    return got[0], got[1], time.monotonic() - start


def test_an_agreement_only_one_rank_enters_fails_loudly_not_forever(ranks):
    """Rank 1 alone changes its setting and asks to re-agree: SettingsAgreementError naming what changed there
    since the agreement, bounded by the 5 s timeout."""
    kind, message, seconds = ranks(2, _agreement_on_one_rank, env=BASE, timeout_s=60)[1]
    assert kind == "SettingsAgreementError" and seconds < 15
    assert "rank 1 re-agrees after SP ranks [0, 1] agreed on them (changed here: " in message
    assert f"{A2A} agreed 'off', now 'auto'" in message and "on every rank" in message


def _override_with_a_typo_on_one_rank(rank, world_size):
    from fastvideo.distributed.parallel_state import override_ulysses_settings

    entered = []

    def block():
        name = "FASTVIDEO_ULYSSES_A2A_LONG_TRAINNG" if rank == 0 else LONG  # rank 0 misspells the name
        with override_ulysses_settings(**{name: "chunked"}):
            entered.append(True)

    start = time.monotonic()
    got = catch(block)
    return got[0], bool(entered), time.monotonic() - start


def test_an_override_a_rank_misspells_enters_no_agreement_there(ranks):
    """A name one rank's override does not know raises KeyError there before any agreement, so its peer's entry
    agreement is met by no one and raises after the 5 s timeout, before the block: the misspelling rank never
    answers it with its exit agreement (which let the peer into the block, out of step by one agreement)."""
    (bad, bad_entered, _), (peer, peer_entered, seconds) = ranks(2, _override_with_a_typo_on_one_rank, env=BASE,
                                                                  timeout_s=60)
    assert (bad, bad_entered) == ("KeyError", False)
    assert peer == "SettingsAgreementError" and not peer_entered and seconds < 15


def _helper_construction_mismatch(rank, world_size):
    import os

    from fastvideo.distributed.parallel_state import get_sp_group

    os.environ[LONG] = "chunked" if rank == 0 else "auto"
    h = build_helper()  # its exchange agrees the settings again: they differ now
    agreed = get_sp_group().settings
    after = catch(a2a, h, rank_input(rank, SHAPE), 0)
    record = last(h)
    h.destroy()
    return agreed[LONG], agreed.differing, h.long_training, after[0], record[0]


def test_helper_construction_declines_differing_settings_on_every_rank(ranks):
    for result in ranks(2, _helper_construction_mismatch, env=BASE, timeout_s=60):
        assert result == ("auto", (LONG,), "auto", "ok", "fused")


def _generation_mismatch(rank, world_size):
    from fastvideo.distributed.parallel_state import get_sp_group

    if rank == 0:
        get_sp_group()._generation += 1  # white-box: rank 0 built one helper its peers never built
    got = catch(build_helper)
    h = build_helper()
    gen = h.generation
    h.destroy()
    return got[0], got[2], gen


def test_helper_generation_mismatch_raises_everywhere_then_resynchronises(ranks):
    results = ranks(2, _generation_mismatch, env=BASE, timeout_s=60)
    for kind, field, _ in results:
        assert (kind, field) == ("ContractMismatchError", "HEADER")
    assert results[0][2] == results[1][2]


def _idiom_on_every_rank(rank, world_size):
    from fastvideo import envs
    from fastvideo.distributed.parallel_state import agree_ulysses_settings, get_sp_group

    sp = get_sp_group()
    with envs.FASTVIDEO_ULYSSES_A2A_LONG_TRAINING.override("chunked"):
        read, unagreed = envs.FASTVIDEO_ULYSSES_A2A_LONG_TRAINING, sp.settings[LONG]
        agreed = agree_ulysses_settings()[LONG]
    return read, unagreed, agreed, sp.settings[LONG], agree_ulysses_settings()[LONG]


def test_an_override_reaches_the_agreed_settings_only_through_an_agreement(ranks):
    """Upstream's ``envs.NAME.override(value)`` sets this rank's environment: ``envs.NAME`` reads it at once, the
    SP group's agreed settings (what the helpers follow) only after every rank agrees again, and they keep the
    block's value until the next agreement after it."""
    assert ranks(2, _idiom_on_every_rank, env=BASE, timeout_s=60) == [
        ("chunked", "auto", "chunked", "chunked", "auto")] * 2
