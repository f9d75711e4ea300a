"""``fastvideo`` and ``fastvideo.attention``: upstream FastVideo 0.2.1's package surface, resolved lazily.

Each check runs in a fresh interpreter. Alone (this tree): importing the packages loads nothing else (no torch),
upstream's names raise an ImportError that says they need upstream FastVideo, ``__version__`` is this package's.
Over upstream (simulated: this tree's two ``__init__.py`` files beside stand-ins at upstream's module paths):
upstream's eager imports run, in its order, and the same names resolve to upstream's objects and ``__version__`` to
upstream's release. The exported names are a
committed list, compared with upstream's own ``__init__.py`` files where the unpacked wheel is present. Negative
control: the standalone run's ImportError assertions fail in the simulated overlay, where the names exist.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests import upstream_tree

ROOT = pathlib.Path(__file__).resolve().parents[1]
UPSTREAM_ALL = {
    "fastvideo": ["VideoGenerator", "PipelineConfig", "SamplingParam", "__version__"],
    "fastvideo.attention": ["DistributedAttention", "LocalAttention", "DistributedAttention_VSA", "AttentionBackend",
                            "AttentionMetadata", "AttentionMetadataBuilder", "get_attn_backend"],
}
# What importing fastvideo, fastvideo.attention and fastvideo.envs loads: nothing else (no torch, no layer).
LIGHT = ["fastvideo", "fastvideo.attention", "fastvideo.envs", "fastvideo.upstream_envs"]
# What upstream's own fastvideo/__init__.py imports, in its order (the overlay runs the same imports).
UPSTREAM_EAGER = ["fastvideo.configs.pipelines", "fastvideo.api.sampling_param",
                  "fastvideo.entrypoints.video_generator"]
UPSTREAM_ONLY = {"fastvideo": ["VideoGenerator", "PipelineConfig", "SamplingParam"],
                 "fastvideo.attention": ["AttentionBackend", "AttentionMetadata", "AttentionMetadataBuilder",
                                         "get_attn_backend"]}

PROBE = textwrap.dedent("""
    import json, sys
    import fastvideo, fastvideo.attention, fastvideo.envs
    report = {"loaded": sorted(m for m in sys.modules if m.startswith(("fastvideo", "torch"))),
              "version": fastvideo.__version__, "names": {}}
    for package, names in json.loads(sys.argv[1]).items():
        module = sys.modules[package]
        for name in names:
            try:
                value = getattr(module, name)
                report["names"][f"{package}.{name}"] = ["ok", getattr(value, "__module__", None) or repr(value)]
            except Exception as exc:
                report["names"][f"{package}.{name}"] = [type(exc).__name__, str(exc)]
    report["dir"] = sorted(set(dir(fastvideo)) & {"VideoGenerator", "__version__"})
    print(json.dumps(report))
""")


def _probe(pythonpath: pathlib.Path, names: dict[str, list[str]]) -> dict:
    """Import the packages in a fresh interpreter on ``pythonpath`` and resolve ``names`` (package -> names)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(names)], capture_output=True, text=True,
                          env=env, cwd=pythonpath, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_exports_are_upstreams_list():
    import fastvideo
    from fastvideo import attention

    assert sorted(fastvideo.__all__) == sorted(UPSTREAM_ALL["fastvideo"])
    assert sorted(attention.__all__) == sorted(UPSTREAM_ALL["fastvideo.attention"])


def test_alone_imports_nothing_and_names_upstream_where_it_is_missing():
    report = _probe(ROOT, UPSTREAM_ALL)
    assert report["loaded"] == LIGHT
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert report["version"] == version
    for package, names in UPSTREAM_ONLY.items():
        for name in names:
            kind, message = report["names"][f"{package}.{name}"]
            assert kind == "ImportError" and "upstream FastVideo" in message and "Copy it over" in message, name
    for name in ("DistributedAttention", "DistributedAttention_VSA", "LocalAttention"):
        assert report["names"][f"fastvideo.attention.{name}"] == ["ok", "fastvideo.attention.layer"]
    assert report["dir"] == ["VideoGenerator", "__version__"]


def _simulated_overlay(tmp: pathlib.Path) -> pathlib.Path:
    """This tree's package files beside stand-ins for upstream's modules at upstream's paths."""
    files = {
        "version.py": '__version__ = "0.2.1"\n',
        "configs/__init__.py": "",
        "configs/pipelines.py": "class PipelineConfig: ...\n",
        "api/__init__.py": "",
        "api/sampling_param.py": "class SamplingParam: ...\n",
        "entrypoints/__init__.py": "",
        "entrypoints/video_generator.py": "class VideoGenerator: ...\n",
        "attention/selector.py": "def get_attn_backend(*args, **kwargs): ...\n",
        "attention/backends/__init__.py": "",
        "attention/backends/abstract.py": "class AttentionBackend: ...\nclass AttentionMetadata: ...\n"
                                          "class AttentionMetadataBuilder: ...\n",
    }
    package = tmp / "fastvideo"
    shutil.copytree(ROOT / "fastvideo", package, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in files.items():
        assert not (package / rel).exists(), f"fastvideo/{rel} would shadow upstream's module"
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    return tmp


def test_over_upstream_the_names_are_upstreams(tmp_path):
    report = _probe(_simulated_overlay(tmp_path), UPSTREAM_ONLY)  # the layers' names: the standalone test
    # Over upstream, importing fastvideo runs upstream's own eager imports (its modules rely on their order).
    assert report["loaded"] == sorted([*LIGHT, *UPSTREAM_EAGER, "fastvideo.api", "fastvideo.configs",
                                       "fastvideo.entrypoints"])
    assert report["version"] == "0.2.1"
    expected = {"fastvideo.VideoGenerator": "fastvideo.entrypoints.video_generator",
                "fastvideo.PipelineConfig": "fastvideo.configs.pipelines",
                "fastvideo.SamplingParam": "fastvideo.api.sampling_param",
                "fastvideo.attention.get_attn_backend": "fastvideo.attention.selector",
                "fastvideo.attention.AttentionMetadata": "fastvideo.attention.backends.abstract"}
    for name, module in expected.items():
        assert report["names"][name] == ["ok", module], name
    # The negative control: what the standalone test asserts of these names does not hold here.
    assert all(report["names"][f"{p}.{n}"][0] == "ok" for p, names in UPSTREAM_ONLY.items() for n in names)


def test_upstream_subpackages_resolve_as_attributes(tmp_path):
    code = "import fastvideo.configs.pipelines, fastvideo; print(fastvideo.configs.pipelines.PipelineConfig.__name__)"
    env = {**os.environ, "PYTHONPATH": str(_simulated_overlay(tmp_path))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "PipelineConfig", done.stderr
    bare = subprocess.run([sys.executable, "-c", "import fastvideo; print(fastvideo.configs)"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert bare.returncode == 0 and "fastvideo.configs" in bare.stdout, bare.stderr
    missing = subprocess.run([sys.executable, "-c", "import fastvideo; fastvideo.no_such"], capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=120)
    assert missing.returncode != 0 and "has no attribute 'no_such'" in missing.stderr


@pytest.mark.parametrize("package", sorted(UPSTREAM_ALL))
def test_live_exports_match_upstreams_init(package):
    path = upstream_tree.path("/".join([*package.split(".")[1:], "__init__.py"]))
    tree = ast.parse(path.read_text())
    exported = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", None) == "__all__" for t in n.targets))
    assert exported == UPSTREAM_ALL[package]
