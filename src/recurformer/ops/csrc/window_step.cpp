// The fused decode step of the window mixers (`window`, `window+mamba2`, `window+mamba`,
// `window+linear`): one call per layer and token for all of the layer's replaced heads.
//
// A decode step is bound by per-operation overhead and by reading weights, not by
// arithmetic: the PyTorch step of `window+mamba2` is ~40 small ops per layer and token.
// Here it is one call in three phases:
//   1. projections: every matrix that reads the hidden state (the window's q, k, v and
//      the tail's in_proj), row blocks spread over the threads, each weight row read once
//      for all batch rows;
//   2. per batch row: the position and ring slot, (window+linear) the tail sums take the
//      token leaving the window, RoPE on q and k, the token's key and value written into
//      its slot, the softmax over the filled slots with each KV group's query heads
//      together, and (window+mamba, window+mamba2) the tail's recurrent step, which is
//      the compiled step of step.cpp called directly;
//   3. (window+mamba, window+mamba2) out_proj of the tail, times the gate, plus the window.
// The ring buffer, its index and the tail's states are written in place; the scratch
// memory (decode.h) is allocated once per thread.
//
// Every "io" tensor (activations, cos and sin, keys and values, the conv state, weights,
// output) has one dtype: bf16 when `bf16`, else fp32. The arithmetic is fp32; the SSM
// state and the tail sums are fp32.
#include "abi.h"
#include "common.h"
#include "decode.h"
#include "step.h"

#include <algorithm>
#include <limits>

namespace rf {
namespace {

enum Tail : int64_t { NO_TAIL = 0, MAMBA2_TAIL = 1, MAMBA_TAIL = 2, LINEAR_TAIL = 3 };

// The weights and shape of one mixer, fixed from call to call: mirrored field for field
// by `WindowStepWeights` in ops/window_step/compiled.py. Every field is 8 bytes wide, so
// the two layouts agree without padding rules.
struct WindowStepWeights {
  int64_t bf16, tail;
  int64_t d_in, heads, kv_heads, head_dim, sinks, window;
  double scaling;
  const void *q_weight, *q_bias, *k_weight, *k_bias, *v_weight, *v_bias;  // biases may be null
  // window+mamba2, window+mamba: out = window + gate * out_proj(branch(in_proj(x)))
  const void *in_weight, *in_bias, *out_weight, *out_bias, *gate;  // in [in_rows, d_in], out [H D, width]
  int64_t in_rows, branch_width;
  const void *conv_weight, *conv_bias, *dt_bias, *A_log, *D, *norm_weight, *x_proj, *dt_proj;
  int64_t groups, n_state, conv_width, dt_rank;
  double eps;
  // window+linear: feature_map [G, D, feature_dim], log_alpha [H]; gate [H] is `gate`
  const void *feature_map, *log_alpha;
  int64_t feature_dim;
};

// One call: the weights, the token and the state.
struct WindowStepArgs : WindowStepWeights {
  int64_t batch, cos_rows, threads;
  const void *x, *cos, *sin;  // x [B, d_in]; cos, sin [cos_rows, D], cos_rows 1 or B
  void* out;                  // [B, H D]
  void *keys, *values;        // [B, S, G, D], S = sinks + window
  int64_t* index;             // [B, S]
  void* conv;                 // [B, channels, conv_width] (window+mamba2, window+mamba)
  float* ssm;
  float *tail_kv, *tail_k;  // [B, G, 2 feature_dim, D], [B, G, 2 feature_dim] (window+linear)
};

// window+linear's feature map of one vector x [D] with its group's map [D, F/2]:
// phi = (softmax(x M), softmax(-x M)) [F], written to `phi`.
template <typename T>
void features(const float* x, const T* M, int64_t D, int64_t half, float* phi) {
  float* projected = phi;  // the first half first holds x M
  for (int64_t f = 0; f < half; ++f) projected[f] = 0.0f;
  for (int64_t d = 0; d < D; ++d)
    for (int64_t f = 0; f < half; f += W) {
      const int lanes = int(std::min<int64_t>(W, half - f));
      store(projected + f, load(projected + f, lanes) + x[d] * load(M + d * half + f, lanes), lanes);
    }
  float high = -std::numeric_limits<float>::infinity(), low = -high;
  for (int64_t f = 0; f < half; ++f) {
    high = std::max(high, projected[f]);
    low = std::min(low, projected[f]);
  }
  float plus = 0.0f, minus = 0.0f;
  for (int64_t f = 0; f < half; ++f) {
    const float p = projected[f];
    phi[half + f] = exp(low - p);  // softmax(-p): its maximum is -low
    phi[f] = exp(p - high);
    plus += phi[f];
    minus += phi[half + f];
  }
  for (int64_t f = 0; f < half; ++f) {
    phi[f] /= plus;
    phi[half + f] /= minus;
  }
}

// window+linear: the token in `slot` leaves the window; its features and value enter the
// row's tail sums (tail_kv += phi(k) v^T, tail_k += phi(k)) per KV group.
template <typename T>
void evict(const WindowStepArgs& a, int64_t b, const T* key, const T* value, float* work) {
  const int64_t G = a.kv_heads, D = a.head_dim, half = a.feature_dim, F = 2 * half;
  float *k = work, *phi = work + lines(D);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) k[d] = to_float(key[g * D + d]);
    features(k, (const T*)a.feature_map + g * D * half, D, half, phi);
    float* kv = a.tail_kv + (b * G + g) * F * D;
    float* ks = a.tail_k + (b * G + g) * F;
    for (int64_t f = 0; f < F; ++f) {
      ks[f] += phi[f];
      for (int64_t d = 0; d < D; d += W) {
        const int lanes = int(std::min<int64_t>(W, D - d));
        store(kv + f * D + d, load(kv + f * D + d, lanes) + phi[f] * load(value + g * D + d, lanes), lanes);
      }
    }
  }
}

