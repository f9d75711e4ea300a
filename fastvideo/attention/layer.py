"""Upstream FastVideo's attention layers, over this package's Ulysses all-to-all.

``DistributedAttention`` takes q, k, v as each SP rank's sequence shard ``[B, S/P, H, D]`` (S padded to a multiple
of P, or with ``seq_splits`` every rank's own share of the unpadded sequence), packs them on the batch dim into ONE
all-to-all (``[3B, S/P, H, D] -> [3B, S, H/P, D]``), trims the padding (``original_seq_len``), applies the rotary
embedding to q and k over the whole sequence (``freqs_cis``), appends this rank's heads of the replicated tokens
(text tokens, identical on every rank) to the sequence, attends, all-gathers the replicated tokens' output over the
heads, pads the sequence back and returns it with a second all-to-all. Where P does not divide the heads, the
all-to-alls split them as evenly as they go (``balanced_splits``) and the replicated tokens' all-gather follows the
same table: no head padding. Attention is flash-attn where installed and applicable (bf16/fp16 on CUDA), SDPA
otherwise; the all-to-alls are the public op, so ``FASTVIDEO_ULYSSES_A2A=auto`` takes the fused route underneath.

Upstream wraps ``forward`` in ``torch.compiler.disable``; here it traces whole: ``torch.compile(...,
fullgraph=True)`` works (the all-to-all is one opaque ``torch.library`` op, the all-gather torch's functional
collective). Upstream's attention backends (``supported_attention_backends``, forward contexts, VSA) are not
part of this package: flash-attn and SDPA are (``docs/fastvideo_migration.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastvideo.attention import overlap as _overlap
from fastvideo.attention.dense import attention, attention_backend
from fastvideo.attention.rotary import apply_rotary_emb
from fastvideo.distributed.communication_op import (
    sequence_model_parallel_all_gather,
    sequence_model_parallel_all_to_all_4D,
)
from fastvideo.distributed.parallel_state import get_sp_parallel_rank, get_sp_world_size
from fastvideo.distributed.ulysses.layout import balanced_splits, shares

__all__ = ["DistributedAttention", "LocalAttention"]

# Upstream's backend names this package can honour: flash-attn and SDPA are what ``attention`` picks between.
_HONOURED = ("FLASH_ATTN", "TORCH_SDPA", "SDPA", "FLASH")


def _check_backends(cls: str, backends: Sequence[Any] | None) -> tuple[str, ...] | None:
    if backends is None:
        return None
    names = tuple(str(getattr(b, "name", b)).upper() for b in backends)
    if not any(n in _HONOURED for n in names):
        raise ValueError(f"{cls}: supported_attention_backends={names} names none of flash-attn or SDPA, the only "
                         "backends here (the sparse ones, e.g. VSA or sliding-tile attention, are not part of this "
                         "package).")
    return names


def _check_extra(cls: str, extra: dict[str, Any]) -> None:
    if extra:
        raise TypeError(f"{cls}: {sorted(extra)} are upstream backend arguments this package does not implement; "
                        "drop them (flash-attn / SDPA take none).")


class _Attention(nn.Module):
    def __init__(self, cls: str, num_heads: int, head_size: int, num_kv_heads: int | None, softmax_scale: float | None,
                 causal: bool, supported_attention_backends: Sequence[Any] | None, extra: dict[str, Any]) -> None:
        super().__init__()
        if num_heads < 1 or head_size < 1:
            raise ValueError(f"{cls}: num_heads={num_heads} and head_size={head_size} must be positive.")
        self.num_heads, self.head_size = num_heads, head_size
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.softmax_scale = head_size ** -0.5 if softmax_scale is None else softmax_scale
        self.causal = causal
        self.supported_attention_backends = _check_backends(cls, supported_attention_backends)
        _check_extra(cls, extra)
        # flash-attn's deterministic backward (see ``attention``): a training recipe comparing routes sets it.
        self.deterministic = False

    def backend(self, q: torch.Tensor) -> str:
        """``"flash-attn"`` or ``"sdpa"``: what ``forward`` runs for a query like ``q``."""
        return attention_backend(q)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
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


class DistributedAttention(_Attention):
    """Ulysses sequence-parallel attention (see the module docstring). ``forward`` is collective over the SP
    group; it does not block the host except for the all-to-all's vote (``auto``, checked mode).

    Two keyword-only arguments of this package, not upstream's, for benchmarks: ``all_to_all(x, scatter_dim,
    gather_dim, name, **kwargs)`` replaces the public op (``name``: ``"qkv"`` for the packed Q, K, V, ``"out"`` for
    the attention output; ``kwargs``: the public op's keywords, ``seq_splits`` and ``head_splits`` passed only where
    the call is uneven, ``tag`` only where the layer has a ``prefix``), ``attend(q, k, v)`` the attention (e.g. a
    block-sparse one); both default to the package's.

    ``prefix`` (upstream's: the layer's name in the model, e.g. ``"blocks.3.attn"``) tags the two all-to-alls
    ``f"{prefix}.qkv"`` and ``f"{prefix}.out"`` (``tags``, fixed at construction): wherever the call votes (the
    fused route, checked mode), a rank that skips or repeats one layer's call raises ``ContractMismatchError`` on
    every rank naming the tag, where layers of one shape would otherwise pair the wrong calls silently. An empty
    prefix leaves the calls untagged (``call_tags``). Give every layer of a model its own prefix, the same on
    every rank.

    ``overlap_chunks`` (this package's): pipeline the heads in that many groups, each group's exchanges in flight
    under its neighbours' attention (``fastvideo/attention/overlap.py``; the same result); None: the agreed
    ``FASTVIDEO_ULYSSES_A2A_OVERLAP`` (0, off, by default); 0 or 1: off. An ``all_to_all`` override must then
    take ``async_op=True`` and return a handle with ``wait()``, as the public op does.
    """

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int | None = None,
                 softmax_scale: float | None = None, causal: bool = False,
                 supported_attention_backends: Sequence[Any] | None = None, prefix: str = "", *,
                 all_to_all: AllToAll | None = None,
                 attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 overlap_chunks: int | None = None, **extra_impl_args: Any) -> None:
        super().__init__("DistributedAttention", num_heads, head_size, num_kv_heads, softmax_scale, causal,
                         supported_attention_backends, extra_impl_args)
        if self.num_kv_heads != num_heads:
            raise ValueError(f"DistributedAttention: num_kv_heads={num_kv_heads} must equal num_heads={num_heads}: q, "
                             "k and v travel in one all-to-all packed on the batch dim (repeat K/V heads first).")
        self.prefix = prefix
        self.tags = call_tags(prefix)
        # Each role's tag keyword, only where there is a tag (an override that takes none serves untagged layers).
        self._tag_kw = {role: {"tag": tag} if tag is not None else {} for role, tag in self.tags.items()}
        self.all_to_all = all_to_all or _public_all_to_all  # a module function: the module holds no reference cycle
        self.attend = attend
        self.overlap_chunks = _overlap.check_chunks(num_heads, overlap_chunks)

    def attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention on this rank's heads ``[B, S, h, D]`` (``attend`` where given, else ``_attend``). Local.

        A rank may hold no head of a call (fewer heads than SP ranks, or a pipelined head group smaller than the
        SP size): its empty output is built here without a kernel, since older torch's CPU SDPA kernel divides by
        the head count (the process dies of SIGFPE). It stays differentiable in q, k and v, so every rank's
        backward issues the same exchanges."""
        if q.shape[2] == 0:
            out = q.new_zeros((*q.shape[:3], v.shape[-1]))
            if q.requires_grad or k.requires_grad or v.requires_grad:  # sums over no element: no kernel divides
                out = out + (q.sum() + k.sum() + v.sum()) * 0
            return out
        return self._attend(q, k, v) if self.attend is None else self.attend(q, k, v)

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
        self._check(q, k, v, replicated_q, replicated_k, replicated_v)
        chunks = _overlap.chunks_for(self.num_heads, self.overlap_chunks)
        if chunks > 1:  # head groups pipelined under their exchanges (fastvideo/attention/overlap.py)
            return _overlap.forward(self, q, k, v, original_seq_len, replicated_q, replicated_k, replicated_v,
                                    freqs_cis, seq_splits, chunks)
        b = q.shape[0]
        p, rank = get_sp_world_size(), get_sp_parallel_rank()
        # Heads the SP size does not divide are split as evenly as they go; the op's keywords only where uneven,
        # so an even call (and an all_to_all override that takes none) is as before.
        heads = (self.num_heads // p,) * p if self.num_heads % p == 0 else balanced_splits(self.num_heads, p)
        uneven = {}
        if seq_splits is not None:
            uneven["seq_splits"] = shares("DistributedAttention", "seq_splits", seq_splits, p)
            total = sum(uneven["seq_splits"])
            if original_seq_len not in (None, total):
                raise ValueError(f"DistributedAttention: original_seq_len={original_seq_len} with seq_splits "
                                 f"(summing to {total}): uneven shards carry no padding; pass original_seq_len=None.")
        if self.num_heads % p:
            uneven["head_splits"] = heads
        qkv = self.all_to_all(torch.cat([q, k, v], dim=0), 2, 1, "qkv", **uneven, **self._tag_kw["qkv"])
        full = qkv.shape[1]
        seq = original_seq_len or full
        if not 0 < seq <= full:
            raise ValueError(f"DistributedAttention: original_seq_len={original_seq_len} must be in 1..{full} (the "
                             f"padded sequence: {p} ranks x {q.shape[1]} rows).")
        qkv = qkv[:, :seq] if seq < full else qkv
        if freqs_cis is not None:
            cos, sin = freqs_cis
            qkv = torch.cat([apply_rotary_emb(qkv[: 2 * b], cos, sin, is_neox_style=False), qkv[2 * b:]], dim=0)
        replicated = replicated_q is not None
        if replicated:
            first = sum(heads[:rank])
            mine = torch.cat([replicated_q, replicated_k, replicated_v], dim=0)[:, :, first:first + heads[rank]]
            qkv = torch.cat([qkv, mine], dim=1)
        q_, k_, v_ = qkv.chunk(3, dim=0)
        out = self.attend_heads(q_, k_, v_)  # [B, S0 (+ T), H/P, D]
        replicated_out = None
        if replicated:
            replicated_out = sequence_model_parallel_all_gather(out[:, seq:].contiguous(), dim=2,
                                                                splits=uneven.get("head_splits"))
            out = out[:, :seq]
        if seq < full:
            out = F.pad(out, (0, 0, 0, 0, 0, full - seq))
        return self.all_to_all(out.contiguous(), 1, 2, "out", **uneven, **self._tag_kw["out"]), replicated_out

    def _check(self, q, k, v, rq, rk, rv) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"DistributedAttention: {name} must be 4-D [B, S/P, H, D], got {tuple(t.shape)}.")
        if not q.shape == k.shape == v.shape:
            raise ValueError(f"DistributedAttention: q, k, v must have one shape (they are packed into one "
                             f"all-to-all), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
        if (q.shape[2], q.shape[3]) != (self.num_heads, self.head_size):
            raise ValueError(f"DistributedAttention: q is {tuple(q.shape)}, expected [B, S/P, {self.num_heads}, "
                             f"{self.head_size}] (num_heads, head_size).")
        given = [t is not None for t in (rq, rk, rv)]
        if any(given) and not all(given):
            raise ValueError("DistributedAttention: pass replicated_q, replicated_k and replicated_v together.")
        if all(given):
            shapes = {tuple(t.shape) for t in (rq, rk, rv)}
            rshape = next(iter(shapes))
            if len(shapes) != 1 or len(rshape) != 4 or (rshape[0], rshape[2], rshape[3]) != (q.shape[0], *q.shape[2:]):
                raise ValueError(f"DistributedAttention: replicated_q/k/v must each be [B, T, H, D] = "
                                 f"[{q.shape[0]}, T, {self.num_heads}, {self.head_size}], got "
                                 f"{[tuple(t.shape) for t in (rq, rk, rv)]}.")


class LocalAttention(_Attention):
    """Attention on tensors that every rank holds whole: no collective. ``num_kv_heads`` may divide ``num_heads``
    (grouped-query attention)."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int | None = None,
                 softmax_scale: float | None = None, causal: bool = False,
                 supported_attention_backends: Sequence[Any] | None = None, default_backend: Any | None = None,
                 **extra_impl_args: Any) -> None:
        super().__init__("LocalAttention", num_heads, head_size, num_kv_heads, softmax_scale, causal,
                         supported_attention_backends, extra_impl_args)
        if num_heads % self.num_kv_heads:
            raise ValueError(f"LocalAttention: num_kv_heads={self.num_kv_heads} must divide num_heads={num_heads}.")
        if default_backend is not None:
            _check_backends("LocalAttention", [default_backend])
        self.default_backend = default_backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                freqs_cis: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``[B, S, H, D]`` attention of q ``[B, S, H, D]`` over k, v ``[B, S_kv, H_kv, D]``; ``freqs_cis``
        (``(cos, sin)``, ``[S, D/2]``) rotates q and k first."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"LocalAttention: {name} must be 4-D [B, S, H, D], got {tuple(t.shape)}.")
        if freqs_cis is not None:
            cos, sin = freqs_cis
            q = apply_rotary_emb(q, cos, sin, is_neox_style=False)
            k = apply_rotary_emb(k, cos, sin, is_neox_style=False)
        return self._attend(q, k, v)
