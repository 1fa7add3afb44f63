// Fused elementwise steps of the decoder layer, registered as torch operators
// pdserve_fused::add_rms_norm, pdserve_fused::rope_ and pdserve_fused::silu_mul: each replaces a chain
// of torch ops (one pass over the rows instead of one per op, no temporaries) with bit-identical results;
// rows run on torch's intra-op thread pool.
#pragma GCC optimize("fp-contract=off")  // a*b+c stays two roundings, as torch's separate ops round
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace pdserve {

struct NormParams {
  void* residual;  // [rows, hidden] rows residual_stride apart: the input, updated in place with delta
  int64_t residual_stride;
  const void* delta;  // null, or [rows, hidden] rows delta_stride apart, added to residual first
  int64_t delta_stride;
  const void* weight;  // [hidden]
  void* out;           // [rows, hidden] contiguous
  int64_t hidden;
  float eps;
  bool is_bfloat16;
};

struct SiluMulParams {
  const void* gate_up;  // [rows, 2 * width]: the gate half then the up half, rows gate_up_stride apart
  int64_t gate_up_stride;
  void* out;  // [rows, width] contiguous
  int64_t width;
  bool is_bfloat16;
};

struct RopeParams {
  void* x;  // [tokens, heads, head_dim], last dim contiguous
  int64_t token_stride, head_stride, num_heads, head_dim;
  const void* cos;  // [tokens, head_dim] rows cos_stride apart
  int64_t cos_stride;
  const void* sin;
  int64_t sin_stride;
  bool is_bfloat16;
};

#define FO_INLINE static inline __attribute__((always_inline))
#define FO_MEMBER inline __attribute__((always_inline))

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FO_MULTI_TARGET 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi2")
#include <immintrin.h>
// torch's Vectorized<float>::exp() on AVX-512 (libtorch_cpu exports its SLEEF functions). Weak: a torch
// without it still loads this library, and silu_mul then takes the generic path.
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
namespace avx512 {
// exp of 16 floats as torch's AVX-512 kernels compute it; their vectors are 64 bytes.
constexpr int64_t kExpLanes = 16;
constexpr int64_t kTorchVectorBytes = 64;
FO_INLINE void exp_lanes(const float* in, float* out) { _mm512_storeu_ps(out, Sleef_expf16_u10(_mm512_loadu_ps(in))); }
#include "fused_ops_kernel.h"
}
#pragma GCC pop_options
#endif
namespace generic {
// No vectorised exp here: std::exp everywhere (torch's scalar path), which the start-up check compares
// with what torch runs on this CPU before the fused op is used.
constexpr int64_t kExpLanes = 0;
constexpr int64_t kTorchVectorBytes = 64;
FO_INLINE void exp_lanes(const float*, float*) {}
#include "fused_ops_kernel.h"
}

static bool use_avx512() {
#ifdef FO_MULTI_TARGET
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  }();
  return supported;
#else
  return false;
#endif
}

// SLEEF's exp is found (silu_mul's AVX-512 copy needs it) and the CPU runs AVX-512.
static bool use_avx512_exp() {
#ifdef FO_MULTI_TARGET
  return use_avx512() && Sleef_expf16_u10 != nullptr;
#else
  return false;
#endif
}

template <typename P>
using RowKernel = void (*)(const P&, int64_t, int64_t);

// An op's AVX-512 copy (null where none is built) and its generic copy.
#ifdef FO_MULTI_TARGET
#define FO_KERNELS(name) avx512::name, generic::name
#else
#define FO_KERNELS(name) nullptr, generic::name
#endif

