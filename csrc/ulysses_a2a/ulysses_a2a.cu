// Ulysses fused all-to-all on NCCL's device API: kernels and the C ABI (ulysses_a2a.h).
//
// Push design (movement.cuh, run_call). For each chunk c, CTA i of every rank
//   1. waits at LSA barrier i: CTA i of every rank has finished copying chunk c-1 (or the previous
//      call) out of region i of its window;
//   2. stores its slice of its block for each peer into region i of that peer's window through LSA
//      pointers, the sequence/head relayout folded into the addressing, and its own block straight
//      into its output;
//   3. waits at LSA barrier i again: CTA i of every rank has stored into region i of this window;
//   4. copies region i of its window into its output.
//
// Why per-CTA barriers suffice (no grid-wide synchronisation). A barrier on slot i orders only the
// CTAs i of all ranks; CTA j != i of a peer may be any number of chunks ahead or behind. So two
// accesses to the same window byte are ordered only if they come from the same CTA index. The
// argument therefore needs THE WINDOW INVARIANT (layout.h): within a call, each window byte belongs
// to one CTA index in every chunk, i.e. region i depends on (src, i) and the plan, never on the
// current chunk. Then every conflicting pair is {store into region i, copy-out of region i} by
// CTAs i, separated by barrier i (store of chunk c after barrier 2c, which every rank's CTA i
// reaches only after its copy-out of chunk c-1; copy-out of chunk c after barrier 2c+1, reached
// only after every rank's CTA i stored chunk c), and stores of one chunk by different senders go
// to different src blocks. Consecutive calls are ordered on each rank by its stream (the launcher
// adds an event wait when the caller's stream changes): a CTA of call n+1 stores only after its
// first barrier, which needs the same CTA index of every rank to have STARTED call n+1, i.e. every
// rank to have finished call n entirely, whatever either call's CTA count or chunking.
// Preconditions the argument needs: (a) every rank issues the same sequence of launches on this
// context (the vote guarantees it; a launch that fails on one rank after its checks poisons the
// context, so that rank never launches again and its peers' watchdog ends them); (b) a rank's
// launches run in issue order (one stream, or launch_local's event wait when the stream changes; with
// captured graphs, the completion event's external wait and record nodes: fvk_a2a_captured);
// (c) no programmatic dependent launch.
// sync_model.cpp checks this argument as a happens-before property over the plan space, on the
// functions the kernel runs (layout.h); its negative controls are the pre-fix layout (regions that
// moved with the chunk size: wrong on 2x H200 at 8912e8a) and a loop without the entry barrier.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <cuda/atomic>
#include <new>
#include <string>
#include <vector>

#include "ce_plan.h"
#include "movement.cuh"
#include "ulysses_a2a.h"

namespace fvk {

int vote_world(void* handle);  // shm_vote.cpp: an open vote handle's world size, or -1

thread_local char g_error[1024];

// Not in the anonymous namespace: shm_vote.cpp reports through it too (hidden, not exported).
int set_error(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, args);
  va_end(args);
  return code;
}

int itemsize_of(int dtype) {
  switch (dtype) {
    case 1: return 4;  // float32
    case 2: return 2;  // float16
    case 3: return 2;  // bfloat16
    default: return 0;
  }
}

bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const char *pa = static_cast<const char*>(a), *pb = static_cast<const char*>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

// Checks a call's geometry and plan and fills the rank-independent part of `p`.
int make_problem(int world, int mode, int dtype, int64_t B, int64_t S, int64_t H, int64_t D, int ctas, int max_ctas,
                 int64_t planes_per_chunk, int64_t rows_per_chunk, size_t window_bytes, Problem& p,
                 int64_t& operand_bytes, int layout) {
  const int itemsize = itemsize_of(dtype);
  if (itemsize == 0) return set_error(FVK_ERR_INVALID, "dtype code %d is not 1 (f32), 2 (f16) or 3 (bf16)", dtype);
  if (world < 1 || world > kMaxWorld)
    return set_error(FVK_ERR_INVALID, "world size %d outside 1..%d", world, kMaxWorld);
  if (mode != 0 && mode != 1) return set_error(FVK_ERR_INVALID, "mode %d is not 0 or 1", mode);
  if (B < 1 || S < 1 || H < 1 || D < 1 || H % world)
    return set_error(FVK_ERR_INVALID, "geometry B=%lld S=%lld H=%lld D=%lld invalid for world size %d", (long long)B,
                     (long long)S, (long long)H, (long long)D, world);
  if (ctas < 1 || ctas > max_ctas) return set_error(FVK_ERR_INVALID, "ctas=%d outside 1..%d", ctas, max_ctas);
  if (planes_per_chunk < 1 || rows_per_chunk < 1)
    return set_error(FVK_ERR_INVALID, "planes_per_chunk=%lld rows_per_chunk=%lld must be >= 1",
                     (long long)planes_per_chunk, (long long)rows_per_chunk);
  // Every product below in int64 without overflow (a wrapped product could pass the window check).
  int64_t elements = 0, chunk_check = 0;
  const int64_t planes = planes_per_chunk < B ? planes_per_chunk : B, rows = rows_per_chunk < S ? rows_per_chunk : S;
  if (__builtin_mul_overflow(B, S, &elements) || __builtin_mul_overflow(elements, H, &elements) ||
      __builtin_mul_overflow(elements, D, &elements) || __builtin_mul_overflow(elements, itemsize, &operand_bytes) ||
      __builtin_mul_overflow(planes, rows, &chunk_check) || __builtin_mul_overflow(chunk_check, H, &chunk_check) ||
      __builtin_mul_overflow(chunk_check, D * itemsize, &chunk_check))
    return set_error(FVK_ERR_INVALID, "geometry B=%lld S=%lld H=%lld D=%lld overflows 64-bit byte counts", (long long)B,
                     (long long)S, (long long)H, (long long)D);
  p = plan_problem(world, mode, itemsize, B, S, H, D, planes_per_chunk, rows_per_chunk, layout);
  const int64_t chunk_bytes = window_need(p);
  if (static_cast<uint64_t>(chunk_bytes) > window_bytes)
    return set_error(FVK_ERR_INVALID, "a chunk needs %lld window bytes, the window has %zu", (long long)chunk_bytes,
                     window_bytes);
  // copy_units counts the units of one block in 32 bits (with headroom for its loop stride, so
  // below 2^31); the smallest unit is 2 bytes.
  if (chunk_bytes / world / 2 > static_cast<int64_t>(INT32_MAX))
    return set_error(FVK_ERR_INVALID, "a chunk of %lld bytes per peer exceeds the kernel's 32-bit unit index",
                     (long long)(chunk_bytes / world));
  return FVK_OK;
}

namespace {

constexpr int kOriginalCtas = 36;

#define FVK_CUDA(call)                                                                               \
  do {                                                                                               \
    cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess)                                                                           \
      return set_error(FVK_ERR_CUDA, "%s failed: CUDA error %d %s: %s", #call, static_cast<int>(e_), \
                       cudaGetErrorName(e_), cudaGetErrorString(e_));                                \
  } while (0)

#define FVK_NCCL(call)                                                                               \
  do {                                                                                               \
    ncclResult_t r_ = (call);                                                                        \
    if (r_ != ncclSuccess)                                                                           \
      return set_error(FVK_ERR_NCCL, "%s failed: NCCL error %d %s: %s", #call, static_cast<int>(r_), \
                       ncclGetErrorString(r_), ncclGetLastError(nullptr));                           \
  } while (0)

#define FVK_TRY(call)            \
  do {                           \
    int s_ = (call);             \
    if (s_ != FVK_OK) return s_; \
  } while (0)

// Makes `device` current for the scope of one API call and restores the caller's device after.
class DeviceGuard {
 public:
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  int set(int device) {
    FVK_CUDA(cudaGetDevice(&prev_));
    FVK_CUDA(cudaSetDevice(device));
    return FVK_OK;
  }

 private:
  int prev_ = -1;
};

// ---------------------------------------------------------------------------------- epoch checker

// Debug stamps, one uint64 per window granule: state | cta << 2 | src << 12 | chunk << 16 | call << 48.
// A store asserts the granule is empty, or was consumed by the same CTA index (or in an earlier
// call); a copy-out asserts it was written in this chunk by this CTA index from that source. A
// violation is reported whichever access comes first, so a layout that hands a byte to two CTA
// indices is caught on every schedule, not only on the schedules that corrupt data.
constexpr unsigned long long kWritten = 1, kConsumed = 2;

