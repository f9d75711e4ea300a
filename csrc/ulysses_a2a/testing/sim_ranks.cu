// P simulated ranks on one GPU (fvk_sim_a2a, ulysses_a2a_testing.h): the fused kernel's own body, run_call in
// movement.cuh, with every rank a CTA group of ONE co-resident launch and a same-device barrier that has the
// LSA barrier's per-CTA semantics. So the one-GPU check runs the real chunk loop and barrier points, not
// launch-separated phases (which hid the race the first 2-GPU run found: docs/kernel.md).
#include <cuda/atomic>

#include "../movement.cuh"
#include "../status.h"
#include "epoch.cuh"
#include "ulysses_a2a_testing.h"

namespace fvk {
namespace {

// P ranks as CTA groups of ONE launch of P x max_ctas co-resident CTAs (block b plays CTA b % max_ctas
// of rank b / max_ctas), running a sequence of calls through the same run_call as the fused kernel.
constexpr int kSimThreads = 128;
constexpr int kSimMinBlocksPerSm = 9;  // 132 SMs x 9 >= 8 ranks x 144 CTAs
constexpr int kMaxSimCalls = 4;

struct SimCall {
  Problem rank[kMaxWorld];
  int vec[kMaxWorld];  // each simulated rank's vector width, chosen from its own pointers
  int ctas;
};

struct SimLaunch {
  SimCall calls[kMaxSimCalls];
  int ncalls, world, max_ctas;
};

struct SimShared {
  char* window[kMaxWorld];
  unsigned long long* shadow[kMaxWorld];  // per rank's window, when checking
  unsigned int* slots;                    // [max_ctas][world]: arrivals per barrier slot, as epochs
  unsigned int* call_done;                // [world]: CTAs of each rank that finished the current call
  unsigned long long* report;
  unsigned long long seed;
  unsigned int skew_ns;  // 0: no skew; else random delays up to this around every barrier
};

// The same-device barrier with the LSA barrier's per-CTA semantics: slot i synchronises CTA i of
// every simulated rank and nothing else; epochs persist across chunks and calls as the LSA
// barrier's do. A rank's call boundary (stream order: its next kernel starts when this one has
// ended) is a rank-local arrival count over all of that rank's CTAs.
template <bool Check>
struct SimEnv {
  static constexpr bool kHost = false;
  static constexpr bool kCheck = Check;
  static constexpr bool kAnyLayout = true;
  const SimShared* sh;
  int rank, world, cta;
  unsigned int epoch = 0, k = 0;
  uint32_t call = 0;

  __device__ char* window(int peer) const { return sh->window[peer]; }

  __device__ void skew(unsigned int salt) const {
    if (sh->skew_ns)
      __nanosleep(mix(sh->seed ^ (static_cast<unsigned long long>(rank) << 56) ^
                      (static_cast<unsigned long long>(cta) << 40) ^ (static_cast<unsigned long long>(k) << 8) ^ salt) %
                  sh->skew_ns);
  }

  __device__ void sync() {
    __syncthreads();
    if (threadIdx.x == 0) {
      skew(1);  // late arrival
      ++epoch;
      ++k;
      __threadfence();
      cuda::atomic_ref<unsigned int, cuda::thread_scope_device> mine(sh->slots[cta * world + rank]);
      mine.store(epoch, cuda::memory_order_release);
      for (int q = 0; q < world; ++q) {
        cuda::atomic_ref<unsigned int, cuda::thread_scope_device> peer(sh->slots[cta * world + q]);
        while (peer.load(cuda::memory_order_acquire) < epoch) {
        }
      }
      skew(2);  // late departure: this CTA's next phase lags while other CTA indices run ahead
    }
    __syncthreads();
  }

  __device__ void end_call(int n, int max_ctas) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      cuda::atomic_ref<unsigned int, cuda::thread_scope_device> done(sh->call_done[rank]);
      done.fetch_add(1, cuda::memory_order_release);
      const unsigned int target = static_cast<unsigned int>((n + 1) * max_ctas);
      while (done.load(cuda::memory_order_acquire) < target) {
      }
    }
    __syncthreads();
  }

  __device__ void check_store(int peer, int64_t g, int c, int64_t chunk) {
    epoch_store(sh->shadow[peer], g, sh->report, rank, peer, c, chunk, call);
  }
  __device__ void check_load(int src, int64_t g, int c, int64_t chunk) {
    epoch_load(sh->shadow[rank], g, sh->report, rank, src, c, chunk, call);
  }
};

template <bool Check>
__global__ void __launch_bounds__(kSimThreads, kSimMinBlocksPerSm)
    sim_kernel(const SimLaunch* __restrict__ launch, SimShared sh) {
  const int max_ctas = launch->max_ctas;
  SimEnv<Check> env{&sh, static_cast<int>(blockIdx.x) / max_ctas, launch->world,
                    static_cast<int>(blockIdx.x) % max_ctas};
  for (int n = 0; n < launch->ncalls; ++n) {
    const SimCall& call = launch->calls[n];
    env.call = static_cast<uint32_t>(n);
    if (env.cta < call.ctas) {
      const Problem& p = call.rank[env.rank];
      switch (call.vec[env.rank]) {
        case 16: run_call<uint4>(p, env, env.cta, call.ctas); break;
        case 8: run_call<uint2>(p, env, env.cta, call.ctas); break;
        case 4: run_call<uint32_t>(p, env, env.cta, call.ctas); break;
        default: run_call<uint16_t>(p, env, env.cta, call.ctas); break;
      }
    }
    env.end_call(n, max_ctas);
  }
}

}  // namespace
}  // namespace fvk

using namespace fvk;

