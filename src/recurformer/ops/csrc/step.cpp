// One decode step of the mamba and mamba2 mixers, everything between in_proj and out_proj
// in one call: the causal conv's update, SiLU, the small projections (mamba), softplus,
// the state update, the output, D, the gate (and mamba2's per-head RMSNorm).
//
// Decoding is bound by per-operation overhead, not arithmetic: the torch path is ~20 small
// ops per layer and token. Here it is one call; the arithmetic is fp32 whatever the
// activations' dtype, and the SSM state is fp32. The state is laid out as the mixers keep
// it, with the state dimension n innermost, so the vector lanes run over n.
//
// Every "io" tensor of a call (activations, conv state, weights, output) has one dtype:
// bf16 when `bf16`, else fp32.
#include "abi.h"
#include "common.h"
#include "step.h"

#include <algorithm>
#include <vector>

namespace rf {
namespace {

// out[i] = sum_j W[i, j] x[j] for a row-major [rows, cols] W: one vector dot product per
// row, their lane sums taken 16 rows at a time.
template <typename T>
void matvec(const T* Wm, int64_t rows, int64_t cols, const float* x, float* out) {
  vf dots[W];
  for (int64_t r0 = 0; r0 < rows; r0 += W) {
    const int count = int(std::min<int64_t>(W, rows - r0));
    for (int i = 0; i < count; ++i) {
      const T* row = Wm + (r0 + i) * cols;
      vf acc = {};
      for (int64_t j = 0; j < cols; j += W) {
        const int lanes = int(std::min<int64_t>(W, cols - j));
        acc += load(row + j, lanes) * load(x + j, lanes);
      }
      dots[i] = acc;
    }
    const vf sums = lane_sums(dots, count);
    for (int i = 0; i < count; ++i) out[r0 + i] = sums[i];
  }
}

// The causal depthwise conv's step for `channels` channels: shift the last `width`
// inputs left, append x, then out = silu(state . weight + bias) (fp32).
template <int K, typename T>
void conv_window(const T* x, T* state, const T* weight, int64_t channels, int64_t width, float* out) {
  const int64_t k_max = K ? K : width;  // K = 0: any width, else a width known here
  for (int64_t c = 0; c < channels; ++c) {
    T* window = state + c * k_max;
    float acc = 0.0f;
    for (int64_t k = 0; k + 1 < k_max; ++k) {
      window[k] = window[k + 1];
      acc += to_float(window[k]) * to_float(weight[c * k_max + k]);
    }
    window[k_max - 1] = x[c];
    out[c] = acc + to_float(x[c]) * to_float(weight[c * k_max + k_max - 1]);
  }
}

template <typename T>
void conv_step(const T* x, T* state, const T* weight, const T* bias, int64_t channels, int64_t width, float* out) {
  if (width == 4)  // the default d_conv
    conv_window<4>(x, state, weight, channels, width, out);
  else
    conv_window<0>(x, state, weight, channels, width, out);
  if (bias)
    for (int64_t c = 0; c < channels; ++c) out[c] += to_float(bias[c]);
  for (int64_t c = 0; c < channels; c += W) {
    const int lanes = int(std::min<int64_t>(W, channels - c));
    store(out + c, silu(load(out + c, lanes)), lanes);
  }
}

// out = softplus(x + bias) (bias may be null).
template <typename X, typename T>
void softplus_into(const X* x, const T* bias, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += W) {
    const int lanes = int(std::min<int64_t>(W, n - i));
    vf v = load(x + i, lanes);
    if (bias) v += load(bias + i, lanes);
    store(out + i, softplus(v), lanes);
  }
}

struct MambaStep {
  const void *xz, *conv_weight, *conv_bias, *x_proj, *dt_proj, *dt_bias, *A_log, *D;
  void *conv_state, *y;
  float* ssm;
  int64_t batch, channels, width, n_state, dt_rank;
};

template <typename T>
bool mamba_step(const MambaStep& a, int threads) {
  const int64_t Di = a.channels, N = a.n_state, R = a.dt_rank;
  return parallel_for(a.batch, threads, a.batch > 1, true, [&](int64_t b) {
    FlushDenormals ftz;
    const T* xz = (const T*)a.xz + b * 2 * Di;
    static thread_local std::vector<float> xs, dbc, delta;  // grown once per thread, not per token
    xs.resize(Di);
    dbc.resize(R + 2 * N);
    delta.resize(Di);
    conv_step(xz, (T*)a.conv_state + b * Di * a.width, (const T*)a.conv_weight, (const T*)a.conv_bias, Di, a.width,
              xs.data());
    matvec((const T*)a.x_proj, R + 2 * N, Di, xs.data(), dbc.data());  // (dt, B, C)
    matvec((const T*)a.dt_proj, Di, R, dbc.data(), delta.data());
    softplus_into(delta.data(), (const T*)a.dt_bias, Di, delta.data());
    const float *Bt = dbc.data() + R, *Ct = Bt + N;
    const T *A_log = (const T*)a.A_log, *Dp = (const T*)a.D, *z = xz + Di;
    float* ssm = a.ssm + b * Di * N;
    vf dots[W];
    for (int64_t d0 = 0; d0 < Di; d0 += W) {
      const int count = int(std::min<int64_t>(W, Di - d0));
      for (int i = 0; i < count; ++i) {  // channel d: lanes over the state n
        const int64_t d = d0 + i;
        const float step = delta[d], dx = step * xs[d];
        vf acc = {};
        for (int64_t n = 0; n < N; n += W) {
          const int lanes = int(std::min<int64_t>(W, N - n));
          const vf A2 = -exp(load(A_log + d * N + n, lanes)) * LOG2E;  // A log2(e), A = -exp(A_log)
          const vf h = exp2(step * A2) * load(ssm + d * N + n, lanes) + dx * load(Bt + n, lanes);
          store(ssm + d * N + n, h, lanes);
          acc += h * load(Ct + n, lanes);
        }
        dots[i] = acc;
      }
      const vf u = load(xs.data() + d0, count);
      const vf y = (lane_sums(dots, count) + load(Dp + d0, count) * u) * silu(load(z + d0, count));
      store((T*)a.y + b * Di + d0, y, count);
    }
  });
}

struct Mamba2Step {
  const void *zxbcdt, *conv_weight, *conv_bias, *dt_bias, *A_log, *D, *norm_weight;
  void *conv_state, *out;
  float* ssm;
  float eps;
  int64_t batch, heads, groups, head_dim, n_state, width;
};

template <typename T>
bool mamba2_step(const Mamba2Step& a, int threads) {
  const int64_t H = a.heads, G = a.groups, P = a.head_dim, N = a.n_state;
  const int64_t channels = G * P + G * N + H * N;  // the conv's: x, B, C
  return parallel_for(a.batch, threads, a.batch > 1, true, [&](int64_t b) {
    FlushDenormals ftz;
    const T* in = (const T*)a.zxbcdt + b * (H * P + channels + H);
    const T *z = in, *dt_raw = in + H * P + channels;
    static thread_local std::vector<float> xbc, dt, gated;  // grown once per thread, not per token
    xbc.resize(channels);
    dt.resize(H);
    gated.resize(P);
    conv_step(in + H * P, (T*)a.conv_state + b * channels * a.width, (const T*)a.conv_weight,
              (const T*)a.conv_bias, channels, a.width, xbc.data());
    softplus_into(dt_raw, (const T*)a.dt_bias, H, dt.data());
    const float *xs = xbc.data(), *Bm = xs + G * P, *Cm = Bm + G * N;
    const T *A_log = (const T*)a.A_log, *Dp = (const T*)a.D, *norm = (const T*)a.norm_weight;
    vf dots[W];
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / G);
      const float step = dt[h], decay = exp(-step * std::exp(to_float(A_log[h]))), Dh = to_float(Dp[h]);
      const float *x = xs + g * P, *Bt = Bm + g * N, *Ct = Cm + h * N;
      float* S = a.ssm + (b * H + h) * P * N;
      for (int64_t p0 = 0; p0 < P; p0 += W) {
        const int count = int(std::min<int64_t>(W, P - p0));
        for (int i = 0; i < count; ++i) {  // row p: lanes over the state n
          const int64_t p = p0 + i;
          const float dx = step * x[p];
          vf acc = {};
          for (int64_t n = 0; n < N; n += W) {
            const int lanes = int(std::min<int64_t>(W, N - n));
            const vf s = decay * load(S + p * N + n, lanes) + dx * load(Bt + n, lanes);
            store(S + p * N + n, s, lanes);
            acc += s * load(Ct + n, lanes);
          }
          dots[i] = acc;
        }
        const vf y = lane_sums(dots, count) + Dh * load(x + p0, count);
        store(gated.data() + p0, y * silu(load(z + h * P + p0, count)), count);
      }
      float scale = 1.0f;
      if (norm) {  // RMSNorm over the head's P channels
        float squares = 0.0f;
        for (int64_t p = 0; p < P; ++p) squares += gated[p] * gated[p];
        scale = 1.0f / std::sqrt(squares / float(P) + a.eps);
      }
      T* out = (T*)a.out + (b * H + h) * P;
      for (int64_t p0 = 0; p0 < P; p0 += W) {
        const int count = int(std::min<int64_t>(W, P - p0));
        vf v = load(gated.data() + p0, count) * scale;
        if (norm) v *= load(norm + h * P + p0, count);
        store(out + p0, v, count);
      }
    }
  });
}

}  // namespace
}  // namespace rf

