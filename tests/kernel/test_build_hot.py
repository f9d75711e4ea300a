"""The hot-path extension's build script on hosts that are not a GPU host: a CUDA torch on a node without GPUs, or
without CUDA's toolkit where torch's builder looks for it. Pure checks: nothing is compiled."""

from __future__ import annotations

import importlib.util
import os
import types
from pathlib import Path

import pytest
import torch

from tests.kernel.built import REPO


def build_hot() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("build_hot", REPO / "fastvideo-kernel" / "build_hot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("flags", "arches"), [
    ("sm_75 sm_80 sm_86 sm_90 sm_100 sm_120", "7.5;8.0;8.6;9.0;10.0;12.0"),
    ("sm_90a compute_90 sm_100f", "9.0a;9.0;10.0f"),
    ("", ""),
])
def test_the_arch_list_names_the_arches_torch_was_built_for(flags: str, arches: str) -> None:
    assert build_hot().built_arches(flags) == arches


def test_a_cuda_torch_whose_cuda_home_lacks_the_toolkit_says_to_set_it(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))  # no include/cuda_runtime_api.h there
    with pytest.raises(SystemExit, match=rf"CUDA_HOME \({tmp_path}\) has no include/cuda_runtime_api.h: set CUDA_HOME"):
        build_hot().build(tmp_path / "out")
    assert not (tmp_path / "out").exists(), "the check comes before anything is written"


def test_a_cuda_torch_without_gpus_builds_for_its_own_arches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime_api.h").touch()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getArchFlags", lambda: "sm_80 sm_90", raising=False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "")  # recorded, so that what the build sets is undone
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    seen: dict[str, str | None] = {}

    def load(**kwargs: object) -> None:
        seen["arches"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
        raise SystemExit("stop before compiling")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr("shutil.which", lambda *args, **kwargs: "/usr/bin/ninja")
    with pytest.raises(SystemExit, match="stop before compiling"):
        build_hot().build(tmp_path / "out")
    assert seen == {"arches": "8.0;9.0"}
