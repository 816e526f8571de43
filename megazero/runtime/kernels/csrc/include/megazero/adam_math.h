// One Adam/AdamW element update, shared by the CPU kernels (scalar path and vector tails) and the CUDA
// multi-tensor kernel, so every backend runs the same sequence of IEEE operations.
//
// The order of operations follows torch.optim.AdamW(foreach=False) on a vectorised CPU build:
//   g  = maximize ? -g : g
//   g  = fma(p, weight_decay, g)                      (classic Adam with L2, weight_decay != 0)
//   p  = p * (1 - lr * weight_decay)                  (AdamW, weight_decay != 0)
//   m  = fma(1 - beta1, g - m, m)                     (torch.lerp; fma(-beta1, g - m, g) when 1 - beta1 >= 0.5)
//   v  = fma((1 - beta2) * g, g, v * beta2)           (mul_ then addcmul_)
//   p  = p + (-step_size * m) / fma(sqrt(v), 1 / sqrt(bc2), eps)
// with step_size = lr / bc1, bc1 = 1 - beta1^step and bc2 = 1 - beta2^step (both 1 without bias correction).
// The one departure from torch: torch divides sqrt(v) by sqrt(bc2) and then adds eps; a multiply by the host's
// reciprocal fused with the add frees the divider (the kernel's bottleneck once data is in cache) and changes
// denom by at most an ulp or so. sqrt, division and fma are correctly rounded everywhere and every fma is
// explicit (no other a*b+c may be contracted: see MZ_MUL), so all backends agree bit for bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MZ_HOST_DEVICE __host__ __device__
#else
#define MZ_HOST_DEVICE
#endif

// Plain multiply/add/subtract that no compiler may fuse into an fma: nvcc contracts a*b + c by default, even
// across statements (p * decay, then p + update), so device code uses the _rn intrinsics, which are never
// contracted. Host code is built with -ffp-contract=off.
#if defined(__CUDA_ARCH__)
#define MZ_MUL(a, b) __fmul_rn((a), (b))
#define MZ_ADD(a, b) __fadd_rn((a), (b))
#define MZ_SUB(a, b) __fsub_rn((a), (b))
#else
#define MZ_MUL(a, b) ((a) * (b))
#define MZ_ADD(a, b) ((a) + (b))
#define MZ_SUB(a, b) ((a) - (b))
#endif

namespace megazero {

// Per-step constants, computed once on the host in double and rounded to float as torch does.
struct AdamCoeffs {
  float decay;          // AdamW: p *= decay (= 1 - lr * weight_decay)
  float l2;             // classic Adam: g += l2 * p (= weight_decay)
  float lerp_weight;    // m = fma(lerp_weight, g - m, lerp_small ? m : g)
  float beta2;
  float one_minus_beta2;
  float inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^step), 1 without bias correction
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  bool apply_decay;
  bool apply_l2;
  bool lerp_small;
  bool maximize;
};

inline AdamCoeffs make_adam_coeffs(double lr, double beta1, double beta2, double eps, double weight_decay,
                                   int64_t step, bool adamw_mode, bool bias_correction, bool maximize) {
  AdamCoeffs c;
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  const float w = static_cast<float>(1.0 - beta1);
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.l2 = static_cast<float>(weight_decay);
  c.lerp_small = w < 0.5f;
  c.lerp_weight = c.lerp_small ? w : w - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-(lr / bc1));
  c.apply_decay = adamw_mode && weight_decay != 0.0;
  c.apply_l2 = !adamw_mode && weight_decay != 0.0;
  c.maximize = maximize;
  return c;
}

MZ_HOST_DEVICE inline void adam_element(float& p, float g, float& m, float& v, const AdamCoeffs& c) {
  if (c.maximize) g = -g;
  if (c.apply_l2) g = fmaf(p, c.l2, g);
  if (c.apply_decay) p = MZ_MUL(p, c.decay);
  const float diff = MZ_SUB(g, m);
  m = fmaf(c.lerp_weight, diff, c.lerp_small ? m : g);
  v = fmaf(MZ_MUL(c.one_minus_beta2, g), g, MZ_MUL(v, c.beta2));
  const float denom = fmaf(sqrtf(v), c.inv_bc2_sqrt, c.eps);
  p = MZ_ADD(p, MZ_MUL(c.neg_step_size, m) / denom);
}

// bfloat16 <-> float, round to nearest even, NaN -> 0x7FC0 (as c10::BFloat16).
MZ_HOST_DEVICE inline float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

MZ_HOST_DEVICE inline uint16_t float_to_bf16_bits(float f) {
  if (f != f) return 0x7FC0;
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half <-> float without F16C, round to nearest even (the FP16 library's bit tricks, as c10::Half).
inline float fp16_bits_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  uint32_t bits = (two_w >> 4) + (0xE0u << 23);
  float normalized;
  memcpy(&normalized, &bits, sizeof(bits));
  normalized *= 0x1.0p-112f;
  bits = (two_w >> 17) | (126u << 23);
  float denormalized;
  memcpy(&denormalized, &bits, sizeof(bits));
  denormalized -= 0.5f;
  uint32_t out;
  if (two_w < (1u << 27)) {
    memcpy(&out, &denormalized, sizeof(out));
  } else {
    memcpy(&out, &normalized, sizeof(out));
  }
  out |= sign;
  float f;
  memcpy(&f, &out, sizeof(f));
  return f;
}

inline uint16_t float_to_fp16_bits(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t w;
  memcpy(&w, &f, sizeof(w));
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  const uint32_t bias_bits = (bias >> 1) + 0x07800000u;
  float bias_f;
  memcpy(&bias_f, &bias_bits, sizeof(bias_f));
  base = bias_f + base;
  uint32_t bits;
  memcpy(&bits, &base, sizeof(bits));
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

}  // namespace megazero