// Phase 2 for batch row b: q [H D], k and v [G D] are its projections (fp32, q and k
// rotated here); writes the window's output [H D] (fp32) to `out`. `work` holds
// `row_work` floats.
template <typename T>
void attend_row(const WindowStepArgs& a, int64_t b, float* q, float* k, const float* v, float* out, float* work) {
  const int64_t H = a.heads, G = a.kv_heads, D = a.head_dim, S = a.sinks + a.window, group = H / G;
  int64_t* index = a.index + b * S;
  int64_t seen = -1;  // the row's real tokens so far, minus one
  for (int64_t j = 0; j < S; ++j) seen = std::max(seen, index[j]);
  const int64_t position = seen + 1;
  const int64_t slot = position < a.sinks ? position : a.sinks + (position - a.sinks) % a.window;
  T* keys = (T*)a.keys + b * S * G * D;
  T* values = (T*)a.values + b * S * G * D;
  if (a.tail == LINEAR_TAIL && index[slot] >= a.sinks) evict(a, b, keys + slot * G * D, values + slot * G * D, work);

  const int64_t c = a.cos_rows == 1 ? 0 : b;
  rotate(q, H, D, (const T*)a.cos + c * D, (const T*)a.sin + c * D);
  rotate(k, G, D, (const T*)a.cos + c * D, (const T*)a.sin + c * D);
  for (int64_t i = 0; i < G * D; i += W) {  // the token takes its slot
    const int lanes = int(std::min<int64_t>(W, G * D - i));
    store(keys + slot * G * D + i, load(k + i, lanes), lanes);
    store(values + slot * G * D + i, load(v + i, lanes), lanes);
  }
  index[slot] = position;

  // Softmax over the filled slots (the buffer now holds exactly what this query sees),
  // reading the keys and values as stored. A group's query heads share its keys/values.
  float* scores = work;                    // [group, S]
  float* sums = scores + lines(group * S);  // [group, D]: sum_j p_j v_j
  float* phi = sums + lines(group * D);     // [F] (window+linear)
  float* tail = phi + lines(2 * a.feature_dim);  // [D] (window+linear)
  const float scaling = float(a.scaling);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < group; ++i) {
      float* s = scores + i * S;
      dots(keys + g * D, S, D, G * D, q + (g * group + i) * D, s);
      float high = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < S; ++j)
        if (index[j] >= 0) high = std::max(high, s[j] * scaling);
      for (int64_t j = 0; j < S; j += W) {
        const int lanes = int(std::min<int64_t>(W, S - j));
        store(s + j, exp(load(s + j, lanes) * scaling - high), lanes);
      }
      for (int64_t j = 0; j < S; ++j)
        if (index[j] < 0) s[j] = 0.0f;
    }
    for (int64_t i = 0; i < group * D; ++i) sums[i] = 0.0f;
    for (int64_t j = 0; j < S; ++j) {
      if (index[j] < 0) continue;
      const T* value = values + (j * G + g) * D;
      for (int64_t d = 0; d < D; d += W) {
        const int lanes = int(std::min<int64_t>(W, D - d));
        const vf vj = load(value + d, lanes);
        for (int64_t i = 0; i < group; ++i)
          store(sums + i * D + d, load(sums + i * D + d, lanes) + scores[i * S + j] * vj, lanes);
      }
    }
    for (int64_t i = 0; i < group; ++i) {
      const int64_t h = g * group + i;
      float den = 0.0f;
      for (int64_t j = 0; j < S; ++j) den += scores[i * S + j];
      const float* num = sums + i * D;
      float* o = out + h * D;
      if (a.tail != LINEAR_TAIL) {
        for (int64_t d = 0; d < D; ++d) o[d] = num[d] / den;
        continue;
      }
      // window+linear: window_out + gate (hybrid - window_out), hybrid sharing the
      // normalizer with the tail's linear attention: (num + alpha phi(q) S_kv) /
      // (den + alpha phi(q) . S_k).
      const int64_t half = a.feature_dim, F = 2 * half;
      features(q + h * D, (const T*)a.feature_map + g * D * half, D, half, phi);
      const float* kv = a.tail_kv + (b * G + g) * F * D;
      const float* ks = a.tail_k + (b * G + g) * F;
      float tail_den = 0.0f;
      for (int64_t d = 0; d < D; ++d) tail[d] = 0.0f;
      for (int64_t f = 0; f < F; ++f) {
        tail_den += phi[f] * ks[f];
        for (int64_t d = 0; d < D; d += W) {
          const int lanes = int(std::min<int64_t>(W, D - d));
          store(tail + d, load(tail + d, lanes) + phi[f] * load(kv + f * D + d, lanes), lanes);
        }
      }
      const float alpha = std::exp(to_float(((const T*)a.log_alpha)[h])), gate = to_float(((const T*)a.gate)[h]);
      for (int64_t d = 0; d < D; ++d) {
        const float window = num[d] / den, hybrid = (num[d] + alpha * tail[d]) / (den + alpha * tail_den);
        o[d] = window + gate * (hybrid - window);
      }
    }
  }
}

