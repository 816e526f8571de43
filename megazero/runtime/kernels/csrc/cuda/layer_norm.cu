// LayerNorm and RMSNorm forward/backward over (rows, cols), fp32/bf16/fp16 inputs, fp32 statistics.
//
// Forward and the dx half of backward use one block per row (grid-stride over rows). A row of up to
// kPer * blockDim.x elements is held in registers (kPer in {1, 4, 16}, blockDim.x <= 1024): one read of x from
// memory, an exact two-pass variance. Longer rows (kPer == 0) are re-read from L2.
// dweight/dbias: each block of norm_bwd_partial sums 32 columns over a slice of rows into a fp32 workspace;
// norm_bwd_final adds the slices. Deterministic: no atomics.
#include <algorithm>

#include "device_common.cuh"

namespace megazero {
namespace cuda {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int kPartRows = 8;   // blockDim.y of norm_bwd_partial
constexpr int kMaxParts = 512;

struct NormArgs {
  int64_t rows;
  int cols;
  float eps;
  bool rms;
};

// Reads element k of this thread's share of the row (j = threadIdx.x + k * blockDim.x).
template <typename T>
__device__ __forceinline__ float load_or_zero(const T* row, int j, int cols) {
  return j < cols ? to_float(row[j]) : 0.f;
}

template <typename W>
__device__ __forceinline__ float normalize(float xv, float mu, float rstd, const W* w, const W* b, int j) {
  const float out = (xv - mu) * rstd * to_float(w[j]);
  return b != nullptr ? out + to_float(b[j]) : out;
}

template <typename T, typename W, int kPer>
__global__ void __launch_bounds__(kMaxThreads)
    norm_fwd(const T* __restrict__ x, const W* __restrict__ w, const W* __restrict__ b, T* __restrict__ y,
             float* __restrict__ mean_out, float* __restrict__ rstd_out, NormArgs a) {
  __shared__ float smem[kWarp];
  constexpr int kRegs = kPer > 0 ? kPer : 1;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* xr = x + row * a.cols;
    T* yr = y + row * a.cols;
    float v[kRegs];
    float mu = 0.f;
    if (!a.rms) {
      float s = 0.f;
      if constexpr (kPer > 0) {
#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          v[k] = load_or_zero(xr, threadIdx.x + k * blockDim.x, a.cols);
          s += v[k];
        }
      } else {
        for (int j = threadIdx.x; j < a.cols; j += blockDim.x) s += to_float(xr[j]);
      }
      mu = block_reduce(s, smem, SumOp(), 0.f) / a.cols;
    } else if constexpr (kPer > 0) {
#pragma unroll
      for (int k = 0; k < kPer; ++k) v[k] = load_or_zero(xr, threadIdx.x + k * blockDim.x, a.cols);
    }
    float sq = 0.f;
    if constexpr (kPer > 0) {
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const float d = threadIdx.x + k * blockDim.x < a.cols ? v[k] - mu : 0.f;
        sq += d * d;
      }
    } else {
      for (int j = threadIdx.x; j < a.cols; j += blockDim.x) {
        const float d = to_float(xr[j]) - mu;
        sq += d * d;
      }
    }
    const float rstd = 1.f / sqrtf(block_reduce(sq, smem, SumOp(), 0.f) / a.cols + a.eps);
    if (threadIdx.x == 0) {
      if (!a.rms) mean_out[row] = mu;
      rstd_out[row] = rstd;
    }
    if constexpr (kPer > 0) {
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < a.cols) yr[j] = from_float<T>(normalize(v[k], mu, rstd, w, b, j));
      }
    } else {
      for (int j = threadIdx.x; j < a.cols; j += blockDim.x) {
        yr[j] = from_float<T>(normalize(to_float(xr[j]), mu, rstd, w, b, j));
      }
    }
  }
}

// dx = rstd * (dy*w - mean(dy*w) - xhat * mean(dy*w*xhat)); RMSNorm drops the mean(dy*w) term.
template <typename T, typename W, int kPer>
__global__ void __launch_bounds__(kMaxThreads)
    norm_bwd_dx(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ w,
                const float* __restrict__ mean, const float* __restrict__ rstd_in, T* __restrict__ dx, NormArgs a) {
  __shared__ float smem[kWarp];
  constexpr int kRegs = kPer > 0 ? kPer : 1;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* xr = x + row * a.cols;
    const T* dyr = dy + row * a.cols;
    T* dxr = dx + row * a.cols;
    const float mu = a.rms ? 0.f : mean[row];
    const float rstd = rstd_in[row];
    float xh[kRegs], g[kRegs];
    float s1 = 0.f, s2 = 0.f;
    if constexpr (kPer > 0) {
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        xh[k] = j < a.cols ? (to_float(xr[j]) - mu) * rstd : 0.f;
        g[k] = j < a.cols ? to_float(dyr[j]) * to_float(w[j]) : 0.f;
        s1 += g[k];
        s2 += g[k] * xh[k];
      }
    } else {
      for (int j = threadIdx.x; j < a.cols; j += blockDim.x) {
        const float xv = (to_float(xr[j]) - mu) * rstd;
        const float gv = to_float(dyr[j]) * to_float(w[j]);
        s1 += gv;
        s2 += gv * xv;
      }
    }
    const float mean_g = a.rms ? 0.f : block_reduce(s1, smem, SumOp(), 0.f) / a.cols;
    const float mean_gx = block_reduce(s2, smem, SumOp(), 0.f) / a.cols;
    if constexpr (kPer > 0) {
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j < a.cols) dxr[j] = from_float<T>(rstd * (g[k] - mean_g - xh[k] * mean_gx));
      }
    } else {
      for (int j = threadIdx.x; j < a.cols; j += blockDim.x) {
        const float xv = (to_float(xr[j]) - mu) * rstd;
        const float gv = to_float(dyr[j]) * to_float(w[j]);
        dxr[j] = from_float<T>(rstd * (gv - mean_g - xv * mean_gx));
      }
    }
  }
}

