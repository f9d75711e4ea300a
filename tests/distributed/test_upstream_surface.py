"""Every name upstream FastVideo 0.2.1 reads from ``fastvideo.distributed`` resolves here, with a compatible signature.

``upstream_surface.json`` beside this file is derived from the pinned upstream wheel by
``scripts/derive_upstream_surface.py`` (``ast`` over upstream's sources: nothing of it is imported or copied). It
lists, for each upstream module at a path this repository ships, its public names (functions and methods with
their parameters and defaults, classes with their properties, instance attributes and nested classes), and every
``(module, name)`` another upstream module imports from the package. This tree passes when each name exists and
each signature accepts every call upstream's accepts: the same positional parameters in the same order, the same
keyword names, the same defaults; parameters added here have defaults.

Negative controls: a name removed from a module, a parameter renamed, a default changed and a parameter added
without a default are each flagged. ``python tests/distributed/test_upstream_surface.py`` prints the gaps.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import upstream_tree

SURFACE = Path(__file__).with_name("upstream_surface.json")
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_MISSING = object()


def load_surface() -> dict:
    return json.loads(SURFACE.read_text())


def _default_value(text: str, namespace: dict[str, Any]) -> Any:
    try:
        return ast.literal_eval(text)
    except ValueError:
        pass
    scope = {"torch": torch, "dist": dist, "ReduceOp": dist.ReduceOp, "Backend": dist.Backend, **namespace}
    try:
        return eval(text, scope)
    except Exception:  # noqa: BLE001 - reported as a gap by the caller
        return _MISSING


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b if isinstance(a, (bool, int, float, str)) else a is b or a == b


def signature_gaps(where: str, upstream: list[list], fn: Any, drop_first: bool) -> list[str]:
    """Why a call written for upstream's parameters would fail or mean something else on ``fn`` (empty: none)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [f"{where}: no inspectable signature"]
    ours = list(sig.parameters.values())
    if drop_first and ours and ours[0].kind in _POSITIONAL:
        ours = ours[1:]
    by_name = {p.name: p for p in ours}
    namespace = getattr(inspect.unwrap(fn), "__globals__", {})
    gaps = []
    up_positional = [name for name, kind, _ in upstream if kind in ("positional_only", "positional_or_keyword")]
    our_positional = [p.name for p in ours if p.kind in _POSITIONAL]
    if our_positional[: len(up_positional)] != up_positional:
        gaps.append(f"{where}: positional parameters {our_positional}, upstream's {up_positional} must lead them")
    has_var = {k: any(p.kind == k for p in ours) for k in (inspect.Parameter.VAR_POSITIONAL,
                                                             inspect.Parameter.VAR_KEYWORD)}
    for name, kind, default in upstream:
        if kind == "var_positional":
            if not has_var[inspect.Parameter.VAR_POSITIONAL]:
                gaps.append(f"{where}: upstream takes *{name}, this does not")
            continue
        if kind == "var_keyword":
            if not has_var[inspect.Parameter.VAR_KEYWORD]:
                gaps.append(f"{where}: upstream takes **{name}, this does not")
            continue
        p = by_name.get(name)
        if p is None:
            gaps.append(f"{where}: parameter {name!r} missing")
            continue
        if kind == "keyword_only" and p.kind not in (inspect.Parameter.KEYWORD_ONLY,
                                                     inspect.Parameter.POSITIONAL_OR_KEYWORD):
            gaps.append(f"{where}: parameter {name!r} must be accepted by keyword")
        if default is not None:
            if p.default is inspect.Parameter.empty:
                gaps.append(f"{where}: parameter {name!r} has no default, upstream's is {default}")
                continue
            want = _default_value(default, namespace)
            if want is _MISSING:
                gaps.append(f"{where}: upstream default {default!r} of {name!r} does not evaluate here")
            elif not _same(p.default, want):
                gaps.append(f"{where}: parameter {name!r} defaults to {p.default!r}, upstream's to {default}")
    upstream_names = {name for name, _, _ in upstream}
    for p in ours:
        if p.name not in upstream_names and p.default is inspect.Parameter.empty and p.kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            gaps.append(f"{where}: parameter {p.name!r} (not upstream's) has no default")
    return gaps


