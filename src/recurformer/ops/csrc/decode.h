// Pieces shared by the fused decode steps (window_step.cpp, attention_step.cpp): the
// projections of a hidden state by several matrices at once, RoPE, and scratch memory.
#pragma once

#include "common.h"

#include <algorithm>
#include <vector>

namespace rf {

// Round `n` floats up to whole cache lines, so that every scratch array starts on one.
inline int64_t lines(int64_t n) { return (n + W - 1) / W * W; }

// acc[i] = the lanes of sum_j M[i * stride + j] x[j] for i < R (R rows, `cols` columns):
// the R rows are read side by side, so R multiply-adds are in flight at once.
template <int R, typename T>
inline void row_dots(const T* M, int64_t cols, int64_t stride, const float* x, vf* acc) {
  for (int i = 0; i < R; ++i) acc[i] = vf{};
  for (int64_t j = 0; j < cols; j += W) {
    const int lanes = int(std::min<int64_t>(W, cols - j));
    const vf xv = load(x + j, lanes);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[i] += load(M + i * stride + j, lanes) * xv;
  }
}

// out[r] = sum_j M[r * stride + j] x[j] for r < rows.
template <typename T>
void dots(const T* M, int64_t rows, int64_t cols, int64_t stride, const float* x, float* out) {
  vf acc[W];
  for (int64_t r = 0; r < rows; r += W) {
    const int n = int(std::min<int64_t>(W, rows - r));
    if (n == W)
      row_dots<W>(M + r * stride, cols, stride, x, acc);
    else
      for (int i = 0; i < n; ++i) row_dots<1>(M + (r + i) * stride, cols, stride, x, acc + i);
    store(out + r, lane_sums(acc, n), n);
  }
}

// One matrix that reads the hidden state: out[b, r] = M[r] . x[b] + bias[r], out [B, rows].
struct Projection {
  const void *weight, *bias;
  int64_t rows;
  float* out;
};

constexpr int64_t ROWS_PER_ITEM = 32;  // rows of one work item of the projections

// BATCH_TILE batch rows at once: each weight vector loaded serves all of them, so a step of
// a batch costs a quarter of the loads of one row after another (the loads, not the
// multiply-adds, bound `dots`).
constexpr int BATCH_TILE = 4, ROW_TILE = W / BATCH_TILE;

// out[b * out_stride + i] = M[i] . x[b] for the W rows of M and BATCH_TILE rows of x.
template <typename T>
void dots_tile(const T* M, int64_t cols, const float* x, float* out, int64_t out_stride) {
  for (int i0 = 0; i0 < W; i0 += ROW_TILE) {
    vf acc[W] = {};  // acc[i * BATCH_TILE + b]: row i0 + i, batch row b
    for (int64_t j = 0; j < cols; j += W) {
      const int lanes = int(std::min<int64_t>(W, cols - j));
      vf xv[BATCH_TILE];
      for (int b = 0; b < BATCH_TILE; ++b) xv[b] = load(x + b * cols + j, lanes);
#pragma GCC unroll 4
      for (int i = 0; i < ROW_TILE; ++i) {
        const vf m = load(M + (i0 + i) * cols + j, lanes);
        for (int b = 0; b < BATCH_TILE; ++b) acc[i * BATCH_TILE + b] += m * xv[b];
      }
    }
    const vf sums = lane_sums(acc, W);
    for (int i = 0; i < ROW_TILE; ++i)
      for (int b = 0; b < BATCH_TILE; ++b) out[b * out_stride + i0 + i] = sums[i * BATCH_TILE + b];
  }
}

// Rows [r0, r0 + count) of `p` for every batch row: a block of W weight rows is read from
// memory once and serves all batch rows from the cache, BATCH_TILE of them at a time.
template <typename T>
void project_rows(const Projection& p, int64_t r0, int64_t count, const float* x, int64_t batch, int64_t cols) {
  const T *M = (const T*)p.weight, *bias = (const T*)p.bias;
  for (int64_t r = r0; r < r0 + count; r += W) {
    const int n = int(std::min<int64_t>(W, r0 + count - r));
    int64_t b = 0;
    if (n == W)
      for (; b + BATCH_TILE <= batch; b += BATCH_TILE) dots_tile(M + r * cols, cols, x + b * cols, p.out + b * p.rows + r, p.rows);
    for (; b < batch; ++b) dots(M + r * cols, n, cols, cols, x + b * cols, p.out + b * p.rows + r);
    if (bias)
      for (b = 0; b < batch; ++b) {
        float* out = p.out + b * p.rows + r;
        store(out, load(out, n) + load(bias + r, n), n);
      }
  }
}

// Every projection, its rows cut into work items spread over the threads.
template <typename T>
bool project_all(const Projection* projections, int count, const float* x, int64_t batch, int64_t cols, int threads) {
  int64_t first[8], items = 0;  // first work item of each projection
  for (int i = 0; i < count; ++i) {
    first[i] = items;
    items += (projections[i].rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
  }
  return parallel_for(items, threads, threads > 1, true, [&](int64_t item) {
    int i = count - 1;
    while (first[i] > item) --i;
    const Projection& p = projections[i];
    const int64_t r0 = (item - first[i]) * ROWS_PER_ITEM;
    project_rows<T>(p, r0, std::min(ROWS_PER_ITEM, p.rows - r0), x, batch, cols);
  });
}

// RoPE as transformers' apply_rotary_pos_emb, in place on `heads` vectors of D values:
// x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]).
template <typename T>
void rotate(float* x, int64_t heads, int64_t D, const T* cos, const T* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t d = 0; d < half; ++d) {
      const float a = v[d], b = v[d + half];
      v[d] = a * to_float(cos[d]) - b * to_float(sin[d]);
      v[d + half] = b * to_float(cos[d + half]) + a * to_float(sin[d + half]);
    }
  }
}

// Scratch arrays of floats for one call, carved from a buffer that belongs to the calling
// thread (two Python threads never share it) and grows only when a call needs more than
// any earlier one. Each array starts on a cache line.
class Scratch {
 public:
  // `sizes[i]` floats for array i; `arrays[i]` receives its address.
  template <size_t N>
  Scratch(const int64_t (&sizes)[N], float* (&arrays)[N]) {
    static thread_local std::vector<float> buffer;
    int64_t total = W;
    for (int64_t n : sizes) total += lines(n);
    if (int64_t(buffer.size()) < total) buffer.resize(total);
    float* cursor = buffer.data();
    while (reinterpret_cast<uintptr_t>(cursor) % (W * sizeof(float))) ++cursor;
    for (size_t i = 0; i < N; ++i) {
      arrays[i] = cursor;
      cursor += lines(sizes[i]);
    }
  }
};

// `n` io values as fp32: `x` itself, or converted into `buffer`.
inline const float* as_floats(const float* x, int64_t, float*) { return x; }
inline const float* as_floats(const bf16* x, int64_t n, float* buffer) {
  for (int64_t i = 0; i < n; ++i) buffer[i] = to_float(x[i]);
  return buffer;
}

}  // namespace rf
