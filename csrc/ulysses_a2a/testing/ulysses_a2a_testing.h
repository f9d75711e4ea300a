/*
 * fastvideo-kernel's test library (libfastvideo_ulysses_a2a_testing.so): the product library's sources and
 * ABI (../ulysses_a2a.h, all of it exported here too) plus the test and measurement code, which the product
 * library does not contain:
 *   - the epoch-checked SM launch: fvk_launch with FVK_CALL_DEBUG (checked_launch.cu);
 *   - P simulated ranks on one GPU running the fused kernel's own body (sim_ranks.cu);
 *   - the host property checks of both plan kinds' synchronisation and addressing (sync_model.cu,
 *     ce_sync_model.cpp, addressing.cu; no GPU);
 *   - the benchmark's fabric copy (fabric_copy.cu).
 * Because it holds the product code too, one communicator built through it serves product launches, the
 * epoch-checked launch and the fabric copy alike (the gate and the benchmarks load it in place of the
 * product library).
 */
#ifndef FASTVIDEO_ULYSSES_A2A_TESTING_H_
#define FASTVIDEO_ULYSSES_A2A_TESTING_H_

#include "../ulysses_a2a.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1: the first test library (product ABI 4).
   2: product ABI 5 (uneven splits): the simulation and the host checks take fvk_call descriptions (their split
      tables included), the SM kind's host addressing check, the even-only layout as a negative control. */
#define FVK_TESTING_ABI_VERSION 2
FVK_API int fvk_testing_abi_version(void);

/* ---- the epoch-checked launch: fvk_launch with FVK_CALL_DEBUG (collective, like any launch) ----
   An eager SM-kind call, no vote. The kernel stamps every window granule it touches and reports any access
   another CTA index could race on. fvk_call.debug_report: device memory of 5 uint64 zeroed by the caller:
   violations, then the first one's kind | rank << 8 | peer << 16, granule, stamp found, stamp written.
   The window must hold the plan's bytes plus 8 bytes of stamps per granule. FVK_CALL_DEBUG_MOVING_LAYOUT:
   the pre-fix window layout (the negative control: wrong with uneven chunks). */

/* The host checks' and the simulation's window layouts: the kernels', and two negative controls (layout.h). */
#define FVK_LAYOUT_STATIC 0    /* the kernels' layout */
#define FVK_LAYOUT_MOVING 1    /* regions that move with the block size (the pre-fix layout) */
#define FVK_LAYOUT_EVEN_ONLY 2 /* the split tables ignored: the layout before uneven splits, applied to them */

/* ---- simulated ranks on one device (no NCCL): the fused kernel's own chunk loop ---- */
/* One call of a simulated sequence: its description (an SM-kind fvk_call: geometry, split tables, plan; flags
   and debug_report unused) and each simulated rank's input and output (null where that operand is empty). */
typedef struct fvk_sim_call {
  fvk_call call;
  const void* x[8];
  void* out[8];
} fvk_sim_call;
#define FVK_SIM_SKEW 1u          /* random delays around every barrier (skew_ns max; 0 = 20 us) */
#define FVK_SIM_EPOCH_CHECK 2u   /* the epoch checker (report as for FVK_CALL_DEBUG) */
#define FVK_SIM_MOVING_LAYOUT 4u /* negative control: the pre-fix window layout */
/* `ncalls` (1..4) consecutive calls as ONE launch of world x max(ctas) co-resident CTAs, each group
   of CTAs playing one rank: the real chunk loop and barrier points, a same-device barrier with the
   LSA barrier's per-CTA semantics, and each rank's call boundary as its stream would order it.
   windows: `world` device pointers of `window_bytes` each. Blocking (synchronises `stream`); report:
   host array of 5 uint64. FVK_ERR_NOT_CORESIDENT when the device cannot hold the launch. */
FVK_API int fvk_sim_a2a(int world, int ncalls, const fvk_sim_call* calls, void* const* windows, size_t window_bytes,
                        unsigned flags, unsigned skew_ns, uint64_t seed, uint64_t* report, void* stream);

