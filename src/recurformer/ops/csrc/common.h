// Shared pieces of the compiled CPU kernels: a 16-lane float vector, a vector exp,
// bf16 loads and stores, lane sums, and a scoped flush-to-zero.
//
// Vectors are GCC/Clang vector extensions, not intrinsics: the same source compiles to
// AVX-512 (one register per vector), AVX2 (two) or SSE/NEON (four), whatever
// `-march=native` finds. Kernels put 16 consecutive channels in the lanes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace rf {

constexpr int W = 16;  // lanes per vector
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));
typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));

typedef uint16_t bf16;  // the raw bits of a bfloat16

// body(i) for i in [0, n), on up to `threads` OpenMP threads when `parallel`. `balanced`:
// items are handed out one at a time as threads free up (a thread that the OS suspends
// does not hold the others back); only for work whose result does not depend on which
// thread runs an item. Otherwise each thread runs a fixed range of items, so that
// per-thread partial sums (the backward passes') are the same from run to run.
// Returns false when a body threw (std::bad_alloc): exceptions must cross neither
// OpenMP nor the C interface.
template <typename Body>
bool parallel_for(int64_t n, int threads, bool parallel, bool balanced, Body body) {
  int failed = 0;
  auto run = [&](int64_t i) {
    try {
      body(i);
    } catch (...) {
#pragma omp atomic write
      failed = 1;
    }
  };
  if (balanced) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (parallel)
    for (int64_t i = 0; i < n; ++i) run(i);
  } else {
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) run(i);
  }
  return !failed;
}

inline int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Denormal arithmetic is ~100x slower on x86, and a decaying state passes through the
// denormal range on its way to zero. Flush-to-zero and denormals-are-zero are set for the
// kernel's duration on the calling thread only, and restored after: a library must not
// change the process-wide floating-point mode. They change values below 1.2e-38 only.
struct FlushDenormals {
#if defined(__SSE__)
  unsigned int saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store_scalar(float* p, float v) { *p = v; }
inline void store_scalar(bf16* p, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if (v != v) {
    *p = 0x7FC0;  // a quiet NaN
    return;
  }
  *p = bf16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);  // round to nearest even
}

// `n` values at p as floats: p itself, or converted from bf16 into `buffer`.
inline const float* floats(const float* p, int64_t, float*) { return p; }
inline const float* floats(const bf16* p, int64_t n, float* buffer) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = to_float(p[i]);
  return buffer;
}

// Load `n` <= W consecutive values as floats; lanes past `n` are zero. Partial vectors
// use masked loads and stores where AVX-512 has them (they touch no memory past `n`).
#if defined(__AVX512F__)
inline __mmask16 first(int n) { return __mmask16((1u << n) - 1); }
#endif

