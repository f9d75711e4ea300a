// The fused all-to-all's one kernel body: the chunk loop with its barrier points, stores and copy-outs, and the
// copy-engine kind's on-device copies.
//
// `run_call` is the only implementation of a call. It is templated on an Env that says how a CTA
// finds the ranks' windows and how it waits at a barrier:
//   * LsaEnv (lsa_env.cuh): LSA pointers into peers' symmetric windows, ncclLsaBarrierSession;
//   * in the test library: CheckedLsaEnv (testing/checked_launch.cu), LsaEnv stamping every window
//     granule (the epoch checker, `kCheck`), and SimEnv (testing/sim_ranks.cu), P ranks simulated as
//     CTA groups of ONE co-resident launch on one device, with a same-device barrier that has the LSA
//     barrier's per-CTA semantics;
//   * host Envs (`kHost`) of the test library's host checks (testing/sync_model.cu records every window
//     access and barrier of run_call; testing/addressing.cu moves host bytes through store_chunk and
//     copy_out_chunk): the same functions, compiled for the host too (FVK_HD).
// So the one-GPU check runs the real chunk loop and the real barrier points, not launch-separated
// phases, and the host checks check the kernel's own addressing and barrier points.
//
// Addressing (layout.h): rank `me` sends peer q the block of its input that tensor_view(me, q) names; it lands
// in q's output where tensor_view(q, me) names. The window side of every copy is linear: CTA i's slice goes to
// region i (layout.h's invariant).
#pragma once

#include <cstdint>

#include "ce_plan.h"
#include "layout.h"

