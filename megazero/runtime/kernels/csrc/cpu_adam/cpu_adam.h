// CPU Adam/AdamW over flat fp32 buffers: one pass over memory per step (read p, g, m, v; write p, m, v and,
// optionally, a bf16/fp16 copy of p), AVX-512 / AVX2 / scalar paths chosen at run time, OpenMP across threads.
// Plain C++ over raw pointers: no torch headers here (bindings.cpp is the thin torch layer).
#pragma once

#include <cstdint>

#include "megazero/adam_math.h"

namespace megazero {
namespace cpu_adam {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kNone = 3 };

// Instruction sets, best last. kAuto picks the best one this CPU supports.
enum class Isa : int { kAuto = -1, kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

struct Buffers {
  float* param;
  const void* grad;       // grad_dtype elements
  float* exp_avg;
  float* exp_avg_sq;
  void* param_copy;       // copy_dtype elements, or nullptr when copy_dtype == kNone
  int64_t numel;
  DType grad_dtype;
  DType copy_dtype;
};

// Kernel over elements [begin, end) of the buffers; one per instruction set.
using RangeFn = void (*)(const Buffers&, const AdamCoeffs&, int64_t begin, int64_t end);

void adam_range_scalar(const Buffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);
// Defined only on x86-64 (cpu_adam_avx2.cpp, cpu_adam_avx512.cpp).
void adam_range_avx2(const Buffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);
void adam_range_avx512(const Buffers& b, const AdamCoeffs& c, int64_t begin, int64_t end);

bool isa_supported(Isa isa);
Isa best_isa();
const char* isa_name(Isa isa);

// One optimizer step over all `b.numel` elements using `num_threads` OpenMP threads (<= 0: all of them).
// `isa` must be kAuto or supported (check isa_supported first); returns the instruction set used.
Isa adam_step(const Buffers& b, const AdamCoeffs& c, Isa isa, int num_threads);

}  // namespace cpu_adam
}  // namespace megazero
