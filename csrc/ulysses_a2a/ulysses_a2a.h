/*
 * fastvideo-kernel: the Ulysses fused all-to-all, plain C ABI (loaded from Python with ctypes).
 *
 * This is the product library's ABI (libfastvideo_ulysses_a2a.so, the one the wheel ships). The test
 * library (libfastvideo_ulysses_a2a_testing.so: these sources plus csrc/ulysses_a2a/testing/) exports all
 * of it too, and adds the simulated ranks, the host property checks and the fabric copy
 * (testing/ulysses_a2a_testing.h).
 *
 * Every function returns FVK_OK (0) or an FVK_ERR_* code; fvk_last_error() then returns a message
 * (thread-local, valid until the next call on the same thread) naming the failing CUDA/NCCL call,
 * its code and its text. Nothing here aborts the process.
 *
 * Geometry is passed in the project's mode-independent terms (fastvideo/distributed/ulysses/policy.py), with
 * every rank's shares (fvk_call's split tables; null = even):
 *   mode 0: rank r's input [B, seq[r], H, D] -> output [B, sum(seq), heads[r], D]   (scatter heads, gather sequence)
 *   mode 1: rank r's input [B, sum(seq), heads[r], D] -> output [B, seq[r], H, D]   (the inverse)
 *   S = the largest sequence share (S_local when even: every seq[r] = S), H = the global head count (sum(heads);
 *   heads[r] = H / P when even), P = world size of the communicator. A share may be 0 (an idle rank).
 * dtype codes are the contract's wire codes: 1 = float32, 2 = float16, 3 = bfloat16.
 * A plan is (kind, ctas, planes_per_chunk, rows_per_chunk); chunks run planes-major, then row ranges of
 * [0, S) taken from every peer's share (a shorter share contributes fewer rows; policy.Plan.chunks).
 *
 * Construction is split into the steps the helper votes between. Local: fvk_create,
 * fvk_window_alloc. Collective over the communicator's ranks, entered by every rank in the same
 * order: fvk_comm_init, fvk_window_register, fvk_devcomm_create, fvk_destroy, and every launch.
 */
#ifndef FASTVIDEO_ULYSSES_A2A_H_
#define FASTVIDEO_ULYSSES_A2A_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: static window regions (layout.h), the one-launch simulated ranks, the epoch checker, the host check.
   3: the copy-engine plan kind (ce_plan.h), the fabric copy and the copy-engine host checks.
   4: one launch entry, fvk_launch, taking a call description (fvk_call) for every plan kind and flag, and
      the voted form (fvk_vote); it replaces fvk_a2a_tuned, _ce, _captured, _ce_captured, _debug and
      fvk_voted_launch. The simulated ranks, the epoch-checked launch, the host checks and the fabric copy
      moved to the test library. fvk_a2a_original stays (older callers).
   5: uneven sequence and head splits: fvk_call's split tables (refused as non-null by ABI 4), both plan kinds. */
#define FVK_ABI_VERSION 5

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
  FVK_ERR_TIMEOUT = 7,        /* the shared-memory vote's deadline passed (a peer is stopped, stuck or elsewhere) */
  FVK_ERR_PEER_GONE = 8       /* the shared-memory vote's peer process no longer exists */
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

/* ---- execution: one entry, fvk_launch, and its call description ---- */

/* fvk_call.kind, the plan kind. SM: the fused kernel, `ctas` CTAs store every share straight into the peers'
   windows. CE: the copy-engine kind (ce_plan.h), the fabric crossed by the copy engines, `ctas` CTAs for the
   on-device copies; the window holds two chunk buffers (each chunk fits half). */
#define FVK_KIND_SM 0
#define FVK_KIND_CE 1

/* fvk_call.flags. */
#define FVK_CALL_CAPTURE 1u /* into the CUDA graph `stream` is capturing (below) */
/* The SM kind with the epoch checker, and its negative control (the pre-fix window layout): the test
   library only (testing/ulysses_a2a_testing.h); the product library refuses them, naming it. */
#define FVK_CALL_DEBUG 2u
#define FVK_CALL_DEBUG_MOVING_LAYOUT 4u

/* One call, described once per signature and reused (the caller caches it): the plan kind, flags,
   geometry and plan. `size` versions it: the caller sets sizeof(fvk_call) as it was compiled; a library
   reads the fields it knows (an older caller's missing fields read as zero) and refuses a newer caller's
   fields it does not know unless they are zero. New fields are appended. */
typedef struct fvk_call {
  uint32_t size;  /* sizeof(fvk_call) */
  uint32_t flags; /* FVK_CALL_* */
  int32_t kind;   /* FVK_KIND_* */
  int32_t mode;   /* 0 or 1 (see the header comment) */
  int32_t dtype;  /* 1 f32, 2 f16, 3 bf16 */
  int32_t ctas;   /* 1..fvk_max_ctas() */
  int64_t B, S, H, D;
  int64_t planes_per_chunk, rows_per_chunk; /* clamped to B and S */
  /* The split tables (ABI 5; ABI 4 refuses non-null ones): P int64 each, every rank's sequence rows and every
     rank's head count, the same on every rank (null = even: S rows and H / P heads each). Shares are >= 0;
     seq_split's largest must be S, head_split's sum H. Read when the call is launched (a capture freezes them). */
  const int64_t* seq_split;
  const int64_t* head_split;
  /* FVK_CALL_DEBUG: device memory of 5 uint64 zeroed by the caller, the epoch checker's report. */
  void* debug_report;
} fvk_call;

