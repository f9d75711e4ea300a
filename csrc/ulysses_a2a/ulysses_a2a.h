/*
 * fastvideo-kernel: the Ulysses fused all-to-all, plain C ABI (loaded from Python with ctypes).
 *
 * Every function returns FVK_OK (0) or an FVK_ERR_* code; fvk_last_error() then returns a message
 * (thread-local, valid until the next call on the same thread) naming the failing CUDA/NCCL call,
 * its code and its text. Nothing here aborts the process.
 *
 * Geometry is passed in the project's mode-independent terms (fastvideo/distributed/ulysses/policy.py):
 *   mode 0: input [B, S, H, D]   -> output [B, P*S, H/P, D]   (scatter heads, gather sequence)
 *   mode 1: input [B, P*S, H/P, D] -> output [B, S, H, D]     (the inverse)
 *   S = S_local (rows per rank), H = global head count, P = world size of the communicator.
 * dtype codes are the contract's wire codes: 1 = float32, 2 = float16, 3 = bfloat16.
 * A plan is (ctas, planes_per_chunk, rows_per_chunk); chunks run planes-major, then S_local row
 * ranges taken from every peer's block (policy.Plan.chunks).
 *
 * Construction is split into the steps the helper votes between. Local: fvk_create,
 * fvk_window_alloc. Collective over the communicator's ranks, entered by every rank in the same
 * order: fvk_comm_init, fvk_window_register, fvk_devcomm_create, fvk_destroy, and every execute.
 */
#ifndef FASTVIDEO_ULYSSES_A2A_H_
#define FASTVIDEO_ULYSSES_A2A_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: static window regions (layout.h), the one-launch simulated ranks (fvk_sim_a2a with calls and
   flags), fvk_a2a_debug and fvk_check_window_sync.
   3: the copy-engine plan kind (fvk_a2a_ce, ce_plan.h), fvk_fabric_copy and fvk_check_ce_sync. */
#define FVK_ABI_VERSION 3

/* The library is built with -fvisibility=hidden: only these functions are exported. */
#define FVK_API __attribute__((visibility("default")))

enum {
  FVK_OK = 0,
  FVK_ERR_INVALID = 1,        /* bad argument or geometry */
  FVK_ERR_CUDA = 2,           /* a CUDA runtime call failed */
  FVK_ERR_NCCL = 3,           /* an NCCL call failed */
  FVK_ERR_NOT_CORESIDENT = 4, /* the CTA count cannot be co-resident: launching would risk deadlock */
  FVK_ERR_STATE = 5,          /* step called out of order (e.g. execute before the device comm) */
  FVK_ERR_UNAVAILABLE = 6,    /* an optional facility (NVML, POSIX shared memory) is missing */
  FVK_ERR_TIMEOUT = 7         /* the shared-memory vote's deadline passed */
};

typedef struct fvk_ctx fvk_ctx;

/* ---- library identity ---- */
FVK_API int fvk_abi_version(void);
FVK_API int fvk_nccl_build_version(void);           /* NCCL_VERSION_CODE of the headers compiled against */
FVK_API int fvk_nccl_runtime_version(int* version); /* ncclGetVersion of the libnccl.so.2 in this process */
FVK_API const char* fvk_last_error(void);
FVK_API int fvk_max_ctas(void); /* LSA barrier slots reserved by fvk_devcomm_create (144) */
/* CTAs of the fused kernel one device can hold at once (occupancy x SMs), the co-residency limit. */
FVK_API int fvk_coresident_ctas(int device, int* ctas);

/* Sets the calling thread's stream-capture mode to relaxed, so that its event queries (the helper's
   watchdog thread) never invalidate a CUDA-graph capture another thread has begun in global mode (as
   torch's NCCL watchdog does). Per thread, at the driver level: it covers torch's calls too. */
FVK_API int fvk_relax_capture_mode(void);

/* ---- topology helpers (local) ---- */
FVK_API int fvk_pci_bus_id(int device, char* buf, int len);
/* *nvlink = 1 when NVML reports NVLink P2P between the two GPUs (PCI bus ids), else 0. */
FVK_API int fvk_nvlink_p2p(const char* bus_id_a, const char* bus_id_b, int* nvlink);

