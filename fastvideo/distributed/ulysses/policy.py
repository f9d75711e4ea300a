"""Plan selection for the fused route: pure functions, no GPU, no process group.

Words (the same in both modes): a *plane* is one batch element of the operand; plane bytes =
S_local x H x D x itemsize (input and output planes have the same size); *H* is the global head
count; a *chunk* is what one launch step moves: ``planes_per_chunk`` planes, or a range of
``rows_per_chunk`` S_local rows taken from every peer's block (sub-plane chunking).

Rules (``docs/ulysses_policy.md``):

* Window: a chunk fits when its full per-rank output bytes fit the window (1 GiB by default). With uneven
  split tables, chunks and windows are sized by the largest share (``Geometry``): a chunk takes the same
  S_local row range from every peer, a peer with a shorter share contributes fewer or no rows.
* Untuned (original) plan: ``ORIGINAL_CTAS`` CTAs, the whole operand in one chunk if it fits,
  else the NCCL route (``WINDOW``).
* Tuned plans come only from ``TUNED_TABLE`` (measured rows, keyed by GPU model, SP size, dtype, H,
  D; the first row of a key applies, so a key lists its copy-engine row before its SM row, which the
  helper uses where copy-engine rows do not apply): the row's engine, CTAs, planes per chunk, and
  sub-plane split (``row_chunks``: S_local cut into that many even row ranges). When one plane
  exceeds the window, chunk along S_local instead of declining, into as few even row ranges as fit.
* Engines: ``sm`` (the fused kernel: CTAs store over NVLink) and ``ce`` (the copy engines cross the
  fabric, CTAs copy on the device; two chunk buffers, so a chunk must fit half the window).
* Long training: a grad-tracked operand whose plane exceeds ``LONG_TRAINING_PLANE_BYTES`` keeps the
  untuned policy unless ``long_training == "chunked"``. No-grad operands use tuned rows directly.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from fastvideo.distributed.ulysses.contract import DeclineReason

ORIGINAL_CTAS = 36
MAX_CTAS = 144  # the device communicator reserves one LSA barrier per CTA of the largest launch
DEFAULT_WINDOW_BYTES = 1 << 30
LONG_TRAINING_PLANE_BYTES = 512 << 20
MIN_WORLD_SIZE, MAX_WORLD_SIZE = 2, 8
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

ENGINE_SM, ENGINE_CE = "sm", "ce"
ENGINES = (ENGINE_SM, ENGINE_CE)
_CTA_BITS, _PLANE_BITS, _ROW_BITS = 10, 16, 35
_TUNED_BIT = _CTA_BITS + _PLANE_BITS + _ROW_BITS
_CE_BIT = _TUNED_BIT + 1  # bit 62: the word stays a positive int64


def _hash_once(self) -> int:
    """``__hash__`` of a frozen dataclass that keys per-call dicts (the transport's launches, the stats): the fields
    hashed once per object. Not pickled (``_without_hash``): a str's hash differs between processes."""
    try:
        return self.__dict__["_hash"]
    except KeyError:
        value = hash(tuple(getattr(self, name) for name in self.__dataclass_fields__))
        object.__setattr__(self, "_hash", value)
        return value


def check_engine(what: str, engine: str) -> None:
    """Raise ValueError, naming ``what``, for an engine not among ``ENGINES``."""
    if engine not in ENGINES:
        raise ValueError(f"{what}: engine {engine!r} not among {ENGINES}")


def _without_hash(self) -> dict:
    state = dict(self.__dict__)
    state.pop("_hash", None)
    return state


# The plan kinds a CUDA-graph capture may freeze, by engine (``UlyssesHelper.capture_engines``). The
# copy-engine kind can be captured (``fvk_launch`` with ``FVK_CALL_CAPTURE``), but its captured form has run only
# on one GPU (P = 1: no peers, so no push): until a 2-GPU run of
# ``tests/distributed/check_ulysses_graphs.py --capture-engines ce,sm`` shows it exact, a capture plans
# from the table's SM rows, as before.
CAPTURE_ENGINES: tuple[str, ...] = (ENGINE_SM,)


def _uneven(table: Sequence[int] | None) -> tuple[int, ...] | None:
    """A split table as a tuple, or None where it is the even one (every share equal)."""
    if table is None or all(v == table[0] for v in table):
        return None
    return tuple(int(v) for v in table)


@dataclass(frozen=True)
class Geometry:
    """One call's operand in mode-independent terms, identical on every rank (the policy plans from it alone).

    ``S``: the rows of the largest per-rank sequence share (S_local when even); ``H``: global heads.
    ``seq_splits`` / ``head_splits``: every rank's share where they differ (None: the even table, S rows and
    H / P heads each). Windows and chunks are sized by the largest share: a chunk takes the same S_local row
    range from every peer, and a peer with a shorter share contributes fewer (or no) rows to it."""

    mode: int
    dtype: torch.dtype
    B: int
    S: int
    H: int
    D: int
    world_size: int
    seq_splits: tuple[int, ...] | None = None
    head_splits: tuple[int, ...] | None = None

    __hash__ = _hash_once
    __getstate__ = _without_hash

    @classmethod
    def from_input(cls, shape: Sequence[int], mode: int, world_size: int, dtype: torch.dtype, *,
                   seq_splits: Sequence[int] | None = None, head_splits: Sequence[int] | None = None) -> Geometry:
        """The geometry of a call whose (validated) input has ``shape`` on this rank. Tables whose shares are all
        equal are the even table (None), so explicit even tables and None give one geometry."""
        b, s, h, d = (int(v) for v in shape)
        seq, heads = _uneven(seq_splits), _uneven(head_splits)
        s_max = max(seq) if seq is not None else s if mode == 0 else s // world_size
        h_global = sum(heads) if heads is not None else h if mode == 0 else h * world_size
        return cls(mode, dtype, b, s_max, h_global, d, world_size, seq, heads)

    @property
    def uneven(self) -> bool:
        return self.seq_splits is not None or self.head_splits is not None

    @property
    def seq_table(self) -> tuple[int, ...]:
        """Every rank's sequence share (rows before mode 0, after mode 1)."""
        return self.seq_splits if self.seq_splits is not None else (self.S,) * self.world_size

    @property
    def head_table(self) -> tuple[int, ...]:
        """Every rank's head share (after mode 0, before mode 1)."""
        return self.head_splits if self.head_splits is not None else (self.H // self.world_size,) * self.world_size

    @property
    def S_global(self) -> int:
        """The whole sequence: the sum of the shares (S x P when even)."""
        return sum(self.seq_table)

    @property
    def row_bytes(self) -> int:
        """Bytes of one S_local row of one plane, every peer's head share (the unit of sub-plane chunking and of
        window sizing): H x D x itemsize, sized by the largest head share where the shares differ (what any rank
        receives for one row range, in either mode, is at most P rows of that share)."""
        heads = self.H if self.head_splits is None else self.world_size * max(self.head_splits)
        return heads * self.D * self.dtype.itemsize

    @property
    def plane_bytes(self) -> int:
        return self.S * self.row_bytes

    @property
    def operand_bytes(self) -> int:
        return self.B * self.plane_bytes


@dataclass(frozen=True)
class Plan:
    """A fused-route plan: engine, CTAs per launch and the chunk shape. Packs into one int64 for the vote."""

    ctas: int
    planes_per_chunk: int
    rows_per_chunk: int
    tuned: bool
    engine: str = ENGINE_SM

    __hash__ = _hash_once
    __getstate__ = _without_hash

    def __post_init__(self) -> None:
        if not (1 <= self.ctas < 1 << _CTA_BITS and 1 <= self.planes_per_chunk < 1 << _PLANE_BITS
                and 1 <= self.rows_per_chunk < 1 << _ROW_BITS):
            raise ValueError(f"Plan out of range: {self}")
        check_engine("Plan", self.engine)

    @property
    def word(self) -> int:
        return (
            self.ctas
            | self.planes_per_chunk << _CTA_BITS
            | self.rows_per_chunk << (_CTA_BITS + _PLANE_BITS)
            | int(self.tuned) << _TUNED_BIT
            | int(self.engine == ENGINE_CE) << _CE_BIT
        )

    @classmethod
    def from_word(cls, word: int) -> Plan:
        return cls(
            ctas=word & ((1 << _CTA_BITS) - 1),
            planes_per_chunk=(word >> _CTA_BITS) & ((1 << _PLANE_BITS) - 1),
            rows_per_chunk=(word >> (_CTA_BITS + _PLANE_BITS)) & ((1 << _ROW_BITS) - 1),
            tuned=bool(word >> _TUNED_BIT & 1),
            engine=ENGINE_CE if word >> _CE_BIT & 1 else ENGINE_SM,
        )

    def sub_plane(self, geom: Geometry) -> bool:
        return self.rows_per_chunk < geom.S

    def window_bytes(self, geom: Geometry) -> int:
        """Window bytes the plan needs: the per-rank output bytes of the largest chunk, twice for ``ce``
        (chunk c lands in one buffer while chunk c - 1 is copied out of the other)."""
        chunk = min(self.planes_per_chunk, geom.B) * min(self.rows_per_chunk, geom.S) * geom.row_bytes
        return 2 * chunk if self.engine == ENGINE_CE else chunk

    def chunks(self, geom: Geometry) -> Iterator[tuple[int, int, int, int]]:
        """``(plane_start, plane_end, row_start, row_end)`` of every chunk, in launch order."""
        for p0 in range(0, geom.B, self.planes_per_chunk):
            p1 = min(p0 + self.planes_per_chunk, geom.B)
            for r0 in range(0, geom.S, self.rows_per_chunk):
                yield p0, p1, r0, min(r0 + self.rows_per_chunk, geom.S)

    def num_chunks(self, geom: Geometry) -> int:
        return -(-geom.B // self.planes_per_chunk) * -(-geom.S // self.rows_per_chunk)

    def describe(self, geom: Geometry) -> str:
        if self.sub_plane(geom):
            chunking = f"sub-plane chunks of {self.rows_per_chunk} rows"
        elif self.planes_per_chunk >= geom.B:
            chunking = "whole operand in one chunk"
        else:
            n = self.planes_per_chunk
            chunking = "one plane per chunk" if n == 1 else f"{n} planes per chunk"
        kind = "tuned" if self.tuned else "original"
        if self.engine == ENGINE_CE:
            kind += ", copy engine"
        chunks, window = self.num_chunks(geom), self.window_bytes(geom)
        return f"{kind}: {self.ctas} CTAs, {chunking}, {chunks} chunk(s), window {window} B"


@dataclass(frozen=True)
class TunedRow:
    """One measured geometry: the plan shape that won there, and where it was measured."""

    gpu: str
    world_size: int
    dtype: torch.dtype
    heads: int
    head_dim: int
    ctas: int
    planes_per_chunk: int
    source: str
    row_chunks: int = 1  # >1: one plane per chunk, S_local split evenly into this many row ranges
    engine: str = ENGINE_SM

    def __post_init__(self) -> None:
        if not 1 <= self.ctas <= MAX_CTAS or self.planes_per_chunk < 1 or self.row_chunks < 1:
            raise ValueError(f"TunedRow out of range (1 <= ctas <= {MAX_CTAS}, planes and row chunks >= 1): {self}")
        check_engine("TunedRow", self.engine)

    @property
    def key(self) -> tuple[str, int, torch.dtype, int, int]:
        return (self.gpu, self.world_size, self.dtype, self.heads, self.head_dim)


# Only measured rows belong here (docs/ulysses_policy.md says where each came from).
TUNED_TABLE: tuple[TunedRow, ...] = (
    TunedRow("GB200", 4, torch.bfloat16, 56, 128, ctas=144, planes_per_chunk=1,
             source="upstream H3 measurements, 4x GB200, NCCL 2.29.7 (docs/ulysses_policy.md)"),
    # 2x H200 (NV18), bf16: the tuner's winners over both engines, then the SM kernel's best for the same keys
    # (where the copy-engine kind does not apply: a build without it, CUDA-graph capture). Where each was
    # measured, with the figures: the table of tuned rows in docs/ulysses_policy.md.
    TunedRow("H200", 2, torch.bfloat16, 40, 128, ctas=132, planes_per_chunk=1, row_chunks=2, engine="ce",
             source="2x H200 tuner sweep, copy-engine and SM plans, wan720p modes 0/1 (docs/ulysses_policy.md)"),
    TunedRow("H200", 2, torch.bfloat16, 56, 128, ctas=132, planes_per_chunk=2, engine="ce",
             source="2x H200 tuner sweep, copy-engine and SM plans, h3-32k QKV modes 0/1 (docs/ulysses_policy.md)"),
    TunedRow("H200", 2, torch.bfloat16, 40, 128, ctas=144, planes_per_chunk=1, row_chunks=4,
             source="2x H200 tuner sweep, SM plans, wan720p (docs/ulysses_policy.md)"),
    TunedRow("H200", 2, torch.bfloat16, 56, 128, ctas=144, planes_per_chunk=1, row_chunks=2,
             source="2x H200 tuner sweep, SM plans, h3-32k QKV (docs/ulysses_policy.md)"),
)


def even_rows(S: int, max_rows: int) -> int:
    """Rows per chunk that cut S into the fewest row ranges of at most ``max_rows``, as even as possible.

    Even ranges keep every CTA busy in every chunk (a short remainder chunk leaves most of the
    launch's work to a few rows)."""
    pieces = -(-S // max(1, max_rows))
    return -(-S // pieces)


def normalize_gpu_name(name: str) -> str:
    """'NVIDIA H200' -> 'H200', 'NVIDIA GB200' -> 'GB200', 'NVIDIA H100 80GB HBM3' -> 'H100'."""
    tokens = [t for t in re.split(r"[\s_-]+", name.strip().upper()) if t and t != "NVIDIA"]
    for token in tokens:
        if re.fullmatch(r"[A-Z]{1,3}\d{2,4}[A-Z]?", token):
            return token
    return tokens[0] if tokens else ""


def lookup(table: Sequence[TunedRow], gpu: str, geom: Geometry) -> TunedRow | None:
    """The first row of ``table`` keyed by ``gpu`` and ``geom`` (GPU model, SP size, dtype, H, D), else None."""
    key = (normalize_gpu_name(gpu), geom.world_size, geom.dtype, geom.H, geom.D)
    return next((row for row in table if row.key == key), None)


@dataclass(frozen=True)
class Choice:
    """The policy's answer for one call: a plan, or the reason there is none; ``why`` says which rule."""

    plan: Plan | None
    reason: DeclineReason | None
    why: str


def original_plan(geom: Geometry, window_bytes: int, note: str = "") -> Choice:
    """The untuned plan: the whole operand in one chunk if it fits the window, else the NCCL route (``WINDOW``);
    a batch of more planes than the plan word holds moves in chunks of as many as it holds. ``note`` (e.g. why a
    tuned row was not used) leads ``why``."""
    if geom.operand_bytes <= window_bytes:
        plan = Plan(ORIGINAL_CTAS, min(geom.B, (1 << _PLANE_BITS) - 1), geom.S, tuned=False)
        return Choice(plan, None, f"{note}original policy")
    return Choice(None, DeclineReason.WINDOW, f"{note}original policy: the whole operand ({geom.operand_bytes} B) "
                  f"exceeds the window ({window_bytes} B)")


def choose_plan(
    geom: Geometry,
    *,
    gpu: str,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    grad: bool = False,
    long_training: str = "auto",
    table: Sequence[TunedRow] = TUNED_TABLE,
) -> Choice:
    """The plan for ``geom`` on ``gpu``, or why the fused route declines it. Pure."""
    if long_training not in ("auto", "chunked"):
        raise ValueError(f"choose_plan: long_training={long_training!r}; choose 'auto' or 'chunked'.")
    if not MIN_WORLD_SIZE <= geom.world_size <= MAX_WORLD_SIZE:
        return Choice(None, DeclineReason.WORLD_SIZE,
                      f"SP size {geom.world_size} outside {MIN_WORLD_SIZE}..{MAX_WORLD_SIZE}")
    if geom.dtype not in KERNEL_DTYPES:
        return Choice(None, DeclineReason.DTYPE, f"dtype {geom.dtype} not moved by the kernel")
    if not geom.operand_bytes:  # the NCCL route returns an empty output of the right shape
        return Choice(None, DeclineReason.EMPTY, "an operand of no element: nothing to move")
    row = lookup(table, gpu, geom)
    if row is None:
        return original_plan(geom, window_bytes)
    if grad and geom.plane_bytes > LONG_TRAINING_PLANE_BYTES and long_training != "chunked":
        return original_plan(geom, window_bytes, f"long training: grad-tracked plane {geom.plane_bytes} B > "
                             f"{LONG_TRAINING_PLANE_BYTES} B keeps the original policy; ")
    # A copy-engine plan double-buffers its chunks: each must fit half the window.
    usable = window_bytes // 2 if row.engine == ENGINE_CE else window_bytes
    name = f"tuned row {row.gpu}/SP{row.world_size}" + (" (copy engine)" if row.engine == ENGINE_CE else "")
    if geom.plane_bytes <= usable:
        if row.row_chunks > 1 and geom.S > 1:
            rows = even_rows(geom.S, -(-geom.S // row.row_chunks))
            return Choice(Plan(row.ctas, 1, rows, tuned=True, engine=row.engine), None,
                          f"{name}: {row.row_chunks} row chunks per plane")
        planes = max(1, min(row.planes_per_chunk, geom.B, usable // geom.plane_bytes))
        return Choice(Plan(row.ctas, planes, geom.S, tuned=True, engine=row.engine), None, name)
    max_rows = usable // geom.row_bytes
    if max_rows < 1:
        return Choice(None, DeclineReason.WINDOW,
                      f"one row ({geom.row_bytes} B) exceeds the usable window ({usable} of {window_bytes} B)")
    rows = even_rows(geom.S, min(max_rows, -(-geom.S // row.row_chunks)))
    limit = (f"the usable window, half the window for the copy-engine kind ({usable} of {window_bytes} B)"
             if row.engine == ENGINE_CE else f"the window ({window_bytes} B)")
    return Choice(Plan(row.ctas, 1, rows, tuned=True, engine=row.engine), None,
                  f"{name}, plane ({geom.plane_bytes} B) exceeds {limit}: even row chunks of at most {max_rows} rows")
