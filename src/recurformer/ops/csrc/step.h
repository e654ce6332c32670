// The decode steps of step.cpp as C functions, for the fused window step
// (window_step.cpp) to call; step.cpp includes this header, so the compiler checks that
// the two agree. The arguments are documented at the definitions.
#pragma once

#include <cstdint>

extern "C" {

int rf_mamba_step(int bf16, const void* xz, void* conv_state, float* ssm, const void* conv_weight,
                  const void* conv_bias, const void* x_proj, const void* dt_proj, const void* dt_bias,
                  const void* A_log, const void* D, void* y, int64_t batch, int64_t channels, int64_t width,
                  int64_t n_state, int64_t dt_rank, int threads);

int rf_mamba2_step(int bf16, const void* zxbcdt, void* conv_state, float* ssm, const void* conv_weight,
                   const void* conv_bias, const void* dt_bias, const void* A_log, const void* D,
                   const void* norm_weight, float eps, void* out, int64_t batch, int64_t heads, int64_t groups,
                   int64_t head_dim, int64_t n_state, int64_t width, int threads);

}  // extern "C"
