// What the paged decode kernel copies share: the task description, and one run_tasks per instruction
// set (paged_decode_avx512.cpp, paged_decode_avx2.cpp, paged_decode_generic.cpp; separate files so
// that the JIT build compiles them in parallel).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

// Several copies for x86-64 with GCC, chosen at run time; elsewhere (other CPUs, Clang) only the
// generic copy, compiled for the build's default target.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PD_MULTI_TARGET 1
#endif

// Blocks of prefetch distance and the prefetch hint (2: into L2), measured best on Zen 4.
#ifndef PD_PREFETCH_DISTANCE
#define PD_PREFETCH_DISTANCE 2
#endif
#ifndef PD_PREFETCH_LOCALITY
#define PD_PREFETCH_LOCALITY 2
#endif

namespace pdserve {

// Everything a task needs, with the cache's element strides so that a cache viewed out of a larger
// pool works as well as a standalone one. Validated by the operator before any kernel runs.
struct DecodeParams {
  const void* query;  // [B, H, D], last dim contiguous
  int64_t q_stride_seq, q_stride_head;
  const void* key;  // [num_blocks, block_size, KVH, D], last dim contiguous
  int64_t k_stride_block, k_stride_token, k_stride_head;
  const void* value;
  int64_t v_stride_block, v_stride_token, v_stride_head;
  const int64_t* block_table;  // [B, max_blocks], last dim contiguous, ids within the cache
  int64_t table_stride;
  bool is_bfloat16;             // else float32
  const int64_t* context_lens;  // [B], each in [1, max_blocks * block_size]
  void* out;                    // [B, H, D] contiguous
  int64_t num_heads, num_kv_heads, head_dim, block_size, group;
  int64_t kv_heads_per_task;  // divides num_kv_heads
  int64_t padded_context;     // longest context rounded up to 16: the row length of the logit buffer
  int64_t sliding_window;     // > 0: a query sees only the last sliding_window keys (itself included)
  float scale;
};

// Runs tasks [begin, end); task i covers sequence i / tasks_per_seq and its kv heads from
// i % tasks_per_seq * kv_heads_per_task, where tasks_per_seq = num_kv_heads / kv_heads_per_task.
using RunTasks = void (*)(const DecodeParams&, int64_t, int64_t);

namespace generic {
void run_tasks(const DecodeParams& p, int64_t begin, int64_t end);
}
#ifdef PD_MULTI_TARGET
namespace avx2 {
void run_tasks(const DecodeParams& p, int64_t begin, int64_t end);
}
namespace avx512 {
void run_tasks(const DecodeParams& p, int64_t begin, int64_t end);
}
#endif

}  // namespace pdserve
