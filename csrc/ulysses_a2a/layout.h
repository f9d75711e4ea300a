// Where the Ulysses fused all-to-all puts every byte: chunks, CTA slices and window regions.
//
// Plain C++ usable on the host and the device (FVK_HD): the kernels (movement.cuh) and the host-side
// property check of the synchronisation argument (testing/sync_model.cpp) call exactly these functions, so
// the check tests the layout the kernel runs, not a restatement of it. (The barrier schedule the
// check assumes, two syncs per chunk, is restated there from run_call.)
//
// Terms (the same in both modes). P = world, S = S_local, run = (H/P) * D * itemsize bytes: one
// sequence row of one peer's head block, contiguous in the input, the window and the output.
// A chunk is planes [p0, p0+np) x rows [r0, r0+nr) of every peer's block; its block (what one
// source sends one receiver) is np*nr*run bytes in [plane][row][run] order. Chunks run planes-major,
// then row ranges (policy.Plan.chunks); every chunk but the last of a plane range can be the full
// size, the last ones smaller.
//
// THE WINDOW INVARIANT (what makes per-CTA barriers sufficient; ulysses_a2a.cu argues it):
//   In one call, every window byte belongs to exactly one CTA index for every chunk: CTA i of a
//   sender only stores into, and CTA i of the receiver only copies out of, region i of the window,
//   and region i is a function of (src, i) and the plan alone, never of the current chunk.
// So the window is laid out [src][cta region][bytes], with src blocks at the FULL chunk's stride and
// region i sized for CTA i's slice of the FULL chunk. A smaller chunk is still sliced among all CTAs
// (every CTA stays busy): split() guarantees CTA i's slice of a smaller chunk is never larger than
// its slice of the full one, so it fits its region.
//
// The layout before 2026-11-29 (kMoving, kept for negative controls only) put src blocks at the
// CURRENT chunk's stride and sliced it by floor(n*i/ctas): when a chunk's size changed, region i moved
// onto bytes another CTA index of the peer was still copying out (wrong results on 2x H200).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define FVK_HD __host__ __device__
#else
#define FVK_HD
#endif