extern "C" int fvk_sim_a2a(int world, int ncalls, const fvk_sim_call* calls, void* const* windows, size_t window_bytes,
                           unsigned flags, unsigned skew_ns, uint64_t seed, uint64_t* report, void* stream) {
  if (!calls || !windows || !report) return set_error(FVK_ERR_INVALID, "null calls, windows or report");
  if (ncalls < 1 || ncalls > kMaxSimCalls)
    return set_error(FVK_ERR_INVALID, "ncalls=%d outside 1..%d", ncalls, kMaxSimCalls);
  if (world < 1 || world > kMaxWorld)
    return set_error(FVK_ERR_INVALID, "world size %d outside 1..%d", world, kMaxWorld);
  if (flags & ~(FVK_SIM_SKEW | FVK_SIM_EPOCH_CHECK | FVK_SIM_MOVING_LAYOUT))
    return set_error(FVK_ERR_INVALID, "unknown sim flags 0x%x", flags);
  const bool check = flags & FVK_SIM_EPOCH_CHECK;
  const int layout = (flags & FVK_SIM_MOVING_LAYOUT) ? kMoving : kStatic;
  SimLaunch host{};
  host.ncalls = ncalls;
  host.world = world;
  int64_t min_granule = 16;
  for (int n = 0; n < ncalls; ++n) {
    const fvk_call& c = calls[n].call;
    Problem base;
    // Every CTA of the simulated launch waits only on CTAs of the same launch: kMaxCtas is the LSA
    // barrier's slot count, the same limit as the fused kernel.
    FVK_TRY(make_problem(world, c, kMaxCtas, window_bytes, base, layout));
    host.calls[n].ctas = c.ctas;
    host.max_ctas = c.ctas > host.max_ctas ? c.ctas : host.max_ctas;
    min_granule = base.granule < min_granule ? base.granule : min_granule;
    for (int r = 0; r < world; ++r) {
      if ((!calls[n].x[r] && input_bytes(base, r)) || (!calls[n].out[r] && output_bytes(base, r)) || !windows[r])
        return set_error(FVK_ERR_INVALID, "call %d: null buffer for simulated rank %d", n, r);
      Problem& p = host.calls[n].rank[r];
      p = base;
      p.x = static_cast<const char*>(calls[n].x[r]);
      p.out = static_cast<char*>(calls[n].out[r]);
      p.rank = r;
      // Each simulated rank picks its own vector width from the pointers it touches, as a real
      // rank would; the CTA partition (granule) is the same for all of them.
      host.calls[n].vec[r] = vector_bytes(p, reinterpret_cast<const void* const*>(windows), world);
    }
  }
  int device = 0, sms = 0, per_sm = 0;
  FVK_CUDA(cudaGetDevice(&device));
  FVK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (check)
    FVK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sim_kernel<true>, kSimThreads, 0));
  else
    FVK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sim_kernel<false>, kSimThreads, 0));
  const int blocks = world * host.max_ctas;
  if (blocks > per_sm * sms)
    return set_error(FVK_ERR_NOT_CORESIDENT, "%d simulated ranks x %d CTAs = %d CTAs exceed the %d this device holds",
                     world, host.max_ctas, blocks, per_sm * sms);
  // Device scratch: the launch description, barrier slots and call counters, report, stamp arrays;
  // each piece 256-byte aligned, offsets computed before the one allocation.
  const size_t shadow_entries = window_bytes / static_cast<size_t>(min_granule) + 1;
  auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t slots_bytes = sizeof(unsigned int) * (static_cast<size_t>(host.max_ctas) * world + world);
  const size_t off_slots = aligned(sizeof(SimLaunch));
  const size_t off_report = off_slots + aligned(slots_bytes);
  const size_t off_shadow = off_report + aligned(8 * sizeof(unsigned long long));
  const size_t per_shadow = aligned(shadow_entries * sizeof(unsigned long long));
  const size_t scratch_bytes = off_shadow + (check ? per_shadow * world : 0);
  auto s = static_cast<cudaStream_t>(stream);
  char* scratch = nullptr;
  FVK_CUDA(cudaMalloc(&scratch, scratch_bytes));
  SimShared sh{};
  auto* dev_launch = reinterpret_cast<SimLaunch*>(scratch);
  sh.slots = reinterpret_cast<unsigned int*>(scratch + off_slots);
  sh.call_done = sh.slots + static_cast<size_t>(host.max_ctas) * world;
  sh.report = reinterpret_cast<unsigned long long*>(scratch + off_report);
  for (int r = 0; r < world; ++r) {
    sh.window[r] = static_cast<char*>(windows[r]);
    sh.shadow[r] = check ? reinterpret_cast<unsigned long long*>(scratch + off_shadow + per_shadow * r) : nullptr;
  }
  sh.seed = seed;
  sh.skew_ns = (flags & FVK_SIM_SKEW) ? (skew_ns ? skew_ns : 20000u) : 0u;
  int rc = FVK_OK;
  cudaError_t e = cudaMemsetAsync(scratch, 0, scratch_bytes, s);
  if (e == cudaSuccess) e = cudaMemcpyAsync(dev_launch, &host, sizeof(host), cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) {
    if (check)
      sim_kernel<true><<<blocks, kSimThreads, 0, s>>>(dev_launch, sh);
    else
      sim_kernel<false><<<blocks, kSimThreads, 0, s>>>(dev_launch, sh);
    e = cudaGetLastError();
  }
  unsigned long long found[5] = {};
  if (e == cudaSuccess) e = cudaMemcpyAsync(found, sh.report, sizeof(found), cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) rc = cuda_error(e, "simulated launch");
  for (int i = 0; i < 5; ++i) report[i] = found[i];
  cudaFree(scratch);
  return rc;
}
