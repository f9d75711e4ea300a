// What the test library's kernels share: the epoch checker's window stamps (the checked LSA launch and the
// simulated ranks) and a hash (the simulation's skew, the host check's test bytes).
#pragma once

#include <cstdint>

namespace fvk {

__host__ __device__ inline unsigned int mix(unsigned long long x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<unsigned int>(x);
}

// Debug stamps, one uint64 per window granule: state | cta << 2 | src << 12 | chunk << 16 | call << 48.
// A store asserts the granule is empty, or was consumed by the same CTA index (or in an earlier
// call); a copy-out asserts it was written in this chunk by this CTA index from that source. A
// violation is reported whichever access comes first, so a layout that hands a byte to two CTA
// indices is caught on every schedule, not only on the schedules that corrupt data.
constexpr unsigned long long kWritten = 1, kConsumed = 2;

__device__ inline unsigned long long stamp(unsigned long long state, int cta, int src, int64_t chunk, uint32_t call) {
  return state | static_cast<unsigned long long>(cta & 1023) << 2 | static_cast<unsigned long long>(src & 15) << 12 |
         (static_cast<unsigned long long>(chunk) & 0xffffffffull) << 16 |
         static_cast<unsigned long long>(call & 0xffff) << 48;
}

// report[0] counts violations; report[1..4] describe the first: kind | rank << 8 | peer << 16, granule,
// the stamp found, the stamp written.
__device__ inline void report_violation(unsigned long long* report, int kind, int rank, int peer, int64_t granule,
                                        unsigned long long found, unsigned long long mine) {
  if (atomicAdd(report, 1ull) == 0) {
    report[1] = static_cast<unsigned long long>(kind | rank << 8 | peer << 16);
    report[2] = static_cast<unsigned long long>(granule);
    report[3] = found;
    report[4] = mine;
  }
}

__device__ inline void epoch_store(unsigned long long* shadow, int64_t granule, unsigned long long* report, int rank,
                                   int peer, int cta, int64_t chunk, uint32_t call) {
  const unsigned long long mine = stamp(kWritten, cta, rank, chunk, call);
  // System scope: peers stamp the same word through LSA pointers over NVLink.
  const unsigned long long old = atomicExch_system(shadow + granule, mine);
  const bool consumed = (old & 3) == kConsumed;
  const bool ok = old == 0 || old == mine ||
                  (consumed && (static_cast<int>(old >> 2 & 1023) == cta || (old >> 48) != (call & 0xffff)));
  if (!ok) report_violation(report, 1, rank, peer, granule, old, mine);
}

__device__ inline void epoch_load(unsigned long long* shadow, int64_t granule, unsigned long long* report, int rank,
                                  int src, int cta, int64_t chunk, uint32_t call) {
  const unsigned long long mine = stamp(kConsumed, cta, src, chunk, call);
  const unsigned long long old = atomicExch_system(shadow + granule, mine);
  if (old != stamp(kWritten, cta, src, chunk, call) && old != mine)
    report_violation(report, 2, rank, src, granule, old, mine);
}

}  // namespace fvk
