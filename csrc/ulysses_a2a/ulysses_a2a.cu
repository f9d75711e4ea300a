// Ulysses fused all-to-all on NCCL's device API: kernels and the C ABI (ulysses_a2a.h).
//
// Push design. For each chunk, CTA i of every rank
//   1. waits at LSA barrier i: CTA i of every peer has finished copying chunk c-1 (or the previous
//      call) out of its window, so region i of every peer's window is free again;
//   2. stores its share of region i into every peer's window through LSA pointers, the
//      sequence/head relayout folded into the addressing (movement.cuh), and its own block
//      straight into its output;
//   3. waits at LSA barrier i again: every peer's CTA i has stored into region i of this window;
//   4. copies region i of its window into its output.
// Region i (slice i of every source block of the receiver's chunk layout, movement.cuh) is the same
// on every rank, so the only CTAs that touch region i of any window are the CTAs i of all ranks:
// per-CTA barriers suffice and no grid-wide synchronisation is needed. Consecutive calls are ordered on each rank by
// its stream (the Python side adds an event when the caller's stream changes), so a call's first barrier also covers
// the previous call's copy-out, whatever its CTA count.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <new>

#include "movement.cuh"
#include "ulysses_a2a.h"

namespace fvk {

thread_local char g_error[1024];

// Not in the anonymous namespace: shm_vote.cpp reports through it too (hidden, not exported).
int set_error(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, args);
  va_end(args);
  return code;
}

