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

// Steps over at least this many elements (all tensors of the step together) write their bf16/fp16 copy with
// non-temporal stores (4 MiB of copy or more: it would not stay in cache anyway).
constexpr int64_t kStreamCopyMin = int64_t{1} << 21;

struct Buffers {
  float* param;
  const void* grad;       // grad_dtype elements
  float* exp_avg;
  float* exp_avg_sq;
  void* param_copy;       // copy_dtype elements, or nullptr when copy_dtype == kNone
  int64_t numel;
  DType grad_dtype;
  DType copy_dtype;
  bool stream_copy = false;  // non-temporal copy stores; adam_step / adam_step_multi set it (kStreamCopyMin)
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

// One optimizer step over `count` tensors, tensor i with its own buffers[i] and coefficients coeffs[i] (e.g.
// its own lr and weight decay), in ONE parallel region: the tensors' elements, laid end to end, are cut into
// chunks of about 64K elements that threads take dynamically, across tensor boundaries, so many small tensors
// run as fast as one large one. Every element sees the same operations as in adam_step, so the results equal
// adam_step(buffers[i], coeffs[i], ...) per tensor bit for bit. Same `isa` and `num_threads` rules.
Isa adam_step_multi(const Buffers* buffers, const AdamCoeffs* coeffs, int64_t count, Isa isa, int num_threads);

}  // namespace cpu_adam
}  // namespace megazero
