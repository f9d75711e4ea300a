// The copy-engine kind's addressing on the host (fvk_check_ce_addressing, ulysses_a2a_testing.h; no GPU):
// one call's data movement for P simulated ranks in host memory, through the launcher's own copies
// (ce_plan.h's ce_push_copies) and the kernels' own addressing (movement.cuh's tensor_rows and WindowRun,
// ce_block_offset, all host-callable), then every output byte against the all-to-all's definition.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../ce_plan.h"
#include "../movement.cuh"
#include "../status.h"
#include "epoch.cuh"
#include "ulysses_a2a_testing.h"

using namespace fvk;

extern "C" int fvk_check_ce_addressing(int world, int mode, int dtype, int64_t B, int64_t S, int64_t H, int64_t D,
                                       int64_t planes_per_chunk, int64_t rows_per_chunk, unsigned flags, int64_t* wrong,
                                       char* msg, int len) {
  if (!wrong) return set_error(FVK_ERR_INVALID, "wrong is null");
  if (flags & ~FVK_CE_CHECK_SWAP_BUFFERS) return set_error(FVK_ERR_INVALID, "unknown flags 0x%x", flags);
  Problem base;
  int64_t operand_bytes = 0;
  FVK_TRY(make_problem(world, mode, dtype, B, S, H, D, 1, kMaxCtas, planes_per_chunk, rows_per_chunk, SIZE_MAX / 4,
                       base, operand_bytes, kStatic));
  if (operand_bytes > (int64_t{256} << 20))
    return set_error(FVK_ERR_INVALID, "the host check takes operands up to 256 MiB (%lld bytes)",
                     (long long)operand_bytes);
  const int64_t need = ce_window_need(base);
  using Bytes = std::vector<unsigned char>;
  std::vector<Bytes> x(world, Bytes(operand_bytes)), out(world, Bytes(operand_bytes, 0)), win(world, Bytes(need, 0));
  for (int r = 0; r < world; ++r)
    for (int64_t k = 0; k < operand_bytes; ++k)
      x[r][k] = static_cast<unsigned char>(mix(static_cast<unsigned long long>(r) << 48 ^ k) & 0xff);
  int64_t bad = 0;
  std::string first;
  auto fail = [&](const std::string& what, int64_t n) {
    if (bad == 0 && n) first = what;
    bad += n;
  };
  auto rank_problem = [&](int r) {
    Problem p = base;
    p.x = reinterpret_cast<const char*>(x[r].data());
    p.out = reinterpret_cast<char*>(out[r].data());
    p.rank = r;
    return p;
  };
  // The schedule's data movement in an order it allows (every push of a chunk, then its copy-outs): the
  // launcher's copies (ce_push_copies) and the kernels' addressing (tensor_rows, ce_block_offset).
  using U = unsigned char;
  for (int64_t ci = 0; ci < num_chunks(base); ++ci) {
    for (int r = 0; r < world; ++r) {
      const Problem p = rank_problem(r);
      ce_push_copies(p, ci, [&](const CeCopy& k) {
        const int64_t src_end = k.src_offset + (k.rows - 1) * k.src_pitch + k.width;
        const int64_t dst_end = k.dst_offset + (k.rows - 1) * k.dst_pitch + k.width;
        // Each push stays inside its own block: buffer ci % 2, source r (what the sync model assumes).
        const int64_t block = ce_block_offset(p, static_cast<int>(ci % 2), r);
        if (k.src_offset < 0 || src_end > operand_bytes || k.dst_offset < block ||
            dst_end > block + full_block_bytes(p) || dst_end > need) {
          fail("push outside its block: chunk " + std::to_string(ci) + " rank " + std::to_string(r), 1);
          return;
        }
        for (int64_t row = 0; row < k.rows; ++row)
          memcpy(win[k.peer].data() + k.dst_offset + row * k.dst_pitch, x[r].data() + k.src_offset + row * k.src_pitch,
                 k.width);
      });
    }
    for (int r = 0; r < world; ++r) {
      const Problem p = rank_problem(r);
      const Chunk c = chunk_at(p, ci);
      const uint32_t units = static_cast<uint32_t>(block_bytes(p, c));
      const TensorRows<U> own_in = tensor_rows<U>(p, c, const_cast<char*>(p.x), r, mode == 0);
      const TensorRows<U> own_out = tensor_rows<U>(p, c, p.out, r, mode != 0);
      for (uint32_t u = 0; u < units; ++u) *own_out.at(u) = *own_in.at(u);  // ce_local_kernel
      const int buffer = static_cast<int>((ci + ((flags & FVK_CE_CHECK_SWAP_BUFFERS) ? 1 : 0)) % 2);
      for (int src = 0; src < world; ++src) {  // ce_copy_out_kernel
        if (src == r) continue;
        const WindowRun<U> from{reinterpret_cast<char*>(win[r].data()) + ce_block_offset(p, buffer, src), 0};
        const TensorRows<U> to = tensor_rows<U>(p, c, p.out, src, mode == 1);
        for (uint32_t u = 0; u < units; ++u) *to.at(u) = *from.at(u);
      }
    }
  }
  // The all-to-all's definition: rank r's output row of source q is source q's row for r.
  const int64_t run = base.run_bytes, P = world;
  for (int r = 0; r < world; ++r)
    for (int q = 0; q < world; ++q)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s) {
          const int64_t out_row = mode == 0 ? (b * P + q) * S + s : (b * S + s) * P + q;
          const int64_t in_row = mode == 0 ? (b * S + s) * P + r : (b * P + r) * S + s;
          int64_t n = 0;
          for (int64_t k = 0; k < run; ++k) n += out[r][out_row * run + k] != x[q][in_row * run + k];
          fail("rank " + std::to_string(r) + " plane " + std::to_string(b) + " row " + std::to_string(s) +
                   " from rank " + std::to_string(q) + ": " + std::to_string(n) + " wrong bytes",
               n);
        }
  *wrong = bad;
  if (msg && len > 0) snprintf(msg, static_cast<size_t>(len), "%s", first.c_str());
  return FVK_OK;
}
