"""Upstream FastVideo's attention layers (``DistributedAttention``, ``DistributedAttention_VSA``, ``LocalAttention``),
over this package's Ulysses all-to-all.

``DistributedAttention`` takes q, k, v as each SP rank's sequence shard ``[B, S/P, H, D]`` (S padded to a multiple
of P, or with ``seq_splits`` every rank's own share of the unpadded sequence), packs them on the batch dim into ONE
all-to-all (``[3B, S/P, H, D] -> [3B, S, H/P, D]``), trims the padding (``original_seq_len``), applies the rotary
embedding to q and k over the whole sequence (``freqs_cis``), appends this rank's heads of the replicated tokens
(text tokens, identical on every rank) to the sequence, attends, pads the sequence back and returns it with a
second all-to-all; the replicated tokens' output is all-gathered over the heads. Where P does not divide the heads,
the all-to-alls split them as evenly as they go (``balanced_splits``) and the replicated tokens' heads and
all-gather follow the same table: no head padding (upstream slices the replicated heads by ``num_heads // P``,
which is wrong there). The all-to-alls are the public op, so ``FASTVIDEO_ULYSSES_A2A=auto`` takes the fused route
underneath.

Pipelined (``overlap_chunks``; docs/overlap.md), the same steps run per head group in ``overlap_plan.schedule``'s
order, each group's exchanges in flight (``async_op=True``) under its neighbours' attention; attention does not mix
heads, so the result is the unpipelined one.

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

The forward's steps, for an extension to reuse: ``_layout``, ``_exchange``, ``_attend_heads`` (this rank's heads of
the call or of one head group), ``_run_groups`` (the groups' steps in the schedule's order).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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
from fastvideo.distributed.all_to_all import balanced_splits, shares
from fastvideo.distributed.communication_op import (
    sequence_model_parallel_all_gather,
    sequence_model_parallel_all_to_all_4D,
)
from fastvideo.distributed.parallel_state import get_sp_group, get_sp_parallel_rank, get_sp_world_size
from fastvideo.distributed.ulysses.exchange import voted_errors
from fastvideo.distributed.ulysses.overlap_plan import SETTING, CallLayout, check_chunks, gather_plan, schedule

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

    def _backend_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        """Attention through upstream's backend where it was built, else dense attention. Local."""
        if self.attn_impl is not None:
            return self.attn_impl.forward(q, k, v, meta)
        return attention(q, k, v, softmax_scale=self.softmax_scale, causal=self.causal,
                         deterministic=self.deterministic)


AllToAll = Callable[..., torch.Tensor]  # (x, scatter_dim, gather_dim, name, **the public op's keywords)


def _public_all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, name: str, **kwargs: Any) -> torch.Tensor:
    return sequence_model_parallel_all_to_all_4D(x, scatter_dim=scatter_dim, gather_dim=gather_dim, **kwargs)


