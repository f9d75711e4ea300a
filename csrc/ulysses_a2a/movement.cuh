// The fused all-to-all's one kernel body: the chunk loop with its barrier points, stores and copy-outs.
//
// `run_call` is the only implementation of a call. It is templated on an Env that says how a CTA
// finds the ranks' windows and how it waits at a barrier:
//   * LsaEnv (lsa_env.cuh): LSA pointers into peers' symmetric windows, ncclLsaBarrierSession;
//   * in the test library: CheckedLsaEnv (testing/checked_launch.cu), LsaEnv stamping every window
//     granule (the epoch checker, `kCheck`), and SimEnv (testing/sim_ranks.cu), P ranks simulated as
//     CTA groups of ONE co-resident launch on one device, with a same-device barrier that has the LSA
//     barrier's per-CTA semantics.
// So the one-GPU check runs the real chunk loop and the real barrier points, not launch-separated
// phases.
//
// Addressing (layout.h): rank `me` sends block q (its rows for peer q); it lands in q's output as
// block `me`. Two tensor layouts of [B, S, H, D]-shaped data, as rows of `run` bytes:
//   head-split [B, S, P, run]: the mode-0 input, the mode-1 output;
//   seq-split  [B, P, S, run]: the mode-0 output, the mode-1 input.
// The window side of every copy is linear: CTA i's slice goes to region i (layout.h's invariant).
#pragma once

#include <cstdint>

#include "layout.h"