__device__ inline unsigned long long stamp(unsigned long long state, int cta, int src, int64_t chunk, uint32_t call) {
  return state | static_cast<unsigned long long>(cta & 1023) << 2 | static_cast<unsigned long long>(src & 15) << 12 |
         (static_cast<unsigned long long>(chunk) & 0xffffffffull) << 16 |
         static_cast<unsigned long long>(call & 0xffff) << 48;
}

// report[0] counts violations; report[1..4] describe the first: kind | rank << 8 | peer << 16, granule,
// the stamp found, the stamp written.
__device__ inline void report_violation(unsigned long long* report, int kind, int rank, int peer, int64_t granule,
                                        unsigned long long found, unsigned long long mine) {
  if (atomicAdd(report, 1ull) == 0) {
    report[1] = static_cast<unsigned long long>(kind | rank << 8 | peer << 16);
    report[2] = static_cast<unsigned long long>(granule);
    report[3] = found;
    report[4] = mine;
  }
}

__device__ inline void epoch_store(unsigned long long* shadow, int64_t granule, unsigned long long* report, int rank,
                                   int peer, int cta, int64_t chunk, uint32_t call) {
  const unsigned long long mine = stamp(kWritten, cta, rank, chunk, call);
  // System scope: peers stamp the same word through LSA pointers over NVLink.
  const unsigned long long old = atomicExch_system(shadow + granule, mine);
  const bool consumed = (old & 3) == kConsumed;
  const bool ok = old == 0 || old == mine ||
                  (consumed && (static_cast<int>(old >> 2 & 1023) == cta || (old >> 48) != (call & 0xffff)));
  if (!ok) report_violation(report, 1, rank, peer, granule, old, mine);
}

__device__ inline void epoch_load(unsigned long long* shadow, int64_t granule, unsigned long long* report, int rank,
                                  int src, int cta, int64_t chunk, uint32_t call) {
  const unsigned long long mine = stamp(kConsumed, cta, src, chunk, call);
  const unsigned long long old = atomicExch_system(shadow + granule, mine);
  if (old != stamp(kWritten, cta, src, chunk, call) && old != mine)
    report_violation(report, 2, rank, src, granule, old, mine);
}

// ---------------------------------------------------------------------------------- the real fused kernel

// Where fvk_a2a_debug's stamps live in every rank's window: past the plan's bytes, 8 per granule.
struct StampArea {
  int64_t offset, bytes;
};
inline StampArea stamp_area(const Problem& p) {
  return StampArea{(window_need(p) + 255) / 256 * 256, window_need(p) / p.granule * 8};
}

struct DebugArgs {             // fvk_a2a_debug only
  int64_t shadow_offset;       // window offset of the stamp array (same on every rank)
  unsigned long long* report;  // this rank's device report (see report_violation)
  uint32_t call;
};

template <bool Check>
struct LsaEnv {
  static constexpr bool kCheck = Check;
  static constexpr bool kAnyLayout = Check;  // the debug kernel may run the pre-fix layout
  ncclLsaBarrierSession<ncclCoopCta>* barrier;
  ncclCoopCta* coop;
  ncclWindow_t win;
  DebugArgs dbg;
  int rank;
  __device__ char* window(int peer) const { return static_cast<char*>(ncclGetLsaPointer(win, 0, peer)); }
  // Acquire/release: orders peers' copy-out reads before our stores (WAR across chunks and calls),
  // and our stores before their reads.
  __device__ void sync() { barrier->sync(*coop, cuda::memory_order_acq_rel); }
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

template <typename V, bool Check>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    fused_a2a_kernel(Problem p, ncclWindow_t window, ncclDevComm dev_comm, DebugArgs dbg) {
  ncclCoopCta coop;
  ncclLsaBarrierSession<ncclCoopCta> barrier{coop, dev_comm, ncclTeamLsa(dev_comm), dev_comm.lsaBarrier, blockIdx.x};
  LsaEnv<Check> env{&barrier, &coop, window, dbg, p.rank};
  run_call<V>(p, env, blockIdx.x, gridDim.x);
}

// ---------------------------------------------------------------------------------- the copy-engine plan kind

// ce_plan.h has the schedule; these are its device pieces. The transfer itself is cudaMemcpy2DAsync.

// A barrier of the copy-engine schedule: one CTA on LSA barrier slot kCeBarrierSlot. Stream order
// makes this rank's earlier copies (engine or kernel) complete before it arrives; the system-scope
// fence and the barrier's release/acquire order them before every peer's later work.
__global__ void ce_barrier_kernel(ncclDevComm dev_comm) {
  ncclCoopCta coop;
  ncclLsaBarrierSession<ncclCoopCta> barrier{coop, dev_comm, ncclTeamLsa(dev_comm), dev_comm.lsaBarrier,
                                             kCeBarrierSlot};
  __threadfence_system();
  barrier.sync(coop, cuda::memory_order_acq_rel);
}

// This CTA's share (of gridDim.x) of one block of chunk c: units [u0, u1).
template <typename V>
__device__ inline void grid_share(const Problem& p, const Chunk& c, uint32_t& u0, uint32_t& u1) {
  const Span mine = split(block_bytes(p, c) / static_cast<int64_t>(sizeof(V)), gridDim.x, blockIdx.x);
  u0 = static_cast<uint32_t>(mine.start);
  u1 = static_cast<uint32_t>(mine.start + mine.size);
}

// Chunk `ci` of the own block, input -> output (it never crosses the fabric).
template <typename V>
__global__ void __launch_bounds__(kThreads) ce_local_kernel(Problem p, int64_t ci) {
  const Chunk c = chunk_at(p, ci);
  const bool in_head_split = p.mode == 0;
  uint32_t u0, u1;
  grid_share<V>(p, c, u0, u1);
  copy_units<V>(tensor_rows<V>(p, c, const_cast<char*>(p.x), p.rank, in_head_split),
                tensor_rows<V>(p, c, p.out, p.rank, !in_head_split), u0, u1, NoHook{});
}

// Chunk `ci`: every peer's block from buffer ci % 2 of this rank's window into the output.
template <typename V>
__global__ void __launch_bounds__(kThreads) ce_copy_out_kernel(Problem p, int64_t ci, const char* window) {
  const Chunk c = chunk_at(p, ci);
  uint32_t u0, u1;
  grid_share<V>(p, c, u0, u1);
  for (int src = 0; src < p.world; ++src) {
    if (src == p.rank) continue;
    const WindowRun<V> from{const_cast<char*>(window) + ce_block_offset(p, static_cast<int>(ci % 2), src), 0};
    copy_units<V>(from, tensor_rows<V>(p, c, p.out, src, p.mode == 1), u0, u1, NoHook{});
  }
}

// The fabric reference's SM engine: a flat copy of `units` 16-byte units from `src` into every peer's dst.
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

// Every peer's window base as this rank maps it (LSA pointers exist only on the device in 2.28).
__global__ void resolve_peers_kernel(ncclWindow_t window, int world, void** out) {
  for (int q = 0; q < world; ++q) out[q] = ncclGetLsaPointer(window, 0, q);
}

// ---------------------------------------------------------------------------------- simulated ranks on one GPU

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

__host__ __device__ inline unsigned int mix(unsigned long long x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<unsigned int>(x);
}

// The same-device barrier with the LSA barrier's per-CTA semantics: slot i synchronises CTA i of
// every simulated rank and nothing else; epochs persist across chunks and calls as the LSA
// barrier's do. A rank's call boundary (stream order: its next kernel starts when this one has
// ended) is a rank-local arrival count over all of that rank's CTAs.
template <bool Check>
struct SimEnv {
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
      const Problem p = call.rank[env.rank];
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

// ---------------------------------------------------------------------------------- host helpers

// The widest vector (<= the partition granule) every pointer this rank moves data through allows.
int vector_bytes(const Problem& p, const void* const* extra, int n_extra) {
  uint64_t bits =
      reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.out) | static_cast<uint64_t>(p.granule);
  for (int i = 0; i < n_extra; ++i) bits |= reinterpret_cast<uintptr_t>(extra[i]);
  return static_cast<int>(pow2_divisor(bits));
}

template <typename V>
int occupancy(int device, int& blocks) {
  int sms = 0, per_sm = 0;
  FVK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  FVK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fused_a2a_kernel<V, false>, kThreads, 0));
  blocks = per_sm * sms;
  return FVK_OK;
}

