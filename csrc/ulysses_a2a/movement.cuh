// Data movement of the Ulysses fused all-to-all: addressing and copies only, no synchronisation.
//
// The fused kernel (ulysses_a2a.cu) and the simulated-peers kernels run exactly these functions;
// they differ only in how they find the peers' windows (LSA pointers vs. a table of P buffers on
// one device) and in what separates the phases (an LSA barrier vs. a kernel-launch boundary).
//
// Terms (the same in both modes). P = world, S = S_local, run = (H/P) * D * itemsize bytes: one
// sequence row of one peer's head block, contiguous in the input, the window and the output.
// Two tensor layouts of [B, S, H, D]-shaped data, as rows of `run` bytes:
//   head-split [B, S, P, run]: the mode-0 input, the mode-1 output;
//   seq-split  [B, P, S, run]: the mode-0 output, the mode-1 input.
// Rank `me` sends block q = its rows for peer q; it lands in q's output as block `me`.
//
// A chunk is planes [p0, p0+np) x rows [r0, r0+nr) of every peer's block. Its receiver-side window
// layout, from window offset 0, is [src rank][plane][row][run]: src's share is one contiguous block
// of np*nr*run bytes. Each block is partitioned among CTAs in `granule` units (a function of the
// geometry only, so every rank computes identical slices): CTA i on a sender writes exactly the
// part of each receiver's window that CTA i on that receiver later copies out.
#pragma once

#include <cstdint>

