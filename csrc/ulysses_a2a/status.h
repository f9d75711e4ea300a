// Error returns for code that calls the CUDA runtime and NCCL: FVK_CUDA / FVK_NCCL turn a failing call into
// FVK_ERR_CUDA / FVK_ERR_NCCL with the call, its code, name and text in fvk_last_error(); FVK_TRY returns a
// failing FVK status as it is. nccl.h only (the host API): the simulated ranks and the host checks include
// this without NCCL's device headers.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include "error.h"
#include "ulysses_a2a.h"

namespace fvk {

// "<what> failed: CUDA error <code> <name>: <text>" / "<what> failed: NCCL error <code> <name>: <last error>".
inline int cuda_error(cudaError_t e, const char* what) {
  return set_error(FVK_ERR_CUDA, "%s failed: CUDA error %d %s: %s", what, static_cast<int>(e), cudaGetErrorName(e),
                   cudaGetErrorString(e));
}
inline int nccl_error(ncclResult_t r, const char* what) {
  return set_error(FVK_ERR_NCCL, "%s failed: NCCL error %d %s: %s", what, static_cast<int>(r), ncclGetErrorString(r),
                   ncclGetLastError(nullptr));
}
inline int passed_on(int status, const char*) {
  return status;
}  // FVK_TRY: the callee already set the text

}  // namespace fvk

#define FVK_RETURN_UNLESS(call, ok, to_error)   \
  do {                                          \
    const auto r_ = (call);                     \
    if (r_ != (ok)) return to_error(r_, #call); \
  } while (0)
#define FVK_CUDA(call) FVK_RETURN_UNLESS(call, cudaSuccess, fvk::cuda_error)
#define FVK_NCCL(call) FVK_RETURN_UNLESS(call, ncclSuccess, fvk::nccl_error)
#define FVK_TRY(call) FVK_RETURN_UNLESS(call, FVK_OK, fvk::passed_on)