using namespace rf;

extern "C" {

// Mamba-1 decode step. xz [B, 2 Di] (in_proj's output: x, then the gate z); conv_state
// [B, Di, K] and ssm [B, Di, N] (fp32) are updated in place; conv_weight [Di, K],
// conv_bias [Di] or null, x_proj [R + 2N, Di], dt_proj [Di, R], dt_bias [Di], A_log
// [Di, N], D [Di]; y [B, Di] (the gated output, before out_proj). Returns 0, or 1 when
// out of memory.
int rf_mamba_step(int bf16, const void* xz, void* conv_state, float* ssm, const void* conv_weight,
                  const void* conv_bias, const void* x_proj, const void* dt_proj, const void* dt_bias,
                  const void* A_log, const void* D, void* y, int64_t batch, int64_t channels, int64_t width,
                  int64_t n_state, int64_t dt_rank, int threads) {
  const MambaStep a{xz, conv_weight, conv_bias, x_proj, dt_proj, dt_bias, A_log, D, conv_state, y, ssm,
                    batch, channels, width, n_state, dt_rank};
  return (bf16 ? mamba_step<rf::bf16>(a, threads) : mamba_step<float>(a, threads)) ? 0 : 1;
}

// Mamba-2 decode step. zxbcdt [B, H P + G P + G N + H N + H] (in_proj's output: z, the
// conv's channels x, B, C, then dt); conv_state [B, G P + G N + H N, K] and ssm
// [B, H, P, N] (fp32) are updated in place; conv_weight [channels, K], conv_bias
// [channels] or null, dt_bias, A_log, D [H], norm_weight [H P] or null (no norm); out
// [B, H P] (gated and normed, before out_proj). Returns 0, or 1 when out of memory.
int rf_mamba2_step(int bf16, const void* zxbcdt, void* conv_state, float* ssm, const void* conv_weight,
                   const void* conv_bias, const void* dt_bias, const void* A_log, const void* D,
                   const void* norm_weight, float eps, void* out, int64_t batch, int64_t heads, int64_t groups,
                   int64_t head_dim, int64_t n_state, int64_t width, int threads) {
  const Mamba2Step a{zxbcdt, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, conv_state, out, ssm,
                     eps, batch, heads, groups, head_dim, n_state, width};
  return (bf16 ? mamba2_step<rf::bf16>(a, threads) : mamba2_step<float>(a, threads)) ? 0 : 1;
}

}  // extern "C"

RF_EXPORT_FUNCTION(rf_mamba_step)
RF_EXPORT_FUNCTION(rf_mamba2_step)
