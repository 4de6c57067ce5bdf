// Device helpers shared by the FlashHead kernels: loads and fp32 conversion of the storage
// dtypes, the warp-level dot product every stage is built on, order-preserving keys for
// ranking, dependent-launch hooks, and the host-side launch helper.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels/api.h"
#include "kernels/philox.cuh"

// X(T, TC) for each (hidden dtype, centroid dtype) pair the centroid-scoring launchers are
// instantiated for: the hidden dtype's own centroids, or fp8 e4m3 ones.
#define FLASHHEAD_FOR_EACH_CENTROID_PAIR(X) \
  X(float, float)                           \
  X(__half, __half)                         \
  X(__nv_bfloat16, __nv_bfloat16)           \
  X(float, __nv_fp8_e4m3)                   \
  X(__half, __nv_fp8_e4m3)                  \
  X(__nv_bfloat16, __nv_fp8_e4m3)

namespace flashhead {
namespace detail {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// gridDim.y limit: the candidate kernels and the tensor-core scoring launch larger batches in slices.
constexpr int kMaxGridRows = 65535;

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Rows a head call reads once (centroids, candidate embedding rows) at small batch: marked to
// leave L2 first, so the head does not evict what the model body around it keeps there (a
// Qwen3-0.6B draft step with the FlashHead head 5% faster). Larger batches read rows again across
// their rows (scoring tiles, popular clusters) and keep the normal policy.
constexpr int kRowsOnceMaxBatch = 8;
__host__ __device__ inline bool rows_read_once(int batch) { return batch <= kRowsOnceMaxBatch; }

// The L2 policy of the dot products' row loads (load_piece): evict-first for rows read once, else normal.
__device__ __forceinline__ uint64_t row_policy(bool read_once) {
  uint64_t first, normal;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(first));
  asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(normal));
  return read_once ? first : normal;
}

template <typename T>
constexpr int kVecWidth = 16 / sizeof(T);

// What a lane holds of W consecutive elements for the dot products: whole 16-byte vectors as raw
// 32-bit words, converted straight from them, or one element in the low bits of a word. (A
// struct of W elements cost a register move per element before each conversion: the scoring
// loop issued about three times the instructions its arithmetic needs.)
template <typename T, int W>
struct Piece {
  static_assert(W == 1 || (sizeof(T) * W) % 16 == 0, "whole 16-byte vectors or one element");
  static constexpr int kWords = W == 1 ? 1 : int(sizeof(T)) * W / 4;
  uint32_t word[kWords];
};

// Elements of T packed in a 32-bit word (little-endian: element 0 in the low bits) as floats.
// fp8 converts in pairs (one cvt to f16x2, exact, NaN kept); one at a time it goes through the
// slow conversion unit.
template <typename T>
constexpr int kPerWord = 4 / sizeof(T);
template <typename T>
__device__ __forceinline__ void word_floats(uint32_t w, float* out) {
  if constexpr (std::is_same_v<T, float>) {
    out[0] = __uint_as_float(w);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    out[0] = __uint_as_float(w << 16);
    out[1] = __uint_as_float(w & 0xffff0000u);
  } else if constexpr (std::is_same_v<T, __half>) {
    __half2 pair;
    memcpy(&pair, &w, sizeof(w));
    const float2 f = __half22float2(pair);
    out[0] = f.x;
    out[1] = f.y;
  } else {
    static_assert(std::is_same_v<T, __nv_fp8_e4m3>, "float, bfloat16, half or fp8 e4m3");
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> (16 * k)), __NV_E4M3);
      const float2 f = __half22float2(__half2(raw));
      out[2 * k] = f.x;
      out[2 * k + 1] = f.y;
    }
  }
}

template <typename T, int W>
__device__ __forceinline__ void piece_floats(const Piece<T, W>& piece, float (&out)[W]) {
  if constexpr (W == 1) {
    float all[kPerWord<T>];
    word_floats<T>(piece.word[0], all);
    out[0] = all[0];
  } else {
#pragma unroll
    for (int i = 0; i < Piece<T, W>::kWords; ++i) word_floats<T>(piece.word[i], out + i * kPerWord<T>);
  }
}