/* ---- construction (see the header comment for which steps are collective) ---- */
FVK_API int fvk_unique_id_bytes(void);
FVK_API int fvk_get_unique_id(void* out, size_t len);
FVK_API int fvk_create(int device, fvk_ctx** out);
FVK_API int fvk_comm_init(fvk_ctx* ctx, const void* unique_id, size_t len, int nranks, int rank);
FVK_API int fvk_window_alloc(fvk_ctx* ctx, size_t bytes);
FVK_API int fvk_window_register(fvk_ctx* ctx);
FVK_API int fvk_devcomm_create(fvk_ctx* ctx);
/* LSA coverage: the fused route needs lsa_size == nranks (every SP peer load/store addressable). */
FVK_API int fvk_lsa_info(fvk_ctx* ctx, int* nranks, int* rank, int* lsa_size, int* lsa_rank);

/* ---- execution (collective; enqueued on `stream`, a cudaStream_t; returns once enqueued) ---- */
/* The original entry point: 36 CTAs, the whole operand as one chunk. */
FVK_API int fvk_a2a_original(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S,
                             int64_t H, int64_t D, void* stream);
/* The tuned entry point: CTA count and chunk shape as arguments. */
FVK_API int fvk_a2a_tuned(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                          int64_t D, int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk, void* stream);

/* The copy-engine plan kind (ce_plan.h): the same geometry and chunks, the fabric crossed by the copy
   engines into the peers' windows, `ctas` CTAs for the on-device copies (own block, copy-out). The
   window holds two chunk buffers, so each chunk must fit half of it. Ends on `stream` (internally it
   forks onto the context's copy stream and joins back). */
FVK_API int fvk_a2a_ce(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                       int64_t D, int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk, void* stream);

/* The benchmark's fabric limit (collective, like an execute): barrier, every rank copies `bytes` (a
   multiple of 16, (P + 1) x bytes <= window) from its window into every peer's window at once,
   barrier. engine 0: the copy engines (one cudaMemcpyAsync per peer); 1: `ctas` CTAs of SM stores. */
FVK_API int fvk_fabric_copy(fvk_ctx* ctx, int64_t bytes, int engine, int ctas, void* stream);
/* The tuned entry point for CUDA-graph capture: `stream` must be capturing. It records no host-side state
   (nothing runs at capture) and only graph-legal ordering: each replay waits for the last fused launch
   before it (eager, or another replay: an external event-wait node on the context's completion event) and
   for the previous captured launch of the same capture, and records that event when it completes. After
   a capture, every eager launch waits on that event (so it is ordered after replays issued before it).
   Replays are collective like any launch: every rank must replay the same graphs in the same order, and
   only while the context lives. Absent from older builds (the caller then declines under capture). */
FVK_API int fvk_a2a_captured(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S,
                             int64_t H, int64_t D, int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk,
                             void* stream);

/* The copy-engine kind for CUDA-graph capture (ABI 3, absent from older builds): `stream` must be capturing.
   The call's ops (fork onto the context's copy stream, entry barrier, per chunk the pushes, barrier, own
   block and copy-out, join) go into the graph with the schedule's ordering as graph edges, and the call is
   ordered against eager calls and other replays as fvk_a2a_captured's launch is. The same replay rules. */
FVK_API int fvk_a2a_ce_captured(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S,
                                int64_t H, int64_t D, int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk,
                                void* stream);

/* ---- debug: the fused kernel with the epoch checker (collective, like an execute) ---- */
#define FVK_DEBUG_EPOCH_CHECK 1u   /* stamp window granules; report any access another CTA index could race */
#define FVK_DEBUG_LEGACY_LAYOUT 2u /* negative control: the pre-fix window layout (wrong with uneven chunks) */
/* report: device memory of 5 uint64 (zeroed by the caller): violations, then the first one's
   kind | rank << 8 | peer << 16, granule, stamp found, stamp written. The window must hold the plan's
   bytes plus 8 bytes of stamps per granule. */
