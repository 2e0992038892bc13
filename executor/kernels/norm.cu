// RMSNorm forward and backward. y = x * r * w with r = 1 / sqrt(mean(x^2) + eps) over the
// last dim; dx = r * (g*w - x * r^2 * mean(g*w*x)); dw[c] = sum over rows of g * x * r.
// CPU twins: candle_nn::ops::rms_norm and the executor's fused rms_norm_grad.
#include "common.cuh"

// One block per row.
template <typename T>
__device__ void rmsnorm_fwd(const T *x, const T *w, T *y, int cols, float eps) {
  const size_t row = blockIdx.x;
  const T *xr = x + row * cols;
  T *yr = y + row * cols;
  float ss = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = ld(xr, c);
    ss += v * v;
  }
  const float r = rsqrtf(block_sum(ss) / cols + eps);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) st(yr, c, ld(xr, c) * r * ld(w, c));
}

// One block per row.
template <typename T>
__device__ void rmsnorm_bwd_dx(const T *x, const T *w, const T *g, T *dx, int cols, float eps) {
  const size_t row = blockIdx.x;
  const T *xr = x + row * cols, *gr = g + row * cols;
  T *dr = dx + row * cols;
  float ss = 0.f, gwx = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = ld(xr, c);
    ss += v * v;
    gwx += ld(gr, c) * ld(w, c) * v;
  }
  ss = block_sum(ss);
  gwx = block_sum(gwx);
  const float r = rsqrtf(ss / cols + eps);
  const float k = r * r * r * gwx / cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) st(dr, c, r * ld(gr, c) * ld(w, c) - ld(xr, c) * k);
}

// 1/rms of each row (f32), one block per row: the weight gradient's first pass.
template <typename T>
__device__ void rmsnorm_rinv(const T *x, float *rinv, int cols, float eps) {
  const size_t row = blockIdx.x;
  const T *xr = x + row * cols;
  float ss = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    float v = ld(xr, c);
    ss += v * v;
  }
  ss = block_sum(ss);
  if (threadIdx.x == 0) rinv[row] = rsqrtf(ss / cols + eps);
}

// Partial column sums of g * x * rinv over one chunk of rows: grid (column tiles, chunks);
// a thread owns one column, so a warp reads consecutive columns of a row (coalesced) and
// no two threads ever add into one element: no atomics.
template <typename T>
__device__ void rmsnorm_dw_part(const T *x, const T *g, const float *rinv, float *part, int rows, int cols,
                                int rows_per_chunk) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int r0 = blockIdx.y * rows_per_chunk;
  const int r1 = min(rows, r0 + rows_per_chunk);
  float acc = 0.f;
  for (int r = r0; r < r1; ++r) acc += ld(g, (size_t)r * cols + c) * ld(x, (size_t)r * cols + c) * rinv[r];
  part[(size_t)blockIdx.y * cols + c] = acc;
}

// dw[c] = sum of the chunks' partial sums, in chunk order.
template <typename T>
__device__ void rmsnorm_dw_sum(const float *part, T *dw, int cols, int chunks) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float acc = 0.f;
  for (int k = 0; k < chunks; ++k) acc += part[(size_t)k * cols + c];
  st(dw, c, acc);
}

#define NORM(T, S)                                                                                       \
  extern "C" __global__ void rmsnorm_fwd_##S(const T *x, const T *w, T *y, int cols, float eps) {        \
    rmsnorm_fwd<T>(x, w, y, cols, eps);                                                                  \
  }                                                                                                      \
  extern "C" __global__ void rmsnorm_bwd_dx_##S(const T *x, const T *w, const T *g, T *dx, int cols,     \
                                                 float eps) {                                            \
    rmsnorm_bwd_dx<T>(x, w, g, dx, cols, eps);                                                           \
  }                                                                                                      \
  extern "C" __global__ void rmsnorm_rinv_##S(const T *x, float *rinv, int cols, float eps) {            \
    rmsnorm_rinv<T>(x, rinv, cols, eps);                                                                 \
  }                                                                                                      \
  extern "C" __global__ void rmsnorm_dw_part_##S(const T *x, const T *g, const float *rinv, float *part, \
                                                  int rows, int cols, int rows_per_chunk) {              \
    rmsnorm_dw_part<T>(x, g, rinv, part, rows, cols, rows_per_chunk);                                    \
  }                                                                                                      \
  extern "C" __global__ void rmsnorm_dw_sum_##S(const float *part, T *dw, int cols, int chunks) {        \
    rmsnorm_dw_sum<T>(part, dw, cols, chunks);                                                           \
  }

NORM(float, f32)
NORM(bf16, bf16)
