// Multi-tensor Adam/AdamW: one launch updates every tensor of a list. The host builds a table of tensors (with
// each tensor's step constants: per-tensor lr and weight decay) and a table of (tensor, start) chunks in device
// memory; block k works on chunks k, k + gridDim.x, ... The element update is adam_element (adam_math.h) with
// correctly rounded sqrt/div/fma, so results equal the CPU kernel's bit for bit (build without --use_fast_math).
#include <algorithm>

#include "device_common.cuh"

namespace megazero {
namespace cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;

template <DType G>
__device__ __forceinline__ float load_grad(const void* grad, int64_t i) {
  if constexpr (G == DType::kFloat32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == DType::kBFloat16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(grad)[i]);
  } else {
    return __half2float(static_cast<const __half*>(grad)[i]);
  }
}

template <DType C>
__device__ __forceinline__ void store_copy(void* copy, int64_t i, float p) {
  if constexpr (C == DType::kBFloat16) {
    static_cast<uint16_t*>(copy)[i] = float_to_bf16_bits(p);
  } else if constexpr (C == DType::kFloat16) {
    static_cast<__half*>(copy)[i] = __float2half_rn(p);
  }
}

template <DType G, DType C>
__global__ void __launch_bounds__(kThreads) multi_tensor_adam_kernel(const AdamTensor* __restrict__ tensors,
                                                                     const AdamChunk* __restrict__ chunks,
                                                                     int64_t num_chunks) {
  for (int64_t ci = blockIdx.x; ci < num_chunks; ci += gridDim.x) {
    const AdamChunk chunk = chunks[ci];
    const AdamTensor t = tensors[chunk.tensor];
    const AdamCoeffs& c = t.coeffs;
    const int64_t end = t.numel < chunk.start + kAdamChunk ? t.numel : chunk.start + kAdamChunk;
    for (int64_t base = chunk.start + threadIdx.x; base < end; base += static_cast<int64_t>(kThreads) * kUnroll) {
      float p[kUnroll], g[kUnroll], m[kUnroll], v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll requests in flight per thread
        const int64_t i = base + static_cast<int64_t>(u) * kThreads;
        if (i < end) {
          p[u] = t.param[i];
          g[u] = load_grad<G>(t.grad, i);
          m[u] = t.exp_avg[i];
          v[u] = t.exp_avg_sq[i];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * kThreads;
        if (i < end) {
          adam_element(p[u], g[u], m[u], v[u], c);
          t.param[i] = p[u];
          t.exp_avg[i] = m[u];
          t.exp_avg_sq[i] = v[u];
          store_copy<C>(t.param_copy, i, p[u]);
        }
      }
    }
  }
}

template <DType G, DType C>
cudaError_t launch(const AdamTensor* tensors, const AdamChunk* chunks, int64_t num_chunks, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(num_chunks, int64_t{1} << 16));
  multi_tensor_adam_kernel<G, C><<<grid, kThreads, 0, stream>>>(tensors, chunks, num_chunks);
  return cudaGetLastError();
}

template <DType G>
cudaError_t launch_copy(const AdamTensor* tensors, const AdamChunk* chunks, int64_t num_chunks, DType copy_dtype,
                        cudaStream_t stream) {
  switch (copy_dtype) {
    case DType::kNone: return launch<G, DType::kNone>(tensors, chunks, num_chunks, stream);
    case DType::kBFloat16: return launch<G, DType::kBFloat16>(tensors, chunks, num_chunks, stream);
    case DType::kFloat16: return launch<G, DType::kFloat16>(tensors, chunks, num_chunks, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t multi_tensor_adam(const AdamTensor* tensors, const AdamChunk* chunks, int64_t num_chunks,
                              DType grad_dtype, DType copy_dtype, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  switch (grad_dtype) {
    case DType::kFloat32:
      return launch_copy<DType::kFloat32>(tensors, chunks, num_chunks, copy_dtype, stream);
    case DType::kBFloat16:
      return launch_copy<DType::kBFloat16>(tensors, chunks, num_chunks, copy_dtype, stream);
    case DType::kFloat16:
      return launch_copy<DType::kFloat16>(tensors, chunks, num_chunks, copy_dtype, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace cuda
}  // namespace megazero
