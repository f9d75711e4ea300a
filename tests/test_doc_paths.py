"""Every repository path and command the docs name exists: README.md and every ``docs/**/*.md``.

What is checked, in each file:

* markdown links ``[text](target)`` (not web links or in-page anchors): the target, relative to the file, exists
  inside the repository;
* repository paths in the text (``scripts/...``, ``benchmarks/...``, ``tests/...``, ``fastvideo/...``,
  ``fastvideo-kernel/...``, ``csrc/...``, ``examples/...``, ``docs/...``, ``.ci/...``), from the repository
  root; a glob (``gpu_*.sh``) must match at least one path;
* relative paths (``../x``), from the file: inside the repository and existing;
* ``python -m MODULE``: a module of the repository (``fastvideo``, ``benchmarks``, ``tests``,
  ``fastvideo_kernel``, the recipes' ``sp_recipes``) must be a file of it; any other must be importable here;
* a file name in backticks (an inline code span that is one name ending in ``.py`` or ``.sh``, possibly with a
  path before it or ``:function`` after it, outside fenced code blocks; one that starts with a top folder or
  ``../`` is checked above, from its root): a file of that name (a glob: some file) exists somewhere in the
  repository, ``.venv``, build outputs and ``docs/results`` left out. Commands in backticks are not read for names.

Nothing else is exempt: a doc that names a path that does not exist fails here. A path outside the repository (an
upstream file, a build output) is written so that it does not read as one of ours: ``build/`` outputs are not
checked (they are made by the commands), an upstream path is named with its package prefix spelled out
(``upstream fastvideo 0.2.1: distributed/...``), and an upstream file the pages name by its name alone is one of
``UPSTREAM_FILES``. The scanner's negative controls feed it made-up paths and names.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("scripts", "benchmarks", "tests", "fastvideo", "fastvideo-kernel", "csrc", "examples", "docs", ".ci")
REPO_MODULES = {"fastvideo": "fastvideo", "benchmarks": "benchmarks", "tests": "tests",
                "fastvideo_kernel": "fastvideo-kernel/fastvideo_kernel", "sp_recipes": "examples/sp_recipes"}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A repository path: one of the top folders, not preceded by a path character (so `.revs/base/csrc/x` or
# `$WORK/kernel` are not read as ours), then path characters; a trailing '.' or ',' ends the sentence, not the path.
REPO_PATH = re.compile(rf"(?<![\w./$~-])((?:{'|'.join(re.escape(t) for t in TOP)})/[\w./*{{}},-]*)")
RELATIVE = re.compile(r"(?<![\w./$~-])(\.\./[\w./*-]+)")
MODULE = re.compile(r"python3?\s+-m\s+([A-Za-z_][\w.]*)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
# One name in a code span: a file name ending in .py or .sh, a path before it, ``:function`` after it.
FILE_NAME = re.compile(r"([\w.*{},/-]*[\w*}]\.(?:py|sh))(?::[\w.]+)?")
# Upstream FastVideo 0.2.1's files that the pages name as upstream's: not files of this repository.
UPSTREAM_FILES = frozenset({
    "comm_ops.py", "cpu_communicator.py", "cuda_communicator.py", "npu_communicator.py", "pynccl*.py", "pyhccl*.py",
    "test_sp_wan.py", "test_sp_hunyuanvideo.py", "test_sp_ltx2.py", "test_sp_lingbot_video.py",
})
# Not searched for file names: virtual environments, build outputs and caches, other trees, the recorded runs.
PRUNED = frozenset({".git", ".venv", "__pycache__", "build", "_build", ".revs", ".whl", ".device", ".pytest_cache",
                    ".ruff_cache"})


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _clean(path: str) -> str:
    return path.rstrip(".,:;)'\"`")


def _exists(path: Path) -> bool:
    """``path`` (possibly a glob in its last parts, or a brace list) exists inside the repository."""
    text = str(path)
    if "{" in text:  # a{b,c}d -> abd and acd
        m = re.search(r"\{([^{}]*)\}", text)
        if m:
            return all(_exists(Path(text[:m.start()] + alt + text[m.end():])) for alt in m.group(1).split(","))
    try:
        path.resolve().relative_to(ROOT)
    except ValueError:
        return False  # outside the repository: nothing a reader of this repository can open
    if "*" in text:
        rel = path.resolve().relative_to(ROOT) if "*" not in path.parts[0] else path
        return any(ROOT.glob(str(rel)))
    return path.exists()


@functools.lru_cache(maxsize=1)
def repository_file_names() -> frozenset[str]:
    """The name of every file in the repository (``PRUNED`` folders and ``docs/results`` left out)."""
    names: set[str] = set()
    for folder, subfolders, files in os.walk(ROOT):
        here = Path(folder)
        subfolders[:] = [d for d in subfolders
                         if d not in PRUNED and (here / d).relative_to(ROOT).as_posix() != "docs/results"]
        names.update(files)
    return frozenset(names)


def _name_exists(name: str) -> bool:
    """A file named ``name`` (a glob, or a brace list of alternatives) exists somewhere in the repository."""
    m = re.search(r"\{([^{}]*)\}", name)
    if m:
        return all(_name_exists(name[:m.start()] + alt + name[m.end():]) for alt in m.group(1).split(","))
    if name in UPSTREAM_FILES:
        return True
    names = repository_file_names()
    return any(fnmatch.fnmatchcase(n, name) for n in names) if "*" in name else name in names


def _module_exists(name: str) -> bool:
    top = name.split(".")[0]
    if top in REPO_MODULES:
        base = ROOT / REPO_MODULES[top] / Path(*name.split(".")[1:])
        return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file() or (
            base / "__init__.py").is_file()
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def dead_references(text: str, where: Path) -> list[str]:
    """Every path or command in ``text`` (a markdown file at ``where``) that does not exist: ``kind: reference``."""
    dead: list[str] = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a web link, mailto:, or an anchor in this page
        target = target.split("#")[0]
        if target and not _exists(where.parent / target):
            dead.append(f"link: {target}")
    for raw in REPO_PATH.findall(text):
        path = _clean(raw)
        if path.endswith("/") and path.count("/") == 1 and path.rstrip("/") in TOP:
            continue  # the top folder itself
        if not _exists(ROOT / path):
            dead.append(f"path: {path}")
    for raw in RELATIVE.findall(text):
        path = _clean(raw)
        if not _exists(where.parent / path):
            dead.append(f"relative path: {path}")
    for name in MODULE.findall(text):
        name = name.rstrip(".")
        if not _module_exists(name):
            dead.append(f"python -m: {name}")
    for span in SPAN.findall(FENCE.sub("", text)):
        m = FILE_NAME.fullmatch(span.strip())
        if not m or m.group(1).startswith(("../", *(f"{top}/" for top in TOP))):
            continue  # not one file name, or a path the checks above read from the root
        path = m.group(1)
        if not _name_exists(path.rsplit("/", 1)[-1]):
            dead.append(f"file: {path}")
    return sorted(set(dead))


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_command_a_doc_names_exists(doc):
    dead = dead_references(doc.read_text(), doc)
    assert not dead, f"{doc.relative_to(ROOT)} names what does not exist in this repository: {dead}"


def test_the_docs_are_all_scanned():
    """The scan covers the README and every page under docs/ (a page added anywhere there is checked)."""
    files = doc_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "README.md" in files
    assert len(files) == 1 + len(list((ROOT / "docs").rglob("*.md")))


def test_negative_control_made_up_paths_and_commands_are_flagged():
    where = ROOT / "docs" / "page.md"
    text = """
