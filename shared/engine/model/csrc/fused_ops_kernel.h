// Fused RMSNorm (with the residual add before it), rotary embedding and SiLU-and-multiply, bit-identical
// to the torch op chains they replace (llama.py's RMSNorm, apply_rope and silu(gate) * up): every float32 product
// and sum is the same, rounded to the storage dtype where torch rounds. Included by fused_ops.cpp inside
// one namespace per instruction set; only GCC/Clang vector extensions and scalar code.

// Element loads and stores through the storage bits, in integer steps the compiler vectorises (through
// c10::BFloat16's class it kept the norm's loops scalar). Widening is a shift; narrowing rounds to nearest
// even and maps NaN to 0x7fc0, exactly as c10::detail::round_to_nearest_even does.
FO_INLINE float load(const float* p) { return *p; }
FO_INLINE void store(float* p, float value) { *p = value; }

FO_INLINE float widen_bfloat16(uint16_t storage) {
  const uint32_t bits = static_cast<uint32_t>(storage) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

FO_INLINE float load(const c10::BFloat16* p) { return widen_bfloat16(p->x); }

FO_INLINE uint16_t bfloat16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const uint32_t rounded = (bits + UINT32_C(0x7fff) + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(value != value ? UINT32_C(0x7fc0) : rounded);
}

FO_INLINE void store(c10::BFloat16* p, float value) { p->x = bfloat16_bits(value); }

// value rounded to T and back: the float32 that T holds after torch's op writes value to it.
template <typename T>
FO_INLINE float rounded(float value) {
  if constexpr (std::is_same_v<T, float>) {
    return value;
  } else {
    return widen_bfloat16(bfloat16_bits(value));
  }
}

// sum(x[i]^2) in the order of torch's float32 sum over a contiguous last dimension (aten's
// SumKernel.cpp: vectorized_inner_sum -> row_sum (4 interleaved accumulators of `lanes`-wide vectors,
// cascaded in levels) -> the scalar tail, then the lanes one by one), whose vectors are 8 floats on
// every x86-64 code path torch runs (AVX-512 included: measured, 8 lanes match bit for bit, 16 do not).
template <int kLanes>
struct Lanes {
  float v[kLanes];
  FO_MEMBER void add(const Lanes& o) {
    for (int l = 0; l < kLanes; ++l) v[l] += o.v[l];
  }
  FO_MEMBER void add(const float* p) {
    for (int l = 0; l < kLanes; ++l) v[l] += p[l];
  }
};

template <int kLanes>
FO_INLINE float torch_sum_of_squares(const float* sq, int64_t n) {
  constexpr int kIlp = 4, kLevels = 4;
  const int64_t num_vectors = n / kLanes;
  const int64_t rows = num_vectors / kIlp;  // multi_row_sum's size
  int64_t ceil_log2 = 0;
  while ((int64_t{1} << ceil_log2) < rows) ++ceil_log2;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  Lanes<kLanes> acc[kLevels][kIlp] = {};
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i) {
      for (int k = 0; k < kIlp; ++k) acc[0][k].add(sq + (i * kIlp + k) * kLanes);
    }
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k) {
        acc[j][k].add(acc[j - 1][k]);
        acc[j - 1][k] = Lanes<kLanes>{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i) {
    for (int k = 0; k < kIlp; ++k) acc[0][k].add(sq + (i * kIlp + k) * kLanes);
  }
  for (int j = 1; j < kLevels; ++j) {
    for (int k = 0; k < kIlp; ++k) acc[0][k].add(acc[j][k]);
  }
  for (int64_t v = rows * kIlp; v < num_vectors; ++v) acc[0][0].add(sq + v * kLanes);
  for (int k = 1; k < kIlp; ++k) acc[0][0].add(acc[0][k]);
  float total = 0.0f;
  for (int64_t t = num_vectors * kLanes; t < n; ++t) total += sq[t];
  for (int l = 0; l < kLanes; ++l) total += acc[0][0].v[l];
  return total;
}

// One row: optionally residual += delta (rounded to T, and written back), then
// out = weight * T(x * 1 / sqrt(sum(x^2) / n + eps)), x in float32, as llama.py's RMSNorm.
template <typename T, int kLanes>
FO_INLINE void norm_row(T* residual, const T* delta, const T* weight, T* out, int64_t n, float eps, float* x,
                        float* sq) {
  if (delta != nullptr) {  // two loops, not a test per element: the test kept the loop from vectorising
    for (int64_t i = 0; i < n; ++i) {
      const float v = rounded<T>(load(residual + i) + load(delta + i));
      store(residual + i, v);
      x[i] = v;
      sq[i] = v * v;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float v = load(residual + i);
      x[i] = v;
      sq[i] = v * v;
    }
  }
  const float variance = torch_sum_of_squares<kLanes>(sq, n) / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(variance + eps);
  for (int64_t i = 0; i < n; ++i) {
    store(out + i, load(weight + i) * rounded<T>(x[i] * inv));
  }
}

