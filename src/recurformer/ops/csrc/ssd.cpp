// Mamba-2 SSD scan (a scalar decay per head), forward and backward, fused over time.
//
// Per batch row b and head h, with a state S of shape [P, N]:
//   S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,   y_t = S_t C_t + D_h x_t.
// B is shared by the heads of one of G groups, C by those of one of G' groups. The
// recurrence is the selective scan's with a decay that is one scalar per step and head,
// so it is laid out the same way: a work item is one batch row, one head and up to 64
// consecutive rows p of the state (V vectors of 16 lanes), holding its [N, 16 V] part of
// the state in L1 and running the whole sequence; each B_t and C_t value read serves V
// vectors. The backward pass recomputes each chunk's states from the state saved before
// it and runs the adjoint g_t = C_t gy_t^T + a_{t+1} g_{t+1} in reverse; reductions over
// p (dL/dB, dL/dC, dL/ddt) go to per-thread buffers.
//
// Layouts (contiguous): x, y, gy [B, T, H, P]; dt [B, T, H]; A, D [H]; B [B, T, G, N];
// C [B, T, G', N]; states [B, H, P, N]. The states saved for the backward pass
// ("checkpoints") are kept as the work items hold them: [B, ceil(T / chunk), items per
// batch row, N, 16 V].
#include "abi.h"
#include "common.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace rf {
namespace {

struct SsdArgs {
  const void *x, *dt, *B, *C;
  const float *A, *D, *s0;
  int64_t batch, length, heads, head_dim, n_state, groups_B, groups_C, chunk;
};

// One work item: batch row b, head h, state rows [p0, p0 + 16 V) (fewer in the last
// block of a head: lanes[v] rows in vector v).
template <int V>
struct Item {
  int64_t b, in_row, h, p0;  // in_row: index among the batch row's items
  int lanes[V];
  static int64_t per_row(const SsdArgs& a) { return a.heads * ((a.head_dim + W * V - 1) / (W * V)); }
  Item(int64_t item, const SsdArgs& a) {
    const int64_t blocks = (a.head_dim + W * V - 1) / (W * V);
    b = item / per_row(a);
    in_row = item % per_row(a);
    h = in_row / blocks;
    p0 = in_row % blocks * W * V;
    for (int v = 0; v < V; ++v) lanes[v] = int(std::clamp<int64_t>(a.head_dim - p0 - v * W, 0, W));
  }
  // This item's N V vectors in the checkpoints of chunk c.
  template <typename F>
  F* checkpoint(F* checkpoints, int64_t c, int64_t n_chunks, const SsdArgs& a) const {
    return checkpoints + ((b * n_chunks + c) * per_row(a) + in_row) * a.n_state * V * W;
  }
};

// s[n * V + v] <- rows p0 + 16 v.. of one head's [P, N] state `state` (starting at row
// p0), zero past the rows that exist; and back.
template <int V>
inline void load_rows(vf* s, const float* state, int64_t n_state, const int* lanes) {
  for (int64_t n = 0; n < n_state; ++n)
    for (int v = 0; v < V; ++v) {
      vf r = {};
      for (int l = 0; l < lanes[v]; ++l) r[l] = state[(v * W + l) * n_state + n];
      s[n * V + v] = r;
    }
}
template <int V>
inline void store_rows(float* state, const vf* s, int64_t n_state, const int* lanes) {
  for (int v = 0; v < V; ++v)
    for (int l = 0; l < lanes[v]; ++l)
      for (int64_t n = 0; n < n_state; ++n) state[(v * W + l) * n_state + n] = s[n * V + v][l];
}

template <int V, typename T>
bool forward(const SsdArgs& a, T* y, float* s_last, float* checkpoints, int threads) {
  const int64_t H = a.heads, P = a.head_dim, N = a.n_state, L = a.length;
  const int64_t items = a.batch * H * ((P + W * V - 1) / (W * V));
  const int64_t n_chunks = (L + a.chunk - 1) / a.chunk;
  const bool parallel = items > 1 && items * L * N * V >= 32768;
  return parallel_for(items, threads, parallel, true, [&](int64_t index) {
    FlushDenormals ftz;
    const Item<V> it(index, a);
    const T *x = (const T*)a.x, *dt = (const T*)a.dt, *Bm = (const T*)a.B, *Cm = (const T*)a.C;
    const int64_t gB = it.h / (H / a.groups_B), gC = it.h / (H / a.groups_C);
    const float A = a.A[it.h], Dh = a.D ? a.D[it.h] : 0.0f;
    std::vector<vf> s(N * V);
    std::vector<float> Bbuf(N), Cbuf(N);
    if (a.s0) load_rows<V>(s.data(), a.s0 + ((it.b * H + it.h) * P + it.p0) * N, N, it.lanes);
    for (int64_t t = 0; t < L; ++t) {
      if (checkpoints && t % a.chunk == 0)
        std::memcpy(it.checkpoint(checkpoints, t / a.chunk, n_chunks, a), s.data(), N * V * sizeof(vf));
      const int64_t row = it.b * L + t;
      if (t + PREFETCH_AHEAD < L) {
        prefetch(x + ((row + PREFETCH_AHEAD) * H + it.h) * P + it.p0, V * W);
        prefetch(Bm + ((row + PREFETCH_AHEAD) * a.groups_B + gB) * N, N);
        prefetch(Cm + ((row + PREFETCH_AHEAD) * a.groups_C + gC) * N, N);
      }
      const float step = to_float(dt[row * H + it.h]), decay = exp(step * A);
      const T* x_t = x + (row * H + it.h) * P + it.p0;
      vf xv[V], dx[V], even[V] = {}, odd[V] = {};  // y's sums over even and odd n: shorter add chains
      for (int v = 0; v < V; ++v) xv[v] = load(x_t + v * W, it.lanes[v]), dx[v] = xv[v] * step;
      const float* Bt = floats(Bm + (row * a.groups_B + gB) * N, N, Bbuf.data());
      const float* Ct = floats(Cm + (row * a.groups_C + gC) * N, N, Cbuf.data());
      auto update = [&](int64_t n, vf* acc) {
        vf* sn = &s[n * V];
        for (int v = 0; v < V; ++v) {
          sn[v] = decay * sn[v] + dx[v] * Bt[n];
          acc[v] += sn[v] * Ct[n];
        }
      };
      int64_t n = 0;
      for (; n + 1 < N; n += 2) update(n, even), update(n + 1, odd);
      if (n < N) update(n, even);
      T* y_t = y + (row * H + it.h) * P + it.p0;
      for (int v = 0; v < V; ++v) store(y_t + v * W, even[v] + odd[v] + Dh * xv[v], it.lanes[v]);
    }
    if (s_last) store_rows<V>(s_last + ((it.b * H + it.h) * P + it.p0) * N, s.data(), N, it.lanes);
  });
}

struct SsdGrads {
  float* dx;       // [B, T, H, P]
  float* ddt;      // [threads, B, T, H]
  float *dB, *dC;  // [threads, B, T, G, N] and [threads, B, T, G', N]
  float *dA, *dD;  // [threads, H]
  float* ds0;      // [B, H, P, N]
};

template <int V, typename T>
bool backward(const SsdArgs& a, const T* gy, const float* g_last, const float* checkpoints, const SsdGrads& out,
              int threads) {
  const int64_t H = a.heads, P = a.head_dim, N = a.n_state, L = a.length, K = a.chunk;
  const int64_t items = a.batch * H * ((P + W * V - 1) / (W * V));
  const int64_t n_chunks = (L + K - 1) / K;
  const bool parallel = items > 1 && items * L * N * V >= 8192;
  return parallel_for(items, threads, parallel, false, [&](int64_t index) {
    FlushDenormals ftz;
    const Item<V> it(index, a);
    const T *x = (const T*)a.x, *dt = (const T*)a.dt, *Bm = (const T*)a.B, *Cm = (const T*)a.C;
    const int64_t gB = it.h / (H / a.groups_B), gC = it.h / (H / a.groups_C), tid = thread_id();
    float* ddt = out.ddt + tid * a.batch * L * H;
    float* dB = out.dB + tid * a.batch * L * a.groups_B * N;
    float* dC = out.dC + tid * a.batch * L * a.groups_C * N;
    const float A = a.A[it.h], Dh = a.D ? a.D[it.h] : 0.0f;
    std::vector<vf> g(N * V), start(N * V), states(K * N * V);
    std::vector<float> decays(K), Bbuf(N), Cbuf(N);
    if (g_last) load_rows<V>(g.data(), g_last + ((it.b * H + it.h) * P + it.p0) * N, N, it.lanes);
    vf dD = {};
    float dA = 0.0f;
    for (int64_t c = n_chunks - 1; c >= 0; --c) {
      const int64_t t0 = c * K, t1 = std::min(L, t0 + K);
      // the chunk's states and decays, from its saved start
      std::memcpy(start.data(), it.checkpoint(checkpoints, c, n_chunks, a), N * V * sizeof(vf));
      const vf* prev = start.data();
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t row = it.b * L + t;
        const float step = to_float(dt[row * H + it.h]), decay = exp(step * A);
        const T* x_t = x + (row * H + it.h) * P + it.p0;
        vf dx[V];
        for (int v = 0; v < V; ++v) dx[v] = load(x_t + v * W, it.lanes[v]) * step;
        const float* Bt = floats(Bm + (row * a.groups_B + gB) * N, N, Bbuf.data());
        vf* s = &states[(t - t0) * N * V];
        for (int64_t n = 0; n < N; ++n)
          for (int v = 0; v < V; ++v) s[n * V + v] = decay * prev[n * V + v] + dx[v] * Bt[n];
        decays[t - t0] = decay;
        prev = s;
      }
      for (int64_t t = t1 - 1; t >= t0; --t) {
        const int64_t row = it.b * L + t, at = (row * H + it.h) * P + it.p0;
        if (t >= K) {  // the same step of the next chunk to run, which starts by reading it
          prefetch(x + at - K * H * P, V * W), prefetch(gy + at - K * H * P, V * W);
          prefetch(Bm + ((row - K) * a.groups_B + gB) * N, N), prefetch(Cm + ((row - K) * a.groups_C + gC) * N, N);
        }
        const float step = to_float(dt[row * H + it.h]), decay = decays[t - t0];
        vf xv[V], dx[V], gyv[V], d_dx[V] = {};
        for (int v = 0; v < V; ++v) {
          xv[v] = load(x + at + v * W, it.lanes[v]), dx[v] = xv[v] * step;
          gyv[v] = load(gy + at + v * W, it.lanes[v]);
        }
        const float* Bt = floats(Bm + (row * a.groups_B + gB) * N, N, Bbuf.data());
        const float* Ct = floats(Cm + (row * a.groups_C + gC) * N, N, Cbuf.data());
        const vf* s = &states[(t - t0) * N * V];
        const vf* s_prev = t > t0 ? s - N * V : start.data();
        vf q[V] = {};
        for (int64_t n0 = 0; n0 < N; n0 += W) {  // 16 n at a time, each group's sums taken at once
          const int count = int(std::min<int64_t>(W, N - n0));
          vf pC[W], pB[W];  // per n, the terms of dL/dC_t[n] and dL/dB_t[n] in the lanes
          for (int i = 0; i < count; ++i) {
            const int64_t n = n0 + i;
            vf* gn = &g[n * V];
            vf sum_C = {}, sum_B = {};
            for (int v = 0; v < V; ++v) {
              gn[v] += gyv[v] * Ct[n];  // now dL/dS_t
              sum_C += s[n * V + v] * gyv[v];
              sum_B += gn[v] * dx[v];
              d_dx[v] += gn[v] * Bt[n];
              q[v] += gn[v] * s_prev[n * V + v];
              gn[v] *= decay;  // the part of dL/dS_{t-1} that flows through S_t
            }
            pC[i] = sum_C, pB[i] = sum_B;
          }
          float *dCt = dC + (row * a.groups_C + gC) * N + n0, *dBt = dB + (row * a.groups_B + gB) * N + n0;
          store(dCt, load(dCt, count) + lane_sums(pC, count), count);
          store(dBt, load(dBt, count) + lane_sums(pB, count), count);
        }
        vf x_dx = {}, q_sum = {};
        for (int v = 0; v < V; ++v) {
          x_dx += d_dx[v] * xv[v];
          q_sum += q[v];
          dD += gyv[v] * xv[v];
          store(out.dx + at + v * W, d_dx[v] * step + gyv[v] * Dh, it.lanes[v]);
        }
        const float d_exponent = lane_sum(q_sum) * decay;  // dL/d(dt_t A)
        ddt[row * H + it.h] += d_exponent * A + lane_sum(x_dx);
        dA += d_exponent * step;
      }
    }
    out.dA[tid * H + it.h] += dA;
    out.dD[tid * H + it.h] += lane_sum(dD);
    store_rows<V>(out.ds0 + ((it.b * H + it.h) * P + it.p0) * N, g.data(), N, it.lanes);
  });
}

