"""Where an attention layer's attention comes from (``fastvideo.attention.layer``): upstream FastVideo's backend
machinery where it is installed, else the dense fall back, whose argument checks are here too; and upstream's compile
boundary for the layers' ``forward`` (``FASTVIDEO_DISABLE_ATTENTION_COMPILE``). Local, no collective, no side
effect at import: the layers ask at construction.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from functools import wraps
from types import SimpleNamespace
from typing import Any

from fastvideo import _module_present

_SELECTOR = "fastvideo.attention.selector"


def upstream_attention() -> SimpleNamespace | None:
    """Upstream FastVideo's attention machinery where it is installed (its attention selector present), else None.

    Present means used: an upstream that is installed but fails to import raises here (a missing dependency of
    upstream's is an install error, never a silent fall back to other kernels). Local, no collective; called at
    construction."""
    if not _module_present(_SELECTOR):
        return None
    selector = importlib.import_module(_SELECTOR)
    return SimpleNamespace(
        backend_name_to_enum=selector.backend_name_to_enum,
        get_forward_context=importlib.import_module("fastvideo.forward_context").get_forward_context,
        get_compute_dtype=importlib.import_module("fastvideo.utils").get_compute_dtype,
        apply_rotary=importlib.import_module("fastvideo.layers.rotary_embedding")._apply_rotary_emb,
    )


# Backend names the dense fall back honours (upstream's enum names and their short forms).
_DENSE_NAMES = ("FLASH_ATTN", "TORCH_SDPA", "SDPA", "FLASH")
# Upstream backend arguments the dense fall back accepts when they ask for nothing (no dropout).
_DENSE_NEUTRAL = {"dropout_rate": 0, "dropout_p": 0}


def check_dense_backends(cls: str, backends: Sequence[Any] | None) -> None:
    if backends is None:
        return
    names = tuple(str(getattr(b, "name", b)).upper() for b in backends)
    if not any(n in _DENSE_NAMES for n in names):
        raise ValueError(f"{cls}: supported_attention_backends={names} names none of flash-attn or SDPA, the only "
                         "backends without upstream FastVideo (its sparse ones, e.g. VSA or sliding-tile attention, "
                         "need upstream's attention backends: copy this tree over upstream FastVideo).")


def check_dense_extra(cls: str, extra: dict[str, Any]) -> None:
    refused = sorted(k for k, v in extra.items() if k not in _DENSE_NEUTRAL or v not in (None, _DENSE_NEUTRAL[k]))
    if refused:
        raise TypeError(f"{cls}: {refused} are upstream backend arguments that flash-attn / SDPA without upstream "
                        f"FastVideo do not implement (accepted only as {_DENSE_NEUTRAL}); drop them, or copy this "
                        "tree over upstream FastVideo, whose backends take them.")


# ------------------------------------------------------------------------------------- compile boundary (upstream's)

_COMPILE_ENV = "FASTVIDEO_DISABLE_ATTENTION_COMPILE"


def _attention_compile_disabled() -> bool:
    """Whether new attention instances keep ``forward`` out of compiled graphs: True unless
    ``FASTVIDEO_DISABLE_ATTENTION_COMPILE`` is set to ``0``, ``false``, ``no``, ``off`` or empty (upstream's rule)."""
    value = os.environ.get(_COMPILE_ENV)
    return value is None or value.strip().lower() not in ("0", "false", "no", "off", "")


def _attention_compile_explicitly_disabled() -> bool:
    """Whether the environment asks for the eager boundary explicitly (set, and not to a false value): upstream's
    regional compile then leaves the model eager."""
    return _COMPILE_ENV in os.environ and _attention_compile_disabled()


def _maybe_compiler_disable(fn: Callable) -> Callable:
    """Wrap a ``forward`` so each instance chooses: traced (``self._compile_forward_enabled``) or behind
    ``torch.compiler.disable``. Both wrappers are made here, once; the choice is an attribute read per call."""
    import torch  # here, not at import: this module is read before the layers need torch

    disabled = torch.compiler.disable(fn)

    @wraps(fn)
    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        return (fn if self._compile_forward_enabled else disabled)(self, *args, **kwargs)

    return dispatch
