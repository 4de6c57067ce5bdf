// FHB_CHECK(call): a CUDA runtime call that must succeed, else the program names it and exits 1.
// Shared by the cpp_bench binaries and racecheck_bulk_copy (which has no Google Benchmark).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define FHB_CHECK(call)                                                                                  \
  do {                                                                                                   \
    const cudaError_t err_ = (call);                                                                     \
    if (err_ != cudaSuccess) {                                                                           \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                                      \
    }                                                                                                    \
  } while (0)
