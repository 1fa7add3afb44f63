// CPU paged attention for decode (one query token per sequence), registered as the torch operator
// pdserve_paged_decode::paged_decode_attention: validates its input, then runs the kernel copy for the
// best instruction set this CPU has over (sequence, kv heads) tasks on torch's intra-op thread pool.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "paged_decode_params.h"

namespace pdserve {

static RunTasks select_kernel() {
#ifdef PD_MULTI_TARGET
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
    return &avx512::run_tasks;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &avx2::run_tasks;
#endif
  return &generic::run_tasks;
}

static RunTasks kernel() {
  static const RunTasks chosen = select_kernel();
  return chosen;
}

static std::string kernel_isa() {
#ifdef PD_MULTI_TARGET
  if (kernel() == &avx512::run_tasks) return "avx512";
  if (kernel() == &avx2::run_tasks) return "avx2";
#endif
  return "generic";
}

// A task is one sequence and a range of its kv heads; each query group shares one pass over its keys.
// A task with every kv head reads each block as one contiguous run instead of a slice of every token
// row (without the kernel's prefetching that pattern streamed much faster; with it, the two measure
// about equal), so heads are split only when there are too few sequences to give every thread a few
// tasks.
static int64_t task_splits(int64_t batch, int64_t num_kv_heads) {
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  for (int64_t splits = 1; splits < num_kv_heads; ++splits) {
    if (num_kv_heads % splits == 0 && batch * splits >= wanted) return splits;
  }
  return num_kv_heads;
}

static std::vector<int64_t> checked_context_lens(const at::Tensor& context_lens, int64_t batch, int64_t capacity) {
  TORCH_CHECK_VALUE(context_lens.dim() == 1 && context_lens.size(0) == batch,
                    "context_lens must have shape [", batch, "], got ", context_lens.sizes());
  TORCH_CHECK_VALUE(context_lens.scalar_type() == at::kLong || context_lens.scalar_type() == at::kInt,
                    "context_lens must be int64 or int32, got ", context_lens.scalar_type());
  std::vector<int64_t> lens(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = context_lens.scalar_type() == at::kLong
                            ? context_lens.data_ptr<int64_t>()[b * context_lens.stride(0)]
                            : context_lens.data_ptr<int32_t>()[b * context_lens.stride(0)];
    TORCH_CHECK_VALUE(len >= 1 && len <= capacity, "context_lens[", b, "] = ", len,
                      " is outside [1, max_blocks * block_size = ", capacity, "]");
    lens[b] = len;
  }
  return lens;
}

static void check_block_ids(const at::Tensor& table, const std::vector<int64_t>& lens, int64_t block_size,
                            int64_t num_blocks) {
  const int64_t* data = table.data_ptr<int64_t>();
  for (size_t b = 0; b < lens.size(); ++b) {
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    for (int64_t i = 0; i < used; ++i) {
      const int64_t id = data[b * table.stride(0) + i];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_table[", b, ", ", i, "] = ", id,
                        " is outside the cache's [0, ", num_blocks, ") blocks");
    }
  }
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale,
                                  std::optional<int64_t> sliding_window) {
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be [batch, heads, head_dim], got ", query.sizes());
  TORCH_CHECK_VALUE(key_cache.dim() == 4, "key_cache must be [num_blocks, block_size, kv_heads, head_dim], got ",
                    key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "value_cache shape ", value_cache.sizes(),
                    " differs from key_cache shape ", key_cache.sizes());
  const auto dtype = query.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype,
                    "query, key_cache and value_cache must share one dtype");
  for (const at::Tensor* t : {&query, &key_cache, &value_cache, &block_table, &context_lens}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "all tensors must be on the CPU, got ", t->device());
  }
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK_VALUE(key_cache.size(3) == head_dim, "cache head_dim ", key_cache.size(3), " != query head_dim ",
                    head_dim);
  TORCH_CHECK_VALUE(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, "query heads (", num_heads,
                    ") must be a multiple of kv heads (", num_kv_heads, ")");
  TORCH_CHECK_VALUE(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
                    "query, key_cache and value_cache need a contiguous last (head_dim) dimension");
  TORCH_CHECK_VALUE(block_table.dim() == 2 && block_table.size(0) == batch, "block_table must be [", batch,
                    ", max_blocks], got ", block_table.sizes());
  TORCH_CHECK_VALUE(block_table.scalar_type() == at::kLong || block_table.scalar_type() == at::kInt,
                    "block_table must be int64 or int32, got ", block_table.scalar_type());

  at::Tensor out = at::empty({batch, num_heads, head_dim}, query.options().memory_format(at::MemoryFormat::Contiguous));
  if (batch == 0) return out;
  // The kernel reads int64 ids; an int32 table is widened here (B x max_blocks, negligible next to K/V).
  const at::Tensor table = block_table.scalar_type() == at::kLong && block_table.stride(1) == 1
                               ? block_table
                               : block_table.to(at::kLong).contiguous();
  const std::vector<int64_t> lens = checked_context_lens(context_lens, batch, table.size(1) * block_size);
  check_block_ids(table, lens, block_size, num_blocks);
  const int64_t longest = *std::max_element(lens.begin(), lens.end());
  TORCH_CHECK_VALUE(!sliding_window.has_value() || *sliding_window >= 1, "sliding_window must be >= 1, got ",
                    sliding_window.value_or(0));

  DecodeParams p{};
  p.query = query.data_ptr();
  p.q_stride_seq = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.key = key_cache.data_ptr();
  p.k_stride_block = key_cache.stride(0);
  p.k_stride_token = key_cache.stride(1);
  p.k_stride_head = key_cache.stride(2);
  p.value = value_cache.data_ptr();
  p.v_stride_block = value_cache.stride(0);
  p.v_stride_token = value_cache.stride(1);
  p.v_stride_head = value_cache.stride(2);
  p.block_table = table.data_ptr<int64_t>();
  p.table_stride = table.stride(0);
  p.is_bfloat16 = dtype == at::kBFloat16;
  p.context_lens = lens.data();
  p.out = out.data_ptr();
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.group = num_heads / num_kv_heads;
  p.padded_context = (longest + 15) / 16 * 16;
  p.scale = static_cast<float>(scale);
  p.sliding_window = sliding_window.value_or(0);

  p.kv_heads_per_task = num_kv_heads / task_splits(batch, num_kv_heads);

  const RunTasks run_tasks = kernel();
  const int64_t num_tasks = batch * (num_kv_heads / p.kv_heads_per_task);
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) { run_tasks(p, begin, end); });
  return out;
}

std::string paged_decode_isa() { return kernel_isa(); }

}  // namespace pdserve

TORCH_LIBRARY(pdserve_paged_decode, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor context_lens, float scale, int? sliding_window=None) -> Tensor");
  m.def("isa() -> str", &pdserve::paged_decode_isa);
}

TORCH_LIBRARY_IMPL(pdserve_paged_decode, CPU, m) {
  m.impl("paged_decode_attention", &pdserve::paged_decode_attention);
}
