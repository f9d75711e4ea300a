"""The GPU hosts' scripts (``scripts/gpu_*.sh``) call the benchmarks with flags each case's parser accepts.

A device call is a scarce, timed window: a flag renamed in a case and left stale in a script fails there, after
the host's start-up and builds, instead of here. Every benchmark command line in the scripts (``benchmarks/run.py
CASE``, ``-m benchmarks.run CASE`` and the wrappers ``benchmark_ulysses_a2a.py``, ``tune_ulysses_a2a.py``,
``benchmark_dit_step.py``, directly or through a bash array) is parsed by the harness's own parser for its case
(``benchmarks.harness.main.parse``), with shell variables stood in for: ``${VAR:-default}`` by its default, any
other variable by a path. A shell function that runs a benchmark with ``"$@"`` (after ``shift N``) is checked at
each of its call sites, with the call's arguments past the first N in place of ``"$@"``. The device checks the
scripts run (``tests/distributed/check_*.py``, argparse programs of their own) are held to the flags their
``--help`` lists. Parsing only: nothing runs on a device.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from benchmarks.harness.case import CASES, get_case
from benchmarks.harness.main import parse

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("gpu_*.sh"))
CHECK = re.compile(r"(tests/distributed/check_\w+\.py)")
WRAPPERS = {"benchmark_ulysses_a2a": "a2a", "tune_ulysses_a2a": "tune", "benchmark_dit_step": "dit_step"}
_WRAPPED = "|".join(WRAPPERS)
INVOCATION = re.compile(rf"(?:benchmarks/run\.py|-m benchmarks\.run)\s+([\w-]+)|benchmarks/({_WRAPPED})\.py")
ARRAY = re.compile(r"^\s*(\w+)=\((.*)\)\s*$")
SHELL_END = {";", "|", "||", "&&", "&", ">", ">>", "2>&1", ")"}
STAND_IN = "/tmp/stand-in"


def logical_lines(text: str) -> list[tuple[int, str]]:
    """The script's lines with backslash continuations joined, comments dropped, each with its first line number."""
    out, pending, start = [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if line.lstrip().startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    return out


def expand(line: str, arrays: dict[str, str]) -> str:
    """``line`` with the script's arrays expanded (``arrays``) and its variables stood in for."""
    line = re.sub(r'"?\$\{(\w+)\[@\]\}"?', lambda m: arrays.get(m.group(1), STAND_IN), line)
    line = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", line)
    return re.sub(r"\$\{?\w+\}?", STAND_IN, line)


def invocations(line: str) -> list[tuple[str, list[str]]]:
    """The benchmark commands of one expanded line: (case, the tokens after it up to the end of the command)."""
    found = []
    for match in INVOCATION.finditer(line):
        argv = []
        for token in shlex.split(line[match.end():], comments=True):
            if token in SHELL_END or token.startswith((">", "2>")):
                break
            argv.append(token)
        found.append((match.group(1) or WRAPPERS[match.group(2)], argv))
    return found


def functions(lines: list[tuple[int, str]], arrays: dict[str, str]) -> dict[str, tuple[int, str]]:
    """The script's shell functions that run a benchmark with ``"$@"``: name -> (``shift`` count, that line)."""
    out, name, shift = {}, None, 0
    for _, line in lines:
        if name is None:
            if m := re.match(r"^\s*(\w+)\(\)\s*\{\s*$", line):
                name, shift = m.group(1), 0
            continue
        if line.strip() == "}":
            name = None
        elif m := re.match(r"^\s*shift\s+(\d+)", line):
            shift = int(m.group(1))
        elif '"$@"' in line and INVOCATION.search(expand(line, arrays)):
            out[name] = (shift, line)
    return out


def benchmark_commands(text: str) -> list[tuple[int, str, list[str]]]:
    """Every benchmark command in a script: (line number, case, its flags as the case's parser gets them)."""
    lines = logical_lines(text)
    # Each array as its last non-empty assignment (``A=(...)``, ``A+=(...)``, ``cond && A=(...)``): what it holds
    # where the script fills it (a run-time list of files, flags set when an earlier step left a file).
    arrays = {m.group(1): m.group(2) for _, line in lines for m in re.finditer(r"(\w+)\+?=\(([^)]*)\)", line)
              if m.group(2).strip()}
    wrapped = functions(lines, arrays)
    bodies = {body for _, body in wrapped.values()}
    commands = []
    for number, line in lines:
        if ARRAY.match(line) or line in bodies:
            continue
        words = line.split()
        if words and words[0] in wrapped:  # a call of such a function: its arguments in place of "$@"
            shift, body = wrapped[words[0]]
            call = shlex.split(expand(line, arrays), comments=True)[1 + shift:]
            call = call[:next((i for i, t in enumerate(call) if t in SHELL_END | {";;"}), len(call))]
            line = body.replace('"$@"', shlex.join(call))
        commands += [(number, case, argv) for case, argv in invocations(expand(line, arrays))]
    return commands


def check(name: str, text: str) -> int:
    """Parse every benchmark command of script ``name`` (its ``text``); raise naming the line that fails. Returns
    how many commands were parsed."""
    commands = benchmark_commands(text)
    for number, case, argv in commands:
        where = f"{name}:{number}: {case} {' '.join(argv)}"
        if case not in CASES:
            raise AssertionError(f"{where}: no case {case!r} (cases: {sorted(CASES)})")
        try:
            parse(get_case(case), argv)
        except SystemExit as exc:  # argparse's error exit
            raise AssertionError(f"{where}: the case's parser refused it (exit {exc.code})") from exc
    return len(commands)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_benchmark_command_in_a_device_script_parses(script: Path):
    check(script.name, script.read_text())


def test_the_scripts_hold_benchmark_commands_to_check():
    """The extraction finds the commands (a regex that matched nothing would pass every script): the suites that
    run benchmarks have them, through each way a script calls one."""
    found = {s.name: benchmark_commands(s.read_text()) for s in SCRIPTS}
    assert sum(len(c) for c in found.values()) >= 15, {k: len(v) for k, v in found.items()}
    cases = {case for commands in found.values() for _, case, _ in commands}
    assert {"a2a", "tune", "floor", "fused_host_overhead", "host_path", "dit_step"} <= cases, cases


def test_negative_controls_a_stale_flag_or_case_is_refused():
    """The check can fail: an unknown flag (through an array and a continuation line), an unknown case, and a
    value the flag's type refuses."""
    good = 'TORCHRUN=(python3 -m torch.distributed.run --nproc_per_node=2)\nstep x 9 x.log "${TORCHRUN[@]}" \\\n' \
           '  benchmarks/run.py floor --json "$L/floor.json"\n'
    assert check("good.sh", good) == 1
    with pytest.raises(AssertionError, match=r"bad\.sh:2: floor .*refused"):
        check("bad.sh", good.replace("--json", "--no-such-flag"))
    with pytest.raises(AssertionError, match="no case 'flor'"):
        check("typo.sh", good.replace("floor --json", "flor --json"))
    with pytest.raises(AssertionError, match="refused"):
        check("type.sh", 'python3 -m benchmarks.run host_path --iters "${ITERS:-many}"\n')
    function = 'run() {\n  local name=$1\n  shift 1\n  step "$name" 9 x.log python3 benchmarks/run.py floor "$@"\n}\n'
    assert check("function.sh", function + 'run "a floor" --mib 64 --json "$L/a.json"\n') == 1
    with pytest.raises(AssertionError, match=r"function\.sh:6: floor --no-such-flag"):
        check("function.sh", function + 'run "a floor" --no-such-flag\n')


@cache
def help_flags(program: str) -> frozenset[str]:
    """The option strings ``program --help`` lists (a device check's own argparse)."""
    done = subprocess.run([sys.executable, str(ROOT / program), "--help"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, f"{program} --help failed: {done.stderr[-500:]}"
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", done.stdout))


def check_programs(name: str, text: str) -> int:
    """Every ``tests/distributed/check_*.py`` command of script ``name``: each of its flags listed by the program's
    ``--help``; raise naming the line that fails. Returns how many commands were checked."""
    lines = logical_lines(text)
    checked = 0
    for number, line in lines:
        for match in CHECK.finditer(line):
            tokens = shlex.split(expand(line[match.end():], {}), comments=True)
            flags = {t.split("=")[0] for t in tokens if t.startswith("--")}
            unknown = sorted(flags - help_flags(match.group(1)))
            if unknown:
                raise AssertionError(f"{name}:{number}: {match.group(1)}: {unknown} not among its flags")
            checked += 1
    return checked


def test_every_device_check_a_script_runs_is_called_with_its_own_flags():
    counts = {s.name: check_programs(s.name, s.read_text()) for s in SCRIPTS}
    assert sum(counts.values()) >= 4, counts  # the gate, the watchdog check, both graph checks


def test_negative_control_a_device_check_with_a_stale_flag_is_refused():
    line = 'step g 9 g.log python3 tests/distributed/check_ulysses_graphs.py --capture-engines ce,sm --json "$L/g"\n'
    assert check_programs("good.sh", line) == 1
    with pytest.raises(AssertionError, match=r"bad\.sh:1: .*\['--engines'\] not among its flags"):
        check_programs("bad.sh", line.replace("--capture-engines", "--engines"))
