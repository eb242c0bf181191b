// The fused CPU step of optim's elementwise rules, an XLA FFI custom call (see optim/_engine/fused.py).
//
// XLA:CPU runs Adam's update as three loops over the parameter (the two moments, then the step), each reading
// and writing whole arrays; this kernel does the one pass the arithmetic needs: per element it reads x, g and
// the state and writes the new x and state, in place when the Python side aliases the operands to the results.
// Large calls are split into chunks run on XLA's intra-op thread pool; the call returns a future that the last
// chunk completes, so no thread waits for another.
//
// Operands: `scalars` (members, 8) float32, one row per member:
//   [lr, b1, b2, eps, c1, c2, wd, gs] (Adam, AdamW: c1, c2 the bias corrections 1/(1 - b^t)),
//   [lr, b1, b2, ., ., ., ., gs] (Lion), [lr, rho, ..., gs] (Momentum), [lr, ..., gs] (Descent),
//   where gs scales the gradient (a chain's ClipGlobalNorm factor, else 1);
// then B sets of state stacks (Adam: m, v; Lion: m; Momentum: v; Descent: none), each stack (its size, n);
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Kind : int64_t { kAdam = 0, kAdamWCoupled = 1, kAdamWDecoupled = 2, kLion = 3, kMomentum = 4, kDescent = 5 };

constexpr int StateCount(int64_t kind) {
  switch (kind) {
    case kAdam: case kAdamWCoupled: case kAdamWDecoupled: return 2;
    case kLion: case kMomentum: return 1;
    default: return 0;
  }
}

// bfloat16 as XLA stores it: the high half of a float32, rounded to nearest even.
struct BF16 { uint16_t bits; };

inline float Load(float v) { return v; }
inline float Load(BF16 v) {
  uint32_t u = uint32_t(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename T> inline T Store(float f);
template <> inline float Store<float>(float f) { return f; }
template <> inline BF16 Store<BF16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{uint16_t((u >> 16) | 0x40)};   // NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return BF16{uint16_t(u >> 16)};
}

struct Work {
  int64_t kind, n;
  const float* scalars;
  std::vector<int64_t> rows, sets;   // copies: the chunks may run after the handler has returned
  int64_t ns;                        // state stacks per set
  std::vector<const void*> state_in;   // the sets' state stacks, set by set
  std::vector<void*> state_out;        // ... where their new values go (the same buffers when aliased)
  std::vector<const void*> x_in;       // per member: the parameter
  std::vector<void*> x_out;            // ... and its new value (in place when aliased)
  std::vector<const void*> g, g2;    // per member: the gradient (g2: its second part, or null)
  std::vector<std::vector<void*>> mirrors;   // per member: buffers that get a copy of its new value
  int64_t elem_bytes;                // the parameters' element size
};

struct Scalars8 { float lr, b1, b2, eps, c1, c2, wd, gs; };

// One element: the new parameter, and the new state values `m` and `v` (those the rule has), from the parameter
// `x`, the (scaled) gradient `g` and the old state values. In the order of optim/_rules/'s rules.
template <int64_t K>
inline float Elem(const Scalars8& s, float x, float g, float& m, float& v) {
  float step;
  if constexpr (K == kAdam || K == kAdamWCoupled || K == kAdamWDecoupled) {
    m = s.b1 * m + (1 - s.b1) * g;
    v = s.b2 * v + (1 - s.b2) * (g * g);
    const float a = m * s.c1 / (std::sqrt(v * s.c2) + s.eps);
    if constexpr (K == kAdam) step = a * s.lr;
    else if constexpr (K == kAdamWCoupled) step = s.lr * (a + s.wd * x);
    else step = s.lr * a + s.wd * x;
  } else if constexpr (K == kLion) {
    const float u = s.b1 * m + (1 - s.b1) * g;
    step = u != u ? u : s.lr * float((u > 0) - (u < 0));   // sign, NaN kept (as jnp.sign)
    m = s.b2 * m + (1 - s.b2) * g;
  } else if constexpr (K == kMomentum) {
    m = s.b1 * m + s.lr * g;     // b1 is rho
    step = m;
  } else {
    step = s.lr * g;
  }
  return x - step;
}

// The gradient of element i: its parts summed in the parameter's dtype, as XLA sums tied gradients (a bfloat16
// sum is rounded), then scaled.
template <typename P, bool Two>
inline float Grad(const P* g, const P* g2, int64_t i, float gs) {
  return (Two ? Load(Store<P>(Load(g[i]) + Load(g2[i]))) : Load(g[i])) * gs;
}

// In place: each array is read and written through one pointer (the loop the compiler vectorises).
template <int64_t K, typename P, typename M1, typename M2, bool Two>
void LoopSame(const Scalars8& s, P* x, const P* g, const P* g2, M1* m, M2* v, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    float mi = StateCount(K) > 0 ? Load(m[i]) : 0.f, vi = StateCount(K) > 1 ? Load(v[i]) : 0.f;
    x[i] = Store<P>(Elem<K>(s, Load(x[i]), Grad<P, Two>(g, g2, i, s.gs), mi, vi));
    if constexpr (StateCount(K) > 0) m[i] = Store<M1>(mi);
    if constexpr (StateCount(K) > 1) v[i] = Store<M2>(vi);
  }
}