// Floats of per-row scratch that attend_row uses (evict uses less: D + F).
int64_t row_work(const WindowStepArgs& a) {
  const int64_t S = a.sinks + a.window, group = a.heads / a.kv_heads, D = a.head_dim;
  return lines(group * S) + lines(group * D) + lines(2 * a.feature_dim) + lines(D);
}

template <typename T>
bool window_step(const WindowStepArgs& a) {
  FlushDenormals ftz;
  const int64_t B = a.batch, H = a.heads, G = a.kv_heads, D = a.head_dim, HD = H * D;
  const bool branch = a.tail == MAMBA2_TAIL || a.tail == MAMBA_TAIL;
  const int64_t in_rows = branch ? a.in_rows : 0, width = branch ? a.branch_width : 0;
  const bool floats_io = sizeof(T) == sizeof(float);
  const int64_t sizes[] = {
      B * a.d_in,                                // x as fp32 (bf16 io)
      B * HD, B * G * D, B * G * D, B * in_rows,  // the projections: q, k, v, the branch's input
      B * in_rows, B * width,                    // the branch's input and output in the io dtype (bf16 io)
      B * width,                                 // the branch's output as fp32
      B * HD, B * HD,                            // the window's output; out_proj's
      B * row_work(a),                           // attend_row's
  };
  float* arrays[sizeof sizes / sizeof sizes[0]];
  Scratch scratch(sizes, arrays);
  float *q = arrays[1], *k = arrays[2], *v = arrays[3], *in = arrays[4];
  void* in_io = floats_io ? (void*)in : (void*)arrays[5];
  void* mid_io = arrays[6];
  float *window_out = arrays[8], *tail_out = arrays[9], *work = arrays[10];
  const float* x = as_floats((const T*)a.x, B * a.d_in, arrays[0]);
  const int threads = int(a.threads);

  const Projection projections[] = {
      {a.q_weight, a.q_bias, HD, q}, {a.k_weight, a.k_bias, G * D, k}, {a.v_weight, a.v_bias, G * D, v},
      {a.in_weight, a.in_bias, in_rows, in},
  };
  if (!project_all<T>(projections, branch ? 4 : 3, x, B, a.d_in, threads)) return false;

  if (!parallel_for(B, threads, B > 1, true, [&](int64_t b) {
        attend_row<T>(a, b, q + b * HD, k + b * G * D, v + b * G * D, window_out + b * HD, work + b * row_work(a));
      }))
    return false;

  T* out = (T*)a.out;
  if (!branch) {
    for (int64_t i = 0; i < B * HD; i += W) {
      const int lanes = int(std::min<int64_t>(W, B * HD - i));
      store(out + i, load(window_out + i, lanes), lanes);
    }
    return true;
  }
  if (!floats_io)  // the branch reads its input in the io dtype, as the PyTorch step does
    for (int64_t i = 0; i < B * in_rows; ++i) store_scalar((T*)in_io + i, in[i]);
  const int status =
      a.tail == MAMBA2_TAIL
          ? rf_mamba2_step(!floats_io, in_io, a.conv, a.ssm, a.conv_weight, a.conv_bias, a.dt_bias, a.A_log, a.D,
                           a.norm_weight, float(a.eps), mid_io, B, H, a.groups, D, a.n_state, a.conv_width, threads)
          : rf_mamba_step(!floats_io, in_io, a.conv, a.ssm, a.conv_weight, a.conv_bias, a.x_proj, a.dt_proj,
                          a.dt_bias, a.A_log, a.D, mid_io, B, width, a.conv_width, a.n_state, a.dt_rank, threads);
  if (status != 0) return false;
  const float* mid = as_floats((const T*)mid_io, B * width, arrays[7]);
  const Projection out_proj = {a.out_weight, a.out_bias, HD, tail_out};
  if (!project_all<T>(&out_proj, 1, mid, B, width, threads)) return false;
  const T* gate = (const T*)a.gate;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < HD; i += W) {
      const int lanes = int(std::min<int64_t>(W, HD - i));
      const vf o = load(window_out + b * HD + i, lanes) + load(gate + i, lanes) * load(tail_out + b * HD + i, lanes);
      store(out + b * HD + i, o, lanes);
    }
  return true;
}

}  // namespace
}  // namespace rf

