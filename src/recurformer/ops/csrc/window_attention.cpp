// Windowed softmax attention (sliding window + sinks, GQA), forward and backward.
//
// Query t of batch row b (a real token at position p among the row's real tokens) sees
// the keys at positions { j <= p : p - j < window or j < sinks }: the call's own tokens and
// optionally earlier ones ("past": keys, values and their positions, e.g. a ring buffer;
// -1 marks an empty slot). Padding tokens (position -1) are seen by no one; a padding
// query's output is zero.
//
// A work item is one batch row, one KV group and a block of BLOCK consecutive steps: its
// rows are the group's H / G query heads at those steps (row r = head j * BLOCK + step i),
// its keys the only ones those queries can see, gathered once into item buffers:
//   (a) past slots that some query of the block sees, (b) the row's first `sinks` real
//   tokens that are not in (c), (c) the real tokens from `window - 1` positions before the
//   block's first query to its last one (consecutive positions, in order).
// Rows go through in register blocks of RB = 4 (four steps of one head). A register block
// computes its scores only over (a), (b) and the part of (c) its own queries can see, in
// vectors of 16 keys, so the work per query is about `sinks + window` keys, not the whole
// block's `window + BLOCK`. Scores, softmax and the weighted sum of values are in fp32
// whatever the inputs' dtype, with the softmax in base 2 (q is scaled by scale * log2(e)
// once), as small register-blocked matrix products (RB rows x 4 vectors of 16).
//
// The forward pass saves each row's log-sum-exp (base 2). The backward pass recomputes
// the probabilities P from it (FlashAttention's scheme), then dP = dO V^T,
// dS = P (dP - rowsum(dO O)), dq = scale dS K; dk = scale dS^T q and dv = P^T dO are
// summed over the rows of the item and added to per-thread buffers (keys are shared by
// neighbouring blocks), which the caller sums.
//
// Layouts (contiguous): q, out, gout, dq [B, T, H, D]; k, v [B, T, G, D]; past keys and
// values [B, S, G, D]; position [B, T] and past_index [B, S] (int64); lse [B, T, H] (fp32).
#include "abi.h"
#include "common.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace rf {
namespace {

constexpr int64_t BLOCK = 64;  // query steps per work item
constexpr int RB = 4;          // rows per register block
constexpr int NK = 4;          // vectors of 16 keys (scores) or of 16 channels (sums) per register block
constexpr float LOG2E_F = 1.44269504088896341f;

struct WindowArgs {
  const void *q, *k, *v, *past_k, *past_v;
  const int64_t *position, *past_index;
  int64_t batch, length, heads, groups, dim, slots, window, sinks;
  float scale;
};

// Per batch row: the steps of its real tokens in order, and the position of the first.
struct Rows {
  std::vector<int64_t> steps;  // [B, T]: steps[b * T + n] = step of the row's n-th real token
  std::vector<int64_t> count, seen;
  explicit Rows(const WindowArgs& a) : steps(a.batch * a.length), count(a.batch, 0), seen(a.batch, 0) {
    for (int64_t b = 0; b < a.batch; ++b)
      for (int64_t t = 0; t < a.length; ++t) {
        const int64_t p = a.position[b * a.length + t];
        if (p < 0) continue;
        if (count[b] == 0) seen[b] = p;
        steps[b * a.length + count[b]++] = t;
      }
  }
};

// The keys of one work item: where each comes from, its position, and the range (c).
struct Keys {
  std::vector<int64_t> source;  // step t in the call, or -1 - s for past slot s
  std::vector<int32_t> pos;     // padded with -1 to a whole number of vectors
  int64_t fixed = 0;            // keys (a) + (b); (c) starts here
  int64_t first = 0;            // position of the first key of (c)
  int64_t always = 0;           // the keys every register block computes: (a), (b) and the sinks in (c)
  int64_t count() const { return int64_t(source.size()); }
  int64_t vectors() const { return (count() + W - 1) / W; }
};

// The queries of one work item: their rows' positions (-1: padding or no such row).
struct Queries {
  int64_t b, g, t0, steps, heads_per_group, rows;  // rows: padded to a multiple of RB
  std::vector<int32_t> pos;
  int64_t min_pos = -1, max_pos = -1;  // over the real ones
};

Queries queries_of(const WindowArgs& a, int64_t item) {
  const int64_t blocks = (a.length + BLOCK - 1) / BLOCK;
  Queries Q;
  Q.b = item / (a.groups * blocks);
  Q.g = item / blocks % a.groups;
  Q.t0 = item % blocks * BLOCK;
  Q.steps = std::min(BLOCK, a.length - Q.t0);
  Q.heads_per_group = a.heads / a.groups;
  Q.rows = (Q.heads_per_group * Q.steps + RB - 1) / RB * RB;
  Q.pos.assign(Q.rows, -1);
  for (int64_t i = 0; i < Q.steps; ++i) {
    const int64_t p = a.position[Q.b * a.length + Q.t0 + i];
    if (p < 0) continue;
    for (int64_t j = 0; j < Q.heads_per_group; ++j) Q.pos[j * Q.steps + i] = int32_t(p);
    Q.min_pos = Q.min_pos < 0 ? p : std::min(Q.min_pos, p);
    Q.max_pos = std::max(Q.max_pos, p);
  }
  return Q;
}

void keys_of(const WindowArgs& a, const Rows& rows, const Queries& Q, Keys& K) {
  K.source.clear();
  K.pos.clear();
  const int64_t b = Q.b, lo = std::max(Q.min_pos - a.window + 1, int64_t(0));
  for (int64_t s = 0; a.past_index && s < a.slots; ++s) {  // (a)
    const int64_t p = a.past_index[b * a.slots + s];
    if (p >= 0 && p <= Q.max_pos && (p < a.sinks || p >= lo)) K.source.push_back(-1 - s), K.pos.push_back(int32_t(p));
  }
  const int64_t seen = rows.seen[b], real = rows.count[b];
  const int64_t* steps = &rows.steps[b * a.length];
  const int64_t first = std::max(lo, seen);
  for (int64_t n = 0; n < real && seen + n < std::min(a.sinks, first); ++n)  // (b)
    K.source.push_back(steps[n]), K.pos.push_back(int32_t(seen + n));
  K.fixed = K.count();
  K.first = first;
  for (int64_t p = first; p <= Q.max_pos; ++p)  // (c)
    K.source.push_back(steps[p - seen]), K.pos.push_back(int32_t(p));
  K.always = K.fixed + std::clamp<int64_t>(a.sinks - first, 0, K.count() - K.fixed);
  K.pos.resize(K.vectors() * W, -1);
}

// The vectors of keys a register block computes: [0, v1) and [v2, v3) (v2 == v3: one range).
struct Span {
  int64_t v1, v2, v3;
};

Span span_of(const WindowArgs& a, const Keys& K, const int32_t* pos) {
  int64_t lo = -1, hi = -1;
  for (int r = 0; r < RB; ++r)
    if (pos[r] >= 0) lo = lo < 0 ? pos[r] : std::min<int64_t>(lo, pos[r]), hi = std::max<int64_t>(hi, pos[r]);
  if (lo < 0) return {0, 0, 0};  // padding only
  const int64_t c_lo = std::max<int64_t>(0, lo - a.window + 1 - K.first), c_hi = hi - K.first + 1;
  const int64_t fixed = (K.always + W - 1) / W, v2 = (K.fixed + c_lo) / W, v3 = (K.fixed + c_hi + W - 1) / W;
  if (v2 <= fixed) return {std::max(fixed, v3), 0, 0};
  return {fixed, v2, v3};
}

template <typename Body>
inline void for_vectors(const Span& s, Body body) {
  for (int64_t v = 0; v < s.v1; ++v) body(v);
  for (int64_t v = s.v2; v < s.v3; ++v) body(v);
}

// Per-thread item buffers, kept between items and calls (grown as needed).
struct Workspace {
  std::vector<float> q, g, kt, vt, kb, vb, p, ds, dk, dv;
  std::vector<float> lse, delta;
  Keys keys;
};
Workspace& workspace() {
  static thread_local Workspace w;
  return w;
}

inline void grow(std::vector<float>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(n);
}

// Gather key k's D channels (fp32) from the call's tokens or the past.
template <typename T>
inline const T* key_row(const WindowArgs& a, const void* call, const void* past, int64_t b, int64_t g, int64_t source) {
  if (source >= 0) return (const T*)call + ((b * a.length + source) * a.groups + g) * a.dim;
  return (const T*)past + ((b * a.slots + (-1 - source)) * a.groups + g) * a.dim;
}

// Keys transposed, `kt[d * stride + key]`, and/or as rows, `kb[key * padded_dim + d]` (zeros past D).
template <typename T>
void gather_keys(const WindowArgs& a, const Keys& K, int64_t b, int64_t g, const void* call, const void* past, float* kt,
                 float* kb, int64_t padded_dim) {
  const int64_t stride = K.vectors() * W, D = a.dim;
  if (kt) std::fill(kt, kt + D * stride, 0.0f);
  if (kb) std::fill(kb, kb + stride * padded_dim, 0.0f);
  for (int64_t key = 0; key < K.count(); ++key) {
    const T* row = key_row<T>(a, call, past, b, g, K.source[key]);
    for (int64_t d = 0; d < D; ++d) {
      const float x = to_float(row[d]);
      if (kt) kt[d * stride + key] = x;
      if (kb) kb[key * padded_dim + d] = x;
    }
  }
}

// out[r][key] for RB rows and the keys of `n` vectors from vector v: rows `x` (stride
// `xs`, D channels) times keys transposed (`kt`, stride `ks`).
template <int N>
inline void products(const float* x, int64_t xs, const float* kt, int64_t ks, int64_t D, int64_t v, float* out,
                     int64_t os) {
  vf acc[RB][N] = {};
  for (int64_t d = 0; d < D; ++d) {
    vf kv[N];
    for (int c = 0; c < N; ++c) std::memcpy(&kv[c], kt + d * ks + (v + c) * W, sizeof(vf));
    for (int r = 0; r < RB; ++r) {
      const vf xr = broadcast(x[r * xs + d]);
      for (int c = 0; c < N; ++c) acc[r][c] += xr * kv[c];
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < N; ++c) std::memcpy(out + r * os + (v + c) * W, &acc[r][c], sizeof(vf));
}

// `products` over the vectors of a span, N at a time.
inline void span_products(const Span& s, const float* x, int64_t xs, const float* kt, int64_t ks, int64_t D, float* out,
                          int64_t os) {
  auto range = [&](int64_t from, int64_t to) {
    int64_t v = from;
    for (; v + NK <= to; v += NK) products<NK>(x, xs, kt, ks, D, v, out, os);
    for (; v < to; ++v) products<1>(x, xs, kt, ks, D, v, out, os);
  };
  range(0, s.v1);
  range(s.v2, s.v3);
}

// out[r][c * W ..] = sum over the span's keys of w[r][key] rows[key][c * W ..], for N
// vectors of channels from `c0`.
template <int N>
inline void weighted_sums(const Span& s, const float* w, int64_t ws, const float* rows, int64_t rs, int64_t c0,
                          vf (*out)[NK]) {
  vf acc[RB][N] = {};
  auto keys = [&](int64_t from, int64_t to) {
    for (int64_t key = from; key < to; ++key) {
      vf x[N];
      for (int c = 0; c < N; ++c) std::memcpy(&x[c], rows + key * rs + (c0 + c) * W, sizeof(vf));
      for (int r = 0; r < RB; ++r) {
        const vf wr = broadcast(w[r * ws + key]);
        for (int c = 0; c < N; ++c) acc[r][c] += wr * x[c];
      }
    }
  };
  keys(0, s.v1 * W);
  keys(s.v2 * W, s.v3 * W);
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < N; ++c) out[r][c] = acc[r][c];
}

// All channel vectors of the weighted sums for RB rows: out[r * padded_dim + ..].
inline void all_weighted_sums(const Span& s, const float* w, int64_t ws, const float* rows, int64_t padded_dim,
                              float* out) {
  const int64_t vectors = padded_dim / W;
  vf part[RB][NK];
  for (int64_t c0 = 0; c0 < vectors; c0 += NK) {
    const int n = int(std::min<int64_t>(NK, vectors - c0));
    switch (n) {
      case 4: weighted_sums<4>(s, w, ws, rows, padded_dim, c0, part); break;
      case 3: weighted_sums<3>(s, w, ws, rows, padded_dim, c0, part); break;
      case 2: weighted_sums<2>(s, w, ws, rows, padded_dim, c0, part); break;
      default: weighted_sums<1>(s, w, ws, rows, padded_dim, c0, part); break;
    }
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < n; ++c) std::memcpy(out + r * padded_dim + (c0 + c) * W, &part[r][c], sizeof(vf));
  }
}

