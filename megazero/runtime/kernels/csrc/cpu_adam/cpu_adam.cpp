// Run-time instruction-set choice, OpenMP partitioning and the scalar path of the CPU Adam kernel.
#include "cpu_adam.h"

#include <algorithm>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace megazero {
namespace cpu_adam {

namespace {

inline float load_grad(const void* grad, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBFloat16:
      return bf16_bits_to_float(static_cast<const uint16_t*>(grad)[i]);
    case DType::kFloat16:
      return fp16_bits_to_float(static_cast<const uint16_t*>(grad)[i]);
    default:
      return static_cast<const float*>(grad)[i];
  }
}

inline void store_copy(void* copy, DType dtype, int64_t i, float p) {
  if (dtype == DType::kBFloat16) {
    static_cast<uint16_t*>(copy)[i] = float_to_bf16_bits(p);
  } else if (dtype == DType::kFloat16) {
    static_cast<uint16_t*>(copy)[i] = float_to_fp16_bits(p);
  }
}

RangeFn range_fn(Isa isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == Isa::kAvx512) return &adam_range_avx512;
  if (isa == Isa::kAvx2) return &adam_range_avx2;
#endif
  (void)isa;
  return &adam_range_scalar;
}

// Work is handed to threads in chunks of about this many elements (about 1.8 MiB of traffic each), dynamically,
// so a thread that loses its core to another process does not hold the others up.
constexpr int64_t kChunk = int64_t{1} << 16;
// Chunk boundaries fall on multiples of this many elements of their tensor: every chunk starts on a 64-byte line
// of every fp32 and 16-bit stream, and only a tensor's last vector is a partial one. kChunk is a multiple of it.
constexpr int64_t kAlign = 64;
// Each thread gets at least this many elements (about 7 MiB of traffic, ~0.1 ms): below it the cost of waking
// and joining threads (worse on busy, shared cores) outweighs the gain.
constexpr int64_t kMinPerThread = int64_t{1} << 18;

// The tensors of one step laid end to end: ends[t] is the end of tensor t in that concatenated element space.
struct Layout {
  const Buffers* buffers;
  const AdamCoeffs* coeffs;
  std::vector<int64_t> ends;

  int64_t total() const { return ends.empty() ? 0 : ends.back(); }
  int64_t start(size_t t) const { return t == 0 ? 0 : ends[t - 1]; }
  // The tensor holding element g (g < total()); empty tensors are skipped.
  size_t tensor_at(int64_t g) const {
    return static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), g) - ends.begin());
  }
  // Element g moved down to a multiple of kAlign of its tensor (total() stays total()). Monotonic in g and
  // at most kAlign - 1 below it, so boundaries of consecutive chunks are kChunk - kAlign + 1 or more apart.
  int64_t boundary(int64_t g) const {
    if (g >= total()) return total();
    const int64_t s = start(tensor_at(g));
    return s + (g - s) / kAlign * kAlign;
  }
  // Steps elements [lo, hi) of the concatenated space, one range call per tensor they touch.
  void run(RangeFn fn, int64_t lo, int64_t hi) const {
    for (size_t t = tensor_at(lo); lo < hi; ++t) {
      const int64_t s = start(t), end = std::min(hi, ends[t]);
      if (end > lo) fn(buffers[t], coeffs[t], lo - s, end - s);
      lo = std::max(lo, end);
    }
  }
};

}  // namespace

void adam_range_scalar(const Buffers& b, const AdamCoeffs& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float p = b.param[i];
    float m = b.exp_avg[i];
    float v = b.exp_avg_sq[i];
    adam_element(p, load_grad(b.grad, b.grad_dtype, i), m, v, c);
    b.param[i] = p;
    b.exp_avg[i] = m;
    b.exp_avg_sq[i] = v;
    store_copy(b.param_copy, b.copy_dtype, i, p);
  }
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kAuto:
    case Isa::kScalar:
      return true;
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
#endif
    default:
      return false;
  }
}

Isa best_isa() {
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kScalar:
      return "scalar";
    default:
      return "auto";
  }
}

Isa adam_step(const Buffers& b, const AdamCoeffs& c, Isa isa, int num_threads) {
  return adam_step_multi(&b, &c, 1, isa, num_threads);
}

Isa adam_step_multi(const Buffers* buffers, const AdamCoeffs* coeffs, int64_t count, Isa isa, int num_threads) {
  if (isa == Isa::kAuto) isa = best_isa();
  const RangeFn fn = range_fn(isa);
  const size_t n = static_cast<size_t>(std::max<int64_t>(count, 0));
  std::vector<int64_t> ends(n);
  int64_t total = 0;
  for (size_t t = 0; t < n; ++t) ends[t] = total += buffers[t].numel;
  // Whether the copy stays in cache depends on the whole step's traffic, not on one tensor's.
  std::vector<Buffers> own(buffers, buffers + n);
  for (Buffers& b : own) b.stream_copy = total >= kStreamCopyMin;
  const Layout layout{own.data(), coeffs, std::move(ends)};
  int threads = 1;
#ifdef _OPENMP
  if (num_threads <= 0) num_threads = omp_get_max_threads();
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, total / kMinPerThread)));
#endif
  if (threads <= 1) {
    layout.run(fn, 0, total);
    return isa;
  }
#ifdef _OPENMP
  const int64_t chunks = (total + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t k = 0; k < chunks; ++k) {
    layout.run(fn, layout.boundary(k * kChunk), layout.boundary((k + 1) * kChunk));
  }
#endif
  return isa;
}

}  // namespace cpu_adam
}  // namespace megazero
