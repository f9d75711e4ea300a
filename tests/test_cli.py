"""The CLI, ``python -m fastvideo.distributed.ulysses``: ``explain`` and ``doctor``, one test per rule.

Mostly through ``main(argv)`` in this process (an argparse error is ``SystemExit(2)`` with the message
on stderr); one subprocess smoke checks that ``doctor`` with a bad setting exits 1 without a traceback.
Every test sets the transport variables it needs (``--long-training``, ``monkeypatch``), so none is
marked ambient. The doctor tests that depend on the host say what torch sees of its GPUs (``fake_gpus``), so they
hold alike on a CPU machine, a one-GPU host and a multi-GPU host.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from fastvideo import envs
from fastvideo.distributed.ulysses import __main__ as cli
from fastvideo.distributed.ulysses.policy import TUNED_TABLE

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
H3 = ("--world-size", "4", "--shape", "3,62500,56,128", "--dtype", "bfloat16", "--gpu", "GB200")
PINNED = ("--a2a", "auto", "--long-training", "auto", "--window-bytes", str(GIB))
LIB = "libfastvideo_ulysses_a2a.so"


def explain(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(["explain", *argv])
    return rc, capsys.readouterr().out


def explain_error(capsys, *argv: str) -> str:
    """An argparse error: exit code 2, the message on stderr."""
    with pytest.raises(SystemExit) as info:
        cli.main(["explain", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


def line(out: str, label: str) -> str:
    """The one output line that starts with ``label``."""
    found = [ln for ln in out.splitlines() if ln.startswith(label)]
    assert len(found) == 1, out
    return found[0]


# ------------------------------------------------------------------------------------- explain: plans


def test_explain_inference_prints_144_ctas_one_plane_per_chunk(capsys):
    rc, out = explain(capsys, *H3, *PINNED)
    route = line(out, "route")
    assert rc == 0 and route.startswith("route      fused (tuned: 144 CTAs") and "one plane per chunk" in route


def test_explain_grad_declines_window_under_auto(capsys):
    rc, out = explain(capsys, *H3, "--grad", *PINNED)
    assert rc == 0 and line(out, "route") == "route      nccl (declined: window)"
    assert "long training" in line(out, "why")


def test_explain_grad_long_training_chunked_runs_144_ctas(capsys):
    rc, out = explain(capsys, *H3, "--grad", "--a2a", "auto", "--long-training", "chunked", "--window-bytes", str(GIB))
    assert rc == 0 and "144 CTAs" in line(out, "route") and "one plane per chunk" in line(out, "route")


def test_explain_reads_long_training_from_env_when_not_given(capsys):
    with envs.override(FASTVIDEO_ULYSSES_A2A_LONG_TRAINING="chunked", FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES=None):
        rc, out = explain(capsys, *H3, "--grad", "--a2a", "auto")
    assert rc == 0 and "long_training=chunked" in out and "144 CTAs" in line(out, "route")


@pytest.mark.parametrize(
    "var, flag, given",
    [
        ("FASTVIDEO_ULYSSES_A2A_LONG_TRAINING", "--long-training", ("--window-bytes", str(GIB))),
        ("FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES", "--window-bytes", ("--long-training", "auto")),
    ],
)
def test_explain_invalid_setting_behind_a_default_names_the_variable_and_the_flag(capsys, var, flag, given):
    with envs.override(**{var: "sometimes"}):
        err = explain_error(capsys, *H3, *given)
    assert f"{var}='sometimes' is not valid" in err and f"pass {flag}" in err


def test_explain_input_no_route_can_serve_exits_nonzero(capsys):
    rc, out = explain(capsys, "--world-size", "4", "--shape", "3,62500,54,128", "--gpu", "GB200", *PINNED)
    assert rc == 2 and "not divisible" in out


def test_explain_uneven_splits_sizes_by_the_largest_share_and_names_the_transport_gap(capsys):
    """Rank 1's input with 40 heads at SP3 (Wan 14B) and a sequence P does not divide: the plan of the largest
    share, the tables, and which transports run it (a kernel build older than ABI 5 declines uneven_splits)."""
    rc, out = explain(capsys, "--world-size", "3", "--shape", "1,10920,40,128", "--seq-splits", "10920,10920,10919",
                      "--head-splits", "14,13,13", "--rank", "1", *PINNED)
    assert rc == 0 and "largest S_local share=10920, H=40" in line(out, "geometry")
    assert line(out, "splits") == ("splits     seq [10920, 10920, 10919], heads [14, 13, 13] (uneven: chunks and the "
                                   "window are sized by the largest share)")
    assert f"plane {10920 * 3 * 14 * 128 * 2} B" in line(out, "geometry")
    assert line(out, "route").startswith("route      fused (original: 36 CTAs")
    assert "ABI 5 or later" in line(out, "transport") and "declines uneven_splits" in line(out, "transport")


def test_explain_even_tables_are_the_even_call(capsys):
    """Explicit even tables explain exactly what no tables do (the control: no transport note)."""
    _, plain = explain(capsys, "--world-size", "2", "--shape", "1,8,12,128", *PINNED)
    _, tables = explain(capsys, "--world-size", "2", "--shape", "1,8,12,128", "--seq-splits", "8,8", "--head-splits",
                        "6,6", *PINNED)
    assert plain == tables and "transport" not in plain and "splits     even (8 rows and 6 heads per rank)" in plain


@pytest.mark.parametrize("argv, needle", [
    (("--seq-splits", "8,x"), "argument --seq-splits: '8,x': expected one non-negative integer per SP rank"),
    (("--head-splits", "-1,13"), "argument --head-splits: '-1,13': shares are non-negative (0: an idle rank)"),
    (("--rank", "-1"), "argument --rank: '-1': a rank is non-negative"),
    (("--rank", "7"), "--rank: rank=7 is outside the SP group of size 2"),  # no tables: the rank labels the input
    (("--seq-splits", "8,8", "--rank", "2"), "--rank: rank=2 is outside the SP group of size 2"),
    (("--overlap", "-1"), "argument --overlap: '-1': head groups are non-negative"),
])
def test_explain_bad_tables_are_argparse_errors(capsys, argv, needle):
    assert needle in explain_error(capsys, "--world-size", "2", "--shape", "1,8,12,128", *argv, *PINNED)


@pytest.mark.parametrize("argv, needle", [
    (("--seq-splits", "8,8,8"), "seq_splits has 3 entries for SP size 2"),
    (("--seq-splits", "5,11"), "seq_splits[0] = 5 but this rank's x has 8 sequence rows"),
    (("--head-splits", "5,5"), "head_splits sums to 10 but x has 12 heads"),
])
def test_explain_tables_that_do_not_fit_the_shape_exit_2_with_validate_inputs_message(capsys, argv, needle):
    rc, out = explain(capsys, "--world-size", "2", "--shape", "1,8,12,128", *argv, *PINNED)
    assert rc == 2 and needle in out


# ------------------------------------------------------------------------------------- explain: bad arguments


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_world_size_not_positive_is_an_argparse_error(capsys, value):
    err = explain_error(capsys, "--world-size", value, "--shape", "3,16,8,8", *PINNED)
    assert "argument --world-size" in err and "positive integer" in err


def test_world_size_one_is_the_identity(capsys):
    rc, out = explain(capsys, "--world-size", "1", "--shape", "3,16,8,8", *PINNED)
    assert rc == 0 and "identity" in line(out, "route") and "declined" not in out


def test_world_size_above_eight_still_declines_world_size(capsys):
    rc, out = explain(capsys, "--world-size", "16", "--shape", "3,16,16,8", *PINNED)
    assert rc == 0 and line(out, "route") == "route      nccl (declined: world_size)"


@pytest.mark.parametrize("value", ["0", "-5", "1k"])
def test_window_bytes_has_the_env_settings_minimum(capsys, value):
    var = envs.registry()["FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES"]
    with pytest.raises(ValueError):  # the variable refuses the same value
        var.parse(value)
    err = explain_error(capsys, *H3, "--long-training", "auto", "--window-bytes", value)
    assert "argument --window-bytes" in err and f">= {var.minimum:g}" in err
    assert "FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES" in err


def test_window_bytes_at_the_minimum_is_accepted(capsys):
    rc, out = explain(capsys, *H3, "--a2a", "auto", "--long-training", "auto", "--window-bytes", "1")
    assert rc == 0 and "window=1 B" in out and line(out, "route") == "route      nccl (declined: window)"


@pytest.mark.parametrize("gpu", ["RTX9999", "B200", ""])
def test_gpu_without_tuned_rows_is_named_and_the_tuned_gpus_listed(capsys, gpu):
    rc, out = explain(capsys, *H3[:-2], "--gpu", gpu, *PINNED)
    note = line(out, "tuned row")
    assert rc == 0 and note.startswith("tuned row  none: no ")
    assert ("no GPU model given" if gpu == "" else f"no tuned row exists for GPU {gpu!r}") in note
    for known in {row.gpu for row in TUNED_TABLE}:
        assert known in note
    assert "original policy" in note


def test_gpu_with_rows_but_not_for_this_geometry_lists_its_rows(capsys):
    rc, out = explain(capsys, "--world-size", "2", *H3[2:], *PINNED)
    note = line(out, "tuned row")
    assert rc == 0 and "none for GB200 at SP2" in note and "SP4" in note


def test_gpu_with_a_matching_row_names_it(capsys):
    rc, out = explain(capsys, *H3, *PINNED)
    assert rc == 0 and line(out, "tuned row").startswith("tuned row  GB200/SP4: SM kind, 144 CTAs")
    assert line(out, "kind").startswith("kind       SM kind: the fused kernel's CTAs store")


def test_h200_row_says_copy_engine_and_row_chunks(capsys):
    rc, out = explain(capsys, "--world-size", "2", "--shape", "1,37800,40,128", "--gpu", "H200", *PINNED)
    row = line(out, "tuned row")
    assert rc == 0 and "copy-engine kind, 132 CTAs" in row and "2 row chunks per plane" in row
    assert "copy engine" in line(out, "route") and line(out, "kind").startswith("kind       copy-engine kind: ")


# ------------------------------------------------------------------------------------- explain: what it assumes


def test_explain_applies_the_switch_off_is_the_nccl_route_saying_why(capsys):
    """``FASTVIDEO_ULYSSES_A2A=off`` (the default): the NCCL route, as the helper would take, naming the switch;
    the plan ``auto`` would run is still shown, labelled. Control: ``auto`` in the environment is the fused route."""
    shape = ("--world-size", "2", "--shape", "1,37800,40,128", "--gpu", "H200", "--long-training", "auto")
    with envs.override(FASTVIDEO_ULYSSES_A2A="off"):
        rc, out = explain(capsys, *shape)
    assert rc == 0 and line(out, "route").startswith("route      nccl (FASTVIDEO_ULYSSES_A2A=off: every call takes")
    assert line(out, "switch") == "switch     FASTVIDEO_ULYSSES_A2A=off (from the environment)"
    assert line(out, "with auto").startswith("with auto  fused (tuned, copy engine")
    with envs.override(FASTVIDEO_ULYSSES_A2A="auto"):
        rc, out = explain(capsys, *shape)
    assert rc == 0 and line(out, "route").startswith("route      fused (tuned") and "with auto" not in out


def test_explain_a2a_flag_overrides_the_variable(capsys):
    with envs.override(FASTVIDEO_ULYSSES_A2A="auto"):
        rc, out = explain(capsys, *H3, "--a2a", "OFF", "--long-training", "auto", "--window-bytes", str(GIB))
    assert rc == 0 and line(out, "switch") == "switch     FASTVIDEO_ULYSSES_A2A=off (--a2a)"
    assert line(out, "route").startswith("route      nccl (FASTVIDEO_ULYSSES_A2A=off")


@pytest.mark.parametrize("value", ["on", "1", "fused"])
def test_explain_refuses_an_invalid_switch_as_doctor_does(capsys, settings, value):
    """The same message doctor reports as a problem, as an argparse error naming the variable and the flag.
    Control: the valid spellings pass (the test above)."""
    settings.setenv("FASTVIDEO_ULYSSES_A2A", value)
    err = explain_error(capsys, *H3, "--long-training", "auto", "--window-bytes", str(GIB))
    rc, out = doctor(capsys)
    problem = line(out, "env        PROBLEM").removeprefix("env        PROBLEM: ")
    assert rc == 1 and f"FASTVIDEO_ULYSSES_A2A={value!r} is not valid" in problem
    assert f"{problem} Fix the variable or pass --a2a." in err


def test_explain_without_a_gpu_prints_its_gpu_as_an_assumption(capsys, monkeypatch):
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: False)
    rc, out = explain(capsys, "--world-size", "2", "--shape", "1,37800,40,128", *PINNED)
    assert rc == 0 and line(out, "gpu") == ("gpu        H200 (assumed: this machine has no GPU; pass --gpu to plan "
                                            "for another model)")
    rc, out = explain(capsys, "--world-size", "2", "--shape", "1,37800,40,128", "--gpu", "H200", *PINNED)
    assert rc == 0 and line(out, "gpu") == "gpu        H200 (--gpu)" and "assumed" not in out


def test_explain_with_a_gpu_plans_for_gpu_0(capsys, monkeypatch):
    monkeypatch.setattr(cli.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cli.torch.cuda, "get_device_name", lambda i=0: "NVIDIA GB200")
    rc, out = explain(capsys, *H3[:-2], *PINNED)
    assert rc == 0 and line(out, "gpu") == "gpu        NVIDIA GB200 (GPU 0 of this machine)" and "assumed" not in out
    assert line(out, "tuned row").startswith("tuned row  GB200/SP4")


def test_explain_lists_a_gpus_rows_once_each_naming_their_kind(capsys):
    """H200 has a copy-engine row and an SM row per key: listed without a kind they read as duplicates."""
    rc, out = explain(capsys, "--world-size", "8", "--shape", "1,3276,40,128", "--gpu", "H200", *PINNED)
    note = ". Where the call is eligible (route, below), the original policy applies."
    listed = line(out, "tuned row").split("H200 rows: ")[1].removesuffix(note).split("; ")
    h200 = [r for r in TUNED_TABLE if r.gpu == "H200"]
    assert rc == 0 and len(listed) == len(h200) == len(set(listed))  # control: the same rows without kinds repeat
    assert len({f"SP{r.world_size} {r.dtype} H={r.heads} D={r.head_dim}" for r in h200}) < len(h200)
    for row in h200:
        kind = "copy-engine kind" if row.engine == "ce" else "SM kind"
        assert f"SP{row.world_size} {row.dtype} H={row.heads} D={row.head_dim} ({kind})" in listed


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\((\d+) B\)|\((\d+) of", text) for n in n if n]


def test_explain_copy_engine_reason_gives_the_half_window_limit_beside_the_plane(capsys):
    """A plane smaller than the window but over half of it: the copy-engine kind chunks it, and the reason says the
    limit is half the window, with the numbers, which agree with the geometry line beside it."""
    rc, out = explain(capsys, "--world-size", "2", "--shape", "1,60000,40,128", "--gpu", "H200", *PINNED)
    plane = int(re.search(r"plane (\d+) B", line(out, "geometry")).group(1))
    why = line(out, "why")
    assert rc == 0 and GIB // 2 < plane < GIB  # the case the old reason got wrong: "exceeds the window"
    assert f"plane ({plane} B) exceeds the usable window, half the window for the copy-engine kind " \
           f"({GIB // 2} of {GIB} B)" in why
    stated_plane, stated_limit = _numbers(why)[:2]
    assert stated_plane == plane and stated_plane > stated_limit
    assert f"each chunk must fit half the window ({GIB // 2} of {GIB} B)" in line(out, "kind")


def test_sm_kind_reason_gives_the_whole_window_beside_the_plane():
    """The SM kind's limit is the whole window (control for the test above: no 'half')."""
    from fastvideo.distributed.ulysses.policy import Geometry, choose_plan

    sm = tuple(r for r in TUNED_TABLE if r.gpu == "H200" and r.engine == "sm")
    geom = Geometry.from_input((1, 60000, 40, 128), 0, 2, cli.torch.bfloat16)
    window = 1 << 29
    choice = choose_plan(geom, gpu="H200", window_bytes=window, table=sm)
    assert choice.plan is not None and choice.plan.engine == "sm"
    assert f"plane ({geom.plane_bytes} B) exceeds the window ({window} B)" in choice.why and "half" not in choice.why
    assert geom.plane_bytes > window