namespace fvk {

constexpr int kMaxWorld = 8;
constexpr int kMaxCtas = 144;  // LSA barrier slots: one per CTA of the largest launch

enum Layout : int {
  kStatic = 0,  // the kernel's layout: region i fixed for the whole call
  kMoving = 1,  // negative control only: regions that move with the chunk size (docs/kernel.md)
};

// One rank's view of one call. Everything except x, out, rank and the vector width chosen by the
// launcher is identical on every rank.
struct Problem {
  const char* x;  // this rank's input (read only)
  char* out;      // this rank's output: caller-owned, never aliases a window
  int world, rank, mode, layout;
  int itemsize;
  int64_t B, S;
  int64_t run_bytes;                         // (H / P) * D * itemsize
  int64_t granule;                           // CTA partition unit in bytes (a power of two dividing run_bytes)
  int64_t planes_per_chunk, rows_per_chunk;  // clamped to B and S: the full chunk
};

struct Chunk {
  int64_t p0, np, r0, nr;
};

FVK_HD inline int64_t row_chunks(const Problem& p) {
  return (p.S + p.rows_per_chunk - 1) / p.rows_per_chunk;
}

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

// Bytes one source contributes to one receiver in chunk c, and in the full (largest) chunk.
FVK_HD inline int64_t block_bytes(const Problem& p, const Chunk& c) {
  return c.np * c.nr * p.run_bytes;
}
FVK_HD inline int64_t full_block_bytes(const Problem& p) {
  return p.planes_per_chunk * p.rows_per_chunk * p.run_bytes;
}

// Window bytes one call needs on every rank: P full blocks (equals policy.Plan.window_bytes).
FVK_HD inline int64_t window_need(const Problem& p) {
  return p.world * full_block_bytes(p);
}

struct Span {
  int64_t start, size;
};

// Part i of n items split into k parts: the first n % k parts get one more. Monotone in n: for
// n' <= n, split(n', k, i).size <= split(n, k, i).size (q' < q gives q'+1 <= q; q' == q gives
// r' <= r). That is what lets a smaller chunk's slice fit the region sized by the full chunk.
FVK_HD inline Span split(int64_t n, int64_t k, int64_t i) {
  const int64_t q = n / k, r = n % k;
  return Span{i * q + (i < r ? i : r), q + (i < r ? 1 : 0)};
}

// What CTA `cta` of `ctas` moves of source `src`'s block in chunk c, and where it sits in the
// receiver's window: bytes [first, first + bytes) of the block's [plane][row][run] order go to
// window bytes [window, window + bytes), in order. Every rank computes the same slices.
struct Slice {
  int64_t first, bytes, window;
};

// The kernel's layout (kStatic): the window offset depends on (src, cta) and the full chunk only.
FVK_HD inline Slice cta_slice_static(const Problem& p, const Chunk& c, int src, int cta, int ctas) {
  const Span mine = split(block_bytes(p, c) / p.granule, ctas, cta);
  const Span region = split(full_block_bytes(p) / p.granule, ctas, cta);
  return Slice{mine.start * p.granule, mine.size * p.granule, src * full_block_bytes(p) + region.start * p.granule};
}

// Either layout, by p.layout: the host model, the simulation and the debug kernels. The production
// kernel calls cta_slice_static directly (a runtime layout branch there cost registers and spills).
FVK_HD inline Slice cta_slice(const Problem& p, const Chunk& c, int src, int cta, int ctas) {
  if (p.layout == kMoving) {
    const int64_t granules = block_bytes(p, c) / p.granule;
    const int64_t g0 = granules * cta / ctas, g1 = granules * (cta + 1) / ctas;
    return Slice{g0 * p.granule, (g1 - g0) * p.granule, src * block_bytes(p, c) + g0 * p.granule};
  }
  return cta_slice_static(p, c, src, cta, ctas);
}

// Largest power of two <= 16 that divides v (v > 0).
FVK_HD inline int64_t pow2_divisor(uint64_t v) {
  int64_t g = 16;
  while (g > 1 && v % g) g /= 2;
  return g;
}

// The rank-independent part of a call's Problem (x, out and rank are the launcher's). Arguments are
// assumed valid (the launcher's make_problem checks them); planes and rows are clamped to B and S.
FVK_HD inline Problem plan_problem(int world, int mode, int itemsize, int64_t B, int64_t S, int64_t H, int64_t D,
                                   int64_t planes_per_chunk, int64_t rows_per_chunk, int layout) {
  Problem p{};
  p.world = world;
  p.mode = mode;
  p.layout = layout;
  p.itemsize = itemsize;
  p.B = B;
  p.S = S;
  p.run_bytes = H / world * D * itemsize;
  p.granule = pow2_divisor(static_cast<uint64_t>(p.run_bytes));
  p.planes_per_chunk = planes_per_chunk < B ? planes_per_chunk : B;
  p.rows_per_chunk = rows_per_chunk < S ? rows_per_chunk : S;
  return p;
}

// Host only (ulysses_a2a.cu): bytes per element of a dtype wire code (0 if unknown), and the checks every
// launcher, the simulation and the host checks apply to a call's geometry and plan before filling `p` with
// plan_problem.
int itemsize_of(int dtype);
int make_problem(int world, int mode, int dtype, int64_t B, int64_t S, int64_t H, int64_t D, int ctas, int max_ctas,
                 int64_t planes_per_chunk, int64_t rows_per_chunk, size_t window_bytes, Problem& p,
                 int64_t& operand_bytes, int layout = kStatic);
// The widest vector (<= the partition granule) every pointer a rank moves data through allows: p.x, p.out
// and `extra` (its windows).
int vector_bytes(const Problem& p, const void* const* extra, int n_extra);

// Region `cta` of source `src`'s block in the window: every byte CTA `cta` may touch there in a call
// (the host model checks every kStatic slice lies inside it).
FVK_HD inline Span cta_region(const Problem& p, int src, int cta, int ctas) {
  const Span region = split(full_block_bytes(p) / p.granule, ctas, cta);
  return Span{src * full_block_bytes(p) + region.start * p.granule, region.size * p.granule};
}

}  // namespace fvk
