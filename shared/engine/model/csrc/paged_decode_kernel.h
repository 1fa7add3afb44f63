// Paged decode attention kernel body. Each paged_decode_<isa>.cpp includes this file inside its own
// namespace, compiled for its target, after defining PD_LANES (floats per native vector) and
// PD_VECTOR_REGISTERS (how many such vectors the registers hold); the operator picks a copy at run time.
// Only GCC/Clang vector extensions are used, so every copy is the same portable source.
// Expects paged_decode_params.h to be included first.

constexpr int kLanes = PD_LANES;
constexpr int kVectorRegisters = PD_VECTOR_REGISTERS;

typedef float vfloat __attribute__((vector_size(sizeof(float) * PD_LANES)));
typedef int32_t vint __attribute__((vector_size(sizeof(int32_t) * PD_LANES)));
typedef uint32_t vuint __attribute__((vector_size(sizeof(uint32_t) * PD_LANES)));
typedef uint16_t vhalf __attribute__((vector_size(sizeof(uint16_t) * PD_LANES)));

#define PD_INLINE static inline __attribute__((always_inline))
#define PD_MEMBER inline __attribute__((always_inline))

template <size_t... I>
PD_INLINE vfloat splat_lanes(float x, std::index_sequence<I...>) {
  return vfloat{((void)I, x)...};
}

// A broadcast; `vfloat{} + x` would cost a real addition, since x + 0.0 is not x for x = -0.0.
PD_INLINE vfloat splat(float x) { return splat_lanes(x, std::make_index_sequence<kLanes>{}); }

template <size_t... I>
PD_INLINE vint lane_index(std::index_sequence<I...>) {
  return vint{static_cast<int32_t>(I)...};
}

