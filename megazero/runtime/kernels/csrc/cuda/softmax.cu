// Scaled masked softmax and scaled upper-triangular (causal) masked softmax, forward and backward, with the
// semantics of Megatron-LM's fused ops (see kernels.h): fp32 math, masked scores -10000, causal scores -inf.
//
// Rows of up to 1024 elements: one warp per row, the row in registers (kPer = 1..32 elements per lane,
// element j on lane j % 32), a single read of x. Longer rows: one block per row, three passes that re-read x
// from L2 (max, sum, write). Both are grid-stride loops over rows.
#include <algorithm>

#include "device_common.cuh"

namespace megazero {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kRowThreads = 256;
constexpr float kMaskedScore = -10000.0f;

struct Row {
  int64_t index;       // row number
  int64_t qi;          // query position i
  const uint8_t* mask; // mask row, or null
};

__device__ __forceinline__ Row locate(int64_t row, const uint8_t* mask, const SoftmaxShape& s) {
  Row r{row, row % s.sq, nullptr};
  if (mask != nullptr && !s.causal) {
    const int64_t b = row / (s.heads * s.sq);
    r.mask = mask + ((s.mask_batches == 1 ? 0 : b) * s.sq + r.qi) * s.sk;
  }
  return r;
}

__device__ __forceinline__ bool masked(const Row& r, int64_t j, const SoftmaxShape& s) {
  return s.causal ? j > r.qi : (r.mask != nullptr && r.mask[j] != 0);
}

// The score the softmax sees: scale * x, -10000 where masked, -inf beyond the causal diagonal.
__device__ __forceinline__ float score(float x, const Row& r, int64_t j, const SoftmaxShape& s) {
  if (s.causal) return j > r.qi ? -INFINITY : x * s.scale;
  return (r.mask != nullptr && r.mask[j] != 0) ? kMaskedScore : x * s.scale;
}

template <typename T, int kPer>
__global__ void softmax_fwd_warp(const T* __restrict__ x, const uint8_t* __restrict__ mask, T* __restrict__ y,
                                 SoftmaxShape s, int64_t rows) {
  const int lane = threadIdx.x % kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp; row < rows; row += stride) {
    const Row r = locate(row, mask, s);
    const T* xr = x + row * s.sk;
    float v[kPer];
    float mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t j = lane + k * kWarp;
      v[k] = j < s.sk ? score(to_float(xr[j]), r, j, s) : -INFINITY;
      mx = fmaxf(mx, v[k]);
    }
    mx = warp_reduce(mx, MaxOp());
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      v[k] = expf(v[k] - mx);
      sum += v[k];
    }
    sum = warp_reduce(sum, SumOp());
    T* yr = y + row * s.sk;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t j = lane + k * kWarp;
      if (j < s.sk) yr[j] = from_float<T>(v[k] / sum);
    }
  }
}

template <typename T, int kPer>
__global__ void softmax_bwd_warp(const T* dy, const T* __restrict__ y, const uint8_t* __restrict__ mask, T* dx,
                                 SoftmaxShape s, int64_t rows) {
  const int lane = threadIdx.x % kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarp; row < rows; row += stride) {
    const Row r = locate(row, mask, s);
    const T* dyr = dy + row * s.sk;
    const T* yr = y + row * s.sk;
    float yv[kPer], gv[kPer];
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t j = lane + k * kWarp;
      yv[k] = j < s.sk ? to_float(yr[j]) : 0.f;
      gv[k] = j < s.sk ? to_float(dyr[j]) : 0.f;
      dot += yv[k] * gv[k];
    }
    dot = warp_reduce(dot, SumOp());
    T* dxr = dx + row * s.sk;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t j = lane + k * kWarp;
      if (j < s.sk) dxr[j] = from_float<T>(masked(r, j, s) ? 0.f : s.scale * yv[k] * (gv[k] - dot));
    }
  }
}

template <typename T>
__global__ void softmax_fwd_block(const T* __restrict__ x, const uint8_t* __restrict__ mask, T* __restrict__ y,
                                  SoftmaxShape s, int64_t rows) {
  __shared__ float smem[kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Row r = locate(row, mask, s);
    const T* xr = x + row * s.sk;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < s.sk; j += blockDim.x) mx = fmaxf(mx, score(to_float(xr[j]), r, j, s));
    mx = block_reduce(mx, smem, MaxOp(), -INFINITY);
    float sum = 0.f;
    for (int64_t j = threadIdx.x; j < s.sk; j += blockDim.x) sum += expf(score(to_float(xr[j]), r, j, s) - mx);
    sum = block_reduce(sum, smem, SumOp(), 0.f);
    T* yr = y + row * s.sk;
    for (int64_t j = threadIdx.x; j < s.sk; j += blockDim.x) {
      yr[j] = from_float<T>(expf(score(to_float(xr[j]), r, j, s) - mx) / sum);
    }
  }
}

template <typename T>
__global__ void softmax_bwd_block(const T* dy, const T* __restrict__ y, const uint8_t* __restrict__ mask, T* dx,
                                  SoftmaxShape s, int64_t rows) {
  __shared__ float smem[kWarp];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Row r = locate(row, mask, s);
    const T* dyr = dy + row * s.sk;
    const T* yr = y + row * s.sk;
    float dot = 0.f;
    for (int64_t j = threadIdx.x; j < s.sk; j += blockDim.x) dot += to_float(yr[j]) * to_float(dyr[j]);
    dot = block_reduce(dot, smem, SumOp(), 0.f);
    T* dxr = dx + row * s.sk;
    for (int64_t j = threadIdx.x; j < s.sk; j += blockDim.x) {
      const float g = to_float(dyr[j]);  // read before the write: dx may alias dy
      dxr[j] = from_float<T>(masked(r, j, s) ? 0.f : s.scale * to_float(yr[j]) * (g - dot));
    }
  }
}

