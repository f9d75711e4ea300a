"""The benchmark cases' GPU paths, where the GPUs exist (every test skips cleanly without them): the floor's
bidirectional peer copy on 2 GPUs, and the one-GPU cases end to end with a valid document and no wrong element."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_peer_copy_both_directions_at_once() -> None:
    from benchmarks.cases import floor

    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    res = floor.peer_copy(64 << 20, devices, iters=5, warmup=2)
    assert res["wrong"] == 0 and res["pairs"] == 2 and len(res["seconds"]) == 5
    assert res["held"] and all(s > 0 for s in res["seconds"])
    # The links are full duplex: both directions at once take about as long as one alone, where copies that
    # shared a stream (or waited for each other) would take twice as long.
    one = floor.peer_copy(64 << 20, devices, iters=5, warmup=2, pairs=[(0, 1)])
    assert one["pairs"] == 1 and one["wrong"] == 0
    assert min(res["seconds"]) < 1.6 * min(one["seconds"]), (res["seconds"], one["seconds"])


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["launch_host", "fused_host_overhead", "copy_engine", "floor"])
def test_one_gpu_case(tmp_path: Path, case: str) -> None:
    if case in ("launch_host", "fused_host_overhead"):
        import fastvideo_kernel

        try:
            fastvideo_kernel.load()
        except Exception as exc:  # noqa: BLE001 - no library here: nothing of these cases can run
            pytest.skip(f"the kernel library does not load: {exc}")
    out = tmp_path / f"{case}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTVIDEO_ULYSSES")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", case, "--quick", "--json", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from benchmarks.harness import report

    doc = json.loads(out.read_text())
    assert report.validate(doc) == [] and doc["header"]["device"].startswith("cuda")
    ran = [r for r in doc["rows"] if "skipped" not in r]
    assert ran and all(r["wrong"] in (0, None) for r in ran)