// Whether a query at q sees keys at k (lanes; -1: none).
inline vi visible(vi k, int32_t q, int64_t window, int64_t sinks) {
  const vi qv = (vi){} + q;
  const vi near = (qv - k) < int32_t(std::min<int64_t>(window, std::numeric_limits<int32_t>::max()));
  const vi sink = k < int32_t(std::min<int64_t>(sinks, std::numeric_limits<int32_t>::max()));
  return (k >= 0) & (k <= qv) & (near | sink);
}

inline int64_t padded(int64_t dim) { return (dim + W - 1) / W * W; }

// The item's rows as fp32 `x[r * padded_dim + d]` (zeros past D and for missing rows), times `factor`.
template <typename T>
void gather_rows(const WindowArgs& a, const Queries& Q, const void* src, float factor, float* x) {
  const int64_t Dp = padded(a.dim);
  std::fill(x, x + Q.rows * Dp, 0.0f);
  for (int64_t j = 0; j < Q.heads_per_group; ++j)
    for (int64_t i = 0; i < Q.steps; ++i) {
      const T* row = (const T*)src + ((Q.b * a.length + Q.t0 + i) * a.heads + Q.g * Q.heads_per_group + j) * a.dim;
      float* to = x + (j * Q.steps + i) * Dp;
      for (int64_t d = 0; d < a.dim; ++d) to[d] = to_float(row[d]) * factor;
    }
}