PD_INLINE vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 is the high half of a float32: widen and shift instead of a per-element conversion.
PD_INLINE vfloat load(const c10::BFloat16* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  vuint w = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

PD_INLINE void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

PD_INLINE float load1(const float* p) { return *p; }
PD_INLINE float load1(const c10::BFloat16* p) { return static_cast<float>(*p); }

PD_INLINE float hsum(vfloat v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

PD_INLINE float hmax(vfloat v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

PD_INLINE vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

#if defined(__clang__) || __GNUC__ >= 12
#define PD_HAS_SHUFFLE 1
// Transposing sum: from kLanes vectors a[t], a vector whose lane t is the sum of a[t]'s lanes, in
// kLanes - 1 shuffle pairs instead of kLanes horizontal sums. Each level pairs up vectors that each
// hold some tokens' partial sums in runs of W lanes, and folds every run in half: the output holds
// the tokens of x then those of y, in runs of W / 2.
constexpr int fold_index(int lane, int width, bool upper) {
  const int half = kLanes / 2;
  const int source = lane / half, within = lane % half;
  return source * kLanes + within / (width / 2) * width + within % (width / 2) + (upper ? width / 2 : 0);
}

template <int W, int... I>
PD_INLINE vfloat fold(vfloat x, vfloat y, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(x, y, fold_index(I, W, false)...) +
         __builtin_shufflevector(x, y, fold_index(I, W, true)...);
}

template <int W>
PD_INLINE void fold_level(vfloat* a, int count) {
  for (int i = 0; i < count / 2; ++i) a[i] = fold<W>(a[2 * i], a[2 * i + 1], std::make_integer_sequence<int, kLanes>{});
  if constexpr (W > 2) fold_level<W / 2>(a, count / 2);
}

PD_INLINE vfloat transpose_sum(vfloat* a) {
  fold_level<kLanes>(a, kLanes);
  return a[0];
}
#endif

// exp for x <= 0 (softmax arguments): round-to-nearest range reduction by ln 2 (split in two constants
// so n * ln2 is exact enough), degree-6 polynomial on |r| <= ln2 / 2, scale by 2^n through the exponent
// bits; about 1 ulp. Inputs below -87 are clamped, which keeps 2^n normal; e^-87 is far below any
// weight that can move a float32 sum that already holds the maximum's 1.
PD_INLINE vfloat vexp(vfloat x) {
  const vfloat lo = splat(-87.0f), hi = splat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vfloat magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vfloat n = x * 1.44269504088896341f + magic;
  n = n - magic;
  vfloat r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vint e = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// Blocks sit anywhere in the pool, so the hardware prefetcher cannot run ahead across a block boundary.
// A task reads its blocks as one stream (its K blocks, its V blocks, then the next task's first K
// blocks) and prefetches, into L2, the block kPrefetchDistance items ahead of the one it computes on.
// The prefetches are spread over that block's token iterations, a few cache lines each: a whole block
// issued in one burst overflows the core's miss queue (measured on Zen 4: burst prefetching was no
// faster than none; spread out, ~1.7x faster from DRAM).
constexpr int64_t kPrefetchDistance = PD_PREFETCH_DISTANCE;

class Prefetcher {
 public:
  explicit Prefetcher(int64_t lines_per_step) : lines_per_step_(lines_per_step) {}

  // Queues `rows` token rows of `span` bytes, `stride` bytes apart; issues what is left of the last one.
  void start(const void* first_row, int64_t rows, int64_t span, int64_t stride) {
    flush();
    row_ = static_cast<const char*>(first_row);
    offset_ = 0;
    rows_left_ = rows;
    span_ = span;
    stride_ = stride;
  }

  void flush() {
    while (rows_left_ > 0) step();
  }

  // Called once per token iteration of the compute loops.
  PD_MEMBER void step() {
    for (int64_t i = 0; i < lines_per_step_ && rows_left_ > 0; ++i) {
      __builtin_prefetch(row_ + offset_, 0, PD_PREFETCH_LOCALITY);
      offset_ += 64;
      if (offset_ >= span_) {
        offset_ = 0;
        row_ += stride_;
        --rows_left_;
      }
    }
  }

 private:
  const char* row_ = nullptr;
  int64_t offset_ = 0, rows_left_ = 0, span_ = 0, stride_ = 0;
  int64_t lines_per_step_;
};

// The part of the cache one task reads: a sequence's blocks, restricted to a range of kv heads. With a
// sliding window only the blocks holding the window's keys are read; token positions (and the logit
// buffer) count from the first of them.
template <typename T>
struct TaskBlocks {
  const T* key;  // at the first kv head of the range
  const T* value;
  const int64_t* blocks;  // from the first block read
  int64_t context;        // tokens from the first block read up to and including the query's own
  int64_t first_visible;  // keys before this one (in the same numbering) are outside the window
  int64_t num_blocks;     // blocks read

  TaskBlocks(const DecodeParams& p, int64_t seq, int64_t first_kv_head)
      : key(static_cast<const T*>(p.key) + first_kv_head * p.k_stride_head),
        value(static_cast<const T*>(p.value) + first_kv_head * p.v_stride_head) {
    const int64_t full_context = p.context_lens[seq];
    const int64_t first_key = p.sliding_window > 0 ? std::max<int64_t>(0, full_context - p.sliding_window) : 0;
    const int64_t first_block = first_key / p.block_size;
    blocks = p.block_table + seq * p.table_stride + first_block;
    context = full_context - first_block * p.block_size;
    first_visible = first_key - first_block * p.block_size;
    num_blocks = (context + p.block_size - 1) / p.block_size;
  }

  const T* k_block(const DecodeParams& p, int64_t blk) const { return key + blocks[blk] * p.k_stride_block; }
  const T* v_block(const DecodeParams& p, int64_t blk) const { return value + blocks[blk] * p.v_stride_block; }
  int64_t tokens_in(const DecodeParams& p, int64_t blk) const {
    return std::min(p.block_size, context - blk * p.block_size);
  }
};

// kD > 0: head_dim known at compile time (queries and accumulators live in registers); kD == 0: any.
template <typename T, int kD>
struct Task {
  static constexpr int kChunks = kD / kLanes;
  // Query rows handled together (a tile) share every K / V load; a tile's query or accumulator vectors
  // take at most half the vector registers.
  static constexpr int kMaxRows = kChunks == 0 ? 1 : std::clamp(kVectorRegisters / 2 / std::max(kChunks, 1), 1, 4);

  const DecodeParams& p;
  float* scores;  // [rows][padded_context]: logits, then unnormalised softmax weights
  float* qbuf;    // [rows][head_dim]: scaled queries in float32
  float* acc;     // [rows][head_dim] weighted value sums, then [rows] reciprocal weight sums

  int64_t head_dim() const { return kD > 0 ? kD : p.head_dim; }

  // Attention of the query heads of kv heads [first_kv_head, first_kv_head + num_kv) of one sequence;
  // `next` is the task that follows on this thread (its first blocks are prefetched), or null.
  void run(int64_t seq, int64_t first_kv_head, int64_t num_kv, const TaskBlocks<T>* next, bool prefetch_start) const {
    const int64_t d = head_dim();
    const int64_t rows = num_kv * p.group;  // query heads first_kv_head * group onwards, in order
    const TaskBlocks<T> own(p, seq, first_kv_head);
    const T* query = static_cast<const T*>(p.query) + seq * p.q_stride_seq + first_kv_head * p.group * p.q_stride_head;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < d; ++i) qbuf[r * d + i] = load1(query + r * p.q_stride_head + i) * p.scale;
    }

    const int64_t k_span = ((num_kv - 1) * p.k_stride_head + d) * sizeof(T);
    const int64_t v_span = ((num_kv - 1) * p.v_stride_head + d) * sizeof(T);
    // One token row of a block is consumed by num_kv * tiles token iterations; prefetch that row's lines
    // over as many steps, so a block ahead is fully requested by the time the current one is done.
    const int64_t steps_per_row = num_kv * num_row_tiles<kMaxRows>(p.group);
    // At least one line per step, whatever the row's size: a row shorter than a cache line (a small
    // head_dim) would otherwise be given zero lines per step and never finish being prefetched.
    const int64_t lines_per_row = (std::max(k_span, v_span) + 63) / 64;
    Prefetcher prefetcher(std::max<int64_t>(1, (lines_per_row + steps_per_row - 1) / steps_per_row));
    // Item i of this task's stream: K block i, then V block i - num_blocks, then the next task's K blocks.
    auto prefetch = [&](int64_t i) {
      const int64_t nb = own.num_blocks;
      if (i < nb) {
        prefetcher.start(own.k_block(p, i), own.tokens_in(p, i), k_span, p.k_stride_token * sizeof(T));
      } else if (i < 2 * nb) {
        prefetcher.start(own.v_block(p, i - nb), own.tokens_in(p, i - nb), v_span, p.v_stride_token * sizeof(T));
      } else if (next != nullptr && i - 2 * nb < next->num_blocks) {
        prefetcher.start(next->k_block(p, i - 2 * nb), next->tokens_in(p, i - 2 * nb), k_span,
                         p.k_stride_token * sizeof(T));
      }
    };
    if (prefetch_start) {
      // The first task of a thread has nothing before it to hide its first blocks behind.
      for (int64_t i = 0; i < kPrefetchDistance; ++i) {
        prefetch(i);
        prefetcher.flush();
      }
    }

    for (int64_t blk = 0; blk < own.num_blocks; ++blk) {
      prefetch(blk + kPrefetchDistance);
      const T* kb = own.k_block(p, blk);
      const int64_t n = own.tokens_in(p, blk);
      for (int64_t h = 0; h < num_kv; ++h) {
        for_row_tiles<kMaxRows>(h * p.group, p.group, [&](auto tile, int64_t r) {
          logits<decltype(tile)::value>(qbuf + r * d, kb + h * p.k_stride_head, n,
                                        scores + r * p.padded_context + blk * p.block_size, prefetcher);
        });
      }
    }

    float* inv_sum = acc + rows * d;
    for (int64_t r = 0; r < rows; ++r) inv_sum[r] = 1.0f / softmax_weights(scores + r * p.padded_context, own.first_visible, own.context);

    std::fill(acc, acc + rows * d, 0.0f);
    for (int64_t blk = 0; blk < own.num_blocks; ++blk) {
      prefetch(own.num_blocks + blk + kPrefetchDistance);
      const T* vb = own.v_block(p, blk);
      const int64_t n = own.tokens_in(p, blk);
      for (int64_t h = 0; h < num_kv; ++h) {
        for_row_tiles<kMaxRows>(h * p.group, p.group, [&](auto tile, int64_t r) {
          accumulate<decltype(tile)::value>(scores + r * p.padded_context + blk * p.block_size,
                                            vb + h * p.v_stride_head, n, acc + r * d, prefetcher);
        });
      }
    }

    T* out = static_cast<T*>(p.out) + (seq * p.num_heads + first_kv_head * p.group) * d;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < d; ++i) out[r * d + i] = static_cast<T>(acc[r * d + i] * inv_sum[r]);
    }
  }

  template <int R>
  static int64_t num_row_tiles(int64_t count) {
    if constexpr (kD == 0) {
      return count;
    } else {
      int64_t tiles = count / R;
      if constexpr (R > 1) tiles += num_row_tiles<R - 1>(count % R);
      return tiles;
    }
  }

  // Calls body(integral_constant<R>, first_row) over rows [first, first + count) in tiles of at most R.
  template <int R, typename F>
  PD_MEMBER void for_row_tiles(int64_t first, int64_t count, F&& body) const {
    if constexpr (kD == 0) {
      for (int64_t r = first; r < first + count; ++r) body(std::integral_constant<int, 1>{}, r);
    } else {
      for (; count >= R; first += R, count -= R) body(std::integral_constant<int, R>{}, first);
      if constexpr (R > 1) {
        if (count > 0) for_row_tiles<R - 1>(first, count, body);
      }
    }
  }

  // scores[r][t] = q_r . k_t for R consecutive query rows (q and scores rows apart by head_dim and
  // padded_context) and the n tokens of one block; each key row is loaded once for all R queries.
  template <int R>
  PD_MEMBER void logits(const float* q, const T* kb, int64_t n, float* s, Prefetcher& prefetcher) const {
    const int64_t stride = p.k_stride_token;
    if constexpr (kD > 0) {
      vfloat qv[R][kChunks];
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < kChunks; ++c) qv[r][c] = load(q + r * kD + c * kLanes);
      }
      // Per token and row a kLanes-wide partial dot product; two accumulators halve the FMA chain.
      auto partial = [&](const vfloat* kv, int r) {
        vfloat a0 = qv[r][0] * kv[0];
        vfloat a1 = splat(0.0f);
        for (int c = 1; c < kChunks; ++c) {
          if (c % 2) a1 += qv[r][c] * kv[c];
          else a0 += qv[r][c] * kv[c];
        }
        return a0 + a1;
      };
      for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
        const int64_t m = std::min<int64_t>(kLanes, n - t0);
        vfloat part[R][kLanes];
        for (int64_t t = 0; t < m; ++t) {
          prefetcher.step();
          vfloat kv[kChunks];
          for (int c = 0; c < kChunks; ++c) kv[c] = load(kb + (t0 + t) * stride + c * kLanes);
          for (int r = 0; r < R; ++r) part[r][t] = partial(kv, r);
        }
        for (int r = 0; r < R; ++r) {
#ifdef PD_HAS_SHUFFLE
          for (int64_t t = m; t < kLanes; ++t) part[r][t] = splat(0.0f);
          const vfloat sums = transpose_sum(part[r]);
          std::memcpy(s + r * p.padded_context + t0, &sums, m * sizeof(float));
#else
          for (int64_t t = 0; t < m; ++t) s[r * p.padded_context + t0 + t] = hsum(part[r][t]);
#endif
        }
      }
    } else {
      const int64_t d = p.head_dim;
      const int64_t vec_end = d / kLanes * kLanes;
      for (int64_t t = 0; t < n; ++t) {
        prefetcher.step();
        const T* k = kb + t * stride;
        vfloat a = splat(0.0f);
        for (int64_t i = 0; i < vec_end; i += kLanes) a += load(q + i) * load(k + i);
        float dot = hsum(a);
        for (int64_t i = vec_end; i < d; ++i) dot += q[i] * load1(k + i);
        s[t] = dot;
      }
    }
  }

  // Turns one row's logits over keys [first, context) into exp(logit - max) in place, zero for the keys
  // before first (outside a sliding window, first < block_size), and returns their sum. The row is padded
  // to a multiple of 16 floats, so the last vector may read past the context: those lanes are masked out.
  PD_MEMBER float softmax_weights(float* s, int64_t first, int64_t context) const {
    const vint lane = lane_index(std::make_index_sequence<kLanes>{});
    const vfloat neg_inf = splat(-INFINITY);
    auto is_partial = [&](int64_t i) { return i < first || context - i < kLanes; };
    auto visible = [&](int64_t i) {
      const vint position = lane + static_cast<int32_t>(i);
      return (position >= static_cast<int32_t>(first)) & (position < static_cast<int32_t>(context));
    };
    vfloat m = neg_inf;
    for (int64_t i = 0; i < context; i += kLanes) {
      vfloat v = load(s + i);
      if (is_partial(i)) v = visible(i) ? v : neg_inf;
      m = vmax(m, v);
    }
    const vfloat max = splat(hmax(m));
    vfloat sum = splat(0.0f);
    for (int64_t i = 0; i < context; i += kLanes) {
      vfloat e = vexp(load(s + i) - max);
      if (is_partial(i)) e = visible(i) ? e : splat(0.0f);
      store(s + i, e);
      sum += e;
    }
    return hsum(sum);
  }

  // acc_r += sum_t w_r[t] * v_t for R consecutive rows over the n tokens of one block; each value row
  // is loaded once for all R rows.
  template <int R>
  PD_MEMBER void accumulate(const float* w, const T* vb, int64_t n, float* acc_out, Prefetcher& prefetcher) const {
    const int64_t stride = p.v_stride_token;
    if constexpr (kD > 0) {
      // Fused multiply-adds have a latency of several cycles: with few (row, chunk) accumulators,
      // alternate tokens between two sets so that independent chains keep the FMA units busy.
      constexpr int kSets = R * kChunks < 8 && 2 * R * kChunks + kChunks <= kVectorRegisters ? 2 : 1;
      vfloat av[kSets][R][kChunks];
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < kChunks; ++c) {
          av[0][r][c] = load(acc_out + r * kD + c * kLanes);
          if constexpr (kSets == 2) av[1][r][c] = splat(0.0f);
        }
      }
      auto add_token = [&](int set, int64_t t) {
        prefetcher.step();
        vfloat vv[kChunks];
        for (int c = 0; c < kChunks; ++c) vv[c] = load(vb + t * stride + c * kLanes);
        for (int r = 0; r < R; ++r) {
          const vfloat wt = splat(w[r * p.padded_context + t]);
          for (int c = 0; c < kChunks; ++c) av[set][r][c] += wt * vv[c];
        }
      };
      int64_t t = 0;
      if constexpr (kSets == 2) {
        for (; t + 1 < n; t += 2) {
          add_token(0, t);
          add_token(1, t + 1);
        }
      }
      for (; t < n; ++t) add_token(0, t);
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < kChunks; ++c) {
          vfloat total = av[0][r][c];
          if constexpr (kSets == 2) total += av[1][r][c];
          store(acc_out + r * kD + c * kLanes, total);
        }
      }
    } else {
      const int64_t d = p.head_dim;
      const int64_t vec_end = d / kLanes * kLanes;
      for (int64_t t = 0; t < n; ++t) {
        prefetcher.step();
        const T* v = vb + t * stride;
        const vfloat wt = splat(w[t]);
        for (int64_t i = 0; i < vec_end; i += kLanes) store(acc_out + i, load(acc_out + i) + wt * load(v + i));
        for (int64_t i = vec_end; i < d; ++i) acc_out[i] += w[t] * load1(v + i);
      }
    }
  }
};