// Beside: new arrays that do not overlap the old (restrict: else the compiler would check at run time for
// overlaps between seven pointers, beyond its limit, and not vectorise).
template <int64_t K, typename P, typename M1, typename M2, bool Two>
void LoopApart(const Scalars8& s, const P* __restrict__ x, P* __restrict__ xo, const P* __restrict__ g,
               const P* __restrict__ g2, const M1* __restrict__ m, M1* __restrict__ mo, const M2* __restrict__ v,
               M2* __restrict__ vo, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    float mi = StateCount(K) > 0 ? Load(m[i]) : 0.f, vi = StateCount(K) > 1 ? Load(v[i]) : 0.f;
    xo[i] = Store<P>(Elem<K>(s, Load(x[i]), Grad<P, Two>(g, g2, i, s.gs), mi, vi));
    if constexpr (StateCount(K) > 0) mo[i] = Store<M1>(mi);
    if constexpr (StateCount(K) > 1) vo[i] = Store<M2>(vi);
  }
}

// Elements [lo, hi) of member r.
template <int64_t K, typename P, typename M1, typename M2, bool Two, bool InPlace>
void Run(const Work& w, int64_t r, int64_t lo, int64_t hi) {
  Scalars8 s;
  std::memcpy(&s, w.scalars + 8 * r, sizeof s);
  const P* g = static_cast<const P*>(w.g[r]);
  const P* g2 = static_cast<const P*>(w.g2[r]);
  const int64_t at = w.rows[r] * w.n, set = w.sets[r] * w.ns;
  M1* mo = StateCount(K) > 0 ? static_cast<M1*>(w.state_out[set]) + at : nullptr;
  M2* vo = StateCount(K) > 1 ? static_cast<M2*>(w.state_out[set + 1]) + at : nullptr;
  if constexpr (InPlace) {
    LoopSame<K, P, M1, M2, Two>(s, static_cast<P*>(w.x_out[r]), g, g2, mo, vo, lo, hi);
  } else {
    const M1* m = StateCount(K) > 0 ? static_cast<const M1*>(w.state_in[set]) + at : nullptr;
    const M2* v = StateCount(K) > 1 ? static_cast<const M2*>(w.state_in[set + 1]) + at : nullptr;
    LoopApart<K, P, M1, M2, Two>(s, static_cast<const P*>(w.x_in[r]), static_cast<P*>(w.x_out[r]), g, g2, m, mo,
                                 v, vo, lo, hi);
  }
}

using Runner = void (*)(const Work&, int64_t, int64_t, int64_t);

