"""FastVideo: this tree is its sequence-parallel (Ulysses) subsystem, importable alone or copied over upstream
FastVideo 0.2.1 (``docs/fastvideo_migration.md``).

Alone, ``import fastvideo`` imports nothing else (no side effects, no torch), and upstream's top-level names
(``VideoGenerator``, ``PipelineConfig``, ``SamplingParam``) raise an ImportError on first use saying they need
upstream FastVideo. In the overlay (upstream's ``fastvideo.configs`` present) it imports them eagerly, in upstream's
order, as upstream's ``__init__`` does: upstream's modules depend on that order to break an import cycle.
``__version__`` is upstream's release where upstream's ``fastvideo/version.py`` is present (the overlay is
upstream FastVideo 0.2.1 with this subsystem in it, and upstream's CLI reads that file), else this package's own
version, ``ULYSSES_PACKAGE_VERSION``. Upstream's subpackages (``fastvideo.configs``, ...) also resolve as
attributes, as upstream's eager imports made them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

# This package's own version (pyproject.toml's), whether alone or in the overlay.
ULYSSES_PACKAGE_VERSION = "0.1.0"

# Upstream's eager exports: name -> the upstream module that defines it.
_UPSTREAM_EXPORTS = {
    "PipelineConfig": "fastvideo.configs.pipelines",
    "SamplingParam": "fastvideo.api.sampling_param",
    "VideoGenerator": "fastvideo.entrypoints.video_generator",
}

__all__ = [*_UPSTREAM_EXPORTS, "__version__"]


def _module_present(module: str) -> bool:
    """Whether ``module`` is imported or can be found (its parents imported, not the module itself). Shared by this
    package's lazy surfaces (``fastvideo.attention``, ``fastvideo.attention.sources``), so defined before the
    eager imports below, which reach them."""
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent is missing, or a module without a spec
        return False


def _lazy_attr(namespace: dict[str, Any], name: str, exports: dict[str, str]) -> Any:
    """A lazy package's ``__getattr__`` (PEP 562), shared by this package's lazy surfaces (so, like
    ``_module_present``, defined before the eager imports below, which reach them): ``name`` of ``exports``
    (name -> the module that defines it), resolved once into ``namespace`` (the package's globals), else the
    package's submodule ``name``, as an eager import would bind it. An export of upstream FastVideo's whose module
    is not installed raises an ImportError saying it needs upstream FastVideo."""
    package = namespace["__name__"]
    if name in exports:
        module = exports[name]
        if not _module_present(module):
            raise ImportError(f"{package}.{name} is upstream FastVideo's ({module}), which is not installed here: "
                              "this tree alone is FastVideo's sequence-parallel subsystem. Copy it over an unpacked "
                              "fastvideo==0.2.1 (docs/fastvideo_migration.md) to use it.", name=module)
        namespace[name] = getattr(importlib.import_module(module), name)  # resolved once
        return namespace[name]
    if not name.startswith("_") and _module_present(f"{package}.{name}"):
        return importlib.import_module(f"{package}.{name}")  # binds itself as an attribute of the package
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


# In the overlay, upstream's modules rely on its package importing these eagerly, in this order: importing
# ``fastvideo.configs.pipelines`` first is what keeps upstream's pipelines -> fastvideo_args -> configs cycle from
# seeing a partly initialised module. So where upstream is present its eager imports run as upstream's __init__
# runs them; this tree alone has no ``fastvideo.configs`` and imports nothing.
if importlib.util.find_spec(f"{__name__}.configs") is not None:
    for _name, _module in _UPSTREAM_EXPORTS.items():
        globals()[_name] = getattr(importlib.import_module(_module), _name)


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()[name] = (importlib.import_module("fastvideo.version").__version__  # resolved once
                           if _module_present("fastvideo.version") else ULYSSES_PACKAGE_VERSION)
        return globals()[name]
    return _lazy_attr(globals(), name, _UPSTREAM_EXPORTS)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
