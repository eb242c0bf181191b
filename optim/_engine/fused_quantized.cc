// `optim_adam_quantized`: the one-pass CPU step of Adam and AdamW with quantised moments, an XLA FFI custom call
// (see optim/_engine/onepass.py, which lowers its primitive to this on one CPU device).
//
// XLA:CPU stores a blockwise-quantised moment in several passes over the parameter: the moments dequantised and
// stepped, each block's maximum, then the codes, with float32 moments written between them. This call reads
// each block once (parameter, gradient, codes, scales) and writes it once (parameter, codes, scales); blocks
// are split into chunks run on XLA's intra-op thread pool, as the fused kernel's elements are (fused.cc).
//
// Operands: `scalars` (7,) float32: lr, b1, b2, eps, c1, c2 (the bias corrections 1/(1 - b^t)), wd; the
// parameter x and its gradient g (float32, blocks x block numbers), the first moment's codes (uint8, blocks x
// block * bits / 8) and scales (float32, blocks), the second moment's. Results: x, the codes and the scales,
// new, in their operands' buffers (onepass aliases them) or in buffers of their own (a block's codes are read
// before they are written). Attributes: `kind` (Adam, AdamW coupled or decoupled, as
// fused.h's kinds), `bits` (8 or 4), `mantissa` (the code maps' mantissa bits, per
// optim._rules.quantized.MANTISSA).

#include "fused.h"

namespace optim_kernel {

// A map's constants as optim._rules.quantized._map computes them.
void MapOf(QWork& w, int j, int64_t bits, int64_t mantissa, bool sign) {
  w.shift[j] = int32_t(23 - mantissa);
  w.top[j] = int32_t((int64_t(1) << (bits - sign)) - 1);
  w.base[j] = 0x3F800000u - (uint32_t(w.top[j]) << w.shift[j]);
  if (sign) {
    const uint32_t smallest = w.base[j] + (uint32_t(1) << w.shift[j]);
    float f;
    std::memcpy(&f, &smallest, 4);
    w.half_smallest = f / 2;
  }
}

void Blocks(const QWork& w, int64_t lo, int64_t hi) {
#ifdef OPTIM_X86
  if (Isa() == 2) return avx512::QuantizedBlocks(w, lo, hi);
  if (Isa() == 1) return avx2::QuantizedBlocks(w, lo, hi);
#endif
  base::QuantizedBlocks(w, lo, hi);
}

ffi::Future Error(const char* what) {
  ffi::Promise p;
  ffi::Future f(p);
  p.SetError(ffi::Error::InvalidArgument(what));
  return f;
}

using F32 = ffi::Buffer<ffi::F32>;
using U8 = ffi::Buffer<ffi::U8>;

ffi::Future AdamQuantized(ffi::ThreadPool pool, F32 scalars, F32 x, F32 g, U8 mc, F32 ms, U8 vc, F32 vs,
                          ffi::Result<F32> xo, ffi::Result<U8> mco, ffi::Result<F32> mso, ffi::Result<U8> vco,
                          ffi::Result<F32> vso, int64_t kind, int64_t bits, int64_t mantissa) {
  if (kind != kAdam && kind != kAdamWCoupled && kind != kAdamWDecoupled)
    return Error("optim_adam_quantized: kind is Adam or AdamW");
  if ((bits != 8 && bits != 4) || mantissa < 1 || mantissa > 7) return Error("optim_adam_quantized: a bad code map");
  const int64_t nb = int64_t(ms.element_count()), n = int64_t(x.element_count());
  if (nb == 0 || n % nb != 0 || n / nb > kMaxQBlock || (n / nb) % 2 != 0 || int64_t(g.element_count()) != n ||
      int64_t(vs.element_count()) != nb || int64_t(mc.element_count()) != n * bits / 8 ||
      int64_t(vc.element_count()) != n * bits / 8 || scalars.element_count() != 7)
    return Error("optim_adam_quantized: operands of mismatched sizes");
  auto w = std::make_shared<QWork>();
  w->kind = kind;
  w->bits = bits;
  w->block = n / nb;
  std::memcpy(w->scalars, scalars.typed_data(), sizeof(w->scalars));
  MapOf(*w, 0, bits, mantissa, true);
  MapOf(*w, 1, bits, mantissa, false);
  // The new parameter is the old one's buffer (onepass aliases them; XLA copies an operand that is not
  // donated): stepped in place. A caller's separate result gets the operand first.
  if (x.typed_data() != xo->typed_data()) std::memcpy(xo->typed_data(), x.typed_data(), n * sizeof(float));
  w->x = xo->typed_data();
  w->g = g.typed_data();
  w->mc = mc.typed_data();
  w->vc = vc.typed_data();
  w->ms = ms.typed_data();
  w->vs = vs.typed_data();
  w->mco = mco->typed_data();
  w->vco = vco->typed_data();
  w->mso = mso->typed_data();
  w->vso = vso->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t tasks = std::min<int64_t>(threads, n / kChunk);
  return Spread(pool, nb, tasks, [w](int64_t lo, int64_t hi) { Blocks(*w, lo, hi); });
}

}  // namespace optim_kernel

XLA_FFI_DEFINE_HANDLER(kOptimAdamQuantized, optim_kernel::AdamQuantized,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<optim_kernel::F32>()
                           .Arg<optim_kernel::F32>()
                           .Arg<optim_kernel::F32>()
                           .Arg<optim_kernel::U8>()
                           .Arg<optim_kernel::F32>()
                           .Arg<optim_kernel::U8>()
                           .Arg<optim_kernel::F32>()
                           .Ret<optim_kernel::F32>()
                           .Ret<optim_kernel::U8>()
                           .Ret<optim_kernel::F32>()
                           .Ret<optim_kernel::U8>()
                           .Ret<optim_kernel::F32>()
                           .Attr<int64_t>("kind")
                           .Attr<int64_t>("bits")
                           .Attr<int64_t>("mantissa"));

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* optim_adam_quantized(XLA_FFI_CallFrame* call_frame) {
  return kOptimAdamQuantized(call_frame);
}