namespace fvk {

constexpr int kThreads = 512;
// Two CTAs per SM so that the largest launch (144 CTAs) is co-resident on 132 SMs.
constexpr int kMinBlocksPerSm = 2;
// Independent loads each thread issues before its stores (memory-level parallelism over NVLink).
constexpr int kUnroll = 4;

// Block q of a head-split or seq-split tensor, addressed by the chunk block's linear V-unit index.
template <typename V>
struct TensorRows {
  char* base;
  int64_t S, p0, r0;
  uint32_t run_units, nr;
  int world, q;
  bool head_split;
  FVK_HD V* at(uint32_t u) const {  // host too: the copy-engine kind's host addressing check
    // Unit counts within a block stay below 2^31 (the host checks): 32-bit divisions, no wrap.
    const uint32_t row = u / run_units, k = u - row * run_units;
    const uint32_t pl = row / nr, r = row - pl * nr;
    const int64_t b = p0 + pl, s = r0 + r;
    const int64_t index = head_split ? (b * S + s) * world + q : (b * world + q) * S + s;
    return reinterpret_cast<V*>(base + index * static_cast<int64_t>(run_units) * sizeof(V)) + k;
  }
};

template <typename V>
FVK_HD inline TensorRows<V> tensor_rows(const Problem& p, const Chunk& c, char* base, int q, bool head_split) {
  return TensorRows<V>{
      base,    p.S, c.p0,      c.r0, static_cast<uint32_t>(p.run_bytes / sizeof(V)), static_cast<uint32_t>(c.nr),
      p.world, q,   head_split};
}

// A CTA's slice in a window region: unit u of the block sits at base + (u - first).
template <typename V>
struct WindowRun {
  char* base;
  uint32_t first;
  FVK_HD V* at(uint32_t u) const { return reinterpret_cast<V*>(base) + (u - first); }
};

// Copy units [u0, u1) from `src` to `dst`, the whole CTA cooperating; `hook(u)` runs before each
// unit moves (the epoch checker; empty otherwise).
template <typename V, typename Src, typename Dst, typename Hook>
__device__ inline void copy_units(const Src& src, const Dst& dst, uint32_t u0, uint32_t u1, const Hook& hook) {
  for (uint32_t base = u0 + threadIdx.x; base < u1; base += kUnroll * blockDim.x) {
    V v[kUnroll];
    V* d[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const uint32_t u = base + j * blockDim.x;
      if (u < u1) {
        hook(u);
        v[j] = *src.at(u);
        d[j] = dst.at(u);
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (base + j * blockDim.x < u1) *d[j] = v[j];
    }
  }
}

struct NoHook {
  __device__ void operator()(uint32_t) const {}
};

// Epoch-checker hook: the window granule a unit lands in, stamped through the Env as a store into
// `rank`'s window (kStore) or as this rank's copy-out of `rank`'s slice.
template <typename V, typename Env, bool kStore>
struct GranuleHook {
  Env* env;
  int rank, cta;
  int64_t chunk, window, granule;
  uint32_t first;
  __device__ void operator()(uint32_t u) const {
    const int64_t g = (window + static_cast<int64_t>(u - first) * sizeof(V)) / granule;
    if constexpr (kStore)
      env->check_store(rank, g, cta, chunk);
    else
      env->check_load(rank, g, cta, chunk);
  }
};

// Store phase of chunk c: this CTA's slice of this rank's block for every peer into that peer's
// window (region `cta`), and its own block straight into the output (it never needs the window).
// Peers are visited starting after `rank` so that ranks spread their stores over different links.
// The slice a CTA moves: the static layout in production, p.layout where the Env allows the pre-fix
// layout as a negative control (debug and simulation only).
template <typename Env>
__device__ inline Slice env_slice(const Problem& p, const Chunk& c, int src, int cta, int ctas) {
  if constexpr (Env::kAnyLayout)
    return cta_slice(p, c, src, cta, ctas);
  else
    return cta_slice_static(p, c, src, cta, ctas);
}

template <typename V, typename Env>
__device__ void store_chunk(const Problem& p, const Chunk& c, int64_t ci, Env& env, int cta, int ctas) {
  const Slice s = env_slice<Env>(p, c, p.rank, cta, ctas);
  if (s.bytes == 0) return;
  const uint32_t u0 = static_cast<uint32_t>(s.first / sizeof(V)), u1 = u0 + static_cast<uint32_t>(s.bytes / sizeof(V));
  const bool in_head_split = p.mode == 0;
  for (int j = 1; j <= p.world; ++j) {
    const int q = (p.rank + j) % p.world;
    const TensorRows<V> src = tensor_rows<V>(p, c, const_cast<char*>(p.x), q, in_head_split);
    if (q == p.rank) {
      copy_units<V>(src, tensor_rows<V>(p, c, p.out, p.rank, !in_head_split), u0, u1, NoHook{});
    } else {
      const WindowRun<V> dst{env.window(q) + s.window, u0};
      if constexpr (Env::kCheck)
        copy_units<V>(src, dst, u0, u1, GranuleHook<V, Env, true>{&env, q, cta, ci, s.window, p.granule, u0});
      else
        copy_units<V>(src, dst, u0, u1, NoHook{});
    }
  }
}

// Copy-out phase of chunk c: region `cta` of this rank's window (every other rank's slice) into the output.
template <typename V, typename Env>
__device__ void copy_out_chunk(const Problem& p, const Chunk& c, int64_t ci, Env& env, int cta, int ctas) {
  const bool out_head_split = p.mode == 1;
  char* own = env.window(p.rank);
  for (int src_rank = 0; src_rank < p.world; ++src_rank) {
    if (src_rank == p.rank) continue;  // written straight to the output by the store phase
    const Slice s = env_slice<Env>(p, c, src_rank, cta, ctas);
    if (s.bytes == 0) continue;
    const uint32_t u0 = static_cast<uint32_t>(s.first / sizeof(V)),
                   u1 = u0 + static_cast<uint32_t>(s.bytes / sizeof(V));
    const WindowRun<V> src{own + s.window, u0};
    const TensorRows<V> dst = tensor_rows<V>(p, c, p.out, src_rank, out_head_split);
    if constexpr (Env::kCheck)
      copy_units<V>(src, dst, u0, u1, GranuleHook<V, Env, false>{&env, src_rank, cta, ci, s.window, p.granule, u0});
    else
      copy_units<V>(src, dst, u0, u1, NoHook{});
  }
}

// One call as CTA `cta` of `ctas` runs it: per chunk, barrier / store / barrier / copy-out.
// ulysses_a2a.cu's header argues why per-CTA barriers suffice; testing/sync_model.cpp checks that argument
// as a property over the plan space, on the same layout functions.
template <typename V, typename Env>
__device__ void run_call(const Problem& p, Env& env, int cta, int ctas) {
  const int64_t chunks = num_chunks(p);
  for (int64_t c = 0; c < chunks; ++c) {
    const Chunk chunk = chunk_at(p, c);
    env.sync();  // CTA `cta` of every rank has copied region `cta` out (chunk c-1 / the previous call)
    store_chunk<V>(p, chunk, c, env, cta, ctas);
    env.sync();  // CTA `cta` of every rank has stored into region `cta` of this rank's window
    copy_out_chunk<V>(p, chunk, c, env, cta, ctas);
  }
}

}  // namespace fvk