namespace {

constexpr int kMaxCtas = 144;  // LSA barrier slots: one per CTA of the largest launch
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

// ---------------------------------------------------------------------------------- kernels

struct LsaWindows {  // peers' windows through LSA pointers (the communicator spans one LSA team)
  ncclWindow_t window;
  __device__ char* operator()(int peer) const { return static_cast<char*>(ncclGetLsaPointer(window, 0, peer)); }
};

struct SimWindows {  // simulated peers: P windows on one device
  char* window[kMaxWorld];
  __device__ char* operator()(int peer) const { return window[peer]; }
};

template <typename V>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    fused_a2a_kernel(Problem p, ncclWindow_t window, ncclDevComm dev_comm) {
  ncclCoopCta cta;
  ncclLsaBarrierSession<ncclCoopCta> barrier{cta, dev_comm, ncclTeamLsa(dev_comm), dev_comm.lsaBarrier, blockIdx.x};
  const LsaWindows windows{window};
  char* own = windows(p.rank);
  const int64_t chunks = num_chunks(p);
  for (int64_t c = 0; c < chunks; ++c) {
    const Chunk chunk = chunk_at(p, c);
    // Acquire/release in both syncs: the first orders the peers' copy-out reads of region i before
    // our stores into it (WAR across chunks and calls), the second our stores before their reads.
    barrier.sync(cta, cuda::memory_order_acq_rel);
    store_chunk<V>(p, chunk, windows, blockIdx.x, gridDim.x);
    barrier.sync(cta, cuda::memory_order_acq_rel);
    copy_out_chunk<V>(p, chunk, own, blockIdx.x, gridDim.x);
  }
}

template <typename V>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    sim_store_kernel(Problem p, SimWindows windows, int64_t c) {
  store_chunk<V>(p, chunk_at(p, c), windows, blockIdx.x, gridDim.x);
}

template <typename V>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    sim_copy_out_kernel(Problem p, SimWindows windows, int64_t c) {
  copy_out_chunk<V>(p, chunk_at(p, c), windows(p.rank), blockIdx.x, gridDim.x);
}

// ---------------------------------------------------------------------------------- host helpers

// One phase of chunk c for one simulated rank (0: stores into the windows, 1: copy-out).
template <typename V>
void launch_sim(int phase, int ctas, cudaStream_t s, const Problem& p, const SimWindows& windows, int64_t c) {
  if (phase == 0)
    sim_store_kernel<V><<<ctas, kThreads, 0, s>>>(p, windows, c);
  else
    sim_copy_out_kernel<V><<<ctas, kThreads, 0, s>>>(p, windows, c);
}

int itemsize_of(int dtype) {
  switch (dtype) {
    case 1: return 4;  // float32
    case 2: return 2;  // float16
    case 3: return 2;  // bfloat16
    default: return 0;
  }
}

// Largest power of two <= 16 that divides v (v > 0).
int64_t pow2_divisor(uint64_t v) {
  int64_t g = 16;
  while (g > 1 && v % g) g /= 2;
  return g;
}

bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const char *pa = static_cast<const char*>(a), *pb = static_cast<const char*>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

// Checks a call's geometry and plan and fills the rank-independent part of `p`.
int make_problem(int world, int mode, int dtype, int64_t B, int64_t S, int64_t H, int64_t D, int ctas, int max_ctas,
                 int64_t planes_per_chunk, int64_t rows_per_chunk, size_t window_bytes, Problem& p,
                 int64_t& operand_bytes) {
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
  p = Problem{};
  p.world = world;
  p.mode = mode;
  p.B = B;
  p.S = S;
  p.run_bytes = H / world * D * itemsize;
  p.granule = pow2_divisor(static_cast<uint64_t>(p.run_bytes));
  p.planes_per_chunk = planes_per_chunk < B ? planes_per_chunk : B;
  p.rows_per_chunk = rows_per_chunk < S ? rows_per_chunk : S;
  operand_bytes = B * S * H * D * itemsize;
  const int64_t chunk_bytes = p.planes_per_chunk * p.rows_per_chunk * world * p.run_bytes;
  if (static_cast<uint64_t>(chunk_bytes) > window_bytes)
    return set_error(FVK_ERR_INVALID, "a chunk needs %lld window bytes, the window has %zu", (long long)chunk_bytes,
                     window_bytes);
  // copy_block counts the units of one block in 32 bits (with headroom for its loop stride, so
  // below 2^31); the smallest unit is 2 bytes.
  if (chunk_bytes / world / 2 > static_cast<int64_t>(INT32_MAX))
    return set_error(FVK_ERR_INVALID, "a chunk of %lld bytes per peer exceeds the kernel's 32-bit unit index",
                     (long long)(chunk_bytes / world));
  return FVK_OK;
}

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
  FVK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fused_a2a_kernel<V>, kThreads, 0));
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
};

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
  FVK_NCCL(ncclDevCommCreate(ctx->comm, &reqs, &ctx->dev_comm));
  ctx->has_dev_comm = true;
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
  if (!ctx || !ctx->has_dev_comm) return set_error(FVK_ERR_STATE, "execute needs a constructed context");
  if (!x || !out) return set_error(FVK_ERR_INVALID, "null input or output");
  // LSA rank r must be communicator rank r: ncclGetLsaPointer(window, 0, q) is addressed by SP rank.
  if (ctx->dev_comm.lsaSize != ctx->nranks || ctx->dev_comm.lsaRank != ctx->rank)
    return set_error(FVK_ERR_STATE, "LSA team (size %d, rank %d) does not cover the communicator (%d ranks, rank %d)",
                     ctx->dev_comm.lsaSize, ctx->dev_comm.lsaRank, ctx->nranks, ctx->rank);
  Problem p;
  int64_t operand_bytes = 0;
  FVK_TRY(make_problem(ctx->nranks, mode, dtype, B, S, H, D, ctas, kMaxCtas, planes_per_chunk, rows_per_chunk,
                       ctx->bytes, p, operand_bytes));
  if (overlaps(out, operand_bytes, ctx->buffer, ctx->bytes) || overlaps(x, operand_bytes, ctx->buffer, ctx->bytes))
    return set_error(FVK_ERR_INVALID, "input or output aliases the communication window");
  if (overlaps(out, operand_bytes, x, operand_bytes)) return set_error(FVK_ERR_INVALID, "output aliases the input");
  // Spinning CTAs wait for the same CTA index on peers: a CTA that cannot become resident while
  // others spin would deadlock every rank, so refuse such launches instead.
  if (ctas > ctx->coresident)
    return set_error(FVK_ERR_NOT_CORESIDENT, "ctas=%d exceeds the %d CTAs this device can hold at once", ctas,
                     ctx->coresident);
  p.x = static_cast<const char*>(x);
  p.out = static_cast<char*>(out);
  p.rank = ctx->rank;
  const void* window = ctx->buffer;
  const int vec = vector_bytes(p, &window, 1);
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  auto s = static_cast<cudaStream_t>(stream);
  switch (vec) {
    case 16: fused_a2a_kernel<uint4><<<ctas, kThreads, 0, s>>>(p, ctx->window, ctx->dev_comm); break;
    case 8: fused_a2a_kernel<uint2><<<ctas, kThreads, 0, s>>>(p, ctx->window, ctx->dev_comm); break;
    case 4: fused_a2a_kernel<uint32_t><<<ctas, kThreads, 0, s>>>(p, ctx->window, ctx->dev_comm); break;
    default: fused_a2a_kernel<uint16_t><<<ctas, kThreads, 0, s>>>(p, ctx->window, ctx->dev_comm); break;
  }
  FVK_CUDA(cudaGetLastError());
  return FVK_OK;
}

