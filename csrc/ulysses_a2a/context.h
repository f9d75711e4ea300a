// The library's internal interface: the context and the launch path's building blocks. Nothing here is exported
// (-fvisibility=hidden). One definition, used by the product sources (context.cu: the context's lifecycle;
// ulysses_a2a.cu: the kernels and fvk_launch) and by the test library's launchers (testing/: the epoch-checked SM
// launch through SmVariant, the fabric copy), so that a test launch goes through the same checks, call ordering and
// poisoning as a product one.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include "ce_plan.h"
#include "layout.h"
#include "status.h"
#include "ulysses_a2a.h"

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
  char* peers[fvk::kMaxWorld] = {};
  cudaStream_t copy_stream = nullptr;
  cudaEvent_t ce_events[fvk::kCeEvents] = {};
  // CUDA-graph capture (FVK_CALL_CAPTURE): `captured` once any launch was captured (eager launches then
  // always wait on `done`, which replays record); the capture id of the last captured launch, and an
  // event recorded inside that capture after it (orders the next launch of the same capture).
  bool captured = false;
  unsigned long long capture_id = 0;
  cudaEvent_t capture_done = nullptr;
};

namespace fvk {

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

int vote_world(void* handle);  // shm_vote.cpp: an open vote handle's world size, or -1

// ---- ulysses_a2a.cu: the launch path's pieces every launcher uses

// CTAs of the fused kernel that can be resident at once on `device`, over every vector width.
int coresident_ctas(int device, int& ctas);
// The context checks every launch makes first: they fail alike on every rank and leave the context usable.
int check_context(const fvk_ctx* ctx, bool copy_engine);
// Refuses a capturing stream (a launcher that cannot be captured), before anything is enqueued.
int refuse_capture(cudaStream_t s, const char* what);
// Orders a call after the previous fused work on this context (and, captured, inside its capture), and marks
// its end for the next one: every launcher brackets its work with these two (ulysses_a2a.cu says why).
int order_call(const fvk_ctx* ctx, cudaStream_t s, bool capture, unsigned long long& capture_id);
int finish_call(fvk_ctx* ctx, cudaStream_t s, bool capture, unsigned long long capture_id);
// The copy-engine schedule's barrier (one CTA on LSA slot kCeBarrierSlot), enqueued on `s`.
int enqueue_barrier(const fvk_ctx& ctx, cudaStream_t s);

// An SM-kind kernel in place of the production one: the test library's epoch-checked launch
// (testing/checked_launch.cu) registers itself in g_debug_variant when the library loads, and fvk_launch
// runs it for FVK_CALL_DEBUG; the product library has none and refuses that flag. The launch path around
// it (checks, operands, ordering, poisoning) is the product's.
struct SmVariant {
  int (*layout)(const fvk_call& call);  // the window layout (layout.h's kStatic, or kMoving as a control)
  // Checks of agreed values the variant adds (its window needs): they fail alike on every rank.
  int (*check)(const fvk_ctx& ctx, const Problem& p, const fvk_call& call);
  // Enqueues the variant's kernel, and what it needs first, on `s`; FVK_OK or an error (set_error).
  int (*enqueue)(const fvk_ctx& ctx, const Problem& p, int vec, const fvk_call& call, cudaStream_t s);
};
extern const SmVariant* g_debug_variant;

}  // namespace fvk
