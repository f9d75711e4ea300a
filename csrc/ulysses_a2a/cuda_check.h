// Error returns for code that calls the CUDA runtime: FVK_CUDA turns a failing call into FVK_ERR_CUDA with the
// call, its code, name and text in fvk_last_error(); FVK_TRY returns a failing FVK status as it is. Without
// NCCL (the simulated ranks need none); context.h adds FVK_NCCL.
#pragma once

#include <cuda_runtime.h>

#include "error.h"
#include "ulysses_a2a.h"

#define FVK_CUDA(call)                                                                               \
  do {                                                                                               \
    cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess)                                                                           \
      return set_error(FVK_ERR_CUDA, "%s failed: CUDA error %d %s: %s", #call, static_cast<int>(e_), \
                       cudaGetErrorName(e_), cudaGetErrorString(e_));                                \
  } while (0)

#define FVK_TRY(call)            \
  do {                           \
    int s_ = (call);             \
    if (s_ != FVK_OK) return s_; \
  } while (0)
