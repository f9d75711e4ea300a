// The epoch-checked SM launch (fvk_launch with FVK_CALL_DEBUG, ulysses_a2a_testing.h): the fused kernel's own
// body on real ranks, with every window granule stamped. It is an SmVariant (../context.h) that this file
// registers with the product launch path when the test library loads, so the launch around it (checks,
// operands, call ordering, poisoning) is the product's; only the kernel and its stamp area differ.
#include "../context.h"
#include "../lsa_env.cuh"
#include "epoch.cuh"
#include "ulysses_a2a_testing.h"

namespace fvk {
namespace {

// Where the stamps live in every rank's window: past the plan's bytes, 8 per granule.
struct StampArea {
  int64_t offset, bytes;
};
inline StampArea stamp_area(const Problem& p) {
  return StampArea{(window_need(p) + 255) / 256 * 256, window_need(p) / p.granule * 8};
}

struct DebugArgs {
  int64_t shadow_offset;       // window offset of the stamp array (same on every rank)
  unsigned long long* report;  // this rank's device report (see report_violation)
  uint32_t call;
};

// LsaEnv plus the stamps: the pre-fix layout is allowed (the negative control), and every store and copy-out
// stamps the granule in the window it touches (peers' windows through LSA pointers).
struct CheckedLsaEnv : LsaEnv {
  static constexpr bool kCheck = true;
  static constexpr bool kAnyLayout = true;
  DebugArgs dbg;
  __device__ unsigned long long* shadow(int peer) const {
    return reinterpret_cast<unsigned long long*>(window(peer) + dbg.shadow_offset);
  }
  __device__ void check_store(int peer, int64_t g, int cta, int64_t chunk) {
    epoch_store(shadow(peer), g, dbg.report, rank, peer, cta, chunk, dbg.call);
  }
  __device__ void check_load(int src, int64_t g, int cta, int64_t chunk) {
    epoch_load(shadow(rank), g, dbg.report, rank, src, cta, chunk, dbg.call);
  }
};

template <typename V>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    checked_a2a_kernel(const __grid_constant__ Problem p, ncclWindow_t window, ncclDevComm dev_comm, DebugArgs dbg) {
  run_on_lsa<V, CheckedLsaEnv>(p, window, dev_comm, dbg);
}

int checked_layout(const fvk_call& call) {
  return (call.flags & FVK_CALL_DEBUG_MOVING_LAYOUT) ? kMoving : kStatic;
}

int checked_check(const fvk_ctx& ctx, const Problem& p, const fvk_call& call) {
  if (!call.debug_report)
    return set_error(FVK_ERR_INVALID, "FVK_CALL_DEBUG needs fvk_call.debug_report (device memory, 5 x uint64)");
  const StampArea stamps = stamp_area(p);
  const int64_t need = stamps.offset + stamps.bytes;
  if (need > static_cast<int64_t>(ctx.bytes))
    return set_error(FVK_ERR_INVALID,
                     "the epoch checker needs %lld window bytes (the plan's %lld + stamps), the window has %zu",
                     (long long)need, (long long)window_need(p), ctx.bytes);
  return FVK_OK;
}

int checked_enqueue(const fvk_ctx& ctx, const Problem& p, int vec, const fvk_call& call, cudaStream_t s) {
  // Stamps live in every rank's window past the plan's bytes (peers stamp through LSA pointers). Cleared on
  // this rank's stream: peers stamp here only after barrier 0, i.e. after this rank's kernel started, i.e.
  // after the clear; and their stamps of the previous call all happened before this rank's previous kernel
  // ended.
  const StampArea stamps = stamp_area(p);
  // The stamps are cleared every call: no call id (a per-rank counter could diverge).
  const DebugArgs dbg{stamps.offset, static_cast<unsigned long long*>(call.debug_report), 0};
  FVK_CUDA(cudaMemsetAsync(static_cast<char*>(ctx.buffer) + stamps.offset, 0, stamps.bytes, s));
  switch (vec) {
    case 16: checked_a2a_kernel<uint4><<<call.ctas, kThreads, 0, s>>>(p, ctx.window, ctx.dev_comm, dbg); break;
    case 8: checked_a2a_kernel<uint2><<<call.ctas, kThreads, 0, s>>>(p, ctx.window, ctx.dev_comm, dbg); break;
    case 4: checked_a2a_kernel<uint32_t><<<call.ctas, kThreads, 0, s>>>(p, ctx.window, ctx.dev_comm, dbg); break;
    default: checked_a2a_kernel<uint16_t><<<call.ctas, kThreads, 0, s>>>(p, ctx.window, ctx.dev_comm, dbg); break;
  }
  FVK_CUDA(cudaGetLastError());
  return FVK_OK;
}

constexpr SmVariant kChecked{checked_layout, checked_check, checked_enqueue};

// At load time (a namespace-scope initializer of this library): fvk_launch runs kChecked for FVK_CALL_DEBUG.
[[maybe_unused]] const bool kRegistered = (g_debug_variant = &kChecked, true);

}  // namespace
}  // namespace fvk

extern "C" int fvk_testing_abi_version(void) {
  return FVK_TESTING_ABI_VERSION;
}
