// Causal flash attention forward and backward through cuDNN's fused SDPA, behind a plain C
// interface that takes device pointers and the caller's CUDA stream. Built by
// executor/build.rs (the `cuda` feature) over cudnn-frontend's header-only graph API;
// libcudnn.so.9 and libcudart are opened at run time (cudnn-frontend's dynamic loading),
// so a CUDA build starts without cuDNN and only `--kernels native` needs it.
//
// Layouts: q, o, dq, do [b, s, hq, d]; k, v, dk, dv [b, s, hkv, d] (grouped-query heads
// without repeats), all contiguous in that order (cuDNN reads [b, h, s, d] through
// strides); lse [b, hq, s] f32, the log-sum-exp of each row of scaled scores, which the
// forward writes and the backward reads.
// CPU twin: the executor's attention forward and its blockwise backward
// (executor/src/cpu/attention.rs, kernels::attention_backward_blockwise).
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include <cudnn_frontend.h>

namespace fe = cudnn_frontend;

namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr;
}

namespace {

thread_local std::string last_error;

int fail(const std::string &what) {
  last_error = what;
  return 1;
}

std::mutex load_mutex;

// Opens libcudnn once; false with `last_error` set when it cannot.
bool load_cudnn() {
  std::lock_guard<std::mutex> lock(load_mutex);
  if (fe::cudnn_dlhandle) return true;
  const char *names[] = {"libcudnn.so.9", "libcudnn.so"};
  std::string errors;
  for (const char *name : names) {
    void *h = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
    if (h) {
      fe::cudnn_dlhandle = h;
      return true;
    }
    const char *e = dlerror();
    errors += std::string(name) + ": " + (e ? e : "not found") + "; ";
  }
  last_error = "cannot load cuDNN (" + errors +
               "add the folder of libcudnn.so.9, e.g. PyTorch's site-packages/nvidia/cudnn/lib, to "
               "LD_LIBRARY_PATH, or run with --kernels candle)";
  return false;
}

using Key = std::tuple<int, int, int, int, int, int, int, uint32_t, int>;

struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
};

std::mutex cache_mutex;
std::map<Key, Entry> cache;

// One cuDNN handle and workspace per thread (ranks run as threads on one device).
struct ThreadState {
  cudnnHandle_t handle = nullptr;
  void *workspace = nullptr;
  int64_t workspace_bytes = 0;
  ~ThreadState() {
    if (workspace) fe::detail::cuda_free(workspace);
    if (handle) fe::detail::destroy_handle(handle);
  }
};
thread_local ThreadState state;

bool ready(void *stream) {
  if (!load_cudnn()) return false;
  if (!state.handle) {
    auto st = fe::detail::create_handle(&state.handle);
    if (st != CUDNN_STATUS_SUCCESS) {
      state.handle = nullptr;
      last_error = "cudnnCreate failed with status " + std::to_string((int)st);
      return false;
    }
  }
  auto st = fe::detail::set_stream(state.handle, (cudaStream_t)stream);
  if (st != CUDNN_STATUS_SUCCESS) {
    last_error = "cudnnSetStream failed with status " + std::to_string((int)st);
    return false;
  }
  return true;
}

bool workspace(int64_t bytes) {
  if (bytes <= state.workspace_bytes) return true;
  if (state.workspace) fe::detail::cuda_free(state.workspace);
  state.workspace = nullptr;
  state.workspace_bytes = 0;
  if (fe::detail::cuda_malloc(&state.workspace, (size_t)bytes) != cudaSuccess) {
    last_error = "cannot allocate " + std::to_string(bytes) + " bytes of cuDNN workspace";
    return false;
  }
  state.workspace_bytes = bytes;
  return true;
}

enum Uid : int64_t { Q = 1, K, V, O, DO, STATS, DQ, DK, DV };

std::shared_ptr<fe::graph::Tensor_attributes> bshd(fe::graph::Graph &g, const char *name, int64_t uid, int64_t b,
                                                   int64_t h, int64_t s, int64_t d) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({b, h, s, d})
                      .set_stride({s * h * d, d, h * d, 1}));
}

void out_bshd(const std::shared_ptr<fe::graph::Tensor_attributes> &t, int64_t uid, int64_t b, int64_t h, int64_t s,
              int64_t d) {
  t->set_output(true).set_uid(uid).set_dim({b, h, s, d}).set_stride({s * h * d, d, h * d, 1});
}