// A piece of row p under an L2 policy, or with a null policy by non-coherent loads (__ldg): hidden
// rows (they stay in L1), the decoder-layer ops' weights and keys.
template <typename T, int W>
__device__ __forceinline__ Piece<T, W> load_piece(const T* p, const uint64_t* policy) {
  Piece<T, W> piece;
  if constexpr (W == 1) {
    if constexpr (sizeof(T) == 1) {
      piece.word[0] = __ldg(reinterpret_cast<const unsigned char*>(p));
    } else if constexpr (sizeof(T) == 2) {
      piece.word[0] = __ldg(reinterpret_cast<const unsigned short*>(p));
    } else {
      piece.word[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    }
  } else {
#pragma unroll
    for (int i = 0; i < Piece<T, W>::kWords / 4; ++i) {
      const int4* at = reinterpret_cast<const int4*>(p) + i;
      int4 raw;
      if (policy) {
        asm("ld.global.nc.L2::cache_hint.v4.s32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
            : "l"(at), "l"(*policy));
      } else {
        raw = __ldg(at);
      }
      memcpy(&piece.word[4 * i], &raw, sizeof(raw));
    }
  }
  return piece;
}

// A 16-byte piece by a plain load: from shared memory (decoder_step's weight ring and staged keys)
// or from memory the running kernel writes (this block included), where load_piece's non-coherent
// global loads do not apply.
template <typename T, int W>
__device__ __forceinline__ Piece<T, W> plain_piece(const T* p) {
  static_assert(Piece<T, W>::kWords == 4, "one 16-byte vector");
  Piece<T, W> piece;
  const int4 raw = *reinterpret_cast<const int4*>(p);
  memcpy(&piece.word[0], &raw, sizeof(raw));
  return piece;
}

// Rows of D elements can use 16-byte loads when every row starts 16-byte aligned.
template <typename T>
__host__ __device__ inline bool rows_vectorizable(const void* base, int hidden_dim) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (static_cast<size_t>(hidden_dim) * sizeof(T)) % 16 == 0;
}

// arr[i] for a run-time i through selects: indexing a register array at run time would move it
// to local memory.
template <typename V, int N>
__device__ __forceinline__ V pick(const V (&arr)[N], int i) {
  V v = arr[0];
#pragma unroll
  for (int k = 1; k < N; ++k) v = i == k ? arr[k] : v;
  return v;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// The value as the storage dtype would hold it: the reference rounds between its torch ops.
template <typename T>
__device__ __forceinline__ float rounded(float x) {
  return to_float(from_float<T>(x));
}

// GELU, tanh approximation (torch's approximate="tanh", in float32 as its kernels compute it).
__device__ __forceinline__ float gelu_tanh(float x) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  return 0.5f * x * (1.0f + tanhf(kBeta * (x + kKappa * x * x * x)));
}

