// The benchmark's fabric limit (fvk_fabric_copy, ulysses_a2a_testing.h): a flat push of the same bytes into
// every peer's window at once, between two barriers, on a real communicator. It uses the product launch
// path's pieces (context checks, call ordering, the copy-engine schedule's barrier, poisoning), so it is
// ordered with the context's launches as every launch is; the host property check does not model it (it
// never runs between a job's calls).
#include "../context.h"
#include "../movement.cuh"  // kThreads
#include "ulysses_a2a_testing.h"

namespace fvk {
namespace {

// The SM engine: a flat copy of `units` 16-byte units from `src` into every peer's dst.
struct PeerPointers {
  uint4* at[kMaxWorld];
};
__global__ void __launch_bounds__(kThreads)
    flat_push_kernel(const uint4* src, int64_t units, int world, int rank, PeerPointers dst) {
  for (int j = 1; j < world; ++j) {
    uint4* out = dst.at[(rank + j) % world];
    for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; u < units;
         u += static_cast<int64_t>(gridDim.x) * blockDim.x)
      out[u] = src[u];
  }
}

// Entry barrier, every rank copies `bytes` from its window's start into every peer's window (at
// (1 + rank) * bytes, so no two writers overlap), exit barrier. engine 0: one copy-engine copy per peer;
// 1: `ctas` CTAs of SM stores.
int fabric_local(fvk_ctx* ctx, int64_t bytes, int engine, int ctas, cudaStream_t s) {
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  unsigned long long capture_id = 0;
  FVK_TRY(order_call(ctx, s, false, capture_id));
  FVK_TRY(enqueue_barrier(*ctx, s));
  const int64_t offset = (1 + static_cast<int64_t>(ctx->rank)) * bytes;
  if (engine == FVK_FABRIC_COPY_ENGINE) {
    for (int j = 1; j < ctx->nranks; ++j) {
      const int q = (ctx->rank + j) % ctx->nranks;
      FVK_CUDA(cudaMemcpyAsync(ctx->peers[q] + offset, ctx->buffer, bytes, cudaMemcpyDefault, s));
    }
  } else {
    PeerPointers dst{};
    for (int q = 0; q < ctx->nranks; ++q) dst.at[q] = reinterpret_cast<uint4*>(ctx->peers[q] + offset);
    flat_push_kernel<<<ctas, kThreads, 0, s>>>(static_cast<const uint4*>(ctx->buffer), bytes / 16, ctx->nranks,
                                               ctx->rank, dst);
    FVK_CUDA(cudaGetLastError());
  }
  FVK_TRY(enqueue_barrier(*ctx, s));
  return finish_call(ctx, s, false, capture_id);
}

}  // namespace
}  // namespace fvk

using namespace fvk;

extern "C" int fvk_fabric_copy(fvk_ctx* ctx, int64_t bytes, int engine, int ctas, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  FVK_TRY(check_context(ctx, true));
  FVK_TRY(refuse_capture(s, "fvk_fabric_copy"));
  if (bytes <= 0 || bytes % 16 || static_cast<uint64_t>(bytes) * (ctx->nranks + 1) > ctx->bytes)
    return set_error(FVK_ERR_INVALID,
                     "fabric copy of %lld bytes: need a positive multiple of 16 with (P + 1) x bytes "
                     "<= the window (%zu)",
                     (long long)bytes, ctx->bytes);
  if (engine != FVK_FABRIC_COPY_ENGINE && engine != FVK_FABRIC_SM)
    return set_error(FVK_ERR_INVALID, "engine %d is not 0 (copy engine) or 1 (SM)", engine);
  if (ctas < 1 || ctas > 1024) return set_error(FVK_ERR_INVALID, "ctas=%d outside 1..1024", ctas);
  // Past the agreed checks: peers may already wait at the first barrier (as for every launch).
  const int rc = fabric_local(ctx, bytes, engine, ctas, s);
  if (rc != FVK_OK) ctx->poisoned = "a fabric copy that failed on this rank after every rank agreed to run it";
  return rc;
}