namespace fvk {

constexpr int kMaxWorld = 8;
constexpr int kThreads = 512;
// Two CTAs per SM so that the largest launch (144 CTAs) is co-resident on 132 SMs.
constexpr int kMinBlocksPerSm = 2;
// Independent loads each thread issues before its stores (memory-level parallelism over NVLink).
constexpr int kUnroll = 4;

// One rank's view of one call. Everything except x, out, rank and the vector width chosen by the
// launcher is identical on every rank.
struct Problem {
  const char* x;  // this rank's input (read only)
  char* out;      // this rank's output: caller-owned, never aliases a window
  int world, rank, mode;
  int64_t B, S;
  int64_t run_bytes;  // (H / P) * D * itemsize
  int64_t granule;    // CTA partition unit in bytes (a power of two dividing run_bytes)
  int64_t planes_per_chunk, rows_per_chunk;
};

struct Chunk {
  int64_t p0, np, r0, nr;
};

__host__ __device__ inline int64_t row_chunks(const Problem& p) {
  return (p.S + p.rows_per_chunk - 1) / p.rows_per_chunk;
}

__host__ __device__ inline int64_t num_chunks(const Problem& p) {
  return (p.B + p.planes_per_chunk - 1) / p.planes_per_chunk * row_chunks(p);
}

// Chunk c in launch order (policy.Plan.chunks: planes-major, then row ranges).
__host__ __device__ inline Chunk chunk_at(const Problem& p, int64_t c) {
  const int64_t rc = row_chunks(p);
  Chunk k;
  k.p0 = c / rc * p.planes_per_chunk;
  k.np = (p.B - k.p0 < p.planes_per_chunk) ? p.B - k.p0 : p.planes_per_chunk;
  k.r0 = c % rc * p.rows_per_chunk;
  k.nr = (p.S - k.r0 < p.rows_per_chunk) ? p.S - k.r0 : p.rows_per_chunk;
  return k;
}

// Bytes one source rank contributes to one receiver's window in chunk c.
__host__ __device__ inline int64_t block_bytes(const Problem& p, const Chunk& c) {
  return c.np * c.nr * p.run_bytes;
}

// The V units [u0, u1) of every source rank's block that CTA `cta` of `ctas` owns: the same slice
// of each block, counted in `granule` units, on every rank. Slicing each block (rather than the
// whole [src][...] window) gives every CTA work in both phases: it stores its slice of this rank's
// block to every peer, then copies its slice of every peer's block out of its own window.
template <typename V>
__device__ inline void cta_units(const Problem& p, const Chunk& c, int cta, int ctas, uint32_t& u0, uint32_t& u1) {
  const int64_t granules = block_bytes(p, c) / p.granule;
  const int64_t per = p.granule / static_cast<int64_t>(sizeof(V));
  u0 = static_cast<uint32_t>(granules * cta / ctas * per);
  u1 = static_cast<uint32_t>(granules * (cta + 1) / ctas * per);
}

// Where row (plane pl, row r) of the chunk lives, for the two kinds of endpoint of a copy.
struct WindowBlock {  // one src rank's contiguous block in a window: [plane][row][run]
  char* base;
  int64_t nr, run;
  __device__ char* row(const Chunk&, int64_t pl, int64_t r) const { return base + (pl * nr + r) * run; }
};

struct TensorBlock {  // block q of a head-split or seq-split tensor
  char* base;
  int64_t S, run;
  int world, q;
  bool head_split;
  __device__ char* row(const Chunk& c, int64_t pl, int64_t r) const {
    const int64_t b = c.p0 + pl, s = c.r0 + r;
    const int64_t index = head_split ? (b * S + s) * world + q : (b * world + q) * S + s;
    return base + index * run;
  }
};

// Copy units [u0, u1) (V-sized, counted linearly over the block's [plane][row][run] order) from
// `src` to `dst`, the whole CTA cooperating. Unit counts within a block stay below 2^31 (the host
// checks), which keeps the per-unit index arithmetic in 32-bit divisions without wrap-around.
template <typename V, typename Src, typename Dst>
__device__ inline void copy_block(const Src& src, const Dst& dst, const Chunk& c, int64_t run_bytes, uint32_t u0,
                                  uint32_t u1) {
  const uint32_t run_units = static_cast<uint32_t>(run_bytes / sizeof(V));
  const uint32_t nr = static_cast<uint32_t>(c.nr);
  for (uint32_t base = u0 + threadIdx.x; base < u1; base += kUnroll * blockDim.x) {
    V v[kUnroll];
    V* d[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const uint32_t u = base + j * blockDim.x;
      if (u < u1) {
        const uint32_t row = u / run_units, k = u - row * run_units;
        const uint32_t pl = row / nr, r = row - pl * nr;
        v[j] = *reinterpret_cast<const V*>(src.row(c, pl, r) + static_cast<int64_t>(k) * sizeof(V));
        d[j] = reinterpret_cast<V*>(dst.row(c, pl, r) + static_cast<int64_t>(k) * sizeof(V));
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (base + j * blockDim.x < u1) *d[j] = v[j];
    }
  }
}

// Store phase: this CTA's share of chunk c into every peer's window (LSA stores), and its own
// block straight into the output (it never needs the window). Peers are visited starting after
// `rank` so that ranks spread their stores over different links at any moment.
template <typename V, typename Windows>
__device__ void store_chunk(const Problem& p, const Chunk& c, const Windows& windows, int cta, int ctas) {
  uint32_t u0, u1;
  cta_units<V>(p, c, cta, ctas, u0, u1);
  if (u0 >= u1) return;
  const int64_t bytes = block_bytes(p, c);
  const bool in_head_split = p.mode == 0;
  for (int j = 1; j <= p.world; ++j) {
    const int q = (p.rank + j) % p.world;
    const TensorBlock src{const_cast<char*>(p.x), p.S, p.run_bytes, p.world, q, in_head_split};
    if (q == p.rank) {
      const TensorBlock dst{p.out, p.S, p.run_bytes, p.world, p.rank, !in_head_split};
      copy_block<V>(src, dst, c, p.run_bytes, u0, u1);
    } else {
      const WindowBlock dst{windows(q) + p.rank * bytes, c.nr, p.run_bytes};
      copy_block<V>(src, dst, c, p.run_bytes, u0, u1);
    }
  }
}

// Copy-out phase: this CTA's range of this rank's window (every other rank's block) into the output.
template <typename V>
__device__ void copy_out_chunk(const Problem& p, const Chunk& c, char* window, int cta, int ctas) {
  uint32_t u0, u1;
  cta_units<V>(p, c, cta, ctas, u0, u1);
  if (u0 >= u1) return;
  const int64_t bytes = block_bytes(p, c);
  const bool out_head_split = p.mode == 1;
  for (int src_rank = 0; src_rank < p.world; ++src_rank) {
    if (src_rank == p.rank) continue;  // written straight to the output by the store phase
    const WindowBlock src{window + src_rank * bytes, c.nr, p.run_bytes};
    const TensorBlock dst{p.out, p.S, p.run_bytes, p.world, src_rank, out_head_split};
    copy_block<V>(src, dst, c, p.run_bytes, u0, u1);
  }
}

}  // namespace fvk
