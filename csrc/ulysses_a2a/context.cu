// The context's lifecycle and the library's queries (ulysses_a2a.h): identity, error text, topology
// helpers, the construction steps the helper votes between, and teardown. The kernels and the launch entry
// are ulysses_a2a.cu.
#include <dlfcn.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <new>

#include "context.h"

namespace fvk {

thread_local char g_error[1024];

int set_error(int code, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_error, sizeof(g_error), fmt, args);
  va_end(args);
  return code;
}

namespace {

// Every peer's window base as this rank maps it (LSA pointers exist only on the device in 2.28).
__global__ void resolve_peers_kernel(ncclWindow_t window, int world, void** out) {
  for (int q = 0; q < world; ++q) out[q] = ncclGetLsaPointer(window, 0, q);
}

// The context's CUDA events and copy stream (teardown, after the device is idle).
void release_streams(fvk_ctx* ctx) {
  if (ctx->done) cudaEventDestroy(ctx->done);
  if (ctx->capture_done) cudaEventDestroy(ctx->capture_done);
  for (cudaEvent_t ev : ctx->ce_events)
    if (ev) cudaEventDestroy(ev);
  if (ctx->copy_stream) cudaStreamDestroy(ctx->copy_stream);
}

// A failed release during teardown: the first failure is the one reported, and teardown goes on so that every
// resource gets its release call.
void keep_nccl(int& rc, ncclResult_t r, const char* what) {
  if (r != ncclSuccess && rc == FVK_OK) rc = nccl_error(r, what);
}

// fvk_destroy and fvk_abort: on the context's device, `release(rc)` frees what the context holds, then its
// streams and events, then the context itself; rc is the first failure.
template <typename Release>
int teardown(fvk_ctx* ctx, Release&& release) {
  if (!ctx) return FVK_OK;
  int rc = FVK_OK;
  {
    DeviceGuard guard;
    rc = guard.set(ctx->device);
    release(rc);
    release_streams(ctx);  // on the context's device, after the device is idle
  }
  delete ctx;
  return rc;
}

}  // namespace
}  // namespace fvk

using namespace fvk;

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
  if (e != cudaSuccess) return cuda_error(e, "resolving the peers' window pointers");
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

int fvk_destroy(fvk_ctx* ctx) {
  return teardown(ctx, [ctx](int& rc) {
    // Kernels still in flight read the window and barriers: let them finish before teardown.
    if (rc == FVK_OK) {
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) rc = cuda_error(e, "cudaDeviceSynchronize before teardown");
    }
    if (ctx->has_dev_comm) keep_nccl(rc, ncclDevCommDestroy(ctx->comm, &ctx->dev_comm), "ncclDevCommDestroy");
    if (ctx->window) keep_nccl(rc, ncclCommWindowDeregister(ctx->comm, ctx->window), "ncclCommWindowDeregister");
    if (ctx->buffer) keep_nccl(rc, ncclMemFree(ctx->buffer), "ncclMemFree");
    if (ctx->comm) keep_nccl(rc, ncclCommDestroy(ctx->comm), "ncclCommDestroy");
  });
}

int fvk_abort(fvk_ctx* ctx) {
  return teardown(ctx, [ctx](int& rc) {
    // ncclCommAbort is local (peers may be in any state after a failed step) and releases the
    // communicator's registrations and device communicator with it; the buffer is ours to free.
    if (ctx->comm) keep_nccl(rc, ncclCommAbort(ctx->comm), "ncclCommAbort");
    if (ctx->buffer) keep_nccl(rc, ncclMemFree(ctx->buffer), "ncclMemFree");
  });
}

}  // extern "C"