/* ---- host property check of the synchronisation argument (sync_model.cu; no GPU) ---- */
/* Models `ncalls` consecutive SM-kind calls (`calls`: their descriptions, split tables included) on `world`
   ranks: runs the kernel body (movement.cuh's run_call) of every rank and CTA on the host, recording every
   window access and barrier point, and counts window accesses that conflict without a happens-before order
   (per-CTA barriers, stream order between calls), CTA slices that do not tile the block the all-to-all's
   definition gives (every rank's shares) or leave their region, and accesses outside `window_bytes`. (That a
   copy-out reads the bytes its store wrote is the addressing check's and the simulation's job.) layout:
   FVK_LAYOUT_*. schedule: FVK_SYNC_KERNEL (run_call's two barriers per chunk), or a negative control with
   barriers removed. *violations gets the count; msg (len bytes) describes the first. */
#define FVK_SYNC_NO_FIRST_ENTRY 0 /* no barrier before chunk 0's stores (the cross-call argument) */
#define FVK_SYNC_KERNEL 1         /* as the kernel runs */
#define FVK_SYNC_NO_ENTRY 2       /* no barrier before any chunk's stores (write-after-read in a call) */
#define FVK_SYNC_NO_MIDDLE 3      /* no barrier between stores and copy-out (read-after-write) */
FVK_API int fvk_check_window_sync(int world, int ncalls, const fvk_call* calls, size_t window_bytes, int layout,
                                  int schedule, int64_t* violations, char* msg, int len);

/* The same kind of check for the copy-engine schedule (ce_plan.h's ce_schedule, as the launcher runs
   it): `ncalls` consecutive calls (`calls`: copy-engine descriptions, split tables included, or SM-kind ones
   between them) on `world` ranks, two streams per rank, event records/waits with reuse as issued, barriers
   pairing by order. Each rank runs its own schedule and its own pushes (ce_push_copies), so a rank that sends
   nothing still issues every barrier. Counts conflicting window accesses (byte ranges of pushes and copy-outs)
   without happens-before, pushes that leave their block, and copy-stream work outside its call (before the
   caller's stream reached it, or after the call's end). An SM-kind call: the fused kernel there instead, its
   stores and copy-out over the whole window. layout: FVK_LAYOUT_STATIC or FVK_LAYOUT_EVEN_ONLY (the negative
   control). drop: 0 as built, or ce_plan.h's kCeDrop* bits (negative controls) and kCeModelStreamPerCall
   (every call on streams of its own, ordered through the completion event). */
FVK_API int fvk_check_ce_sync(int world, int ncalls, const fvk_call* calls, int layout, unsigned drop,
                              int64_t* violations, char* msg, int len);

/* The addressing of one call on the host (addressing.cu; no GPU): P ranks' inputs, outputs and windows in host
   memory, sized by the call's shares; the data movement of both kinds as the kernels address it, every store
   or push of a chunk before its copy-outs: for the SM kind every CTA's store_chunk and copy_out_chunk
   (movement.cuh), for the copy-engine kind the launcher's pushes (ce_push_copies) and its kernels' bodies
   (ce_own_chunk, ce_copy_out_chunk). Then every output byte against the all-to-all's definition. *wrong
   counts differing bytes and accesses outside a rank's tensors or window; msg describes the first. Operands up
   to 256 MiB. layout: FVK_LAYOUT_* (negative controls). flags: FVK_CE_CHECK_SWAP_BUFFERS (negative control of
   the copy-engine kind: copy-outs read the other buffer). */
#define FVK_CE_CHECK_SWAP_BUFFERS 1u
FVK_API int fvk_check_addressing(int world, const fvk_call* call, int layout, unsigned flags, int64_t* wrong, char* msg,
                                 int len);

/* ---- the benchmark's fabric limit (collective, like a launch; eager only) ---- */
/* Barrier, every rank copies `bytes` (a multiple of 16, (P + 1) x bytes <= window) from its window into
   every peer's window at once, barrier. engine 0: the copy engines (one cudaMemcpyAsync per peer); 1:
   `ctas` CTAs of SM stores. Ordered with the context's launches as every launch is. */
#define FVK_FABRIC_COPY_ENGINE 0
#define FVK_FABRIC_SM 1
FVK_API int fvk_fabric_copy(fvk_ctx* ctx, int64_t bytes, int engine, int ctas, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* FASTVIDEO_ULYSSES_A2A_TESTING_H_ */
