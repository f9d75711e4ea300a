/*
 * fastvideo-kernel: the same-host shared-memory vote (host-only C++, no CUDA).
 *
 * The helper's per-call vote exchanges 12 int64 fields between the P ranks of one SP group. The
 * fused route is single-host by construction, so a POSIX shared-memory segment replaces the gloo
 * all-gather on the call path (construction stays on gloo).
 *
 * Layout: a header (magic, layout version, world size, slot size, attached-ranks mask), then one
 * slot per rank, each on its own cache lines: an atomic uint64 sequence and the rank's pid (alone on
 * their line) and two 12-field buffers, used by call parity.
 *
 * Protocol for this handle's call n (n = 1, 2, ...):
 *   1. write my fields into slot[me].buf[n & 1];
 *   2. store-release slot[me].seq = n;
 *   3. for each peer p: wait until load-acquire slot[p].seq >= n, then copy slot[p].buf[n & 1].
 * The release store in (2) orders the buffer writes of (1) before the sequence; the acquire load in
 * (3) that observes seq >= n makes those writes visible to the reader. std::atomic with explicit
 * release/acquire is correct on weakly ordered hosts (aarch64: stlr/ldar), not only on x86.
 *
 * Why two buffers suffice: peer p overwrites slot[p].buf[n & 1] next at its call n + 2. To start call
 * n + 2 it must have finished call n + 1, i.e. observed my seq >= n + 1, and I publish seq = n + 1 only
 * at the start of my call n + 1, after I finished reading every peer's call-n buffer. So no peer can
 * overwrite a buffer I am still reading. The same argument bounds a peer's sequence: while I wait in
 * call n, every peer's seq is at most n + 1 (a larger value means a stale segment or a duplicate rank
 * and is reported as an error).
 *
 * Back-off while waiting: a bounded spin with a CPU pause/yield hint, then sched_yield() for a short
 * while, then nanosleep() in short steps, so four ranks on two cores do not thrash. A CLOCK_MONOTONIC
 * deadline ends the wait with FVK_ERR_TIMEOUT; a peer whose process no longer exists (its pid, checked
 * every few milliseconds once sleeping, gives ESRCH) ends it at once with FVK_ERR_PEER_GONE: a dead peer is
 * told from a stopped or slow one. Either leaves the peers out of step, so the handle refuses further
 * exchanges (the caller treats it as terminal). Errors never abort; messages go to
 * fvk_last_error().
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <new>
#include <unordered_set>

#include "error.h"
#include "ulysses_a2a.h"

namespace {

using fvk::set_error;

constexpr uint64_t kMagic = 0x65746F7646564B31ull;  // "1KVFvote"
constexpr uint32_t kLayoutVersion = 2;              // 2: each slot holds its rank's pid
constexpr int kFields = 12;
constexpr int kMaxVoteWorld = 64;  // the attached mask is one uint64
constexpr size_t kLine = 64;

struct alignas(kLine) Header {
  std::atomic<uint64_t> magic;  // stored (release) last by the creator
  uint32_t layout_version;
  uint32_t world;
  uint64_t slot_bytes;
  std::atomic<uint64_t> attached;  // bit r: rank r opened the segment
};

struct alignas(kLine) Slot {
  std::atomic<uint64_t> seq;  // the last call whose fields are in buf[seq & 1]
  std::atomic<int32_t> pid;   // the rank's process, set at open: a waiting peer tells "gone" from "late"
  char pad[kLine - sizeof(std::atomic<uint64_t>) - sizeof(std::atomic<int32_t>)];
  int64_t buf[2][kFields];
};

static_assert(sizeof(Header) % kLine == 0 && sizeof(Slot) % kLine == 0, "slots must be cache-line aligned");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the vote needs lock-free 64-bit atomics");

struct Vote {
  char name[256];
  void* base = nullptr;
  size_t bytes = 0;
  int world = 0;
  int rank = 0;
  uint64_t calls = 0;
  bool broken = false;  // a timeout or protocol error: peers are out of step
  Header* header() const { return static_cast<Header*>(base); }
  Slot* slot(int r) const { return reinterpret_cast<Slot*>(static_cast<char*>(base) + sizeof(Header)) + r; }
};

// Live handles: a closed or foreign pointer is an error, not a use-after-free.
std::mutex g_live_mutex;
std::unordered_set<Vote*> g_live;

bool live(Vote* v) {
  std::lock_guard<std::mutex> lock(g_live_mutex);
  return g_live.count(v) != 0;
}

size_t segment_bytes(int world) {
  return sizeof(Header) + sizeof(Slot) * static_cast<size_t>(world);
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield" ::: "memory");
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

constexpr int kSpins = 256;               // pause-hint iterations before yielding the CPU
constexpr int64_t kYieldNs = 200 * 1000;  // then sched_yield for up to 200 us
constexpr long kSleepNs = 50 * 1000;      // then sleep in 50 us steps

constexpr int kSleepsPerLivenessCheck = 100;  // once sleeping: is the peer's process still there (5 ms)?

enum WaitResult { kArrived, kTimedOut, kPeerGone };

// Whether the process `pid` no longer exists (ESRCH; EPERM means it exists under another user).
bool gone(int32_t pid) {
  return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH;
}

// Waits until slot->seq >= n; `seen` gets the value seen.
WaitResult wait_for(const Slot* slot, uint64_t n, int64_t start, int64_t deadline, uint64_t& seen) {
  seen = slot->seq.load(std::memory_order_acquire);
  for (int i = 0; seen < n && i < kSpins; ++i) {
    cpu_relax();
    seen = slot->seq.load(std::memory_order_acquire);
  }
  for (int sleeps = 0; seen < n;) {
    int64_t t = now_ns();
    if (t >= deadline) return kTimedOut;
    if (t - start < kYieldNs) {
      sched_yield();
    } else {
      timespec ts{0, kSleepNs};
      nanosleep(&ts, nullptr);
      if (++sleeps % kSleepsPerLivenessCheck == 0 && gone(slot->pid.load(std::memory_order_relaxed))) {
        seen = slot->seq.load(std::memory_order_acquire);
        return seen >= n ? kArrived : kPeerGone;
      }
    }
    seen = slot->seq.load(std::memory_order_acquire);
  }
  return kArrived;
}

}  // namespace

namespace fvk {
// The world size of an open vote handle, or -1 (ulysses_a2a.cu's voted_launch, fvk_launch's voted form, sizes
// the gathered table by it, and checks it against the communicator's).
int vote_world(void* handle) {
  Vote* v = static_cast<Vote*>(handle);
  return v && live(v) ? v->world : -1;
}
}  // namespace fvk

extern "C" {

int fvk_vote_open(const char* name, int world, int rank, int create, void** handle) {
  if (!handle) return set_error(FVK_ERR_INVALID, "vote: handle is null");
  *handle = nullptr;
  if (!name || name[0] != '/' || strlen(name) >= sizeof(Vote::name) || strchr(name + 1, '/'))
    return set_error(FVK_ERR_INVALID, "vote: segment name must be '/name' (no other '/', < 256 chars)");
  if (world < 1 || world > kMaxVoteWorld)
    return set_error(FVK_ERR_INVALID, "vote: world size %d outside 1..%d", world, kMaxVoteWorld);
  if (rank < 0 || rank >= world) return set_error(FVK_ERR_INVALID, "vote: rank %d outside 0..%d", rank, world - 1);
  const size_t bytes = segment_bytes(world);
  int fd = create ? shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600) : shm_open(name, O_RDWR, 0);
  if (fd < 0) return set_error(FVK_ERR_UNAVAILABLE, "vote: shm_open(%s) failed: %s", name, strerror(errno));
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int e = errno;
    close(fd);
    shm_unlink(name);
    return set_error(FVK_ERR_UNAVAILABLE, "vote: ftruncate(%s, %zu) failed: %s", name, bytes, strerror(e));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    close(fd);
    return set_error(FVK_ERR_STATE, "vote: segment %s has %lld bytes, world size %d needs %zu (stale segment?)", name,
                     static_cast<long long>(st.st_size), world, bytes);
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int map_errno = errno;
  close(fd);  // the mapping keeps the segment alive
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name);
    return set_error(FVK_ERR_UNAVAILABLE, "vote: mmap(%s) failed: %s", name, strerror(map_errno));
  }
  Header* h = static_cast<Header*>(base);
  if (create) {  // a fresh segment is zero-filled: every seq starts at 0
    h->layout_version = kLayoutVersion;
    h->world = static_cast<uint32_t>(world);
    h->slot_bytes = sizeof(Slot);
    h->attached.store(0, std::memory_order_relaxed);
    h->magic.store(kMagic, std::memory_order_release);
  } else if (h->magic.load(std::memory_order_acquire) != kMagic || h->layout_version != kLayoutVersion ||
             h->world != static_cast<uint32_t>(world) || h->slot_bytes != sizeof(Slot)) {
    unsigned long long magic = h->magic.load(std::memory_order_relaxed);
    unsigned v = h->layout_version, w = h->world;
    munmap(base, bytes);
    return set_error(FVK_ERR_STATE,
                     "vote: segment %s is not a layout-%u vote for %d ranks (magic %llx, layout %u, "
                     "world %u): stale or foreign segment",
                     name, kLayoutVersion, world, magic, v, w);
  }
  const uint64_t bit = 1ull << rank;
  if (h->attached.fetch_or(bit, std::memory_order_acq_rel) & bit) {
    munmap(base, bytes);
    return set_error(FVK_ERR_STATE, "vote: rank %d already attached to %s (duplicate rank or stale segment)", rank,
                     name);
  }
  Slot* own = reinterpret_cast<Slot*>(static_cast<char*>(base) + sizeof(Header)) + rank;
  own->pid.store(static_cast<int32_t>(getpid()), std::memory_order_relaxed);
  Vote* v = new (std::nothrow) Vote;
  if (!v) {
    munmap(base, bytes);
    return set_error(FVK_ERR_INVALID, "vote: out of host memory");
  }
  snprintf(v->name, sizeof(v->name), "%s", name);
  v->base = base;
  v->bytes = bytes;
  v->world = world;
  v->rank = rank;
  {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    g_live.insert(v);
  }
  *handle = v;
  return FVK_OK;
}

int fvk_vote_exchange(void* handle, const int64_t* fields, int64_t* out, int64_t timeout_ns) {
  Vote* v = static_cast<Vote*>(handle);
  if (!v || !live(v)) return set_error(FVK_ERR_STATE, "vote: handle %p is not open (closed or never opened)", handle);
  if (!fields || !out) return set_error(FVK_ERR_INVALID, "vote: null fields or output");
  if (v->broken) return set_error(FVK_ERR_STATE, "vote: an earlier exchange failed; peers are out of step");
  const uint64_t n = ++v->calls;
  const int par = static_cast<int>(n & 1);
  Slot* mine = v->slot(v->rank);
  memcpy(mine->buf[par], fields, sizeof(int64_t) * kFields);
  mine->seq.store(n, std::memory_order_release);
  memcpy(out + static_cast<size_t>(v->rank) * kFields, fields, sizeof(int64_t) * kFields);
  const int64_t start = now_ns();
  const int64_t deadline = timeout_ns > INT64_MAX - start ? INT64_MAX : start + timeout_ns;
  for (int p = 0; p < v->world; ++p) {
    if (p == v->rank) continue;
    const Slot* peer = v->slot(p);
    uint64_t seen = 0;
    const WaitResult waited = wait_for(peer, n, start, deadline, seen);
    if (waited == kTimedOut) {
      v->broken = true;
      return set_error(FVK_ERR_TIMEOUT,
                       "shared-memory vote %s: rank %d timed out after %.3f s waiting for rank %d at call %llu "
                       "(rank %d is at call %llu: stopped, stuck, or not calling)",
                       v->name, v->rank, (now_ns() - start) * 1e-9, p, static_cast<unsigned long long>(n), p,
                       static_cast<unsigned long long>(seen));
    }
    if (waited == kPeerGone) {
      v->broken = true;
      return set_error(FVK_ERR_PEER_GONE,
                       "shared-memory vote %s: rank %d (pid %d) exited while rank %d waited for it at call %llu, "
                       "after %.3f s",
                       v->name, p, static_cast<int>(peer->pid.load(std::memory_order_relaxed)), v->rank,
                       static_cast<unsigned long long>(n), (now_ns() - start) * 1e-9);
    }
    if (seen > n + 1) {
      v->broken = true;
      return set_error(FVK_ERR_STATE,
                       "shared-memory vote %s: rank %d is at call %llu while rank %d is at call %llu "
                       "(stale segment or duplicate rank)",
                       v->name, p, static_cast<unsigned long long>(seen), v->rank, static_cast<unsigned long long>(n));
    }
    memcpy(out + static_cast<size_t>(p) * kFields, peer->buf[par], sizeof(int64_t) * kFields);
  }
  return FVK_OK;
}

int fvk_vote_unlink(void* handle) {
  Vote* v = static_cast<Vote*>(handle);
  if (!v || !live(v)) return set_error(FVK_ERR_STATE, "vote: handle %p is not open", handle);
  if (shm_unlink(v->name) != 0 && errno != ENOENT)
    return set_error(FVK_ERR_UNAVAILABLE, "vote: shm_unlink(%s) failed: %s", v->name, strerror(errno));
  return FVK_OK;
}

int fvk_vote_close(void* handle, int unlink) {
  Vote* v = static_cast<Vote*>(handle);
  {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    if (!v || !g_live.erase(v)) return set_error(FVK_ERR_STATE, "vote: handle %p is not open", handle);
  }
  int rc = FVK_OK;
  if (unlink && shm_unlink(v->name) != 0 && errno != ENOENT)
    rc = set_error(FVK_ERR_UNAVAILABLE, "vote: shm_unlink(%s) failed: %s", v->name, strerror(errno));
  munmap(v->base, v->bytes);
  delete v;
  return rc;
}

}  // extern "C"