// The loop for one call: kind, dtypes (parameter, m, v), whether a member has two gradient parts, in place.
// Rules without a second (first) state array ignore its dtype: fewer instantiations.
template <int64_t K, typename P, typename M1, typename M2>
Runner Pick3(bool two, bool in_place) {
  if (two) return in_place ? &Run<K, P, M1, M2, true, true> : &Run<K, P, M1, M2, true, false>;
  return in_place ? &Run<K, P, M1, M2, false, true> : &Run<K, P, M1, M2, false, false>;
}
template <int64_t K, typename P, typename M1>
Runner Pick2(bool m2_bf16, bool two, bool in_place) {
  if (StateCount(K) < 2 || !m2_bf16) return Pick3<K, P, M1, float>(two, in_place);
  return Pick3<K, P, M1, BF16>(two, in_place);
}
template <int64_t K, typename P>
Runner Pick1(bool m1_bf16, bool m2_bf16, bool two, bool in_place) {
  if (StateCount(K) < 1 || !m1_bf16) return Pick2<K, P, float>(m2_bf16, two, in_place);
  return Pick2<K, P, BF16>(m2_bf16, two, in_place);
}
template <int64_t K>
Runner Pick0(bool p_bf16, bool m1_bf16, bool m2_bf16, bool two, bool in_place) {
  return p_bf16 ? Pick1<K, BF16>(m1_bf16, m2_bf16, two, in_place) : Pick1<K, float>(m1_bf16, m2_bf16, two, in_place);
}
Runner Pick(int64_t kind, bool p, bool m1, bool m2, bool two, bool in_place) {
  switch (kind) {
    case kAdam: return Pick0<kAdam>(p, m1, m2, two, in_place);
    case kAdamWCoupled: return Pick0<kAdamWCoupled>(p, m1, m2, two, in_place);
    case kAdamWDecoupled: return Pick0<kAdamWDecoupled>(p, m1, m2, two, in_place);
    case kLion: return Pick0<kLion>(p, m1, m2, two, in_place);
    case kMomentum: return Pick0<kMomentum>(p, m1, m2, two, in_place);
    case kDescent: return Pick0<kDescent>(p, m1, m2, two, in_place);
  }
  return nullptr;
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

constexpr int64_t kChunk = 1 << 16;   // elements per task: ~1 MB of traffic, far above a task's scheduling cost

using Scalars = ffi::Buffer<ffi::F32, 2>;

// Checks the call's operands against its attributes and fills `w` (pointers, sizes) and `bf16` (whether the
// parameters, the first and the second state arrays are bfloat16) and `set_rows` (rows of each state stack).
// Returns nullptr, or what is wrong.
const char* Read(Work& w, bool bf16[3], std::vector<int64_t>& set_rows, Scalars scalars,
                 const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, int64_t kind,
                 ffi::Span<const int64_t> sets, ffi::Span<const int64_t> rows, ffi::Span<const int64_t> parts,
                 ffi::Span<const int64_t> mirrors) {
  if (kind < kAdam || kind > kDescent) return "optim_fused: unknown kind";
  const int64_t ns = StateCount(kind), k = int64_t(rows.size());
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
  if (scalars.dimensions().size() != 2 || scalars.dimensions()[0] != k || scalars.dimensions()[1] != 8)
    return "optim_fused: scalars must be (members, 8)";
  w.kind = kind;
  w.ns = ns;
  w.scalars = scalars.typed_data();
  w.rows.assign(rows.begin(), rows.end());
  w.sets.assign(sets.begin(), sets.end());
  for (int64_t j = 0; j < nstate; ++j) {
    auto in = args.get<ffi::AnyBuffer>(j);
    auto out = rets.get<ffi::AnyBuffer>(j);
    if (!in.has_value() || !out.has_value() || !IsFloat(in->element_type()) ||
        (j >= ns && (in->element_type() == ffi::DataType::BF16) != bf16[1 + j % ns]))
      return "optim_fused: state stacks must be float32 or bfloat16, alike across sets";
    w.state_in.push_back(in->untyped_data());
    w.state_out.push_back((*out)->untyped_data());
    if (j < ns) bf16[1 + j] = in->element_type() == ffi::DataType::BF16;
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

// Runs the members' elements in `tasks` equal ranges: tasks - 1 on the pool and one here; the last to finish
// completes the returned future (no thread waits for another).
ffi::Future Launch(ffi::ThreadPool& pool, std::shared_ptr<Work> w, const Runner run[2]) {
  const int64_t total = int64_t(w->x_in.size()) * w->n;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t tasks = std::min<int64_t>(threads, (total + kChunk - 1) / kChunk);
  ffi::Promise done;
  ffi::Future future(done);       // made first: a promise makes one future, before anything else holds it
  if (tasks <= 1) {
    RunRange(*w, run, 0, total);
    done.SetAvailable();
    return future;
  }
  ffi::CountDownPromise count(done, tasks);
  for (int64_t t = 1; t < tasks; ++t) {
    const int64_t lo = total * t / tasks, hi = total * (t + 1) / tasks;
    pool.Schedule([w, run0 = run[0], run1 = run[1], lo, hi, count]() mutable {
      const Runner runs[2] = {run0, run1};
      RunRange(*w, runs, lo, hi);
      count.CountDown();
    });
  }
  RunRange(*w, run, 0, total / tasks);
  count.CountDown();
  return future;
}

ffi::Future Fused(ffi::ThreadPool pool, Scalars scalars, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  int64_t kind, ffi::Span<const int64_t> sets, ffi::Span<const int64_t> rows,
                  ffi::Span<const int64_t> parts, ffi::Span<const int64_t> mirrors) {
  auto w = std::make_shared<Work>();
  bool bf16[3] = {false, false, false};
  std::vector<int64_t> set_rows;
  if (const char* wrong = Read(*w, bf16, set_rows, scalars, args, rets, kind, sets, rows, parts, mirrors)) {
    ffi::Promise p;
    ffi::Future f(p);
    p.SetError(ffi::Error::InvalidArgument(wrong));
    return f;
  }
  CopyIdleRows(*w, set_rows, args);
  const bool same = InPlace(*w, args);
  const Runner run[2] = {Pick(kind, bf16[0], bf16[1], bf16[2], false, same),
                         Pick(kind, bf16[0], bf16[1], bf16[2], true, same)};
  return Launch(pool, w, run);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kOptimFused, Fused,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::ThreadPool>()
                           .Arg<Scalars>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attr<int64_t>("kind")
                           .Attr<ffi::Span<const int64_t>>("sets")
                           .Attr<ffi::Span<const int64_t>>("rows")
                           .Attr<ffi::Span<const int64_t>>("parts")
                           .Attr<ffi::Span<const int64_t>>("mirrors"));

extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* optim_fused(XLA_FFI_CallFrame* call_frame) {
  return kOptimFused(call_frame);
}
