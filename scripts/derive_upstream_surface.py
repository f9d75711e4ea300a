"""Derive the upstream FastVideo surface this package must keep, from an unpacked upstream wheel.

    python scripts/derive_upstream_surface.py UPSTREAM_ROOT > tests/distributed/upstream_surface.json

``UPSTREAM_ROOT``: the folder holding an unpacked ``fastvideo==0.2.1`` wheel's ``fastvideo/`` (the tests unpack the
pinned wheel into the overlay's cache: ``python -c "from tests.overlay import build; print(build.upstream_source())"``).

Reads upstream's sources with ``ast`` (nothing is imported or copied) and writes, as JSON:

* ``modules``: for each upstream module under ``fastvideo/distributed/`` at a path this repository also ships,
  its public module-level names: functions with their parameters (name, kind, default as source text), classes
  with their methods (the same), properties and instance attributes, and other values; plus the private names
  that some other upstream module reads;
* ``imports``: every ``(module, name)`` that an upstream module outside those files imports from
  ``fastvideo.distributed`` or reads as an attribute of one of its modules, with the importing files.

``tests/distributed/test_upstream_surface.py`` checks this tree against the committed output.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

PACKAGE = "fastvideo.distributed"
# The upstream module paths this repository ships (its files replace upstream's in the overlay).
SHIPPED = (
    "fastvideo.distributed",
    "fastvideo.distributed.communication_op",
    "fastvideo.distributed.device_communicators",
    "fastvideo.distributed.device_communicators.base_device_communicator",
    "fastvideo.distributed.device_communicators.ulysses_a2a",
    "fastvideo.distributed.parallel_state",
    "fastvideo.distributed.utils",
)

# Names upstream modules read that are not kept, each with the reason (docs/fastvideo_migration.md).
EXCLUDED = {
    "fastvideo.distributed.device_communicators.ulysses_a2a": {
        "UlyssesA2AHelper._can_attempt": "a private method of upstream's helper, patched by upstream's GPU "
                                         "fault-injection test; this package's construction agrees capability "
                                         "itself, and the helper's private attributes are not part of its surface",
    },
}


def module_of(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> list[list]:
    """``[name, kind, default source or None]`` for each parameter (``self``/``cls`` dropped from methods)."""
    a = fn.args
    out: list[list] = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "positional_only" if i < len(a.posonlyargs) else "positional_or_keyword"
        out.append([arg.arg, kind, None if default is None else ast.unparse(default)])
    if a.vararg:
        out.append([a.vararg.arg, "var_positional", None])
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append([arg.arg, "keyword_only", None if default is None else ast.unparse(default)])
    if a.kwarg:
        out.append([a.kwarg.arg, "var_keyword", None])
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if method and not static and out and out[0][1] != "var_positional":
        out = out[1:]
    return out


def decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return sorted(ast.unparse(d).split(".")[-1] for d in fn.decorator_list)


def class_spec(node: ast.ClassDef) -> dict:
    methods: dict[str, dict] = {}
    properties: list[str] = []
    attributes: set[str] = set()
    nested: dict[str, dict] = {}
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decs = decorators(item)
            if "property" in decs:
                properties.append(item.name)
            elif "setter" not in decs:
                methods[item.name] = {"params": params(item, True), "decorators": decs}
            for sub in ast.walk(item):  # self.X = ... anywhere in the class's methods
                targets = sub.targets if isinstance(sub, ast.Assign) else (
                    [sub.target] if isinstance(sub, ast.AnnAssign) else [])
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        attributes.add(t.attr)
        elif isinstance(item, ast.ClassDef):
            nested[item.name] = {"bases": [ast.unparse(b) for b in item.bases]}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attributes.add(item.target.id)
        elif isinstance(item, ast.Assign):
            attributes.update(t.id for t in item.targets if isinstance(t, ast.Name))
    public = {m: s for m, s in methods.items() if not m.startswith("_") or m == "__init__"}
    return {"kind": "class", "bases": [ast.unparse(b) for b in node.bases], "methods": public,
            "properties": sorted(properties), "classes": nested,
            "attributes": sorted(a for a in attributes - set(properties) if not a.startswith("_"))}


def module_spec(tree: ast.Module) -> dict[str, dict]:
    """Every name bound at module level: what it is (imports recorded as ``import``)."""
    names: dict[str, dict] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = {"kind": "function", "params": params(node, False), "decorators": decorators(node)}
        elif isinstance(node, ast.ClassDef):
            names[node.name] = class_spec(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    names.setdefault(t.id, {"kind": "value"})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    bound = alias.asname or alias.name.split(".")[0]
                    names.setdefault(bound, {"kind": "import"})
    return names


def imports_from_package(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, str]]:
    """``(module, name)`` that ``tree`` takes from ``fastvideo.distributed``: ``from X import name`` and
    ``alias.name`` where ``alias`` is a module of the package bound by an import."""
    found: list[tuple[str, str]] = []
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                if alias.name == "*":
                    continue
                found.append((target, alias.name))
                aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + ".") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = ast.unparse(node.value)
            target = aliases.get(dotted) or (dotted if dotted.startswith(PACKAGE + ".") or dotted == PACKAGE
                                             else None)
            if target is not None:
                found.append((target, node.attr))
    return found


def star_names(tree: ast.Module) -> list[str]:
    """The modules a module star-imports from the package (``from fastvideo.distributed.X import *``)."""
    return [n.module for n in tree.body
            if isinstance(n, ast.ImportFrom) and n.module and any(a.name == "*" for a in n.names)]


def derive(root: Path) -> dict:
    files = {module_of(p, root): p for p in sorted((root / "fastvideo").rglob("*.py"))}
    # Only files that can name the package (its own use relative imports) need parsing.
    texts = {m: p.read_text() for m, p in files.items()}
    trees = {m: ast.parse(t, filename=str(files[m])) for m, t in texts.items()
             if m.startswith(PACKAGE) or PACKAGE in t}
    specs = {m: module_spec(trees[m]) for m in SHIPPED if m in files}
    imports: dict[tuple[str, str], set[str]] = {}
    for importer, path in files.items():
        if importer in SHIPPED or importer not in trees:
            continue
        for target, name in imports_from_package(trees[importer], importer, path.name == "__init__.py"):
            if f"{target}.{name}" in files:
                continue  # a submodule, not a name
            module, dotted = target, name
            while module not in files and "." in module:  # ``Class.attr``: an attribute of an imported class
                module, last = module.rsplit(".", 1)
                dotted = f"{last}.{dotted}"
            if module not in SHIPPED:
                continue  # upstream's own file stays in the overlay: whatever it defines is there
            if dotted in EXCLUDED.get(module, {}):
                continue
            imports.setdefault((module, dotted), set()).add(str(path.relative_to(root)))
    out_modules: dict[str, dict] = {}
    for m, names in specs.items():
        read = {n.split(".")[0] for (t, n) in imports if t == m}
        keep = {}
        for n, spec in sorted(names.items()):
            if spec["kind"] == "import" and n not in read and m != PACKAGE:
                continue  # a module the file happens to use, not its interface
            if n.startswith("_") and n not in read:
                continue
            keep[n] = spec
        for star in star_names(trees[m]):  # ``from X import *`` re-exports X's functions and classes
            for n, spec in specs.get(star, {}).items():
                if not n.startswith("_") and spec["kind"] in ("function", "class"):
                    keep.setdefault(n, {"kind": "import"})
        out_modules[m] = keep
    return {
        "upstream": "fastvideo==0.2.1",
        "shipped": list(SHIPPED),
        "excluded": EXCLUDED,
        "modules": out_modules,
        "imports": [{"module": t, "name": n, "importers": sorted(v)} for (t, n), v in sorted(imports.items())],
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    json.dump(derive(Path(argv[1])), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
