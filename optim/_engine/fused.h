// What the fused kernel's files share (see fused.cc): the kinds, one call's work, and the entry points of the
// element loops (fused_loops.inc), which are compiled once per instruction set, each in a file of its own so the
// three compile at once: the baseline x86-64 in fused.cc, AVX2 in fused_avx2.cc, AVX-512 in fused_avx512.cc.
// Each of those files includes this header before its `#pragma GCC target`: what is defined here is compiled for
// the baseline everywhere. The loops use no template from the standard library, whose instantiations, made under
// that pragma, would be merged across the files by the linker (one build's code could run under another's).
#pragma once

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <memory>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OPTIM_X86 1
#endif

namespace ffi = xla::ffi;

namespace optim_kernel {

enum Kind : int64_t {
  kAdam = 0, kAdamWCoupled = 1, kAdamWDecoupled = 2, kLion = 3, kMomentum = 4, kDescent = 5, kNAdam = 6,
  kAdaBelief = 7, kRMSProp = 8, kRMSPropCentred = 9, kAMSGrad = 10, kRAdam = 11, kADOPT = 12, kADOPTNesterov = 13,
  kAdEMAMix = 14
};
constexpr int64_t kLastKind = kAdEMAMix;
constexpr int64_t kWidth = 16;   // scalars per member

constexpr int StateCount(int64_t kind) {
  switch (kind) {
    case kAMSGrad: case kAdEMAMix: return 3;
    case kAdam: case kAdamWCoupled: case kAdamWDecoupled: case kNAdam: case kAdaBelief: case kRMSPropCentred:
    case kRAdam: case kADOPT: case kADOPTNesterov:
      return 2;
    case kLion: case kMomentum: case kRMSProp: return 1;
    default: return 0;
  }
}

struct Work {
  int64_t kind, n;
  const float* scalars;
  std::vector<int64_t> rows, sets;   // copies: the chunks may run after the handler has returned
  int64_t ns;                        // state stacks per set (the rule's, then the EMA's average)
  std::vector<const void*> state_in;   // the sets' state stacks, set by set
  std::vector<void*> state_out;        // ... where their new values go (the same buffers when aliased)
  std::vector<const void*> x_in;       // per member: the parameter
  std::vector<void*> x_out;            // ... and its new value (in place when aliased)
  std::vector<const void*> g, g2;    // per member: the gradient (g2: its second part, or null)
  std::vector<std::vector<void*>> mirrors;   // per member: buffers that get a copy of its new value
  int64_t elem_bytes;                // the parameters' element size
};

using Runner = void (*)(const Work&, int64_t, int64_t, int64_t);

constexpr int64_t kChunk = 1 << 16;   // elements per task: ~1 MB of traffic, far above a task's scheduling cost

// Runs `range(lo, hi)` over [0, total) in `tasks` equal ranges: tasks - 1 on the pool and one here; the last to
// finish completes the returned future (no thread waits for another).
template <typename Range>
ffi::Future Spread(ffi::ThreadPool& pool, int64_t total, int64_t tasks, Range range) {
  ffi::Promise done;
  ffi::Future future(done);       // made first: a promise makes one future, before anything else holds it
  if (tasks <= 1) {
    range(int64_t(0), total);
    done.SetAvailable();
    return future;
  }
  ffi::CountDownPromise count(done, tasks);
  for (int64_t t = 1; t < tasks; ++t) {
    const int64_t lo = total * t / tasks, hi = total * (t + 1) / tasks;
    pool.Schedule([range, lo, hi, count]() mutable {
      range(lo, hi);
      count.CountDown();
    });
  }
  range(int64_t(0), total / tasks);
  count.CountDown();
  return future;
}

// One call of the one-pass quantised Adam step (fused_quantized.cc): a float32 parameter of whole blocks, its
// gradient, and its two moments as codes and scales (the first on the signed map, the second on the unsigned).
constexpr int64_t kMaxQBlock = 4096;   // numbers a block holds at most here (its moments are kept on the stack)
struct QWork {
  int64_t kind, bits, block;
  float scalars[7];                    // lr, b1, b2, eps, c1, c2, wd: the first fields of fused_loops.inc's rows
  int32_t shift[2], top[2];            // per map (m, v): see fused_quantized.inc's QMap
  uint32_t base[2];
  float half_smallest;                 // the signed map's
  float* x;                            // the parameter: updated in place
  const float* g;
  const uint8_t *mc, *vc;              // the codes and scales, old
  const float *ms, *vs;
  uint8_t *mco, *vco;                  // new (may be the old ones' buffers)
  float *mso, *vso;
};

// The build of the element loops that runs (fused.cc): 0 baseline, 1 AVX2, 2 AVX-512.
int Isa();

// The element loops' entry points, per instruction set (fused_loops.inc): the loop for a call's kind, dtypes
// (parameter, m, v), two gradient parts or one, in place or beside, with an EMA or not; and whether elements
// [lo, hi) of a float32 (bfloat16) array are all finite.
namespace base {
Runner Pick(int64_t kind, bool p, bool m1, bool m2, bool two, bool in_place, bool ema);
bool FiniteRange(bool bf16, const void* data, int64_t lo, int64_t hi);
void QuantizedBlocks(const QWork& w, int64_t lo, int64_t hi);
}  // namespace base
#ifdef OPTIM_X86
namespace avx2 {
Runner Pick(int64_t kind, bool p, bool m1, bool m2, bool two, bool in_place, bool ema);
bool FiniteRange(bool bf16, const void* data, int64_t lo, int64_t hi);
void QuantizedBlocks(const QWork& w, int64_t lo, int64_t hi);
}  // namespace avx2
namespace avx512 {
Runner Pick(int64_t kind, bool p, bool m1, bool m2, bool two, bool in_place, bool ema);
bool FiniteRange(bool bf16, const void* data, int64_t lo, int64_t hi);
void QuantizedBlocks(const QWork& w, int64_t lo, int64_t hi);
}  // namespace avx512
#endif

}  // namespace optim_kernel