FVK_API int fvk_a2a_debug(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                          int64_t D, int ctas, int64_t planes_per_chunk, int64_t rows_per_chunk, unsigned flags,
                          void* report, void* stream);

/* ---- simulated ranks on one device (no NCCL): the fused kernel's own chunk loop ---- */
/* One call of a simulated sequence: geometry, plan, and each simulated rank's input and output. */
typedef struct fvk_sim_call {
  int mode, dtype, ctas, reserved;
  int64_t B, S, H, D, planes_per_chunk, rows_per_chunk;
  const void* x[8];
  void* out[8];
} fvk_sim_call;
#define FVK_SIM_SKEW 1u          /* random delays around every barrier (skew_ns max; 0 = 20 us) */
#define FVK_SIM_EPOCH_CHECK 2u   /* the epoch checker (report as for fvk_a2a_debug) */
#define FVK_SIM_LEGACY_LAYOUT 4u /* negative control: the pre-fix window layout */
/* `ncalls` (1..4) consecutive calls as ONE launch of world x max(ctas) co-resident CTAs, each group
   of CTAs playing one rank: the real chunk loop and barrier points, a same-device barrier with the
   LSA barrier's per-CTA semantics, and each rank's call boundary as its stream would order it.
   windows: `world` device pointers of `window_bytes` each. Blocking (synchronises `stream`); report:
   host array of 5 uint64. FVK_ERR_NOT_CORESIDENT when the device cannot hold the launch. */
FVK_API int fvk_sim_a2a(int world, int ncalls, const fvk_sim_call* calls, void* const* windows, size_t window_bytes,
                        unsigned flags, unsigned skew_ns, uint64_t seed, uint64_t* report, void* stream);

/* ---- host property check of the synchronisation argument (sync_model.cpp; no GPU) ---- */
/* Models `ncalls` consecutive calls on `world` ranks (per-CTA barriers, stream order between calls)
   over the window layout of layout.h, and counts window accesses that conflict without a
   happens-before order, CTA slices that do not tile their block or leave their region, and accesses
   outside `window_bytes`. (That a copy-out reads the bytes its store wrote is the simulation's job.)
   calls: ncalls x 8 int64 (dtype, B, S, H, D, ctas, planes_per_chunk, rows_per_chunk). layout: 0 the
   kernel's, 1 legacy (negative control). schedule: FVK_SYNC_KERNEL (run_call's two barriers per
   chunk), or a negative control with barriers removed. *violations gets the count; msg (len bytes)
   describes the first. */
#define FVK_SYNC_NO_FIRST_ENTRY 0 /* no barrier before chunk 0's stores (the cross-call argument) */
#define FVK_SYNC_KERNEL 1         /* as the kernel runs */
#define FVK_SYNC_NO_ENTRY 2       /* no barrier before any chunk's stores (write-after-read in a call) */
#define FVK_SYNC_NO_MIDDLE 3      /* no barrier between stores and copy-out (read-after-write) */
FVK_API int fvk_check_window_sync(int world, int ncalls, const int64_t* calls, size_t window_bytes, int layout,
                                  int schedule, int64_t* violations, char* msg, int len);

/* The same kind of check for the copy-engine schedule (ce_plan.h's ce_schedule, as the launcher runs
   it): `ncalls` consecutive calls of chunks[n] chunks on `world` ranks, two streams per rank, event
   records/waits with reuse as issued, barriers pairing by order. Counts conflicting window accesses
   (push into a buffer block vs its copy-out) without happens-before, and copy-stream work outside its
   call (before the caller's stream reached it, or after the call's end). chunks[n] = kCeSmCall (-1):
   an SM-kind call there instead. drop: 0 as built, or ce_plan.h's kCeDrop* bits (negative controls)
   and kCeModelStreamPerCall (every call on streams of its own, ordered through the completion event). */
FVK_API int fvk_check_ce_sync(int world, int ncalls, const int64_t* chunks, unsigned drop, int64_t* violations,
                              char* msg, int len);

