// Host-side property check of the fused kernel's synchronisation argument (ulysses_a2a.cu header).
//
// It runs the kernel body itself (movement.cuh's run_call) for every rank and CTA of a sequence of calls on
// the host, with an Env that records every window access the body makes and every barrier point it reaches
// (nothing is moved: the windows are disjoint fake address ranges the Env decodes), and checks that every
// pair of conflicting accesses (same window bytes, at least one a store) is ordered by happens-before as the
// kernel's structure defines it:
//   * per-CTA barriers: accesses of the same CTA index in different barrier intervals of one call
//     are ordered (barrier k+1 on slot i needs every rank's CTA i to have finished interval k);
//     accesses of different CTA indices in one call are never ordered (no grid-wide barrier), nor
//     are two accesses of one CTA index in the same interval on different ranks;
//   * stream order between calls: call n+1 starts on a rank after call n ended there, and an access
//     of call n+1 that follows at least one barrier of its call follows every rank's call n (that
//     barrier needs the same CTA index of every rank to have started call n+1).
// Besides races it checks the addressing against the all-to-all's definition: the CTA slices of the block
// each rank sends each rank tile exactly the block the call's shares define (its rows clipped to the share
// they come from, the other rank's heads), every access stays inside its CTA's region (the kernels' layout)
// and nothing falls outside the window. (That a copy-out lands the bytes its store wrote is the addressing
// check's job, addressing.cu, and the simulated ranks'.) No GPU: runs in CI.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <queue>
#include <string>
#include <vector>

#include "../error.h"
#include "../movement.cuh"
#include "ulysses_a2a_testing.h"

namespace fvk {

namespace {

struct Access {
  int64_t lo, hi;          // window bytes [lo, hi) of the receiving rank's window
  int call, rank, cta, k;  // k: the last barrier this access follows in its call (-1: none)
  bool store;
  int64_t chunk;
};

// Happens-before in either direction, from the kernel's structure (see the file comment).
bool ordered(const Access& a, const Access& b) {
  if (a.call != b.call) {
    const Access& later = a.call > b.call ? a : b;
    return a.rank == b.rank || later.k >= 0;
  }
  return a.cta == b.cta && a.k != b.k;
}

std::string describe(const Access& a) {
  char buf[160];
  snprintf(buf, sizeof(buf), "call %d chunk %lld %s by rank %d CTA %d after barrier %d, bytes [%lld, %lld)", a.call,
           static_cast<long long>(a.chunk), a.store ? "store" : "copy-out", a.rank, a.cta, a.k,
           static_cast<long long>(a.lo), static_cast<long long>(a.hi));
  return buf;
}

// The windows as the recording Env hands them out: rank q's at (q + 1) << kWindowShift, never dereferenced.
constexpr int kWindowShift = 40;
char* fake_window(int q) {
  return reinterpret_cast<char*>(static_cast<uintptr_t>(q + 1) << kWindowShift);
}

class Checker {
 public:
  int64_t violations = 0;
  std::string first;
  std::vector<std::vector<Access>> accesses;  // per receiving window
  int call_ctas = 1;                          // the CTA count of the call being recorded

  void fail(const std::string& what) {
    if (violations++ == 0) first = what;
  }

  // Where an access falls: the window and its offset, with the checks every access must pass.
  void record(const Problem& p, int window, int64_t lo, int64_t hi, const Access& a, size_t window_bytes) {
    if (window < 0 || window >= p.world || lo < 0 || hi > static_cast<int64_t>(window_bytes)) {
      fail("outside the window: " + describe(a) + " in window " + std::to_string(window) + " of " +
           std::to_string(window_bytes) + " bytes");
      return;
    }
    if (p.layout != kMoving) {  // the kernels' layout: every access inside region `cta` of one source block
      const int64_t full = full_block_bytes(p), src = lo / full;
      const Span r = cta_region(p, static_cast<int>(src), a.cta, call_ctas);
      if (lo < r.start || hi > r.start + r.size) fail("a slice leaves its CTA's region: " + describe(a));
    }
    Access x = a;
    x.lo = lo;
    x.hi = hi;
    accesses[window].push_back(x);
  }

  // The slices of the block `src` sends `dst` in chunk c, over all CTAs, must tile [0, the block the call's
  // shares define) in CTA order.
  void tiles(const Problem& p, const fvk_call& call, const Chunk& ch, int64_t c, int src, int dst, int n) {
    int64_t next = 0;
    for (int i = 0; i < call.ctas; ++i) {
      const Slice s = cta_slice(p, ch, src, dst, i, call.ctas);
      if (s.first != next || s.bytes < 0) {
        fail("CTA slices do not tile the block: call " + std::to_string(n) + " chunk " + std::to_string(c) + " CTA " +
             std::to_string(i) + " rank " + std::to_string(src) + " to " + std::to_string(dst));
        return;
      }
      next += s.bytes;
    }
    const int64_t want = defined_block_bytes(call, p.world, ch, src, dst);
    if (next != want)
      fail("CTA slices cover " + std::to_string(next) + " of the " + std::to_string(want) + " bytes rank " +
           std::to_string(src) + " sends rank " + std::to_string(dst) + " in call " + std::to_string(n) + " chunk " +
           std::to_string(c));
  }

