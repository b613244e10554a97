// Decode attention over a paged KV pool: one call per layer for the whole batch.
//
// Each running request's K and V live in fixed-size blocks of one pool per layer,
//
//     k_cache           [num_blocks, kv_heads, head_dim, block_size]  (K transposed in its block)
//     v_cache           [num_blocks, kv_heads, block_size, head_dim]
//     block_tables      [batch, max_blocks]  int32: row b's i-th block holds its tokens
//                                            [i * block_size, (i + 1) * block_size)
//
// `decode_attention` first writes every row's new K and V at its position (positions[b]), then
// attends each row's query heads over its tokens [0, positions[b]]. It is a flash-decoding loop:
// the work is split into items (a row and a span of at most `span_tokens` of its tokens), so that
// a short batch of long contexts still spreads over every thread; an item reads its span's K (then
// V) block by block, each block of every kv head one contiguous read, once for all the query heads
// that share a kv head (GQA); when a row was split, the spans' partial results are merged exactly
// (log-sum-exp rescaling) in a second pass.
//
// Numerics: a span is computed as torch's CPU flash attention computes one of its key blocks (so
// a request decoded here agrees with transformers' decoding in the same dtype): scores q.k in
// float32, then scaled; exp(score - the span's max) summed in float32; in bfloat16 the weights
// rounded to bfloat16 before they multiply V (torch multiplies bfloat16 matrices), accumulated in
// float32; the output rounded once to the query's dtype. The order of the float32 sums differs
// from torch's, so a row agrees with it to rounding, not bit for bit (tests/greedy.py).
//
// Threads: at::parallel_for, so the kernel follows torch.set_num_threads like every other op.

// NOTE: ATen's and the op registry's headers only, not torch/extension.h: no Python headers are
// needed to build it (a slim container has none), and it compiles in a fraction of the time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

constexpr int kMaxGroup = 16;     // query heads per kv head the kernel supports
constexpr int kMaxHeads = 64;     // query heads the kernel supports
constexpr int kMaxHeadDim = 256;  // head_dim the kernel supports
constexpr int kMaxBlock = 256;    // block_size the kernel supports

using namespace moonbus_vec;

template <typename scalar_t>
void write_new_kv(const scalar_t* k_new, const scalar_t* v_new, scalar_t* k_cache, scalar_t* v_cache,
                  const int32_t* tables, const int64_t* positions, int64_t batch, int64_t kv_heads,
                  int64_t block_size, int64_t head_dim, int64_t max_blocks) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pos = positions[b];
    const int64_t block = tables[b * max_blocks + pos / block_size];
    const int64_t offset = pos % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const scalar_t* k = k_new + (b * kv_heads + h) * head_dim;
      scalar_t* kb = k_cache + (block * kv_heads + h) * head_dim * block_size;  // [head_dim, block_size]
      for (int64_t d = 0; d < head_dim; ++d) kb[d * block_size + offset] = k[d];
      std::memcpy(v_cache + ((block * kv_heads + h) * block_size + offset) * head_dim,
                  v_new + (b * kv_heads + h) * head_dim, head_dim * sizeof(scalar_t));
    }
  }
}

