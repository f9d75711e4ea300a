// Host-side property check of the fused kernel's synchronisation argument (ulysses_a2a.cu header).
//
// It enumerates every window access the kernel makes over a sequence of calls, with the layout
// functions the kernel itself runs (layout.h), and checks that every pair of conflicting accesses
// (same window bytes, at least one a store) is ordered by happens-before as the kernel's structure
// defines it:
//   * per-CTA barriers: accesses of the same CTA index in different barrier intervals of one call
//     are ordered (barrier k+1 on slot i needs every rank's CTA i to have finished interval k);
//     accesses of different CTA indices in one call are never ordered (no grid-wide barrier), nor
//     are two accesses of one CTA index in the same interval on different ranks;
//   * stream order between calls: call n+1 starts on a rank after call n ended there, and an access
//     of call n+1 that follows at least one barrier of its call follows every rank's call n (that
//     barrier needs the same CTA index of every rank to have started call n+1).
// Besides races it checks the addressing: the CTA slices of each block tile it exactly, and nothing
// falls outside the window. (A copy-out reads its slice through the same cta_slice call as the
// matching store; that the data lands right is the simulated-ranks check's job.) No GPU: runs in CI.
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <functional>
#include <queue>
#include <string>
#include <vector>

#include "../error.h"
#include "../layout.h"
#include "ulysses_a2a_testing.h"

namespace fvk {

namespace {

struct Access {
  int64_t lo, hi;          // window bytes [lo, hi) of the receiving rank's window
  int call, rank, cta, k;  // k: the last barrier this access follows in its call (-1: none)
  bool store;
  int src;
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

class Checker {
 public:
  int64_t violations = 0;
  std::string first;

  void fail(const std::string& what) {
    if (violations++ == 0) first = what;
  }

  using Counts = std::vector<int64_t>;

  // Every access into window `w` of the sequence, checked for races and addressing.
  void window(int w, const std::vector<Problem>& calls, const std::vector<int>& ctas, size_t window_bytes,
              int schedule) {
    std::vector<Access> acc;
    for (int n = 0; n < static_cast<int>(calls.size()); ++n) {
      const Problem& p = calls[n];
      for (int64_t c = 0; c < num_chunks(p); ++c) {
        const Chunk ch = chunk_at(p, c);
        // The barrier each access follows (run_call: sync, stores, sync, copy-out per chunk), or a
        // negative control's schedule with one of those barriers removed.
        int store_k = static_cast<int>(2 * c), load_k = static_cast<int>(2 * c + 1);
        if (schedule == FVK_SYNC_NO_FIRST_ENTRY && c == 0) store_k = -1;
        if (schedule == FVK_SYNC_NO_ENTRY) store_k = static_cast<int>(c) - 1, load_k = static_cast<int>(c);
        if (schedule == FVK_SYNC_NO_MIDDLE) store_k = load_k = static_cast<int>(c);
        for (int src = 0; src < p.world; ++src) {
          tiles(p, ch, c, src, ctas[n], n);
          if (src == w) continue;  // a rank's own block never passes through its window
          for (int i = 0; i < ctas[n]; ++i) {
            const Slice s = cta_slice(p, ch, src, i, ctas[n]);
            if (s.bytes == 0) continue;
            if (s.window < 0 || s.window + s.bytes > static_cast<int64_t>(window_bytes))
              fail("outside the window: call " + std::to_string(n) + " chunk " + std::to_string(c) + " CTA " +
                   std::to_string(i) + " bytes [" + std::to_string(s.window) + ", " +
                   std::to_string(s.window + s.bytes) + ") of " + std::to_string(window_bytes));
            if (p.layout == kStatic) {
              const Span r = cta_region(p, src, i, ctas[n]);
              if (s.window < r.start || s.window + s.bytes > r.start + r.size)
                fail("a slice leaves its CTA's region: call " + std::to_string(n) + " chunk " + std::to_string(c) +
                     " CTA " + std::to_string(i));
            }
            // The sender src stores its slice; the receiver w copies the same slice out.
            acc.push_back(Access{s.window, s.window + s.bytes, n, src, i, store_k, true, src, c});
            acc.push_back(Access{s.window, s.window + s.bytes, n, w, i, load_k, false, src, c});
          }
        }
      }
    }
    races(acc, w);
  }

 private:
  // The slices of one block over all CTAs must tile [0, block) in CTA order.
  void tiles(const Problem& p, const Chunk& ch, int64_t c, int src, int ctas, int n) {
    int64_t next = 0;
    for (int i = 0; i < ctas; ++i) {
      const Slice s = cta_slice(p, ch, src, i, ctas);
      if (s.first != next || s.bytes < 0) {
        fail("CTA slices do not tile the block: call " + std::to_string(n) + " chunk " + std::to_string(c) + " CTA " +
             std::to_string(i));
        return;
      }
      next += s.bytes;
    }
    if (next != block_bytes(p, ch))
      fail("CTA slices cover " + std::to_string(next) + " of " + std::to_string(block_bytes(p, ch)) + " block bytes");
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
};

}  // namespace
}  // namespace fvk

using namespace fvk;

extern "C" int fvk_check_window_sync(int world, int ncalls, const int64_t* calls, size_t window_bytes, int layout,
                                     int schedule, int64_t* violations, char* msg, int len) {
  if (!calls || !violations) return set_error(FVK_ERR_INVALID, "null calls or violations");
  if (ncalls < 1) return set_error(FVK_ERR_INVALID, "ncalls=%d must be >= 1", ncalls);
  if (layout != kStatic && layout != kMoving) return set_error(FVK_ERR_INVALID, "layout %d is not 0 or 1", layout);
  if (schedule < FVK_SYNC_NO_FIRST_ENTRY || schedule > FVK_SYNC_NO_MIDDLE)
    return set_error(FVK_ERR_INVALID, "schedule %d is not one of FVK_SYNC_*", schedule);
  std::vector<Problem> problems;
  std::vector<int> ctas;
  for (int n = 0; n < ncalls; ++n) {
    const int64_t* c = calls + 8 * n;
    Problem p;
    int64_t operand_bytes = 0;
    const int status = make_problem(world, 0, static_cast<int>(c[0]), c[1], c[2], c[3], c[4], static_cast<int>(c[5]),
                                    kMaxCtas, c[6], c[7], window_bytes, p, operand_bytes, layout);
    if (status != FVK_OK) return status;
    problems.push_back(p);
    ctas.push_back(static_cast<int>(c[5]));
  }
  Checker checker;
  for (int w = 0; w < world; ++w) checker.window(w, problems, ctas, window_bytes, schedule);
  *violations = checker.violations;
  if (msg && len > 0) snprintf(msg, static_cast<size_t>(len), "%s", checker.first.c_str());
  return FVK_OK;
}