inline vf load(const float* p, int n) {
  vf v = {};
  if (n == W)
    std::memcpy(&v, p, sizeof v);
  else
#if defined(__AVX512F__)
    v = (vf)_mm512_maskz_loadu_ps(first(n), p);
#else
    for (int i = 0; i < n; ++i) v[i] = p[i];
#endif
  return v;
}
inline vf load(const bf16* p, int n) {
  vh h = {};
  if (n == W)
    std::memcpy(&h, p, sizeof h);
  else
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    h = (vh)_mm256_maskz_loadu_epi16(first(n), p);
#else
    for (int i = 0; i < n; ++i) h[i] = p[i];
#endif
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

// Store the first `n` <= W lanes.
inline void store(float* p, vf v, int n) {
  if (n == W)
    std::memcpy(p, &v, sizeof v);
  else
#if defined(__AVX512F__)
    _mm512_mask_storeu_ps(p, first(n), (__m512)v);
#else
    for (int i = 0; i < n; ++i) p[i] = v[i];
#endif
}
inline void store(bf16* p, vf v, int n) {
  vu bits = (vu)v;
  vu rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  rounded = (v != v) ? (vu){} + 0x7FC0u : rounded;  // NaN stays NaN
  vh h = __builtin_convertvector(rounded, vh);
  if (n == W)
    std::memcpy(p, &h, sizeof h);
  else
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    _mm256_mask_storeu_epi16(p, first(n), (__m256i)h);
#else
    for (int i = 0; i < n; ++i) p[i] = h[i];
#endif
}

// Ask for the cache lines of `count` values at p. The kernels walk time with a stride
// of a whole row ([T, D] or [T, H, P] layouts), too far apart for the hardware
// prefetcher; they prefetch the rows PREFETCH_AHEAD steps ahead (8 was best of 1-8 here:
// ~1.4x faster than without).
constexpr int64_t PREFETCH_AHEAD = 8;
template <typename T>
inline void prefetch(const T* p, int64_t count) {
  const char* bytes = (const char*)p;
  for (int64_t i = 0; i < int64_t(count * sizeof(T)); i += 64) __builtin_prefetch(bytes + i);
}

inline vf broadcast(float x) { return (vf){} + x; }

// 2^x: x = k + f with k an integer and |f| <= 1/2, 2^f by a degree-6 polynomial (fitted
// here by weighted least squares on [-1/2, 1/2]: relative error < 2e-9, far below fp32's
// 6e-8), times 2^k. With AVX-512, k and the scaling are one instruction each
// (vrndscaleps, vscalefps), and 2^x underflows to 0 and overflows to inf as it should;
// elsewhere k is rounded with the 1.5 * 2^23 trick and 2^k built in the exponent bits, so
// x is clamped to [-126, 127] (below, 1.2e-38 instead of a smaller number).
inline vf exp2(vf x) {
#if defined(__AVX512F__)
  const vf k = (vf)_mm512_roundscale_ps((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  x = x < -126.0f ? broadcast(-126.0f) : x;
  x = x > 127.0f ? broadcast(127.0f) : x;
  const float round_magic = 12582912.0f;  // adding 1.5 * 2^23 rounds to an integer
  const vf shifted = x + round_magic;
  const vf k = shifted - round_magic;
#endif
  const vf f = x - k;
  vf p = broadcast(1.5345799850695314e-4f);
  p = p * f + 1.3399931221315814e-3f;
  p = p * f + 9.618489003159262e-3f;
  p = p * f + 5.550328777023809e-2f;
  p = p * f + 2.4022646890200558e-1f;
  p = p * f + 6.931472057371908e-1f;
  p = p * f + 1.0000000005542258f;
#if defined(__AVX512F__)
  return (vf)_mm512_scalef_ps((__m512)p, (__m512)k);
#else
  return p * (vf)(((vi)shifted + 127) << 23);  // the low mantissa bits of `shifted` hold k
#endif
}

constexpr float LOG2E = 1.44269504088896341f;

inline vf exp(vf x) { return exp2(x * LOG2E); }

inline float exp(float x) { return std::exp(x < -87.0f ? -87.0f : x); }

inline vf sigmoid(vf x) { return 1.0f / (1.0f + exp(-x)); }
inline vf silu(vf x) { return x * sigmoid(x); }

// log(x) for normal x > 0: x = m 2^e with m in [sqrt(1/2), sqrt(2)), and
// log(m) = 2 atanh(s) = 2 (s + s^3 / 3 + ... + s^9 / 9), s = (m - 1) / (m + 1), |s| < 0.172
// (truncation error < 1e-9 relative).
inline vf log(vf x) {
  const vi bits = (vi)x;
  vi e = ((bits >> 23) & 0xFF) - 127;
  vf m = (vf)((bits & 0x7FFFFF) | 0x3F800000);  // in [1, 2)
  const vi big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e = big ? e + 1 : e;
  const vf s = (m - 1.0f) / (m + 1.0f), s2 = s * s;
  vf p = broadcast(1.0f / 9);
  p = p * s2 + 1.0f / 7;
  p = p * s2 + 1.0f / 5;
  p = p * s2 + 1.0f / 3;
  p = p * s2 + 1.0f;
  return __builtin_convertvector(e, vf) * 0.693147180559945309f + 2.0f * s * p;
}

// log(1 + exp(x)), and x itself above 20, as torch.nn.functional.softplus. log1p(w) is
// log(1 + w) w / ((1 + w) - 1), exact to rounding also where 1 + w rounds to 1.
inline vf softplus(vf x) {
  const vf w = exp(x), u = 1.0f + w;
  const vf log1p = u == 1.0f ? w : log(u) * w / (u - 1.0f);
  return x > 20.0f ? x : log1p;
}

inline float lane_sum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// Lane sums of up to W vectors at once: out[i] = lane_sum(v[i]) for i < n, 0 beyond.
// Four rounds, each adding the halves of pairs of vectors (a transpose and add): ~45
// operations for 16 sums instead of ~120, all in registers.
inline vf lane_sums(const vf* v, int n) {
  static_assert(W == 16, "lane_sums is written for 16 lanes");
  // Round 1 pairs v[bitrev(2i)] with v[bitrev(2i + 1)]; the rounds leave the sum of the
  // vector of slot s in lane bitrev(s), so v[i]'s sum ends in lane i.
  constexpr int bitrev[W] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  auto at = [&](int slot) { return bitrev[slot] < n ? v[bitrev[slot]] : vf{}; };
  auto fold = [](vf a, vf b, vi lo, vi hi) { return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi); };
  // round 1: lanes 0-7 <- a[0-7] + a[8-15], lanes 8-15 <- b[0-7] + b[8-15]
  const vi lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  // round 2: groups of 4 (a, b, a, b); round 3: groups of 2; round 4: single lanes
  const vi lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const vi hi2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const vi lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const vi hi3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const vi lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const vi hi4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  const vf a0 = fold(at(0), at(1), lo1, hi1), a1 = fold(at(2), at(3), lo1, hi1);
  const vf a2 = fold(at(4), at(5), lo1, hi1), a3 = fold(at(6), at(7), lo1, hi1);
  const vf a4 = fold(at(8), at(9), lo1, hi1), a5 = fold(at(10), at(11), lo1, hi1);
  const vf a6 = fold(at(12), at(13), lo1, hi1), a7 = fold(at(14), at(15), lo1, hi1);
  const vf b0 = fold(a0, a1, lo2, hi2), b1 = fold(a2, a3, lo2, hi2);
  const vf b2 = fold(a4, a5, lo2, hi2), b3 = fold(a6, a7, lo2, hi2);
  return fold(fold(b0, b1, lo3, hi3), fold(b2, b3, lo3, hi3), lo4, hi4);
}

}  // namespace rf