/* The voted form's vote (fvk_launch with a non-null `vote`): the same-host shared-memory vote's handle
   and buffers in, the stage reached and the exchange's duration out. Built once per vote, reused. */
#define FVK_STAGE_REFUSED (-1)      /* refused before the exchange: this rank has not voted */
#define FVK_STAGE_EXCHANGE_FAILED 0 /* the exchange failed (the return code is the vote's) */
#define FVK_STAGE_NOT_LAUNCHED 1    /* exchanged, not launched: the caller decides from `votes` */
#define FVK_STAGE_LAUNCHED 2        /* launched (the return code is the launch's) */
typedef struct fvk_vote {
  uint32_t size;         /* sizeof(fvk_vote) */
  int32_t stage;         /* out: FVK_STAGE_* */
  void* handle;          /* fvk_vote_open's */
  const int64_t* fields; /* this rank's FVK_VOTE_FIELDS fields */
  int64_t* votes;        /* out: world x FVK_VOTE_FIELDS gathered fields, row r = rank r */
  int64_t timeout_ns;    /* the exchange's deadline */
  int64_t vote_ns;       /* out: the exchange's duration */
} fvk_vote;

/* Enqueues one call on `stream` (a cudaStream_t) and returns. Collective: every rank launches the same
   calls in the same order (the per-call vote guarantees it). x and out are this rank's operands; out
   never aliases x or the window; an empty one (an idle rank's share of 0) may be null.
   Checks of the call description and of agreed values (geometry, plan, window) fail alike on every rank
   and leave the context usable; a failure after them (local pointers, co-residency, a CUDA error) poisons
   the context (every later launch returns FVK_ERR_STATE): its peers may be waiting at its barriers.
   Calls are ordered on each rank: the library keeps its last stream and a completion event, and a call on
   another stream waits for the previous one.
   FVK_CALL_CAPTURE: `stream` must be capturing. Nothing runs and no host state changes; the call's ops go
   into the graph (the copy-engine kind's fork onto the context's copy stream and join back, its per-chunk
   events as graph edges) with graph-legal ordering: each replay waits for the last fused call before it
   (eager, or another replay: an external event-wait node on the completion event) and for the previous
   captured call of the same capture, and records that event when it completes; after a capture every
   eager call waits on it. Replays are collective like any launch: every rank replays the same graphs in
   the same order, and only while the context lives. Without the flag, the copy-engine kind refuses a
   capturing stream.
   vote (nullable): the voted form. fvk_vote_exchange, then, where fvk_vote_would_run, the launch. vote->stage
   says how far it went (FVK_STAGE_*): REFUSED for a bad call description or vote (a closed vote, a vote
   and a communicator of different sizes, a capture or debug flag: the voted form is eager and unchecked);
   a null `ctx` fails at LAUNCHED, so the decision can be tested without a GPU. Host-blocking for the
   exchange. */
FVK_API int fvk_launch(fvk_ctx* ctx, const fvk_call* call, const void* x, void* out, void* stream, fvk_vote* vote);

/* The original entry point (kept for older callers): fvk_launch of the SM kind with 36 CTAs, the whole
   operand as one chunk. */
FVK_API int fvk_a2a_original(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S,
                             int64_t H, int64_t D, void* stream);

/* ---- teardown ---- */
/* Collective: device comm, window deregistration, ncclMemFree, ncclCommDestroy; frees ctx. */
FVK_API int fvk_destroy(fvk_ctx* ctx);
/* Local, after a failed construction: ncclCommAbort and free whatever this rank holds; frees ctx. */
FVK_API int fvk_abort(fvk_ctx* ctx);

/* ---- same-host shared-memory vote (host only, shm_vote.cpp; protocol in that file) ---- */
/* Open (create = 1: the one creating rank, O_EXCL) the POSIX shm segment `name` ("/x") for `world` ranks. */
FVK_API int fvk_vote_open(const char* name, int world, int rank, int create, void** handle);
/* One call: publish 12 int64 `fields`, gather every rank's into out[world * 12] (row r = rank r).
   FVK_ERR_TIMEOUT after `timeout_ns`; FVK_ERR_PEER_GONE as soon as a waited-for peer's process no longer exists
   (every rank's pid is in the segment); any failure leaves the handle unusable for further exchanges. */
FVK_API int fvk_vote_exchange(void* handle, const int64_t* fields, int64_t* out, int64_t timeout_ns);
/* shm_unlink the segment's name (existing mappings stay valid): nothing leaks if the job dies. */
FVK_API int fvk_vote_unlink(void* handle);
/* Unmap and free the handle (unlink = 1 also unlinks the name); a closed handle is an error, not a crash. */
FVK_API int fvk_vote_close(void* handle, int unlink);

/* The vote's wire format (docs/ulysses_contract.md): fields per rank, and the two the verdict reads. */
#define FVK_VOTE_FIELDS 12
#define FVK_FIELD_ELIGIBILITY 2
#define FVK_FIELD_PLAN 11
/* 1 when the gathered votes[world * 12] say "run this rank's proposal": every rank's 12 fields equal
   `mine`, with no eligibility bit and a plan. That is the only case in which the contract's verdict runs
   a plan (contract.decide; every other table declines or raises on every rank), so a launch decided here
   is the launch the Python verdict would order. Host only. */
FVK_API int fvk_vote_would_run(const int64_t* votes, int world, const int64_t* mine);

#ifdef __cplusplus
}
#endif

#endif /* FASTVIDEO_ULYSSES_A2A_H_ */
