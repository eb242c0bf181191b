// The fused CPU step of optim's elementwise rules, an XLA FFI custom call (see optim/_engine/fused.py).
//
// XLA:CPU runs Adam's update as three loops over the parameter (the two moments, then the step), each reading
// and writing whole arrays; this kernel does the one pass the arithmetic needs: per element it reads x, g and
// the state and writes the new x and state, in place when the Python side aliases the operands to the results.
// Large calls are split into chunks run on XLA's intra-op thread pool; the call returns a future that the last
// chunk completes, so no thread waits for another.
//
// Operands: `scalars` (members, 16) float32, one row per member:
//   [lr, b1, b2, eps, c1, c2, wd, gs, f, d, ok, k2, flag, b3, ...] where
//   Adam, AdamW: c1, c2 the bias corrections 1/(1 - b^t); NAdam: c1 = b1/(1 - b1 b1^t), k2 = (1 - b1)/(1 - b1^t),
//   c2 = b2/(1 - b2^t); AdaBelief as Adam (wd 0); RAdam as Adam, k2 its rectification r where flag != 0;
//   ADOPT: lr, b1, b2, eps, c1 the clip t^(1/4) (inf: none), flag its first step; AMSGrad: lr, b1, b2, eps;
//   AdEMAMix: as AdamW (decay coupled), k2 its alpha, b3 the slow moment's decay;
//   RMSProp (plain, centred): lr, rho (in b1), eps; Lion: lr, b1, b2; Momentum: lr, rho (in b1); Descent: lr;
//   gs scales the gradient (a chain's ClipGlobalNorm factor, else 1), f the step (a chain's last `Scale`, else 1),
//   d is the decay of an EMA of the new parameter (attribute `ema`), ok = 0 skips the member (SkipNonFinite,
//   SkipLargeUpdates: its parameter and state keep their values, and in place nothing is written);
// then B sets of state stacks (Adam, NAdam, RAdam, ADOPT: m, v; AdaBelief: m, s; AMSGrad: m, v, its running
// maximum (of v's dtype); AdEMAMix: m, the slow moment, v (the parameter's dtype); RMSProp: q, centred also l;
// Lion: m; Momentum: v; Descent: none; then, with `ema`, the float32 average), each stack (its size, n);
// then the members' parameters x_1..x_k, n elements each, then their gradients: per member `parts[r]` (1 or 2)
// arrays of n elements, summed here (a tied parameter's gradients at its positions: summing them here saves
// writing the sum and reading it back), then per member `mirrors[r]` arrays of n elements (the model's other
// positions tied to it, only written). Attributes: `sets`, `rows`, `parts` and `mirrors`: per member its set of
// state stacks, its row in them (rows that no member names keep their values), its number of gradient arrays
// and of mirrors. Results: the state stacks, then x_1..x_k, then the mirrors, each holding its member's new
// value: aliased to their operands (updated in place, when the caller donates), or new buffers (the operands
// are then only read). Inside a caller's jit a tied parameter's other positions are outputs of their own; a
// mirror aliased to the donated buffer of such a position is written block by block as the member is (from
// cache), where XLA would otherwise copy the new value into a fresh buffer after the step. Dtypes: parameters
// (and their gradients) float32 or bfloat16, each state stack float32 or bfloat16 (alike across sets); the
// arithmetic is float32, in the order of the rules in optim/_rules/.

#include "fused.h"