// float32 -> the nearest bfloat16 (ties to even), kept as a float32 value.
inline float round_to_bfloat16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// One item: every query head of row b over its tokens [start, end), one span (start on a block
// boundary). q [heads, head_dim] in float32. Leaves, per query head, the span's max score, the sum
// of exp(score - max) and the unnormalised output sum of exp(score - max) * V.
//
// The span is computed the way torch's CPU flash attention computes one of its key blocks, so
// that a request decoded here agrees with one decoded by transformers (scaled_dot_product_attention)
// in the same dtype: scores q.k in float32, then scaled; the span's max; the weights exp(s - max)
// summed in float32; in bfloat16, the weights rounded to bfloat16 before they multiply V (torch
// multiplies them as bfloat16 matrices), accumulated in float32.
//
// K is stored transposed within a block ([head_dim, block_size]), so a block's scores come out
// as vectors of kLanes tokens, each dimension one FMA with the query's value broadcast: no
// horizontal sums. A block's K (then V) of every kv head is one contiguous read, so the hardware
// prefetcher streams it. block_size is a multiple of kLanes (checked by the caller).
template <typename scalar_t, int kGroup>
void attend_span(const float* q, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* table,
                 int64_t kv_heads, int64_t block_size, int64_t head_dim, int64_t runtime_group, float scale,
                 int64_t start, int64_t end, float* scores_buf, float* max_out, float* sum_out, float* acc_out) {
  // kGroup > 0: query heads per kv head known at compile time, so the per-head loops unroll and
  // their accumulators stay in registers; 0: the group size of a model no instance below covers
  const int64_t group = kGroup > 0 ? kGroup : runtime_group;
  const int64_t heads = kv_heads * group, token_vecs = block_size / kLanes, span = end - start;
  const int64_t stride = (span + block_size - 1) / block_size * block_size;  // a head's row of scores_buf
  auto scores = [&](int64_t g) { return scores_buf + g * stride; };
  // the span's scores, kLanes tokens at a time, for every query head of each kv head
  for (int64_t t = start; t < end; t += block_size) {
    const int64_t block = table[t / block_size];
    for (int64_t h = 0; h < kv_heads; ++h) {
      const scalar_t* kb = k_cache + (block * kv_heads + h) * head_dim * block_size;  // [head_dim, block_size]
      const float* qh = q + h * group * head_dim;
      for (int64_t tv = 0; tv < token_vecs; ++tv) {
        // four partial sums per query head (dimensions d mod 4): independent FMA chains
        vf dots[4][kMaxGroup];
        for (int u = 0; u < 4; ++u)
          for (int64_t g = 0; g < group; ++g) dots[u][g] = vzero();
        int64_t d = 0;
        for (; d + 4 <= head_dim; d += 4) {
          for (int u = 0; u < 4; ++u) {
            const vf kd = vload(kb + (d + u) * block_size + tv * kLanes);
            for (int64_t g = 0; g < group; ++g) dots[u][g] = vfma(vset(qh[g * head_dim + d + u]), kd, dots[u][g]);
          }
        }
        for (; d < head_dim; ++d) {
          const vf kd = vload(kb + d * block_size + tv * kLanes);
          for (int64_t g = 0; g < group; ++g) dots[0][g] = vfma(vset(qh[g * head_dim + d]), kd, dots[0][g]);
        }
        const vf sc = vset(scale);
        for (int64_t g = 0; g < group; ++g)
          vstore(scores(h * group + g) + (t - start) + tv * kLanes,
                 vmul(vadd(vadd(dots[0][g], dots[1][g]), vadd(dots[2][g], dots[3][g])), sc));
      }
    }
  }
  // the weights: exp(score - the span's max), summed; rounded as torch rounds them in bfloat16
  constexpr bool kRound = std::is_same<scalar_t, c10::BFloat16>::value;
  for (int64_t g = 0; g < heads; ++g) {
    float* sg = scores(g);
    const float m = max_of(sg, span);
    const float total = exp_in_place(sg, span, m);
    if (kRound)
      for (int64_t i = 0; i < span; ++i) sg[i] = round_to_bfloat16(sg[i]);
    max_out[g] = m;
    sum_out[g] = total;
  }
  // the weighted V ([block_size, head_dim] per block): each V read once for its group, the
  // group's output in registers across a block's tokens
  std::fill(acc_out, acc_out + heads * head_dim, 0.f);
  for (int64_t t = start; t < end; t += block_size) {
    const int64_t block = table[t / block_size];
    const int64_t count = std::min(block_size, end - t);  // slots past `count` are not tokens yet
    for (int64_t h = 0; h < kv_heads; ++h) {
      const scalar_t* vb = v_cache + (block * kv_heads + h) * block_size * head_dim;
      for (int64_t c = 0; c < head_dim; c += kLanes) {
        // four partial outputs per query head (tokens i mod 4): independent FMA chains
        vf acc[4][kMaxGroup];
        for (int64_t g = 0; g < group; ++g) {
          acc[0][g] = vload(acc_out + (h * group + g) * head_dim + c);
          acc[1][g] = acc[2][g] = acc[3][g] = vzero();
        }
        int64_t i = 0;
        for (; i + 4 <= count; i += 4) {
          for (int u = 0; u < 4; ++u) {
            const vf vc = vload(vb + (i + u) * head_dim + c);
            for (int64_t g = 0; g < group; ++g)
              acc[u][g] = vfma(vset(scores(h * group + g)[t - start + i + u]), vc, acc[u][g]);
          }
        }
        for (; i < count; ++i) {
          const vf vc = vload(vb + i * head_dim + c);
          for (int64_t g = 0; g < group; ++g) acc[0][g] = vfma(vset(scores(h * group + g)[t - start + i]), vc, acc[0][g]);
        }
        for (int64_t g = 0; g < group; ++g)
          vstore(acc_out + (h * group + g) * head_dim + c, vadd(vadd(acc[0][g], acc[1][g]), vadd(acc[2][g], acc[3][g])));
      }
    }
  }
}

