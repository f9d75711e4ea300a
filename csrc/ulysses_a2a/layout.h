// Where the Ulysses fused all-to-all puts every byte: shares, chunks, blocks, CTA slices and window regions.
//
// Plain C++ usable on the host and the device (FVK_HD): the kernels (movement.cuh, ce_plan.h) and the test
// library's host checks and simulation (testing/) call exactly these functions, so the checks test the layout
// the kernels run, not a restatement of it.
//
// Shares. Rank r holds seq[r] sequence rows before mode 0 (after mode 1) and heads[r] heads after mode 0
// (before mode 1): mode 0 takes [B, seq[r], H, D] with H = sum(heads) to [B, sum(seq), heads[r], D], mode 1
// is the inverse. The even split (no tables) is the special case seq[r] = S, heads[r] = H / P, run through
// the same code. A share may be 0 (an idle rank: it sends and receives nothing, and still meets every
// barrier, because the chunks are the same on every rank).
//
// Terms. P = world; S = the largest sequence share (the rows a chunk ranges over); run[r] = heads[r] * D *
// itemsize, the bytes of one sequence row of rank r's heads. Two tensor layouts of a rank `me`'s operands:
//   head-split [B, seq[me], every head]: rows of row_bytes = H * D * itemsize, peer q's heads at run_at[q]
//     (the mode-0 input, the mode-1 output);
//   seq-split [B, seq_total, heads[me]]: rows of run[me] bytes, peer q's rows from seq_at[q] (the mode-0
//     output, the mode-1 input).
// A chunk is planes [p0, p0+np) x rows [r0, r0+nr) of [0, S): the same row range of every peer's share, so
// a peer whose share is shorter contributes fewer rows, or none. Chunks run planes-major, then row ranges
// (policy.Plan.chunks); every chunk but the last of a plane range can be the full size, the last ones smaller.
// The block source `src` sends receiver `dst` in a chunk (pair_block) is np planes x rows x run bytes in
// [plane][row][run] order: its rows are the chunk's row range clipped to the sequence share they come from (the
// sender's in mode 0, the receiver's in mode 1), its run is the other rank's head share (the receiver's in
// mode 0, the sender's in mode 1).
//
// THE WINDOW INVARIANT (what makes per-CTA barriers sufficient; ulysses_a2a.cu argues it):
//   In one call, every window byte belongs to exactly one CTA index for every chunk: CTA i of a
//   sender only stores into, and CTA i of the receiver only copies out of, region i of the window,
//   and region i is a function of (src, i) and the plan alone, never of the current chunk or pair.
// So the window is laid out [src][cta region][bytes], with src blocks at the FULL block's stride and region
// i sized for CTA i's slice of the FULL block: the full chunk's rows of the LARGEST head share (full_block_bytes:
// windows and chunks are sized by the largest share). Every pair's block of every chunk is at most that, so it
// is still sliced among all CTAs (every CTA stays busy): split() guarantees CTA i's slice of a smaller block is
// never larger than its slice of the full one, so it fits its region.
//
// Negative controls of the test library only: kMoving, the layout before 2026-11-29, put src blocks at the
// CURRENT block's stride and sliced it by floor(n*i/ctas): when a block's size changed, region i moved onto
// bytes another CTA index of the peer was still copying out (wrong results on 2x H200). kEvenOnly ignores the
// split tables (every share as if even: S rows, H / P heads), the layout before uneven splits applied to them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ulysses_a2a.h"

#if defined(__CUDACC__)
#define FVK_HD __host__ __device__
#else
#define FVK_HD
#endif

