// The fused kernel's element loops (fused_loops.inc) built for AVX-512 (F, BW, VL, DQ); fused.cc picks them where
// the CPU has it. A file of its own so that it compiles beside the others (setup.py compiles the kernel's files at
// once).
#include "fused.h"

#ifdef OPTIM_X86
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace optim_kernel {
namespace avx512 {
#include "fused_loops.inc"
#include "fused_quantized.inc"
}  // namespace avx512
}  // namespace optim_kernel
#endif