using namespace rf;

extern "C" {

// The fused window step of the mixer `weights` describes, for x [B, d_in]; the state
// (see `WindowStepArgs`; null where the kind has none) is updated in place and the
// output written to out [B, H D]. Returns 0, or 1 when out of memory.
int rf_window_step(const void* weights, const void* x, const void* cos, const void* sin, void* out, void* keys,
                   void* values, int64_t* index, void* conv, float* ssm, float* tail_kv, float* tail_k,
                   int64_t batch, int64_t cos_rows, int threads) {
  WindowStepArgs a;
  static_cast<WindowStepWeights&>(a) = *(const WindowStepWeights*)weights;
  a.batch = batch;
  a.cos_rows = cos_rows;
  a.threads = threads;
  a.x = x;
  a.cos = cos;
  a.sin = sin;
  a.out = out;
  a.keys = keys;
  a.values = values;
  a.index = index;
  a.conv = conv;
  a.ssm = ssm;
  a.tail_kv = tail_kv;
  a.tail_k = tail_k;
  try {
    return (a.bf16 ? window_step<rf::bf16>(a) : window_step<float>(a)) ? 0 : 1;
  } catch (...) {  // std::bad_alloc from the scratch
    return 1;
  }
}

}  // extern "C"

RF_EXPORT_FUNCTION(rf_window_step)
RF_EXPORT_STRUCT(WindowStepWeights)