template <typename T, int kD>
void run_range(const DecodeParams& p, int64_t begin, int64_t end) {
  const int64_t rows = p.kv_heads_per_task * p.group;
  const int64_t d = p.head_dim;
  // One allocation per chunk of tasks, not per task, with rows on vector boundaries (padded_context is a
  // multiple of 16 floats): a vector access that straddles two cache lines costs double.
  const int64_t row_floats = (d + kLanes - 1) / kLanes * kLanes;
  std::vector<float> work(rows * p.padded_context + 2 * rows * row_floats + rows + kLanes);
  float* base = work.data();
  base += (kLanes - reinterpret_cast<uintptr_t>(base) / sizeof(float) % kLanes) % kLanes;
  const Task<T, kD> task{p, base, base + rows * p.padded_context, base + rows * p.padded_context + rows * row_floats};
  const int64_t tasks_per_seq = p.num_kv_heads / p.kv_heads_per_task;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t seq = i / tasks_per_seq, first_kv_head = i % tasks_per_seq * p.kv_heads_per_task;
    if (i + 1 < end) {
      const TaskBlocks<T> next(p, (i + 1) / tasks_per_seq, (i + 1) % tasks_per_seq * p.kv_heads_per_task);
      task.run(seq, first_kv_head, p.kv_heads_per_task, &next, i == begin);
    } else {
      task.run(seq, first_kv_head, p.kv_heads_per_task, nullptr, i == begin);
    }
  }
}

template <typename T>
void run_range_dim(const DecodeParams& p, int64_t begin, int64_t end) {
  switch (p.head_dim) {
    case 64: return run_range<T, 64>(p, begin, end);
    case 128: return run_range<T, 128>(p, begin, end);
    default: return run_range<T, 0>(p, begin, end);
  }
}

// Entry point of this instruction-set copy: runs tasks [begin, end); task i covers sequence
// i / tasks_per_seq, kv heads from i % tasks_per_seq * kv_heads_per_task.
void run_tasks(const DecodeParams& p, int64_t begin, int64_t end) {
  if (p.is_bfloat16) return run_range_dim<c10::BFloat16>(p, begin, end);
  run_range_dim<float>(p, begin, end);
}

#undef PD_INLINE
#undef PD_MEMBER
#undef PD_VECTOR_REGISTERS
#undef PD_LANES
