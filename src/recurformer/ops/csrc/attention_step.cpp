// The decode step of a layer's kept heads in one call: their q/k/v projections, RoPE, the
// token's key and value appended to the K/V cache buffers, and softmax attention of every
// query head over the cache.
//
// At long contexts reading the cache is most of a decode step. The attention is split
// along the cache ("split-K", as flash-decoding does on GPUs): a work item is one batch
// row, one KV group and a chunk of CHUNK cached tokens; it reads each key and value of its
// chunk once for all query heads of its group and keeps a partial softmax (maximum, sum,
// weighted sum of values); the partials are merged at the end. So both threads stream the
// cache whatever the number of groups (torch's CPU SDPA splits over heads only: one group
// keeps one thread busy).
//
// A batch of left-padded rows gives each row the first slot it attends from (`starts`,
// null: slot 0 for every row): a work item reads only the slots of its chunk from there,
// so the padding is neither attended nor read.
//
// Every "io" tensor (activations, cos and sin, cache buffers, weights, output) has one
// dtype: bf16 when `bf16`, else fp32. The arithmetic is fp32.
#include "abi.h"
#include "common.h"
#include "decode.h"

#include <algorithm>
#include <limits>

namespace rf {
namespace {

constexpr int64_t CHUNK = 256;  // cached tokens per work item

// Mirrored field for field by `AttentionStepWeights` in ops/attention_step/compiled.py
// (every field 8 bytes wide).
struct AttentionStepWeights {
  int64_t bf16, d_in, heads, kv_heads, head_dim;
  double scaling;
  const void *q_weight, *q_bias, *k_weight, *k_bias, *v_weight, *v_bias;  // biases may be null
};

struct AttentionStepArgs : AttentionStepWeights {
  int64_t batch, cos_rows, capacity, length, threads;
  const void *x, *cos, *sin;  // x [B, d_in]; cos, sin [cos_rows, D]
  void *keys, *values;        // [B, G, capacity, D]; the token goes to slot length - 1
  void* out;                  // [B, H D]
  const int64_t* starts;      // [B] first slot each row attends from, or null (0)
};

// One work item: query heads q [group, D] of group g against cached tokens [t0, t1)
// (none when t0 >= t1: maximum -inf, sums 0); writes, per head, (maximum score, sum of
// exp(score - maximum), sum of exp(...) v [D]) to `partial` [group, D + 2]. `scores` holds
// group * CHUNK floats.
template <typename T>
void attend_chunk(const AttentionStepArgs& a, const float* q, const T* keys, const T* values, int64_t t0, int64_t t1,
                  float* partial, float* scores) {
  const int64_t group = a.heads / a.kv_heads, D = a.head_dim, n = std::max<int64_t>(0, t1 - t0);
  const float scaling = float(a.scaling);
  for (int64_t i = 0; i < group; ++i) {
    float* s = scores + i * CHUNK;
    dots(keys + t0 * D, n, D, D, q + i * D, s);
    float high = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) high = std::max(high, s[t] * scaling);
    vf total = {};
    for (int64_t t = 0; t < n; t += W) {
      const int lanes = int(std::min<int64_t>(W, n - t));
      const vf e = exp(load(s + t, lanes) * scaling - high);
      store(s + t, e, lanes);
      total += lanes == W ? e : load(s + t, lanes);  // lanes past n are zero
    }
    float* out = partial + i * (D + 2);
    out[0] = high;
    out[1] = lane_sum(total);
    for (int64_t d = 0; d < D; ++d) out[2 + d] = 0.0f;
  }
  for (int64_t t = 0; t < n; ++t) {
    const T* value = values + (t0 + t) * D;
    for (int64_t d = 0; d < D; d += W) {
      const int lanes = int(std::min<int64_t>(W, D - d));
      const vf v = load(value + d, lanes);
      for (int64_t i = 0; i < group; ++i) {
        float* sum = partial + i * (D + 2) + 2 + d;
        store(sum, load(sum, lanes) + scores[i * CHUNK + t] * v, lanes);
      }
    }
  }
}

template <typename T>
bool attention_step(const AttentionStepArgs& a) {
  FlushDenormals ftz;
  const int64_t B = a.batch, H = a.heads, G = a.kv_heads, D = a.head_dim, group = H / G, HD = H * D;
  const int64_t chunks = (a.length + CHUNK - 1) / CHUNK, items = B * G * chunks;
  const int64_t sizes[] = {B * a.d_in, B * HD, B * G * D, B * G * D, items * group * (D + 2), items * group * CHUNK, D};
  float* arrays[sizeof sizes / sizeof sizes[0]];
  Scratch scratch(sizes, arrays);
  float *q = arrays[1], *k = arrays[2], *v = arrays[3], *partials = arrays[4], *scores = arrays[5], *merged = arrays[6];
  const float* x = as_floats((const T*)a.x, B * a.d_in, arrays[0]);
  const int threads = int(a.threads);

  const Projection projections[] = {
      {a.q_weight, a.q_bias, HD, q}, {a.k_weight, a.k_bias, G * D, k}, {a.v_weight, a.v_bias, G * D, v}};
  if (!project_all<T>(projections, 3, x, B, a.d_in, threads)) return false;
  const int64_t slot = a.length - 1;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = a.cos_rows == 1 ? 0 : b;
    rotate(q + b * HD, H, D, (const T*)a.cos + c * D, (const T*)a.sin + c * D);
    rotate(k + b * G * D, G, D, (const T*)a.cos + c * D, (const T*)a.sin + c * D);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = ((b * G + g) * a.capacity + slot) * D;
      for (int64_t d = 0; d < D; d += W) {
        const int lanes = int(std::min<int64_t>(W, D - d));
        store((T*)a.keys + at + d, load(k + (b * G + g) * D + d, lanes), lanes);
        store((T*)a.values + at + d, load(v + (b * G + g) * D + d, lanes), lanes);
      }
    }
  }

  if (!parallel_for(items, threads, threads > 1 && items > 1, true, [&](int64_t item) {
        const int64_t bg = item / chunks, t0 = (item % chunks) * CHUNK;
        const int64_t b = bg / G, g = bg % G;
        const int64_t cache = bg * a.capacity * D, start = a.starts ? a.starts[b] : 0;
        attend_chunk(a, q + (b * H + g * group) * D, (const T*)a.keys + cache, (const T*)a.values + cache,
                     std::max(t0, start), std::min(a.length, t0 + CHUNK), partials + item * group * (D + 2),
                     scores + item * group * CHUNK);
      }))
    return false;

  // Merge the chunks: out = sum_c e^(m_c - m) s_c / sum_c e^(m_c - m) l_c, m = max_c m_c.
  T* out = (T*)a.out;
  for (int64_t bg = 0; bg < B * G; ++bg)
    for (int64_t i = 0; i < group; ++i) {
      const float* first = partials + (bg * chunks * group + i) * (D + 2);
      float high = -std::numeric_limits<float>::infinity(), total = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) high = std::max(high, first[c * group * (D + 2)]);
      for (int64_t d = 0; d < D; ++d) merged[d] = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = first + c * group * (D + 2);
        const float weight = exp(part[0] - high);
        total += weight * part[1];
        for (int64_t d = 0; d < D; d += W) {
          const int lanes = int(std::min<int64_t>(W, D - d));
          store(merged + d, load(merged + d, lanes) + weight * load(part + 2 + d, lanes), lanes);
        }
      }
      const int64_t b = bg / G, h = (bg % G) * group + i;
      for (int64_t d = 0; d < D; d += W) {
        const int lanes = int(std::min<int64_t>(W, D - d));
        store(out + b * HD + h * D + d, load(merged + d, lanes) / total, lanes);
      }
    }
  return true;
}

}  // namespace
}  // namespace rf