// Elements per lane for the warp kernels (a power of two with 32 * kPer >= sk), or 0 for the block kernels.
int per_lane(int64_t sk) {
  for (int per = 1; per <= 32; per *= 2) {
    if (sk <= per * kWarp) return per;
  }
  return 0;
}

unsigned warp_grid(int64_t rows) {
  return static_cast<unsigned>(std::min<int64_t>(ceil_div(rows, kWarpsPerBlock), 1 << 20));
}
unsigned block_grid(int64_t rows) { return static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20)); }

template <typename T>
cudaError_t forward_typed(const void* x, const uint8_t* mask, void* y, const SoftmaxShape& s, cudaStream_t stream) {
  const int64_t rows = s.batches * s.heads * s.sq;
  const auto* xt = static_cast<const T*>(x);
  auto* yt = static_cast<T*>(y);
  const unsigned wg = warp_grid(rows);
  constexpr unsigned wt = kWarpsPerBlock * kWarp;
  switch (per_lane(s.sk)) {
    case 1: softmax_fwd_warp<T, 1><<<wg, wt, 0, stream>>>(xt, mask, yt, s, rows); break;
    case 2: softmax_fwd_warp<T, 2><<<wg, wt, 0, stream>>>(xt, mask, yt, s, rows); break;
    case 4: softmax_fwd_warp<T, 4><<<wg, wt, 0, stream>>>(xt, mask, yt, s, rows); break;
    case 8: softmax_fwd_warp<T, 8><<<wg, wt, 0, stream>>>(xt, mask, yt, s, rows); break;
    case 16: softmax_fwd_warp<T, 16><<<wg, wt, 0, stream>>>(xt, mask, yt, s, rows); break;
    case 32: softmax_fwd_warp<T, 32><<<wg, wt, 0, stream>>>(xt, mask, yt, s, rows); break;
    default: softmax_fwd_block<T><<<block_grid(rows), kRowThreads, 0, stream>>>(xt, mask, yt, s, rows); break;
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const void* dy, const void* y, const uint8_t* mask, void* dx, const SoftmaxShape& s,
                           cudaStream_t stream) {
  const int64_t rows = s.batches * s.heads * s.sq;
  const auto* dyt = static_cast<const T*>(dy);
  const auto* yt = static_cast<const T*>(y);
  auto* dxt = static_cast<T*>(dx);
  const unsigned wg = warp_grid(rows);
  constexpr unsigned wt = kWarpsPerBlock * kWarp;
  switch (per_lane(s.sk)) {
    case 1: softmax_bwd_warp<T, 1><<<wg, wt, 0, stream>>>(dyt, yt, mask, dxt, s, rows); break;
    case 2: softmax_bwd_warp<T, 2><<<wg, wt, 0, stream>>>(dyt, yt, mask, dxt, s, rows); break;
    case 4: softmax_bwd_warp<T, 4><<<wg, wt, 0, stream>>>(dyt, yt, mask, dxt, s, rows); break;
    case 8: softmax_bwd_warp<T, 8><<<wg, wt, 0, stream>>>(dyt, yt, mask, dxt, s, rows); break;
    case 16: softmax_bwd_warp<T, 16><<<wg, wt, 0, stream>>>(dyt, yt, mask, dxt, s, rows); break;
    case 32: softmax_bwd_warp<T, 32><<<wg, wt, 0, stream>>>(dyt, yt, mask, dxt, s, rows); break;
    default: softmax_bwd_block<T><<<block_grid(rows), kRowThreads, 0, stream>>>(dyt, yt, mask, dxt, s, rows); break;
  }
  return cudaGetLastError();
}

bool valid(const SoftmaxShape& s) {
  return s.batches >= 0 && s.heads >= 0 && s.sq >= 0 && s.sk > 0 &&
         (s.causal || s.mask_batches == 1 || s.mask_batches == s.batches);
}

}  // namespace

cudaError_t softmax_forward(const void* x, const uint8_t* mask, void* y, const SoftmaxShape& shape, DType dtype,
                            cudaStream_t stream) {
  if (!valid(shape)) return cudaErrorInvalidValue;
  if (shape.batches * shape.heads * shape.sq == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: return forward_typed<float>(x, mask, y, shape, stream);
    case DType::kBFloat16: return forward_typed<__nv_bfloat16>(x, mask, y, shape, stream);
    case DType::kFloat16: return forward_typed<__half>(x, mask, y, shape, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t softmax_backward(const void* dy, const void* y, const uint8_t* mask, void* dx,
                             const SoftmaxShape& shape, DType dtype, cudaStream_t stream) {
  if (!valid(shape)) return cudaErrorInvalidValue;
  if (shape.batches * shape.heads * shape.sq == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: return backward_typed<float>(dy, y, mask, dx, shape, stream);
    case DType::kBFloat16: return backward_typed<__nv_bfloat16>(dy, y, mask, dx, shape, stream);
    case DType::kFloat16: return backward_typed<__half>(dy, y, mask, dx, shape, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace megazero
