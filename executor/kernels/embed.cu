// The embedding table's gradient: dtable[ids[t], :] += g[t, :]. Every (token, column) is
// one thread adding into an f32 table, so tokens run in parallel and only repeats of one
// id contend (an f32 atomic add on distinct addresses otherwise); candle's cast makes the
// gradient's dtype when that is not f32. Ids outside the table are skipped here; the CPU kernel refuses them and the data loader checks them first.
// CPU twin: the executor's fused embedding_grad.
#include "common.cuh"

template <typename T>
__device__ void embed_grad(const uint32_t *ids, const T *g, float *table, size_t tokens, int dim, uint32_t vocab) {
  const size_t n = tokens * dim;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t t = i / dim;
    const int c = (int)(i % dim);
    const uint32_t id = ids[t];
    if (id < vocab) atomicAdd(table + (size_t)id * dim + c, ld(g, i));
  }
}

extern "C" __global__ void embed_grad_f32(const uint32_t *ids, const float *g, float *table, size_t tokens, int dim,
                                          uint32_t vocab) {
  embed_grad<float>(ids, g, table, tokens, dim, vocab);
}
extern "C" __global__ void embed_grad_bf16(const uint32_t *ids, const bf16 *g, float *table, size_t tokens, int dim,
                                           uint32_t vocab) {
  embed_grad<bf16>(ids, g, table, tokens, dim, vocab);
}

