"""The commit a record names: a ``COMMIT`` stamp (what an exported tree carries instead of ``.git``) or the
checkout's HEAD, whichever the tree's files are, by one rule (``benchmarks/harness/commit.py``'s
``describe_commit``), which the GPU scripts run from bash (``scripts/gpu_lib.sh``'s ``tree_commit``): case by case
both entries give the same answer, the commit on stdout and the note on stderr from bash.

A stamp left behind in a checkout that has moved on must not win over HEAD; a tree copied over a checkout of another
commit (a GPU host's copy: its ``.git`` names that other commit) keeps its stamp; an exported tree without ``.git``
keeps its stamp exactly as before. Where stamp and HEAD disagree the record says so (a note beside the commit, on
stderr). ``gpu_init`` writes the note into ``commit.txt``, and ``gpu_fresh_export.sh`` exports HEAD with ``git
archive`` where HEAD is the tree's commit, whatever a stale stamp says.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness.commit import describe_commit

ROOT = Path(__file__).resolve().parents[1]
LIB = ROOT / "scripts" / "gpu_lib.sh"
RULE = "benchmarks/harness/commit.py"
UNKNOWN = "f" * 40  # a commit no test repository has


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          capture_output=True, text=True, check=True, env=env).stdout.strip()


def _repo(path: Path, extra: dict[str, str] | None = None) -> tuple[str, str]:
    """A checkout at ``path`` with two commits, A (a.txt "1") and B (a.txt "2", HEAD); ``extra`` files (path ->
    text) committed in A. Returns (A, B)."""
    path.mkdir(parents=True)
    _git(path, "init", "-q")
    (path / ".gitignore").write_text("/COMMIT\n")
    (path / "a.txt").write_text("1\n")
    for name, text in (extra or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    _git(path, "add", "-A")
    _git(path, "commit", "-q", "-m", "A")
    a = _git(path, "rev-parse", "HEAD")
    (path / "a.txt").write_text("2\n")
    _git(path, "commit", "-q", "-am", "B")
    return a, _git(path, "rev-parse", "HEAD")


def _bash(tree: Path) -> tuple[str, str]:
    """``tree_commit TREE`` of gpu_lib.sh: (stdout, stderr)."""
    proc = subprocess.run(["bash", "-c", 'source "$1"; tree_commit "$2"', "_", str(LIB), str(tree)],
                          capture_output=True, text=True, check=True, timeout=60)
    return proc.stdout.strip(), proc.stderr.strip()


def _both(tree: Path) -> tuple[str, str | None]:
    """The rule's answer from Python, checked against bash's entry: the same commit, a note from both or neither."""
    commit, note = describe_commit(tree)
    out, err = _bash(tree)
    assert (out, bool(err)) == (commit, bool(note)), (out, err, commit, note)
    return commit, note


# Each case: how the tree is left after _repo (stamp: "A", "B", UNKNOWN or None; the file a.txt's text), then
# which commit is true ("A", "B", "stamp") with or without -dirty, and whether a note is due.
CASES = {
    "no stamp, clean": (None, "2\n", "B", False),
    "stamp is HEAD": ("B", "2\n", "B", False),
    "stamp is HEAD, changed file": ("B", "3\n", "B-dirty", False),
    "stale stamp, clean": ("A", "2\n", "B", True),
    "stale stamp, changed file": ("A", "3\n", "B-dirty", True),
    "copied over another commit's checkout": ("A", "1\n", "A", True),
    "unknown stamp, files not HEAD's": (UNKNOWN, "1\n", "stamp", True),
    "unknown stamp, files HEAD's": (UNKNOWN, "2\n", "B", True),
}


@pytest.mark.parametrize("case", CASES)
def test_the_files_decide_between_stamp_and_head(tmp_path: Path, case: str) -> None:
    stamp, text, expected, noted = CASES[case]
    repo = tmp_path / "repo"
    a, b = _repo(repo)
    names = {"A": a, "B": b, "stamp": stamp}
    if stamp is not None:
        (repo / "COMMIT").write_text(f"{names.get(stamp, stamp)}\n")
    (repo / "a.txt").write_text(text)
    commit, note = _both(repo)
    head, _, dirty = expected.partition("-")
    assert commit == names[head] + (f"-{dirty}" if dirty else "")
    assert bool(note) == noted
    if noted:
        assert f"COMMIT stamp {names.get(stamp, stamp)} disagrees with this checkout's HEAD {b}" in note
        assert ("recorded HEAD" in note) == (head == "B")


def test_an_exported_tree_keeps_its_stamp(tmp_path: Path) -> None:
    """Controls: no ``.git`` (an exported tree), and a folder inside another checkout (``.revs/base``), take the
    stamp as before, without a note; without a stamp, "unknown" (never the enclosing repository's HEAD)."""
    exported = tmp_path / "export"
    exported.mkdir()
    (exported / "COMMIT").write_text("v1-export\n")
    assert _both(exported) == ("v1-export", None)
    (exported / "COMMIT").unlink()
    assert _both(exported) == ("unknown", None)
    repo = tmp_path / "repo"
    _repo(repo)
    inner = repo / ".revs" / "base"
    inner.mkdir(parents=True)
    (inner / "COMMIT").write_text("older\n")
    assert _both(inner) == ("older", None)


def _scripts_repo(tmp_path: Path, *scripts: str) -> tuple[Path, str, str]:
    """A checkout holding copies of ``scripts`` and of the rule they run (committed), with a stale stamp: COMMIT
    names A, HEAD is B."""
    repo = tmp_path / "repo"
    files = {f"scripts/{s}": (ROOT / "scripts" / s).read_text() for s in scripts}
    files[RULE] = (ROOT / RULE).read_text()
    a, b = _repo(repo, files)
    (repo / "COMMIT").write_text(f"{a}\n")
    return repo, a, b


def test_gpu_init_records_head_and_the_note_beside_a_stale_stamp(tmp_path: Path) -> None:
    repo, a, b = _scripts_repo(tmp_path, "gpu_lib.sh")
    work = tmp_path / "work"
    proc = subprocess.run(["bash", "-c", 'source scripts/gpu_lib.sh && gpu_init t'], cwd=repo, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "WORK": str(work), "OUT": str(work / "out")})
    assert proc.returncode == 0, proc.stderr
    lines = (work / "logs" / "commit.txt").read_text().splitlines()
    assert lines[0] == f"commit {b}"
    assert lines[1].startswith(f"note: the COMMIT stamp {a} disagrees") and lines[1].endswith(f"recorded HEAD ({b})")
    assert lines[1].removeprefix("note: ") in proc.stderr
    assert not (work / "logs" / "commit_note.txt").exists()


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_fresh_export_archives_head_whatever_a_stale_stamp_says(tmp_path: Path) -> None:
    """The export's set-up alone: ``BUDGET_S=1`` leaves no time for its steps (each is skipped), and ``true``
    stands in for the host's python."""
    repo, _, b = _scripts_repo(tmp_path, "gpu_lib.sh", "gpu_fresh_export.sh")
    work = tmp_path / "work"
    env = {**os.environ, "WORK": str(work), "OUT": str(work / "out"), "PYTHON": "true", "BUDGET_S": "1"}
    subprocess.run(["bash", "scripts/gpu_fresh_export.sh"], cwd=repo, capture_output=True, text=True, timeout=120,
                   env=env)
    assert "exported: git archive HEAD" in (work / "logs" / "export.txt").read_text()
    assert (work / "tree" / "COMMIT").read_text().strip() == b
    assert (work / "tree" / "a.txt").read_text() == "2\n"


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_a_step_cut_at_its_limit_keeps_what_it_prints_on_the_way_out(tmp_path: Path) -> None:
    """``step`` stops a command at its limit with SIGINT, so a Python step (pytest's summary with its failures'
    text) prints what it has before it stops; the line in summary.txt says the limit's exit status, 124."""
    work = tmp_path / "work"
    # The text it prints on the way out is built at run time: the log echoes the command, code included.
    code = ("import time\ntry:\n    print('started', flush=True); time.sleep(60)\n"
            "except KeyboardInterrupt:\n    print('-'.join(('failures', 'so', 'far')), flush=True)")
    script = f'source scripts/gpu_lib.sh && gpu_init t && step cut 2 cut.log {shlex.quote(sys.executable)} -c "$CODE"'
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "WORK": str(work), "OUT": str(work / "out"), "CODE": code})
    assert proc.returncode == 124, proc.stderr
    log = (work / "logs" / "cut.log").read_text()
    assert "started" in log and "failures-so-far" in log
    assert (work / "logs" / "summary.txt").read_text().split()[:2] == ["cut", "rc=124"]


def test_the_header_carries_and_prints_the_note(capsys: pytest.CaptureFixture[str]) -> None:
    """``commit_note`` is in every header (None where nothing disagrees) and, where set, printed with the header
    and on stderr; unset, nothing is printed for it."""
    import torch

    from benchmarks.harness.header import build_header, print_header

    header = build_header(torch.device("cpu"), 1, case="x")
    assert "commit_note" in header
    print_header({**header, "commit_note": None})
    out, err = capsys.readouterr()
    assert "commit note" not in out and "commit_note" not in out and not err
    print_header({**header, "commit": "c0ffee", "commit_note": "the COMMIT stamp 1 disagrees"})
    out, err = capsys.readouterr()
    assert "# commit note: the COMMIT stamp 1 disagrees" in out
    assert "warning: commit c0ffee: the COMMIT stamp 1 disagrees" in err
