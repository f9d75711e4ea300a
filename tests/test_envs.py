"""The env registry: parsing, errors that say how to fix, overrides, and docs/env_vars.md in sync."""

from __future__ import annotations

import os
import pathlib
import pickle
import re

import pytest

from fastvideo import envs

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "env_vars.md"


def _doc_rows() -> dict[str, tuple[str, str, str]]:
    """This package's table: the rows before the first section (upstream's variables have their own)."""
    rows = {}
    for line in DOC.read_text().split("\n## ")[0].splitlines():
        m = re.match(r"\| `(FASTVIDEO_[A-Z0-9_]+)` \| (.+?) \| `(.*?)` \| (.+) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    return rows


def test_doc_lists_exactly_the_registry():
    assert set(_doc_rows()) == set(envs.registry()), "docs/env_vars.md and fastvideo/envs.py drifted apart"


@pytest.mark.parametrize("name", sorted(envs.registry()))
def test_doc_row_matches_registry(name):
    var = envs.registry()[name]
    kind, default, doc = _doc_rows()[name]
    assert default == str(var.default)
    assert doc == var.doc
    if var.kind == "choice":
        assert kind == " \\| ".join(f"`{c}`" for c in var.choices)
    else:
        assert kind == var.kind


def test_defaults_when_unset():
    with envs.override(FASTVIDEO_ULYSSES_A2A=None, FASTVIDEO_ULYSSES_A2A_LONG_TRAINING=None):
        assert envs.get("FASTVIDEO_ULYSSES_A2A") == "off"
        assert envs.get("FASTVIDEO_ULYSSES_A2A_LONG_TRAINING") == "auto"


@pytest.mark.parametrize("raw,expected", [(" AUTO ", "auto"), ("Off", "off"), ("\tauto\n", "auto"), ("", "off")])
def test_choice_is_case_and_space_insensitive(raw, expected):
    with envs.override(FASTVIDEO_ULYSSES_A2A=raw):
        assert envs.get("FASTVIDEO_ULYSSES_A2A") == expected


@pytest.mark.parametrize("name,raw", [("FASTVIDEO_ULYSSES_A2A", "on"), ("FASTVIDEO_ULYSSES_A2A_LONG_TRAINING", "yes")])
def test_bad_choice_names_variable_value_and_choices(name, raw):
    with envs.override(**{name: raw}), pytest.raises(ValueError) as info:
        envs.get(name)
    message = str(info.value)
    assert name in message and repr(raw) in message
    for choice in envs.registry()[name].choices:
        assert choice in message


def test_numbers_parse_and_reject():
    with envs.override(FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES="4096"):
        assert envs.get("FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES") == 4096
    with envs.override(FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES="1GiB"), pytest.raises(ValueError, match="integer"):
        envs.get("FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES")
    with envs.override(FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S="-1"), pytest.raises(ValueError, match=">="):
        envs.get("FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S")


def test_read_when_asked_not_frozen(monkeypatch):
    monkeypatch.setenv("FASTVIDEO_ULYSSES_A2A", "auto")
    assert envs.get("FASTVIDEO_ULYSSES_A2A") == "auto"
    monkeypatch.setenv("FASTVIDEO_ULYSSES_A2A", "off")
    assert envs.get("FASTVIDEO_ULYSSES_A2A") == "off"


def test_override_restores_previous_value(monkeypatch):
    monkeypatch.setenv("FASTVIDEO_ULYSSES_A2A", "auto")
    with envs.override(FASTVIDEO_ULYSSES_A2A="off"):
        assert envs.get("FASTVIDEO_ULYSSES_A2A") == "off"
    assert envs.get("FASTVIDEO_ULYSSES_A2A") == "auto"


def test_unknown_variable_is_a_clear_error():
    with pytest.raises(KeyError, match="not a FastVideo environment variable"):
        envs.get("FASTVIDEO_NOPE")
    with pytest.raises(KeyError, match="not a FastVideo environment variable"), envs.override(FASTVIDEO_NOPE="1"):
        pass


def test_snapshot_changes_exactly_when_a_value_changes(monkeypatch):
    """``envs.snapshot`` (what an agreement records, to name a later change): equal while nothing changes,
    different after a set, a change or an unset, through os.environ and envs.override alike."""
    names = ("FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_CHECKED")
    monkeypatch.delenv(names[1], raising=False)
    base = envs.snapshot(names)
    assert envs.snapshot(names) == base
    monkeypatch.setenv(names[1], "1")
    set_once = envs.snapshot(names)
    assert set_once != base
    with envs.override(FASTVIDEO_ULYSSES_A2A_CHECKED="0"):
        assert envs.snapshot(names) not in (base, set_once)
    assert envs.snapshot(names) == set_once
    monkeypatch.delenv(names[1])
    assert envs.snapshot(names) == base
    assert envs.raw(names) == tuple(map(envs.os.environ.get, names))


# ------------------------------------------------------------------------------------- upstream's attribute access


def test_module_attributes_read_the_environment_now(monkeypatch):
    """``envs.FASTVIDEO_ULYSSES_A2A`` as upstream FastVideo reads it: the parsed string, read at each access."""
    monkeypatch.setenv("FASTVIDEO_ULYSSES_A2A", " AUTO ")
    assert envs.FASTVIDEO_ULYSSES_A2A == "auto"
    monkeypatch.setenv("FASTVIDEO_ULYSSES_A2A", "off")
    assert envs.FASTVIDEO_ULYSSES_A2A == "off"
    monkeypatch.setenv("FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES", "4096")
    assert envs.FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES == 4096
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert envs.LOCAL_RANK == 3
    assert {"FASTVIDEO_ULYSSES_A2A", "LOCAL_RANK"} <= set(dir(envs))


def test_module_attribute_of_an_invalid_value_names_the_fix(monkeypatch):
    monkeypatch.setenv("FASTVIDEO_ULYSSES_A2A", "on")
    with pytest.raises(ValueError, match="choose one of off, auto"):
        envs.FASTVIDEO_ULYSSES_A2A  # noqa: B018 - the read is the test


# This package's settings only: upstream's other variables (LOCAL_RANK, ...) assign as upstream's do
# (tests/test_envs_upstream.py).
@pytest.mark.parametrize("name", ["FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING",
                                  "FASTVIDEO_ULYSSES_A2A_CHECKED"])
def test_assigning_a_setting_raises_and_says_how_to_change_it(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    before = getattr(envs, name)
    with pytest.raises(AttributeError) as info:
        setattr(envs, name, "auto")
    message = str(info.value)
    assert f"envs.{name} cannot be assigned" in message
    assert "before the SP groups are initialised" in message and f"envs.override({name}=...)" in message
    assert "agree_ulysses_settings()" in message
    assert getattr(envs, name) == before and name not in vars(envs)  # nothing was stored
    with pytest.raises(AttributeError, match="cannot be deleted"):
        delattr(envs, name)


def test_other_module_attributes_stay_assignable_and_unknown_names_are_clear(monkeypatch):
    """Only the settings are guarded: the module's own names (tests patch them) assign as usual."""
    monkeypatch.setattr(envs, "ASSIGNMENT_HELP", "patched")
    assert envs.ASSIGNMENT_HELP == "patched"
    with pytest.raises(AttributeError, match=r"FASTVIDEO_ULYSSES_A2A_NOPE.*the FastVideo environment variables"):
        envs.FASTVIDEO_ULYSSES_A2A_NOPE  # noqa: B018


# ------------------------------------------------------------------------------------- upstream's .override idiom

# (name, its raw value before, what ``.override`` gets, what ``envs.NAME`` reads inside, the plain type): the
# variables upstream's later tests override (the long-training policy, the route) and one of each value type.
IDIOM = [
    ("FASTVIDEO_ULYSSES_A2A_LONG_TRAINING", "chunked", "auto", "auto", str),
    ("FASTVIDEO_ULYSSES_A2A", "off", "auto", "auto", str),
    ("FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES", "2048", 4096, 4096, int),
    ("FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S", "1", 2.5, 2.5, float),
    ("FASTVIDEO_STAGE_LOGGING", "0", True, True, bool),
    ("LOCAL_RANK", "1", 3, 3, int),
]


@pytest.mark.parametrize("set_before", [True, False], ids=["set", "unset"])
@pytest.mark.parametrize("name, before, value, inside, plain", IDIOM, ids=[row[0] for row in IDIOM])
def test_value_override_sets_the_variable_for_the_block_and_restores_it(monkeypatch, name, before, value, inside,
                                                                         plain, set_before):
    """``envs.NAME.override(value)``: the variable is set in this process inside the block (``envs.NAME`` reads
    it), and on exit, normal or by an exception, it is what it was, set or unset."""
    if set_before:
        monkeypatch.setenv(name, before)
    else:
        monkeypatch.delenv(name, raising=False)
    expected = os.environ.get(name)
    current = getattr(envs, name)
    assert isinstance(current, plain if plain is not bool else int) and current == envs.get(name)
    with current.override(value):
        got = getattr(envs, name)
        assert got == inside and os.environ[name] == (str(int(value)) if plain is bool else str(value))
        assert os.environ.get(name) != expected  # the control: the block did change it
    assert os.environ.get(name) == expected
    with pytest.raises(RuntimeError, match="inside"), getattr(envs, name).override(value):
        raise RuntimeError("inside")
    assert os.environ.get(name) == expected
    assert type(pickle.loads(pickle.dumps(got))) is plain and pickle.loads(pickle.dumps(got)) == inside


def test_override_values_read_as_the_plain_ones(monkeypatch):
    """Only ``envs.NAME`` adds ``.override``: ``envs.get`` and ``environment_variables`` give the plain value; a
    bool reads and prints as one; None (unset, no default) stays None."""
    monkeypatch.setenv("FASTVIDEO_STAGE_LOGGING", "1")
    flag = envs.FASTVIDEO_STAGE_LOGGING
    assert flag and flag == True and (repr(flag), str(flag), f"{flag}") == ("True", "True", "True")  # noqa: E712
    assert envs.get("FASTVIDEO_STAGE_LOGGING") is True and not hasattr(envs.get("FASTVIDEO_STAGE_LOGGING"), "name")
    monkeypatch.setenv("FASTVIDEO_ULYSSES_A2A", "auto")
    assert type(envs.get("FASTVIDEO_ULYSSES_A2A")) is str and not hasattr(envs.get("FASTVIDEO_ULYSSES_A2A"),
                                                                           "override")
    monkeypatch.delenv("FASTVIDEO_ATTENTION_BACKEND", raising=False)
    assert envs.FASTVIDEO_ATTENTION_BACKEND is None


@pytest.mark.parametrize("raw", ["inf", "nan", "1e300", "604801", "-1"])
def test_a_timeout_out_of_its_bounds_names_the_variable_and_the_bounds(raw):
    """A timeout must be a number of seconds from 0 to a week: infinity, NaN or a value no timedelta holds would
    otherwise reach torch.distributed and fail there naming nothing. Control: the bounds themselves pass."""
    name = "FASTVIDEO_ULYSSES_A2A_VOTE_TIMEOUT_S"
    with envs.override(**{name: raw}), pytest.raises(ValueError) as info:
        envs.get(name)
    assert name in str(info.value) and "must be >= 0 and <= 604800" in str(info.value)
    for ok in ("0", "604800"):
        with envs.override(**{name: ok}):
            assert envs.get(name) == float(ok)
