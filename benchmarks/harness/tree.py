"""Which FastVideo tree is under test, chosen before anything imports ``fastvideo``.

The benchmark code (this repository) and the package it measures can differ: ``--compare-revs`` runs this code
against exported trees of other revisions, ``--tree DIR`` against one. The chosen tree goes first on
``sys.path``, so ``import fastvideo`` finds it; the ``benchmarks`` package is imported by then and keeps
resolving to this repository, and so do the recipes' models the DiT case builds (``sp_recipes``, from this
repository's ``examples/``, put on ``sys.path`` after the tree): the workload stays the same whichever package is
measured. The choice is exported (``FASTVIDEO_BENCH_TREE``) so that every rank a launcher starts makes the same one.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

TREE_ENV = "FASTVIDEO_BENCH_TREE"
BENCH_ROOT = Path(__file__).resolve().parents[2]  # the repository the benchmark code lives in
LIBRARY_ENV = "FASTVIDEO_KERNEL_LIBRARY"
LIBRARY_NAME = "libfastvideo_ulysses_a2a.so"


def select_tree(tree: str | os.PathLike | None = None) -> Path:
    """Put the tree under test first on ``sys.path`` (this repository's recipes after it) and return it: ``tree``,
    else ``$FASTVIDEO_BENCH_TREE``, else this repository. Local. Raises if a different ``fastvideo`` was imported
    already."""
    chosen = Path(tree or os.environ.get(TREE_ENV) or BENCH_ROOT).resolve()
    if not (chosen / "fastvideo").is_dir():
        raise SystemExit(f"--tree {chosen}: no fastvideo/ package there (export a tree with git archive)")
    loaded = sys.modules.get("fastvideo")
    if loaded is not None and getattr(loaded, "__file__", None):
        where = Path(loaded.__file__).resolve().parents[1]
        if where != chosen:
            raise RuntimeError(f"fastvideo was imported from {where} before the tree under test ({chosen}) was chosen")
    os.environ[TREE_ENV] = str(chosen)
    path = str(chosen)
    if path in sys.path:
        sys.path.remove(path)
    sys.path.insert(0, path)
    recipes = str(BENCH_ROOT / "examples")
    if recipes not in sys.path:
        sys.path.insert(1, recipes)
    return chosen


def use_kernel_library(tree: Path, library: str | None) -> str | None:
    """Point the kernel loader at a library: ``library`` (a path, or ``dev`` for ``TREE/build/kernel``'s
    development build); without one, leave the loader's own choice (the installed wheel, or
    ``FASTVIDEO_KERNEL_LIBRARY`` as set). Where no loader package is installed, the tree's
    ``fastvideo-kernel/`` provides it. Returns the library path set, or None. Local; before the first load."""
    chosen = None
    if library:
        chosen = str((tree / "build" / "kernel" / LIBRARY_NAME) if library == "dev" else Path(library).resolve())
        if not Path(chosen).is_file():
            raise SystemExit(f"--kernel-library {library}: {chosen} does not exist (scripts/build_kernel.sh builds it)")
        os.environ[LIBRARY_ENV] = chosen
    loader = tree / "fastvideo-kernel"
    if importlib.util.find_spec("fastvideo_kernel") is None and loader.is_dir() and str(loader) not in sys.path:
        sys.path.insert(1, str(loader))
    return chosen