// Offset of row r's channels in a [B, T, H, D] tensor.
inline int64_t row_offset(const WindowArgs& a, const Queries& Q, int64_t r) {
  const int64_t j = r / Q.steps, i = r % Q.steps;
  return ((Q.b * a.length + Q.t0 + i) * a.heads + Q.g * Q.heads_per_group + j) * a.dim;
}

template <typename T>
bool forward(const WindowArgs& a, T* out, float* lse, int threads) {
  const Rows rows(a);
  const int64_t blocks = (a.length + BLOCK - 1) / BLOCK, items = a.batch * a.groups * blocks;
  const int64_t Dp = padded(a.dim);
  const bool parallel = items > 1 && a.batch * a.length * a.heads * a.dim * std::min(a.window + a.sinks, a.length) >= 1 << 18;
  return parallel_for(items, threads, parallel, true, [&](int64_t item) {
    FlushDenormals ftz;
    Workspace& w = workspace();
    const Queries Q = queries_of(a, item);
    Keys& K = w.keys;
    keys_of(a, rows, Q, K);
    const int64_t stride = K.vectors() * W;
    grow(w.q, Q.rows * Dp), grow(w.kt, a.dim * stride), grow(w.vb, stride * Dp), grow(w.p, RB * stride), grow(w.g, RB * Dp);
    gather_rows<T>(a, Q, a.q, a.scale * LOG2E_F, w.q.data());
    gather_keys<T>(a, K, Q.b, Q.g, a.k, a.past_k, w.kt.data(), nullptr, Dp);
    gather_keys<T>(a, K, Q.b, Q.g, a.v, a.past_v, nullptr, w.vb.data(), Dp);
    for (int64_t r0 = 0; r0 < Q.rows; r0 += RB) {
      const int32_t* qpos = &Q.pos[r0];
      const Span s = span_of(a, K, qpos);
      span_products(s, &w.q[r0 * Dp], Dp, w.kt.data(), stride, a.dim, w.p.data(), stride);
      float sums[RB], maxima[RB];
      for (int r = 0; r < RB; ++r) {  // masked softmax numerators, in place
        float* p = &w.p[r * stride];
        vf m = broadcast(-std::numeric_limits<float>::infinity());
        for_vectors(s, [&](int64_t v) {
          vf x;
          vi k;
          std::memcpy(&x, p + v * W, sizeof x), std::memcpy(&k, &K.pos[v * W], sizeof k);
          x = visible(k, qpos[r], a.window, a.sinks) ? x : broadcast(-std::numeric_limits<float>::infinity());
          std::memcpy(p + v * W, &x, sizeof x);
          m = x > m ? x : m;
        });
        float top = -std::numeric_limits<float>::infinity();
        for (int l = 0; l < W; ++l) top = std::max(top, m[l]);
        vf total = {};
        for_vectors(s, [&](int64_t v) {
          vf x;
          vi k;
          std::memcpy(&x, p + v * W, sizeof x), std::memcpy(&k, &K.pos[v * W], sizeof k);
          x = visible(k, qpos[r], a.window, a.sinks) ? exp2(x - top) : vf{};  // exp2(-inf) would be NaN
          std::memcpy(p + v * W, &x, sizeof x);
          total += x;
        });
        sums[r] = lane_sum(total), maxima[r] = top;
      }
      all_weighted_sums(s, w.p.data(), stride, w.vb.data(), Dp, w.g.data());
      for (int r = 0; r < RB && r0 + r < Q.heads_per_group * Q.steps; ++r) {
        const int64_t at = row_offset(a, Q, r0 + r);
        const bool real = qpos[r] >= 0;
        const float inverse = real ? 1.0f / sums[r] : 0.0f;
        for (int64_t d = 0; d < a.dim; d += W) {
          vf x;
          std::memcpy(&x, &w.g[r * Dp + d], sizeof x);
          store(out + at + d, x * inverse, int(std::min<int64_t>(W, a.dim - d)));
        }
        if (lse) lse[at / a.dim] = real ? maxima[r] + std::log2(sums[r]) : 0.0f;
      }
    }
  });
}