// Builds (or finds) the graph of one direction for one shape; nullptr on failure.
Entry *graph_for(bool backward, int b, int s, int hq, int hkv, int d, int causal, float scale, int dtype) {
  uint32_t scale_bits;
  std::memcpy(&scale_bits, &scale, 4);
  Key key{backward, b, s, hq, hkv, d, causal, scale_bits, dtype};
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto found = cache.find(key);
  if (found != cache.end()) return &found->second;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(dtype == 0 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto q = bshd(*g, "q", Q, b, hq, s, d);
  auto k = bshd(*g, "k", K, b, hkv, s, d);
  auto v = bshd(*g, "v", V, b, hkv, s, d);
  if (!backward) {
    auto opts = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true).set_attn_scale(scale);
    if (causal) opts.set_causal_mask(true);
    auto [o, stats] = g->sdpa(q, k, v, opts);
    out_bshd(o, O, b, hq, s, d);
    stats->set_output(true).set_uid(STATS).set_data_type(fe::DataType_t::FLOAT);
  } else {
    auto o = bshd(*g, "o", O, b, hq, s, d);
    auto dout = bshd(*g, "do", DO, b, hq, s, d);
    auto stats = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("stats")
                               .set_uid(STATS)
                               .set_dim({b, hq, s, 1})
                               .set_stride({hq * s, s, 1, 1})
                               .set_data_type(fe::DataType_t::FLOAT));
    auto opts = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(scale);
    if (causal) opts.set_causal_mask(true);
    auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, opts);
    out_bshd(dq, DQ, b, hq, s, d);
    out_bshd(dk, DK, b, hkv, s, d);
    out_bshd(dv, DV, b, hkv, s, d);
  }
  std::string shape = "(b " + std::to_string(b) + ", s " + std::to_string(s) + ", heads " + std::to_string(hq) + "/" +
                      std::to_string(hkv) + ", head dim " + std::to_string(d) + ")";
  auto check = [&](fe::error_t e, const char *stage) {
    if (e.is_bad()) {
      last_error = std::string("cuDNN SDPA ") + (backward ? "backward" : "forward") + " " + shape + ": " + stage +
                   ": " + e.get_message();
      return false;
    }
    return true;
  };
  if (!check(g->validate(), "validate") || !check(g->build_operation_graph(state.handle), "build") ||
      !check(g->create_execution_plans({fe::HeurMode_t::A}), "plans") || !check(g->check_support(), "support") ||
      !check(g->build_plans(), "build plans"))
    return nullptr;
  Entry e;
  e.graph = g;
  if (!check(g->get_workspace_size(e.workspace), "workspace size")) return nullptr;
  return &cache.emplace(key, e).first->second;
}

int run(Entry *e, std::unordered_map<int64_t, void *> &ptrs) {
  if (!workspace(e->workspace)) return 1;
  auto err = e->graph->execute(state.handle, ptrs, state.workspace);
  if (err.is_bad()) return fail(std::string("cuDNN SDPA execute: ") + err.get_message());
  return 0;
}

}  // namespace

extern "C" {

// The thread's last error message ("" when none).
const char *sp_attn_error(void) { return last_error.c_str(); }

// 0 when libcudnn can be opened, else 1 (message in sp_attn_error).
int sp_attn_load(void) {
  try {
    return load_cudnn() ? 0 : 1;
  } catch (const std::exception &ex) {
    return fail(ex.what());
  }
}

// The cuDNN version the library reports (e.g. 91900), 0 when it cannot be loaded.
int64_t sp_attn_cudnn_version(void) {
  try {
    if (!load_cudnn()) return 0;
    return (int64_t)fe::detail::get_backend_version();
  } catch (...) {
    return 0;
  }
}

// dtype: 0 bf16, 1 f16. Returns 0 on success.
int sp_attn_fwd(const void *q, const void *k, const void *v, void *o, float *lse, int b, int s, int hq, int hkv, int d,
                float scale, int causal, int dtype, void *stream) {
  try {
    if (!ready(stream)) return 1;
    Entry *e = graph_for(false, b, s, hq, hkv, d, causal, scale, dtype);
    if (!e) return 1;
    std::unordered_map<int64_t, void *> ptrs{{Q, (void *)q}, {K, (void *)k}, {V, (void *)v}, {O, o}, {STATS, lse}};
    return run(e, ptrs);
  } catch (const std::exception &ex) {
    return fail(std::string("cuDNN SDPA forward: ") + ex.what());
  }
}

int sp_attn_bwd(const void *q, const void *k, const void *v, const void *o, const void *dout, const float *lse,
                void *dq, void *dk, void *dv, int b, int s, int hq, int hkv, int d, float scale, int causal, int dtype,
                void *stream) {
  try {
    if (!ready(stream)) return 1;
    Entry *e = graph_for(true, b, s, hq, hkv, d, causal, scale, dtype);
    if (!e) return 1;
    std::unordered_map<int64_t, void *> ptrs{{Q, (void *)q},        {K, (void *)k},  {V, (void *)v},
                                             {O, (void *)o},        {DO, (void *)dout}, {STATS, (void *)lse},
                                             {DQ, dq},              {DK, dk},        {DV, dv}};
    return run(e, ptrs);
  } catch (const std::exception &ex) {
    return fail(std::string("cuDNN SDPA backward: ") + ex.what());
  }
}

}  // extern "C"
