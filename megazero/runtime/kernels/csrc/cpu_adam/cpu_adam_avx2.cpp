// AVX2 + FMA + F16C path of the CPU Adam kernel: 8 floats per vector. The tail (fewer than 8 elements) is
// staged through small stack buffers and run through the same vector code, so every element sees exactly
// the same operations. Compiled without -mavx2: every function carries a target attribute and has internal
// linkage; the run-time check lives in cpu_adam.cpp (isa_supported).
#include "cpu_adam.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <cstring>

#define MZ_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace megazero {
namespace cpu_adam {
namespace {

template <DType G>
MZ_AVX2 inline __m256 load_grad(const void* grad, int64_t i) {
  if constexpr (G == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    if constexpr (G == DType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Round to nearest even as float_to_bf16_bits; NaN -> 0x7FC0.
MZ_AVX2 inline __m128i to_bf16(__m256 p) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Every lane is <= 0xFFFF, so unsigned saturation is exact.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Aligned vectors of a large copy go around the cache (non-temporal), saving the read-for-ownership.
template <DType C>
MZ_AVX2 inline void store_copy(void* copy, int64_t i, __m256 p, bool stream) {
  if constexpr (C != DType::kNone) {
    __m128i h;
    if constexpr (C == DType::kBFloat16) {
      h = to_bf16(p);
    } else {
      h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(copy) + i);
    if (stream && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
      _mm_stream_si128(dst, h);
    } else {
      _mm_storeu_si128(dst, h);
    }
  }
}

struct VecCoeffs {
  __m256 decay, l2, lerp_weight, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size, sign;
};

MZ_AVX2 inline VecCoeffs broadcast(const AdamCoeffs& c) {
  return {_mm256_set1_ps(c.decay),     _mm256_set1_ps(c.l2),          _mm256_set1_ps(c.lerp_weight),
          _mm256_set1_ps(c.beta2),     _mm256_set1_ps(c.one_minus_beta2), _mm256_set1_ps(c.inv_bc2_sqrt),
          _mm256_set1_ps(c.eps),       _mm256_set1_ps(c.neg_step_size), _mm256_set1_ps(-0.0f)};
}

// The vector twin of adam_element (adam_math.h): the same operations in the same order.
template <DType G, DType C>
MZ_AVX2 inline void step8(const Buffers& b, const AdamCoeffs& c, const VecCoeffs& k, int64_t i, bool stream) {
  __m256 p = _mm256_loadu_ps(b.param + i);
  __m256 m = _mm256_loadu_ps(b.exp_avg + i);
  __m256 v = _mm256_loadu_ps(b.exp_avg_sq + i);
  __m256 g = load_grad<G>(b.grad, i);
  if (c.maximize) g = _mm256_xor_ps(g, k.sign);
  if (c.apply_l2) g = _mm256_fmadd_ps(p, k.l2, g);
  if (c.apply_decay) p = _mm256_mul_ps(p, k.decay);
  const __m256 diff = _mm256_sub_ps(g, m);
  m = _mm256_fmadd_ps(k.lerp_weight, diff, c.lerp_small ? m : g);
  v = _mm256_fmadd_ps(_mm256_mul_ps(k.one_minus_beta2, g), g, _mm256_mul_ps(v, k.beta2));
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), k.inv_bc2_sqrt, k.eps);
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(k.neg_step_size, m), denom));
  _mm256_storeu_ps(b.param + i, p);
  _mm256_storeu_ps(b.exp_avg + i, m);
  _mm256_storeu_ps(b.exp_avg_sq + i, v);
  store_copy<C>(b.param_copy, i, p, stream);
}

size_t element_size(DType t) { return t == DType::kFloat32 ? 4 : (t == DType::kNone ? 0 : 2); }

// Copies the last `left` (< 8) elements into zero-padded buffers, steps them there and copies them back.
template <DType G, DType C>
MZ_AVX2 void step_tail(const Buffers& b, const AdamCoeffs& c, const VecCoeffs& k, int64_t i, int64_t left) {
  alignas(32) float p[8] = {}, m[8] = {}, v[8] = {}, g[8] = {};
  alignas(32) uint16_t copy[8] = {};
  const size_t gsize = element_size(b.grad_dtype), csize = element_size(b.copy_dtype);
  std::memcpy(p, b.param + i, left * 4);
  std::memcpy(m, b.exp_avg + i, left * 4);
  std::memcpy(v, b.exp_avg_sq + i, left * 4);
  std::memcpy(g, static_cast<const char*>(b.grad) + i * gsize, left * gsize);
  const Buffers t{p, g, m, v, copy, 8, b.grad_dtype, b.copy_dtype};
  step8<G, C>(t, c, k, 0, false);
  std::memcpy(b.param + i, p, left * 4);
  std::memcpy(b.exp_avg + i, m, left * 4);
  std::memcpy(b.exp_avg_sq + i, v, left * 4);
  if (csize) std::memcpy(static_cast<char*>(b.param_copy) + i * csize, copy, left * csize);
}

// Software prefetch of the 64-byte lines kPrefetch elements ahead (see cpu_adam_avx512.cpp).
constexpr int64_t kPrefetch = 512;

template <DType G>
MZ_AVX2 inline void prefetch_line(const Buffers& b, int64_t i) {
  _mm_prefetch(reinterpret_cast<const char*>(b.param + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(b.exp_avg_sq + i), _MM_HINT_T0);
  const int64_t gbytes = G == DType::kFloat32 ? 4 : 2;
  if (G == DType::kFloat32 || i % 32 == 0) {
    _mm_prefetch(static_cast<const char*>(b.grad) + i * gbytes, _MM_HINT_T0);
  }
}

template <DType G, DType C>
MZ_AVX2 void run(const Buffers& b, const AdamCoeffs& c, int64_t begin, int64_t end) {
  const VecCoeffs k = broadcast(c);
  const bool stream = b.stream_copy;
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    if (i + kPrefetch + 16 <= end) prefetch_line<G>(b, i + kPrefetch);
    step8<G, C>(b, c, k, i, stream);
    step8<G, C>(b, c, k, i + 8, stream);
  }
  for (; i + 8 <= end; i += 8) step8<G, C>(b, c, k, i, stream);
  if (i < end) step_tail<G, C>(b, c, k, i, end - i);
  if (C != DType::kNone && stream) _mm_sfence();
}

template <DType G>
MZ_AVX2 void run_grad(const Buffers& b, const AdamCoeffs& c, int64_t begin, int64_t end) {
  switch (b.copy_dtype) {
    case DType::kBFloat16:
      return run<G, DType::kBFloat16>(b, c, begin, end);
    case DType::kFloat16:
      return run<G, DType::kFloat16>(b, c, begin, end);
    default:
      return run<G, DType::kNone>(b, c, begin, end);
  }
}

}  // namespace

void adam_range_avx2(const Buffers& b, const AdamCoeffs& c, int64_t begin, int64_t end) {
  switch (b.grad_dtype) {
    case DType::kBFloat16:
      return run_grad<DType::kBFloat16>(b, c, begin, end);
    case DType::kFloat16:
      return run_grad<DType::kFloat16>(b, c, begin, end);
    default:
      return run_grad<DType::kFloat32>(b, c, begin, end);
  }
}

}  // namespace cpu_adam
}  // namespace megazero

#endif  // x86-64