struct WindowGrads {
  float* dq;              // [B, T, H, D]
  float *dk, *dv;         // [threads, B, T, G, D]
  float *dpast_k, *dpast_v;  // [threads, B, S, G, D] or null
};

// acc[key][..] += sum over the rows of the register blocks whose span holds vector v of
// w[r][key] x[r][..], for the 16 keys of vector v; into `out[key * Dp ..]`.
template <int N>
inline void key_sums(const float* w, const float* x, int64_t stride, int64_t Dp, const std::vector<Span>& spans,
                     int64_t v, int64_t c0, float* out) {
  for (int64_t k0 = v * W; k0 < (v + 1) * W; k0 += RB) {
    vf acc[RB][N] = {};
    for (int64_t rb = 0; rb < int64_t(spans.size()); ++rb) {
      const Span& s = spans[rb];
      if (!(v < s.v1 || (v >= s.v2 && v < s.v3))) continue;
      for (int64_t r = rb * RB; r < (rb + 1) * RB; ++r) {
        vf xr[N];
        for (int c = 0; c < N; ++c) std::memcpy(&xr[c], x + r * Dp + (c0 + c) * W, sizeof(vf));
        for (int i = 0; i < RB; ++i) {
          const vf wi = broadcast(w[r * stride + k0 + i]);
          for (int c = 0; c < N; ++c) acc[i][c] += wi * xr[c];
        }
      }
    }
    for (int i = 0; i < RB; ++i)
      for (int c = 0; c < N; ++c) std::memcpy(out + (k0 + i) * Dp + (c0 + c) * W, &acc[i][c], sizeof(vf));
  }
}

