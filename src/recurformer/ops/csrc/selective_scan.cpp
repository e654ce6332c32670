// Mamba-1 selective scan, forward and backward, fused over time.
//
// Per batch row b, channel d and state n:
//   h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t,   y_t = (C_t . h_t + D u_t) silu(z_t).
// A work item is one batch row and 16 consecutive channels (the vector lanes); it runs
// the whole sequence with its [N, 16] state in registers / L1, reading each input once and
// writing y once. Work items run in parallel (OpenMP). The forward pass also saves the
// state before every `chunk` steps; the backward pass walks the chunks in reverse,
// recomputes a chunk's states from its saved start, then runs the adjoint recurrence
//   g_t = C_t gy'_t + a_{t+1} g_{t+1}   (gy' = gy silu(z), g = dL/dh)
// backwards through it. Reductions over channels (dL/dB, dL/dC) go to per-thread buffers.
//
// Layouts (contiguous, row-major): u, delta, z, y, gy [B, T, D]; A [D, N]; B, C [B, T, N];
// D [D]; states [B, D, N]. The states saved for the backward pass ("checkpoints") are kept
// as the work items hold them: [B, ceil(T / chunk), ceil(D / 16), N, 16].
#include "abi.h"
#include "common.h"

#include <algorithm>
#include <vector>