  // Sweep by start offset: every overlapping pair is seen when its later-starting access arrives,
  // against the accesses still active there. The active set is summarised by counters over the
  // fields `ordered` looks at, so each arrival costs O(calls) however many chunks reuse a region;
  // the active set is scanned only to describe the first violation.
  void races(std::vector<Access>& acc, int w) {
    std::sort(acc.begin(), acc.end(), [](const Access& a, const Access& b) { return a.lo < b.lo; });
    int calls = 0, ctas = 0, ks = 0, ranks = 0;
    for (const Access& a : acc) {
      calls = std::max(calls, a.call + 1);
      ctas = std::max(ctas, a.cta + 1);
      ks = std::max(ks, a.k + 2);  // k + 1 indexes, k = -1 included
      ranks = std::max(ranks, a.rank + 1);
    }
    // [kind: 0 any, 1 store] per call; per (call, cta); per (call, cta, k); per (call, rank) overall
    // and for accesses before any barrier of their call (k == -1).
    using Counts = std::vector<int64_t>;
    Counts call_n(2 * calls), cta_n(2 * calls * ctas), k_n(2 * static_cast<size_t>(calls) * ctas * ks),
        rank_n(2 * calls * ranks), first_n(2 * calls * ranks);
    auto update = [&](const Access& a, int d) {
      for (int s = 0; s <= (a.store ? 1 : 0); ++s) {
        call_n[2 * a.call + s] += d;
        cta_n[2 * (a.call * ctas + a.cta) + s] += d;
        k_n[2 * ((static_cast<size_t>(a.call) * ctas + a.cta) * ks + a.k + 1) + s] += d;
        rank_n[2 * (a.call * ranks + a.rank) + s] += d;
        if (a.k < 0) first_n[2 * (a.call * ranks + a.rank) + s] += d;
      }
    };
    using Ending = std::pair<int64_t, size_t>;
    std::priority_queue<Ending, std::vector<Ending>, std::greater<Ending>> ending;
    for (size_t xi = 0; xi < acc.size(); ++xi) {
      const Access& x = acc[xi];
      while (!ending.empty() && ending.top().first <= x.lo) {
        update(acc[ending.top().second], -1);
        ending.pop();
      }
      const int s = x.store ? 0 : 1;  // a load conflicts with stores only, a store with anything
      int64_t bad = 0;
      // Same call: another CTA index, or the same CTA index in the same barrier interval.
      bad += call_n[2 * x.call + s] - cta_n[2 * (x.call * ctas + x.cta) + s];
      bad += k_n[2 * ((static_cast<size_t>(x.call) * ctas + x.cta) * ks + x.k + 1) + s];
      // Other calls: unordered when on another rank and the later access follows no barrier.
      for (int m = 0; m < calls; ++m) {
        if (m == x.call) continue;
        const Counts& later_first = (m > x.call) ? first_n : rank_n;  // which side must have k == -1
        if (m < x.call && x.k >= 0) continue;
        int64_t others = 0;
        for (int r = 0; r < ranks; ++r)
          if (r != x.rank) others += later_first[2 * (m * ranks + r) + s];
        bad += others;
      }
      if (bad) {
        if (violations == 0) {
          for (size_t yi = 0; yi < xi && first.empty(); ++yi) {
            const Access& y = acc[yi];
            if (y.hi > x.lo && (x.store || y.store) && !ordered(x, y))
              first = "race in rank " + std::to_string(w) + "'s window: " + describe(y) + " vs " + describe(x);
          }
        }
        violations += bad;
      }
      update(x, +1);
      ending.push({x.hi, xi});
    }
  }

  // The all-to-all's definition of the bytes `src` sends `dst` in a chunk, from the call's own tables (not from
  // layout.h): the chunk's rows of the sequence share they come from, the other rank's heads.
  static int64_t defined_block_bytes(const fvk_call& call, int world, const Chunk& ch, int src, int dst) {
    const int owner = call.mode == 0 ? src : dst, holder = call.mode == 0 ? dst : src;
    const int64_t seq = call.seq_split ? call.seq_split[owner] : call.S;
    const int64_t heads = call.head_split ? call.head_split[holder] : call.H / world;
    const int64_t end = std::min(ch.r0 + ch.nr, seq), rows = std::max<int64_t>(0, end - ch.r0);
    return ch.np * rows * heads * call.D * itemsize_of(call.dtype);
  }
};

// The kernel body's Env on the host: records the window ranges of its stores and copy-outs and counts its
// barriers (run_call's two per chunk, less the ones a negative-control schedule drops).
struct RecordingEnv {
  static constexpr bool kHost = true;
  static constexpr bool kCheck = false;
  static constexpr bool kAnyLayout = true;
  Checker* checker;
  const Problem* p;
  size_t window_bytes;
  int call, rank, cta, schedule;
  int syncs = 0, k = -1;

