// The optimizer's two passes over a rank's f32 gradient shards.
//  - sumsq_multi: the sum of squares of every shard of the rank, one launch: each block
//    takes one chunk of one tensor (the tensors are in the launch's parameter struct) and
//    writes its f64 partial times the tensor's weight; sumsq_finish adds the partials in
//    block order (so the norm repeats bit for bit) and scales them.
//  - adamw: one AdamW update in a single pass over p, g, m, v, with the gradient factor
//    (micro-batch average times the clipping factor) read from device memory, so the host
//    never waits for the norm.
// CPU twins: the executor's fused sum_squares and adamw (vmath::adamw's arithmetic, in the
// same order).
#include "common.cuh"

#define SUMSQ_MAX_TENSORS 48
#define SUMSQ_CHUNK 65536

// Passed by value (a kernel parameter, no copy to the device first).
struct SumSqArgs {
  const float *ptr[SUMSQ_MAX_TENSORS];
  unsigned long long len[SUMSQ_MAX_TENSORS];
  double weight[SUMSQ_MAX_TENSORS];
  // First block of each tensor; first_block[count] is the number of blocks.
  unsigned int first_block[SUMSQ_MAX_TENSORS + 1];
  int count;
};

extern "C" __global__ void sumsq_multi(const SumSqArgs a, double *partial) {
  int t = 0;
  while (t + 1 < a.count && blockIdx.x >= a.first_block[t + 1]) ++t;
  const size_t start = (size_t)(blockIdx.x - a.first_block[t]) * SUMSQ_CHUNK;
  const size_t end = min((size_t)a.len[t], start + SUMSQ_CHUNK);
  const float *x = a.ptr[t];
  double acc = 0.0;
  for (size_t i = start + threadIdx.x; i < end; i += blockDim.x) {
    double v = x[i];
    acc += v * v;
  }
  acc = block_sum_d(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc * a.weight[t];
}

// out[0] += scale^2 * sum(partial), one block; `accumulate` 0 overwrites out[0].
extern "C" __global__ void sumsq_finish(const double *partial, int n, double scale, int accumulate, double *out) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  acc = block_sum_d(acc);
  if (threadIdx.x == 0) {
    double v = (acc * scale) * scale;
    out[0] = accumulate ? out[0] + v : v;
  }
}

// p, g, m, v: n f32 each; the new values go to np, nm, nv (which may alias p, m, v).
// The gradient factor is `host_scale` times `factor[0]`, one f64 on the device (null: 1).
extern "C" __global__ void adamw_f32(const float *p, const float *g, const float *m, const float *v, float *np,
                                     float *nm, float *nv, size_t n, const double *factor, float host_scale, float lr,
                                     float beta1, float beta2, float eps, float weight_decay, float bias1,
                                     float bias2) {
  const float scale = factor ? (float)(factor[0] * host_scale) : host_scale;
  const float decay = 1.f - lr * weight_decay;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float grad = g[i] * scale;
    const float mi = beta1 * m[i] + (1.f - beta1) * grad;
    const float vi = beta2 * v[i] + (1.f - beta2) * grad * grad;
    const float update = (mi / bias1) / (sqrtf(vi / bias2) + eps);
    np[i] = p[i] * decay - lr * update;
    nm[i] = mi;
    nv[i] = vi;
  }
}
