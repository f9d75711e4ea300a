"""The main job (README's first command) runs to OK on 2 gloo ranks, prints medians of warm iterations,
and refuses bad arguments clearly."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from sp_recipes import sp_attention_demo

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(?P<route>(off|auto)->\S+(?: \([a-z_, ]+\))?)\s+x\[\S+\] qkv\[\S+\]\s+(?P<median>\d+\.\d)\s+"
                 r"(?P<lo>\d+\.\d)-(?P<hi>\d+\.\d)\s+(?P<errs>(?:\S+\s+){3})(?P<result>OK|FAIL)$")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples")])}  # sp_recipes: examples/
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "FASTVIDEO_ULYSSES_A2A"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "sp_recipes.sp_attention_demo", "--device", "cpu", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_demo_prints_one_row_per_route_with_the_median_of_warm_iterations():
    proc = _run("--seq", "96", "--hidden", "64", "--heads", "4", "--warmup", "1", "--iters", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "OK"
    assert any(line.startswith("time: ") and "median and min-max of 3 iterations after 1 untimed warm-up" in line
               for line in lines)
    rows = [m for m in map(ROW.match, lines) if m]
    assert [m["route"].split("->")[0] for m in rows] == ["off", "auto"], proc.stdout
    for m in rows:
        assert m["result"] == "OK" and float(m["lo"]) <= float(m["median"]) <= float(m["hi"])
    # On CPU there is no fused transport: auto must say it took the NCCL route and why.
    assert rows[1]["route"] == "auto->nccl (transport_missing)"


def test_demo_rejects_heads_not_divisible_by_sp_size():
    proc = _run("--heads", "3", "--hidden", "48", "--seq", "96")
    assert proc.returncode != 0
    assert "--heads=3 must be divisible by the SP size 2" in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("flag", ["--warmup", "--iters"])
def test_demo_needs_at_least_one_warmup_and_one_timed_iteration(flag, capsys):
    with pytest.raises(SystemExit) as info:  # refused before any process group exists
        sp_attention_demo.main([flag, "0"])
    assert info.value.code == 2 and f"{flag}=0: must be >= 1" in capsys.readouterr().err
