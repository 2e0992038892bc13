// Rotary embedding over x [b, s, h, d] (rotate-half pairs (i, i + d/2)), from tables
// cos, sin [s, d/2] of x's dtype. The backward is the rotation by minus the angle: sign -1.
// CPU twin: candle_nn::rotary_emb::rope_thd with the same tables (sin negated for the
// backward), as the executor's candle path runs it.
#include "common.cuh"

// One thread per pair; grid-stride over b * s * h * d/2 pairs.
template <typename T>
__device__ void rope(const T *x, const T *cos_t, const T *sin_t, T *y, size_t pairs, int s, int h, int d,
                     float sign) {
  const int half = d / 2;
  for (size_t p = blockIdx.x * (size_t)blockDim.x + threadIdx.x; p < pairs; p += (size_t)gridDim.x * blockDim.x) {
    const int i = (int)(p % half);
    const size_t bsh = p / half;
    const int pos = (int)((bsh / h) % s);
    const size_t base = bsh * d;
    const float c = ld(cos_t, (size_t)pos * half + i), sn = sign * ld(sin_t, (size_t)pos * half + i);
    const float x1 = ld(x, base + i), x2 = ld(x, base + i + half);
    st(y, base + i, x1 * c - x2 * sn);
    st(y, base + i + half, x2 * c + x1 * sn);
  }
}

#define ROPE(T, S)                                                                                      \
  extern "C" __global__ void rope_##S(const T *x, const T *cos_t, const T *sin_t, T *y, size_t pairs, \
                                      int s, int h, int d, float sign) {                               \
    rope<T>(x, cos_t, sin_t, y, pairs, s, h, d, sign);                                                 \
  }

ROPE(float, f32)
ROPE(bf16, bf16)
