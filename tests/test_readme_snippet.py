"""The README's API snippet runs as pasted: extracted from README.md and run under torchrun on 2 gloo ranks (the
GPUs hidden), imports and process-group set-up included. Negative control: the same snippet with its round-trip
assertion inverted fails, so a snippet that breaks is seen."""

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