// CTAs of the fused kernel that can be resident at once on `device`, over every vector width.
int coresident_ctas(int device, int& ctas) {
  int b16 = 0, b8 = 0, b4 = 0, b2 = 0;
  FVK_TRY(occupancy<uint4>(device, b16));
  FVK_TRY(occupancy<uint2>(device, b8));
  FVK_TRY(occupancy<uint32_t>(device, b4));
  FVK_TRY(occupancy<uint16_t>(device, b2));
  ctas = b16;
  for (int b : {b8, b4, b2}) ctas = b < ctas ? b : ctas;
  return FVK_OK;
}

}  // namespace
}  // namespace fvk

using namespace fvk;

struct fvk_ctx {
  int device = -1;
  int rank = -1, nranks = 0;
  ncclComm_t comm = nullptr;
  void* buffer = nullptr;
  size_t bytes = 0;
  ncclWindow_t window = nullptr;
  ncclDevComm dev_comm{};
  bool has_dev_comm = false;
  int coresident = 0;  // co-resident CTAs of the fused kernel on this device
  // A launch that failed after its checks began: peers may wait at its barriers forever, and a later
  // launch would pair with their call. Every later launch is refused (rebuild the context).
  const char* poisoned = nullptr;
  cudaEvent_t done = nullptr;          // recorded after every launch, on its stream
  cudaStream_t last_stream = nullptr;  // the stream of the previous launch
  // The copy-engine plan kind (ce_plan.h): every peer's window as this rank maps it (LSA pointers,
  // resolved once by fvk_devcomm_create), the copy stream and the schedule's events.
  char* peers[kMaxWorld] = {};
  cudaStream_t copy_stream = nullptr;
  cudaEvent_t ce_events[kCeEvents] = {};
  // CUDA-graph capture (fvk_a2a_captured): `captured` once any launch was captured (eager launches then
  // always wait on `done`, which replays record); the capture id of the last captured launch, and an
  // event recorded inside that capture after it (orders the next launch of the same capture).
  bool captured = false;
  unsigned long long capture_id = 0;
  cudaEvent_t capture_done = nullptr;
};