// The larger of two values: fmaxf for floats (a NaN loses to a number), max for packed words.
__device__ __forceinline__ float larger(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ uint64_t larger(uint64_t a, uint64_t b) { return max(a, b); }
// The largest value over the warp, in every lane.
template <typename V>
__device__ __forceinline__ V warp_max(V x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) x = larger(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}

// Dot products of ROWS rows (of TR: T, or fp8 centroids) with RB hidden rows (of T) over D
// elements, fp32 accumulation; a piece is W elements of each. The rows are loaded under `policy`
// (row_policy). A null row pointer is a masked row: it is never read and its sums are 0. The loop
// keeps ROWS * U loads of each lane in flight before the first use. Every lane returns the full sums.
template <typename TR, typename T, int W, int ROWS, int RB, int U>
__device__ __forceinline__ void warp_dot_chunks(const TR* const (&rows)[ROWS], const T* const (&hid)[RB], int dim,
                                                uint64_t policy, float (&acc)[ROWS][RB]) {
  const int lane = threadIdx.x % kWarpSize;
  const int num_chunks = dim / W;
  for (int base = 0; base < num_chunks; base += kWarpSize * U) {
    Piece<TR, W> c[ROWS][U];
    Piece<T, W> h[RB][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int idx = base + u * kWarpSize + lane;
      const bool in_range = idx < num_chunks;
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        c[r][u] = (in_range && rows[r]) ? load_piece<TR, W>(rows[r] + int64_t{idx} * W, &policy) : Piece<TR, W>{};
#pragma unroll
      for (int b = 0; b < RB; ++b)
        h[b][u] = (in_range && hid[b]) ? load_piece<T, W>(hid[b] + int64_t{idx} * W, nullptr) : Piece<T, W>{};
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float hf[RB][W];
#pragma unroll
      for (int b = 0; b < RB; ++b) piece_floats(h[b][u], hf[b]);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float cf[W];
        piece_floats(c[r][u], cf);
#pragma unroll
        for (int e = 0; e < W; ++e)
#pragma unroll
          for (int b = 0; b < RB; ++b) acc[r][b] = fmaf(cf[e], hf[b][e], acc[r][b]);
      }
    }
  }
}

template <typename TR, typename T, int ROWS, int RB, int U>
__device__ __forceinline__ void warp_dot(const TR* const (&rows)[ROWS], const T* const (&hid)[RB], int dim, bool vec,
                                         uint64_t policy, float (&acc)[ROWS][RB]) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int b = 0; b < RB; ++b) acc[r][b] = 0.0f;
  // Scalar loads when rows are not 16-byte aligned (odd D, offset views): correct, slower.
  if (vec) {
    warp_dot_chunks<TR, T, kVecWidth<TR>, ROWS, RB, U>(rows, hid, dim, policy, acc);
  } else {
    warp_dot_chunks<TR, T, 1, ROWS, RB, U * 2>(rows, hid, dim, policy, acc);
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int b = 0; b < RB; ++b) acc[r][b] = warp_sum(acc[r][b]);
}

// Ranking keys: a larger uint32 is a better score. NaN ranks like -inf (the reference maps NaN
// to -inf before ranking) and -0 like +0 (they compare equal, so the id decides).
// Four instructions (the selection converts every key of a row on one SM): fmaxf drops a NaN
// for -inf, adding +0 turns -0 into +0 (and keeps denormals: the kernels are built without
// flush-to-zero), and a negative value's bits are all flipped, a positive one's sign bit.
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t bits = __float_as_uint(fmaxf(x, -INFINITY) + 0.0f);
  return bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u);
}

// (key, id) in one uint64 ordered by key, then by the smaller id: a max over packed values is
// the ranking with its tie-break. Every packed entry is > 0 (order_key(-inf) > 0), so 0 is "none".
__device__ __forceinline__ uint64_t pack_ranked(uint32_t key, int32_t id) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(id));
}
__device__ __forceinline__ int32_t packed_id(uint64_t packed) {
  return static_cast<int32_t>(~static_cast<uint32_t>(packed));
}
constexpr uint64_t kNoneRanked = 0;

// Loads and stores at gpu scope, relaxed, for a word another block (or a kernel still running)
// writes once and whose value is its own signal: the reader polls it past this SM's L1, with no
// fence. No memory clobber: what a caller does with the value depends on the value itself.
__device__ __forceinline__ int32_t load_relaxed(const int32_t* word) {
  int32_t value;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(word));
  return value;
}
__device__ __forceinline__ uint64_t load_relaxed(const uint64_t* word) {
  uint64_t value;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(value) : "l"(word));
  return value;
}
__device__ __forceinline__ void store_relaxed(int32_t* word, int32_t value) {
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(word), "r"(value));
}
__device__ __forceinline__ void store_relaxed(uint64_t* word, uint64_t value) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(word), "l"(value));
}