def _check_4d(cls: str, layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{cls}: {name} must be 4-D {layout}, got {got}.")


def _cat_heads(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


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
    prefix leaves the calls untagged.

    Two keyword-only arguments of this package, for benchmarks: ``all_to_all(x, scatter_dim, gather_dim, name,
    **kwargs)`` replaces the public op (``name``: ``"qkv"`` or ``"out"``; ``kwargs``: the public op's keywords,
    ``seq_splits`` and ``head_splits`` only where the call is uneven, ``tag`` only where the layer has a prefix),
    ``attend(q, k, v)`` the attention (e.g. a block-sparse one); both default to the package's.

    ``overlap_chunks`` (this package's): pipeline the heads in that many groups, each group's exchanges in flight
    under its neighbours' attention (module docstring; the same result); None: the agreed
    ``FASTVIDEO_ULYSSES_A2A_OVERLAP`` (0, off, by default); 0 or 1: off (``overlap_groups``). An ``all_to_all``
    override must then take ``async_op=True`` and return a handle with ``wait()``, as the public op does, and the
    calls' tags get the group's ``.g{group}``. Every SP rank must pass the same value: ranks that differ raise
    ``ContractMismatchError`` on every rank wherever the calls vote (docs/overlap.md says on which field).
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
        # Each role's tag ("qkv": the packed Q, K, V in; "out": the attention output back). Empty prefix: untagged, as
        # a per-instance name could differ between ranks that build their models in another order, and a wrong tag
        # raises where nothing is wrong.
        self.tags = {role: f"{prefix}.{role}" if prefix else None for role in ("qkv", "out")}
        self.all_to_all = all_to_all or _public_all_to_all  # a module function: the module holds no reference cycle
        self.attend = attend
        self.overlap_chunks = check_chunks(cls, num_heads, overlap_chunks)
        # Upstream's compile boundary, per instance (module docstring).
        self._compile_forward_enabled = not _attention_compile_disabled()

    def _set_compile_forward_enabled(self, enabled: bool) -> None:
        """Let this instance's ``forward`` be traced (True), or keep it behind ``torch.compiler.disable``."""
        self._compile_forward_enabled = enabled

    def overlap_groups(self) -> int:
        """How many head groups ``forward`` pipelines over (local; reads the agreed setting): ``overlap_chunks``,
        else the agreed ``FASTVIDEO_ULYSSES_A2A_OVERLAP`` capped at ``num_heads`` (0 before the SP group agreed
        any settings); 0 or 1: not pipelined."""
        if self.overlap_chunks is not None:
            return self.overlap_chunks
        agreed = get_sp_group().settings
        return min(int(agreed[SETTING]) if agreed is not None else 0, self.num_heads)

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
        Arguments are checked before any collective; in checked mode a check that fails on one rank is voted as
        the op's own checks are (``exchange.voted_errors``): that rank raises it, its peers ``PeerCallError``.
        What the votes compare is each exchange's contract (shape, dtype, mode, split tables, tag), not
        ``original_seq_len`` or the replicated tokens: those must be the same on every rank, as upstream's, and
        ranks that differ get wrong output (``original_seq_len``), or a replicated all-gather that fails or waits
        for its group's timeout (the replicated tokens present on some ranks, or of different lengths).
        ``freqs_cis`` is applied after the first exchange: tables that do not fit the sequence raise there, on
        their rank alone, and its peers wait in the next exchange's vote for its timeout.
        """
        with voted_errors(get_sp_group(), 0, torch.is_grad_enabled() and getattr(q, "requires_grad", False)):
            replicated = self._check(q, k, v, replicated_q, replicated_k, replicated_v)
            layout = self._layout(q, original_seq_len, seq_splits)
        rep = torch.cat([replicated_q, replicated_k, replicated_v], dim=0) if replicated else None
        return self._run_groups([q, k, v], layout, freqs_cis, rep, self.overlap_groups())

    # -- the steps of a forward: an extension composes these ---------------------------------------------------

    def _layout(self, q: torch.Tensor, original_seq_len: int | None, seq_splits: Sequence[int] | None) -> CallLayout:
        """The split of this call, validated before any collective (``forward`` votes a failure in checked mode)."""
        cls = type(self).__name__
        p, rank = get_sp_world_size(), get_sp_parallel_rank()
        splits = shares(cls, "seq_splits", seq_splits, p)
        full = p * q.shape[1] if splits is None else sum(splits)
        if splits is not None and original_seq_len not in (None, full):
            raise ValueError(f"{cls}: original_seq_len={original_seq_len} with seq_splits (summing to {full}): "
                             "uneven shards carry no padding; pass original_seq_len=None.")
        seq = full if original_seq_len is None else original_seq_len  # 0 is out of range, not "no padding"
        if not 0 < seq <= full:
            raise ValueError(f"{cls}: original_seq_len={original_seq_len} must be in 1..{full} (the padded "
                             f"sequence: {p} ranks x {q.shape[1]} rows).")
        # Heads the SP size does not divide are split as evenly as they go.
        return CallLayout(p, rank, balanced_splits(self.num_heads, p), splits, seq, full)

    def _run_groups(self, stack: list[torch.Tensor], layout: CallLayout,
                    freqs_cis: tuple[torch.Tensor, torch.Tensor] | None, replicated: torch.Tensor | None,
                    chunks: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The exchanges and attention of one forward, collective: ``stack`` (``[B, S/P, H, D]`` each, q and k
        first) packed and exchanged per head group of ``chunks`` (one: synchronous exchanges), each group attended
        (``_attend_heads``) and exchanged back, in ``schedule``'s order; ``replicated`` the packed replicated
        tokens ``[3B, T, H, D]`` or None. Returns ``forward``'s ``(out, replicated_out)``."""
        b, meta, groups = stack[0].shape[0], self._metadata(), layout.groups(chunks)
        # One group's exchanges are synchronous: no async_op keyword (an override that takes none serves them).
        in_flight = {"async_op": True} if len(groups) > 1 else {}
        pending, landed, attended, replicated_outs = {}, {}, {}, []
        for step in schedule(len(groups)):  # the join, the last step, follows the loop
            key, call = (step.role, step.group), groups[step.group]
            if step.kind == "start":
                x = torch.cat([t[:, :, call.span()] for t in stack]) if step.role == "qkv" else attended.pop(step.group)
                pending[key] = self._exchange(x, step.role, call, **in_flight)
            elif step.kind == "wait":
                landed[key] = pending.pop(key).wait() if in_flight else pending.pop(key)
            elif step.kind == "attend":
                attended[step.group], rep_out = self._attend_heads(landed.pop(("qkv", step.group)), b, call,
                                                                   freqs_cis, meta, replicated)
                replicated_outs.append(rep_out)
        out = _cat_heads([landed.pop(("out", g)) for g in range(len(groups))])
        if replicated is None:
            return out, None
        # Every rank's heads of every group's replicated tokens in one all-gather, then in the layer's head order.
        splits, order = gather_plan(groups)
        rep_out = sequence_model_parallel_all_gather(_cat_heads(replicated_outs).contiguous(), dim=2, splits=splits)
        return out, rep_out if order is None else rep_out.index_select(2, torch.tensor(order, device=rep_out.device))

    def _exchange(self, x: torch.Tensor, role: str, layout: CallLayout, **kwargs: Any) -> Any:
        """One all-to-all of a call through ``all_to_all``, collective: ``"qkv"`` ``[nB, S/P, H, D]`` -> ``[nB, S,
        h, D]`` (heads scattered), ``"out"`` back; tagged with the layer's tag for the role (``.g{group}`` added for
        a head group)."""
        tag = self.tags[role]
        tag = f"{tag}.g{layout.group}" if tag is not None and layout.group is not None else tag
        dims = (2, 1) if role == "qkv" else (1, 2)
        return self.all_to_all(x, *dims, role, **layout.uneven, **({"tag": tag} if tag else {}), **kwargs)

    def _attend_heads(self, x: torch.Tensor, b: int, layout: CallLayout,
                      freqs_cis: tuple[torch.Tensor, torch.Tensor] | None, meta: Any,
                      replicated: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention on this rank's heads of one call (local), ``x`` its first exchange's output ``[nB, S, h, D]``:
        the padding trimmed, rotary, the backend's pre-processing, this rank's heads of the replicated tokens
        (``[3B, T, H, D]``) appended, attention, the backend's post-processing, the padding restored. Returns
        ``([B, S, h, D]``, ready for the second exchange, ``[B, T, h, D]`` of the replicated tokens or None)."""
        trimmed = layout.seq < layout.full
        x = x[:, :layout.seq] if trimmed else x
        # q and k (the first 2b of the batch dim) rotated out of place (upstream writes into the exchange's output).
        if freqs_cis is not None:
            cos, sin = freqs_cis
            x = torch.cat([self._rotary(x[: 2 * b], cos, sin, is_neox_style=False), x[2 * b:]], dim=0)
        if self.attn_impl is not None:
            x = self.attn_impl.preprocess_qkv(x, meta)
        if replicated is not None:
            x = torch.cat([x, replicated[:, :, layout.span(layout.rank)]], dim=1)
        # A rank may hold no head of a call (fewer heads than SP ranks, or a pipelined head group smaller than the SP
        # size): its empty output is built without a kernel (older torch's CPU SDPA kernel divides by the head count:
        # the process dies of SIGFPE; a sparse kernel may refuse it), differentiable in q, k and v (sums over no
        # element), so that every rank's backward issues the same exchanges.
        q, k, v, *gate = x.chunk(x.shape[0] // b, dim=0)
        out = (self._attend_local(q, k, v, *gate, meta=meta) if q.shape[2] else  # [B, S0 (+ T), h, D]
               q.new_zeros((*q.shape[:3], v.shape[-1])) + (q.sum() + k.sum() + v.sum()) * 0)
        replicated_out = None
        if replicated is not None:
            out, replicated_out = out[:, :layout.seq], out[:, layout.seq:]
        if self.attn_impl is not None:
            out = self.attn_impl.postprocess_output(out, meta)
        return (F.pad(out, (0, 0, 0, 0, 0, layout.full - layout.seq)) if trimmed else out).contiguous(), replicated_out

    def _attend_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, meta: Any) -> torch.Tensor:
        """Attention on this rank's heads ``[B, S, h, D]``, at least one (``_attend_heads`` builds a rank's empty
        output itself): ``attend`` where given, else the upstream backend, else dense attention. Local."""
        if self.attend is not None:
            return self.attend(q, k, v)
        return self._backend_attention(q, k, v, meta)

    def _check(self, q, k, v, rq, rk, rv) -> bool:
        """Validate the shapes (local); whether replicated tokens were given."""
        cls = type(self).__name__
        _check_4d(cls, "[B, S/P, H, D]", q, k, v)
        if not q.shape == k.shape == v.shape:
            raise ValueError(f"{cls}: q, k, v must have one shape (they are packed into one all-to-all), got "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
        if (q.shape[2], q.shape[3]) != (self.num_heads, self.head_size) or not q.shape[0]:
            raise ValueError(f"{cls}: q is {tuple(q.shape)}, expected [B, S/P, {self.num_heads}, {self.head_size}] "
                             "(B >= 1; num_heads, head_size).")
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
        with voted_errors(get_sp_group(), 0, torch.is_grad_enabled() and getattr(q, "requires_grad", False)):
            if self._check(q, k, v, replicated_q, replicated_k, replicated_v):
                raise ValueError("DistributedAttention_VSA: replicated tokens are not supported with video sparse "
                                 "attention; pass replicated_q/k/v=None.")
            if gate_compress is not None and gate_compress.shape != q.shape:
                raise ValueError(f"DistributedAttention_VSA: gate_compress must be shaped as q {tuple(q.shape)}, "
                                 f"got {tuple(gate_compress.shape)}.")
            layout = self._layout(q, original_seq_len, None)
        stack = [q, k, v] if gate_compress is None else [q, k, v, gate_compress]
        return self._run_groups(stack, layout, freqs_cis, None, self.overlap_groups())[0], None

    def overlap_groups(self) -> int:
        """1: this forward does not pipeline (all its heads in one exchange each way, whatever ``overlap_chunks`` or
        ``FASTVIDEO_ULYSSES_A2A_OVERLAP`` say). Local."""
        return 1

    def _attend_local(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None = None,
                      *, meta: Any) -> torch.Tensor:
        """The sparse attention on this rank's heads, with the gate where given. Local."""
        if self.attend is not None:
            return self.attend(q, k, v, gate)
        return self.attn_impl.forward(q, k, v, gate, meta)


class LocalAttention(_Attention):
    """Attention on tensors that every rank holds whole: no collective. ``num_kv_heads`` may divide ``num_heads``
    (grouped-query attention). Upstream's arguments (``default_backend``, ``**extra_impl_args``) with upstream's
    meaning where upstream FastVideo is installed (module docstring). As upstream's, ``forward`` checks only that q,
    k, v are 4-D: ``head_size`` sets the default softmax scale whatever q's head size is."""

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
        _check_4d("LocalAttention", "[B, S, H, D]", q, k, v)
        meta = self._metadata()
        if freqs_cis is not None:
            cos, sin = freqs_cis
            q = self._rotary(q, cos, sin, is_neox_style=False)
            k = self._rotary(k, cos, sin, is_neox_style=False)
        return self._backend_attention(q, k, v, meta)