namespace {

// launch_fused flag of fvk_a2a_captured (internal; not an FVK_DEBUG_* flag, refused by fvk_a2a_debug).
constexpr unsigned kCaptureLaunch = 1u << 31;

template <bool Check>
void launch_kernel(int vec, int ctas, cudaStream_t s, const Problem& p, const fvk_ctx* ctx, const DebugArgs& dbg) {
  switch (vec) {
    case 16: fused_a2a_kernel<uint4, Check><<<ctas, kThreads, 0, s>>>(p, ctx->window, ctx->dev_comm, dbg); break;
    case 8: fused_a2a_kernel<uint2, Check><<<ctas, kThreads, 0, s>>>(p, ctx->window, ctx->dev_comm, dbg); break;
    case 4: fused_a2a_kernel<uint32_t, Check><<<ctas, kThreads, 0, s>>>(p, ctx->window, ctx->dev_comm, dbg); break;
    default: fused_a2a_kernel<uint16_t, Check><<<ctas, kThreads, 0, s>>>(p, ctx->window, ctx->dev_comm, dbg); break;
  }
}

// Checks and enqueues one fused call: the tuned and original entry points (flags 0, no report) and
// the debug one (epoch checker stamps in the window past the plan's bytes, optional legacy layout).
// The part of a launch that can fail on one rank alone (local pointers, the device, CUDA errors):
// its peers, which passed the same vote, may already be waiting at its barriers.
// The context checks every launch of either kind makes first: they fail alike on every rank (the
// context is shared state all ranks built together), so they leave the context usable.
int check_context(const fvk_ctx* ctx, bool copy_engine) {
  if (!ctx || !ctx->has_dev_comm || (copy_engine && !ctx->copy_stream))
    return set_error(FVK_ERR_STATE, "execute needs a constructed context");
  if (ctx->poisoned)
    return set_error(FVK_ERR_STATE,
                     "this context refuses launches after %s: peers may still wait at that call's barriers; "
                     "destroy it and build a new one",
                     ctx->poisoned);
  // LSA rank r must be communicator rank r: peers' windows are addressed by SP rank.
  if (ctx->dev_comm.lsaSize != ctx->nranks || ctx->dev_comm.lsaRank != ctx->rank)
    return set_error(FVK_ERR_STATE, "LSA team (size %d, rank %d) does not cover the communicator (%d ranks, rank %d)",
                     ctx->dev_comm.lsaSize, ctx->dev_comm.lsaRank, ctx->nranks, ctx->rank);
  return FVK_OK;
}

// This rank's operands into `p`, and the widest vector every pointer allows. It fails on one rank alone
// (local pointers), after every rank agreed to run the call: the callers poison the context then.
int bind_operands(const fvk_ctx* ctx, Problem& p, int64_t operand_bytes, const void* x, void* out, int& vec) {
  if (!x || !out) return set_error(FVK_ERR_INVALID, "null input or output");
  if (overlaps(out, operand_bytes, ctx->buffer, ctx->bytes) || overlaps(x, operand_bytes, ctx->buffer, ctx->bytes))
    return set_error(FVK_ERR_INVALID, "input or output aliases the communication window");
  if (overlaps(out, operand_bytes, x, operand_bytes)) return set_error(FVK_ERR_INVALID, "output aliases the input");
  p.x = static_cast<const char*>(x);
  p.out = static_cast<char*>(out);
  p.rank = ctx->rank;
  const void* window = ctx->buffer;
  vec = vector_bytes(p, &window, 1);
  if (vec < p.itemsize) return set_error(FVK_ERR_INVALID, "input or output is not aligned to its element size");
  return FVK_OK;
}

// The eager entry points of the copy-engine kind and the fabric copy refuse a capturing stream: the
// copy-engine kind is captured through fvk_a2a_ce_captured (ordering through external event nodes), the
// fabric copy (a benchmark) never. Every rank agrees on capturing (the vote's WINDOW_BYTES carries it),
// so this fails alike everywhere.
int refuse_capture(void* stream, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FVK_CUDA(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  if (status != cudaStreamCaptureStatusNone)
    return set_error(FVK_ERR_STATE, "%s cannot be captured into a CUDA graph (the stream is capturing)", what);
  return FVK_OK;
}

// The captured entry points need a capturing stream: checked before anything is enqueued, so that a
// misuse (agreed on every rank: the vote carries the capture bit) leaves the context usable.
int require_capture(void* stream, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FVK_CUDA(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  if (status != cudaStreamCaptureStatusActive)
    return set_error(FVK_ERR_STATE, "%s needs a stream that is capturing a CUDA graph (status %d)", what,
                     static_cast<int>(status));
  return FVK_OK;
}

// The context's copy stream joins a capture at a copy-engine call's fork and stays in it until that
// capture ends. A call made while it is still inside an open capture (an eager call from another
// thread, or a call captured into another graph) would add its copy-stream ops to that capture: refuse
// it before anything is enqueued. (One call at a time per helper is the rule; this keeps a break of it
// from corrupting a graph.)
int check_copy_stream(const fvk_ctx* ctx, cudaStream_t s, bool capture) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  FVK_CUDA(cudaStreamGetCaptureInfo(ctx->copy_stream, &status, &id));
  if (status == cudaStreamCaptureStatusNone) return FVK_OK;
  if (capture && status == cudaStreamCaptureStatusActive) {
    cudaStreamCaptureStatus mine = cudaStreamCaptureStatusNone;
    unsigned long long mine_id = 0;
    FVK_CUDA(cudaStreamGetCaptureInfo(s, &mine, &mine_id));
    if (mine == cudaStreamCaptureStatusActive && mine_id == id) return FVK_OK;  // this same capture
  }
  return set_error(FVK_ERR_STATE,
                   "the context's copy stream is still inside an open CUDA-graph capture (id %llu, status %d): end "
                   "that capture before another copy-engine call",
                   id, static_cast<int>(status));
}

// Orders a call after the previous fused work on this context (the cross-call half of every barrier
// argument needs each rank's calls in order: they share one window and one set of barrier slots).
// Eager: a call on another stream than the previous one waits for it; once a launch was captured, every
// eager call waits (a replay, on any stream, records `done` too). Inside a CUDA-graph capture, only
// graph-legal ordering (an event recorded outside the capture cannot be waited on plainly): each replay
// waits, through an external event-wait node, for the last fused work recorded in `done` before the replay
// was launched (an eager call or another replay), and after the previous captured launch of this same
// capture (whatever its stream). `last_stream` is untouched by a capture: a capture runs nothing.
int order_call(const fvk_ctx* ctx, cudaStream_t s, bool capture, unsigned long long& capture_id) {
  capture_id = 0;
  if (capture) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    FVK_CUDA(cudaStreamGetCaptureInfo(s, &status, &capture_id));
    if (status != cudaStreamCaptureStatusActive)
      return set_error(FVK_ERR_STATE, "a captured launch needs a stream that is capturing a CUDA graph (status %d)",
                       static_cast<int>(status));
    if (ctx->captured && ctx->capture_id == capture_id) FVK_CUDA(cudaStreamWaitEvent(s, ctx->capture_done, 0));
    FVK_CUDA(cudaStreamWaitEvent(s, ctx->done, cudaEventWaitExternal));
  } else if (ctx->captured || (ctx->last_stream != nullptr && ctx->last_stream != s)) {
    FVK_CUDA(cudaStreamWaitEvent(s, ctx->done, 0));
  }
  return FVK_OK;
}

// Marks the end of a call on `s`, its last stream: `done` for the next call (order_call), recorded by every
// replay when captured (an external event-record node), plus `capture_done` inside the capture.
int finish_call(fvk_ctx* ctx, cudaStream_t s, bool capture, unsigned long long capture_id) {
  if (capture) {
    FVK_CUDA(cudaEventRecord(ctx->capture_done, s));                            // a node of this capture
    FVK_CUDA(cudaEventRecordWithFlags(ctx->done, s, cudaEventRecordExternal));  // recorded by every replay
    ctx->captured = true;
    ctx->capture_id = capture_id;
    return FVK_OK;
  }
  FVK_CUDA(cudaEventRecord(ctx->done, s));
  ctx->last_stream = s;
  return FVK_OK;
}

int launch_local(fvk_ctx* ctx, Problem& p, int64_t operand_bytes, const void* x, void* out, int ctas, unsigned flags,
                 unsigned long long* report, cudaStream_t s) {
  // Spinning CTAs wait for the same CTA index on peers: a CTA that cannot become resident while
  // others spin would deadlock every rank, so refuse such launches instead.
  if (ctas > ctx->coresident)
    return set_error(FVK_ERR_NOT_CORESIDENT, "ctas=%d exceeds the %d CTAs this device can hold at once", ctas,
                     ctx->coresident);
  int vec = 0;
  FVK_TRY(bind_operands(ctx, p, operand_bytes, x, out, vec));
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  const bool capture = flags & kCaptureLaunch;
  unsigned long long capture_id = 0;
  FVK_TRY(order_call(ctx, s, capture, capture_id));
  DebugArgs dbg{};
  const bool check = flags & FVK_DEBUG_EPOCH_CHECK;
  if (check) {
    // Stamps live in every rank's window past the plan's bytes (peers stamp through LSA pointers).
    // Cleared on this rank's stream: peers stamp here only after barrier 0, i.e. after this rank's
    // kernel started, i.e. after the clear; and their stamps of the previous call all happened
    // before this rank's previous kernel ended.
    const StampArea stamps = stamp_area(p);
    dbg.shadow_offset = stamps.offset;
    dbg.report = report;
    dbg.call = 0;  // the stamps are cleared every call: no call id (a per-rank counter could diverge)
    FVK_CUDA(cudaMemsetAsync(static_cast<char*>(ctx->buffer) + stamps.offset, 0, stamps.bytes, s));
  }
  if (check)
    launch_kernel<true>(vec, ctas, s, p, ctx, dbg);
  else
    launch_kernel<false>(vec, ctas, s, p, ctx, dbg);
  FVK_CUDA(cudaGetLastError());
  return finish_call(ctx, s, capture, capture_id);
}

// Checks and enqueues one fused call: the tuned and original entry points (flags 0, no report) and
// the debug one (epoch checker stamps in the window past the plan's bytes, optional legacy layout).
// Checks of agreed values (geometry, plan, window) fail identically on every rank and leave the
// context usable; a failure after them poisons it (launch_local).
int launch_fused(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                 int64_t D, int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk, unsigned flags,
                 unsigned long long* report, void* stream) {
  FVK_TRY(check_context(ctx, false));
  if (flags & ~(FVK_DEBUG_EPOCH_CHECK | FVK_DEBUG_LEGACY_LAYOUT | kCaptureLaunch))
    return set_error(FVK_ERR_INVALID, "unknown debug flags 0x%x", flags);
  if (flags & kCaptureLaunch) FVK_TRY(require_capture(stream, "fvk_a2a_captured"));
  Problem p;
  int64_t operand_bytes = 0;
  FVK_TRY(make_problem(ctx->nranks, mode, dtype, B, S, H, D, ctas, kMaxCtas, planes_per_chunk, rows_per_chunk,
                       ctx->bytes, p, operand_bytes, (flags & FVK_DEBUG_LEGACY_LAYOUT) ? kLegacy : kStatic));
  if (flags & FVK_DEBUG_EPOCH_CHECK) {
    const StampArea stamps = stamp_area(p);
    const int64_t need = stamps.offset + stamps.bytes;
    if (need > static_cast<int64_t>(ctx->bytes))
      return set_error(FVK_ERR_INVALID,
                       "the epoch checker needs %lld window bytes (the plan's %lld + stamps), the "
                       "window has %zu",
                       (long long)need, (long long)window_need(p), ctx->bytes);
  }
  const int rc = launch_local(ctx, p, operand_bytes, x, out, ctas, flags, report, static_cast<cudaStream_t>(stream));
  if (rc != FVK_OK) ctx->poisoned = "a fused launch that failed on this rank after every rank agreed to run it";
  return rc;
}

template <typename V>
cudaError_t launch_ce_kernel(int kind, int ctas, cudaStream_t s, const Problem& p, int64_t chunk, const char* window) {
  if (kind == kCeLocal)
    ce_local_kernel<V><<<ctas, kThreads, 0, s>>>(p, chunk);
  else
    ce_copy_out_kernel<V><<<ctas, kThreads, 0, s>>>(p, chunk, window);
  return cudaGetLastError();
}

cudaError_t launch_ce_kernel(int vec, int kind, int ctas, cudaStream_t s, const Problem& p, int64_t chunk,
                             const char* window) {
  switch (vec) {
    case 16: return launch_ce_kernel<uint4>(kind, ctas, s, p, chunk, window);
    case 8: return launch_ce_kernel<uint2>(kind, ctas, s, p, chunk, window);
    case 4: return launch_ce_kernel<uint32_t>(kind, ctas, s, p, chunk, window);
    default: return launch_ce_kernel<uint16_t>(kind, ctas, s, p, chunk, window);
  }
}

// push(c) of the copy-engine schedule: ce_plan.h's copies, through the LSA-mapped peer pointers.
cudaError_t ce_push(const fvk_ctx* ctx, const Problem& p, int64_t ci, cudaStream_t s) {
  cudaError_t e = cudaSuccess;
  ce_push_copies(p, ci, [&](const CeCopy& k) {
    if (e != cudaSuccess) return;
    char* dst = ctx->peers[k.peer] + k.dst_offset;
    const char* src = p.x + k.src_offset;
    e = k.rows == 1 ? cudaMemcpyAsync(dst, src, k.width, cudaMemcpyDefault, s)
                    : cudaMemcpy2DAsync(dst, k.dst_pitch, src, k.src_pitch, k.width, k.rows, cudaMemcpyDefault, s);
  });
  return e;
}

// The part of a copy-engine call that can fail on one rank alone: its operands, then the schedule of
// ce_plan.h, op by op.
// Captured (fvk_a2a_ce_captured): the same ops into the graph `s` is capturing. The fork pulls the copy
// stream into the capture and the join returns it, so the graph holds both streams' ops with the
// schedule's edges; the per-chunk events become edges of the graph (a record inside a capture is no
// event-record node), and the call is ordered against eager calls and other replays by order_call and
// finish_call's external event nodes, as the fused kernel's captured launch is.
int ce_local(fvk_ctx* ctx, Problem& p, int64_t operand_bytes, const void* x, void* out, int ctas, cudaStream_t s,
             bool capture) {
  int vec = 0;
  FVK_TRY(bind_operands(ctx, p, operand_bytes, x, out, vec));
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  unsigned long long capture_id = 0;
  FVK_TRY(order_call(ctx, s, capture, capture_id));
  cudaError_t e = cudaSuccess;
  const char* what = "";
  bool forked = false;  // the copy stream waits for this call: from here on a failure must join it back
  ce_schedule(num_chunks(p), kCeDropNone, [&](const CeOp& op) {
    if (e != cudaSuccess) return;
    const cudaStream_t on = op.stream == kMainStream ? s : ctx->copy_stream;
    switch (op.kind) {
      case kCeRecord:
        what = "cudaEventRecord";
        e = cudaEventRecord(ctx->ce_events[op.event], on);
        break;
      case kCeWait:
        what = "cudaStreamWaitEvent";
        e = cudaStreamWaitEvent(on, ctx->ce_events[op.event], 0);
        if (e == cudaSuccess && op.stream == kCopyStream && op.event == kEvFork) forked = true;
        break;
      case kCeBarrier:
        what = "barrier launch";
        ce_barrier_kernel<<<1, 32, 0, on>>>(ctx->dev_comm);
        e = cudaGetLastError();
        break;
      case kCePush:
        what = "cudaMemcpy2DAsync into a peer's window";
        e = ce_push(ctx, p, op.chunk, on);
        break;
      case kCeLocal:
      case kCeCopyOut:
        what = op.kind == kCeLocal ? "own-block launch" : "copy-out launch";
        e = launch_ce_kernel(vec, op.kind, ctas, on, p, op.chunk, static_cast<const char*>(ctx->buffer));
        break;
    }
  });
  if (e != cudaSuccess) {
    // Best effort: the copy-outs already queued on the copy stream write `out`; join them into the
    // caller's stream so the allocator does not hand `out` to another tensor while they run (and, under
    // capture, so the copy stream does not stay unjoined in the caller's capture).
    // Only once the fork is queued: before it this call put nothing on the copy stream (and, under capture,
    // the copy stream is not in the capture: waiting on an eager record there would break it).
    if (forked && cudaEventRecord(ctx->ce_events[kEvJoin], ctx->copy_stream) == cudaSuccess)
      cudaStreamWaitEvent(s, ctx->ce_events[kEvJoin], 0);
    return set_error(FVK_ERR_CUDA, "copy-engine call: %s failed: CUDA error %d %s: %s", what, static_cast<int>(e),
                     cudaGetErrorName(e), cudaGetErrorString(e));
  }
  return finish_call(ctx, s, capture, capture_id);
}

// Checks and enqueues one call of the copy-engine plan kind. Checks of agreed values (geometry, plan,
// window) fail identically on every rank and leave the context usable; a failure after them poisons it,
// as for the fused kernel.
int launch_ce(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H, int64_t D,
              int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk, void* stream, bool capture) {
  FVK_TRY(check_context(ctx, true));
  if (capture)
    FVK_TRY(require_capture(stream, "fvk_a2a_ce_captured"));
  else
    FVK_TRY(refuse_capture(stream, "fvk_a2a_ce (capture it with fvk_a2a_ce_captured)"));
  FVK_TRY(check_copy_stream(ctx, static_cast<cudaStream_t>(stream), capture));
  Problem p;
  int64_t operand_bytes = 0;
  // Two buffers: each chunk must fit half the window.
  FVK_TRY(make_problem(ctx->nranks, mode, dtype, B, S, H, D, ctas, kMaxCtas, planes_per_chunk, rows_per_chunk,
                       ctx->bytes / 2, p, operand_bytes, kStatic));
  const int rc = ce_local(ctx, p, operand_bytes, x, out, ctas, static_cast<cudaStream_t>(stream), capture);
  if (rc != FVK_OK) ctx->poisoned = "a copy-engine call that failed on this rank after every rank agreed to run it";
  return rc;
}

// The fabric's limit as the benchmark measures it: entry barrier, every rank copies `bytes` from its
// window's start into every peer's window (at (1 + rank) * bytes, so no two writers overlap),
// exit barrier. engine 0: one copy-engine copy per peer; 1: `ctas` CTAs of SM stores.
int fabric_local(fvk_ctx* ctx, int64_t bytes, int engine, int ctas, cudaStream_t s) {
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  unsigned long long capture_id = 0;
  FVK_TRY(order_call(ctx, s, false, capture_id));
  cudaError_t e = cudaSuccess;
  ce_barrier_kernel<<<1, 32, 0, s>>>(ctx->dev_comm);
  e = cudaGetLastError();
  const int64_t offset = (1 + static_cast<int64_t>(ctx->rank)) * bytes;
  if (e == cudaSuccess && engine == 0) {
    for (int j = 1; j < ctx->nranks && e == cudaSuccess; ++j) {
      const int q = (ctx->rank + j) % ctx->nranks;
      e = cudaMemcpyAsync(ctx->peers[q] + offset, ctx->buffer, bytes, cudaMemcpyDefault, s);
    }
  } else if (e == cudaSuccess) {
    PeerPointers dst{};
    for (int q = 0; q < ctx->nranks; ++q) dst.at[q] = reinterpret_cast<uint4*>(ctx->peers[q] + offset);
    flat_push_kernel<<<ctas, kThreads, 0, s>>>(static_cast<const uint4*>(ctx->buffer), bytes / 16, ctx->nranks,
                                               ctx->rank, dst);
    e = cudaGetLastError();
  }
  if (e == cudaSuccess) {
    ce_barrier_kernel<<<1, 32, 0, s>>>(ctx->dev_comm);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess)
    return set_error(FVK_ERR_CUDA, "fabric copy failed: CUDA error %d %s: %s", static_cast<int>(e), cudaGetErrorName(e),
                     cudaGetErrorString(e));
  return finish_call(ctx, s, false, capture_id);
}

int fabric_copy(fvk_ctx* ctx, int64_t bytes, int engine, int ctas, cudaStream_t s) {
  FVK_TRY(check_context(ctx, true));
  FVK_TRY(refuse_capture(s, "fvk_fabric_copy"));
  if (bytes <= 0 || bytes % 16 || static_cast<uint64_t>(bytes) * (ctx->nranks + 1) > ctx->bytes)
    return set_error(FVK_ERR_INVALID,
                     "fabric copy of %lld bytes: need a positive multiple of 16 with (P + 1) x bytes "
                     "<= the window (%zu)",
                     (long long)bytes, ctx->bytes);
  if (engine != 0 && engine != 1)
    return set_error(FVK_ERR_INVALID, "engine %d is not 0 (copy engine) or 1 (SM)", engine);
  if (ctas < 1 || ctas > 1024) return set_error(FVK_ERR_INVALID, "ctas=%d outside 1..1024", ctas);
  // Past the agreed checks: peers may already wait at the first barrier (as for every launch).
  const int rc = fabric_local(ctx, bytes, engine, ctas, s);
  if (rc != FVK_OK) ctx->poisoned = "a fabric copy that failed on this rank after every rank agreed to run it";
  return rc;
}

// The context's CUDA events and copy stream (teardown, after the device is idle).
void release_streams(fvk_ctx* ctx) {
  if (ctx->done) cudaEventDestroy(ctx->done);
  if (ctx->capture_done) cudaEventDestroy(ctx->capture_done);
  for (cudaEvent_t ev : ctx->ce_events)
    if (ev) cudaEventDestroy(ev);
  if (ctx->copy_stream) cudaStreamDestroy(ctx->copy_stream);
}

}  // namespace

