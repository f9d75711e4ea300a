// Ulysses fused all-to-all on NCCL's device API: the kernels of both plan kinds and the one launch entry
// (fvk_launch, ulysses_a2a.h). The context's lifecycle is context.cu.
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
// Uneven shares change none of it: every rank runs the same chunks and barriers (num_chunks depends on B, S
// and the plan alone), so a rank with a share of 0 meets every barrier; regions are sized by the full block of
// the largest shares, which bounds every pair's block, so a pair's slices stay in their regions.
// Preconditions the argument needs: (a) every rank issues the same sequence of launches on this
// context (the vote guarantees it; a launch that fails on one rank after its checks poisons the
// context, so that rank never launches again and its peers' watchdog ends them); (b) a rank's
// launches run in issue order (one stream, or order_call's event wait when the stream changes; with
// captured graphs, the completion event's external wait and record nodes: FVK_CALL_CAPTURE);
// (c) no programmatic dependent launch.
// testing/sync_model.cu checks this argument as a happens-before property over the plan space, on run_call
// itself (movement.cuh, compiled for the host); its negative controls are the pre-fix layout (regions that
// moved with the chunk size: wrong on the first 2-GPU run, docs/kernel.md), the even-only layout (the split
// tables ignored) and loops without one of the barriers.
#include <cstring>
#include <ctime>
#include <initializer_list>

#include "context.h"
#include "lsa_env.cuh"