namespace rf {
namespace {

struct ScanArgs {
  const void *u, *delta, *B, *C, *z;
  const float *A, *D, *h0;
  int64_t batch, length, channels, n_state, chunk;
};

// The lanes of one work item: batch row b, channels [d0, d0 + lanes).
struct Item {
  int64_t b, block, d0;
  int lanes;
  Item(int64_t item, int64_t channels) {
    const int64_t blocks = (channels + W - 1) / W;
    b = item / blocks;
    block = item % blocks;
    d0 = block * W;
    lanes = int(std::min<int64_t>(W, channels - d0));
  }
  // This item's N vectors in the checkpoints of chunk c.
  template <typename F>
  F* checkpoint(F* checkpoints, int64_t c, int64_t n_chunks, int64_t channels, int64_t n_state) const {
    return checkpoints + ((b * n_chunks + c) * ((channels + W - 1) / W) + block) * n_state * W;
  }
};

// [N] vectors of a [..., D, N] state at channels d0.., lanes beyond `lanes` zero.
inline void load_state(vf* h, const float* state, int64_t n_state, int lanes) {
  for (int64_t n = 0; n < n_state; ++n) {
    vf v = {};
    for (int l = 0; l < lanes; ++l) v[l] = state[l * n_state + n];
    h[n] = v;
  }
}
inline void store_state(float* state, const vf* h, int64_t n_state, int lanes) {
  for (int l = 0; l < lanes; ++l)
    for (int64_t n = 0; n < n_state; ++n) state[l * n_state + n] = h[n][l];
}

template <typename T>
bool forward(const ScanArgs& a, T* y, float* h_last, float* checkpoints, int threads) {
  const int64_t N = a.n_state, L = a.length, Dm = a.channels;
  const int64_t items = a.batch * ((Dm + W - 1) / W);
  const int64_t n_chunks = (L + a.chunk - 1) / a.chunk;
  const bool parallel = items > 1 && items * L * N >= 32768;
  return parallel_for(items, threads, parallel, true, [&](int64_t index) {
    FlushDenormals ftz;
    const Item it(index, Dm);
    const T *u = (const T*)a.u, *delta = (const T*)a.delta, *Bm = (const T*)a.B, *Cm = (const T*)a.C,
            *z = (const T*)a.z;
    std::vector<vf> h(N), A2(N);  // A2 = A log2(e): exp(delta A) = exp2(delta A2)
    load_state(A2.data(), a.A + it.d0 * N, N, it.lanes);
    for (vf& v : A2) v *= LOG2E;
    if (a.h0) load_state(h.data(), a.h0 + (it.b * Dm + it.d0) * N, N, it.lanes);
    const vf Dv = a.D ? load(a.D + it.d0, it.lanes) : vf{};
    std::vector<float> Bbuf(N), Cbuf(N);
    for (int64_t t = 0; t < L; ++t) {
      if (checkpoints && t % a.chunk == 0)
        std::memcpy(it.checkpoint(checkpoints, t / a.chunk, n_chunks, Dm, N), h.data(), N * sizeof(vf));
      const int64_t row = it.b * L + t;
      if (t + PREFETCH_AHEAD < L) {
        const int64_t ahead = (row + PREFETCH_AHEAD) * Dm + it.d0;
        prefetch(delta + ahead, W), prefetch(u + ahead, W);
        if (z) prefetch(z + ahead, W);
      }
      const vf dt = load(delta + row * Dm + it.d0, it.lanes), uu = load(u + row * Dm + it.d0, it.lanes);
      const vf du = dt * uu;
      const float *Bt = floats(Bm + row * N, N, Bbuf.data()), *Ct = floats(Cm + row * N, N, Cbuf.data());
      vf even = {}, odd = {};  // y's sums over even and odd n: shorter chains of dependent adds
      auto update = [&](int64_t n, vf& acc) {
        h[n] = exp2(dt * A2[n]) * h[n] + du * Bt[n];
        acc += h[n] * Ct[n];
      };
      int64_t n = 0;
      for (; n + 1 < N; n += 2) update(n, even), update(n + 1, odd);
      if (n < N) update(n, even);
      vf out = even + odd;
      if (a.D) out += Dv * uu;
      if (z) out *= silu(load(z + row * Dm + it.d0, it.lanes));
      store(y + row * Dm + it.d0, out, it.lanes);
    }
    if (h_last) store_state(h_last + (it.b * Dm + it.d0) * N, h.data(), N, it.lanes);
  });
}

struct ScanGrads {
  float *du, *ddelta, *dz;  // [B, T, D]
  float *dB, *dC;           // [threads, B, T, N], summed over threads by the caller
  float *dA;                // [B, D, N], summed over the batch by the caller
  float *dD;                // [B, D], likewise
  float *dh0;               // [B, D, N]
};

template <typename T>
bool backward(const ScanArgs& a, const T* gy, const float* g_last, const float* checkpoints,
              const ScanGrads& out, int threads) {
  const int64_t N = a.n_state, L = a.length, Dm = a.channels, K = a.chunk;
  const int64_t items = a.batch * ((Dm + W - 1) / W);
  const int64_t n_chunks = (L + K - 1) / K;
  const bool parallel = items > 1 && items * L * N >= 8192;
  return parallel_for(items, threads, parallel, false, [&](int64_t index) {
    FlushDenormals ftz;
    const Item it(index, Dm);
    const T *u = (const T*)a.u, *delta = (const T*)a.delta, *Bm = (const T*)a.B, *Cm = (const T*)a.C,
            *z = (const T*)a.z;
    float* dB = out.dB + int64_t(thread_id()) * a.batch * L * N;
    float* dC = out.dC + int64_t(thread_id()) * a.batch * L * N;
    std::vector<vf> A(N), A2(N), g(N), dA(N), start(N), hs(K * N), as(K * N);
    std::vector<float> Bbuf(N), Cbuf(N);
    load_state(A.data(), a.A + it.d0 * N, N, it.lanes);
    for (int64_t n = 0; n < N; ++n) A2[n] = A[n] * LOG2E;
    if (g_last) load_state(g.data(), g_last + (it.b * Dm + it.d0) * N, N, it.lanes);
    const vf Dv = a.D ? load(a.D + it.d0, it.lanes) : vf{};
    vf dD = {};
    for (int64_t c = n_chunks - 1; c >= 0; --c) {
      const int64_t t0 = c * K, t1 = std::min(L, t0 + K);
      // the chunk's states h_t and decays a_t, from its saved start
      std::memcpy(start.data(), it.checkpoint(checkpoints, c, n_chunks, Dm, N), N * sizeof(vf));
      const vf* prev = start.data();
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = it.b * L + t;
        const vf dt = load(delta + row * Dm + it.d0, it.lanes);
        const vf du = dt * load(u + row * Dm + it.d0, it.lanes);
        const float* Bt = floats(Bm + row * N, N, Bbuf.data());
        vf *h = &hs[(t - t0) * N], *decay = &as[(t - t0) * N];
        for (int64_t n = 0; n < N; ++n) {
          decay[n] = exp2(dt * A2[n]);
          h[n] = decay[n] * prev[n] + du * Bt[n];
        }
        prev = h;
      }
      for (int64_t t = t1 - 1; t >= t0; --t) {
        const int64_t row = it.b * L + t, at = row * Dm + it.d0;
        if (t >= K) {  // the same step of the next chunk to run, which starts by reading it
          const int64_t before = at - K * Dm;
          prefetch(delta + before, W), prefetch(u + before, W), prefetch(gy + before, W);
          if (z) prefetch(z + before, W);
        }
        const vf dt = load(delta + at, it.lanes), uu = load(u + at, it.lanes);
        const vf du = dt * uu;
        const vf *h = &hs[(t - t0) * N], *decay = &as[(t - t0) * N];
        const vf* h_prev = t > t0 ? h - N : start.data();
        const float *Bt = floats(Bm + row * N, N, Bbuf.data()), *Ct = floats(Cm + row * N, N, Cbuf.data());
        vf gy_pre = load(gy + at, it.lanes);  // dL/d(C . h + D u)
        if (z) {
          const vf zz = load(z + at, it.lanes), s = sigmoid(zz);
          vf y_pre = a.D ? Dv * uu : vf{};
          for (int64_t n = 0; n < N; ++n) y_pre += h[n] * Ct[n];
          store(out.dz + at, gy_pre * y_pre * s * (1.0f + zz * (1.0f - s)), it.lanes);
          gy_pre *= zz * s;
        }
        vf d_du = {}, d_dt = {};
        for (int64_t n0 = 0; n0 < N; n0 += W) {  // 16 n at a time, each group's sums taken at once
          const int count = int(std::min<int64_t>(W, N - n0));
          vf pC[W], pB[W];  // per n, the terms of dL/dC_t[n] and dL/dB_t[n] in the lanes
          for (int i = 0; i < count; ++i) {
            const int64_t n = n0 + i;
            g[n] += gy_pre * Ct[n];  // now dL/dh_t
            pC[i] = h[n] * gy_pre;
            pB[i] = g[n] * du;
            d_du += g[n] * Bt[n];
            const vf q = g[n] * decay[n] * h_prev[n];  // dL/d(delta_t A)
            dA[n] += q * dt;
            d_dt += q * A[n];
            g[n] *= decay[n];  // the part of dL/dh_{t-1} that flows through h_t
          }
          float *dCt = dC + row * N + n0, *dBt = dB + row * N + n0;
          store(dCt, load(dCt, count) + lane_sums(pC, count), count);
          store(dBt, load(dBt, count) + lane_sums(pB, count), count);
        }
        if (a.D) dD += gy_pre * uu;
        store(out.du + at, d_du * dt + (a.D ? gy_pre * Dv : vf{}), it.lanes);
        store(out.ddelta + at, d_dt + d_du * uu, it.lanes);
      }
    }
    store_state(out.dA + (it.b * Dm + it.d0) * N, dA.data(), N, it.lanes);
    if (a.D) store(out.dD + it.b * Dm + it.d0, dD, it.lanes);
    store_state(out.dh0 + (it.b * Dm + it.d0) * N, g.data(), N, it.lanes);
  });
}

}  // namespace
}  // namespace rf