extern "C" {

int fvk_abi_version(void) {
  return FVK_ABI_VERSION;
}

int fvk_nccl_build_version(void) {
  return NCCL_VERSION_CODE;
}

int fvk_nccl_runtime_version(int* version) {
  if (!version) return set_error(FVK_ERR_INVALID, "version is null");
  FVK_NCCL(ncclGetVersion(version));
  return FVK_OK;
}

const char* fvk_last_error(void) {
  return g_error;
}

int fvk_max_ctas(void) {
  return kMaxCtas;
}

int fvk_coresident_ctas(int device, int* ctas) {
  if (!ctas) return set_error(FVK_ERR_INVALID, "ctas is null");
  DeviceGuard guard;  // the occupancy calculator answers for the current device
  FVK_TRY(guard.set(device));
  return coresident_ctas(device, *ctas);
}

int fvk_relax_capture_mode(void) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  FVK_CUDA(cudaThreadExchangeStreamCaptureMode(&mode));
  return FVK_OK;
}

int fvk_pci_bus_id(int device, char* buf, int len) {
  if (!buf || len < 13) return set_error(FVK_ERR_INVALID, "buffer too small for a PCI bus id");
  FVK_CUDA(cudaDeviceGetPCIBusId(buf, len, device));
  return FVK_OK;
}