// Rows [0, rows) of row_elements elements each, on torch's intra-op pool in tasks of about grain_elements
// elements, by the AVX-512 copy when `wide` and built, else by the generic one.
template <typename P>
static void run_rows(const P& p, int64_t rows, int64_t row_elements, int64_t grain_elements, bool wide,
                     RowKernel<P> wide_kernel, RowKernel<P> generic_kernel) {
  const RowKernel<P> kernel = wide && wide_kernel != nullptr ? wide_kernel : generic_kernel;
  const int64_t grain = std::max<int64_t>(1, grain_elements / std::max<int64_t>(row_elements, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { kernel(p, begin, end); });
}

static void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t hidden, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == rows && t.size(1) == hidden, name, " must be [", rows, ", ",
                    hidden, "], got ", t.sizes());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.device().is_cpu(), name, " must be a CPU ", dtype, " tensor");
  TORCH_CHECK_VALUE(t.stride(1) == 1, name, " needs a contiguous last dimension");
}

// residual [rows, hidden] (+= delta in place when given); returns weight * normalised(residual).
at::Tensor add_rms_norm(const at::Tensor& residual, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK_VALUE(residual.dim() == 2, "residual must be [rows, hidden], got ", residual.sizes());
  const auto dtype = residual.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16, got ", dtype);
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  check_rows(residual, "residual", rows, hidden, dtype);
  if (delta.has_value()) check_rows(*delta, "delta", rows, hidden, dtype);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous() &&
                        weight.scalar_type() == dtype, "weight must be a contiguous [", hidden, "] ", dtype, " tensor");
  at::Tensor out = at::empty({rows, hidden}, residual.options().memory_format(at::MemoryFormat::Contiguous));
  NormParams p{residual.data_ptr(), residual.stride(0), delta.has_value() ? delta->data_ptr() : nullptr,
               delta.has_value() ? delta->stride(0) : 0, weight.data_ptr(), out.data_ptr(), hidden,
               static_cast<float>(eps), dtype == at::kBFloat16};
  run_rows(p, rows, hidden, 16384, use_avx512(), FO_KERNELS(run_norm));
  return out;
}

// silu(gate_up[:, :width]) * gate_up[:, width:] as a new [rows, width] tensor.
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t width) {
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) == 2 * width && gate_up.stride(1) == 1,
                    "gate_up must be [rows, 2 * ", width, "] with a contiguous last dimension, got ", gate_up.sizes());
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(gate_up.device().is_cpu(), "gate_up must be a CPU tensor");
  const int64_t rows = gate_up.size(0);
  at::Tensor out = at::empty({rows, width}, gate_up.options().memory_format(at::MemoryFormat::Contiguous));
  SiluMulParams p{gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), width, dtype == at::kBFloat16};
  run_rows(p, rows, width, 32768, use_avx512_exp(), FO_KERNELS(run_silu_mul));
  return out;
}

// x [tokens, heads, head_dim] rotated in place by cos/sin [tokens, head_dim].
void rope_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK_VALUE(x.dim() == 3 && x.stride(2) == 1, "x must be [tokens, heads, head_dim] with a contiguous "
                    "last dimension, got ", x.sizes(), " strides ", x.strides());
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16, got ", dtype);
  const int64_t tokens = x.size(0), head_dim = x.size(2);
  TORCH_CHECK_VALUE(head_dim % 2 == 0, "head_dim must be even, got ", head_dim);
  check_rows(cos, "cos", tokens, head_dim, dtype);
  check_rows(sin, "sin", tokens, head_dim, dtype);
  RopeParams p{x.data_ptr(), x.stride(0), x.stride(1), x.size(1), head_dim, cos.data_ptr(), cos.stride(0),
               sin.data_ptr(), sin.stride(0), dtype == at::kBFloat16};
  run_rows(p, tokens, x.size(1) * head_dim, 16384, use_avx512(), FO_KERNELS(run_rope));
}

}  // namespace pdserve

TORCH_LIBRARY(pdserve_fused, m) {
  m.def("add_rms_norm(Tensor(a!) residual, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up, int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_fused, CPU, m) {
  m.impl("add_rms_norm", &pdserve::add_rms_norm);
  m.impl("rope_", &pdserve::rope_);
  m.impl("silu_mul", &pdserve::silu_mul);
}