namespace fvk {

constexpr int kMaxWorld = 8;
constexpr int kMaxCtas = 144;  // LSA barrier slots: one per CTA of the largest launch

enum Layout : int {
  kStatic = 0,    // the kernels' layout: region i fixed for the whole call
  kMoving = 1,    // negative control only: regions that move with the block size (docs/kernel.md)
  kEvenOnly = 2,  // negative control only: the split tables ignored (the even layout of the same B, S, H, D)
};

// One rank's view of one call. Everything except x, out, rank and the vector width chosen by the
// launcher is identical on every rank.
struct Problem {
  const char* x;  // this rank's input (read only)
  char* out;      // this rank's output: caller-owned, never aliases a window
  int world, rank, mode, layout;
  int itemsize;
  int64_t B, S;       // S: the largest sequence share (the chunks' row extent)
  int64_t seq_total;  // rows of the whole sequence: the sum of the shares
  int64_t row_bytes;  // one row of a head-split tensor, every head: H * D * itemsize
  int64_t run_bytes;  // the largest head share's run (window sizing)
  int64_t granule;    // CTA partition unit in bytes (a power of two dividing every run)
  int granule_log2;
  int64_t planes_per_chunk, rows_per_chunk;   // clamped to B and S: the full chunk
  int64_t seq[kMaxWorld], seq_at[kMaxWorld];  // every rank's sequence share (rows) and its first row
  int64_t run[kMaxWorld], run_at[kMaxWorld];  // every rank's head share as bytes of a row, and its offset there
};

struct Chunk {
  int64_t p0, np, r0, nr;
};

FVK_HD inline int64_t row_chunks(const Problem& p) {
  return (p.S + p.rows_per_chunk - 1) / p.rows_per_chunk;
}

// A function of (B, S, plan) alone, so every rank, idle or not, runs the same chunks and meets the same barriers.
FVK_HD inline int64_t num_chunks(const Problem& p) {
  return (p.B + p.planes_per_chunk - 1) / p.planes_per_chunk * row_chunks(p);
}

// Chunk c in launch order (policy.Plan.chunks: planes-major, then row ranges).
FVK_HD inline Chunk chunk_at(const Problem& p, int64_t c) {
  const int64_t rc = row_chunks(p);
  Chunk k;
  k.p0 = c / rc * p.planes_per_chunk;
  k.np = (p.B - k.p0 < p.planes_per_chunk) ? p.B - k.p0 : p.planes_per_chunk;
  k.r0 = c % rc * p.rows_per_chunk;
  k.nr = (p.S - k.r0 < p.rows_per_chunk) ? p.S - k.r0 : p.rows_per_chunk;
  return k;
}

// The rows of chunk c that rank `owner`'s sequence share has: [r0, r0 + nr) clipped to [0, seq[owner]).
FVK_HD inline int64_t share_rows(const Problem& p, const Chunk& c, int owner) {
  const int64_t end = p.seq[owner] < c.r0 + c.nr ? p.seq[owner] : c.r0 + c.nr;
  return end > c.r0 ? end - c.r0 : 0;
}

// The block `src` sends `dst` in a chunk: rows per plane and bytes per row (see the file comment).
struct Block {
  int64_t rows, run;
};
FVK_HD inline Block pair_block(const Problem& p, const Chunk& c, int src, int dst) {
  return p.mode == 0 ? Block{share_rows(p, c, src), p.run[dst]} : Block{share_rows(p, c, dst), p.run[src]};
}

// Bytes `src` contributes to `dst` in chunk c, and in the full block (the full chunk of the largest shares).
FVK_HD inline int64_t block_bytes(const Problem& p, const Chunk& c, int src, int dst) {
  const Block b = pair_block(p, c, src, dst);
  return c.np * b.rows * b.run;
}
FVK_HD inline int64_t full_block_bytes(const Problem& p) {
  return p.planes_per_chunk * p.rows_per_chunk * p.run_bytes;
}

// Window bytes one call needs on every rank: P full blocks (equals policy.Plan.window_bytes).
FVK_HD inline int64_t window_need(const Problem& p) {
  return p.world * full_block_bytes(p);
}

// Where the block rank `me` exchanges with `peer` in chunk c sits in one of me's tensors: its first byte (from
// the tensor's start), the pitches between its planes and its rows, and its shape. A head-split tensor holds
// peer's heads of me's rows (the block me sends peer in mode 0, receives from it in mode 1); a seq-split tensor
// peer's rows of me's heads (the block me receives from peer in mode 0, sends it in mode 1). Either way the
// block is pair_block's for that direction.
struct View {
  int64_t offset, plane_pitch, row_pitch;
  Block block;
};
FVK_HD inline View tensor_view(const Problem& p, const Chunk& c, int me, int peer, bool head_split) {
  if (head_split) {
    const int64_t plane = p.seq[me] * p.row_bytes;
    return View{c.p0 * plane + c.r0 * p.row_bytes + p.run_at[peer], plane, p.row_bytes,
                Block{share_rows(p, c, me), p.run[peer]}};
  }
  const int64_t plane = p.seq_total * p.run[me];
  return View{c.p0 * plane + (p.seq_at[peer] + c.r0) * p.run[me], plane, p.run[me],
              Block{share_rows(p, c, peer), p.run[me]}};
}

// Bytes of rank r's input and output.
FVK_HD inline int64_t head_split_bytes(const Problem& p, int r) {
  return p.B * p.seq[r] * p.row_bytes;
}
FVK_HD inline int64_t seq_split_bytes(const Problem& p, int r) {
  return p.B * p.seq_total * p.run[r];
}
FVK_HD inline int64_t input_bytes(const Problem& p, int r) {
  return p.mode == 0 ? head_split_bytes(p, r) : seq_split_bytes(p, r);
}
FVK_HD inline int64_t output_bytes(const Problem& p, int r) {
  return p.mode == 0 ? seq_split_bytes(p, r) : head_split_bytes(p, r);
}

struct Span {
  int64_t start, size;
};

// Part i of n items split into k parts: the first n % k parts get one more. Monotone in n: for
// n' <= n, split(n', k, i).size <= split(n, k, i).size (q' < q gives q'+1 <= q; q' == q gives
// r' <= r). That is what lets a smaller block's slice fit the region sized by the full one.
// n < 2^32 (make_problem bounds every block below 2^31 units of 2 bytes), so the kernels divide in 32 bits.
FVK_HD inline Span split(int64_t n, int64_t k, int64_t i) {
  const uint32_t n32 = static_cast<uint32_t>(n), k32 = static_cast<uint32_t>(k), i32 = static_cast<uint32_t>(i);
  const uint32_t q = n32 / k32, r = n32 - q * k32;
  return Span{static_cast<int64_t>(i32 * q + (i32 < r ? i32 : r)), static_cast<int64_t>(q + (i32 < r ? 1 : 0))};
}

// Granules of `bytes` (a multiple of the granule, a power of two).
FVK_HD inline int64_t granules(const Problem& p, int64_t bytes) {
  return bytes >> p.granule_log2;
}

// What CTA `cta` of `ctas` moves of the block `src` sends `dst` in chunk c, and where it sits in dst's window:
// bytes [first, first + bytes) of the block's [plane][row][run] order go to window bytes [window, window +
// bytes), in order. Every rank computes the same slices.
struct Slice {
  int64_t first, bytes, window;
};

// Region `cta` of source `src`'s block in every window: every byte CTA `cta` may touch there in a call. A
// function of (src, cta) and the plan alone (the window invariant).
FVK_HD inline Span cta_region(const Problem& p, int src, int cta, int ctas) {
  const Span region = split(granules(p, full_block_bytes(p)), ctas, cta);
  return Span{src * full_block_bytes(p) + region.start * p.granule, region.size * p.granule};
}

// The kernels' layout (kStatic): the window offset depends on (src, cta) and the full block only.
FVK_HD inline Slice cta_slice_static(const Problem& p, const Chunk& c, int src, int dst, int cta, int ctas) {
  const Span mine = split(granules(p, block_bytes(p, c, src, dst)), ctas, cta);
  return Slice{mine.start * p.granule, mine.size * p.granule, cta_region(p, src, cta, ctas).start};
}

// Either layout, by p.layout: the host checks, the simulation and the debug kernels. The production
// kernel calls cta_slice_static directly (a runtime layout branch there cost registers and spills).
FVK_HD inline Slice cta_slice(const Problem& p, const Chunk& c, int src, int dst, int cta, int ctas) {
  if (p.layout == kMoving) {
    const int64_t bytes = block_bytes(p, c, src, dst), n = granules(p, bytes);
    const int64_t g0 = n * cta / ctas, g1 = n * (cta + 1) / ctas;
    return Slice{g0 * p.granule, (g1 - g0) * p.granule, src * bytes + g0 * p.granule};
  }
  return cta_slice_static(p, c, src, dst, cta, ctas);
}

// Largest power of two <= 16 that divides v (16 for v = 0).
FVK_HD inline int64_t pow2_divisor(uint64_t v) {
  int64_t g = 16;
  while (g > 1 && v % g) g /= 2;
  return g;
}

// The rank-independent part of a call's Problem (x, out and rank are the launcher's). Arguments are
// assumed valid (make_problem checks them); planes and rows are clamped to B and S. `seq` and `heads`: every
// rank's shares, or null for the even ones (S rows, H / P heads); kEvenOnly ignores them.
FVK_HD inline Problem plan_problem(int world, int mode, int itemsize, int64_t B, int64_t S, int64_t H, int64_t D,
                                   const int64_t* seq, const int64_t* heads, int64_t planes_per_chunk,
                                   int64_t rows_per_chunk, int layout) {
  Problem p{};
  p.world = world;
  p.mode = mode;
  p.layout = layout;
  p.itemsize = itemsize;
  p.B = B;
  p.S = S;
  if (layout == kEvenOnly) seq = heads = nullptr;
  uint64_t runs = 0;  // every run's bits: the granule divides them all
  for (int q = 0; q < world; ++q) {
    p.seq[q] = seq ? seq[q] : S;
    p.run[q] = (heads ? heads[q] : H / world) * D * itemsize;
    p.seq_at[q] = p.seq_total;
    p.run_at[q] = p.row_bytes;
    p.seq_total += p.seq[q];
    p.row_bytes += p.run[q];
    p.run_bytes = p.run[q] > p.run_bytes ? p.run[q] : p.run_bytes;
    runs |= static_cast<uint64_t>(p.run[q]);
  }
  p.granule = pow2_divisor(runs);
  while ((int64_t{1} << p.granule_log2) < p.granule) ++p.granule_log2;
  p.planes_per_chunk = planes_per_chunk < B ? planes_per_chunk : B;
  p.rows_per_chunk = rows_per_chunk < S ? rows_per_chunk : S;
  return p;
}

// Host only (ulysses_a2a.cu): bytes per element of a dtype wire code (0 if unknown), and the checks every
// launcher, the simulation and the host checks apply to a call's description (geometry, split tables, plan)
// before filling `p` with plan_problem: the call's own checks (fvk_call's kind and flags are the launcher's).
int itemsize_of(int dtype);
int make_problem(int world, const fvk_call& call, int max_ctas, size_t window_bytes, Problem& p, int layout = kStatic);
// The widest vector (<= the partition granule) every pointer a rank moves data through allows: p.x, p.out
// and `extra` (its windows).
int vector_bytes(const Problem& p, const void* const* extra, int n_extra);

}  // namespace fvk