void all_key_sums(const float* w, const float* x, int64_t stride, int64_t Dp, const std::vector<Span>& spans, int64_t v,
                  float* out) {
  const int64_t vectors = Dp / W;
  for (int64_t c0 = 0; c0 < vectors; c0 += NK) {
    switch (std::min<int64_t>(NK, vectors - c0)) {
      case 4: key_sums<4>(w, x, stride, Dp, spans, v, c0, out); break;
      case 3: key_sums<3>(w, x, stride, Dp, spans, v, c0, out); break;
      case 2: key_sums<2>(w, x, stride, Dp, spans, v, c0, out); break;
      default: key_sums<1>(w, x, stride, Dp, spans, v, c0, out); break;
    }
  }
}

template <typename T>
bool backward(const WindowArgs& a, const T* out, const T* gout, const float* lse, const WindowGrads& grads,
              int threads) {
  const Rows rows(a);
  const int64_t blocks = (a.length + BLOCK - 1) / BLOCK, items = a.batch * a.groups * blocks;
  const int64_t Dp = padded(a.dim);
  const bool parallel = items > 1 && a.batch * a.length * a.heads * a.dim * std::min(a.window + a.sinks, a.length) >= 1 << 16;
  return parallel_for(items, threads, parallel, false, [&](int64_t item) {
    FlushDenormals ftz;
    Workspace& w = workspace();
    const int64_t tid = thread_id();
    const Queries Q = queries_of(a, item);
    Keys& K = w.keys;
    keys_of(a, rows, Q, K);
    const int64_t stride = K.vectors() * W, real_rows = Q.heads_per_group * Q.steps;
    grow(w.q, Q.rows * Dp), grow(w.g, Q.rows * Dp), grow(w.kt, a.dim * stride), grow(w.vt, a.dim * stride);
    grow(w.kb, stride * Dp), grow(w.p, Q.rows * stride), grow(w.ds, Q.rows * stride), grow(w.dk, stride * Dp);
    grow(w.dv, stride * Dp), grow(w.vb, RB * Dp);
    w.lse.assign(Q.rows, 0.0f), w.delta.assign(Q.rows, 0.0f);
    const float c = a.scale * LOG2E_F;
    gather_rows<T>(a, Q, a.q, c, w.q.data());
    gather_rows<T>(a, Q, gout, 1.0f, w.g.data());
    gather_keys<T>(a, K, Q.b, Q.g, a.k, a.past_k, w.kt.data(), w.kb.data(), Dp);
    gather_keys<T>(a, K, Q.b, Q.g, a.v, a.past_v, w.vt.data(), nullptr, Dp);
    for (int64_t r = 0; r < real_rows; ++r) {  // rowsum(dO O) and the saved log-sum-exp
      const int64_t at = row_offset(a, Q, r);
      float sum = 0.0f;
      for (int64_t d = 0; d < a.dim; ++d) sum += w.g[r * Dp + d] * to_float(out[at + d]);
      w.delta[r] = sum, w.lse[r] = lse[at / a.dim];
    }
    std::vector<Span> spans(Q.rows / RB);
    for (int64_t r0 = 0; r0 < Q.rows; r0 += RB) {
      const int32_t* qpos = &Q.pos[r0];
      const Span s = spans[r0 / RB] = span_of(a, K, qpos);
      float* P = &w.p[r0 * stride];
      float* dS = &w.ds[r0 * stride];
      span_products(s, &w.q[r0 * Dp], Dp, w.kt.data(), stride, a.dim, P, stride);   // scores (base 2)
      span_products(s, &w.g[r0 * Dp], Dp, w.vt.data(), stride, a.dim, dS, stride);  // dP, then dS in place
      for (int r = 0; r < RB; ++r) {
        const float top = w.lse[r0 + r], delta = w.delta[r0 + r];
        for_vectors(s, [&](int64_t v) {
          vf x, dp;
          vi k;
          std::memcpy(&x, P + r * stride + v * W, sizeof x), std::memcpy(&dp, dS + r * stride + v * W, sizeof dp);
          std::memcpy(&k, &K.pos[v * W], sizeof k);
          const vi seen = visible(k, qpos[r], a.window, a.sinks);
          x = seen ? exp2(x - top) : vf{};
          const vf ds = x * (dp - delta);
          std::memcpy(P + r * stride + v * W, &x, sizeof x), std::memcpy(dS + r * stride + v * W, &ds, sizeof ds);
        });
      }
      float* dq_out = w.vb.data();  // [RB, Dp]
      all_weighted_sums(s, dS, stride, w.kb.data(), Dp, dq_out);
      for (int r = 0; r < RB && r0 + r < real_rows; ++r) {
        float* to = grads.dq + row_offset(a, Q, r0 + r);
        for (int64_t d = 0; d < a.dim; ++d) to[d] = qpos[r] >= 0 ? dq_out[r * Dp + d] * a.scale : 0.0f;
      }
    }
    // dk = scale dS^T q = dS^T (c q) / log2(e); dv = P^T dO; then into this thread's buffers
    for (int64_t v = 0; v < K.vectors(); ++v) {
      all_key_sums(w.ds.data(), w.q.data(), stride, Dp, spans, v, w.dk.data());
      all_key_sums(w.p.data(), w.g.data(), stride, Dp, spans, v, w.dv.data());
    }
    const float to_dk = 1.0f / LOG2E_F;
    for (int64_t key = 0; key < K.count(); ++key) {
      const int64_t source = K.source[key];
      float *dk, *dv;
      if (source >= 0) {
        const int64_t at = ((tid * a.batch + Q.b) * a.length + source) * a.groups + Q.g;
        dk = grads.dk + at * a.dim, dv = grads.dv + at * a.dim;
      } else {
        const int64_t at = ((tid * a.batch + Q.b) * a.slots + (-1 - source)) * a.groups + Q.g;
        dk = grads.dpast_k + at * a.dim, dv = grads.dpast_v + at * a.dim;
      }
      for (int64_t d = 0; d < a.dim; ++d) dk[d] += w.dk[key * Dp + d] * to_dk, dv[d] += w.dv[key * Dp + d];
    }
  });
}

}  // namespace
}  // namespace rf