template <typename T, int kLanes>
void norm_rows(const NormParams& p, int64_t begin, int64_t end) {
  std::vector<float> work(2 * p.hidden);
  T* residual = static_cast<T*>(p.residual);
  const T* delta = static_cast<const T*>(p.delta);
  for (int64_t r = begin; r < end; ++r) {
    norm_row<T, kLanes>(residual + r * p.residual_stride, delta == nullptr ? nullptr : delta + r * p.delta_stride,
                        static_cast<const T*>(p.weight), static_cast<T*>(p.out) + r * p.hidden, p.hidden, p.eps,
                        work.data(), work.data() + p.hidden);
  }
}

constexpr int kTorchSumLanes = 8;

void run_norm(const NormParams& p, int64_t begin, int64_t end) {
  if (p.is_bfloat16) return norm_rows<c10::BFloat16, kTorchSumLanes>(p, begin, end);
  norm_rows<float, kTorchSumLanes>(p, begin, end);
}

// In place, per head row x of head_dim d (half h = d / 2), with c, s the position's cos/sin rows:
// y = T(x * c); y[:h] = T(y[:h] - T(x[h:] * s[:h])); y[h:] = T(y[h:] + T(x[:h] * s[h:])).
template <typename T>
void rope_rows(const RopeParams& p, int64_t begin, int64_t end) {
  const int64_t d = p.head_dim, h = d / 2;
  std::vector<float> x(d);
  for (int64_t t = begin; t < end; ++t) {
    const T* c = static_cast<const T*>(p.cos) + t * p.cos_stride;
    const T* s = static_cast<const T*>(p.sin) + t * p.sin_stride;
    for (int64_t head = 0; head < p.num_heads; ++head) {
      T* row = static_cast<T*>(p.x) + t * p.token_stride + head * p.head_stride;
      for (int64_t i = 0; i < d; ++i) x[i] = load(row + i);
      for (int64_t i = 0; i < h; ++i) {
        const float y = rounded<T>(x[i] * load(c + i));
        store(row + i, y - rounded<T>(x[i + h] * load(s + i)));
      }
      for (int64_t i = h; i < d; ++i) {
        const float y = rounded<T>(x[i] * load(c + i));
        store(row + i, y + rounded<T>(x[i - h] * load(s + i)));
      }
    }
  }
}

void run_rope(const RopeParams& p, int64_t begin, int64_t end) {
  if (p.is_bfloat16) return rope_rows<c10::BFloat16>(p, begin, end);
  rope_rows<float>(p, begin, end);
}

// out = T(T(silu(g)) * u) per row, silu(g) = g / (1 + exp(-g)) in float32 as aten's silu_kernel computes it:
// its vectorised loop takes two vectors of T at a time (exp from exp_lanes, the instruction set's
// vectorised exp) and the remainder of the row element by element (std::exp); the product rounds as
// torch's mul does.
template <typename T>
void silu_mul_rows(const SiluMulParams& p, int64_t begin, int64_t end) {
  const int64_t w = p.width;
  const int64_t pair = 2 * kTorchVectorBytes / static_cast<int64_t>(sizeof(T));
  const int64_t vector_end = kExpLanes > 0 ? w / pair * pair : 0;
  std::vector<float> negated(w), e(w);
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = static_cast<const T*>(p.gate_up) + r * p.gate_up_stride;
    const T* up = gate + w;
    T* out = static_cast<T*>(p.out) + r * w;
    for (int64_t i = 0; i < w; ++i) negated[i] = -load(gate + i);
    for (int64_t i = 0; i < vector_end; i += kExpLanes) exp_lanes(&negated[i], &e[i]);  // none without kExpLanes
    for (int64_t i = vector_end; i < w; ++i) e[i] = std::exp(negated[i]);
    for (int64_t i = 0; i < w; ++i) {
      const float silu = rounded<T>(load(gate + i) / (1.0f + e[i]));
      store(out + i, silu * load(up + i));
    }
  }
}

void run_silu_mul(const SiluMulParams& p, int64_t begin, int64_t end) {
  if (p.is_bfloat16) return silu_mul_rows<c10::BFloat16>(p, begin, end);
  silu_mul_rows<float>(p, begin, end);
}