template <typename scalar_t>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& tables, const at::Tensor& positions, double scale,
                           int64_t span_tokens, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = v_cache.size(1), block_size = v_cache.size(2);
  const int64_t group = heads / kv_heads, max_blocks = tables.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kc = k_cache.data_ptr<scalar_t>();
  const scalar_t* vc = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();

  // the items: per row, its spans (every head of the row in each)
  std::vector<int64_t> first_item(batch + 1, 0), spans(batch);
  for (int64_t b = 0; b < batch; ++b) {
    spans[b] = (pos[b] + 1 + span_tokens - 1) / span_tokens;
    first_item[b + 1] = first_item[b] + spans[b];
  }
  const int64_t num_items = first_item[batch];
  // per item and query head: max, sum, and the unnormalised output
  std::vector<float> maxes(num_items * heads), sums(num_items * heads), accs(num_items * heads * head_dim);
  const float fscale = static_cast<float>(scale);
  auto span_fn = &attend_span<scalar_t, 0>;
  switch (group) {
    case 1: span_fn = &attend_span<scalar_t, 1>; break;
    case 2: span_fn = &attend_span<scalar_t, 2>; break;
    case 3: span_fn = &attend_span<scalar_t, 3>; break;
    case 4: span_fn = &attend_span<scalar_t, 4>; break;
    case 5: span_fn = &attend_span<scalar_t, 5>; break;
    case 6: span_fn = &attend_span<scalar_t, 6>; break;
    case 7: span_fn = &attend_span<scalar_t, 7>; break;
    case 8: span_fn = &attend_span<scalar_t, 8>; break;
    default: break;
  }

  const int64_t span_stride = (span_tokens + block_size - 1) / block_size * block_size;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t stop) {
    alignas(64) float qf[kMaxHeads * kMaxHeadDim];
    std::vector<float> scores(heads * span_stride);  // one span's scores of every query head
    for (int64_t item = begin; item < stop; ++item) {
      const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t span = item - first_item[b];
      const int64_t start = span * span_tokens, end = std::min(pos[b] + 1, start + span_tokens);
      const scalar_t* qrow = qp + b * heads * head_dim;
      for (int64_t i = 0; i < heads * head_dim; ++i) qf[i] = to_float(qrow[i]);
      span_fn(qf, kc, vc, tab + b * max_blocks, kv_heads, block_size, head_dim, group, fscale, start, end,
              scores.data(), &maxes[item * heads], &sums[item * heads], &accs[item * heads * head_dim]);
    }
  });

  // merge each row's spans per query head and write the output
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t stop) {
    float merged[kMaxHeadDim];
    for (int64_t bh = begin; bh < stop; ++bh) {
      const int64_t b = bh / heads, g = bh % heads;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < spans[b]; ++s) m = std::max(m, maxes[(first_item[b] + s) * heads + g]);
      float total = 0.f;
      std::fill(merged, merged + head_dim, 0.f);
      for (int64_t s = 0; s < spans[b]; ++s) {
        const int64_t at = (first_item[b] + s) * heads + g;
        const float w = std::exp(maxes[at] - m);
        total += sums[at] * w;
        const float* a = &accs[at * head_dim];
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += w * a[d];
      }
      scalar_t* o = op + bh * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(merged[d] / total);
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "decode_attention: ", what); }

}  // namespace