using namespace rf;

extern "C" {

// out [B, T, H, D] in the inputs' dtype (bf16 when `bf16`, else fp32); lse [B, T, H] or
// null (inference). past_k, past_v, past_index null when there is no past (slots 0).
// Returns 0, or 1 when out of memory.
int rf_window_forward(int bf16, const void* q, const void* k, const void* v, const void* past_k, const void* past_v,
                      const int64_t* position, const int64_t* past_index, void* out, float* lse, int64_t batch,
                      int64_t length, int64_t heads, int64_t groups, int64_t dim, int64_t slots, int64_t window,
                      int64_t sinks, float scale, int threads) {
  const WindowArgs a{q, k, v, past_k, past_v, position, past_index, batch, length, heads, groups, dim, slots,
                     window, sinks, scale};
  const bool ok = bf16 ? forward(a, (rf::bf16*)out, lse, threads) : forward(a, (float*)out, lse, threads);
  return ok ? 0 : 1;
}

// Gradients, fp32: dq [B, T, H, D]; dk, dv [threads, B, T, G, D] and dpast_k, dpast_v
// [threads, B, S, G, D] (null without a past), zero-filled by the caller and summed over
// threads after. out and gout in the inputs' dtype, lse as saved by the forward pass.
// Returns 0, or 1 when out of memory.
int rf_window_backward(int bf16, const void* q, const void* k, const void* v, const void* past_k, const void* past_v,
                       const int64_t* position, const int64_t* past_index, const void* out, const void* gout,
                       const float* lse, float* dq, float* dk, float* dv, float* dpast_k, float* dpast_v,
                       int64_t batch, int64_t length, int64_t heads, int64_t groups, int64_t dim, int64_t slots,
                       int64_t window, int64_t sinks, float scale, int threads) {
  const WindowArgs a{q, k, v, past_k, past_v, position, past_index, batch, length, heads, groups, dim, slots,
                     window, sinks, scale};
  const WindowGrads g{dq, dk, dv, dpast_k, dpast_v};
  const bool ok = bf16 ? backward(a, (const rf::bf16*)out, (const rf::bf16*)gout, lse, g, threads)
                       : backward(a, (const float*)out, (const float*)gout, lse, g, threads);
  return ok ? 0 : 1;
}

}  // extern "C"

RF_EXPORT_FUNCTION(rf_window_forward)
RF_EXPORT_FUNCTION(rf_window_backward)