@pytest.mark.parametrize("dtype, shown", [("BF16", "torch.bfloat16"), ("BFloat16", "torch.bfloat16"),
                                          ("FP32", "torch.float32"), ("Float16", "torch.float16")])
def test_dtype_is_case_insensitive(capsys, dtype, shown):
    rc, out = explain(capsys, *H3[:4], "--dtype", dtype, *PINNED)
    assert rc == 0 and shown in line(out, "input")


def test_unknown_dtype_lists_the_choices(capsys):
    err = explain_error(capsys, *H3[:4], "--dtype", "int8", *PINNED)
    assert "argument --dtype" in err and "bfloat16" in err and "fp32" in err


@pytest.mark.parametrize("shape", ["-1,62500,56,128", "0,62500,56,128", "3,-1,56,128", "3,62500,-56,128"])
def test_shape_not_positive_says_shapes_are_positive(capsys, shape):
    err = explain_error(capsys, "--world-size", "4", "--shape", shape, *PINNED)
    assert "argument --shape" in err and "shapes are positive" in err and "expected one argument" not in err


def test_a_shape_whose_size_overflows_is_an_error_row_not_a_traceback(capsys):
    rc, out = explain(capsys, "--world-size", "2", "--shape", "99999999999,99999999999,4,8", *PINNED)
    assert rc == 2 and line(out, "error:").startswith("error:     Storage size calculation overflowed"), out