using namespace rf;

extern "C" {

// The kept heads' decode step for x [B, d_in] with the heads `weights` describes: the
// token's rotated key and its value are written to slot length - 1 of the buffers keys,
// values [B, G, capacity, D], and out [B, H D] receives the attention over slots
// [starts[b], length) of row b (starts null: [0, length)). Returns 0, or 1 when out of memory.
int rf_attention_step(const void* weights, const void* x, const void* cos, const void* sin, void* keys, void* values,
                      void* out, const int64_t* starts, int64_t batch, int64_t cos_rows, int64_t capacity,
                      int64_t length, int threads) {
  AttentionStepArgs a;
  static_cast<AttentionStepWeights&>(a) = *(const AttentionStepWeights*)weights;
  a.batch = batch;
  a.cos_rows = cos_rows;
  a.capacity = capacity;
  a.length = length;
  a.threads = threads;
  a.x = x;
  a.cos = cos;
  a.sin = sin;
  a.keys = keys;
  a.values = values;
  a.out = out;
  a.starts = starts;
  try {
    return (a.bf16 ? attention_step<rf::bf16>(a) : attention_step<float>(a)) ? 0 : 1;
  } catch (...) {  // std::bad_alloc from the scratch
    return 1;
  }
}

}  // extern "C"

RF_EXPORT_FUNCTION(rf_attention_step)
RF_EXPORT_STRUCT(AttentionStepWeights)