// Block (32, kPartRows) sums dy * xhat and dy for 32 columns over rows [part * rows_per_part, ...).
template <typename T>
__global__ void norm_bwd_partial(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                                 const float* __restrict__ rstd, float* __restrict__ part_w,
                                 float* __restrict__ part_b, int64_t rows_per_part, NormArgs a) {
  __shared__ float sw[kPartRows][kWarp + 1];
  __shared__ float sb[kPartRows][kWarp + 1];
  const int col = blockIdx.x * kWarp + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per_part;
  const int64_t r1 = min(a.rows, r0 + rows_per_part);
  float aw = 0.f, ab = 0.f;
  if (col < a.cols) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kPartRows) {
      const float xh = (to_float(x[r * a.cols + col]) - (a.rms ? 0.f : mean[r])) * rstd[r];
      const float d = to_float(dy[r * a.cols + col]);
      aw += d * xh;
      ab += d;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < a.cols) {
    float tw = 0.f, tb = 0.f;
#pragma unroll
    for (int i = 0; i < kPartRows; ++i) {
      tw += sw[i][threadIdx.x];
      tb += sb[i][threadIdx.x];
    }
    part_w[blockIdx.y * static_cast<int64_t>(a.cols) + col] = tw;
    part_b[blockIdx.y * static_cast<int64_t>(a.cols) + col] = tb;
  }
}

template <typename W>
__global__ void norm_bwd_final(const float* __restrict__ part_w, const float* __restrict__ part_b, W* dw, W* db,
                               int parts, int cols) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  float tw = 0.f, tb = 0.f;
  for (int p = 0; p < parts; ++p) {
    tw += part_w[static_cast<int64_t>(p) * cols + col];
    tb += part_b[static_cast<int64_t>(p) * cols + col];
  }
  dw[col] = from_float<W>(tw);
  if (db != nullptr) db[col] = from_float<W>(tb);
}

// Registers per thread and threads per block for a row of `cols` elements.
struct RowPlan {
  int per;      // 0: re-read from memory
  int threads;
};

RowPlan plan_row(int64_t cols) {
  for (int per : {1, 4, 16}) {
    if (cols <= static_cast<int64_t>(per) * kMaxThreads) {
      const int64_t t = ceil_div(ceil_div(cols, per), kWarp) * kWarp;
      return {per, static_cast<int>(t)};
    }
  }
  return {0, kMaxThreads};
}

// Row slices for the dweight/dbias partial sums: about 64 rows each, at most kMaxParts.
int num_parts(int64_t rows) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kMaxParts, ceil_div(rows, 64))));
}

int grid_rows(int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, int64_t{1} << 20)); }

template <typename T, typename W>
cudaError_t forward_typed(const void* x, const void* w, const void* b, void* y, float* mean, float* rstd,
                          const NormArgs& a, cudaStream_t stream) {
  const RowPlan p = plan_row(a.cols);
  const auto* xt = static_cast<const T*>(x);
  const auto* wt = static_cast<const W*>(w);
  const auto* bt = static_cast<const W*>(b);
  auto* yt = static_cast<T*>(y);
  const int grid = grid_rows(a.rows);
  switch (p.per) {
    case 1: norm_fwd<T, W, 1><<<grid, p.threads, 0, stream>>>(xt, wt, bt, yt, mean, rstd, a); break;
    case 4: norm_fwd<T, W, 4><<<grid, p.threads, 0, stream>>>(xt, wt, bt, yt, mean, rstd, a); break;
    case 16: norm_fwd<T, W, 16><<<grid, p.threads, 0, stream>>>(xt, wt, bt, yt, mean, rstd, a); break;
    default: norm_fwd<T, W, 0><<<grid, p.threads, 0, stream>>>(xt, wt, bt, yt, mean, rstd, a); break;
  }
  return cudaGetLastError();
}