namespace fvk {

const SmVariant* g_debug_variant = nullptr;  // set by the test library when it loads (testing/checked_launch.cu)

int itemsize_of(int dtype) {
  switch (dtype) {
    case 1: return 4;  // float32
    case 2: return 2;  // float16
    case 3: return 2;  // bfloat16
    default: return 0;
  }
}

namespace {

// One split table of a call (null: the even one): P non-negative shares; the largest sequence share must be
// call.S (the chunks' row extent) and the head shares must sum to call.H.
int check_table(const char* name, const int64_t* table, int world, int64_t want, bool largest) {
  if (!table) return FVK_OK;
  int64_t total = 0, most = 0;
  for (int q = 0; q < world; ++q) {
    if (table[q] < 0)
      return set_error(FVK_ERR_INVALID, "fvk_call.%s[%d] = %lld is negative (a share of 0 is an idle rank)", name, q,
                       (long long)table[q]);
    if (__builtin_add_overflow(total, table[q], &total))
      return set_error(FVK_ERR_INVALID, "fvk_call.%s overflows a 64-bit sum", name);
    most = table[q] > most ? table[q] : most;
  }
  if ((largest ? most : total) != want)
    return set_error(FVK_ERR_INVALID, "fvk_call.%s has %s %lld, the call's %s is %lld", name,
                     largest ? "a largest share of" : "shares summing to", (long long)(largest ? most : total),
                     largest ? "S (the largest sequence share)" : "H (every head)", (long long)want);
  return FVK_OK;
}

bool product_overflows(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (const int64_t f : factors)
    if (__builtin_mul_overflow(product, f, &product)) return true;
  return false;
}

}  // namespace

// Checks a call's geometry, split tables and plan, and fills the rank-independent part of `p`.
int make_problem(int world, const fvk_call& call, int max_ctas, size_t window_bytes, Problem& p, int layout) {
  const int64_t B = call.B, S = call.S, H = call.H, D = call.D;
  const int itemsize = itemsize_of(call.dtype);
  if (itemsize == 0) return set_error(FVK_ERR_INVALID, "dtype code %d is not 1 (f32), 2 (f16) or 3 (bf16)", call.dtype);
  if (world < 1 || world > kMaxWorld)
    return set_error(FVK_ERR_INVALID, "world size %d outside 1..%d", world, kMaxWorld);
  if (call.mode != 0 && call.mode != 1) return set_error(FVK_ERR_INVALID, "mode %d is not 0 or 1", call.mode);
  if (B < 1 || S < 1 || H < 1 || D < 1 || (!call.head_split && H % world))
    return set_error(FVK_ERR_INVALID, "geometry B=%lld S=%lld H=%lld D=%lld invalid for world size %d%s", (long long)B,
                     (long long)S, (long long)H, (long long)D, world,
                     call.head_split ? "" : " (no head_split table: H must divide evenly)");
  FVK_TRY(check_table("seq_split", call.seq_split, world, S, true));
  FVK_TRY(check_table("head_split", call.head_split, world, H, false));
  if (call.ctas < 1 || call.ctas > max_ctas)
    return set_error(FVK_ERR_INVALID, "ctas=%d outside 1..%d", call.ctas, max_ctas);
  if (call.planes_per_chunk < 1 || call.rows_per_chunk < 1)
    return set_error(FVK_ERR_INVALID, "planes_per_chunk=%lld rows_per_chunk=%lld must be >= 1",
                     (long long)call.planes_per_chunk, (long long)call.rows_per_chunk);
  // Every product below in int64 without overflow (a wrapped product could pass the window check): the whole
  // sequence of every head bounds every rank's operands (no share exceeds S), P full chunks of every head bound
  // the window's blocks.
  const int64_t planes = call.planes_per_chunk < B ? call.planes_per_chunk : B,
                chunk_rows = call.rows_per_chunk < S ? call.rows_per_chunk : S;
  if (product_overflows({B, S, world, H, D, itemsize}) ||
      product_overflows({planes, chunk_rows, world, H, D, itemsize}))
    return set_error(FVK_ERR_INVALID, "geometry B=%lld S=%lld H=%lld D=%lld overflows 64-bit byte counts", (long long)B,
                     (long long)S, (long long)H, (long long)D);
  p = plan_problem(world, call.mode, itemsize, B, S, H, D, call.seq_split, call.head_split, call.planes_per_chunk,
                   call.rows_per_chunk, layout);
  const int64_t chunk_bytes = window_need(p);
  if (static_cast<uint64_t>(chunk_bytes) > window_bytes)
    return set_error(FVK_ERR_INVALID, "a chunk needs %lld window bytes, the window has %zu", (long long)chunk_bytes,
                     window_bytes);
  // copy_units counts the units of one block in 32 bits (with headroom for its loop stride, so
  // below 2^31); the smallest unit is 2 bytes.
  if (full_block_bytes(p) / 2 > static_cast<int64_t>(INT32_MAX))
    return set_error(FVK_ERR_INVALID, "a chunk of %lld bytes per peer exceeds the kernel's 32-bit unit index",
                     (long long)full_block_bytes(p));
  return FVK_OK;
}

namespace {

constexpr int kOriginalCtas = 36;

// Whether two byte ranges share a byte (an empty range shares none: an idle rank's empty operand may be null).
bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const char *pa = static_cast<const char*>(a), *pb = static_cast<const char*>(b);
  return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

// ---------------------------------------------------------------------------------- the fused kernel (SM kind)

// __grid_constant__: the kernels index the split tables with a peer number, and a grid constant is addressed in
// place (no per-thread copy of the Problem).
template <typename V>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    fused_a2a_kernel(const __grid_constant__ Problem p, ncclWindow_t window, ncclDevComm dev_comm) {
  run_on_lsa<V, LsaEnv>(p, window, dev_comm);
}

// ---------------------------------------------------------------------------------- the copy-engine plan kind

// ce_plan.h has the schedule; these are its device pieces (their bodies are movement.cuh's). The transfer itself
// is cudaMemcpy2DAsync.

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

// Chunk `ci` of the own block, input -> output (it never crosses the fabric).
template <typename V>
__global__ void __launch_bounds__(kThreads) ce_local_kernel(const __grid_constant__ Problem p, int64_t ci) {
  OnDevice env;
  ce_own_chunk<V>(p, ci, blockIdx.x, gridDim.x, env);
}

// Chunk `ci`: every peer's block from buffer ci % 2 of this rank's window into the output.
template <typename V>
__global__ void __launch_bounds__(kThreads)
    ce_copy_out_kernel(const __grid_constant__ Problem p, int64_t ci, char* window) {
  OnDevice env;
  ce_copy_out_chunk<V>(p, ci, window, blockIdx.x, gridDim.x, env);
}

template <typename V>
int occupancy(int device, int& blocks) {
  int sms = 0, per_sm = 0;
  FVK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  FVK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fused_a2a_kernel<V>, kThreads, 0));
  blocks = per_sm * sms;
  return FVK_OK;
}

}  // namespace