  char* window(int peer) const { return fake_window(peer); }

  void sync() {
    const bool entry = syncs % 2 == 0, first_chunk = syncs < 2;
    ++syncs;
    const bool dropped = (schedule == FVK_SYNC_NO_ENTRY && entry) ||
                         (schedule == FVK_SYNC_NO_FIRST_ENTRY && entry && first_chunk) ||
                         (schedule == FVK_SYNC_NO_MIDDLE && !entry);
    if (!dropped) ++k;
  }

  template <typename Src, typename Dst>
  void move(MoveKind kind, const Src& src, const Dst& dst, uint32_t u0, uint32_t u1) {
    if (kind == kMoveOwn) return;  // input to output: no window
    const uintptr_t lo = reinterpret_cast<uintptr_t>(kind == kMoveStore ? dst.at(u0) : src.at(u0));
    const uintptr_t hi = reinterpret_cast<uintptr_t>(kind == kMoveStore ? dst.at(u1 - 1) : src.at(u1 - 1)) + 1;
    const int w = static_cast<int>(lo >> kWindowShift) - 1;
    const int64_t offset = static_cast<int64_t>(lo & ((uintptr_t{1} << kWindowShift) - 1));
    const Access a{0, 0, call, rank, cta, k, kind == kMoveStore, (syncs - 1) / 2};
    if (kind == kMoveCopyOut && w != rank) checker->fail("a copy-out reads another rank's window: " + describe(a));
    checker->record(*p, w, offset, offset + static_cast<int64_t>(hi - lo), a, window_bytes);
  }
};

}  // namespace
}  // namespace fvk

using namespace fvk;

extern "C" int fvk_check_window_sync(int world, int ncalls, const fvk_call* calls, size_t window_bytes, int layout,
                                     int schedule, int64_t* violations, char* msg, int len) {
  if (!calls || !violations) return set_error(FVK_ERR_INVALID, "null calls or violations");
  if (ncalls < 1) return set_error(FVK_ERR_INVALID, "ncalls=%d must be >= 1", ncalls);
  if (layout != kStatic && layout != kMoving && layout != kEvenOnly)
    return set_error(FVK_ERR_INVALID, "layout %d is not one of FVK_LAYOUT_*", layout);
  if (schedule < FVK_SYNC_NO_FIRST_ENTRY || schedule > FVK_SYNC_NO_MIDDLE)
    return set_error(FVK_ERR_INVALID, "schedule %d is not one of FVK_SYNC_*", schedule);
  std::vector<Problem> problems;
  for (int n = 0; n < ncalls; ++n) {
    if (calls[n].kind != FVK_KIND_SM)
      return set_error(FVK_ERR_INVALID,
                       "call %d: kind %d is not FVK_KIND_SM (the copy-engine kind's check is "
                       "fvk_check_ce_sync)",
                       n, calls[n].kind);
    Problem p;
    const int status = make_problem(world, calls[n], kMaxCtas, window_bytes, p, layout);
    if (status != FVK_OK) return status;
    problems.push_back(p);
  }
  Checker checker;
  checker.accesses.resize(world);
  char* const operand = fake_window(kMaxWorld + 1);  // the tensors' side is never touched: no window
  for (int n = 0; n < ncalls; ++n) {
    const fvk_call& call = calls[n];
    checker.call_ctas = call.ctas;
    for (int r = 0; r < world; ++r) {
      Problem p = problems[n];
      p.rank = r;
      p.x = p.out = operand;
      for (int i = 0; i < call.ctas; ++i) {
        RecordingEnv env{&checker, &p, window_bytes, n, r, i, schedule};
        run_call<unsigned char>(p, env, i, call.ctas);  // 1-byte units: every slice's bytes as they are
      }
    }
    const Problem& p = problems[n];
    for (int64_t c = 0; c < num_chunks(p); ++c)
      for (int src = 0; src < world; ++src)
        for (int dst = 0; dst < world; ++dst) checker.tiles(p, call, chunk_at(p, c), c, src, dst, n);
  }
  for (int w = 0; w < world; ++w) checker.races(checker.accesses[w], w);
  *violations = checker.violations;
  if (msg && len > 0) snprintf(msg, static_cast<size_t>(len), "%s", checker.first.c_str());
  return FVK_OK;
}
