// The CPU references' float32 operands, shared by reference.cpp and decoder_ops.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace flashhead {

// A contiguous float32 copy of t, so that the bits of the sums over it do not depend on the
// caller's layout (python_tests/test_layouts.py). A contiguous float32 tensor is used in place
// unless it starts off the allocator's 64-byte alignment: BLAS and the vectorised reductions take
// other paths there, and a view at an odd element offset changed the last bits of scores.
inline at::Tensor float_rows(const at::Tensor& t) {
  at::Tensor rows = t.to(at::kFloat).contiguous();
  return reinterpret_cast<std::uintptr_t>(rows.const_data_ptr()) % 64 == 0 ? rows : rows.clone();
}

}  // namespace flashhead