// ---------------------------------------------------------------------------------- the launch path's pieces

int vector_bytes(const Problem& p, const void* const* extra, int n_extra) {
  uint64_t bits =
      reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.out) | static_cast<uint64_t>(p.granule);
  for (int i = 0; i < n_extra; ++i) bits |= reinterpret_cast<uintptr_t>(extra[i]);
  return static_cast<int>(pow2_divisor(bits));
}

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

// The context is shared state all ranks built together, so these fail alike on every rank.
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

// The eager copy-engine kind and the test library's fabric copy refuse a capturing stream. Every rank agrees on
// capturing (the vote's WINDOW_BYTES carries it), so this fails alike everywhere.
int refuse_capture(cudaStream_t s, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FVK_CUDA(cudaStreamIsCapturing(s, &status));
  if (status != cudaStreamCaptureStatusNone)
    return set_error(FVK_ERR_STATE, "%s cannot be captured into a CUDA graph (the stream is capturing)", what);
  return FVK_OK;
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

int enqueue_barrier(const fvk_ctx& ctx, cudaStream_t s) {
  ce_barrier_kernel<<<1, 32, 0, s>>>(ctx.dev_comm);
  FVK_CUDA(cudaGetLastError());
  return FVK_OK;
}

namespace {

// The captured form needs a capturing stream: checked before anything is enqueued, so that a misuse (agreed on
// every rank: the vote carries the capture bit) leaves the context usable.
int require_capture(cudaStream_t s, const char* what) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FVK_CUDA(cudaStreamIsCapturing(s, &status));
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

// This rank's operands into `p`, and the widest vector every pointer allows. It fails on one rank alone
// (local pointers), after every rank agreed to run the call: the callers poison the context then. An empty
// operand (an idle rank's share of 0) may be null: nothing reads or writes it.
int bind_operands(const fvk_ctx* ctx, Problem& p, const void* x, void* out, int& vec) {
  const int64_t in_bytes = input_bytes(p, ctx->rank), out_bytes = output_bytes(p, ctx->rank);
  if ((!x && in_bytes) || (!out && out_bytes)) return set_error(FVK_ERR_INVALID, "null input or output");
  if (overlaps(out, out_bytes, ctx->buffer, ctx->bytes) || overlaps(x, in_bytes, ctx->buffer, ctx->bytes))
    return set_error(FVK_ERR_INVALID, "input or output aliases the communication window");
  if (overlaps(out, out_bytes, x, in_bytes)) return set_error(FVK_ERR_INVALID, "output aliases the input");
  p.x = static_cast<const char*>(x);
  p.out = static_cast<char*>(out);
  p.rank = ctx->rank;
  const void* window = ctx->buffer;
  vec = vector_bytes(p, &window, 1);
  if (vec < p.itemsize) return set_error(FVK_ERR_INVALID, "input or output is not aligned to its element size");
  return FVK_OK;
}

int enqueue_fused(const fvk_ctx& ctx, const Problem& p, int vec, int ctas, cudaStream_t s) {
  switch (vec) {
    case 16: fused_a2a_kernel<uint4><<<ctas, kThreads, 0, s>>>(p, ctx.window, ctx.dev_comm); break;
    case 8: fused_a2a_kernel<uint2><<<ctas, kThreads, 0, s>>>(p, ctx.window, ctx.dev_comm); break;
    case 4: fused_a2a_kernel<uint32_t><<<ctas, kThreads, 0, s>>>(p, ctx.window, ctx.dev_comm); break;
    default: fused_a2a_kernel<uint16_t><<<ctas, kThreads, 0, s>>>(p, ctx.window, ctx.dev_comm); break;
  }
  FVK_CUDA(cudaGetLastError());
  return FVK_OK;
}

// The part of an SM-kind launch that can fail on one rank alone (local pointers, the device, CUDA errors):
// its peers, which passed the same vote, may already be waiting at its barriers.
int sm_local(fvk_ctx* ctx, Problem& p, const void* x, void* out, const fvk_call& call, const SmVariant* variant,
             cudaStream_t s) {
  // Spinning CTAs wait for the same CTA index on peers: a CTA that cannot become resident while
  // others spin would deadlock every rank, so refuse such launches instead.
  if (call.ctas > ctx->coresident)
    return set_error(FVK_ERR_NOT_CORESIDENT, "ctas=%d exceeds the %d CTAs this device can hold at once", call.ctas,
                     ctx->coresident);
  int vec = 0;
  FVK_TRY(bind_operands(ctx, p, x, out, vec));
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  const bool capture = call.flags & FVK_CALL_CAPTURE;
  unsigned long long capture_id = 0;
  FVK_TRY(order_call(ctx, s, capture, capture_id));
  FVK_TRY(variant ? variant->enqueue(*ctx, p, vec, call, s) : enqueue_fused(*ctx, p, vec, call.ctas, s));
  return finish_call(ctx, s, capture, capture_id);
}

// One SM-kind call: the production kernel, or with FVK_CALL_DEBUG the test library's variant. Checks of agreed
// values (geometry, plan, window) fail identically on every rank and leave the context usable; a failure
// after them poisons it.
int launch_sm(fvk_ctx* ctx, const fvk_call& call, const void* x, void* out, cudaStream_t s) {
  const SmVariant* variant = nullptr;
  if (call.flags & FVK_CALL_DEBUG) {
    variant = g_debug_variant;
    if (!variant)
      return set_error(FVK_ERR_INVALID,
                       "FVK_CALL_DEBUG: the epoch-checked launch is in the test library "
                       "(libfastvideo_ulysses_a2a_testing.so, csrc/ulysses_a2a/testing/), not in this product "
                       "library");
  }
  FVK_TRY(check_context(ctx, false));
  if (call.flags & FVK_CALL_CAPTURE) FVK_TRY(require_capture(s, "a captured launch (FVK_CALL_CAPTURE)"));
  Problem p;
  FVK_TRY(make_problem(ctx->nranks, call, kMaxCtas, ctx->bytes, p, variant ? variant->layout(call) : kStatic));
  if (variant) FVK_TRY(variant->check(*ctx, p, call));
  const int rc = sm_local(ctx, p, x, out, call, variant, s);
  if (rc != FVK_OK) ctx->poisoned = "a fused launch that failed on this rank after every rank agreed to run it";
  return rc;
}

template <typename V>
cudaError_t launch_ce_kernel(int kind, int ctas, cudaStream_t s, const Problem& p, int64_t chunk, char* window) {
  if (kind == kCeLocal)
    ce_local_kernel<V><<<ctas, kThreads, 0, s>>>(p, chunk);
  else
    ce_copy_out_kernel<V><<<ctas, kThreads, 0, s>>>(p, chunk, window);
  return cudaGetLastError();
}

cudaError_t launch_ce_kernel(int vec, int kind, int ctas, cudaStream_t s, const Problem& p, int64_t chunk,
                             char* window) {
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
// Captured: the same ops into the graph `s` is capturing. The fork pulls the copy stream into the capture and
// the join returns it, so the graph holds both streams' ops with the schedule's edges; the per-chunk events
// become edges of the graph (a record inside a capture is no event-record node), and the call is ordered
// against eager calls and other replays by order_call and finish_call's external event nodes, as the fused
// kernel's captured launch is.
int ce_local(fvk_ctx* ctx, Problem& p, const void* x, void* out, int ctas, cudaStream_t s, bool capture) {
  int vec = 0;
  FVK_TRY(bind_operands(ctx, p, x, out, vec));
  DeviceGuard guard;
  FVK_TRY(guard.set(ctx->device));
  unsigned long long capture_id = 0;
  FVK_TRY(order_call(ctx, s, capture, capture_id));
  cudaError_t e = cudaSuccess;
  const char* what = "copy-engine call";
  bool forked = false;  // the copy stream waits for this call: from here on a failure must join it back
  ce_schedule(num_chunks(p), kCeDropNone, [&](const CeOp& op) {
    if (e != cudaSuccess) return;
    const cudaStream_t on = op.stream == kMainStream ? s : ctx->copy_stream;
    switch (op.kind) {
      case kCeRecord:
        what = "copy-engine call: cudaEventRecord";
        e = cudaEventRecord(ctx->ce_events[op.event], on);
        break;
      case kCeWait:
        what = "copy-engine call: cudaStreamWaitEvent";
        e = cudaStreamWaitEvent(on, ctx->ce_events[op.event], 0);
        if (e == cudaSuccess && op.stream == kCopyStream && op.event == kEvFork) forked = true;
        break;
      case kCeBarrier:
        what = "copy-engine call: barrier launch";
        ce_barrier_kernel<<<1, 32, 0, on>>>(ctx->dev_comm);
        e = cudaGetLastError();
        break;
      case kCePush:
        what = "copy-engine call: cudaMemcpy2DAsync into a peer's window";
        e = ce_push(ctx, p, op.chunk, on);
        break;
      case kCeLocal:
      case kCeCopyOut:
        what = op.kind == kCeLocal ? "copy-engine call: own-block launch" : "copy-engine call: copy-out launch";
        e = launch_ce_kernel(vec, op.kind, ctas, on, p, op.chunk, static_cast<char*>(ctx->buffer));
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
    return cuda_error(e, what);
  }
  return finish_call(ctx, s, capture, capture_id);
}

// One call of the copy-engine plan kind. Checks of agreed values (geometry, plan, window) fail identically on
// every rank and leave the context usable; a failure after them poisons it, as for the fused kernel.
int launch_ce(fvk_ctx* ctx, const fvk_call& call, const void* x, void* out, cudaStream_t s) {
  const bool capture = call.flags & FVK_CALL_CAPTURE;
  FVK_TRY(check_context(ctx, true));
  if (capture)
    FVK_TRY(require_capture(s, "a captured copy-engine call (FVK_CALL_CAPTURE)"));
  else
    FVK_TRY(refuse_capture(s, "an eager copy-engine call (capture it with FVK_CALL_CAPTURE)"));
  FVK_TRY(check_copy_stream(ctx, s, capture));
  Problem p;
  // Two buffers: each chunk must fit half the window.
  FVK_TRY(make_problem(ctx->nranks, call, kMaxCtas, ctx->bytes / 2, p, kStatic));
  const int rc = ce_local(ctx, p, x, out, call.ctas, s, capture);
  if (rc != FVK_OK) ctx->poisoned = "a copy-engine call that failed on this rank after every rank agreed to run it";
  return rc;
}

// ---------------------------------------------------------------------------------- the call description

constexpr size_t kCallSizeAbi4 = 96;  // sizeof(fvk_call) in ABI 4, the first ABI with fvk_call
static_assert(sizeof(fvk_call) == kCallSizeAbi4, "fvk_call grows by appending fields (and the size checks below)");
constexpr unsigned kKnownFlags = FVK_CALL_CAPTURE | FVK_CALL_DEBUG | FVK_CALL_DEBUG_MOVING_LAYOUT;

// The caller's call description into `call`, checked for everything that needs no context. A caller compiled
// against an older fvk_call (a smaller size) reads as zeros past its size; one compiled against a newer one
// is refused if it sets a field this build does not know.
int read_call(const fvk_call* in, fvk_call& call) {
  if (!in) return set_error(FVK_ERR_INVALID, "null call description (fvk_call)");
  if (in->size < kCallSizeAbi4)
    return set_error(FVK_ERR_INVALID, "fvk_call.size %u is smaller than any fvk_call (%zu): set it to sizeof(fvk_call)",
                     in->size, kCallSizeAbi4);
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(in);
  for (size_t i = sizeof(fvk_call); i < in->size; ++i)
    if (bytes[i])
      return set_error(FVK_ERR_INVALID,
                       "fvk_call sets a field at byte %zu, past the %zu bytes this library knows: a newer caller needs "
                       "a newer library",
                       i, sizeof(fvk_call));
  memset(&call, 0, sizeof(call));
  memcpy(&call, in, in->size < sizeof(call) ? in->size : sizeof(call));
  if (call.kind != FVK_KIND_SM && call.kind != FVK_KIND_CE)
    return set_error(FVK_ERR_INVALID, "fvk_call.kind %d is not FVK_KIND_SM (0) or FVK_KIND_CE (1)", call.kind);
  if (call.flags & ~kKnownFlags) return set_error(FVK_ERR_INVALID, "fvk_call.flags 0x%x has unknown bits", call.flags);
  if ((call.flags & FVK_CALL_DEBUG_MOVING_LAYOUT) && !(call.flags & FVK_CALL_DEBUG))
    return set_error(FVK_ERR_INVALID, "FVK_CALL_DEBUG_MOVING_LAYOUT needs FVK_CALL_DEBUG");
  if ((call.flags & FVK_CALL_DEBUG) && (call.kind != FVK_KIND_SM || (call.flags & FVK_CALL_CAPTURE)))
    return set_error(FVK_ERR_INVALID, "FVK_CALL_DEBUG is an eager SM-kind launch (kind %d, flags 0x%x)", call.kind,
                     call.flags);
  return FVK_OK;
}

int launch(fvk_ctx* ctx, const fvk_call& call, const void* x, void* out, cudaStream_t s) {
  return call.kind == FVK_KIND_CE ? launch_ce(ctx, call, x, out, s) : launch_sm(ctx, call, x, out, s);
}

// The voted form: the exchange, the library's verdict (fvk_vote_would_run), and the launch where it says run.
int voted_launch(fvk_ctx* ctx, const fvk_call* in, const void* x, void* out, cudaStream_t s, fvk_vote* vote) {
  if (vote->size < sizeof(fvk_vote))
    return set_error(FVK_ERR_INVALID, "fvk_vote.size %u is smaller than fvk_vote (%zu): set it to sizeof(fvk_vote)",
                     vote->size, sizeof(fvk_vote));
  vote->stage = FVK_STAGE_REFUSED;  // refused before the exchange: this rank has not voted
  vote->vote_ns = 0;
  fvk_call call;
  FVK_TRY(read_call(in, call));
  if (call.flags & (FVK_CALL_CAPTURE | FVK_CALL_DEBUG))
    return set_error(FVK_ERR_INVALID, "the voted launch is eager and unchecked: fvk_call.flags 0x%x", call.flags);
  const int world = vote_world(vote->handle);
  if (world < 1) return set_error(FVK_ERR_STATE, "vote handle %p is not open", vote->handle);
  if (ctx && ctx->nranks != world)
    return set_error(FVK_ERR_INVALID, "the vote has %d ranks, the communicator %d", world, ctx->nranks);
  vote->stage = FVK_STAGE_EXCHANGE_FAILED;
  timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  const int rc = fvk_vote_exchange(vote->handle, vote->fields, vote->votes, vote->timeout_ns);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  vote->vote_ns = (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
  if (rc != FVK_OK) return rc;
  vote->stage = FVK_STAGE_NOT_LAUNCHED;
  if (!fvk_vote_would_run(vote->votes, world, vote->fields)) return FVK_OK;
  vote->stage = FVK_STAGE_LAUNCHED;
  if (!ctx) return set_error(FVK_ERR_INVALID, "null context (the vote said run)");
  return launch(ctx, call, x, out, s);
}

}  // namespace
}  // namespace fvk

using namespace fvk;

extern "C" {

int fvk_launch(fvk_ctx* ctx, const fvk_call* call, const void* x, void* out, void* stream, fvk_vote* vote) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (vote) return voted_launch(ctx, call, x, out, s, vote);
  fvk_call checked;
  FVK_TRY(read_call(call, checked));
  return launch(ctx, checked, x, out, s);
}

int fvk_a2a_original(fvk_ctx* ctx, const void* x, void* out, int mode, int dtype, int64_t B, int64_t S, int64_t H,
                     int64_t D, void* stream) {
  // size, flags, kind, mode, dtype, ctas, B, S, H, D, planes and rows per chunk (the whole operand), no splits.
  const fvk_call call{sizeof(fvk_call), 0,       FVK_KIND_SM, mode, dtype, kOriginalCtas, B, S, H, D, B, S,
                      nullptr,          nullptr, nullptr};
  return launch(ctx, call, x, out, static_cast<cudaStream_t>(stream));
}

int fvk_vote_would_run(const int64_t* votes, int world, const int64_t* mine) {
  if (!votes || !mine || world < 1) return 0;
  if (mine[FVK_FIELD_ELIGIBILITY] != 0 || mine[FVK_FIELD_PLAN] == 0) return 0;
  for (int r = 0; r < world; ++r)
    for (int f = 0; f < FVK_VOTE_FIELDS; ++f)
      if (votes[static_cast<int64_t>(r) * FVK_VOTE_FIELDS + f] != mine[f]) return 0;
  return 1;
}

}  // extern "C"
