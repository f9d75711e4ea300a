"""Upstream FastVideo's attention layers (``DistributedAttention``, ``DistributedAttention_VSA``, ``LocalAttention``),
over this package's Ulysses all-to-all.

``DistributedAttention`` takes q, k, v as each SP rank's sequence shard ``[B, S/P, H, D]`` (S padded to a multiple
of P, or with ``seq_splits`` every rank's own share of the unpadded sequence), packs them on the batch dim into ONE
all-to-all (``[3B, S/P, H, D] -> [3B, S, H/P, D]``), trims the padding (``original_seq_len``), applies the rotary
embedding to q and k over the whole sequence (``freqs_cis``), appends this rank's heads of the replicated tokens
(text tokens, identical on every rank) to the sequence, attends, all-gathers the replicated tokens' output over the
heads, pads the sequence back and returns it with a second all-to-all. Where P does not divide the heads, the
all-to-alls split them as evenly as they go (``balanced_splits``) and the replicated tokens' heads and all-gather
follow the same table: no head padding (upstream slices the replicated heads by ``num_heads // P``, which is wrong
there). The all-to-alls are the public op, so ``FASTVIDEO_ULYSSES_A2A=auto`` takes the fused route underneath.

What attends is chosen once, at construction (``attention_source``):

* ``"upstream"``, where upstream FastVideo's attention machinery is installed (this tree copied over upstream's):
  exactly as upstream's layers use it. ``get_attn_backend`` picks the backend from ``supported_attention_backends``
  (and ``FASTVIDEO_ATTENTION_BACKEND``), ``attn_impl`` is built with ``**extra_impl_args``, each forward reads the
  forward context's ``attn_metadata`` and runs ``preprocess_qkv``, ``forward`` and ``postprocess_output``; the
  rotary is upstream's ``fastvideo.layers.rotary_embedding._apply_rotary_emb``.
* ``"dense"``, where it is not (this package alone): ``fastvideo.attention.dense`` (flash-attn where installed and
  applicable, SDPA otherwise) and ``fastvideo.attention.rotary``. Backend arguments it cannot honour raise.

``forward`` keeps upstream's compile boundary: it runs under ``torch.compiler.disable`` unless the instance opted in
(``_set_compile_forward_enabled(True)``, what upstream's regional compile does) or was built with
``FASTVIDEO_DISABLE_ATTENTION_COMPILE`` set to a false value (``0``, ``false``, ``no``, ``off``, empty). Opted in, it
traces whole under ``torch.compile(fullgraph=True)`` (the all-to-all is one opaque ``torch.library`` op, the
all-gather torch's functional collective).

The forward is built from helpers an extension can reuse (``_layout``, ``_scatter_heads``, ``_attend_heads``,
``_gather_heads``): the exchange in, the local attention on this rank's heads, the exchange back.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastvideo.attention import overlap as _overlap
from fastvideo.attention.dense import attention
from fastvideo.attention.rotary import _apply_rotary_emb as _dense_rotary
from fastvideo.attention.sources import (  # upstream's compile boundary, imported from here by upstream's modules
    _attention_compile_disabled,
    _attention_compile_explicitly_disabled,  # noqa: F401 - upstream's fsdp_load imports it from this module
    _maybe_compiler_disable,
    check_dense_backends,
    check_dense_extra,
    upstream_attention,
)
from fastvideo.distributed.communication_op import (
    sequence_model_parallel_all_gather,
    sequence_model_parallel_all_to_all_4D,
)
from fastvideo.distributed.parallel_state import get_sp_parallel_rank, get_sp_world_size
from fastvideo.distributed.ulysses.layout import balanced_splits, shares

__all__ = ["DistributedAttention", "DistributedAttention_VSA", "LocalAttention", "upstream_attention"]

def get_attn_backend(*args: Any, **kwargs: Any) -> Any:
    """Upstream's ``fastvideo.attention.selector.get_attn_backend`` (over upstream only), looked up at each call: the
    layers call this name at construction, so patching it here changes what they build, as in upstream's module."""
    return importlib.import_module("fastvideo.attention.selector").get_attn_backend(*args, **kwargs)