// q [B, Hq, D], k_new / v_new [B, Hkv, D], k_cache [NB, Hkv, D, BS], v_cache [NB, Hkv, BS, D], tables [B, MB] int32,
// positions [B] int64 (where each row's new token lands). Returns [B, Hq, D].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& tables,
                            const at::Tensor& positions, double scale, int64_t span_tokens) {
  check(q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3, "q, k_new, v_new must be [B, H, D]");
  check(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be 4-d");
  check(q.is_contiguous() && k_new.is_contiguous() && v_new.is_contiguous() && k_cache.is_contiguous() &&
            v_cache.is_contiguous() && tables.is_contiguous() && positions.is_contiguous(),
        "every tensor must be contiguous");
  check(q.scalar_type() == k_cache.scalar_type() && k_new.scalar_type() == k_cache.scalar_type() &&
            v_new.scalar_type() == k_cache.scalar_type(),
        "q, the new K, V and the caches must share one dtype");
  check(tables.scalar_type() == at::kInt && positions.scalar_type() == at::kLong, "tables int32, positions int64");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = v_cache.size(1), block_size = v_cache.size(2);
  check(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == kv_heads && k_cache.size(2) == head_dim &&
            k_cache.size(3) == block_size && v_cache.size(3) == head_dim,
        "k_cache must be [blocks, kv heads, D, block], v_cache [blocks, kv heads, block, D]");
  check(k_new.size(1) == kv_heads && k_new.size(2) == head_dim && v_new.sizes() == k_new.sizes(), "shapes disagree");
  check(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup && heads <= kMaxHeads, "query heads out of range");
  check(head_dim <= kMaxHeadDim && head_dim % kLanes == 0, "head_dim must be a multiple of the CPU's vector width, <= 256");
  check(block_size <= kMaxBlock && block_size % kLanes == 0,
        "the block size must be a multiple of the CPU's vector width (16 floats with AVX-512), <= 256");
  check(tables.size(0) == batch && positions.size(0) == batch, "one table and one position per row");
  check(span_tokens > 0 && span_tokens % block_size == 0, "span_tokens must be a multiple of the block size");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int64_t num_blocks = k_cache.size(0), max_blocks = tables.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    check(pos[b] >= 0 && pos[b] / block_size < max_blocks, "a position past its row's block table");
    for (int64_t i = 0; i <= pos[b] / block_size; ++i) {
      const int32_t block = tab[b * max_blocks + i];
      check(block >= 0 && block < num_blocks, "a block id outside the pool");
    }
  }
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    write_new_kv<float>(k_new.data_ptr<float>(), v_new.data_ptr<float>(), k_cache.data_ptr<float>(),
                        v_cache.data_ptr<float>(), tab, pos, batch, kv_heads, block_size, head_dim, max_blocks);
    decode_attention_impl<float>(q, k_cache, v_cache, tables, positions, scale, span_tokens, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    write_new_kv<c10::BFloat16>(k_new.data_ptr<c10::BFloat16>(), v_new.data_ptr<c10::BFloat16>(),
                                k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(), tab, pos, batch,
                                kv_heads, block_size, head_dim, max_blocks);
    decode_attention_impl<c10::BFloat16>(q, k_cache, v_cache, tables, positions, scale, span_tokens, out);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only");
  }
  return out;
}