using namespace rf;

extern "C" {

// Floats of the checkpoints per batch row and chunk.
int64_t rf_selective_scan_checkpoint_floats(int64_t channels, int64_t n_state) {
  return (channels + W - 1) / W * n_state * W;
}

// y [B, T, D] in the inputs' dtype (bf16 when `bf16`, else fp32); h_last [B, D, N] or
// null; checkpoints [B, ceil(T / chunk), checkpoint_floats] or null (inference). Returns 0, or 1 when
// out of memory.
int rf_selective_scan_forward(int bf16, const void* u, const void* delta, const float* A, const void* B,
                              const void* C, const float* D, const void* z, const float* h0, void* y,
                              float* h_last, float* checkpoints, int64_t batch, int64_t length,
                              int64_t channels, int64_t n_state, int64_t chunk, int threads) {
  const ScanArgs a{u, delta, B, C, z, A, D, h0, batch, length, channels, n_state, chunk};
  const bool ok = bf16 ? forward(a, (rf::bf16*)y, h_last, checkpoints, threads)
                       : forward(a, (float*)y, h_last, checkpoints, threads);
  return ok ? 0 : 1;
}

// Gradients, all fp32: du, ddelta, dz [B, T, D] (dz only with z); dB, dC [threads, B, T, N]
// zero-filled by the caller; dA [B, D, N]; dD [B, D] (only with D); dh0 [B, D, N].
// gy is in the inputs' dtype; g_last [B, D, N] fp32 or null. Returns 0, or 1 when out of memory.
int rf_selective_scan_backward(int bf16, const void* u, const void* delta, const float* A, const void* B,
                               const void* C, const float* D, const void* z, const void* gy,
                               const float* g_last, const float* checkpoints, float* du, float* ddelta,
                               float* dz, float* dB, float* dC, float* dA, float* dD, float* dh0,
                               int64_t batch, int64_t length, int64_t channels, int64_t n_state,
                               int64_t chunk, int threads) {
  const ScanArgs a{u, delta, B, C, z, A, D, nullptr, batch, length, channels, n_state, chunk};
  const ScanGrads g{du, ddelta, dz, dB, dC, dA, dD, dh0};
  const bool ok = bf16 ? backward(a, (const rf::bf16*)gy, g_last, checkpoints, g, threads)
                       : backward(a, (const float*)gy, g_last, checkpoints, g, threads);
  return ok ? 0 : 1;
}

}  // extern "C"

RF_EXPORT_FUNCTION(rf_selective_scan_checkpoint_floats)
RF_EXPORT_FUNCTION(rf_selective_scan_forward)
RF_EXPORT_FUNCTION(rf_selective_scan_backward)