namespace fvk {

constexpr int kThreads = 512;
// Two CTAs per SM so that the largest launch (144 CTAs) is co-resident on 132 SMs.
constexpr int kMinBlocksPerSm = 2;
// Independent loads each thread issues before its stores (memory-level parallelism over NVLink).
constexpr int kUnroll = 4;

// One block of a tensor (layout.h's View), addressed by the block's linear V-unit index.
template <typename V>
struct TensorRows {
  char* base;  // the block's first byte
  int64_t plane_pitch, row_pitch;
  uint32_t run_units, nr;
  FVK_HD V* at(uint32_t u) const {
    // Unit counts within a block stay below 2^31 (make_problem checks): 32-bit divisions, no wrap.
    const uint32_t row = u / run_units, k = u - row * run_units;
    const uint32_t pl = row / nr, r = row - pl * nr;
    return reinterpret_cast<V*>(base + pl * plane_pitch + r * row_pitch) + k;
  }
};

// The block rank `me` exchanges with `peer` in chunk c, in me's tensor at `base` (layout.h's tensor_view).
template <typename V>
FVK_HD inline TensorRows<V> tensor_rows(const Problem& p, const Chunk& c, char* base, int me, int peer,
                                        bool head_split) {
  const View v = tensor_view(p, c, me, peer, head_split);
  return TensorRows<V>{base + v.offset, v.plane_pitch, v.row_pitch, static_cast<uint32_t>(v.block.run / sizeof(V)),
                       static_cast<uint32_t>(v.block.rows)};
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
  FVK_HD void operator()(uint32_t) const {}
};

// Moves units [u0, u1) of a block: copy_units on the device; a host Env (`kHost`: the host checks) records or
// performs the move itself (`Env::move`, told which kind of move it is).
enum MoveKind : int { kMoveOwn, kMoveStore, kMoveCopyOut };
#pragma nv_exec_check_disable
template <typename V, typename Env, typename Src, typename Dst, typename Hook>
FVK_HD inline void move_units(Env& env, MoveKind kind, const Src& src, const Dst& dst, uint32_t u0, uint32_t u1,
                              const Hook& hook) {
  if constexpr (Env::kHost)
    env.move(kind, src, dst, u0, u1);
  else
    copy_units<V>(src, dst, u0, u1, hook);
}

// The device's Env for code with no window or barrier of its own (the copy-engine kind's kernels).
struct OnDevice {
  static constexpr bool kHost = false;
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

// The slice a CTA moves: the static layout in production, p.layout where the Env allows the negative-control
// layouts (debug, simulation and host checks only).
template <typename Env>
FVK_HD inline Slice env_slice(const Problem& p, const Chunk& c, int src, int dst, int cta, int ctas) {
  if constexpr (Env::kAnyLayout)
    return cta_slice(p, c, src, dst, cta, ctas);
  else
    return cta_slice_static(p, c, src, dst, cta, ctas);
}

// Store phase of chunk c: this CTA's slice of this rank's block for every peer into that peer's
// window (region `cta`), and its own block straight into the output (it never needs the window).
// Peers are visited starting after `rank` so that ranks spread their stores over different links. A peer
// the rank sends nothing to (an empty block: a share of 0, or rows past a shorter share) is skipped.
#pragma nv_exec_check_disable
template <typename V, typename Env>
FVK_HD void store_chunk(const Problem& p, const Chunk& c, int64_t ci, Env& env, int cta, int ctas) {
  const bool in_head_split = p.mode == 0;
  for (int j = 1; j <= p.world; ++j) {
    const int q = (p.rank + j) % p.world;
    const Slice s = env_slice<Env>(p, c, p.rank, q, cta, ctas);
    if (s.bytes == 0) continue;
    const uint32_t u0 = static_cast<uint32_t>(s.first / sizeof(V)),
                   u1 = u0 + static_cast<uint32_t>(s.bytes / sizeof(V));
    const TensorRows<V> src = tensor_rows<V>(p, c, const_cast<char*>(p.x), p.rank, q, in_head_split);
    if (q == p.rank) {
      move_units<V>(env, kMoveOwn, src, tensor_rows<V>(p, c, p.out, p.rank, p.rank, !in_head_split), u0, u1, NoHook{});
    } else {
      const WindowRun<V> dst{env.window(q) + s.window, u0};
      if constexpr (Env::kCheck)
        move_units<V>(env, kMoveStore, src, dst, u0, u1,
                      GranuleHook<V, Env, true>{&env, q, cta, ci, s.window, p.granule, u0});
      else
        move_units<V>(env, kMoveStore, src, dst, u0, u1, NoHook{});
    }
  }
}

// Copy-out phase of chunk c: region `cta` of this rank's window (every other rank's slice) into the output.
#pragma nv_exec_check_disable
template <typename V, typename Env>
FVK_HD void copy_out_chunk(const Problem& p, const Chunk& c, int64_t ci, Env& env, int cta, int ctas) {
  const bool out_head_split = p.mode == 1;
  char* own = env.window(p.rank);
  for (int src_rank = 0; src_rank < p.world; ++src_rank) {
    if (src_rank == p.rank) continue;  // written straight to the output by the store phase
    const Slice s = env_slice<Env>(p, c, src_rank, p.rank, cta, ctas);
    if (s.bytes == 0) continue;
    const uint32_t u0 = static_cast<uint32_t>(s.first / sizeof(V)),
                   u1 = u0 + static_cast<uint32_t>(s.bytes / sizeof(V));
    const WindowRun<V> src{own + s.window, u0};
    const TensorRows<V> dst = tensor_rows<V>(p, c, p.out, p.rank, src_rank, out_head_split);
    if constexpr (Env::kCheck)
      move_units<V>(env, kMoveCopyOut, src, dst, u0, u1,
                    GranuleHook<V, Env, false>{&env, src_rank, cta, ci, s.window, p.granule, u0});
    else
      move_units<V>(env, kMoveCopyOut, src, dst, u0, u1, NoHook{});
  }
}

// One call as CTA `cta` of `ctas` runs it: per chunk, barrier / store / barrier / copy-out. Every rank runs the
// same chunks (layout.h's num_chunks), whatever its shares, so an idle rank meets every barrier too.
// ulysses_a2a.cu's header argues why per-CTA barriers suffice; testing/sync_model.cu checks that argument
// as a property over the plan space, on this function's own accesses and barrier points.
#pragma nv_exec_check_disable
template <typename V, typename Env>
FVK_HD void run_call(const Problem& p, Env& env, int cta, int ctas) {
  const int64_t chunks = num_chunks(p);
  for (int64_t c = 0; c < chunks; ++c) {
    const Chunk chunk = chunk_at(p, c);
    env.sync();  // CTA `cta` of every rank has copied region `cta` out (chunk c-1 / the previous call)
    store_chunk<V>(p, chunk, c, env, cta, ctas);
    env.sync();  // CTA `cta` of every rank has stored into region `cta` of this rank's window
    copy_out_chunk<V>(p, chunk, c, env, cta, ctas);
  }
}

// ---- the copy-engine kind's on-device copies (ce_plan.h has its window and schedule; ulysses_a2a.cu's kernels
// run these with `part` = blockIdx.x of `parts` = gridDim.x CTAs, testing/addressing.cu on host bytes)

// Part `part` of `parts` of a block of `bytes`, in V units.
template <typename V>
FVK_HD inline void block_share(int64_t bytes, uint32_t part, uint32_t parts, uint32_t& u0, uint32_t& u1) {
  const Span mine = split(bytes / static_cast<int64_t>(sizeof(V)), parts, part);
  u0 = static_cast<uint32_t>(mine.start);
  u1 = static_cast<uint32_t>(mine.start + mine.size);
}

// Chunk `ci` of the own block, input -> output (it never crosses the fabric).
#pragma nv_exec_check_disable
template <typename V, typename Env>
FVK_HD void ce_own_chunk(const Problem& p, int64_t ci, uint32_t part, uint32_t parts, Env& env) {
  const Chunk c = chunk_at(p, ci);
  const bool in_head_split = p.mode == 0;
  uint32_t u0, u1;
  block_share<V>(block_bytes(p, c, p.rank, p.rank), part, parts, u0, u1);
  if (u0 == u1) return;
  move_units<V>(env, kMoveOwn, tensor_rows<V>(p, c, const_cast<char*>(p.x), p.rank, p.rank, in_head_split),
                tensor_rows<V>(p, c, p.out, p.rank, p.rank, !in_head_split), u0, u1, NoHook{});
}

// Chunk `ci`: every peer's block from buffer ci % 2 of this rank's window into the output.
#pragma nv_exec_check_disable
template <typename V, typename Env>
FVK_HD void ce_copy_out_chunk(const Problem& p, int64_t ci, char* window, uint32_t part, uint32_t parts, Env& env) {
  const Chunk c = chunk_at(p, ci);
  for (int src = 0; src < p.world; ++src) {
    if (src == p.rank) continue;
    uint32_t u0, u1;
    block_share<V>(block_bytes(p, c, src, p.rank), part, parts, u0, u1);
    if (u0 == u1) continue;
    move_units<V>(env, kMoveCopyOut, WindowRun<V>{window + ce_block_offset(p, static_cast<int>(ci % 2), src), 0},
                  tensor_rows<V>(p, c, p.out, p.rank, src, p.mode == 1), u0, u1, NoHook{});
  }
}

}  // namespace fvk
