// Both plan kinds' addressing on the host (fvk_check_addressing, ulysses_a2a_testing.h; no GPU): one call's data
// movement for P simulated ranks in host memory, through the kernels' own code compiled for the host -- the SM
// kind's store_chunk and copy_out_chunk for every CTA (movement.cuh), the copy-engine kind's pushes as its
// launcher issues them (ce_plan.h's ce_push_copies) and its kernels' bodies (ce_own_chunk, ce_copy_out_chunk)
// -- then every output byte against the all-to-all's definition, computed here from the call's shares alone.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../movement.cuh"
#include "../status.h"
#include "epoch.cuh"
#include "ulysses_a2a_testing.h"

namespace fvk {
namespace {

using Bytes = std::vector<unsigned char>;

struct Buffers {
  std::vector<Bytes> x, out, win;
};

bool inside(const void* p, size_t n, const Bytes& b) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  return c >= b.data() && c + n <= b.data() + b.size();
}

class Tally {
 public:
  int64_t bad = 0;
  std::string first;
  void fail(const std::string& what, int64_t n) {
    if (bad == 0 && n) first = what;
    bad += n;
  }
};

// The host Env of store_chunk, copy_out_chunk and the copy-engine bodies: moves the units one by one, each
// access checked to lie inside the buffer its kind of move may touch (an access outside is counted, not made).
template <typename V>
struct HostEnv {
  static constexpr bool kHost = true;
  static constexpr bool kCheck = false;
  static constexpr bool kAnyLayout = true;
  Buffers* buf;
  Tally* tally;
  int rank;
  int64_t chunk;

  char* window(int peer) const { return reinterpret_cast<char*>(buf->win[peer].data()); }
  void sync() {}

  template <typename Src, typename Dst>
  void move(MoveKind kind, const Src& src, const Dst& dst, uint32_t u0, uint32_t u1) {
    const Bytes& from = kind == kMoveCopyOut ? buf->win[rank] : buf->x[rank];
    for (uint32_t u = u0; u < u1; ++u) {
      const V* s = src.at(u);
      V* d = dst.at(u);
      bool ok = inside(s, sizeof(V), from);
      if (kind == kMoveStore) {
        bool any = false;
        for (const Bytes& w : buf->win) any = any || inside(d, sizeof(V), w);
        ok = ok && any;
      } else {
        ok = ok && inside(d, sizeof(V), buf->out[rank]);
      }
      if (!ok) {
        tally->fail("rank " + std::to_string(rank) + " chunk " + std::to_string(chunk) + ": a " +
                        (kind == kMoveOwn     ? "own-block copy"
                         : kind == kMoveStore ? "store"
                                              : "copy-out") +
                        " outside the rank's tensors or windows",
                    1);
        continue;
      }
      memcpy(d, s, sizeof(V));
    }
  }
};

// One call's movement with V-unit copies: every store (push) and own block of a chunk, then its copy-outs.
template <typename V>
void run(const Problem& moved, const fvk_call& call, unsigned flags, Buffers& buf, Tally& tally) {
  const int world = moved.world;
  auto rank_problem = [&](int r) {
    Problem p = moved;
    p.x = reinterpret_cast<const char*>(buf.x[r].data());
    p.out = reinterpret_cast<char*>(buf.out[r].data());
    p.rank = r;
    return p;
  };
  for (int64_t ci = 0; ci < num_chunks(moved); ++ci) {
    for (int r = 0; r < world; ++r) {
      const Problem p = rank_problem(r);
      HostEnv<V> env{&buf, &tally, r, ci};
      if (call.kind == FVK_KIND_SM) {
        for (int i = 0; i < call.ctas; ++i) store_chunk<V>(p, chunk_at(p, ci), ci, env, i, call.ctas);
        continue;
      }
      ce_push_copies(p, ci, [&](const CeCopy& k) {  // what ce_push issues as cudaMemcpy2DAsync
        for (int64_t row = 0; row < k.rows; ++row) {
          const unsigned char* s = buf.x[r].data() + k.src_offset + row * k.src_pitch;
          unsigned char* d = buf.win[k.peer].data() + k.dst_offset + row * k.dst_pitch;
          if (k.src_offset < 0 || k.dst_offset < 0 || !inside(s, k.width, buf.x[r]) ||
              !inside(d, k.width, buf.win[k.peer])) {
            tally.fail("rank " + std::to_string(r) + " chunk " + std::to_string(ci) +
                           ": a push outside its input or the peer's window",
                       1);
            return;
          }
          memcpy(d, s, k.width);
        }
      });
      for (int i = 0; i < call.ctas; ++i) ce_own_chunk<V>(p, ci, i, call.ctas, env);
    }
    for (int r = 0; r < world; ++r) {
      const Problem p = rank_problem(r);
      HostEnv<V> env{&buf, &tally, r, ci};
      if (call.kind == FVK_KIND_SM) {
        for (int i = 0; i < call.ctas; ++i) copy_out_chunk<V>(p, chunk_at(p, ci), ci, env, i, call.ctas);
        continue;
      }
      // The negative control reads the other buffer: the window seen one buffer off.
      const int64_t other = (ci % 2 ? -1 : 1) * world * full_block_bytes(p);
      char* window = env.window(r) + ((flags & FVK_CE_CHECK_SWAP_BUFFERS) ? other : 0);
      for (int i = 0; i < call.ctas; ++i) ce_copy_out_chunk<V>(p, ci, window, i, call.ctas, env);
    }
  }
}

}  // namespace
}  // namespace fvk