/* The copy-engine kind's addressing on the host (no GPU): P ranks' inputs, outputs and windows in host
   memory, the data movement of one call as the launcher and the kernels address it (ce_push_copies,
   tensor_rows, ce_block_offset), every push of a chunk before its copy-outs; then every output byte
   against the all-to-all's definition. *wrong counts differing bytes (and out-of-bounds pushes); msg
   describes the first. Operands up to 256 MiB. flags: FVK_CE_CHECK_SWAP_BUFFERS (negative control:
   copy-outs read the other buffer). */
#define FVK_CE_CHECK_SWAP_BUFFERS 1u
FVK_API int fvk_check_ce_addressing(int world, int mode, int dtype, int64_t B, int64_t S, int64_t H, int64_t D,
                                    int64_t planes_per_chunk, int64_t rows_per_chunk, unsigned flags, int64_t* wrong,
                                    char* msg, int len);

/* ---- teardown ---- */
/* Collective: device comm, window deregistration, ncclMemFree, ncclCommDestroy; frees ctx. */
FVK_API int fvk_destroy(fvk_ctx* ctx);
/* Local, after a failed construction: ncclCommAbort and free whatever this rank holds; frees ctx. */
FVK_API int fvk_abort(fvk_ctx* ctx);

/* ---- same-host shared-memory vote (host only, shm_vote.cpp; protocol in that file) ---- */
/* Open (create = 1: the one creating rank, O_EXCL) the POSIX shm segment `name` ("/x") for `world` ranks. */
FVK_API int fvk_vote_open(const char* name, int world, int rank, int create, void** handle);
/* One call: publish 12 int64 `fields`, gather every rank's into out[world * 12] (row r = rank r).
   FVK_ERR_TIMEOUT after `timeout_ns`; any failure leaves the handle unusable for further exchanges. */
FVK_API int fvk_vote_exchange(void* handle, const int64_t* fields, int64_t* out, int64_t timeout_ns);
/* shm_unlink the segment's name (existing mappings stay valid): nothing leaks if the job dies. */
FVK_API int fvk_vote_unlink(void* handle);
/* Unmap and free the handle (unlink = 1 also unlinks the name); a closed handle is an error, not a crash. */
FVK_API int fvk_vote_close(void* handle, int unlink);

/* ---- the vote and the launch in one call (the fused route's hot path; ABI 3, absent from older builds) ---- */
/* The vote's wire format (docs/ulysses_contract.md): fields per rank, and the two this call reads. */
#define FVK_VOTE_FIELDS 12
#define FVK_FIELD_ELIGIBILITY 2
#define FVK_FIELD_PLAN 11
/* 1 when the gathered votes[world * 12] say "run this rank's proposal": every rank's 12 fields equal
   `mine`, with no eligibility bit and a plan. That is the only case in which the contract's verdict runs
   a plan (contract.decide; every other table declines or raises on every rank), so a launch decided here
   is the launch the Python verdict would order. Host only. */
FVK_API int fvk_vote_would_run(const int64_t* votes, int world, const int64_t* mine);
/* fvk_vote_exchange, then, where fvk_vote_would_run, the launch of `entry` (0 fvk_a2a_original, 1
   fvk_a2a_tuned, 2 fvk_a2a_ce; the original ignores ctas, planes and rows) with the plan the fields carry.
   *stage: -1 refused before the exchange (bad entry, a closed vote, a vote and a communicator of different
   sizes: this rank has not voted), 0 the exchange failed (the return code is the vote's), 1 exchanged and
   not launched (the caller decides from `votes`: a decline or an error, on every rank alike), 2 launched (the
   return code is the launch's; a null `ctx` fails here, so the decision can be tested without a GPU).
   *vote_ns: the exchange's duration. Collective, host-blocking for the vote; eager only. */
FVK_API int fvk_voted_launch(void* vote, const int64_t* fields, int64_t* votes, int64_t timeout_ns, int* stage,
                             int64_t* vote_ns, fvk_ctx* ctx, int entry, const void* x, void* out, int mode, int dtype,
                             int64_t B, int64_t S, int64_t H, int64_t D, int ctas, int64_t planes_per_chunk,
                             int64_t rows_per_chunk, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* FASTVIDEO_ULYSSES_A2A_H_ */