template <typename T, typename W>
cudaError_t backward_typed(const void* dy, const void* x, const void* w, const float* mean, const float* rstd,
                           void* dx, void* dw, void* db, float* workspace, const NormArgs& a, cudaStream_t stream) {
  const RowPlan p = plan_row(a.cols);
  const auto* dyt = static_cast<const T*>(dy);
  const auto* xt = static_cast<const T*>(x);
  const auto* wt = static_cast<const W*>(w);
  auto* dxt = static_cast<T*>(dx);
  const int grid = grid_rows(a.rows);
  switch (p.per) {
    case 1: norm_bwd_dx<T, W, 1><<<grid, p.threads, 0, stream>>>(dyt, xt, wt, mean, rstd, dxt, a); break;
    case 4: norm_bwd_dx<T, W, 4><<<grid, p.threads, 0, stream>>>(dyt, xt, wt, mean, rstd, dxt, a); break;
    case 16: norm_bwd_dx<T, W, 16><<<grid, p.threads, 0, stream>>>(dyt, xt, wt, mean, rstd, dxt, a); break;
    default: norm_bwd_dx<T, W, 0><<<grid, p.threads, 0, stream>>>(dyt, xt, wt, mean, rstd, dxt, a); break;
  }
  const int parts = num_parts(a.rows);
  float* part_w = workspace;
  float* part_b = workspace + static_cast<int64_t>(parts) * a.cols;
  const dim3 pgrid(static_cast<unsigned>(ceil_div(a.cols, kWarp)), static_cast<unsigned>(parts));
  norm_bwd_partial<T><<<pgrid, dim3(kWarp, kPartRows), 0, stream>>>(dyt, xt, mean, rstd, part_w, part_b,
                                                                    ceil_div(a.rows, parts), a);
  norm_bwd_final<W><<<static_cast<unsigned>(ceil_div(a.cols, 256)), 256, 0, stream>>>(
      part_w, part_b, static_cast<W*>(dw), static_cast<W*>(db), parts, a.cols);
  return cudaGetLastError();
}

struct ForwardCall {
  const void *x, *w, *b;
  void* y;
  float *mean, *rstd;
  NormArgs a;
  cudaStream_t stream;
  template <typename T, typename W>
  cudaError_t run() const {
    return forward_typed<T, W>(x, w, b, y, mean, rstd, a, stream);
  }
};

struct BackwardCall {
  const void *dy, *x, *w;
  const float *mean, *rstd;
  void *dx, *dw, *db;
  float* workspace;
  NormArgs a;
  cudaStream_t stream;
  template <typename T, typename W>
  cudaError_t run() const {
    return backward_typed<T, W>(dy, x, w, mean, rstd, dx, dw, db, workspace, a, stream);
  }
};

// Calls call.run<T, W>() for the (x, w) dtype pair; W is T or float.
template <typename Call>
cudaError_t dispatch(DType x_dtype, DType w_dtype, const Call& call) {
  const bool w32 = w_dtype == DType::kFloat32;
  switch (x_dtype) {
    case DType::kFloat32:
      return w32 ? call.template run<float, float>() : cudaErrorInvalidValue;
    case DType::kBFloat16:
      if (w32) return call.template run<__nv_bfloat16, float>();
      return w_dtype == DType::kBFloat16 ? call.template run<__nv_bfloat16, __nv_bfloat16>() : cudaErrorInvalidValue;
    case DType::kFloat16:
      if (w32) return call.template run<__half, float>();
      return w_dtype == DType::kFloat16 ? call.template run<__half, __half>() : cudaErrorInvalidValue;
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t norm_forward(const void* x, const void* weight, const void* bias, void* y, float* mean, float* rstd,
                         int64_t rows, int64_t cols, float eps, bool rms, DType x_dtype, DType w_dtype,
                         cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (cols <= 0 || cols > INT32_MAX) return cudaErrorInvalidValue;
  const NormArgs a{rows, static_cast<int>(cols), eps, rms};
  return dispatch(x_dtype, w_dtype, ForwardCall{x, weight, rms ? nullptr : bias, y, mean, rstd, a, stream});
}

int64_t norm_backward_workspace(int64_t rows, int64_t cols) { return 2 * static_cast<int64_t>(num_parts(rows)) * cols; }

cudaError_t norm_backward(const void* dy, const void* x, const void* weight, const float* mean, const float* rstd,
                          void* dx, void* dweight, void* dbias, float* workspace, int64_t rows, int64_t cols,
                          bool rms, DType x_dtype, DType w_dtype, cudaStream_t stream) {
  if (cols <= 0 || cols > INT32_MAX) return cudaErrorInvalidValue;
  if (rows == 0) {
    const size_t bytes = cols * (w_dtype == DType::kFloat32 ? 4 : 2);
    const cudaError_t err = cudaMemsetAsync(dweight, 0, bytes, stream);
    return (err != cudaSuccess || dbias == nullptr) ? err : cudaMemsetAsync(dbias, 0, bytes, stream);
  }
  const NormArgs a{rows, static_cast<int>(cols), 0.f, rms};
  return dispatch(x_dtype, w_dtype,
                  BackwardCall{dy, x, weight, mean, rstd, dx, dweight, dbias, workspace, a, stream});
}

}  // namespace cuda
}  // namespace megazero
