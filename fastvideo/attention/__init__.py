"""FastVideo's attention: upstream's package surface, resolved on first use (PEP 562), so ``import
fastvideo.attention`` imports nothing else.

``DistributedAttention``, ``DistributedAttention_VSA`` and ``LocalAttention`` are this package's
(``fastvideo.attention.layer``); ``AttentionBackend``, ``AttentionMetadata``, ``AttentionMetadataBuilder`` and
``get_attn_backend`` are upstream FastVideo's (its ``backends.abstract`` and ``selector``), there where this tree is
copied over upstream's, and an ImportError saying so where it is not.
"""

from __future__ import annotations

from typing import Any

from fastvideo import _lazy_attr

_EXPORTS = {
    "DistributedAttention": "fastvideo.attention.layer",
    "DistributedAttention_VSA": "fastvideo.attention.layer",
    "LocalAttention": "fastvideo.attention.layer",
    "AttentionBackend": "fastvideo.attention.backends.abstract",
    "AttentionMetadata": "fastvideo.attention.backends.abstract",
    "AttentionMetadataBuilder": "fastvideo.attention.backends.abstract",
    "get_attn_backend": "fastvideo.attention.selector",
}

__all__ = sorted(_EXPORTS)  # the names the table above exports: one list of them


def __getattr__(name: str) -> Any:
    return _lazy_attr(globals(), name, _EXPORTS)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