def test_an_idle_ranks_empty_share_is_an_input_and_an_empty_operand_declines_empty(capsys):
    """S_local = 0: an idle rank's input under --seq-splits (which --geometry prints and the helper runs) is
    explained, not refused; every share empty is the op's empty call, which declines ``empty``."""
    rc, out = explain(capsys, "--world-size", "2", "--shape", "3,0,56,128", "--seq-splits", "16,0", "--rank", "1",
                      "--a2a", "auto", *PINNED)
    assert rc == 0 and "per rank [3, 0, 56, 128] (rank 1's input to the op)" in line(out, "input"), out
    assert line(out, "route").startswith("route      fused"), out
    rc, out = explain(capsys, "--world-size", "2", "--shape", "3,0,56,128", "--a2a", "auto", *PINNED)
    assert rc == 0 and line(out, "route") == "route      nccl (declined: empty)", out


def test_shape_with_three_dims_says_four_are_needed(capsys):
    err = explain_error(capsys, "--world-size", "4", "--shape", "3,62500,56", *PINNED)
    assert "four positive integers B,S,H,D" in err


# ------------------------------------------------------------------------------------- doctor


@pytest.fixture
def settings(monkeypatch):
    """Valid transport settings and no library override: doctor then has nothing to complain about."""
    for name in ("FASTVIDEO_ULYSSES_A2A", "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING", "FASTVIDEO_KERNEL_LIBRARY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def fake_gpus(monkeypatch, count: int, peers: bool = True, driver: Path | None = None) -> None:
    """What torch says of this host's GPUs, whatever the host: ``count`` H200s, with peer access or not. ``driver``:
    the driver's GPU listing (``/proc/driver/nvidia/gpus``), which a CPU torch cannot see; default: none."""
    cuda = cli.torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(cuda, "device_count", lambda: count)
    monkeypatch.setattr(cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(cuda, "can_device_access_peer", lambda i, j: peers)
    monkeypatch.setattr(cuda.nccl, "version", lambda: (2, 28, 9))
    monkeypatch.setattr(cli, "_NVIDIA_GPUS", driver or Path("/nonexistent/nvidia/gpus"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def fake_kernel(tmp_path, settings):
    """A repo with a development build and a loader package without a packaged library (what the test
    command leaves behind); ``info()`` answers like the real loader for whichever path is selected. The host: two
    GPUs with peer access (so that the kernel library is what decides), on every host the suite runs on."""
    fake_gpus(settings, 2)
    dev = tmp_path / "repo" / "build" / "kernel" / LIB
    dev.parent.mkdir(parents=True)
    dev.write_bytes(b"\x7fELF fake")
    package = tmp_path / "site" / "fastvideo_kernel"

    def info() -> dict:
        path = Path(os.environ.get("FASTVIDEO_KERNEL_LIBRARY") or package / "lib" / LIB)
        if path == dev:
            return {"path": str(path), "exists": True, "abi_version": 1}
        return {"path": str(path), "exists": False, "error": f"no kernel library at {path}"}

    loader = types.SimpleNamespace(__file__=str(package / "__init__.py"), info=info)
    settings.setattr(cli, "_loader", lambda: loader)
    (tmp_path / "repo" / "fastvideo-kernel").mkdir()
    settings.setattr(cli, "_checkout", lambda: tmp_path / "repo")
    return types.SimpleNamespace(dev=dev, wheel=package / "lib" / LIB)


def doctor(capsys) -> tuple[int, str]:
    rc = cli.main(["doctor"])
    return rc, capsys.readouterr().out


def test_doctor_clean_settings_exit_zero(capsys, fake_kernel):
    rc, out = doctor(capsys)
    assert rc == 0 and "result     no problems found" in out and "FASTVIDEO_ULYSSES_A2A='off'" in out


def test_doctor_reports_invalid_settings_goes_on_and_exits_nonzero(capsys, fake_kernel):
    bad = {"FASTVIDEO_ULYSSES_A2A": "sometimes", "FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES": "0"}
    with envs.override(**bad):
        rc, out = doctor(capsys)
    assert rc == 1
    assert "env        PROBLEM: FASTVIDEO_ULYSSES_A2A='sometimes' is not valid: choose one of off, auto" in out
    assert "PROBLEM: FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES='0' is not valid: must be >= 1" in out
    assert "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING='auto'" in out  # the valid ones are still listed
    assert "gpus " in out and "result     2 problem(s) found:" in out  # it went on to the end


def test_doctor_points_out_a_misspelt_setting(capsys, fake_kernel, settings):
    settings.setenv("FASTVIDEO_ULYSSES_A2A_LONGTRAINING", "chunked")
    rc, out = doctor(capsys)
    assert rc == 0 and "did you mean FASTVIDEO_ULYSSES_A2A_LONG_TRAINING?" in out


def test_doctor_names_every_place_and_how_to_use_the_development_build(capsys, fake_kernel):
    rc, out = doctor(capsys)
    assert rc == 0
    assert "$FASTVIDEO_KERNEL_LIBRARY: -  [unset]" in out
    assert f"the wheel's library: {fake_kernel.wheel}  [missing]" in out
    assert f"development build: {fake_kernel.dev}  [found; loaded only via $FASTVIDEO_KERNEL_LIBRARY]" in out
    assert f"to use a development build: export FASTVIDEO_KERNEL_LIBRARY={fake_kernel.dev}" in out


def test_doctor_with_the_variable_on_the_development_build_loads_it(capsys, fake_kernel, settings):
    settings.setenv("FASTVIDEO_KERNEL_LIBRARY", str(fake_kernel.dev))
    rc, out = doctor(capsys)
    assert rc == 0 and "abi_version: 1" in out
    assert f"$FASTVIDEO_KERNEL_LIBRARY: {fake_kernel.dev}  [found; the loader opens this one]" in out
    assert f"development build: {fake_kernel.dev}  [found; the loader opens this one]" in out
    assert "to use a development build" not in out
    # The hot-path extension is looked for beside the library the loader opens (none built beside the fake one).
    assert f"hot-path extension: not built beside the kernel library (python fastvideo-kernel/build_hot.py --out " \
           f"{fake_kernel.dev.parent})" in out


def test_doctor_variable_on_a_missing_file_is_a_problem(capsys, fake_kernel, settings, tmp_path):
    settings.setenv("FASTVIDEO_KERNEL_LIBRARY", str(tmp_path / "gone.so"))
    rc, out = doctor(capsys)
    assert rc == 1 and f"$FASTVIDEO_KERNEL_LIBRARY: {tmp_path / 'gone.so'}  [MISSING]" in out
    assert "PROBLEM: $FASTVIDEO_KERNEL_LIBRARY is set but unusable" in out


def test_doctor_without_the_loader_package_says_how_to_get_it(capsys, fake_kernel, settings):
    def missing():
        raise ImportError("No module named 'fastvideo_kernel'")

    settings.setattr(cli, "_loader", missing)
    rc, out = doctor(capsys)
    assert rc == 0 and "fastvideo_kernel is not importable" in out
    assert f"PYTHONPATH={cli._checkout() / 'fastvideo-kernel'}" in out


def test_doctor_a_check_that_raises_is_a_finding_and_the_rest_still_runs(capsys, fake_kernel, settings):
    from fastvideo.distributed.ulysses import construction

    def broken():
        raise OSError("no hostname")

    settings.setattr(construction, "host_identity", broken)
    rc, out = doctor(capsys)
    assert rc == 1 and "host       PROBLEM: check raised OSError: no hostname" in out
    assert "kernel     looked for the library" in out and "gpus " in out


def test_doctor_counts_a_missing_kernel_library_as_a_problem_under_auto(capsys, fake_kernel, settings):
    """Under ``auto`` no library means every call declines to the NCCL route: a problem, exit 1. Controls: the same
    machine under ``off`` is fine (a note), and ``auto`` with a loadable library is fine."""
    settings.setenv("FASTVIDEO_ULYSSES_A2A", "auto")
    rc, out = doctor(capsys)
    assert rc == 1 and line(out, "kernel     PROBLEM").startswith("kernel     PROBLEM: no kernel library: ")
    assert "while FASTVIDEO_ULYSSES_A2A=auto every call takes the NCCL route" in out
    assert "declined: transport_missing" in out and "result     1 problem(s) found:" in out
    assert "no problems found" not in out
    settings.setenv("FASTVIDEO_ULYSSES_A2A", "off")
    rc, out = doctor(capsys)
    assert rc == 0 and "(not needed while FASTVIDEO_ULYSSES_A2A=off)" in line(out, "kernel     not available")
    settings.setenv("FASTVIDEO_ULYSSES_A2A", "auto")
    settings.setenv("FASTVIDEO_KERNEL_LIBRARY", str(fake_kernel.dev))
    rc, out = doctor(capsys)
    assert rc == 0 and "result     no problems found" in out


def test_doctor_without_the_loader_package_under_auto_is_a_problem(capsys, fake_kernel, settings):
    def missing():
        raise ImportError("No module named 'fastvideo_kernel'")

    settings.setattr(cli, "_loader", missing)
    settings.setenv("FASTVIDEO_ULYSSES_A2A", "auto")
    rc, out = doctor(capsys)
    assert rc == 1 and "while FASTVIDEO_ULYSSES_A2A=auto every call takes the NCCL route" in out
    assert "PROBLEM: no kernel library: the loader package fastvideo_kernel is not importable" in out


def test_doctor_on_this_machine_never_raises(capsys, settings):
    rc, out = doctor(capsys)
    assert rc in (0, 1) and "python " in out and "kernel     looked for the library" in out and "result " in out


def test_doctor_subprocess_reports_a_bad_setting_without_a_traceback():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FASTVIDEO_ULYSSES_A2A": "sometimes",
           "FASTVIDEO_ULYSSES_A2A_LONG_TRAINING": "auto"}
    env.pop("FASTVIDEO_KERNEL_LIBRARY", None)
    proc = subprocess.run([sys.executable, "-m", "fastvideo.distributed.ulysses", "doctor"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "PROBLEM: FASTVIDEO_ULYSSES_A2A='sometimes'" in proc.stdout and "result     1 problem(s)" in proc.stdout


def test_overlap_plan_lists_each_groups_exchanges(capsys):
    """``--overlap 3`` for 8 heads at SP2: groups of 3, 3, 2 heads, each with its q/k/v and output exchange (the
    uneven groups with their head splits), every one with a route and kind; 9 groups of 8 heads are capped at the
    heads, as the layer caps the setting that --overlap stands for."""
    rc, out = explain(capsys, "--world-size", "2", "--shape", "3,4096,8,64", "--overlap", "3", *PINNED)
    assert rc == 0
    assert line(out, "overlap").startswith("overlap    3 head groups of [3, 3, 2] heads")
    assert line(out, "group 0 qkv").startswith("group 0 qkv [3, 4096, 3, 64] mode 0, head splits [2, 1]: ")
    assert line(out, "group 2 out").startswith("group 2 out [1, 8192, 1, 64] mode 1: ")
    for g in range(3):
        for role in ("qkv", "out"):
            assert any(k in line(out, f"group {g} {role}") for k in ("fused, SM kind", "fused, copy engines",
                                                                      "nccl route"))
    rc, out = explain(capsys, "--world-size", "2", "--shape", "3,4096,8,64", "--overlap", "9", *PINNED)
    assert rc == 0, out
    assert line(out, "overlap").startswith("overlap    8 head groups (capped at H) of [1, 1, 1, 1, 1, 1, 1, 1]")


def test_overlap_from_the_setting_is_capped_at_the_heads_as_the_layer_caps_it(capsys, monkeypatch):
    """FASTVIDEO_ULYSSES_A2A_OVERLAP=8 (valid) on a 4-head layer: the layer runs 4 groups, and so does explain (it
    exited 2 naming --overlap, a flag not passed); a 1-head layer has nothing to pipeline: the setting's line
    says so (exit 0), --overlap's is an error (exit 2)."""
    monkeypatch.setenv("FASTVIDEO_ULYSSES_A2A_OVERLAP", "8")
    rc, out = explain(capsys, "--world-size", "2", "--shape", "6,8,4,16", *PINNED)
    assert rc == 0 and line(out, "overlap").startswith("overlap    4 head groups (capped at H) of [1, 1, 1, 1]"), out
    rc, out = explain(capsys, "--world-size", "1", "--shape", "6,8,1,16", *PINNED)
    assert rc == 0 and line(out, "overlap").startswith("overlap    none: FASTVIDEO_ULYSSES_A2A_OVERLAP=8 pipelines "
                                                       "DistributedAttention layers, whose packed q/k/v exchange "
                                                       "needs a layer of 2 heads or more (H = 1)"), out
    rc, out = explain(capsys, "--world-size", "1", "--shape", "6,8,1,16", "--overlap", "8", *PINNED)
    assert rc == 2 and "error: --overlap 8 explains a layer's packed q/k/v [3B, S_local, H, D]: a layer of 2 " \
                       "heads or more (H = 1)" in out, out


def test_overlap_of_heads_the_sp_size_does_not_divide_takes_the_layers_head_split(capsys):
    """5 heads at SP2: the op needs head_splits, and --overlap takes the layer's own (3, 2: larger shares first),
    describing the groups the layer runs (3 + 2 heads; group 0's split 2 + 1); another split is an error naming it."""
    rc, out = explain(capsys, "--world-size", "2", "--shape", "3,4096,5,64", "--overlap", "2", *PINNED)
    assert rc == 2 and "pass head_splits" in out
    rc, out = explain(capsys, "--world-size", "2", "--shape", "3,4096,5,64", "--head-splits", "3,2", "--overlap", "2",
                      *PINNED)
    assert rc == 0 and line(out, "overlap").startswith("overlap    2 head groups of [3, 2] heads"), out
    assert line(out, "group 0 qkv").startswith("group 0 qkv [3, 4096, 3, 64] mode 0, head splits [2, 1]: ")
    assert line(out, "group 1 qkv").startswith("group 1 qkv [3, 4096, 2, 64] mode 0: ")
    rc, out = explain(capsys, "--world-size", "2", "--shape", "3,4096,5,64", "--head-splits", "2,3", "--overlap", "2",
                      *PINNED)
    assert rc == 2 and "the layer's head split (even, or --head-splits 3,2)" in out, out


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_overlap_of_an_input_that_is_no_packed_qkv_is_an_error_not_a_traceback(capsys, monkeypatch, batch):
    """A layer's packed q/k/v has a batch of 3B. ``--overlap`` with a batch that is no multiple of 3 exits 2
    naming the batch, the op's rows printed first. FASTVIDEO_ULYSSES_A2A_OVERLAP (--overlap's default) applies to
    layers alone: the same call, a plain op call, exits 0 with a line saying why no groups are described (it
    exited 2, and so did the README's explain of wan720p with the variable set). Control: batch 3 describes the
    groups."""
    rc, out = explain(capsys, "--world-size", "2", "--shape", f"{batch},4096,8,64", "--overlap", "2", *PINNED)
    assert rc == 2 and f"a batch of 3B (this input's is {batch})" in line(out, "error:") and line(out, "route"), out
    monkeypatch.setenv("FASTVIDEO_ULYSSES_A2A_OVERLAP", "2")
    rc, out = explain(capsys, "--world-size", "2", "--shape", f"{batch},4096,8,64", *PINNED)
    assert rc == 0 and f"needs a batch of 3B (this input's is {batch}); this call is no such exchange" in out, out
    rc, out = explain(capsys, "--world-size", "2", "--geometry", "wan720p", *PINNED)
    assert rc == 0 and line(out, "overlap").startswith("overlap    none: FASTVIDEO_ULYSSES_A2A_OVERLAP=2"), out
    rc, out = explain(capsys, "--world-size", "2", "--shape", "3,4096,8,64", *PINNED)
    assert rc == 0 and line(out, "overlap").startswith("overlap    2 head groups"), out


# ------------------------------------------------------------------------------------- doctor: what blocks the route


ADVICE = ("to use a development build", "to make a development build", "PYTHONPATH=", "pip install")


@pytest.mark.parametrize("count, peers, blocked", [
    (0, False, "1 of 6: no CUDA GPU"), (1, False, "2 of 6: one GPU only"), (2, False, "3 of 6: no NVLink peer"),
    (8, True, "4 of 6: no kernel library")])
def test_doctor_names_the_first_blocker_the_host_before_the_kernel(capsys, fake_kernel, settings, count, peers,
                                                                     blocked):
    """No kernel library is in use (the wheel's is missing, the variable unset) under ``auto``. Where the host's GPUs
    cannot run the fused route, doctor names that, gives no build advice and finds no problem (nothing built here
    would help); on 2+ GPUs with peer access the library is the blocker and the problem, with how to get one."""
    fake_gpus(settings, count, peers)
    settings.setenv("FASTVIDEO_ULYSSES_A2A", "auto")
    rc, out = doctor(capsys)
    assert line(out, "fused").startswith(f"fused      blocked at {blocked}"), out
    if count < 2 or not peers:
        assert rc == 0 and "PROBLEM" not in out and not any(a in out for a in ADVICE), out
        assert line(out, "fused").endswith("; nothing on this host can change that")
        assert "of no use on this host" in line(out, "kernel     not available")
    else:
        assert rc == 1 and f"to use a development build: export FASTVIDEO_KERNEL_LIBRARY={fake_kernel.dev}" in \
            line(out, "fused")


def test_doctor_advises_only_what_this_host_can_change(capsys, fake_kernel, settings, tmp_path):
    """A CPU build of torch where the driver lists GPUs: install a CUDA torch. A CUDA torch that sees none of the
    driver's GPUs under ``CUDA_VISIBLE_DEVICES`` ("" or "-1"): the variable hides them. One GPU visible under
    ``CUDA_VISIBLE_DEVICES``: the variable may hide the others. Controls: neither, and nothing to advise."""
    driver = tmp_path / "nvidia-gpus"
    (driver / "0000:18:00.0").mkdir(parents=True)
    settings.setattr(cli.torch.version, "cuda", None)
    fake_gpus(settings, 0, driver=driver)
    assert line(doctor(capsys)[1], "fused").endswith("this torch is a CPU build and the driver lists GPUs: install a "
                                                     "CUDA build of torch")
    fake_gpus(settings, 0)
    assert line(doctor(capsys)[1], "fused").endswith("nothing on this host can change that")
    settings.setattr(cli.torch.version, "cuda", "13.0")
    for hidden in ("", "-1"):
        fake_gpus(settings, 0, driver=driver)
        settings.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert line(doctor(capsys)[1], "fused").endswith(f"the driver lists GPUs: CUDA_VISIBLE_DEVICES={hidden!r} "
                                                         "hides them")
    fake_gpus(settings, 0, driver=driver)  # the variable unset: a CUDA torch that sees none of them, no advice
    assert line(doctor(capsys)[1], "fused").endswith("nothing on this host can change that")
    fake_gpus(settings, 1)
    settings.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert line(doctor(capsys)[1], "fused").endswith("one SP rank each); CUDA_VISIBLE_DEVICES=3 may hide the others")
    settings.delenv("CUDA_VISIBLE_DEVICES")
    assert line(doctor(capsys)[1], "fused").endswith("one SP rank each); nothing on this host can change that")


def _loader_with(info: dict):
    from fastvideo_kernel import nccl_version_tuple  # the real loader's (the caller puts it on the path)

    path = info["path"]
    return types.SimpleNamespace(__file__=str(Path(path).parent / "fastvideo_kernel" / "__init__.py"),
                                 info=lambda: {"exists": True, **info}, nccl_version_tuple=nccl_version_tuple)


@pytest.mark.parametrize("info, why", [
    ({"abi_version": 1, "problem": "kernel ABI 1 is older than the oldest supported (2)"}, "kernel ABI 1 is older"),
    ({"abi_version": 5, "nccl_build": 22809, "nccl_runtime": 23007},
     "kernel built against NCCL 2.28.9, process runs NCCL 2.30.7"),
])
def test_doctor_blocker_5_is_a_library_this_package_cannot_drive(capsys, fake_kernel, settings, info, why):
    """A library that loads but is too old for this package, or built for another NCCL than the process runs:
    blocker 5, a problem under ``auto``. Control: the same library at the matching NCCL is no blocker."""
    settings.syspath_prepend(str(ROOT / "fastvideo-kernel"))  # the loader's version helper, as where it is installed
    settings.setattr(cli, "_loader", lambda: _loader_with({"path": str(fake_kernel.dev), **info}))
    settings.setenv("FASTVIDEO_ULYSSES_A2A", "auto")
    rc, out = doctor(capsys)
    assert rc == 1 and line(out, "fused").startswith(f"fused      blocked at 5 of 6: kernel library unusable: {why}")
    # the helper's transport declines such a library transport_too_old or nccl_runtime_mismatch, not as missing
    assert "declined: transport_missing" not in out and "every call takes the NCCL route" in out
    fake_kernel.dev.unlink()  # no development build to point at: the fix is to make one
    rc, out = doctor(capsys)
    built = "2.30.7" if "nccl_runtime" in info else "2.28.9"  # the NCCL the process runs, where the library says
    assert rc == 1 and f"bash scripts/build_kernel.sh {built} build/kernel; set FASTVIDEO_KERNEL_LIBRARY to it" in out
    settings.setattr(cli, "_loader", lambda: _loader_with({"path": str(fake_kernel.dev), "abi_version": 5,
                                                           "nccl_build": 22809, "nccl_runtime": 22809}))
    rc, out = doctor(capsys)
    assert rc == 0 and line(out, "fused").startswith("fused      available: every requirement is met")


def test_doctor_blocker_6_is_the_setting(capsys, fake_kernel, settings):
    """Everything else in place: unset (the default ``off``) and ``off`` are blocker 6 with the fix, not problems;
    ``auto`` is no blocker."""
    settings.setenv("FASTVIDEO_KERNEL_LIBRARY", str(fake_kernel.dev))
    rc, out = doctor(capsys)
    assert rc == 0 and line(out, "fused") == ("fused      blocked at 6 of 6: the setting: FASTVIDEO_ULYSSES_A2A=off "
                                              "(default): every call takes the NCCL route; export "
                                              "FASTVIDEO_ULYSSES_A2A=auto")
    settings.setenv("FASTVIDEO_ULYSSES_A2A", "off")
    rc, out = doctor(capsys)
    assert rc == 0 and "FASTVIDEO_ULYSSES_A2A=off: every call" in line(out, "fused")
    settings.setenv("FASTVIDEO_ULYSSES_A2A", "auto")
    rc, out = doctor(capsys)
    assert rc == 0 and line(out, "fused").startswith("fused      available")


def test_doctor_reports_an_invalid_route_as_invalid_on_every_line_never_as_off(capsys, fake_kernel, settings):
    """``FASTVIDEO_ULYSSES_A2A=bogus``: the environment's problem, the checked mode, the kernel note and the verdict
    all say invalid; no line reads it as ``off``. Control: unset, the same lines say off."""
    off = ("FASTVIDEO_ULYSSES_A2A=off", "FASTVIDEO_ULYSSES_A2A='off'", "the route is off")
    rc, out = doctor(capsys)
    assert rc == 0 and all(text in out for text in off)
    settings.setenv("FASTVIDEO_ULYSSES_A2A", "bogus")
    rc, out = doctor(capsys)
    assert rc == 1 and not any(text in out for text in off), out
    assert "PROBLEM: FASTVIDEO_ULYSSES_A2A='bogus' is not valid" in out
    assert line(out, "env          checked mode") == "env          checked mode unknown: FASTVIDEO_ULYSSES_A2A is " \
                                                    "invalid (above)"
    assert line(out, "kernel     not available").endswith("(FASTVIDEO_ULYSSES_A2A is invalid (above))")
    settings.setenv("FASTVIDEO_KERNEL_LIBRARY", str(fake_kernel.dev))
    rc, out = doctor(capsys)
    assert line(out, "fused") == ("fused      blocked at 6 of 6: the setting: FASTVIDEO_ULYSSES_A2A='bogus' is "
                                  "invalid (off or auto): a job refuses to start")


# ------------------------------------------------------------------------------------- explain: global geometry


EXPLAIN = ("--gpu", "H200", *PINNED)


def test_explain_geometry_is_the_global_operand_and_the_header_prints_both_shapes(capsys):
    """``--geometry wan720p`` at SP2 plans rank 0's half, as ``--shape 1,37800,40,128`` does; the documented global
    shape typed as ``--shape`` is twice the data, and the header says so."""
    rc, named = explain(capsys, "--world-size", "2", "--geometry", "wan720p", *EXPLAIN)
    assert rc == 0 and line(named, "input").startswith(
        "input      global [1, 75600, 40, 128] (wan720p), per rank [1, 37800, 40, 128] (rank 0's input to the op)")
    rc, shaped = explain(capsys, "--world-size", "2", "--shape", "1,37800,40,128", *EXPLAIN)
    assert rc == 0 and line(shaped, "input").startswith("input      global [1, 75600, 40, 128], per rank [1, 37800,")
    assert named.splitlines()[1:] == shaped.splitlines()[1:]  # the same plan
    rc, doubled = explain(capsys, "--world-size", "2", "--shape", "1,75600,40,128", *EXPLAIN)
    assert line(doubled, "input").startswith("input      global [1, 151200, 40, 128], per rank [1, 75600, 40, 128]")
    assert line(doubled, "geometry") != line(named, "geometry")


def test_explain_geometry_in_mode_1_and_with_uneven_shares(capsys):
    rc, out = explain(capsys, "--world-size", "4", "--geometry", "h3-32k", "--mode", "1", *EXPLAIN)
    assert rc == 0 and line(out, "input").startswith("input      global [3, 32768, 56, 128] (h3-32k), per rank "
                                                     "[3, 32768, 14, 128]")
    rc, out = explain(capsys, "--world-size", "3", "--geometry", "1,100,8,64", "--seq-splits", "40,30,30",
                      "--head-splits", "3,3,2", "--rank", "1", *EXPLAIN)
    assert rc == 0 and line(out, "input").startswith("input      global [1, 100, 8, 64] (1,100,8,64), per rank "
                                                     "[1, 30, 8, 64] (rank 1's input")


@pytest.mark.parametrize("argv, needle", [
    (("--world-size", "2", "--geometry", "h3"), "choose one of wan720p, h3-32k, h3-128k, h3-250k, toy or give"),
    (("--world-size", "2", "--geometry", "1,75601,40,128"),
     "--geometry 1,75601,40,128: S=75601 does not divide by the SP size 2: pass --seq-splits or another --world-size"),
    (("--world-size", "3", "--geometry", "1,100,8,64", "--seq-splits", "40,30,20"),
     "--geometry 1,100,8,64: --seq-splits sums to 90, not S=100"),
    (("--world-size", "2", "--geometry", "wan720p", "--shape", "1,37800,40,128"), "not allowed with argument"),
    # a negative first value reaches the type check (argparse alone said only "expected one argument")
    (("--world-size", "2", "--geometry", "-1,8,4,8"), "argument --geometry: '-1,8,4,8': shapes are positive; B=-1"),
])
def test_explain_bad_geometry_is_an_argparse_error_naming_the_fix(capsys, argv, needle):
    assert needle in explain_error(capsys, *argv, *EXPLAIN)


def test_explain_geometry_names_are_the_benchmarks_names():
    """One table: the benchmarks' ``--geometry`` presets are the package's, and reading them does not import the
    package (the benchmarks choose the tree they measure first)."""
    from benchmarks.harness import cli as bench
    from fastvideo.distributed.ulysses.geometries import GEOMETRIES

    assert bench.PRESETS == GEOMETRIES and {"wan720p", "h3-32k"} <= set(GEOMETRIES)
    probe = "import sys, benchmarks.harness.cli as c; print(len(c.PRESETS), 'fastvideo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.split() == [str(len(GEOMETRIES)), "False"], done.stdout + done.stderr


def test_explain_says_default_for_an_unset_variable(capsys, settings):
    """Unset: ``(default)``; set: ``(from the environment)``; a flag: the flag."""
    for name in ("FASTVIDEO_ULYSSES_A2A_WINDOW_BYTES", "FASTVIDEO_ULYSSES_A2A_OVERLAP"):
        settings.delenv(name, raising=False)
    rc, out = explain(capsys, *H3)
    assert rc == 0 and line(out, "switch") == "switch     FASTVIDEO_ULYSSES_A2A=off (default)"
    assert line(out, "policy") == f"policy     grad=False long_training=auto (default) window={GIB} B (default)"
    settings.setenv("FASTVIDEO_ULYSSES_A2A_LONG_TRAINING", "chunked")
    rc, out = explain(capsys, *H3, "--window-bytes", "4096")
    assert "long_training=chunked (from the environment) window=4096 B (--window-bytes)" in line(out, "policy")