int fvk_nvlink_p2p(const char* bus_id_a, const char* bus_id_b, int* nvlink) {
  // NVML through dlopen (the driver ships libnvidia-ml.so.1; no link-time dependency). Minimal
  // prototypes from nvml.h: nvmlReturn_t is an int, NVML_SUCCESS = 0, NVML_P2P_CAPS_INDEX_NVLINK = 2,
  // NVML_P2P_STATUS_OK = 0.
  if (!bus_id_a || !bus_id_b || !nvlink) return set_error(FVK_ERR_INVALID, "null argument");
  void* nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!nvml) return set_error(FVK_ERR_UNAVAILABLE, "cannot load libnvidia-ml.so.1: %s", dlerror());
  using InitFn = int (*)();
  using HandleFn = int (*)(const char*, void**);
  using P2PFn = int (*)(void*, void*, int, int*);
  auto init = reinterpret_cast<InitFn>(dlsym(nvml, "nvmlInit_v2"));
  auto shutdown = reinterpret_cast<InitFn>(dlsym(nvml, "nvmlShutdown"));
  auto handle = reinterpret_cast<HandleFn>(dlsym(nvml, "nvmlDeviceGetHandleByPciBusId_v2"));
  auto p2p = reinterpret_cast<P2PFn>(dlsym(nvml, "nvmlDeviceGetP2PStatus"));
  int rc = FVK_OK;
  if (!init || !shutdown || !handle || !p2p) {
    rc = set_error(FVK_ERR_UNAVAILABLE, "libnvidia-ml.so.1 lacks the NVML P2P functions");
  } else if (int e = init(); e != 0) {
    rc = set_error(FVK_ERR_UNAVAILABLE, "nvmlInit_v2 failed: NVML error %d", e);
  } else {
    void *a = nullptr, *b = nullptr;
    int status = -1, r = handle(bus_id_a, &a);
    if (r == 0) r = handle(bus_id_b, &b);
    if (r == 0) r = p2p(a, b, /*NVML_P2P_CAPS_INDEX_NVLINK*/ 2, &status);
    if (r != 0)
      rc = set_error(FVK_ERR_UNAVAILABLE, "NVML P2P query %s -> %s failed: NVML error %d", bus_id_a, bus_id_b, r);
    else
      *nvlink = status == 0;
    shutdown();
  }
  dlclose(nvml);
  return rc;
}

int fvk_unique_id_bytes(void) {
  return static_cast<int>(sizeof(ncclUniqueId));
}

int fvk_get_unique_id(void* out, size_t len) {
  if (!out || len != sizeof(ncclUniqueId))
    return set_error(FVK_ERR_INVALID, "unique id buffer must be %zu bytes", sizeof(ncclUniqueId));
  ncclUniqueId id;
  FVK_NCCL(ncclGetUniqueId(&id));
  memcpy(out, &id, sizeof(id));
  return FVK_OK;
}

int fvk_create(int device, fvk_ctx** out) {
  if (!out) return set_error(FVK_ERR_INVALID, "out is null");
  int count = 0;
  FVK_CUDA(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count) return set_error(FVK_ERR_INVALID, "device %d outside 0..%d", device, count - 1);
  fvk_ctx* ctx = new (std::nothrow) fvk_ctx;
  if (!ctx) return set_error(FVK_ERR_INVALID, "out of host memory");
  ctx->device = device;
  *out = ctx;
  return FVK_OK;
}

int fvk_comm_init(fvk_ctx* ctx, const void* unique_id, size_t len, int nranks, int rank) {
  if (!ctx || !unique_id || len != sizeof(ncclUniqueId)) return set_error(FVK_ERR_INVALID, "bad context or unique id");
  if (ctx->comm) return set_error(FVK_ERR_STATE, "communicator already initialised");
  if (nranks < 1 || nranks > kMaxWorld || rank < 0 || rank >= nranks)
    return set_error(FVK_ERR_INVALID, "rank %d of %d outside the supported 1..%d ranks", rank, nranks, kMaxWorld);
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  ncclUniqueId id;
  memcpy(&id, unique_id, sizeof(id));
  FVK_NCCL(ncclCommInitRank(&ctx->comm, nranks, id, rank));
  ctx->nranks = nranks;
  ctx->rank = rank;
  return FVK_OK;
}

int fvk_window_alloc(fvk_ctx* ctx, size_t bytes) {
  if (!ctx || bytes == 0) return set_error(FVK_ERR_INVALID, "bad context or zero window size");
  if (ctx->buffer) return set_error(FVK_ERR_STATE, "window already allocated");
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  FVK_NCCL(ncclMemAlloc(&ctx->buffer, bytes));
  ctx->bytes = bytes;
  return FVK_OK;
}

int fvk_window_register(fvk_ctx* ctx) {
  if (!ctx || !ctx->comm || !ctx->buffer) return set_error(FVK_ERR_STATE, "register needs a communicator and a window");
  if (ctx->window) return set_error(FVK_ERR_STATE, "window already registered");
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  FVK_NCCL(ncclCommWindowRegister(ctx->comm, ctx->buffer, ctx->bytes, &ctx->window, NCCL_WIN_COLL_SYMMETRIC));
  return FVK_OK;
}

int fvk_devcomm_create(fvk_ctx* ctx) {
  if (!ctx || !ctx->window) return set_error(FVK_ERR_STATE, "device communicator needs a registered window");
  if (ctx->has_dev_comm) return set_error(FVK_ERR_STATE, "device communicator already created");
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  FVK_TRY(coresident_ctas(ctx->device, ctx->coresident));
  ncclDevCommRequirements reqs;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 29, 0)
  // 2.29+ stamps size/magic/version into the struct; ncclDevCommCreate rejects it without them.
  reqs = NCCL_DEV_COMM_REQUIREMENTS_INITIALIZER;
#else
  memset(&reqs, 0, sizeof(reqs));  // 2.28 has no initializer: all-zero is its default
#endif
  reqs.lsaBarrierCount = kMaxCtas;
  if (!ctx->done) FVK_CUDA(cudaEventCreateWithFlags(&ctx->done, cudaEventDisableTiming));
  if (!ctx->capture_done) FVK_CUDA(cudaEventCreateWithFlags(&ctx->capture_done, cudaEventDisableTiming));
  FVK_NCCL(ncclDevCommCreate(ctx->comm, &reqs, &ctx->dev_comm));
  ctx->has_dev_comm = true;
  // The copy-engine plan kind: peers' window bases (LSA pointers are device-side only in 2.28),
  // its copy stream and events. Local work, once per context.
  void** resolved = nullptr;
  FVK_CUDA(cudaMalloc(&resolved, sizeof(void*) * kMaxWorld));
  resolve_peers_kernel<<<1, 1>>>(ctx->window, ctx->nranks, resolved);
  cudaError_t e = cudaGetLastError();
  void* host[kMaxWorld] = {};
  if (e == cudaSuccess) e = cudaMemcpy(host, resolved, sizeof(void*) * ctx->nranks, cudaMemcpyDeviceToHost);
  cudaFree(resolved);
  if (e != cudaSuccess)
    return set_error(FVK_ERR_CUDA, "resolving the peers' window pointers failed: CUDA error %d %s: %s",
                     static_cast<int>(e), cudaGetErrorName(e), cudaGetErrorString(e));
  for (int q = 0; q < ctx->nranks; ++q) ctx->peers[q] = static_cast<char*>(host[q]);
  if (!ctx->copy_stream) FVK_CUDA(cudaStreamCreateWithFlags(&ctx->copy_stream, cudaStreamNonBlocking));
  for (cudaEvent_t& ev : ctx->ce_events)
    if (!ev) FVK_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  return FVK_OK;
}