// The rotary embedding of a decode step's q and k heads, as common/engine/llama.py `_rotate`
// computes it (per head, halves x1, x2 -> x1 cos - x2 sin, x2 cos + x1 sin, each product, then
// the difference or sum, rounded to the dtype as torch's ops round them), and v copied out.
template <typename scalar_t>
void rotate_rows(const scalar_t* qkv, int64_t row_stride, const scalar_t* cos, const scalar_t* sin, int64_t batch,
                 int64_t heads, int64_t kv_heads, int64_t head_dim, scalar_t* q, scalar_t* k, scalar_t* v) {
  // each product rounded to the dtype on its own, as torch's separate ops round it: the empty asm
  // keeps the compiler (-ffp-contract=fast) from fusing a float32 product into the FMA of the sum
  auto r = [](float x) {
    asm("" : "+x"(x));
    return static_cast<float>(static_cast<scalar_t>(x));
  };
  const int64_t half = head_dim / 2;
  for (int64_t b = 0; b < batch; ++b) {
    const scalar_t* row = qkv + b * row_stride;
    const scalar_t* c = cos + b * half;
    const scalar_t* sn = sin + b * half;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const scalar_t* x = row + h * head_dim;
      scalar_t* o = h < heads ? q + (b * heads + h) * head_dim : k + (b * kv_heads + h - heads) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_float(x[i]), x2 = to_float(x[half + i]), ci = to_float(c[i]), si = to_float(sn[i]);
        o[i] = static_cast<scalar_t>(r(x1 * ci) - r(x2 * si));
        o[half + i] = static_cast<scalar_t>(r(x2 * ci) + r(x1 * si));
      }
    }
    std::memcpy(v + b * kv_heads * head_dim, row + (heads + kv_heads) * head_dim, kv_heads * head_dim * sizeof(scalar_t));
  }
}

// qkv [B, (Hq + 2 Hkv) D] (a decode step's joined projection, rows may be strided), cos, sin
// [B, D / 2]: rotates q and k (`rotate_rows`), then `decode_attention`. Returns [B, Hq, D]. One
// call in place of the rotation's and the heads' dozen torch ops per layer.
at::Tensor decode_attention_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& tables,
                                const at::Tensor& positions, double scale, int64_t span_tokens, int64_t heads) {
  check(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be [B, (Hq + 2 Hkv) D], its rows contiguous");
  check(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2,
        "cos and sin must be contiguous [B, D / 2]");
  check(qkv.scalar_type() == cos.scalar_type() && sin.scalar_type() == cos.scalar_type(),
        "qkv, cos and sin must share one dtype");
  const int64_t batch = qkv.size(0), kv_heads = v_cache.size(1), head_dim = v_cache.size(3);
  check(heads > 0 && qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "qkv's width is not (Hq + 2 Hkv) D");
  check(cos.size(0) == batch && cos.size(1) * 2 == head_dim, "cos and sin must be [B, D / 2]");
  at::Tensor q = at::empty({batch, heads, head_dim}, qkv.options());
  at::Tensor k = at::empty({batch, kv_heads, head_dim}, qkv.options());
  at::Tensor v = at::empty({batch, kv_heads, head_dim}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rotate_rows<float>(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), batch,
                       heads, kv_heads, head_dim, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>());
  } else if (qkv.scalar_type() == at::kBFloat16) {
    rotate_rows<c10::BFloat16>(qkv.data_ptr<c10::BFloat16>(), qkv.stride(0), cos.data_ptr<c10::BFloat16>(),
                               sin.data_ptr<c10::BFloat16>(), batch, heads, kv_heads, head_dim,
                               q.data_ptr<c10::BFloat16>(), k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "decode_attention_qkv: float32 or bfloat16 only");
  }
  return decode_attention(q, k, v, k_cache, v_cache, tables, positions, scale, span_tokens);
}

TORCH_LIBRARY(moonbus, m) {
  m.def("decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor tables, Tensor positions, float scale, int span_tokens) -> Tensor");
  m.def("decode_attention_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor tables, Tensor positions, float scale, int span_tokens, int heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(moonbus, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_qkv", &decode_attention_qkv);
}