int fvk_a2a_original(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                     int64_t D, void* stream) {
  return fvk_a2a_tuned(ctx, x, out, mode, dtype, B, S, H, D, kOriginalCtas, B, S, stream);
}

int fvk_sim_a2a(int world, const void* const* xs, void* const* windows, size_t window_bytes, void* const* outs,
                int mode, int dtype, int64_t B, int64_t S, int64_t H, int64_t D, int ctas, int64_t planes_per_chunk,
                int64_t rows_per_chunk, void* stream) {
  if (!xs || !windows || !outs) return set_error(FVK_ERR_INVALID, "null pointer table");
  Problem base;
  int64_t operand_bytes = 0;
  // No inter-CTA waiting here, so any CTA count the plan word can carry (10 bits) is allowed.
  FVK_TRY(make_problem(world, mode, dtype, B, S, H, D, ctas, 1023, planes_per_chunk, rows_per_chunk, window_bytes, base,
                       operand_bytes));
  SimWindows table{};
  for (int r = 0; r < world; ++r) {
    if (!xs[r] || !windows[r] || !outs[r]) return set_error(FVK_ERR_INVALID, "null buffer for simulated rank %d", r);
    table.window[r] = static_cast<char*>(windows[r]);
  }
  Problem ranks[kMaxWorld];
  int vec[kMaxWorld];
  for (int r = 0; r < world; ++r) {
    ranks[r] = base;
    ranks[r].x = static_cast<const char*>(xs[r]);
    ranks[r].out = static_cast<char*>(outs[r]);
    ranks[r].rank = r;
    // Each simulated rank picks its own vector width from the pointers it touches, as a real rank
    // would; the CTA partition (granule) is the same for all of them.
    vec[r] = vector_bytes(ranks[r], reinterpret_cast<const void* const*>(windows), world);
  }
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t chunks = num_chunks(base);
  for (int64_t c = 0; c < chunks; ++c) {
    // Launch boundaries stand in for the two LSA barriers of the fused kernel.
    for (int phase = 0; phase < 2; ++phase) {
      for (int r = 0; r < world; ++r) {
        switch (vec[r]) {
          case 16: launch_sim<uint4>(phase, ctas, s, ranks[r], table, c); break;
          case 8: launch_sim<uint2>(phase, ctas, s, ranks[r], table, c); break;
          case 4: launch_sim<uint32_t>(phase, ctas, s, ranks[r], table, c); break;
          default: launch_sim<uint16_t>(phase, ctas, s, ranks[r], table, c); break;
        }
        FVK_CUDA(cudaGetLastError());
      }
    }
  }
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
  }
  delete ctx;
  return rc;
}

}  // extern "C"
