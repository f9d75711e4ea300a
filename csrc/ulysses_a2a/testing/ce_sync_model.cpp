// Host-side property check of the copy-engine plan kind's synchronisation (ce_plan.h).
//
// It replays ce_schedule() -- the function the launcher executes -- for a sequence of calls on every
// rank, each rank from its own Problem (so a rank whose shares are 0 runs its own, identical schedule and
// pushes nothing), builds the happens-before graph the CUDA semantics give those operations, and checks every
// pair of window accesses that touch the same bytes:
//   * stream order: the ops of one (rank, stream) in issue order; the caller's stream carries on
//     from call to call, and so does the context's copy stream;
//   * events: a wait follows the latest record of the same event issued before it (host issue
//     order), which is what cudaStreamWaitEvent captures; a wait on a never-recorded event orders
//     nothing;
//   * barriers: the k-th barrier of every rank pairs up (every rank issues the same schedule, checked);
//     each rank's arrival happens before every rank's departure;
//   * accesses, as byte ranges: push(c) by rank r writes, in every peer's window, what the launcher's own
//     copies (ce_push_copies) write there; copy-out(c) on rank w reads each source's block of chunk c from
//     buffer c % 2 (layout.h's block_bytes at ce_block_offset, what ce_copy_out_chunk reads). An empty
//     block is no access. Two accesses of the same bytes must be ordered in sequence order (a write before
//     the copy-out of its chunk, a copy-out before the next write of its bytes);
//   * addressing, against the all-to-all's definition: every push stays inside its own block (buffer c % 2,
//     its source), and moves exactly the bytes the call's shares define for that pair;
//   * containment: copy-stream work of a call happens after the caller's stream reached the call
//     (its input and output are ready) and before the call ends on the caller's stream.
// SM-kind calls (kind FVK_KIND_SM) between copy-engine calls: the fused kernel on the caller's stream,
// modelled at the granularity that matters across kinds. Its CTAs meet the peers' CTAs at LSA barriers
// before storing into the peers' windows and again before copying out, so the model has one barrier hub
// before the stores (every rank's arrival after its stream reached the call) and one after them; the
// stores may touch any byte of every peer's window, the copy-out any byte of the rank's own. Races among
// one SM call's own CTAs are sync_model.cu's (per-CTA barriers): pairs of accesses of the same SM call
// are not checked here.
// With kCeModelStreamPerCall, no stream carries on from call to call: each call's ops run on streams of
// their own (a CUDA-graph replay's branches, a call on another stream), ordered after the previous call
// only through the completion event the launchers record after the join and wait for before the fork
// (kCeDropDoneWait drops that wait: the negative control).
// No GPU: runs in CI, with negative controls that drop one ordering each (ce_plan.h's CeDrop), and the
// even-only layout (kEvenOnly) applied to uneven shares.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "../ce_plan.h"
#include "../error.h"
#include "ulysses_a2a_testing.h"