using namespace fvk;

extern "C" int fvk_check_addressing(int world, const fvk_call* call, int layout, unsigned flags, int64_t* wrong,
                                    char* msg, int len) {
  if (!call || !wrong) return set_error(FVK_ERR_INVALID, "null call or wrong");
  if (call->kind != FVK_KIND_SM && call->kind != FVK_KIND_CE)
    return set_error(FVK_ERR_INVALID, "kind %d is not FVK_KIND_SM or FVK_KIND_CE", call->kind);
  if (flags & ~FVK_CE_CHECK_SWAP_BUFFERS) return set_error(FVK_ERR_INVALID, "unknown flags 0x%x", flags);
  if ((flags & FVK_CE_CHECK_SWAP_BUFFERS) && call->kind != FVK_KIND_CE)
    return set_error(FVK_ERR_INVALID, "FVK_CE_CHECK_SWAP_BUFFERS is a control of the copy-engine kind");
  if (layout != kStatic && layout != kEvenOnly && !(layout == kMoving && call->kind == FVK_KIND_SM))
    return set_error(FVK_ERR_INVALID, "layout %d is not one of FVK_LAYOUT_* for this kind", layout);
  Problem real, moved;  // the call's shares (buffers, definition), and the layout under test
  FVK_TRY(make_problem(world, *call, kMaxCtas, SIZE_MAX / 4, real, kStatic));
  FVK_TRY(make_problem(world, *call, kMaxCtas, SIZE_MAX / 4, moved, layout));
  int64_t largest = 0;
  for (int r = 0; r < world; ++r) largest = std::max({largest, input_bytes(real, r), output_bytes(real, r)});
  if (largest > (int64_t{256} << 20))
    return set_error(FVK_ERR_INVALID, "the host check takes operands up to 256 MiB (%lld bytes)", (long long)largest);
  const int64_t need = call->kind == FVK_KIND_CE ? ce_window_need(moved) : window_need(moved);
  Buffers buf;
  for (int r = 0; r < world; ++r) {
    buf.x.emplace_back(input_bytes(real, r));
    buf.out.emplace_back(output_bytes(real, r), 0);
    buf.win.emplace_back(need, 0);
    // Never 0, so an output byte no copy wrote (still 0) differs from its definition.
    for (size_t k = 0; k < buf.x[r].size(); ++k)
      buf.x[r][k] = static_cast<unsigned char>(mix(static_cast<unsigned long long>(r) << 48 ^ k) | 1);
  }
  Tally tally;
  // The widest vector every rank's pointers allow, as the launcher picks it.
  int vec = 16;
  for (int r = 0; r < world; ++r) {
    Problem p = moved;
    p.x = reinterpret_cast<const char*>(buf.x[r].data());
    p.out = reinterpret_cast<char*>(buf.out[r].data());
    const void* w = buf.win[r].data();
    vec = std::min(vec, vector_bytes(p, &w, 1));
  }
  switch (vec) {
    case 16: run<uint4>(moved, *call, flags, buf, tally); break;
    case 8: run<uint2>(moved, *call, flags, buf, tally); break;
    case 4: run<uint32_t>(moved, *call, flags, buf, tally); break;
    default: run<uint16_t>(moved, *call, flags, buf, tally); break;
  }
  // The all-to-all's definition, from the call's shares alone: rank r's output holds, from every source q, the
  // rows and heads q sends it (mode 0: q's rows of r's heads; mode 1: r's rows of q's heads).
  const int64_t unit = call->D * itemsize_of(call->dtype);
  std::vector<int64_t> seq(world), heads(world), seq_at(world + 1, 0), head_at(world + 1, 0);
  for (int q = 0; q < world; ++q) {
    seq[q] = call->seq_split ? call->seq_split[q] : call->S;
    heads[q] = call->head_split ? call->head_split[q] : call->H / world;
    seq_at[q + 1] = seq_at[q] + seq[q];
    head_at[q + 1] = head_at[q] + heads[q];
  }
  const int64_t row = call->H * unit, total = seq_at[world];
  for (int r = 0; r < world; ++r)
    for (int q = 0; q < world; ++q) {
      const int owner = call->mode == 0 ? q : r, holder = call->mode == 0 ? r : q;  // whose rows, whose heads
      const int64_t run = heads[holder] * unit;
      for (int64_t b = 0; b < call->B; ++b)
        for (int64_t s = 0; s < seq[owner]; ++s) {
          // Head-split [B, seq, H * unit] holds holder's heads at head_at[holder]; seq-split [B, total, run]
          // holds owner's rows from seq_at[owner].
          const int64_t head_split = (b * seq[owner] + s) * row + head_at[holder] * unit;
          const int64_t seq_split = (b * total + seq_at[owner] + s) * run;
          const unsigned char* got = buf.out[r].data() + (call->mode == 0 ? seq_split : head_split);
          const unsigned char* want = buf.x[q].data() + (call->mode == 0 ? head_split : seq_split);
          int64_t n = 0;
          for (int64_t k = 0; k < run; ++k) n += got[k] != want[k];
          tally.fail("rank " + std::to_string(r) + " plane " + std::to_string(b) + " row " + std::to_string(s) +
                         " from rank " + std::to_string(q) + ": " + std::to_string(n) + " wrong bytes",
                     n);
        }
    }
  *wrong = tally.bad;
  if (msg && len > 0) snprintf(msg, static_cast<size_t>(len), "%s", tally.first.c_str());
  return FVK_OK;
}
