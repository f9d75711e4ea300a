"""Layers go one way: no import cycle among ``fastvideo/`` modules and the recipes' (``examples/sp_recipes/``,
the top-level package ``sp_recipes``), the layer rules hold, and the recipes import the package, never the reverse.

The graph is built statically with ``ast`` from every import statement in every module, including
function-local ones and ``TYPE_CHECKING`` blocks (a deferred import is still a dependency, and a
cycle hidden in a function is still a cycle). Importing ``a.b.c`` counts as importing ``a`` and
``a.b`` too (Python imports the parent packages first); ``from a.b import c`` counts ``a.b.c`` when
it is a module. Negative controls feed the checker a synthetic cycle (a graph, and a source tree
whose cycle goes through a function-local and a relative import) and assert it is flagged. Beside the graph:
one autograd formula for the op, and no module over the size limit (each with its negative control). The checks
below the graph cover the package's modules and the recipes' alike.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Absolute names an import statement may load (modules and ``from`` targets)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{alias.name}" for alias in node.names if alias.name != "*"]


def modules(root: Path, package: str) -> dict[str, Path]:
    """``module -> path`` of every ``.py`` under ``root/package`` (``root`` the folder on the path)."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """``module -> modules of the same tree it imports`` for every ``.py`` under ``root/package``."""
    return graph_of(modules(root, package))


def graph_of(files: dict[str, Path]) -> dict[str, set[str]]:
    """For every module of ``files`` (``module -> path``), the modules of ``files`` it imports."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # every statement, at any depth: function-local imports included
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, path.name == "__init__.py"):
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # the parents are imported first
                    prefix = ".".join(parts[:i])
                    if prefix in files and prefix != module and not module.startswith(prefix + "."):
                        edges.add(prefix)
        graph[module] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete cycle (``[a, b, ..., a]``) per strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            sccs.append(scc)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for scc in sccs:
        start = min(scc)
        if len(scc) == 1 and start not in graph.get(start, ()):
            continue
        path, seen = [start], {start}
        while True:  # walk inside the component until a node repeats
            nxt = min(w for w in graph[path[-1]] if w in scc)
            if nxt in seen:
                cycles.append([*path[path.index(nxt):], nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


# Upstream FastVideo's own tests, edited, at upstream's paths (fastvideo/tests/): upstream's files, not this package's
# modules, so outside its structure checks (docs/fastvideo_migration.md, "Upstream's tests, edited").
UPSTREAM_TESTS = "fastvideo.tests"


def _ours(modules: dict) -> dict:
    return {m: v for m, v in modules.items() if m != UPSTREAM_TESTS and not m.startswith(f"{UPSTREAM_TESTS}.")}


PACKAGE = _ours(modules(ROOT, "fastvideo"))
RECIPES = modules(ROOT / "examples", "sp_recipes")  # outside the package: importable with examples/ on the path
GRAPH = graph_of(PACKAGE | RECIPES)  # one graph, so the edges between the two count (cycles, closures)
U = "fastvideo.distributed.ulysses"
A2A = "fastvideo.distributed.all_to_all"
# The routes and the pure pieces below the helper, and what they must never reach.
BELOW_HELPER = [A2A, "fastvideo.distributed.communicator"] + [
    f"{U}.{m}" for m in ("transport", "native", "vote", "contract", "policy", "watchdog", "planner", "stats",
                         "mismatch", "runtime", "sequence", "hot", "nccl_runtime", "overlap_plan", "explain")]
ABOVE = {f"{U}.helper", f"{U}.ops", f"{U}.exchange", f"{U}.registry", f"{U}.construction",
         "fastvideo.distributed.communication_op", "fastvideo.distributed.parallel_state",
         "fastvideo.distributed.sp_groups", "fastvideo.attention.layer",
         "sp_recipes.attention_block", "sp_recipes.sp_attention_demo",
         "fastvideo.distributed.device_communicators.ulysses_a2a"}


def test_the_graph_sees_the_package():
    """Guards the checker itself: it found the modules and the known edges (one of them function-local, one from
    the recipes into the package), and left out upstream's edited tests, which it would otherwise see (the
    control)."""
    assert {f"{U}.helper", "fastvideo.distributed.communication_op", "fastvideo.envs"} <= set(GRAPH)
    assert not any(m.startswith(UPSTREAM_TESTS) for m in [*GRAPH, *_files()])
    assert any(m.startswith(UPSTREAM_TESTS) for m in import_graph(ROOT, "fastvideo"))
    assert f"{U}.ops" in GRAPH["fastvideo.distributed.communication_op"]
    assert {f"{U}.exchange", f"{U}.helper"} <= GRAPH[f"{U}.ops"]
    assert {"sp_recipes.loop", "sp_recipes.video_dit", "sp_recipes.train_wan"} <= set(GRAPH)
    assert "fastvideo.distributed.parallel_state" in GRAPH["sp_recipes.sp_attention_demo"]
    assert f"{U}.native" in GRAPH[f"{U}.construction"]  # imported inside a function
    assert {f"{U}.runtime", f"{U}.sequence", f"{U}.hot", f"{U}.stats"} <= GRAPH[f"{U}.helper"]
    assert "fastvideo.distributed.sp_groups" in GRAPH["fastvideo.distributed.parallel_state"]


def test_no_import_cycle_among_fastvideo_modules():
    assert find_cycles(GRAPH) == []


_RECIPE_NAME = re.compile(r"(?:[\w.]*\.)?sp_recipes(?:\.[\w.]*)?")


def recipe_references(files: dict[str, Path]) -> list[str]:
    """Where ``files`` reach for the recipes: an import statement (at any depth) naming ``sp_recipes`` or
    ``*.sp_recipes``, or a string that is such a module name (``importlib.import_module``'s argument)."""
    found = []
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [n for n in _imported(node, module, path.name == "__init__.py") if n]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            else:
                continue
            found += [f"{module}:{node.lineno} {n}" for n in names if _RECIPE_NAME.fullmatch(n)][:1]
    return found


def test_the_package_never_imports_the_recipes():
    """One way: the recipes import the package (which the wheel ships alone), nothing in ``fastvideo/`` imports
    them (by any import statement, or by name through importlib). The negative control is the next test."""
    assert recipe_references(PACKAGE) == []
    assert not any(edge in RECIPES for m in PACKAGE for edge in GRAPH[m])
    assert any(edge in PACKAGE for m in RECIPES for edge in GRAPH[m])  # the recipes do import the package


def test_the_recipe_reference_check_flags_each_spelling(tmp_path):
    """A function-local import, a name under ``fastvideo.`` and an importlib call are flagged; a module that
    imports the package alone and names the recipes in prose is not."""
    sources = {"local": "def f():\n    from sp_recipes.loop import train_steps\n",
               "old": "import fastvideo.sp_recipes.video_dit\n",
               "dynamic": "import importlib\nimportlib.import_module('sp_recipes.report')\n",
               "clean": '"""Not the recipes: sp_recipes are elsewhere."""\nfrom fastvideo import envs\n'}
    paths = {name: tmp_path / f"{name}.py" for name in sources}
    for name, source in sources.items():
        paths[name].write_text(source)
    assert recipe_references(paths) == ["local:2 sp_recipes.loop", "old:1 fastvideo.sp_recipes.video_dit",
                                        "dynamic:2 sp_recipes.report"]


@pytest.mark.parametrize("module", BELOW_HELPER)
def test_routes_import_nothing_above_them(module):
    assert module in GRAPH, f"{module} moved: update the layer list"
    assert closure(GRAPH, module) & ABOVE == set()


def test_layers_go_one_way():
    """public op -> ops -> the core -> the helper -> the routes; the SP groups below the helper (which takes its
    group from them), their communicator and the all-to-all's NCCL route below the groups. parallel_state, upstream's
    init entry points, sits on top: its init installs the SP communicator's ``ulysses_a2a``."""
    assert f"{U}.helper" not in closure(GRAPH, "fastvideo.distributed.sp_groups")
    assert "fastvideo.distributed.parallel_state" not in closure(GRAPH, f"{U}.helper")
    assert {"fastvideo.distributed.communication_op", f"{U}.ops", f"{U}.exchange", f"{U}.registry"} & closure(
        GRAPH, f"{U}.helper") == set()
    assert "fastvideo.distributed.communication_op" not in closure(GRAPH, f"{U}.ops")
    assert f"{U}.ops" not in closure(GRAPH, f"{U}.exchange")
    assert f"{U}.registry" in closure(GRAPH, "fastvideo.distributed.parallel_state")


def test_validation_lives_in_one_place():
    """Every entry point validates through all_to_all.validate_input; nothing else defines one."""
    defining = [m for m, p in _files().items() if "def validate_input" in p.read_text()]
    assert defining == [A2A]


# Functions that take split tables without validating them: validate_input itself, what runs after it (the op on
# validated input, its converter, the geometry, the op's fake impl for a FakeTensor), and model blocks and layers that
# hand them to a step that validates them (DistributedAttention.forward: its _layout, before any collective).
_TABLES_UNVALIDATED = {f"{A2A}.validate_input", f"{U}.policy.Geometry.from_input",
                       # the op layer hands the tables to the core, which validates them (exchange.issue), and
                       # the wait takes the tables its start validated
                       f"{U}.ops.call", f"{U}.ops.all_to_all", f"{U}.ops.all_to_all_async", f"{U}.ops._op",
                       f"{U}.ops._start", f"{U}.ops._wait", f"{U}.ops._wait_fake",
                       "fastvideo.distributed.communication_op.sequence_model_parallel_all_to_all_4D",
                       # layers that hand them to a step that validates them before any collective
                       "fastvideo.attention.layer.DistributedAttention.forward",
                       "sp_recipes.attention_block.SPSelfAttention.forward",
                       "sp_recipes.video_dit.VideoDiTBlock.forward",
                       "sp_recipes.video_dit.VideoDiTBlock._forward"}


def _functions(tree: ast.AST, prefix: str):
    """(qualified name, node) of every function in ``tree``, methods as ``Class.method``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}.{node.name}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}.{node.name}", node


# The table checks: the all-to-all's (and the core's, its voting wrapper's and the fake impls' calls of it), the
# other collectives'.
_VALIDATORS = {"validate_input", "shares", "validate", "validated", "_fake_shape"}


def split_table_findings(files: dict[str, Path]) -> list[str]:
    """Where validation of the split tables is not in ``all_to_all`` (``validate_input``, ``shares``): a function
    outside it that raises about ``seq_splits``/``head_splits`` without calling one of them first, or one
    that takes ``seq_splits`` and neither validates it nor is known to run after validation."""
    found = []
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        for name, fn in _functions(tree, module):
            args = [a.arg for a in (*fn.args.args, *fn.args.kwonlyargs)]
            calls = {c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", "")
                     for c in ast.walk(fn) if isinstance(c, ast.Call)}
            validates = bool(calls & _VALIDATORS)
            if module != A2A and not validates:
                for node in ast.walk(fn):
                    if isinstance(node, ast.Raise) and node.exc is not None and any(
                            table in ast.unparse(node.exc) for table in ("seq_splits", "head_splits")):
                        found.append(f"{module}:{node.lineno} raises about the split tables")
            if "seq_splits" in args and not validates and name not in _TABLES_UNVALIDATED:
                found.append(f"{name} takes seq_splits and does not call validate_input")
    return found


def test_split_tables_are_validated_in_one_place(tmp_path):
    """Every entry point that takes ``seq_splits`` calls ``validate_input`` (or ``shares``), and nothing else
    raises about the tables unless it did. Negative control: a module that checks a table itself is flagged."""
    files = _files()
    assert split_table_findings(files) == []
    stray = tmp_path / "stray.py"
    stray.write_text("def entry(x, *, seq_splits=None):\n    if seq_splits and min(seq_splits) < 0:\n"
                     "        raise ValueError(f'bad seq_splits {seq_splits}')\n")
    assert split_table_findings({"stray": stray}) == ["stray:3 raises about the split tables",
                                                      "stray.entry takes seq_splits and does not call validate_input"]


def _files() -> dict[str, Path]:
    """The package's modules and the recipes' (the rules below held for the recipes inside the package too), without
    upstream's edited tests."""
    return PACKAGE | modules(ROOT / "examples", "sp_recipes")


# ------------------------------------------------------------------------------------- policy: no torch.distributed


def _imports_torch_distributed(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = _imported(node, "", False) if isinstance(node, (ast.Import, ast.ImportFrom)) else []
        if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
            return True
    return False


def test_policy_closure_has_no_module_importing_torch_distributed():
    files = _files()
    reach = closure(GRAPH, f"{U}.policy") | {f"{U}.policy"}
    assert [m for m in sorted(reach) if _imports_torch_distributed(files[m])] == []
    # Negative control: the same scan does flag a module that imports it.
    assert _imports_torch_distributed(files[f"{U}.vote"])


_POISONED_IMPORT = """
import importlib, sys
import torch  # torch itself loads torch.distributed; poison it so any later import of it fails
for name in [m for m in sys.modules if m == "torch.distributed" or m.startswith("torch.distributed.")]:
    sys.modules[name] = None
importlib.import_module(sys.argv[1])
print("imported")
"""


def _import_without_torch_distributed(module: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _POISONED_IMPORT, module], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_importing_policy_pulls_in_no_torch_distributed():
    """At run time: with torch.distributed made unimportable, the policy (and the CLI's pure path) still
    imports; the vote module, which needs it, does not (the negative control of the poisoning)."""
    ok = _import_without_torch_distributed(f"{U}.policy")
    assert ok.returncode == 0 and "imported" in ok.stdout, ok.stderr
    bad = _import_without_torch_distributed(f"{U}.vote")
    assert bad.returncode != 0 and "torch.distributed" in bad.stderr


# ------------------------------------------------------------------------------------- negative controls


def test_checker_flags_a_synthetic_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    cycles = find_cycles(graph)
    assert sorted(map(tuple, cycles)) == [("a", "b", "c", "a"), ("e", "e")]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_checker_sees_function_local_and_relative_imports(tmp_path):
    """A cycle through a function-local import and a relative import in a synthetic package is flagged;
    removing the function-local import removes it."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\n\n\ndef late():\n    from pkg.sub import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
    (pkg / "a.py").write_text("import os\n")
    assert find_cycles(import_graph(tmp_path, "pkg")) == []


# ------------------------------------------------------------------------------------- one autograd formula


def autograd_functions(source: str) -> list[str]:
    """Classes in ``source`` that subclass ``torch.autograd.Function`` (however it is spelled: ``Function``,
    ``autograd.Function``, ``torch.autograd.Function``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                if name == "Function":
                    found.append(node.name)
    return found


def test_the_op_has_one_autograd_formula():
    """The registered autograd of ``fastvideo::ulysses_all_to_all_4d`` is the only backward formula of the
    synchronous all-to-all, and the start/wait pair's the only one of the one in flight: no
    ``torch.autograd.Function`` anywhere in fastvideo/ or the recipes, and ``register_autograd`` in
    ``ulysses/ops.py`` only."""
    functions = {m: autograd_functions(p.read_text()) for m, p in _files().items()}
    assert {m: f for m, f in functions.items() if f} == {}
    registrations = [m for m, p in _files().items() if "register_autograd(" in p.read_text()]
    assert sorted(registrations) == [f"{U}.ops"]


def test_the_formula_check_flags_a_second_function():
    """Negative control: a module defining its own differentiable all-to-all is caught in every spelling."""
    source = ("import torch\nfrom torch.autograd import Function\n"
              "class A(torch.autograd.Function):\n    pass\nclass B(Function):\n    pass\n")
    assert autograd_functions(source) == ["A", "B"]


MAX_MODULE_LINES = 450  # a module past this is two jobs in one file: split it by job (docs/architecture.md)


def oversized(files: dict[str, Path], limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    """The modules of ``files`` (name -> path) with more than ``limit`` lines, and their line counts."""
    counts = {m: len(p.read_text().splitlines()) for m, p in files.items()}
    return {m: n for m, n in counts.items() if n > limit}


def test_no_module_of_fastvideo_or_the_recipes_is_over_the_size_limit():
    assert oversized(_files()) == {}


def test_the_size_check_flags_a_long_module(tmp_path):
    """Negative control: one line past the limit is flagged, the limit itself is not."""
    at, past = tmp_path / "at.py", tmp_path / "past.py"
    at.write_text("x = 1\n" * MAX_MODULE_LINES)
    past.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized({"at": at, "past": past}) == {"past": MAX_MODULE_LINES + 1}
