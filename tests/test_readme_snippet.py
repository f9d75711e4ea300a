"""The README: its API snippet runs as pasted (extracted from README.md and run under torchrun on 2 gloo ranks, the
GPUs hidden, imports and process-group set-up included), and it reads in five minutes (at most 900 words, the two
commands first, the hard constraints in their box). Negative controls: the same snippet with its round-trip
assertion inverted fails, so a snippet that breaks is seen; a padded README, one with the commands moved down and
one with a rule dropped are each flagged."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def api_snippet() -> str:
    """The one python block of the README's API section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, f"the API section should hold one python block, found {len(blocks)}"
    return blocks[0]


def run_under_torchrun(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name in ("FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_CHECKED"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


def test_the_readme_api_snippet_runs_as_pasted_on_two_gloo_ranks(tmp_path):
    code = api_snippet()
    assert "import torch.distributed as dist" in code and "init_process_group" in code  # self-contained
    proc = run_under_torchrun(code, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_negative_control_a_broken_snippet_fails(tmp_path):
    code = api_snippet()
    assert "assert torch.equal(z, x)" in code
    proc = run_under_torchrun(code.replace("assert torch.equal(z, x)", "assert not torch.equal(z, x)"), tmp_path)
    assert proc.returncode != 0 and "AssertionError" in proc.stderr + proc.stdout


README_WORDS = 900


def readme_problems(text: str) -> list[str]:
    """What keeps the README from being read in five minutes: over ``README_WORDS`` words (code included), the two
    commands not first, or a hard constraint missing from its box."""
    problems = []
    if len(text.split()) > README_WORDS:
        problems.append(f"{len(text.split())} words, over {README_WORDS}")
    sections = re.findall(r"^## (.+)$", text, re.M)
    if sections[:2] != ["The two commands", "API"]:
        problems.append(f"sections {sections[:2]}: the two commands first, then the API")
    box = "\n".join(line for line in text.splitlines() if line.startswith(">"))
    for rule in ("What `off` (the default) does not protect", "Untagged calls are matched by their order alone",
                 "The async input is the caller's until `wait()`"):
        if rule not in box:
            problems.append(f"the hard constraints box lacks: {rule}")
    return problems


def test_the_readme_reads_in_five_minutes():
    text = (ROOT / "README.md").read_text()
    assert readme_problems(text) == []
    # The controls: padded past the limit, the commands moved down, a rule dropped from the box.
    assert readme_problems(text + " word" * README_WORDS)[0].endswith(f"over {README_WORDS}")
    moved = text.replace("## The two commands", "## Commands", 1)
    assert any(p.startswith("sections") for p in readme_problems(moved))
    dropped = text.replace("Untagged calls are matched by their order alone", "Calls", 1)
    assert readme_problems(dropped) == ["the hard constraints box lacks: Untagged calls are matched by their order "
                                        "alone"]
