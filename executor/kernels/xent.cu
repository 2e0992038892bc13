// Cross-entropy over logits [n, V] (f32 or bf16 storage, f32 math), one kernel each way,
// with no f32 copy of the logits: the forward writes each row's loss (log-sum-exp minus
// the target's logit) and a one-block kernel takes their mean in row order; the backward
// writes (softmax - onehot) * g / n straight into the gradient's dtype.
// A target outside the vocabulary makes that row's loss NaN (the CPU kernel refuses it).
// CPU twins: the executor's fused cross_entropy and cross_entropy_grad.
#include "common.cuh"

template <typename T>
__device__ float row_lse(const T *row, int v) {
  MaxSum a{-INFINITY, 0.f};
  for (int c = threadIdx.x; c < v; c += blockDim.x) a = max_sum_add(a, ld(row, c));
  return block_lse(a);
}

// One block per row.
template <typename T>
__device__ void xent_rows(const T *logits, const uint32_t *targets, float *loss, int v) {
  const size_t r = blockIdx.x;
  const T *row = logits + r * v;
  const float lse = row_lse(row, v);
  if (threadIdx.x == 0) {
    const uint32_t t = targets[r];
    loss[r] = t < (uint32_t)v ? lse - ld(row, t) : NAN;
  }
}

// One block per row: the row's softmax minus the target's one-hot, times g / n.
template <typename T>
__device__ void xent_bwd(const T *logits, const uint32_t *targets, const float *g, T *grad, int n, int v) {
  const size_t r = blockIdx.x;
  const T *row = logits + r * v;
  T *out = grad + r * v;
  const float lse = row_lse(row, v);
  const float scale = g[0] / n;
  const uint32_t t = targets[r];
  for (int c = threadIdx.x; c < v; c += blockDim.x) {
    float p = __expf(ld(row, c) - lse);
    st(out, c, (p - (c == (int)t ? 1.f : 0.f)) * scale);
  }
}

// The mean of the n row losses, one block: each thread sums a strided share in order, then
// the block adds the shares in a fixed tree.
extern "C" __global__ void xent_mean(const float *loss, float *out, int n) {
  double acc = 0.0;
  for (int r = threadIdx.x; r < n; r += blockDim.x) acc += loss[r];
  acc = block_sum_d(acc);
  if (threadIdx.x == 0) out[0] = (float)(acc / n);
}

#define XENT(T, S)                                                                                        \
  extern "C" __global__ void xent_rows_##S(const T *logits, const uint32_t *targets, float *loss, int v) { \
    xent_rows<T>(logits, targets, loss, v);                                                               \
  }                                                                                                       \
  extern "C" __global__ void xent_bwd_##S(const T *logits, const uint32_t *targets, const float *g, T *grad, \
                                          int n, int v) {                                                 \
    xent_bwd<T>(logits, targets, g, grad, n, v);                                                          \
  }

XENT(float, f32)
XENT(bf16, bf16)