namespace fvk {

namespace {

struct Node {
  std::vector<int> out;  // happens-before successors
};

struct Access {
  int node, rank, window, call;
  int64_t lo, hi;  // window bytes [lo, hi)
  int64_t chunk;
  int src;  // the block's source rank (for messages; -1 for an SM-kind call)
  bool write;
  bool sm = false;  // an SM-kind call's access (any byte of the window)
};

// The all-to-all's definition of the bytes `src` sends `dst` in a chunk, from the call's own tables (not from
// layout.h): the chunk's rows of the sequence share they come from, the other rank's heads.
int64_t defined_block_bytes(const fvk_call& call, int world, const Chunk& ch, int src, int dst) {
  const int owner = call.mode == 0 ? src : dst, holder = call.mode == 0 ? dst : src;
  const int64_t seq = call.seq_split ? call.seq_split[owner] : call.S;
  const int64_t heads = call.head_split ? call.head_split[holder] : call.H / world;
  const int64_t end = ch.r0 + ch.nr < seq ? ch.r0 + ch.nr : seq, rows = end > ch.r0 ? end - ch.r0 : 0;
  return ch.np * rows * heads * call.D * itemsize_of(call.dtype);
}

class Graph {
 public:
  std::vector<Node> nodes;
  int add() {
    nodes.emplace_back();
    return static_cast<int>(nodes.size()) - 1;
  }
  void edge(int a, int b) {
    if (a >= 0 && b >= 0) nodes[a].out.push_back(b);
  }
  // reach[i] = nodes reachable from i (bitset), by a topological sweep.
  bool close() {
    const size_t n = nodes.size(), words = (n + 63) / 64;
    std::vector<int> indeg(n, 0), order;
    for (const Node& v : nodes)
      for (int w : v.out) ++indeg[w];
    for (size_t i = 0; i < n; ++i)
      if (!indeg[i]) order.push_back(static_cast<int>(i));
    for (size_t k = 0; k < order.size(); ++k)
      for (int w : nodes[order[k]].out)
        if (--indeg[w] == 0) order.push_back(w);
    if (order.size() != n) return false;  // a cycle: the schedule would deadlock
    reach_.assign(n * words, 0);
    words_ = words;
    for (size_t k = n; k-- > 0;) {
      const int v = order[k];
      for (int w : nodes[v].out) {
        uint64_t* dst = &reach_[v * words];
        const uint64_t* src = &reach_[w * words];
        for (size_t j = 0; j < words; ++j) dst[j] |= src[j];
        dst[w / 64] |= 1ull << (w % 64);
      }
    }
    return true;
  }
  bool before(int a, int b) const { return reach_[a * words_ + b / 64] >> (b % 64) & 1; }

 private:
  std::vector<uint64_t> reach_;
  size_t words_ = 0;
};

}  // namespace
}  // namespace fvk

using namespace fvk;