// Programmatic dependent launch (sm_90+): a dependent kernel may start early and must wait for
// its predecessor's results before touching memory the predecessor writes or reads.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_kernel_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// An arrival that publishes the block's writes (release: with the __syncthreads before it, the
// whole block's), returning the count before it; acquire: the caller then sees what the blocks
// that arrived earlier published.
__device__ __forceinline__ unsigned arrive(unsigned* counter) {
  unsigned before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
  return before;
}

// Whether `kernel` may be launched as a programmatic dependent on the current device: compute
// capability 9.0+ and a build from PTX 9.0 or later (one JIT-compiled from older PTX has no
// griddepcontrol instructions, so as a dependent it would read its inputs without waiting).
bool dependent_launch_compiled(const void* kernel);
cudaError_t multiprocessor_count(int* count);
cudaError_t l2_cache_bytes(int* bytes);

// A kernel's dynamic shared memory on the current device, worked out once per (kernel, device)
// and kept. Its limit is shared by every host thread, so it is only ever raised: a launcher that
// set it to its own size on each call could lower it under another thread's launch. A device
// reset (cudaDeviceReset) would drop the limits unseen, so it is not supported while in use.
struct KernelSmem {
  int ptx_version;     // a JIT from PTX older than 90 has no bulk copies
  size_t max_dynamic;  // the device's opt-in limit less the kernel's static shared memory
};
cudaError_t kernel_smem(const void* kernel, KernelSmem* smem);
// Blocks of `threads` threads and `smem` dynamic bytes that fit on one SM at once; the limit is
// raised to `smem` first, as a launch with that size needs.
cudaError_t resident_blocks(const void* kernel, int threads, size_t smem, int* blocks);

template <typename... Params>
cudaError_t kernel_smem(void (*kernel)(Params...), KernelSmem* smem) {
  return kernel_smem(reinterpret_cast<const void*>(kernel), smem);
}
template <typename... Params>
cudaError_t resident_blocks(void (*kernel)(Params...), int threads, size_t smem, int* blocks) {
  return resident_blocks(reinterpret_cast<const void*>(kernel), threads, smem, blocks);
}

// What a launch of `kernel` with `smem` dynamic bytes needs, from one look-up: its dynamic shared
// memory limit raised to `smem` (past 48 KB less its static shared memory a launch fails unless
// the kernel opted in: session 68's merge did not), and `*programmatic`, whether a `dependent`
// launch may wait on the previous kernel programmatically (dependent_launch_compiled).
cudaError_t prepare_launch(const void* kernel, size_t smem, bool dependent, bool* programmatic);
// Raises the kernel's dynamic shared memory limit to at least `bytes` (a launch that sets its own
// attributes: decoder_step's cooperative one).
template <typename... Params>
cudaError_t allow_dynamic_smem(void (*kernel)(Params...), size_t bytes) {
  bool programmatic = false;
  return prepare_launch(reinterpret_cast<const void*>(kernel), bytes, false, &programmatic);
}

// Launch with an optional programmatic-dependency on the previous kernel in the stream, the
// kernel's dynamic shared memory limit raised to `smem` first (prepare_launch).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool dependent, Args&&... args) {
  bool programmatic = false;
  if (cudaError_t err = prepare_launch(reinterpret_cast<const void*>(kernel), smem, dependent, &programmatic);
      err != cudaSuccess)
    return err;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  if (programmatic) {
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// Carves one caller-provided workspace into aligned arrays; with a null base it only measures.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename U>
  U* take(size_t count) {
    const size_t offset = used_;
    used_ += (count * sizeof(U) + kAlign - 1) / kAlign * kAlign;
    return base_ ? reinterpret_cast<U*>(base_ + offset) : nullptr;
  }
  size_t bytes() const { return used_; }

 private:
  static constexpr size_t kAlign = 256;
  char* base_;
  size_t used_ = 0;
};

}  // namespace detail
}  // namespace flashhead
