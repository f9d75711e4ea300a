"""Recorded runs are data: every folder of ``docs/results/`` is one run's ``run.json`` and ``run.log``, its name
starts with the run's date and ends with its commit, and the index page is what ``scripts/results_index.py``
generates from the folders. Negative controls: a folder added, a stray file, a folder dated otherwise than its
run (a run recorded under the day before it ran), a missing key; each makes the check fail, naming it. Beside it:
``docs/`` stays within its file budget, and the glossary is the one place that defines the measurement terms.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DOCS_FILE_BUDGET = 150


def _module():
    spec = importlib.util.spec_from_file_location("results_index", ROOT / "scripts" / "results_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ri = _module()


def _check(results: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/results_index.py", "--results", str(results), "--check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_index_is_generated_from_the_folders():
    proc = _check(RESULTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    page = (RESULTS / "README.md").read_text()
    folders = sorted(p.name for p in RESULTS.iterdir() if p.is_dir())
    assert folders and all(f"[{name}]({name}/run.json)" in page for name in folders)
    assert len(re.findall(r"^\| \d{4}-\d{2}-\d{2} \|", page, re.M)) == len(folders)  # one line per folder


def _two_runs(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    for name in sorted(p.name for p in RESULTS.iterdir() if p.is_dir())[:2]:
        shutil.copytree(RESULTS / name, results / name)
    (results / "README.md").write_text(ri.index(results))
    return results


def test_negative_controls_a_new_folder_a_stray_file_a_wrong_date(tmp_path):
    results = _two_runs(tmp_path)
    assert _check(results).returncode == 0
    first = sorted(p for p in results.iterdir() if p.is_dir())[0]
    run = json.loads((first / "run.json").read_text())
    added = results / f"{run['date']}-h200-copy-{run['commit'].split()[0].strip(',')}"
    shutil.copytree(first, added)  # a folder the index does not list yet
    proc = _check(results)
    assert proc.returncode == 1 and added.name in proc.stderr and "is stale" in proc.stderr
    (results / "README.md").write_text(ri.index(results))
    assert _check(results).returncode == 0
    (added / "plot.png").write_bytes(b"\x89PNG")
    proc = _check(results)
    assert proc.returncode == 1 and f"{added.name}: holds" in proc.stderr and "plot.png" in proc.stderr
    (added / "plot.png").unlink()
    later = results / f"2099-01-02-{added.name[11:]}"  # named for another day than its run.json says
    added.rename(later)
    proc = _check(results)
    assert proc.returncode == 1 and f"the run's date is {run['date']}" in proc.stderr
    shutil.rmtree(later)
    del run["headline"]
    (first / "run.json").write_text(json.dumps(run))
    proc = _check(results)
    assert proc.returncode == 1 and "missing or empty ['headline']" in proc.stderr


def test_pack_makes_one_run_from_an_output_folder(tmp_path):
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    (out / "a2a.json").write_text(json.dumps({"header": {"date": "2026-12-03T10:00:00+00:00", "commit": "abc1234def"},
                                              "rows": [1, 2]}))
    (out / "logs" / "summary.txt").write_text("a2a rc=0\n")
    (out / "logs" / "bench.log.gz").write_bytes(gzip.compress(b"the benchmark's log\n"))
    (out / "README.md").write_text("what this run was for\n")
    results = tmp_path / "results"
    results.mkdir()
    rc = ri.main(["--results", str(results), "pack", str(out), "2026-12-03-h200-a2a-abc1234", "--host", "H200",
                  "--what", "the transport benchmark", "--headline", "0 wrong", "--command", "bash x.sh"])
    run = json.loads((results / "2026-12-03-h200-a2a-abc1234" / "run.json").read_text())
    log = (results / "2026-12-03-h200-a2a-abc1234" / "run.log").read_text()
    assert rc == 0 and (run["date"], run["commit"], run["command"]) == ("2026-12-03", "abc1234", "bash x.sh")
    assert run["data"] == {"a2a.json": {"header": {"date": "2026-12-03T10:00:00+00:00", "commit": "abc1234def"},
                                        "rows": [1, 2]}}
    assert run["notes"] == "what this run was for\n"
    assert "===== logs/bench.log =====\nthe benchmark's log" in log and "===== logs/summary.txt =====" in log
    assert "2026-12-03-h200-a2a-abc1234" in (results / "README.md").read_text()
    with pytest.raises(SystemExit):  # the control: a name that is not the run's commit
        ri.main(["--results", str(results), "pack", str(out), "2026-12-03-h200-a2a-fff0000", "--host", "H200",
                 "--what", "x", "--headline", "y", "--command", "bash x.sh"])


def test_pack_refuses_a_run_without_a_command_or_with_two_commits(tmp_path, capsys):
    """A run names the command that made it: from its JSON headers where they agree, else --command; headers that
    carry two commits (or dates, or commands) need the key given; nothing is written for a refused run."""
    out, results = tmp_path / "out", tmp_path / "results"
    out.mkdir()
    results.mkdir()
    (out / "a.json").write_text(json.dumps({"header": {"date": "2026-12-03", "commit": "abc1234", "command": "x"}}))
    args = ["--results", str(results), "pack", str(out), "2026-12-03-h200-a-abc1234", "--host", "H200", "--what",
            "w", "--headline", "h"]
    assert ri.main(args) == 0  # the header's command
    assert json.loads((results / "2026-12-03-h200-a-abc1234" / "run.json").read_text())["command"] == "x"
    (out / "b.json").write_text(json.dumps({"header": {"date": "2026-12-03", "commit": "bbb1234"}}))
    with pytest.raises(SystemExit):
        ri.main([*args[:4], "2026-12-03-h200-b-abc1234", *args[5:]])
    assert "different commits (abc1234, bbb1234): pass --commit" in capsys.readouterr().err
    assert ri.main([*args[:4], "2026-12-03-h200-b-abc1234", *args[5:], "--commit", "abc1234"]) == 0  # given
    (out / "a.json").write_text(json.dumps({"header": {"date": "2026-12-03", "commit": "abc1234"}}))
    (out / "b.json").unlink()
    with pytest.raises(SystemExit):
        ri.main([*args[:4], "2026-12-03-h200-c-abc1234", *args[5:]])
    assert "nothing gives ['command']: pass --command" in capsys.readouterr().err
    assert sorted(p.name for p in results.iterdir()) == ["2026-12-03-h200-a-abc1234", "2026-12-03-h200-b-abc1234",
                                                         "README.md"]


def test_docs_stay_within_their_file_budget():
    files = [p for p in (ROOT / "docs").rglob("*") if p.is_file()]
    assert len(files) <= DOCS_FILE_BUDGET, f"docs/ holds {len(files)} files, over {DOCS_FILE_BUDGET}"


def test_the_glossary_defines_the_measurements_once_and_the_pages_link_it():
    """``busy_us`` and its siblings are defined in the glossary alone; a page that names one links the glossary."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    terms = ("busy_us", "paired_us", "host_overhead_us")
    for term in terms:
        defining = [p.name for p in pages if f"**`{term}`**" in p.read_text()]
        assert defining == ["glossary.md"], (term, defining)
    for page in pages:
        text = page.read_text()
        if page.name != "glossary.md" and any(f"`{t}`" in text for t in terms):
            assert "glossary.md" in text, page.name