// V: vectors of 16 state rows per work item, as many as a head has, up to 4.
template <typename Kernel>
bool by_width(int64_t head_dim, Kernel kernel) {
  switch (std::min<int64_t>(4, (head_dim + W - 1) / W)) {
    case 1: return kernel(std::integral_constant<int, 1>{});
    case 2: return kernel(std::integral_constant<int, 2>{});
    case 3: return kernel(std::integral_constant<int, 3>{});
    default: return kernel(std::integral_constant<int, 4>{});
  }
}

}  // namespace
}  // namespace rf

using namespace rf;

extern "C" {

// Floats of the checkpoints per batch row and chunk.
int64_t rf_ssd_checkpoint_floats(int64_t heads, int64_t head_dim, int64_t n_state) {
  int64_t floats = 0;
  by_width(head_dim, [&](auto V) {
    floats = heads * ((head_dim + W * V - 1) / (W * V)) * n_state * V * W;
    return true;
  });
  return floats;
}

// y [B, T, H, P] in the inputs' dtype (bf16 when `bf16`, else fp32); s_last [B, H, P, N]
// or null; checkpoints [B, ceil(T / chunk), checkpoint_floats] or null (inference). Returns 0, or 1
// when out of memory.
int rf_ssd_forward(int bf16, const void* x, const void* dt, const float* A, const void* B, const void* C,
                   const float* D, const float* s0, void* y, float* s_last, float* checkpoints, int64_t batch,
                   int64_t length, int64_t heads, int64_t head_dim, int64_t n_state, int64_t groups_B,
                   int64_t groups_C, int64_t chunk, int threads) {
  const SsdArgs a{x, dt, B, C, A, D, s0, batch, length, heads, head_dim, n_state, groups_B, groups_C, chunk};
  const bool ok = by_width(head_dim, [&](auto V) {
    return bf16 ? forward<V>(a, (rf::bf16*)y, s_last, checkpoints, threads)
                : forward<V>(a, (float*)y, s_last, checkpoints, threads);
  });
  return ok ? 0 : 1;
}

// Gradients, all fp32: dx [B, T, H, P]; ddt [threads, B, T, H], dB [threads, B, T, G, N],
// dC [threads, B, T, G', N], dA and dD [threads, H], all zero-filled by the caller and
// summed over threads after; ds0 [B, H, P, N]. gy in the inputs' dtype, g_last fp32 or null.
// Returns 0, or 1 when out of memory.
int rf_ssd_backward(int bf16, const void* x, const void* dt, const float* A, const void* B, const void* C,
                    const float* D, const void* gy, const float* g_last, const float* checkpoints, float* dx,
                    float* ddt, float* dB, float* dC, float* dA, float* dD, float* ds0, int64_t batch,
                    int64_t length, int64_t heads, int64_t head_dim, int64_t n_state, int64_t groups_B,
                    int64_t groups_C, int64_t chunk, int threads) {
  const SsdArgs a{x, dt, B, C, A, D, nullptr, batch, length, heads, head_dim, n_state, groups_B, groups_C, chunk};
  const SsdGrads g{dx, ddt, dB, dC, dA, dD, ds0};
  const bool ok = by_width(head_dim, [&](auto V) {
    return bf16 ? backward<V>(a, (const rf::bf16*)gy, g_last, checkpoints, g, threads)
                : backward<V>(a, (const float*)gy, g_last, checkpoints, g, threads);
  });
  return ok ? 0 : 1;
}

}  // extern "C"

RF_EXPORT_FUNCTION(rf_ssd_checkpoint_floats)
RF_EXPORT_FUNCTION(rf_ssd_forward)
RF_EXPORT_FUNCTION(rf_ssd_backward)
