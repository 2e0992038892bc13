// SiLU forward and backward, elementwise in one pass (the feed-forward's SwiGLU is the IR's
// silu and mul nodes; the mul runs as candle's binary kernel). dx = g * s * (1 + x (1 - s)),
// s = sigmoid(x). CPU twins: candle's silu and the executor's fused activation_grad.
#include "common.cuh"

template <typename T>
__device__ void silu_fwd(const T *x, T *y, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float v = ld(x, i);
    st(y, i, v / (1.f + __expf(-v)));
  }
}

template <typename T>
__device__ void silu_bwd(const T *x, const T *g, T *dx, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    float v = ld(x, i);
    float s = 1.f / (1.f + __expf(-v));
    st(dx, i, ld(g, i) * s * (1.f + v * (1.f - s)));
  }
}

#define ACT(T, S)                                                                                 \
  extern "C" __global__ void silu_fwd_##S(const T *x, T *y, size_t n) { silu_fwd<T>(x, y, n); } \
  extern "C" __global__ void silu_bwd_##S(const T *x, const T *g, T *dx, size_t n) { silu_bwd<T>(x, g, dx, n); }

ACT(float, f32)
ACT(bf16, bf16)