int fvk_lsa_info(fvk_ctx* ctx, int* nranks, int* rank, int* lsa_size, int* lsa_rank) {
  if (!ctx || !ctx->has_dev_comm) return set_error(FVK_ERR_STATE, "LSA info needs a device communicator");
  if (!nranks || !rank || !lsa_size || !lsa_rank) return set_error(FVK_ERR_INVALID, "null argument");
  *nranks = ctx->dev_comm.nRanks;
  *rank = ctx->dev_comm.rank;
  *lsa_size = ctx->dev_comm.lsaSize;
  *lsa_rank = ctx->dev_comm.lsaRank;
  return FVK_OK;
}

int fvk_a2a_tuned(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                  int64_t D, int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk, void* stream) {
  return launch_fused(ctx, x, out, mode, dtype, B, S, H, D, ctas, planes_per_chunk, rows_per_chunk, 0, nullptr, stream);
}

int fvk_a2a_original(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                     int64_t D, void* stream) {
  return fvk_a2a_tuned(ctx, x, out, mode, dtype, B, S, H, D, kOriginalCtas, B, S, stream);
}

int fvk_a2a_ce(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H, int64_t D,
               int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk, void* stream) {
  return launch_ce(ctx, x, out, mode, dtype, B, S, H, D, ctas, planes_per_chunk, rows_per_chunk, stream, false);
}

int fvk_a2a_ce_captured(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                        int64_t D, int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk, void* stream) {
  return launch_ce(ctx, x, out, mode, dtype, B, S, H, D, ctas, planes_per_chunk, rows_per_chunk, stream, true);
}

int fvk_vote_would_run(const int64_t* votes, int world, const int64_t* mine) {
  if (!votes || !mine || world < 1) return 0;
  if (mine[FVK_FIELD_ELIGIBILITY] != 0 || mine[FVK_FIELD_PLAN] == 0) return 0;
  for (int r = 0; r < world; ++r)
    for (int f = 0; f < FVK_VOTE_FIELDS; ++f)
      if (votes[static_cast<int64_t>(r) * FVK_VOTE_FIELDS + f] != mine[f]) return 0;
  return 1;
}