extern "C" int fvk_check_ce_sync(int world, int ncalls, const fvk_call* calls, int layout, unsigned drop,
                                 int64_t* violations, char* msg, int len) {
  if (!calls || !violations) return set_error(FVK_ERR_INVALID, "null calls or violations");
  if (world < 1 || world > kMaxWorld)
    return set_error(FVK_ERR_INVALID, "world size %d outside 1..%d", world, kMaxWorld);
  if (ncalls < 1 || ncalls > 16) return set_error(FVK_ERR_INVALID, "ncalls=%d outside 1..16", ncalls);
  if (layout != kStatic && layout != kEvenOnly)
    return set_error(FVK_ERR_INVALID, "layout %d is not FVK_LAYOUT_STATIC or FVK_LAYOUT_EVEN_ONLY", layout);
  if (drop > 255) return set_error(FVK_ERR_INVALID, "drop 0x%x has unknown bits", drop);
  std::vector<Problem> problems(ncalls);  // an SM-kind call's is unused (its accesses cover the whole window)
  for (int n = 0; n < ncalls; ++n) {
    if (calls[n].kind == FVK_KIND_SM) continue;
    if (calls[n].kind != FVK_KIND_CE)
      return set_error(FVK_ERR_INVALID, "call %d: kind %d is not FVK_KIND_CE or FVK_KIND_SM", n, calls[n].kind);
    const int status = make_problem(world, calls[n], kMaxCtas, SIZE_MAX / 4, problems[n], layout);
    if (status != FVK_OK) return status;
    if (num_chunks(problems[n]) > 256)
      return set_error(FVK_ERR_INVALID, "call %d: %lld chunks, the check takes up to 256", n,
                       (long long)num_chunks(problems[n]));
  }
  const bool per_call = drop & kCeModelStreamPerCall;
  const bool done_wait = per_call && !(drop & kCeDropDoneWait);
  const unsigned schedule_drop = drop & 31u;

  int64_t bad = 0;
  std::string first;
  auto fail = [&](const std::string& what) {
    if (bad++ == 0) first = what;
  };
  Graph g;
  std::vector<Access> acc;
  std::vector<int> barrier_hub;  // one node per barrier index, shared by all ranks
  std::vector<int> sm_hub;       // the same for the SM-kind calls' two barrier meetings
  std::vector<std::vector<int>> starts(world), ends(world);
  std::vector<std::vector<std::pair<int, int>>> copy_ops(world);  // (call, node) of copy-stream work
  std::vector<int> meetings(world);                               // barriers each rank issued
  for (int r = 0; r < world; ++r) {
    int last[2] = {-1, -1};  // last node per stream
    int recorded[kCeEvents];
    for (int& e : recorded) e = -1;
    int barriers = 0, sm_barriers = 0;
    auto on = [&](int stream, int node) {
      g.edge(last[stream], node);
      last[stream] = node;
    };
    // A barrier meeting on `stream`: this rank's arrival, the hub every rank's k-th meeting shares, departure.
    auto meet = [&](int stream, std::vector<int>& hubs, int& k) {
      const int arrive = g.add(), depart = g.add();
      on(stream, arrive);
      if (static_cast<int>(hubs.size()) <= k) hubs.push_back(g.add());
      const int hub = hubs[k++];
      g.edge(arrive, hub);
      g.edge(hub, depart);
      last[stream] = depart;  // no direct arrive -> depart edge: the hub carries it
    };
    for (int n = 0; n < ncalls; ++n) {
      if (per_call) {
        // Streams of the call's own: nothing carries on from the previous call but the completion event
        // (its `done`, recorded by the previous call's end, waited for before this call's fork).
        last[kMainStream] = last[kCopyStream] = -1;
      }
      const int start = g.add();  // the caller's stream reaches the call (input written, output allocated)
      on(kMainStream, start);
      if (done_wait && n > 0) g.edge(ends[r][n - 1], start);
      starts[r].push_back(start);
      if (calls[n].kind == FVK_KIND_SM) {
        if (!(drop & kCeDropSmEntryBarrier)) meet(kMainStream, sm_hub, sm_barriers);
        const int stores = g.add();
        on(kMainStream, stores);
        meet(kMainStream, sm_hub, sm_barriers);
        const int copy_out = g.add();
        on(kMainStream, copy_out);
        for (int q = 0; q < world; ++q) {
          if (q != r) acc.push_back(Access{stores, r, q, n, 0, INT64_MAX, -1, -1, true, true});
          if (q == r) acc.push_back(Access{copy_out, r, r, n, 0, INT64_MAX, -1, -1, false, true});
        }
        const int end = g.add();
        on(kMainStream, end);
        ends[r].push_back(end);
        continue;
      }
      Problem p = problems[n];
      p.rank = r;
      ce_schedule(num_chunks(p), schedule_drop, [&](const CeOp& op) {
        if (op.kind == kCeBarrier) {
          meet(op.stream, barrier_hub, barriers);
          return;
        }
        const int v = g.add();
        on(op.stream, v);
        if (op.kind == kCeRecord) recorded[op.event] = v;
        if (op.kind == kCeWait) g.edge(recorded[op.event], v);
        if (op.stream == kCopyStream) copy_ops[r].push_back({n, v});
        if (op.kind != kCePush && op.kind != kCeCopyOut) return;
        const Chunk ch = chunk_at(p, op.chunk);
        const int buffer = static_cast<int>(op.chunk % 2);
        const std::string where =
            "call " + std::to_string(n) + " chunk " + std::to_string(op.chunk) + " rank " + std::to_string(r);
        if (op.kind == kCePush) {
          // The launcher's own copies, gathered per peer: one access per peer, over the bytes they span.
          std::vector<int64_t> lo(world, INT64_MAX), hi(world, -1), moved(world, 0);
          const int64_t block = ce_block_offset(p, buffer, r), block_end = block + full_block_bytes(p);
          ce_push_copies(p, op.chunk, [&](const CeCopy& k) {
            const int64_t end = k.dst_offset + (k.rows - 1) * k.dst_pitch + k.width;
            if (k.dst_offset < block || end > block_end) fail("a push leaves its block: " + where);
            lo[k.peer] = lo[k.peer] < k.dst_offset ? lo[k.peer] : k.dst_offset;
            hi[k.peer] = hi[k.peer] > end ? hi[k.peer] : end;
            moved[k.peer] += k.rows * k.width;
          });
          for (int q = 0; q < world; ++q) {
            if (q == r) continue;
            const int64_t want = defined_block_bytes(calls[n], world, ch, r, q);
            if (moved[q] != want)
              fail("rank " + std::to_string(r) + " pushes " + std::to_string(moved[q]) + " bytes to rank " +
                   std::to_string(q) + " in call " + std::to_string(n) + " chunk " + std::to_string(op.chunk) +
                   ", the shares define " + std::to_string(want));
            if (moved[q]) acc.push_back(Access{v, r, q, n, lo[q], hi[q], op.chunk, r, true});
          }
        } else {
          for (int src = 0; src < world; ++src) {
            const int64_t bytes = src == r ? 0 : block_bytes(p, ch, src, r);
            const int64_t lo = ce_block_offset(p, buffer, src);
            if (bytes) acc.push_back(Access{v, r, r, n, lo, lo + bytes, op.chunk, src, false});
          }
        }
      });
      const int end = g.add();  // what the caller's stream runs after the call
      on(kMainStream, end);
      ends[r].push_back(end);
    }
    meetings[r] = barriers + sm_barriers;
  }
  for (int r = 1; r < world; ++r)
    if (meetings[r] != meetings[0])
      fail("rank " + std::to_string(r) + " meets " + std::to_string(meetings[r]) + " barriers, rank 0 " +
           std::to_string(meetings[0]) + ": they would pair with the wrong ones");
  if (!g.close()) {
    *violations = bad + 1;
    if (msg && len > 0) snprintf(msg, static_cast<size_t>(len), "the schedule's happens-before graph has a cycle");
    return FVK_OK;
  }
  auto describe = [](const Access& a) {
    char buf[160];
    if (a.sm)
      snprintf(buf, sizeof(buf), "call %d (SM kind) %s rank %d's window (by rank %d)", a.call,
               a.write ? "store into" : "copy-out of", a.window, a.rank);
    else
      snprintf(buf, sizeof(buf),
               "call %d chunk %lld %s of block %d, bytes [%lld, %lld) of rank %d's window (by rank %d)", a.call,
               static_cast<long long>(a.chunk), a.write ? "push" : "copy-out", a.src, static_cast<long long>(a.lo),
               static_cast<long long>(a.hi), a.window, a.rank);
    return std::string(buf);
  };
  for (size_t i = 0; i < acc.size(); ++i) {
    for (size_t j = i + 1; j < acc.size(); ++j) {
      const Access &a = acc[i], &b = acc[j];
      if (a.window != b.window || a.hi <= b.lo || b.hi <= a.lo || (!a.write && !b.write)) continue;
      if (a.sm && b.sm && a.call == b.call) continue;  // within one SM call: sync_model.cu's per-CTA check
      // Sequence order: (call, chunk), and within one chunk the push before its copy-out.
      const bool a_first = a.call != b.call ? a.call < b.call : a.chunk != b.chunk ? a.chunk < b.chunk : a.write;
      const Access& x = a_first ? a : b;
      const Access& y = a_first ? b : a;
      if (!g.before(x.node, y.node)) fail("unordered: " + describe(x) + " then " + describe(y));
    }
  }
  for (int r = 0; r < world; ++r)
    for (const auto& [n, v] : copy_ops[r]) {
      if (!g.before(starts[r][n], v))
        fail("rank " + std::to_string(r) + " call " + std::to_string(n) +
             ": copy-stream work may start before the caller's stream reached the call");
      if (!g.before(v, ends[r][n]))
        fail("rank " + std::to_string(r) + " call " + std::to_string(n) +
             ": copy-stream work may still run after the call ended on the caller's stream");
    }
  *violations = bad;
  if (msg && len > 0) snprintf(msg, static_cast<size_t>(len), "%s", first.c_str());
  return FVK_OK;
}