namespace optim_kernel {

// The element loops, compiled three times in the same library: for the baseline x86-64 (SSE2) here, for AVX2
// (fused_avx2.cc) and for AVX-512 (F, BW, VL, DQ; fused_avx512.cc), the best the CPU has chosen at the first call
// (`Isa`). Without AVX2 the bfloat16 conversions (32 -> 16 bits, and the rounding's select) have no vector
// instruction and the loops with bfloat16 moments became compute-bound: measured on one core over 16M elements,
// Adam with bfloat16 moments 42-48 ms vs 31 with float32 ones; with AVX2 21 vs 20. AVX-512 has the 32 -> 16-bit
// narrowing in one instruction (vpmovdw): Adam with bfloat16 moments over 100 x 160k, 0.84x the float32 step
// with AVX2, 0.75x with AVX-512 (bench/NOTES.md).
// All builds compute the same bits: setup.py compiles with -ffp-contract=off (no multiply-add is contracted where
// AVX-512 has FMA), and sqrt and division are correctly rounded in every instruction set (tests/test_fused.py runs
// each build and compares).
namespace base {
#include "fused_loops.inc"
#include "fused_quantized.inc"
}  // namespace base

// The build of the loops that runs: 0 baseline, 1 AVX2, 2 AVX-512; the best this CPU has, at most the one the
// environment variable OPTIM_FUSED_ISA names (baseline, avx2 or avx512: the tests run each), read once.
int Isa() {
  static const int isa = [] {
    int best = 0;
#ifdef OPTIM_X86
    if (__builtin_cpu_supports("avx2")) best = 1;
    if (best == 1 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      best = 2;
#endif
    const char* cap = std::getenv("OPTIM_FUSED_ISA");
    if (cap != nullptr) {
      const int want = std::strcmp(cap, "baseline") == 0 ? 0 : std::strcmp(cap, "avx2") == 0 ? 1 : 2;
      best = std::min(best, want);
    }
    return best;
  }();
  return isa;
}

Runner Pick(int64_t kind, bool p, bool m1, bool m2, bool two, bool in_place, bool ema) {
#ifdef OPTIM_X86
  if (Isa() == 2) return avx512::Pick(kind, p, m1, m2, two, in_place, ema);
  if (Isa() == 1) return avx2::Pick(kind, p, m1, m2, two, in_place, ema);
#endif
  return base::Pick(kind, p, m1, m2, two, in_place, ema);
}

constexpr int64_t kBlock = 1 << 13;   // elements a member with mirrors steps before copying them out (<= 32 KB)

// Elements [lo, hi) of the members' elements laid end to end.
void RunRange(const Work& w, const Runner* run, int64_t lo, int64_t hi) {
  while (lo < hi) {
    const int64_t r = lo / w.n, i = lo % w.n, stop = std::min(hi - r * w.n, w.n);
    const Runner f = run[w.g2[r] != nullptr];
    if (w.mirrors[r].empty()) {
      f(w, r, i, stop);
    } else {   // block by block, each copied to the mirrors while it is still in cache
      const char* x = static_cast<const char*>(w.x_out[r]);
      for (int64_t b = i; b < stop; b += kBlock) {
        const int64_t e = std::min(stop, b + kBlock);
        f(w, r, b, e);
        for (void* y : w.mirrors[r])
          std::memcpy(static_cast<char*>(y) + b * w.elem_bytes, x + b * w.elem_bytes, (e - b) * w.elem_bytes);
      }
    }
    lo = r * w.n + stop;
  }
}

bool IsFloat(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

using Scalars = ffi::Buffer<ffi::F32, 2>;

// Checks the call's operands against its attributes and fills `w` (pointers, sizes) and `bf16` (whether the
// parameters, the first and the second state arrays are bfloat16) and `set_rows` (rows of each state stack).
// Returns nullptr, or what is wrong.
const char* Read(Work& w, bool bf16[3], std::vector<int64_t>& set_rows, Scalars scalars,
                 const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, int64_t kind, int64_t ema,
                 ffi::Span<const int64_t> sets, ffi::Span<const int64_t> rows, ffi::Span<const int64_t> parts,
                 ffi::Span<const int64_t> mirrors) {
  if (kind < kAdam || kind > kLastKind) return "optim_fused: unknown kind";
  if (ema != 0 && ema != 1) return "optim_fused: ema is 0 or 1";
  const int64_t own = StateCount(kind), ns = own + ema, k = int64_t(rows.size());
  int64_t ngrads = 0, nmirrors = 0;
  for (int64_t r = 0; r < int64_t(parts.size()); ++r) {
    if (parts[r] < 1 || parts[r] > 2) return "optim_fused: a member has 1 or 2 gradient arrays";
    ngrads += parts[r];
  }
  for (int64_t r = 0; r < int64_t(mirrors.size()); ++r) {
    if (mirrors[r] < 0) return "optim_fused: a negative number of mirrors";
    nmirrors += mirrors[r];
  }
  const int64_t nstate = int64_t(args.size()) - k - ngrads - nmirrors;
  if (k == 0 || int64_t(sets.size()) != k || int64_t(parts.size()) != k || int64_t(mirrors.size()) != k ||
      nstate < 0 || (ns == 0 ? nstate != 0 : nstate % ns != 0) || int64_t(rets.size()) != nstate + k + nmirrors)
    return "optim_fused: wrong number of operands";
  if (scalars.dimensions().size() != 2 || scalars.dimensions()[0] != k || scalars.dimensions()[1] != kWidth)
    return "optim_fused: scalars must be (members, 16)";
  w.kind = kind;
  w.ns = ns;
  w.scalars = scalars.typed_data();
  w.rows.assign(rows.begin(), rows.end());
  w.sets.assign(sets.begin(), sets.end());
  for (int64_t j = 0; j < nstate; ++j) {
    auto in = args.get<ffi::AnyBuffer>(j);
    auto out = rets.get<ffi::AnyBuffer>(j);
    const int64_t c = j % ns;      // a third state array has the second's dtype
    if (!in.has_value() || !out.has_value() || !IsFloat(in->element_type()) ||
        (c >= own && in->element_type() != ffi::DataType::F32) ||
        (c < own && (j >= ns || c > 1) &&
         (in->element_type() == ffi::DataType::BF16) != bf16[1 + std::min<int64_t>(c, 1)]))
      return "optim_fused: state stacks must be float32 or bfloat16, alike across sets (an EMA's float32)";
    w.state_in.push_back(in->untyped_data());
    w.state_out.push_back((*out)->untyped_data());
    if (j < own && j < 2) bf16[1 + j] = in->element_type() == ffi::DataType::BF16;
    auto d = in->dimensions();
    set_rows.push_back(d.size() == 0 ? 1 : d[0]);
  }
  w.n = 0;
  for (int64_t r = 0, at = nstate + k; r < k; at += parts[r], ++r) {
    auto x = args.get<ffi::AnyBuffer>(nstate + r);
    auto g = args.get<ffi::AnyBuffer>(at);
    auto g2 = args.get<ffi::AnyBuffer>(parts[r] == 2 ? at + 1 : at);
    auto out = rets.get<ffi::AnyBuffer>(nstate + r);
    if (!x.has_value() || !g.has_value() || !g2.has_value() || !out.has_value() || !IsFloat(x->element_type()) ||
        g->element_type() != x->element_type() || g2->element_type() != x->element_type() ||
        (r > 0 && (x->element_type() == ffi::DataType::BF16) != bf16[0]))
      return "optim_fused: parameters and gradients must share one float32 or bfloat16 dtype";
    const int64_t n = int64_t(x->element_count());
    if (r == 0) {
      w.n = n;
      bf16[0] = x->element_type() == ffi::DataType::BF16;
    }
    if (n != w.n || int64_t(g->element_count()) != n || int64_t(g2->element_count()) != n)
      return "optim_fused: members differ in size";
    if (ns > 0) {
      if (sets[r] < 0 || (sets[r] + 1) * ns > nstate || rows[r] < 0) return "optim_fused: bad set or row";
      for (int64_t j = 0; j < ns; ++j) {
        auto st = args.get<ffi::AnyBuffer>(sets[r] * ns + j);
        if (rows[r] >= set_rows[sets[r] * ns + j] || int64_t(st->element_count()) != set_rows[sets[r] * ns + j] * n)
          return "optim_fused: a state stack is not (rows, parameter size)";
      }
    }
    w.x_in.push_back(x->untyped_data());
    w.x_out.push_back((*out)->untyped_data());
    w.g.push_back(g->untyped_data());
    w.g2.push_back(parts[r] == 2 ? g2->untyped_data() : nullptr);
  }
  w.elem_bytes = bf16[0] ? 2 : 4;
  w.mirrors.resize(k);
  for (int64_t r = 0, at = nstate + k; r < k; ++r) {
    for (int64_t c = 0; c < mirrors[r]; ++c, ++at) {
      auto y = rets.get<ffi::AnyBuffer>(at);
      if (!y.has_value() || (*y)->element_type() != args.get<ffi::AnyBuffer>(nstate + r)->element_type() ||
          int64_t((*y)->element_count()) != w.n)
        return "optim_fused: a mirror is not like its member";
      w.mirrors[r].push_back((*y)->untyped_data());
    }
  }
  return nullptr;
}

// Not aliased (a call that does not donate), the new state is written beside the old: the rows that do not
// step are copied over, the others are written by the loop (one pass, not a copy and then a pass).
void CopyIdleRows(const Work& w, const std::vector<int64_t>& set_rows, const ffi::RemainingArgs& args) {
  for (int64_t j = 0; j < int64_t(w.state_in.size()); ++j) {
    if (w.state_out[j] == w.state_in[j]) continue;
    const int64_t row_bytes = int64_t(args.get<ffi::AnyBuffer>(j)->size_bytes()) / set_rows[j];
    std::vector<char> steps(set_rows[j], 0);
    for (int64_t r = 0; r < int64_t(w.rows.size()); ++r)
      if (w.sets[r] == j / w.ns) steps[w.rows[r]] = 1;
    for (int64_t row = 0; row < set_rows[j]; ++row)
      if (!steps[row])
        std::memcpy(static_cast<char*>(w.state_out[j]) + row * row_bytes,
                    static_cast<const char*>(w.state_in[j]) + row * row_bytes, row_bytes);
  }
}

// Whether to run in place: when every output is its operand (XLA aliased them); beside when none is. A mix
// (which `update` never asks for) is made in place by copying the operands over first.
bool InPlace(Work& w, const ffi::RemainingArgs& args) {
  const int64_t nstate = int64_t(w.state_in.size()), k = int64_t(w.x_in.size());
  bool same = true, apart = true;
  for (int64_t j = 0; j < nstate; ++j) (w.state_out[j] == w.state_in[j] ? apart : same) = false;
  for (int64_t r = 0; r < k; ++r) (w.x_out[r] == w.x_in[r] ? apart : same) = false;
  if (same || apart) return same;
  for (int64_t j = 0; j < nstate; ++j)
    if (w.state_out[j] != w.state_in[j]) {
      std::memcpy(w.state_out[j], w.state_in[j], args.get<ffi::AnyBuffer>(j)->size_bytes());
      w.state_in[j] = w.state_out[j];
    }
  for (int64_t r = 0; r < k; ++r)
    if (w.x_out[r] != w.x_in[r]) {
      std::memcpy(w.x_out[r], w.x_in[r], args.get<ffi::AnyBuffer>(nstate + r)->size_bytes());
      w.x_in[r] = w.x_out[r];
    }
  return true;
}

// Runs the members' elements in equal ranges on the pool (`Spread`).
ffi::Future Launch(ffi::ThreadPool& pool, std::shared_ptr<Work> w, const Runner run[2]) {
  const int64_t total = int64_t(w->x_in.size()) * w->n;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t tasks = std::min<int64_t>(threads, (total + kChunk - 1) / kChunk);
  return Spread(pool, total, tasks, [w, run0 = run[0], run1 = run[1]](int64_t lo, int64_t hi) {
    const Runner runs[2] = {run0, run1};
    RunRange(*w, runs, lo, hi);
  });
}

ffi::Future Fused(ffi::ThreadPool pool, Scalars scalars, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  int64_t kind, int64_t ema, ffi::Span<const int64_t> sets, ffi::Span<const int64_t> rows,
                  ffi::Span<const int64_t> parts, ffi::Span<const int64_t> mirrors) {
  auto w = std::make_shared<Work>();
  bool bf16[3] = {false, false, false};
  std::vector<int64_t> set_rows;
  if (const char* wrong = Read(*w, bf16, set_rows, scalars, args, rets, kind, ema, sets, rows, parts, mirrors)) {
    ffi::Promise p;
    ffi::Future f(p);
    p.SetError(ffi::Error::InvalidArgument(wrong));
    return f;
  }
  CopyIdleRows(*w, set_rows, args);
  const bool same = InPlace(*w, args);
  const Runner run[2] = {Pick(kind, bf16[0], bf16[1], bf16[2], false, same, ema),
                         Pick(kind, bf16[0], bf16[1], bf16[2], true, same, ema)};
  return Launch(pool, w, run);
}


// `optim_finite`: 1 when every element of every operand (float32 or bfloat16 arrays: a rule's gradients) is
// finite, else 0, as one float32. What SkipNonFinite asks before the step: XLA:CPU computes `all(isfinite(g))`
// as a loop writing a bool per element and a reduction over them (measured: 29 ms over 16M gradients, where
// reading them takes 4); this is one vectorised read, on the pool. An element is not finite when its exponent
// bits are all ones (Inf, NaN).
// (`FiniteRange`, in fused_loops.inc: compiled per instruction set as the element loops are.)
bool AllFinite(bool bf16, const void* data, int64_t lo, int64_t hi) {
#ifdef OPTIM_X86
  if (Isa() == 2) return avx512::FiniteRange(bf16, data, lo, hi);
  if (Isa() == 1) return avx2::FiniteRange(bf16, data, lo, hi);
#endif
  return base::FiniteRange(bf16, data, lo, hi);
}

struct FiniteWork {
  std::vector<const void*> data;
  std::vector<int64_t> sizes, starts;   // per operand: elements, and its first element among all
  std::vector<char> bf16;
  int64_t total = 0;
  std::atomic<bool> ok{true};
  float* out = nullptr;
};

void FiniteSpan(FiniteWork& w, int64_t lo, int64_t hi) {
  for (size_t j = 0; j < w.data.size() && lo < hi; ++j) {
    const int64_t a = w.starts[j], b = a + w.sizes[j];
    if (b <= lo || a >= hi) continue;
    const int64_t from = std::max(lo, a) - a, to = std::min(hi, b) - a;
    if (!AllFinite(w.bf16[j], w.data[j], from, to)) w.ok.store(false, std::memory_order_relaxed);
  }
}

using Flag = ffi::Buffer<ffi::F32, 0>;

ffi::Future Finite(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::Result<Flag> out) {
  auto w = std::make_shared<FiniteWork>();
  for (size_t j = 0; j < args.size(); ++j) {
    auto a = args.get<ffi::AnyBuffer>(j);
    if (!a.has_value() || !IsFloat(a->element_type())) {
      ffi::Promise p;
      ffi::Future f(p);
      p.SetError(ffi::Error::InvalidArgument("optim_finite: operands must be float32 or bfloat16"));
      return f;
    }
    w->data.push_back(a->untyped_data());
    w->sizes.push_back(int64_t(a->element_count()));
    w->starts.push_back(w->total);
    w->bf16.push_back(a->element_type() == ffi::DataType::BF16);
    w->total += int64_t(a->element_count());
  }
  w->out = out->typed_data();
  ffi::Promise done;
  ffi::Future future(done);
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(threads, w->total / (4 * kChunk)));
  if (tasks <= 1) {
    FiniteSpan(*w, 0, w->total);
    *w->out = w->ok.load() ? 1.f : 0.f;
    done.SetAvailable();
    return future;
  }
  // The last task to finish writes the result, then completes the future.
  auto left = std::make_shared<std::atomic<int64_t>>(tasks);
  auto finish = [w, left, done]() mutable {
    if (left->fetch_sub(1) == 1) {
      *w->out = w->ok.load() ? 1.f : 0.f;
      done.SetAvailable();
    }
  };
  for (int64_t t = 1; t < tasks; ++t) {
    const int64_t lo = w->total * t / tasks, hi = w->total * (t + 1) / tasks;
    pool.Schedule([w, lo, hi, finish]() mutable {
      FiniteSpan(*w, lo, hi);
      finish();
    });
  }
  FiniteSpan(*w, 0, w->total / tasks);
  finish();
  return future;
}

}  // namespace optim_kernel

XLA_FFI_DEFINE_HANDLER(kOptimFused, optim_kernel::Fused,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<optim_kernel::Scalars>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attr<int64_t>("kind")
                           .Attr<int64_t>("ema")
                           .Attr<ffi::Span<const int64_t>>("sets")
                           .Attr<ffi::Span<const int64_t>>("rows")
                           .Attr<ffi::Span<const int64_t>>("parts")
                           .Attr<ffi::Span<const int64_t>>("mirrors"));

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* optim_fused(XLA_FFI_CallFrame* call_frame) {
  return kOptimFused(call_frame);
}

XLA_FFI_DEFINE_HANDLER(kOptimFinite, optim_kernel::Finite,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .RemainingArgs()
                           .Ret<optim_kernel::Flag>());

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* optim_finite(XLA_FFI_CallFrame* call_frame) {
  return kOptimFinite(call_frame);
}

// Which build of the element loops this process runs (see `Isa`), for optim.info().
extern "C" __attribute__((visibility("default"))) int optim_isa() { return optim_kernel::Isa(); }