class _Attention(nn.Module):
    """What the three layers share: arguments, and the attention chosen at construction."""

    def __init__(self, cls: str, num_heads: int, head_size: int, num_kv_heads: int | None, softmax_scale: float | None,
                 causal: bool, supported_attention_backends: Sequence[Any] | None, extra: dict[str, Any], *,
                 impl_prefix: str | None = None, default_backend: Any | None = None) -> None:
        super().__init__()
        if num_heads < 1 or head_size < 1:
            raise ValueError(f"{cls}: num_heads={num_heads} and head_size={head_size} must be positive.")
        self.num_heads, self.head_size = num_heads, head_size
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.softmax_scale = head_size ** -0.5 if softmax_scale is None else softmax_scale
        self.causal = causal
        self.supported_attention_backends = supported_attention_backends
        # flash-attn's deterministic backward in the dense fall back (``attention``): a recipe comparing routes sets it.
        self.deterministic = False
        up = upstream_attention()
        self._upstream = up
        if up is None:
            check_dense_backends(cls, supported_attention_backends)
            if default_backend is not None:
                check_dense_backends(cls, [default_backend])
            check_dense_extra(cls, extra)
            self.attention_source = "dense"
            self.attn_impl = None
            self.backend = None  # upstream's AttentionBackendEnum; ``dense.attention_backend(q)`` says which here
            self.dtype = torch.get_default_dtype()
            self._rotary = _dense_rotary
            return
        # Upstream's construction, as its layers do it.
        self.attention_source = "upstream"
        self.dtype = up.get_compute_dtype()
        kwargs = {"default_backend": default_backend} if default_backend is not None else {}
        backend = get_attn_backend(head_size, self.dtype, supported_attention_backends=supported_attention_backends,
                                   **kwargs)
        impl_kwargs = {"prefix": impl_prefix} if impl_prefix is not None else {}
        self.attn_impl = backend.get_impl_cls()(num_heads=num_heads, head_size=head_size, causal=causal,
                                                softmax_scale=self.softmax_scale, num_kv_heads=self.num_kv_heads,
                                                **impl_kwargs, **extra)
        self.backend = up.backend_name_to_enum(backend.get_name())
        self._rotary = up.apply_rotary

    def _metadata(self) -> Any:
        """The forward context's ``attn_metadata`` (upstream), read once per forward; None in the dense fall back."""
        return None if self._upstream is None else self._upstream.get_forward_context().attn_metadata

    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, softmax_scale=self.softmax_scale, causal=self.causal,
                         deterministic=self.deterministic)


AllToAll = Callable[..., torch.Tensor]  # (x, scatter_dim, gather_dim, name, **the public op's keywords)
ROLES = ("qkv", "out")  # the two all-to-alls of one forward: the packed Q, K, V in, the attention output back


def call_tags(prefix: str) -> dict[str, str | None]:
    """Each role's call tag for a layer named ``prefix``: ``f"{prefix}.qkv"`` and ``f"{prefix}.out"``, or None for
    both with an empty prefix (untagged: a per-instance name could differ between ranks that build their models in
    another order, and a wrong tag raises where nothing is wrong)."""
    return {role: f"{prefix}.{role}" if prefix else None for role in ROLES}


def _public_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, name: str, **kwargs: Any) -> torch.Tensor:
    return sequence_model_parallel_all_to_all_4D(x, scatter_dim=scatter_dim, gather_dim=gather_dim, **kwargs)


@dataclass(frozen=True)
class _Layout:
    """One forward's split of the sequence and heads over the SP group (the same on every rank)."""

    world: int
    rank: int
    heads: tuple[int, ...]  # every rank's heads after the first exchange
    uneven: dict[str, Any]  # the public op's ``seq_splits`` / ``head_splits``, only where uneven
    seq: int  # the unpadded sequence length
    full: int  # the sequence length the exchange gathers (padded to a multiple of the SP size, or the splits' sum)

    @property
    def first_head(self) -> int:
        """This rank's first head in the full head dim."""
        return sum(self.heads[: self.rank])


