// The fused kernel's Env on real ranks (movement.cuh's run_call): LSA pointers into the peers' symmetric
// windows and one ncclLsaBarrierSession per CTA. The production kernel (ulysses_a2a.cu) runs LsaEnv itself;
// the test library's epoch-checked kernel (testing/checked_launch.cu) runs an Env derived from it, so both
// use this one definition of the barrier and of the window addressing.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <cuda/atomic>

#include "movement.cuh"

namespace fvk {

struct LsaEnv {
  static constexpr bool kHost = false;
  static constexpr bool kCheck = false;
  static constexpr bool kAnyLayout = false;  // the production kernel runs the static layout only
  ncclLsaBarrierSession<ncclCoopCta>* barrier;
  ncclCoopCta* coop;
  ncclWindow_t win;
  int rank;
  __device__ char* window(int peer) const { return static_cast<char*>(ncclGetLsaPointer(win, 0, peer)); }
  // Acquire/release: orders peers' copy-out reads before our stores (WAR across chunks and calls),
  // and our stores before their reads.
  __device__ void sync() { barrier->sync(*coop, cuda::memory_order_acq_rel); }
};

// One call as this CTA runs it on LSA: the barrier session on slot blockIdx.x (the device communicator
// reserves one per CTA of the largest launch), then run_call with an Env built from an LsaEnv and `extra`
// (the members a derived Env adds, in order).
template <typename V, typename Env, typename... Extra>
__device__ inline void run_on_lsa(const Problem& p, ncclWindow_t window, const ncclDevComm& dev_comm,
                                  const Extra&... extra) {
  ncclCoopCta coop;
  ncclLsaBarrierSession<ncclCoopCta> barrier{coop, dev_comm, ncclTeamLsa(dev_comm), dev_comm.lsaBarrier, blockIdx.x};
  Env env{LsaEnv{&barrier, &coop, window, p.rank}, extra...};
  run_call<V>(p, env, blockIdx.x, gridDim.x);
}

}  // namespace fvk
