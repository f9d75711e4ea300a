"""``fastvideo.attention.layer``'s upstream surface: constructors that take upstream's arguments, the attention
chosen once at construction (upstream's backend machinery where installed, the dense fall back where not), and
upstream's compile boundary.

Upstream's machinery is stood in for by small modules installed under upstream's names
(``fastvideo.attention.selector``, ``fastvideo.forward_context``, ``fastvideo.utils``,
``fastvideo.layers.rotary_embedding``): a backend whose impl records each call (``preprocess_qkv``, ``forward``,
``postprocess_output``, with the forward context's metadata) and attends with SDPA, and a rotary that counts its
calls. On gloo ranks (P = 2 and 3, replicated tokens, padding, a head count P does not divide) the layer built over
them matches the dense layer bit for bit, forward and backward, and the records say the upstream impl ran every
step, in upstream's order. Negative controls: the dense layer has no records (the same assertion on it fails),
and an impl whose post-processing changes its output by one part in a thousand breaks the bit equality.
``DistributedAttention_VSA`` on the same exchange (gate packed, or left out) against a single-device reference.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.conftest import bit_equal, catch

B, D, TEXT = 2, 8, 3

# ----------------------------------------------------------------------------- stand-ins for upstream's machinery


class Backends(enum.Enum):  # upstream's AttentionBackendEnum, the members these tests name
    FLASH_ATTN = enum.auto()
    TORCH_SDPA = enum.auto()
    VIDEO_SPARSE_ATTN = enum.auto()


META = object()  # the forward context's attn_metadata


def _sdpa(q, k, v, scale, causal=False):
    """What the dense fall back runs on CPU (``dense.attention``'s SDPA branch), call for call."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                          scale=scale).transpose(1, 2)


class RecordingImpl:
    """An upstream-style AttentionImpl: records every call; ``tamper`` changes the post-processed output."""

    tamper = False

    def __init__(self, num_heads, head_size, causal, softmax_scale, num_kv_heads=None, prefix=None, **extra):
        self.kwargs = dict(num_heads=num_heads, head_size=head_size, causal=causal, softmax_scale=softmax_scale,
                           num_kv_heads=num_kv_heads, prefix=prefix, **extra)
        self.calls: list[tuple] = []

    def preprocess_qkv(self, qkv, meta):
        self.calls.append(("preprocess_qkv", tuple(qkv.shape), meta is META))
        return qkv

    def forward(self, q, k, v, meta):
        self.calls.append(("forward", tuple(q.shape), meta is META))
        return _sdpa(q, k, v, self.kwargs["softmax_scale"], self.kwargs["causal"])

    def postprocess_output(self, out, meta):
        self.calls.append(("postprocess_output", tuple(out.shape), meta is META))
        return out * 1.001 if self.tamper else out


class GatedImpl(RecordingImpl):
    """A stand-in for VSA's impl: dense attention times the gate's sigmoid (per head and row, so the SP split and
    the single-device reference agree)."""

    def forward(self, q, k, v, gate, meta):
        self.calls.append(("forward", tuple(q.shape), meta is META, gate is not None))
        return _gated(q, k, v, gate, self.kwargs["softmax_scale"])


def _gated(q, k, v, gate, scale):
    out = _sdpa(q, k, v, scale)
    return out if gate is None else out * torch.sigmoid(gate)


def _backend(name, impl):
    return type(f"{name}Backend", (), {"get_name": staticmethod(lambda: name),
                                       "get_impl_cls": staticmethod(lambda: impl)})


@contextlib.contextmanager
def upstream_machinery(impl=RecordingImpl):
    """Install the stand-ins under upstream's module names; yields the selector's call log and the rotary's."""
    from fastvideo.attention.rotary import apply_rotary

    selections: list[tuple] = []
    rotations: list[tuple] = []

    def get_attn_backend(head_size, dtype, supported_attention_backends=None, default_backend=None):
        selections.append((head_size, dtype, supported_attention_backends, default_backend))
        sparse = supported_attention_backends and supported_attention_backends[0] is Backends.VIDEO_SPARSE_ATTN
        return _backend("VIDEO_SPARSE_ATTN", GatedImpl) if sparse else _backend("TORCH_SDPA", impl)

    def rotary(x, cos, sin, is_neox_style):
        rotations.append((tuple(x.shape), is_neox_style))
        return apply_rotary(x, cos, sin, is_neox_style)

    attrs = {
        "fastvideo.attention.selector": {"get_attn_backend": get_attn_backend,
                                         "backend_name_to_enum": lambda name: Backends[name]},
        "fastvideo.forward_context": {"get_forward_context": lambda: types.SimpleNamespace(attn_metadata=META)},
        "fastvideo.utils": {"get_compute_dtype": torch.get_default_dtype},
        "fastvideo.layers": {},
        "fastvideo.layers.rotary_embedding": {"_apply_rotary_emb": rotary},
    }
    saved = {name: sys.modules.get(name) for name in attrs}
    for name, values in attrs.items():
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__dict__.update(values)
        sys.modules[name] = module
    try:
        yield selections, rotations
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# ----------------------------------------------------------------------------- construction (no collective)


def test_dense_fall_back_takes_upstreams_arguments():
    """Alone: upstream's call sites construct (wanvideo's LocalAttention with dropout_rate=0, enum backends, a
    prefix); the source is the dense fall back, with no upstream impl."""
    from fastvideo.attention.layer import DistributedAttention, LocalAttention

    both = (Backends.FLASH_ATTN, Backends.TORCH_SDPA)
    local = LocalAttention(num_heads=6, head_size=D, dropout_rate=0, softmax_scale=None, causal=False,
                           supported_attention_backends=both)
    dist = DistributedAttention(num_heads=6, head_size=D, causal=False, supported_attention_backends=both,
                                prefix="blocks.0.attn1")
    for layer in (local, dist):
        assert (layer.attention_source, layer.attn_impl, layer.backend) == ("dense", None, None)
        assert layer.softmax_scale == D ** -0.5
    assert dist.tags == {"qkv": "blocks.0.attn1.qkv", "out": "blocks.0.attn1.out"}
    err = catch(LocalAttention, 6, D, dropout_rate=0.1)
    assert err[0] == "TypeError" and "dropout_rate" in err[1] and "upstream FastVideo" in err[1]


def test_upstream_machinery_is_used_as_upstream_uses_it():
    """With upstream's machinery installed: get_attn_backend once per layer with upstream's arguments, the impl
    built with upstream's keywords (``prefix.impl``, extra arguments passed through), the backend's enum."""
    from fastvideo.attention.layer import DistributedAttention, LocalAttention

    with upstream_machinery() as (selections, _):
        dist = DistributedAttention(6, D, supported_attention_backends=(Backends.TORCH_SDPA,), prefix="blocks.1",
                                    dropout_rate=0.25)
        local = LocalAttention(6, D, num_kv_heads=3, default_backend=Backends.TORCH_SDPA, dropout_rate=0)
    assert selections == [(D, torch.get_default_dtype(), (Backends.TORCH_SDPA,), None),
                          (D, torch.get_default_dtype(), None, Backends.TORCH_SDPA)]
    assert dist.attention_source == local.attention_source == "upstream"
    assert dist.backend is Backends.TORCH_SDPA and dist.dtype == torch.get_default_dtype()
    assert dist.attn_impl.kwargs == dict(num_heads=6, head_size=D, causal=False, softmax_scale=D ** -0.5,
                                         num_kv_heads=6, prefix="blocks.1.impl", dropout_rate=0.25)
    assert local.attn_impl.kwargs["num_kv_heads"] == 3 and local.attn_impl.kwargs["prefix"] is None
    # The choice was made at construction: with the machinery gone, the layer keeps it; a new one falls back.
    assert dist.attention_source == "upstream"
    assert DistributedAttention(6, D).attention_source == "dense"


def test_patching_the_modules_get_attn_backend_changes_what_the_layers_build(monkeypatch):
    """Upstream's tests patch ``fastvideo.attention.layer.get_attn_backend``: the layers then build from the
    patched one; unpatched (the control), from upstream's selector."""
    import fastvideo.attention.layer as layer

    picked = []

    def patched(*args, **kwargs):
        picked.append(args)
        return _backend("TORCH_SDPA", GatedImpl)

    with upstream_machinery() as (selections, _):
        assert type(layer.DistributedAttention(6, D).attn_impl) is RecordingImpl and len(selections) == 1
        monkeypatch.setattr(layer, "get_attn_backend", patched)
        built = layer.DistributedAttention(6, D)
    assert type(built.attn_impl) is GatedImpl and picked == [(D, torch.get_default_dtype())] and len(selections) == 1


def test_local_attention_over_upstreams_machinery_matches_the_dense_one():
    from fastvideo.attention.layer import LocalAttention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, 5, 6, D, generator=g, dtype=torch.float64) for _ in range(3))
    angles = torch.rand(5, D // 2, generator=g, dtype=torch.float64)
    freqs = (angles.cos(), angles.sin())
    dense = LocalAttention(6, D)(q, k, v, freqs_cis=freqs)
    with upstream_machinery() as (_, rotations):
        layer = LocalAttention(6, D)
        got = layer(q, k, v, freqs_cis=freqs)
    assert bit_equal(got, dense)
    assert layer.attn_impl.calls == [("forward", (B, 5, 6, D), True)] and len(rotations) == 2


def test_an_installed_but_broken_upstream_raises_instead_of_falling_back(monkeypatch):
    from fastvideo.attention.layer import DistributedAttention

    broken = types.ModuleType("fastvideo.attention.selector")
    broken.__spec__ = importlib.machinery.ModuleSpec(broken.__name__, None)
    monkeypatch.setitem(sys.modules, broken.__name__, broken)
    with pytest.raises(AttributeError, match=r"'fastvideo\.attention\.selector' has no attribute"):
        DistributedAttention(6, D)


def test_vsa_without_upstream_needs_an_attend_and_refuses_replicated_tokens():
    from fastvideo.attention.layer import DistributedAttention_VSA

    err = catch(DistributedAttention_VSA, 6, D)
    assert err[0] == "ValueError" and "VIDEO_SPARSE_ATTN" in err[1] and "attend=" in err[1]
    assert DistributedAttention_VSA(6, D, attend=lambda q, k, v, g: q).attention_source == "dense"


# ----------------------------------------------------------------------------- compile boundary (upstream's)


def test_compile_boundary_follows_the_environment_and_the_instance_flag(monkeypatch):
    from fastvideo.attention import layer as attention_layer

    monkeypatch.delenv("FASTVIDEO_DISABLE_ATTENTION_COMPILE", raising=False)
    assert attention_layer._attention_compile_disabled()
    assert not attention_layer._attention_compile_explicitly_disabled()
    default = attention_layer.DistributedAttention(6, D)
    assert default._compile_forward_enabled is False
    default._set_compile_forward_enabled(True)
    assert default._compile_forward_enabled is True
    for value, disabled in (("0", False), ("off", False), ("", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("FASTVIDEO_DISABLE_ATTENTION_COMPILE", value)
        assert attention_layer._attention_compile_disabled() is disabled
        assert attention_layer._attention_compile_explicitly_disabled() is disabled
        assert attention_layer.DistributedAttention(6, D)._compile_forward_enabled is (not disabled)


def test_the_boundary_wrapper_is_made_once_and_chosen_per_instance(monkeypatch):
    """As upstream's own test: ``torch.compiler.disable`` is applied when the method is decorated, and an instance
    that has not opted in calls through it."""
    from fastvideo.attention import layer as attention_layer

    disabled_calls: list[str] = []

    def fake_disable(fn):
        def disabled(self):
            disabled_calls.append("disabled")
            return fn(self)
        return disabled

    monkeypatch.setattr(attention_layer.torch.compiler, "disable", fake_disable)

    class Toy:
        def __init__(self, enabled):
            self._compile_forward_enabled = enabled

        @attention_layer._maybe_compiler_disable
        def forward(self):
            return "forward"

    assert Toy(False).forward() == "forward" and disabled_calls == ["disabled"]
    assert Toy(True).forward() == "forward" and disabled_calls == ["disabled"]


def test_fullgraph_capture_fails_behind_the_boundary_and_traces_when_opted_in():
    import torch._dynamo

    from fastvideo.attention import layer as attention_layer

    class Probe(torch.nn.Module):
        def __init__(self, enabled):
            super().__init__()
            self._compile_forward_enabled = enabled

        @attention_layer._maybe_compiler_disable
        def forward(self, x):
            return x + 1

    try:
        with pytest.raises(torch._dynamo.exc.Unsupported):
            torch.compile(Probe(False), backend="eager", fullgraph=True)(torch.ones(2))
        assert torch.equal(torch.compile(Probe(True), backend="eager", fullgraph=True)(torch.ones(2)),
                           torch.full((2,), 2.0))
    finally:
        torch._dynamo.reset()


# ----------------------------------------------------------------------------- forward on gloo ranks


def _inputs(seq, heads, world, rank, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 + seq + heads)
    t = {n: torch.randn(B, seq, heads, D, generator=g, dtype=dtype) for n in ("q", "k", "v", "gate", "grad")}
    t.update({n: torch.randn(B, TEXT, heads, D, generator=g, dtype=dtype) for n in ("rq", "rk", "rv")})
    angles = torch.rand(seq, D // 2, generator=g, dtype=torch.float64) * 6
    t["cos"], t["sin"] = angles.cos().to(dtype), angles.sin().to(dtype)
    rows = -(-seq // world)

    def shard(x):
        x = torch.cat([x, x.new_zeros(B, rows * world - seq, *x.shape[2:])], dim=1)
        return x[:, rank * rows:(rank + 1) * rows].clone()

    return t, shard, rows


def _run(layer, t, shard, seq):
    leaves = {n: shard(t[n]).requires_grad_() for n in ("q", "k", "v")}
    rep = {n: t[n].clone().requires_grad_() for n in ("rq", "rk", "rv")}
    out, rep_out = layer(leaves["q"], leaves["k"], leaves["v"], seq, rep["rq"], rep["rk"], rep["rv"],
                         freqs_cis=(t["cos"], t["sin"]))
    ((out * shard(t["grad"])).sum() + rep_out.sum()).backward()
    return [out, rep_out, *(leaves[n].grad for n in ("q", "k", "v")), *(rep[n].grad for n in ("rq", "rk", "rv"))]


def _parity(rank, world, seq, heads):
    from fastvideo.attention.layer import DistributedAttention

    t, shard, rows = _inputs(seq, heads, world, rank)
    dense = DistributedAttention(heads, D, prefix="blocks.0.attn1")
    want = _run(dense, t, shard, seq)
    with upstream_machinery() as (selections, rotations):
        layer = DistributedAttention(heads, D, prefix="blocks.0.attn1")
        got = _run(layer, t, shard, seq)
    with upstream_machinery(type("Tampered", (RecordingImpl,), {"tamper": True})):
        tampered = _run(DistributedAttention(heads, D, prefix="blocks.1.attn1"), t, shard, seq)
    mine = heads // world + (rank < heads % world)
    return {
        "equal": [bit_equal(a, b) for a, b in zip(got, want, strict=True)],
        "tampered equal": bit_equal(tampered[0], want[0]),
        "calls": layer.attn_impl.calls, "dense calls": dense.attn_impl,
        "expected calls": [("preprocess_qkv", (3 * B, seq, mine, D), True), ("forward", (B, seq + TEXT, mine, D), True),
                           ("postprocess_output", (B, seq, mine, D), True)],
        "expected rotations": [((2 * B, seq, mine, D), False)],
        "selections": len(selections), "rotations": rotations, "source": (dense.attention_source,
                                                                          layer.attention_source),
        "shapes": (tuple(got[0].shape), tuple(got[1].shape)), "rows": rows,
    }


@pytest.mark.parametrize("world,seq,heads", [(2, 13, 5), (3, 11, 6)], ids=["P2-odd-heads", "P3"])
def test_forward_over_upstreams_machinery_matches_the_dense_layer_bit_for_bit(ranks, world, seq, heads):
    for r in ranks(world, _parity, seq, heads):
        assert r["equal"] == [True] * 8, r["equal"]  # out, replicated out, dq, dk, dv, drq, drk, drv
        assert r["tampered equal"] is False  # negative control: the impl's post-processing reaches the output
        assert r["source"] == ("dense", "upstream")
        assert r["calls"] == r["expected calls"]  # the upstream impl ran each step, with the context's metadata
        assert r["dense calls"] is None  # negative control: the dense layer has no impl, so this assertion fails
        assert r["selections"] == 1  # chosen once, at construction, not per call
        assert r["rotations"] == r["expected rotations"]  # upstream's rotary, once, on q and k (GPT-J pairs)
        assert r["shapes"] == ((B, r["rows"], heads, D), (B, TEXT, heads, D))


def _vsa(rank, world, seq, heads, chunks=None):
    return [_vsa_case(rank, world, seq, heads, with_gate, chunks) for with_gate in (True, False)]


def _vsa_case(rank, world, seq, heads, with_gate, chunks=None):
    from fastvideo.attention.layer import DistributedAttention_VSA

    t, shard, rows = _inputs(seq, heads, world, rank)
    scale = D ** -0.5
    # The single-device reference: rotary over the whole sequence, the gated attention per head.
    from fastvideo.attention.rotary import apply_rotary

    leaves = {n: t[n].clone().requires_grad_() for n in ("q", "k", "v", "gate")}
    q, k = (apply_rotary(leaves[n], t["cos"], t["sin"]) for n in ("q", "k"))
    ref = _gated(q, k, leaves["v"], leaves["gate"] if with_gate else None, scale)
    (ref * t["grad"]).sum().backward()

    local = {n: shard(t[n]).requires_grad_() for n in ("q", "k", "v", "gate")}
    with upstream_machinery():
        layer = DistributedAttention_VSA(heads, D, supported_attention_backends=(Backends.VIDEO_SPARSE_ATTN,),
                                         overlap_chunks=chunks)
        out, none = layer(local["q"], local["k"], local["v"], seq, gate_compress=local["gate"] if with_gate else None,
                          freqs_cis=(t["cos"], t["sin"]))
    (out * shard(t["grad"])).sum().backward()
    n = min(rows, seq - rank * rows)
    mine = slice(rank * rows, rank * rows + n)
    names = ("q", "k", "v", "gate") if with_gate else ("q", "k", "v")
    errs = {"out": (out[:, :n] - ref[:, mine]).abs().max().item(),
            "pad": out[:, n:].abs().max().item() if n < rows else 0.0,
            **{f"d{m}": (local[m].grad[:, :n] - leaves[m].grad[:, mine]).abs().max().item() for m in names}}
    forwards = [c for c in layer.attn_impl.calls if c[0] == "forward"]
    return (errs, none, layer.backend.name, [c[0] for c in layer.attn_impl.calls], [c[-1] for c in forwards],
            [c[1][2] for c in forwards], layer.overlap_groups())


def test_vsa_on_the_same_exchange_matches_the_single_device_reference(ranks):
    """The gate packed as a fourth tensor, and left out (None): each against the single-device reference."""
    for cases in ranks(2, _vsa, 13, 6):
        for with_gate, (errs, none, backend, steps, gate_seen, _, _) in zip((True, False), cases, strict=True):
            assert max(errs.values()) < 1e-12, errs
            assert none is None and backend == "VIDEO_SPARSE_ATTN" and gate_seen == [with_gate]
            assert steps == ["preprocess_qkv", "forward", "postprocess_output"]


def test_vsa_with_a_rank_holding_no_head_and_overlap_asked_for(ranks):
    """2 heads over 3 ranks, overlap_chunks=2 asked: the sparse backend never sees a call with no head (rank 2
    builds its empty output itself, as the dense layer does: a kernel may refuse zero heads), and the layer says
    what it does (``overlap_groups()`` 1: its forward does not pipeline); exact against the reference, forward and
    gradients, gate or none."""
    for rank, cases in enumerate(ranks(3, _vsa, 7, 2, 2)):
        for errs, _, _, _, _, heads_seen, overlap in cases:
            assert max(errs.values()) < 1e-12, errs
            assert heads_seen == ([1] if rank < 2 else []) and overlap == 1, (rank, heads_seen, overlap)
