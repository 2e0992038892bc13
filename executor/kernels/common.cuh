// Shared helpers of shardplan's CUDA kernels: loads and stores in f32 whatever the storage
// type, and block-wide reductions. Each kernel family is one .cu file beside this one; its
// CPU twin is the CPU executor's kernel for the same op (see executor/src/gpu/selftest.rs).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float ld(const float *p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16 *p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float *p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16 *p, size_t i, float v) { p[i] = __float2bfloat16(v); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The sum of `v` over the block, returned to every thread. blockDim.x is a multiple of 32
// and at most 1024. The order of additions is fixed by the launch shape, so results repeat.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  __shared__ float total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  float r = total;
  __syncthreads();
  return r;
}

__device__ __forceinline__ double block_sum_d(double v) {
  __shared__ double part[32];
  __shared__ double total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum_d(v);
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0;
    s = warp_sum_d(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  double r = total;
  __syncthreads();
  return r;
}

// Online softmax state: the running maximum and the sum of exp(x - max).
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum max_sum_add(MaxSum a, float x) {
  if (x > a.m) {
    a.s = a.s * __expf(a.m - x) + 1.f;
    a.m = x;
  } else {
    a.s += __expf(x - a.m);
  }
  return a;
}

__device__ __forceinline__ MaxSum max_sum_merge(MaxSum a, MaxSum b) {
  if (b.m == -INFINITY) return a;
  if (a.m == -INFINITY) return b;
  float m = fmaxf(a.m, b.m);
  return MaxSum{m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

// The log-sum-exp of the block's values, to every thread.
__device__ __forceinline__ float block_lse(MaxSum v) {
  __shared__ float pm[32], ps[32];
  __shared__ float total;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum w{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = max_sum_merge(v, w);
  }
  if (lane == 0) {
    pm[warp] = v.m;
    ps[warp] = v.s;
  }
  __syncthreads();
  if (warp == 0) {
    MaxSum a = lane < (int)(blockDim.x >> 5) ? MaxSum{pm[lane], ps[lane]} : MaxSum{-INFINITY, 0.f};
    for (int o = 16; o > 0; o >>= 1) {
      MaxSum w{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)};
      a = max_sum_merge(a, w);
    }
    if (lane == 0) total = a.m + __logf(a.s);
  }
  __syncthreads();
  float r = total;
  __syncthreads();
  return r;
}