class DistributedAttention(_Attention):
    """Ulysses sequence-parallel attention (see the module docstring). ``forward`` is collective over the SP
    group; it does not block the host except for the all-to-all's vote (``auto``, checked mode).

    Upstream's arguments, with upstream's meaning; ``**extra_impl_args`` go to upstream's backend (the dense fall
    back accepts only ones that ask for nothing, e.g. ``dropout_rate=0``). ``num_kv_heads`` must equal
    ``num_heads``: q, k and v travel packed in one all-to-all.

    ``prefix`` (upstream's: the layer's name in the model, e.g. ``"blocks.3.attn1"``) also tags the two all-to-alls
    ``f"{prefix}.qkv"`` and ``f"{prefix}.out"`` (``tags``, fixed at construction): wherever the call votes (the
    fused route, checked mode), a rank that skips or repeats one layer's call raises ``ContractMismatchError`` on
    every rank naming the tag, where layers of one shape would otherwise pair the wrong calls silently. An empty
    prefix leaves the calls untagged (``call_tags``).

    Two keyword-only arguments of this package, for benchmarks: ``all_to_all(x, scatter_dim, gather_dim, name,
    **kwargs)`` replaces the public op (``name``: ``"qkv"`` or ``"out"``; ``kwargs``: the public op's keywords,
    ``seq_splits`` and ``head_splits`` only where the call is uneven, ``tag`` only where the layer has a prefix),
    ``attend(q, k, v)`` the attention (e.g. a block-sparse one); both default to the package's.

    ``overlap_chunks`` (this package's): pipeline the heads in that many groups, each group's exchanges in flight
    under its neighbours' attention (``fastvideo/attention/overlap.py``; the same result); None: the agreed
    ``FASTVIDEO_ULYSSES_A2A_OVERLAP`` (0, off, by default); 0 or 1: off. An ``all_to_all`` override must then
    take ``async_op=True`` and return a handle with ``wait()``, as the public op does.
    """

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int | None = None,
                 softmax_scale: float | None = None, causal: bool = False,
                 supported_attention_backends: Sequence[Any] | None = None, prefix: str = "", *,
                 all_to_all: AllToAll | None = None, attend: Callable[..., torch.Tensor] | None = None,
                 overlap_chunks: int | None = None, **extra_impl_args: Any) -> None:
        cls = type(self).__name__
        if num_kv_heads is not None and num_kv_heads != num_heads:
            raise ValueError(f"{cls}: num_kv_heads={num_kv_heads} must equal num_heads={num_heads}: q, k and v "
                             "travel in one all-to-all packed on the batch dim (repeat K/V heads first).")
        super().__init__(cls, num_heads, head_size, num_kv_heads, softmax_scale, causal,
                         supported_attention_backends, extra_impl_args, impl_prefix=f"{prefix}.impl")
        self.prefix = prefix
        self.tags = call_tags(prefix)
        # Each role's tag keyword, only where there is a tag (an override that takes none serves untagged layers).
        self._tag_kw = {role: {"tag": tag} if tag is not None else {} for role, tag in self.tags.items()}
        self.all_to_all = all_to_all or _public_all_to_all  # a module function: the module holds no reference cycle
        self.attend = attend
        self.overlap_chunks = _overlap.check_chunks(num_heads, overlap_chunks)
        # Upstream's compile boundary, per instance (module docstring).
        self._compile_forward_enabled = not _attention_compile_disabled()

    def _set_compile_forward_enabled(self, enabled: bool) -> None:
        """Let this instance's ``forward`` be traced (True), or keep it behind ``torch.compiler.disable``."""
        self._compile_forward_enabled = enabled

    @_maybe_compiler_disable
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        original_seq_len: int | None = None,
        replicated_q: torch.Tensor | None = None,
        replicated_k: torch.Tensor | None = None,
        replicated_v: torch.Tensor | None = None,
        freqs_cis: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        seq_splits: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, replicated_out)``: ``out`` ``[B, S/P, H, D]``, this rank's shard (padded rows zero);
        ``replicated_out`` ``[B, T, H, D]`` on every rank, or None.

        q, k, v: ``[B, S/P, H, D]``, this rank's rows of the padded sequence. ``original_seq_len``: the unpadded
        sequence length S0 <= S (None: no padding). ``replicated_q/k/v``: ``[B, T, H, D]``, the same on every
        rank, attended jointly with the sequence (both directions). ``freqs_cis``: ``(cos, sin)``, each
        ``[S0, D/2]`` (or ``[S0, D]``), applied to q and k (not to the replicated tokens), as upstream does.
        ``seq_splits`` (keyword-only, this package's; the same on every rank): every rank's rows of the unpadded
        sequence (``sequence_model_parallel_shard(..., seq_splits=)``'s table): q, k, v and ``out`` are then
        ``[B, seq_splits[rank], H, D]`` and there is no padding (``original_seq_len`` None or the sum).
        Differentiable: ``replicated_out``'s gradient is summed over the SP ranks (its all-gather's backward), so a
        loss on it counts once per rank; each rank's ``replicated_*`` gradient covers its own heads.
        """
        replicated = self._check(q, k, v, replicated_q, replicated_k, replicated_v)
        chunks = _overlap.chunks_for(self.num_heads, self.overlap_chunks)
        if chunks > 1:  # head groups pipelined under their exchanges (fastvideo/attention/overlap.py)
            return _overlap.forward(self, q, k, v, original_seq_len, replicated_q, replicated_k, replicated_v,
                                    freqs_cis, seq_splits, chunks)
        layout = self._layout(q, original_seq_len, seq_splits)
        meta = self._metadata()
        qkv = self._scatter_heads(torch.cat([q, k, v], dim=0), layout)
        out, replicated_out = self._attend_heads(qkv, q.shape[0], layout, freqs_cis, meta,
                                                 replicated=(replicated_q, replicated_k, replicated_v)
                                                 if replicated else None)
        return self._gather_heads(out, layout), replicated_out

    # -- the steps of a forward: an extension composes these ---------------------------------------------------

    def _layout(self, q: torch.Tensor, original_seq_len: int | None, seq_splits: Sequence[int] | None) -> _Layout:
        """The split of this call (validated before any collective: bad arguments raise on every rank alike)."""
        cls = type(self).__name__
        p, rank = get_sp_world_size(), get_sp_parallel_rank()
        # Heads the SP size does not divide are split as evenly as they go; the op's keywords only where uneven,
        # so an even call (and an all_to_all override that takes none) is as before.
        heads = (self.num_heads // p,) * p if self.num_heads % p == 0 else tuple(balanced_splits(self.num_heads, p))
        uneven: dict[str, Any] = {}
        if seq_splits is not None:
            uneven["seq_splits"] = shares(cls, "seq_splits", seq_splits, p)
            full = sum(uneven["seq_splits"])
            if original_seq_len not in (None, full):
                raise ValueError(f"{cls}: original_seq_len={original_seq_len} with seq_splits (summing to {full}): "
                                 "uneven shards carry no padding; pass original_seq_len=None.")
        else:
            full = p * q.shape[1]
        if self.num_heads % p:
            uneven["head_splits"] = heads
        seq = original_seq_len or full
        if not 0 < seq <= full:
            raise ValueError(f"{cls}: original_seq_len={original_seq_len} must be in 1..{full} (the padded "
                             f"sequence: {p} ranks x {q.shape[1]} rows).")
        return _Layout(p, rank, heads, uneven, seq, full)

    def _scatter_heads(self, x: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """``[nB, S/P, H, D]`` -> ``[nB, S0, H_rank, D]``: the first all-to-all, the padding trimmed."""
        x = self.all_to_all(x, 2, 1, "qkv", **layout.uneven, **self._tag_kw["qkv"])
        return x[:, :layout.seq] if layout.seq < layout.full else x

    def _gather_heads(self, out: torch.Tensor, layout: _Layout) -> torch.Tensor:
        """``[B, S0, H_rank, D]`` -> ``[B, S/P, H, D]``: the padding restored (zero), the second all-to-all."""
        if layout.seq < layout.full:
            out = F.pad(out, (0, 0, 0, 0, 0, layout.full - layout.seq))
        return self.all_to_all(out.contiguous(), 1, 2, "out", **layout.uneven, **self._tag_kw["out"])

    def _rotate(self, x: torch.Tensor, b: int, freqs_cis: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """q and k (the first ``2b`` of the batch dim) rotated; out of place (upstream writes into the exchange's
        output)."""
        if freqs_cis is None:
            return x
        cos, sin = freqs_cis
        return torch.cat([self._rotary(x[: 2 * b], cos, sin, is_neox_style=False), x[2 * b:]], dim=0)

    def _attend_heads(self, qkv: torch.Tensor, b: int, layout: _Layout,
                      freqs_cis: tuple[torch.Tensor, torch.Tensor] | None, meta: Any,
                      replicated: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention on this rank's heads of the whole sequence, ``qkv`` ``[3B, S0, H_rank, D]``: rotary, the
        backend's pre-processing, this rank's heads of the replicated tokens appended, attention, the replicated
        tokens' output all-gathered over the heads (collective), the backend's post-processing of the rest.
        Returns ``([B, S0, H_rank, D], [B, T, H, D] or None)``."""
        qkv = self._rotate(qkv, b, freqs_cis)
        if self.attn_impl is not None:
            qkv = self.attn_impl.preprocess_qkv(qkv, meta)
        if replicated is not None:
            mine = slice(layout.first_head, layout.first_head + layout.heads[layout.rank])
            qkv = torch.cat([qkv, torch.cat(replicated, dim=0)[:, :, mine]], dim=1)
        q, k, v = qkv.chunk(3, dim=0)
        out = self._attend_local(q, k, v, meta)  # [B, S0 (+ T), H_rank, D]
        replicated_out = None
        if replicated is not None:
            replicated_out = sequence_model_parallel_all_gather(out[:, layout.seq:].contiguous(), dim=2,
                                                                splits=layout.uneven.get("head_splits"))
            out = out[:, :layout.seq]
        if self.attn_impl is not None:
            out = self.attn_impl.postprocess_output(out, meta)
        return out, replicated_out

    def _attend_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        """Attention on this rank's heads ``[B, S, h, D]``: ``attend`` where given, else the upstream backend, else
        dense attention. Local.

        A rank may hold no head of a call (fewer heads than SP ranks, or a pipelined head group smaller than the
        SP size): its empty output is built here without a kernel, since older torch's CPU SDPA kernel divides by
        the head count (``_scaled_dot_product_flash_attention_for_cpu``: the process dies of SIGFPE). It stays
        differentiable in q, k and v, so every rank's backward issues the same exchanges."""
        if q.shape[2] == 0:
            out = q.new_zeros((*q.shape[:3], v.shape[-1]))
            if q.requires_grad or k.requires_grad or v.requires_grad:  # sums over no element: no kernel divides
                out = out + (q.sum() + k.sum() + v.sum()) * 0
            return out
        if self.attend is not None:
            return self.attend(q, k, v)
        if self.attn_impl is not None:
            return self.attn_impl.forward(q, k, v, meta)
        return self._dense(q, k, v)

    def _check(self, q, k, v, rq, rk, rv) -> bool:
        """Validate the shapes (local); whether replicated tokens were given."""
        cls = type(self).__name__
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"{cls}: {name} must be 4-D [B, S/P, H, D], got {tuple(t.shape)}.")
        if not q.shape == k.shape == v.shape:
            raise ValueError(f"{cls}: q, k, v must have one shape (they are packed into one all-to-all), got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
        if (q.shape[2], q.shape[3]) != (self.num_heads, self.head_size):
            raise ValueError(f"{cls}: q is {tuple(q.shape)}, expected [B, S/P, {self.num_heads}, {self.head_size}] "
                             "(num_heads, head_size).")
        given = [t is not None for t in (rq, rk, rv)]
        if any(given) and not all(given):
            raise ValueError(f"{cls}: pass replicated_q, replicated_k and replicated_v together.")
        if all(given):
            shapes = {tuple(t.shape) for t in (rq, rk, rv)}
            rshape = next(iter(shapes))
            if len(shapes) != 1 or len(rshape) != 4 or (rshape[0], rshape[2], rshape[3]) != (q.shape[0], *q.shape[2:]):
                raise ValueError(f"{cls}: replicated_q/k/v must each be [B, T, H, D] = [{q.shape[0]}, T, "
                                 f"{self.num_heads}, {self.head_size}], got {[tuple(t.shape) for t in (rq, rk, rv)]}.")
        return all(given)


class DistributedAttention_VSA(DistributedAttention):
    """``DistributedAttention`` for video sparse attention (upstream's VSA backend): the same exchange, with the
    gate (``gate_compress``, ``[B, S/P, H, D]``) packed as a fourth tensor beside q, k, v when given, and passed
    to the backend's ``forward(q, k, v, gate_compress, attn_metadata)``. No replicated tokens (upstream's rule).

    Without upstream FastVideo there is no VSA kernel: construction then needs ``attend(q, k, v, gate_compress)``
    (this package's keyword), and raises without it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.attn_impl is None and self.attend is None:
            raise ValueError("DistributedAttention_VSA: video sparse attention needs upstream FastVideo's "
                             "VIDEO_SPARSE_ATTN backend, which is not installed here: copy this tree over upstream "
                             "FastVideo, or pass attend=(q, k, v, gate_compress) -> out.")

    @_maybe_compiler_disable
    def forward(  # type: ignore[override] - upstream's signature
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        original_seq_len: int,
        replicated_q: torch.Tensor | None = None,
        replicated_k: torch.Tensor | None = None,
        replicated_v: torch.Tensor | None = None,
        gate_compress: torch.Tensor | None = None,
        freqs_cis: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, None]:
        """``(out, None)``: ``out`` ``[B, S/P, H, D]``, this rank's shard (padded rows zero). Arguments as
        ``DistributedAttention.forward``'s; ``gate_compress`` ``[B, S/P, H, D]`` or None (a structurally zero
        gate: it then skips the exchange, as upstream's)."""
        if self._check(q, k, v, replicated_q, replicated_k, replicated_v):
            raise ValueError("DistributedAttention_VSA: replicated tokens are not supported with video sparse "
                             "attention; pass replicated_q/k/v=None.")
        if gate_compress is not None and gate_compress.shape != q.shape:
            raise ValueError(f"DistributedAttention_VSA: gate_compress must be shaped as q {tuple(q.shape)}, got "
                             f"{tuple(gate_compress.shape)}.")
        layout = self._layout(q, original_seq_len, None)
        meta = self._metadata()
        b = q.shape[0]
        stack = [q, k, v] if gate_compress is None else [q, k, v, gate_compress]
        x = self._rotate(self._scatter_heads(torch.cat(stack, dim=0), layout), b, freqs_cis)
        if self.attn_impl is not None:
            x = self.attn_impl.preprocess_qkv(x, meta)
        q, k, v, *gate = x.chunk(len(stack), dim=0)
        gate_local = gate[0] if gate else None
        if self.attend is not None:
            out = self.attend(q, k, v, gate_local)
        else:
            out = self.attn_impl.forward(q, k, v, gate_local, meta)
        if self.attn_impl is not None:
            out = self.attn_impl.postprocess_output(out, meta)
        return self._gather_heads(out, layout), None


class LocalAttention(_Attention):
    """Attention on tensors that every rank holds whole: no collective. ``num_kv_heads`` may divide ``num_heads``
    (grouped-query attention). Upstream's arguments (``default_backend``, ``**extra_impl_args``) with upstream's
    meaning where upstream FastVideo is installed (module docstring)."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int | None = None,
                 softmax_scale: float | None = None, causal: bool = False,
                 supported_attention_backends: Sequence[Any] | None = None, default_backend: Any | None = None,
                 **extra_impl_args: Any) -> None:
        if num_kv_heads is not None and num_heads % num_kv_heads:
            raise ValueError(f"LocalAttention: num_kv_heads={num_kv_heads} must divide num_heads={num_heads}.")
        super().__init__("LocalAttention", num_heads, head_size, num_kv_heads, softmax_scale, causal,
                         supported_attention_backends, extra_impl_args, default_backend=default_backend)
        self.default_backend = default_backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                freqs_cis: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``[B, S, H, D]`` attention of q ``[B, S, H, D]`` over k, v ``[B, S_kv, H_kv, D]``; ``freqs_cis``
        (``(cos, sin)``, ``[S, D/2]``) rotates q and k first."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"LocalAttention: {name} must be 4-D [B, S, H, D], got {tuple(t.shape)}.")
        meta = self._metadata()
        if freqs_cis is not None:
            cos, sin = freqs_cis
            q = self._rotary(q, cos, sin, is_neox_style=False)
            k = self._rotary(k, cos, sin, is_neox_style=False)
        if self.attn_impl is not None:
            return self.attn_impl.forward(q, k, v, meta)
        return self._dense(q, k, v)