def instance_attributes(cls: type) -> set[str]:
    """Names a ``cls`` instance has without running it: class attributes, dataclass fields, annotations, and
    every ``self.X = ...`` in the methods of the classes in its MRO."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        names.update(getattr(klass, "__annotations__", {}))
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def class_gaps(where: str, spec: dict, cls: Any) -> list[str]:
    if not isinstance(cls, type):
        return [f"{where}: not a class ({type(cls).__name__})"]
    gaps = []
    for name, method in spec["methods"].items():
        static = inspect.getattr_static(cls, name, _MISSING)
        if static is _MISSING:
            gaps.append(f"{where}.{name}: method missing")
            continue
        fn = static.__func__ if isinstance(static, (staticmethod, classmethod)) else static
        if not callable(fn):
            gaps.append(f"{where}.{name}: not callable")
            continue
        gaps += signature_gaps(f"{where}.{name}", method["params"], fn,
                               drop_first=not isinstance(static, staticmethod))
    attributes = instance_attributes(cls)
    for name in [*spec["properties"], *spec["attributes"]]:
        if name not in attributes:
            gaps.append(f"{where}.{name}: attribute missing")
    for name, nested in spec.get("classes", {}).items():
        inner = getattr(cls, name, _MISSING)
        if inner is _MISSING:
            gaps.append(f"{where}.{name}: nested class missing")
        elif any("Function" in b for b in nested["bases"]) and not callable(getattr(inner, "apply", None)):
            gaps.append(f"{where}.{name}.apply: missing (upstream's is an autograd Function)")
    return gaps


def resolve(module: str, dotted: str) -> Any:
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        return exc
    for part in dotted.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def gaps(surface: dict) -> list[str]:
    """Every way this tree falls short of ``surface`` (empty: it is a superset)."""
    out: list[str] = []
    for module, names in surface["modules"].items():
        for name, spec in names.items():
            where = f"{module}.{name}"
            obj = resolve(module, name)
            if isinstance(obj, ImportError):
                out.append(f"{module}: does not import ({obj})")
                break
            if obj is _MISSING:
                out.append(f"{where}: missing")
            elif spec["kind"] == "function":
                out += [f"{where}: not callable"] if not callable(obj) else signature_gaps(where, spec["params"], obj,
                                                                                           drop_first=False)
            elif spec["kind"] == "class":
                out += class_gaps(where, spec, obj)
    for entry in surface["imports"]:
        if resolve(entry["module"], entry["name"]) is _MISSING:
            out.append(f"{entry['module']}.{entry['name']}: missing (read by {', '.join(entry['importers'][:3])})")
    return sorted(set(out))


# ------------------------------------------------------------------------------------------------ the checks


def test_the_surface_lists_what_upstream_callers_need():
    surface = load_surface()
    assert surface["upstream"] == "fastvideo==0.2.1"
    modules = surface["modules"]
    ps = modules["fastvideo.distributed.parallel_state"]
    # Spot checks that the derivation read upstream's sources (a truncated list would pass vacuously).
    assert {"send_object", "recv_object", "broadcast_tensor_dict", "graph_capture"} <= set(
        ps["GroupCoordinator"]["methods"])
    assert {"get_node_group", "patch_tensor_parallel_group", "destroy_model_parallel"} <= set(ps)
    assert {"UlyssesA2AHelper", "maybe_create_helper", "SUPPORTED_WORLD_SIZES", "MAX_WINDOW_BYTES"} <= set(
        modules["fastvideo.distributed.device_communicators.ulysses_a2a"])
    assert len(surface["imports"]) > 30


def test_the_committed_list_matches_a_fresh_derivation():
    """Where an unpacked upstream wheel is at hand, the committed list is what the script derives from it now."""
    root = upstream_tree.root()
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        import derive_upstream_surface
    finally:
        sys.path.remove(str(scripts))
    assert json.loads(json.dumps(derive_upstream_surface.derive(root))) == load_surface()


def test_this_tree_is_a_superset_of_upstreams_distributed_surface():
    found = gaps(load_surface())
    assert not found, "upstream names missing or incompatible here:\n" + "\n".join(found)


def _with(surface: dict, module: str, name: str, spec: dict | None) -> dict:
    changed = json.loads(json.dumps(surface))
    if spec is None:
        changed["modules"][module].pop(name)
    else:
        changed["modules"][module][name] = spec
    return changed


@pytest.fixture
def scratch_module(monkeypatch):
    """A module ``fastvideo_surface_scratch`` whose names a negative control defines."""
    module = types.ModuleType("fastvideo_surface_scratch")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_negative_control_a_removed_name_is_flagged(monkeypatch):
    from fastvideo.distributed import parallel_state

    monkeypatch.delattr(parallel_state, "get_node_group")
    found = gaps(load_surface())
    assert "fastvideo.distributed.parallel_state.get_node_group: missing" in found
    assert any(g.startswith("fastvideo.distributed.parallel_state.get_node_group: missing (read by") for g in found)


def test_negative_control_a_removed_method_is_flagged(monkeypatch):
    from fastvideo.distributed.group_transfers import CoordinatorTransfers  # GroupCoordinator's transfers

    monkeypatch.delattr(CoordinatorTransfers, "send_object")
    assert "fastvideo.distributed.parallel_state.GroupCoordinator.send_object: method missing" in gaps(
        load_surface())


def test_negative_control_incompatible_signatures_are_flagged(scratch_module):
    upstream = [["input_", "positional_or_keyword", None], ["dim", "positional_or_keyword", "-1"],
                ["src", "keyword_only", "0"]]
    spec = {"kind": "function", "params": upstream, "decorators": []}
    surface = {"modules": {scratch_module.__name__: {"f": spec}}, "imports": []}

    def check(fn) -> list[str]:
        scratch_module.f = fn
        return gaps(surface)

    assert check(lambda input_, dim=-1, *, src=0, extra=None: None) == []
    assert check(lambda input_, dim=-1, src=0: None) == []  # keyword-only upstream, positional here: still fine
    assert any("'dim' defaults to -2" in g for g in check(lambda input_, dim=-2, *, src=0: None))
    assert any("'dim' missing" in g for g in check(lambda input_, axis=-1, *, src=0: None))
    assert any("must lead" in g for g in check(lambda dim=-1, input_=None, *, src=0: None))
    assert any("'extra' (not upstream's) has no default" in g
               for g in check(lambda input_, dim=-1, *, src=0, extra: None))
    assert any("'src' has no default" in g for g in check(lambda input_, dim=-1, *, src: None))


def test_negative_control_a_missing_instance_attribute_is_flagged(scratch_module):
    class Coordinator:
        def __init__(self, ranks):
            self.ranks = ranks

    scratch_module.Coordinator = Coordinator
    spec = {"kind": "class", "bases": [], "methods": {}, "properties": [], "attributes": ["ranks", "mq_broadcaster"],
            "classes": {}}
    surface = {"modules": {scratch_module.__name__: {"Coordinator": spec}}, "imports": []}
    assert gaps(surface) == [f"{scratch_module.__name__}.Coordinator.mq_broadcaster: attribute missing"]


if __name__ == "__main__":
    for line in gaps(load_surface()):
        print(line)