Run `bash scripts/no_such_script.sh` or `benchmarks/measure_nothing_*.py`, see [the guide](missing_guide.md)
and [design](../../shared/DESIGN.md), read ../outside.md, then `python -m fastvideo.no_such_module` and
`python -m no_such_package_anywhere`. The moved files: fastvideo/distributed/ulysses/no_such.py,
tests/{test_cli,test_no_such}.py, `python -m fastvideo.sp_recipes.train_wan`, `python -m sp_recipes.no_such`.
Real ones pass: `python -m sp_recipes.train_wan compare`,
`scripts/run_tests.sh`, scripts/gpu_*.sh, [kernel](kernel.md#build), [home](../README.md),
`python -m fastvideo.distributed.ulysses explain`, `python -m torch.distributed.run`, https://example.com/x.md,
`$WORK/kernel/x.so`, `.revs/base/csrc/none.cu`, build/video_dit/loss.png, csrc/ulysses_a2a/*.cu.
"""
    assert dead_references(text, where) == sorted([
        "path: scripts/no_such_script.sh",
        "path: benchmarks/measure_nothing_*.py",
        "link: missing_guide.md",
        "link: ../../shared/DESIGN.md",
        "relative path: ../../shared/DESIGN.md",
        "relative path: ../outside.md",
        "python -m: fastvideo.no_such_module",
        "python -m: no_such_package_anywhere",
        "path: fastvideo/distributed/ulysses/no_such.py",
        "path: tests/{test_cli,test_no_such}.py",
        "python -m: fastvideo.sp_recipes.train_wan",
        "python -m: sp_recipes.no_such",
    ])


def test_negative_control_made_up_file_names_are_flagged():
    """A file name in backticks that no file of the repository has is flagged; real names, upstream's named files,
    globs, ``:function`` suffixes and commands (not names) are not, nor is anything inside a fenced block."""
    where = ROOT / "docs" / "page.md"
    text = """
The vote's cost: `measure_vote_cost.py`, the helper `no_such_helper.py:run`, the script `no_such_setup.sh`,
`ulysses/no_such_ops.py`, `test_{doc_paths,no_such_test}.py` and `no_such_*.sh`.
Real ones pass: `settings.py`, `ulysses/ops.py`, `communication_op.py:sequence_model_parallel_all_to_all_4D`,
`gpu_*.sh`, `build_lib.py`, `test_{doc_paths,readme_snippet}.py`, upstream's `comm_ops.py`, and a command,
`bash no_such_device.sh graphs`, is not a name.

```bash
python `fenced_no_such.py`
```
"""
    assert dead_references(text, where) == sorted([
        "file: measure_vote_cost.py",
        "file: no_such_helper.py",
        "file: no_such_setup.sh",
        "file: ulysses/no_such_ops.py",
        "file: test_{doc_paths,no_such_test}.py",
        "file: no_such_*.sh",
    ])