int fvk_voted_launch(void* vote, const int64_t* fields, int64_t* votes, int64_t timeout_ns, int* stage,
                     int64_t* vote_ns, fvk_ctx* ctx, int entry, const void* x, void* out, int mode, int dtype,
                     int64_t B, int64_t S, int64_t H, int64_t D, int ctas, int64_t planes_per_chunk,
                     int64_t rows_per_chunk, void* stream) {
  if (!stage || !vote_ns) return set_error(FVK_ERR_INVALID, "null stage or vote_ns");
  *stage = -1;  // refused before the exchange: this rank has not voted
  *vote_ns = 0;
  if (entry < 0 || entry > 2)
    return set_error(FVK_ERR_INVALID, "entry %d is not 0 (original), 1 (tuned) or 2 (ce)", entry);
  const int world = fvk::vote_world(vote);
  if (world < 1) return set_error(FVK_ERR_STATE, "vote handle %p is not open", vote);
  if (ctx && ctx->nranks != world)
    return set_error(FVK_ERR_INVALID, "the vote has %d ranks, the communicator %d", world, ctx->nranks);
  *stage = 0;
  timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  const int rc = fvk_vote_exchange(vote, fields, votes, timeout_ns);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  *vote_ns = (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
  if (rc != FVK_OK) return rc;
  *stage = 1;
  if (!fvk_vote_would_run(votes, world, fields)) return FVK_OK;
  *stage = 2;
  if (!ctx) return set_error(FVK_ERR_INVALID, "null context (the vote said run)");
  switch (entry) {
    case 0: return fvk_a2a_original(ctx, x, out, mode, dtype, B, S, H, D, stream);
    case 1: return fvk_a2a_tuned(ctx, x, out, mode, dtype, B, S, H, D, ctas, planes_per_chunk, rows_per_chunk, stream);
    default: return fvk_a2a_ce(ctx, x, out, mode, dtype, B, S, H, D, ctas, planes_per_chunk, rows_per_chunk, stream);
  }
}

int fvk_fabric_copy(fvk_ctx* ctx, int64_t bytes, int engine, int ctas, void* stream) {
  return fabric_copy(ctx, bytes, engine, ctas, static_cast<cudaStream_t>(stream));
}

int fvk_a2a_captured(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                     int64_t D, int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk, void* stream) {
  return launch_fused(ctx, x, out, mode, dtype, B, S, H, D, ctas, planes_per_chunk, rows_per_chunk, kCaptureLaunch,
                      nullptr, stream);
}

int fvk_a2a_debug(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                  int64_t D, int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk, unsigned flags, void* report,
                  void* stream) {
  if (!report) return set_error(FVK_ERR_INVALID, "fvk_a2a_debug needs a device report buffer (5 x uint64)");
  if (flags & kCaptureLaunch) return set_error(FVK_ERR_INVALID, "fvk_a2a_debug cannot be captured (flags 0x%x)", flags);
  return launch_fused(ctx, x, out, mode, dtype, B, S, H, D, ctas, planes_per_chunk, rows_per_chunk, flags,
                      static_cast<unsigned long long*>(report), stream);
}

int fvk_sim_a2a(int world, int ncalls, const fvk_sim_call* calls, void* const* windows, size_t window_bytes,
                unsigned flags, unsigned skew_ns, uint64_t seed, uint64_t* report, void* stream) {
  if (!calls || !windows || !report) return set_error(FVK_ERR_INVALID, "null calls, windows or report");
  if (ncalls < 1 || ncalls > kMaxSimCalls)
    return set_error(FVK_ERR_INVALID, "ncalls=%d outside 1..%d", ncalls, kMaxSimCalls);
  if (world < 1 || world > kMaxWorld)
    return set_error(FVK_ERR_INVALID, "world size %d outside 1..%d", world, kMaxWorld);
  if (flags & ~(FVK_SIM_SKEW | FVK_SIM_EPOCH_CHECK | FVK_SIM_LEGACY_LAYOUT))
    return set_error(FVK_ERR_INVALID, "unknown sim flags 0x%x", flags);
  const bool check = flags & FVK_SIM_EPOCH_CHECK;
  const int layout = (flags & FVK_SIM_LEGACY_LAYOUT) ? kLegacy : kStatic;
  SimLaunch host{};
  host.ncalls = ncalls;
  host.world = world;
  int64_t min_granule = 16;
  for (int n = 0; n < ncalls; ++n) {
    const fvk_sim_call& c = calls[n];
    Problem base;
    int64_t operand_bytes = 0;
    // Every CTA of the simulated launch waits only on CTAs of the same launch: kMaxCtas is the LSA
    // barrier's slot count, the same limit as the fused kernel.
    FVK_TRY(make_problem(world, c.mode, c.dtype, c.B, c.S, c.H, c.D, c.ctas, kMaxCtas, c.planes_per_chunk,
                         c.rows_per_chunk, window_bytes, base, operand_bytes, layout));
    host.calls[n].ctas = c.ctas;
    host.max_ctas = c.ctas > host.max_ctas ? c.ctas : host.max_ctas;
    min_granule = base.granule < min_granule ? base.granule : min_granule;
    for (int r = 0; r < world; ++r) {
      if (!c.x[r] || !c.out[r] || !windows[r])
        return set_error(FVK_ERR_INVALID, "call %d: null buffer for simulated rank %d", n, r);
      Problem& p = host.calls[n].rank[r];
      p = base;
      p.x = static_cast<const char*>(c.x[r]);
      p.out = static_cast<char*>(c.out[r]);
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
  if (e != cudaSuccess)
    rc = set_error(FVK_ERR_CUDA, "simulated launch failed: CUDA error %d %s: %s", static_cast<int>(e),
                   cudaGetErrorName(e), cudaGetErrorString(e));
  for (int i = 0; i < 5; ++i) report[i] = found[i];
  cudaFree(scratch);
  return rc;
}

int fvk_check_ce_addressing(int world, int mode, int dtype, int64_t B, int64_t S, int64_t H, int64_t D,
                            int64_t planes_per_chunk, int64_t rows_per_chunk, unsigned flags, int64_t* wrong, char* msg,
                            int len) {
  if (!wrong) return set_error(FVK_ERR_INVALID, "wrong is null");
  if (flags & ~FVK_CE_CHECK_SWAP_BUFFERS) return set_error(FVK_ERR_INVALID, "unknown flags 0x%x", flags);
  Problem base;
  int64_t operand_bytes = 0;
  FVK_TRY(make_problem(world, mode, dtype, B, S, H, D, 1, kMaxCtas, planes_per_chunk, rows_per_chunk, SIZE_MAX / 4,
                       base, operand_bytes, kStatic));
  if (operand_bytes > (int64_t{256} << 20))
    return set_error(FVK_ERR_INVALID, "the host check takes operands up to 256 MiB (%lld bytes)",
                     (long long)operand_bytes);
  const int64_t need = ce_window_need(base);
  using Bytes = std::vector<unsigned char>;
  std::vector<Bytes> x(world, Bytes(operand_bytes)), out(world, Bytes(operand_bytes, 0)), win(world, Bytes(need, 0));
  for (int r = 0; r < world; ++r)
    for (int64_t k = 0; k < operand_bytes; ++k)
      x[r][k] = static_cast<unsigned char>(mix(static_cast<unsigned long long>(r) << 48 ^ k) & 0xff);
  int64_t bad = 0;
  std::string first;
  auto fail = [&](const std::string& what, int64_t n) {
    if (bad == 0 && n) first = what;
    bad += n;
  };
  auto rank_problem = [&](int r) {
    Problem p = base;
    p.x = reinterpret_cast<const char*>(x[r].data());
    p.out = reinterpret_cast<char*>(out[r].data());
    p.rank = r;
    return p;
  };
  // The schedule's data movement in an order it allows (every push of a chunk, then its copy-outs): the
  // launcher's copies (ce_push_copies) and the kernels' addressing (tensor_rows, ce_block_offset).
  using U = unsigned char;
  for (int64_t ci = 0; ci < num_chunks(base); ++ci) {
    for (int r = 0; r < world; ++r) {
      const Problem p = rank_problem(r);
      ce_push_copies(p, ci, [&](const CeCopy& k) {
        const int64_t src_end = k.src_offset + (k.rows - 1) * k.src_pitch + k.width;
        const int64_t dst_end = k.dst_offset + (k.rows - 1) * k.dst_pitch + k.width;
        // Each push stays inside its own block: buffer ci % 2, source r (what the sync model assumes).
        const int64_t block = ce_block_offset(p, static_cast<int>(ci % 2), r);
        if (k.src_offset < 0 || src_end > operand_bytes || k.dst_offset < block ||
            dst_end > block + full_block_bytes(p) || dst_end > need) {
          fail("push outside its block: chunk " + std::to_string(ci) + " rank " + std::to_string(r), 1);
          return;
        }
        for (int64_t row = 0; row < k.rows; ++row)
          memcpy(win[k.peer].data() + k.dst_offset + row * k.dst_pitch, x[r].data() + k.src_offset + row * k.src_pitch,
                 k.width);
      });
    }
    for (int r = 0; r < world; ++r) {
      const Problem p = rank_problem(r);
      const Chunk c = chunk_at(p, ci);
      const uint32_t units = static_cast<uint32_t>(block_bytes(p, c));
      const TensorRows<U> own_in = tensor_rows<U>(p, c, const_cast<char*>(p.x), r, mode == 0);
      const TensorRows<U> own_out = tensor_rows<U>(p, c, p.out, r, mode != 0);
      for (uint32_t u = 0; u < units; ++u) *own_out.at(u) = *own_in.at(u);  // ce_local_kernel
      const int buffer = static_cast<int>((ci + ((flags & FVK_CE_CHECK_SWAP_BUFFERS) ? 1 : 0)) % 2);
      for (int src = 0; src < world; ++src) {  // ce_copy_out_kernel
        if (src == r) continue;
        const WindowRun<U> from{reinterpret_cast<char*>(win[r].data()) + ce_block_offset(p, buffer, src), 0};
        const TensorRows<U> to = tensor_rows<U>(p, c, p.out, src, mode == 1);
        for (uint32_t u = 0; u < units; ++u) *to.at(u) = *from.at(u);
      }
    }
  }
  // The all-to-all's definition: rank r's output row of source q is source q's row for r.
  const int64_t run = base.run_bytes, P = world;
  for (int r = 0; r < world; ++r)
    for (int q = 0; q < world; ++q)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s) {
          const int64_t out_row = mode == 0 ? (b * P + q) * S + s : (b * S + s) * P + q;
          const int64_t in_row = mode == 0 ? (b * S + s) * P + r : (b * P + r) * S + s;
          int64_t n = 0;
          for (int64_t k = 0; k < run; ++k) n += out[r][out_row * run + k] != x[q][in_row * run + k];
          fail("rank " + std::to_string(r) + " plane " + std::to_string(b) + " row " + std::to_string(s) +
                   " from rank " + std::to_string(q) + ": " + std::to_string(n) + " wrong bytes",
               n);
        }
  *wrong = bad;
  if (msg && len > 0) snprintf(msg, static_cast<size_t>(len), "%s", first.c_str());
  return FVK_OK;
}

int fvk_destroy(fvk_ctx* ctx) {
  if (!ctx) return FVK_OK;
  int rc = FVK_OK;
  {
    DeviceGuard guard;
    rc = guard.set(ctx->device);
    // Kernels still in flight read the window and barriers: let them finish before teardown.
    if (rc == FVK_OK) {
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess)
        rc = set_error(FVK_ERR_CUDA, "cudaDeviceSynchronize before teardown failed: CUDA error %d %s: %s",
                       static_cast<int>(e), cudaGetErrorName(e), cudaGetErrorString(e));
    }
    // Keep going after a failure so that every resource gets its release call; report the first.
    auto keep = [&rc](int status) {
      if (rc == FVK_OK) rc = status;
    };
    auto nccl = [&keep](ncclResult_t r, const char* what) {
      if (r != ncclSuccess)
        keep(set_error(FVK_ERR_NCCL, "%s failed: NCCL error %d %s: %s", what, static_cast<int>(r),
                       ncclGetErrorString(r), ncclGetLastError(nullptr)));
    };
    if (ctx->has_dev_comm) nccl(ncclDevCommDestroy(ctx->comm, &ctx->dev_comm), "ncclDevCommDestroy");
    if (ctx->window) nccl(ncclCommWindowDeregister(ctx->comm, ctx->window), "ncclCommWindowDeregister");
    if (ctx->buffer) nccl(ncclMemFree(ctx->buffer), "ncclMemFree");
    if (ctx->comm) nccl(ncclCommDestroy(ctx->comm), "ncclCommDestroy");
    release_streams(ctx);
  }
  delete ctx;
  return rc;
}

int fvk_abort(fvk_ctx* ctx) {
  if (!ctx) return FVK_OK;
  int rc = FVK_OK;
  {
    DeviceGuard guard;
    rc = guard.set(ctx->device);
    // ncclCommAbort is local (peers may be in any state after a failed step) and releases the
    // communicator's registrations and device communicator with it; the buffer is ours to free.
    if (ctx->comm) {
      ncclResult_t r = ncclCommAbort(ctx->comm);
      if (r != ncclSuccess && rc == FVK_OK)
        rc = set_error(FVK_ERR_NCCL, "ncclCommAbort failed: NCCL error %d %s", static_cast<int>(r),
                       ncclGetErrorString(r));
    }
    if (ctx->buffer) {
      ncclResult_t r = ncclMemFree(ctx->buffer);
      if (r != ncclSuccess && rc == FVK_OK)
        rc =
            set_error(FVK_ERR_NCCL, "ncclMemFree failed: NCCL error %d %s", static_cast<int>(r), ncclGetErrorString(r));
    }
    release_streams(ctx);  // on the context's device, as fvk_destroy does
  }
  delete ctx;
  return rc;
}

}  // extern "C"
