// Prefill attention: the causal attention of a prompt's chunk of queries over its prefix and
// itself, one call per layer, in float32 (on the CPU's float32 vectors: AVX-512, or AVX2 with FMA)
// or bfloat16 (on CPUs with AVX-512 BF16 only).
//
//     q      [n, Hq, D]    the chunk's queries (any row and head strides, D contiguous): positions
//                          start .. start + n - 1
//     k, v   [Hkv, T, D]   every key and value the chunk sees (T = start + n; any head and token
//                          strides, D contiguous): the prefix's, then the chunk's own
//     out    [n, Hq, D]    contiguous, so the output projection reads it without a copy
//
// Query i (position start + i) attends over keys [0, start + i]. It is a flash-attention loop:
// an item is one query head and a block of kQueryBlock of its queries; it walks the keys it may
// see kKeyBlock at a time, keeping a running max, sum and output per query (log-sum-exp
// rescaling). K is first rearranged per kv head so that a vector holds one dimension of several
// keys (scores come out a vector of keys at a time, no horizontal sums), each query head of a
// group reading the same copy:
//   float32   K as [T / kLanes][D][kLanes keys]; V is read where it is (a row of D per key).
//   bfloat16  the products run on the CPU's bfloat16 dot-product instruction (vdpbf16ps: 16
//             float32 sums of two bfloat16 products each), so K and V are rearranged in pairs
//             ("VNNI" order): K as [T / 16][D / 2][16 keys][2 dims], V as [T / 2][D][2 keys].
//
// Numerics, as torch's CPU flash attention computes them (scaled_dot_product_attention, what the
// engine ran before and what transformers runs): scores q.k summed in float32, then scaled;
// exp(score - running max) in float32, summed in float32; in bfloat16 the weights rounded to
// bfloat16 before they multiply V, products summed in float32, the output rounded once to
// bfloat16. The order of the float32 sums differs from torch's, so outputs agree with it to
// rounding, not bit for bit (tests/unit/test_prefill_attention.py states the tolerance).
//
// Threads: at::parallel_for over the items, ordered so that each thread's share mixes early
// (short) and late (long) query blocks of the causal triangle.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

struct Shape {
  int64_t n, start, total, heads, kv_heads, group, dim;
  int64_t q_row, q_head;    // q's strides (elements)
  int64_t k_head, k_token;  // k's
  int64_t v_head, v_token;  // v's
  int64_t key_tiles;        // the packed K's tiles per kv head (of 16 keys in bfloat16, kLanes in float32), whole key blocks
  int64_t key_pairs;        // bfloat16: ceil(total / kKeyBlock) * kKeyBlock / 2, the packed V's pairs per kv head
};

void check(bool ok, const char* what) { TORCH_CHECK(ok, "prefill_attention: ", what); }

// Runs item(first, last, head) for every query block [first, last) of `query_block` queries and
// every head, the blocks in the order 0, last, 1, last - 1, ...: a thread's contiguous share of
// them holds short and long rows of the causal triangle alike.
template <typename F>
void for_each_item(const Shape& s, int64_t query_block, const F& item) {
  const int64_t blocks = (s.n + query_block - 1) / query_block;
  std::vector<int64_t> order(blocks);
  for (int64_t i = 0, lo = 0, hi = blocks - 1; i < blocks; ++i) order[i] = i % 2 == 0 ? lo++ : hi--;
  at::parallel_for(0, blocks * s.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t block = order[i / s.heads], head = i % s.heads;
      item(block * query_block, std::min(s.n, (block + 1) * query_block), head);
    }
  });
}

// ---- float32, on the CPU's float32 vectors (vec.h: AVX-512, AVX2 with FMA, or one lane)
namespace f32 {

using namespace moonbus_vec;

constexpr int64_t kQueryBlock = 32;  // queries of one head per item
constexpr int64_t kKeyBlock = 64;    // keys per step of the online softmax (a multiple of 2 * kLanes)
constexpr int64_t kMaxHeadDim = 256;

// K of every kv head as [tiles][D][kLanes keys], zeros past the last key: a dimension of kLanes
// keys is one vector, so a query's scores come out kLanes keys at a time, with no horizontal sums
void pack_keys(const float* k, const Shape& s, float* out) {
  const int64_t per_tile = s.dim * kLanes;
  at::parallel_for(0, s.kv_heads * s.key_tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / s.key_tiles, tile = item % s.key_tiles;
      float* o = out + item * per_tile;
      for (int64_t j = 0; j < kLanes; ++j) {
        const int64_t t = tile * kLanes + j;
        const float* row = t < s.total ? k + h * s.k_head + t * s.k_token : nullptr;
        for (int64_t d = 0; d < s.dim; ++d) o[d * kLanes + j] = row ? row[d] : 0.f;
      }
    }
  });
}

// acc[ri[i]] += weights[ri[i]] . V over keys [0, count) of the block, for vectors c0 .. c0 + kVecs
// of kLanes dims (a repeated row computes its sums twice into the same place: the same values)
template <int kVecs>
inline void weigh_values(const float (*weights)[kKeyBlock], float (*acc)[kMaxHeadDim], const float* v,
                         int64_t v_token, int64_t count, const int64_t* ri, int64_t c0) {
  vf sum[4][kVecs];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < kVecs; ++c) sum[i][c] = vload(acc[ri[i]] + (c0 + c) * kLanes);
  for (int64_t t = 0; t < count; ++t) {
    vf x[kVecs];
    for (int c = 0; c < kVecs; ++c) x[c] = vkeep(vload(v + t * v_token + (c0 + c) * kLanes));
    for (int i = 0; i < 4; ++i) {
      const vf w = vset(weights[ri[i]][t]);
      for (int c = 0; c < kVecs; ++c) sum[i][c] = vfma(w, x[c], sum[i][c]);
    }
  }
  for (int i = 3; i >= 0; --i)  // a repeated row's (the last) stores come first and are overwritten alike
    for (int c = 0; c < kVecs; ++c) vstore(acc[ri[i]] + (c0 + c) * kLanes, sum[i][c]);
}

// One item: query head `head`, queries [first, last) of the chunk.
void attend_block(const float* q, const float* keys, const float* v, const Shape& s, float scale, int64_t head,
                  int64_t first, int64_t last, float* out) {
  const int64_t rows = last - first, kv = head / s.group, vecs = s.dim / kLanes;
  const int64_t tile_size = s.dim * kLanes, tiles = kKeyBlock / kLanes;
  const float* kp = keys + kv * s.key_tiles * tile_size;
  const float* vh = v + kv * s.v_head;
  alignas(64) float weights[kQueryBlock][kKeyBlock];  // a block's scores, then its weights
  alignas(64) float acc[kQueryBlock][kMaxHeadDim];
  float maxes[kQueryBlock], sums[kQueryBlock];
  const float* qrow[kQueryBlock];
  for (int64_t r = 0; r < rows; ++r) {
    maxes[r] = -std::numeric_limits<float>::infinity();
    sums[r] = 0.f;
    std::fill(acc[r], acc[r] + s.dim, 0.f);
    qrow[r] = q + (first + r) * s.q_row + head * s.q_head;
  }
  const int64_t seen_end = s.start + last;  // keys [0, seen_end) are seen by some query of the block
  const vf vscale = vset(scale);
  for (int64_t kb = 0; kb < seen_end; kb += kKeyBlock) {
    // scores: 4 queries x 2 tiles of kLanes keys per pass, each K vector loaded once for the 4
    // queries (8 independent sums in registers); a last pass of fewer queries repeats its last one
    const float* kt = kp + (kb / kLanes) * tile_size;
    const int64_t live_tiles = std::min<int64_t>(tiles, (seen_end - kb + kLanes - 1) / kLanes);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const float* qi[4];
      for (int i = 0; i < 4; ++i) qi[i] = qrow[std::min<int64_t>(r0 + i, rows - 1)];
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      for (int64_t j0 = 0; j0 < live_tiles; j0 += 2) {
        const float* k0 = kt + j0 * tile_size;
        const float* k1 = k0 + tile_size;  // (a block has an even number of tiles: kKeyBlock / kLanes)
        vf dots[4][2];
        for (int i = 0; i < 4; ++i) dots[i][0] = dots[i][1] = vzero();
        for (int64_t d = 0; d < s.dim; ++d) {
          const vf a = vkeep(vload(k0 + d * kLanes)), b = vkeep(vload(k1 + d * kLanes));
          for (int i = 0; i < 4; ++i) {
            const vf qd = vset(qi[i][d]);
            dots[i][0] = vfma(qd, a, dots[i][0]);
            dots[i][1] = vfma(qd, b, dots[i][1]);
          }
        }
        for (int64_t i = 0; i < nr; ++i) {
          vstore(&weights[r0 + i][j0 * kLanes], vmul(dots[i][0], vscale));
          vstore(&weights[r0 + i][(j0 + 1) * kLanes], vmul(dots[i][1], vscale));
        }
      }
    }
    // the online softmax: per query, keys [kb, its own position] of this block are seen
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::min<int64_t>(kKeyBlock, s.start + first + r + 1 - kb);
      float* w = weights[r];
      if (seen <= 0) {
        std::fill(w, w + kKeyBlock, 0.f);
        continue;
      }
      const float new_max = std::max(maxes[r], max_of(w, seen));
      const float rescale = maxes[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(maxes[r] - new_max);
      const float total = exp_in_place(w, seen, new_max);
      std::fill(w + seen, w + kKeyBlock, 0.f);
      sums[r] = sums[r] * rescale + total;
      maxes[r] = new_max;
      if (rescale != 1.f)
        for (int64_t d = 0; d < s.dim; ++d) acc[r][d] *= rescale;
    }
    // acc += weights . V over the block's keys that some query sees (each < total: no padding
    // read), 4 queries x 2 vectors of kLanes dims per pass, each V vector loaded once for the 4
    const int64_t count = std::min(kKeyBlock, seen_end - kb);
    const float* vb = vh + kb * s.v_token;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      int64_t ri[4];
      for (int i = 0; i < 4; ++i) ri[i] = std::min<int64_t>(r0 + i, rows - 1);
      int64_t c0 = 0;
      for (; c0 + 2 <= vecs; c0 += 2) weigh_values<2>(weights, acc, vb, s.v_token, count, ri, c0);
      if (c0 < vecs) weigh_values<1>(weights, acc, vb, s.v_token, count, ri, c0);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / sums[r];
    float* o = out + ((first + r) * s.heads + head) * s.dim;
    for (int64_t d = 0; d < s.dim; ++d) o[d] = acc[r][d] * inv;
  }
}

at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Shape s, float scale) {
  check(s.dim % kLanes == 0 && s.dim <= kMaxHeadDim, "float32: head_dim must be a multiple of the CPU's vector width, <= 256");
  s.key_tiles = (s.total + kKeyBlock - 1) / kKeyBlock * (kKeyBlock / kLanes);
  at::Tensor out = at::empty({s.n, s.heads, s.dim}, q.options());
  if (s.n == 0) return out;
  std::vector<float> keys(s.kv_heads * s.key_tiles * kLanes * s.dim);
  pack_keys(k.data_ptr<float>(), s, keys.data());
  const float* qp = q.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_item(s, kQueryBlock, [&](int64_t first, int64_t last, int64_t head) {
    attend_block(qp, keys.data(), vp, s, scale, head, first, last, op);
  });
  return out;
}

}  // namespace f32

// ---- bfloat16, on the CPU's bfloat16 dot products (AVX-512 BF16 only)
#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace bf16 {

constexpr int64_t kQueryBlock = 32;  // queries of one head per item
constexpr int64_t kKeyBlock = 64;    // keys per step of the online softmax
constexpr int64_t kMaxHeadDim = 256;

// a bfloat16 tensor's elements as their 16 bits
using bits16 = uint16_t;

inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

inline __m512i pair_of(const bits16* p) {  // two adjacent bfloat16 values, broadcast to every lane
  int32_t both;
  std::memcpy(&both, p, sizeof(both));
  return _mm512_set1_epi32(both);
}

using moonbus_vec::vexp_nonpositive;  // (vec.h: vf is __m512 where AVX-512 is)

// float32 -> bfloat16 bits, to nearest (ties to even), 16 at a time
inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }


// K of every kv head as [tiles][D / 2][16][2], zeros past the last key
void pack_keys(const bits16* k, const Shape& s, bits16* out) {
  const int64_t per_tile = s.dim * 16;
  at::parallel_for(0, s.kv_heads * s.key_tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / s.key_tiles, tile = item % s.key_tiles;
      bits16* o = out + item * per_tile;
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t t = tile * 16 + j;
        if (t < s.total) {
          const bits16* row = k + h * s.k_head + t * s.k_token;
          for (int64_t p = 0; p < s.dim / 2; ++p) {
            o[(p * 16 + j) * 2] = row[2 * p];
            o[(p * 16 + j) * 2 + 1] = row[2 * p + 1];
          }
        } else {
          for (int64_t p = 0; p < s.dim / 2; ++p) o[(p * 16 + j) * 2] = o[(p * 16 + j) * 2 + 1] = 0;
        }
      }
    }
  });
}

// V of every kv head as [pairs][D][2], zeros past the last value
void pack_values(const bits16* v, const Shape& s, bits16* out) {
  const int64_t chunk = 32;  // pairs per work item
  const int64_t chunks = (s.key_pairs + chunk - 1) / chunk;
  at::parallel_for(0, s.kv_heads * chunks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / chunks, first = (item % chunks) * chunk;
      for (int64_t pair = first; pair < std::min(first + chunk, s.key_pairs); ++pair) {
        bits16* o = out + (h * s.key_pairs + pair) * s.dim * 2;
        for (int e = 0; e < 2; ++e) {
          const int64_t t = 2 * pair + e;
          if (t < s.total) {
            const bits16* row = v + h * s.v_head + t * s.v_token;
            for (int64_t d = 0; d < s.dim; ++d) o[2 * d + e] = row[d];
          } else {
            for (int64_t d = 0; d < s.dim; ++d) o[2 * d + e] = 0;
          }
        }
      }
    }
  });
}

// acc[r] += weights[r] . V over one block's keys, for rows ri (a repeated row computes its sums
// twice into the same place: the same values) and vectors c0 .. c0 + kVecs of 16 dims
template <int kVecs>
inline void weigh_values(const bits16 (*weights)[kKeyBlock], float (*acc)[kMaxHeadDim], const bits16* vb,
                         const int64_t* ri, int64_t c0, int64_t dim) {
  __m512 sum[4][kVecs];
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < kVecs; ++c) sum[i][c] = _mm512_load_ps(acc[ri[i]] + (c0 + c) * 16);
  for (int64_t p = 0; p < kKeyBlock / 2; ++p) {
    __m512i vvec[kVecs];
    for (int c = 0; c < kVecs; ++c) vvec[c] = _mm512_loadu_si512(vb + (p * dim + (c0 + c) * 16) * 2);
    for (int i = 0; i < 4; ++i) {
      const __m512bh wi = as_bh(pair_of(weights[ri[i]] + 2 * p));
      for (int c = 0; c < kVecs; ++c) sum[i][c] = _mm512_dpbf16_ps(sum[i][c], as_bh(vvec[c]), wi);
    }
  }
  for (int i = 3; i >= 0; --i)  // a repeated row's (the last) stores come first and are overwritten alike
    for (int c = 0; c < kVecs; ++c) _mm512_store_ps(acc[ri[i]] + (c0 + c) * 16, sum[i][c]);
}

// One item: query head `head`, queries [first, last) of the chunk.
void attend_block(const bits16* q, const bits16* keys, const bits16* values, const Shape& s, float scale,
                  int64_t head, int64_t first, int64_t last, bits16* out) {
  const int64_t rows = last - first, kv = head / s.group, pairs = s.dim / 2, vecs = s.dim / 16;
  const bits16* kp = keys + kv * s.key_tiles * s.dim * 16;
  const bits16* vp = values + kv * s.key_pairs * s.dim * 2;
  alignas(64) float scores[kQueryBlock][kKeyBlock];
  alignas(64) bits16 weights[kQueryBlock][kKeyBlock];
  alignas(64) float acc[kQueryBlock][kMaxHeadDim];
  float maxes[kQueryBlock], sums[kQueryBlock];
  for (int64_t r = 0; r < rows; ++r) {
    maxes[r] = -std::numeric_limits<float>::infinity();
    sums[r] = 0.f;
    std::fill(acc[r], acc[r] + s.dim, 0.f);
  }
  const bits16* qrow[kQueryBlock];
  for (int64_t r = 0; r < rows; ++r) qrow[r] = q + (first + r) * s.q_row + head * s.q_head;
  const int64_t seen_end = s.start + last;  // keys [0, seen_end) are seen by some query of the block
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t kb = 0; kb < seen_end; kb += kKeyBlock) {
    const int64_t tiles = kKeyBlock / 16;
    // scores: 4 queries x 4 tiles of 16 keys per pass (a block's every tile: the packed K is padded
    // to whole blocks), each K pair loaded once for the 4 queries; a last pass of fewer queries
    // repeats its last one. Fixed trip counts keep the 16 sums in registers.
    const bits16* kt = kp + (kb / 16) * s.dim * 16;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const bits16* qi[4];
      for (int i = 0; i < 4; ++i) qi[i] = qrow[std::min<int64_t>(r0 + i, rows - 1)];
      __m512 dots[4][4];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) dots[i][j] = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; ++p) {
        __m512i kvec[4];
        for (int j = 0; j < 4; ++j) kvec[j] = _mm512_loadu_si512(kt + (j * pairs + p) * 32);
        for (int i = 0; i < 4; ++i) {
          const __m512bh qv = as_bh(pair_of(qi[i] + 2 * p));
          for (int j = 0; j < 4; ++j) dots[i][j] = _mm512_dpbf16_ps(dots[i][j], as_bh(kvec[j]), qv);
        }
      }
      const int64_t nr = std::min<int64_t>(4, rows - r0);
      for (int64_t i = 0; i < nr; ++i)
        for (int j = 0; j < 4; ++j) _mm512_store_ps(&scores[r0 + i][j * 16], _mm512_mul_ps(dots[i][j], vscale));
    }
    // the online softmax: per query, keys [kb, its own position] of this block are seen
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::min<int64_t>(tiles * 16, s.start + first + r + 1 - kb);  // >= 0: key 0 .. its position
      float* sc = scores[r];
      bits16* w = weights[r];
      if (seen <= 0) {
        std::fill(w, w + tiles * 16, 0);
        continue;
      }
      __m512 m = minus_inf;
      for (int64_t j = 0; j < tiles; ++j) {
        const __mmask16 live = j * 16 >= seen ? 0 : (seen - j * 16 >= 16 ? 0xFFFF : (1u << (seen - j * 16)) - 1);
        m = _mm512_mask_max_ps(m, live, m, _mm512_load_ps(sc + j * 16));
      }
      const float block_max = _mm512_reduce_max_ps(m);
      const float new_max = std::max(maxes[r], block_max);
      const float rescale = maxes[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(maxes[r] - new_max);
      const __m512 vmax = _mm512_set1_ps(new_max);
      __m512 total = _mm512_setzero_ps();
      for (int64_t j = 0; j < tiles; ++j) {
        const __mmask16 live = j * 16 >= seen ? 0 : (seen - j * 16 >= 16 ? 0xFFFF : (1u << (seen - j * 16)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, vexp_nonpositive(_mm512_sub_ps(_mm512_load_ps(sc + j * 16), vmax)));
        total = _mm512_add_ps(total, e);
        _mm256_store_si256(reinterpret_cast<__m256i*>(w + j * 16), to_bf16(e));
      }
      sums[r] = sums[r] * rescale + _mm512_reduce_add_ps(total);
      maxes[r] = new_max;
      if (rescale != 1.f) {
        const __m512 vr = _mm512_set1_ps(rescale);
        for (int64_t c = 0; c < vecs; ++c) _mm512_store_ps(acc[r] + c * 16, _mm512_mul_ps(_mm512_load_ps(acc[r] + c * 16), vr));
      }
    }
    // acc += weights . V: 4 queries x 4 vectors of 16 dims per pass, each V pair of 16 dims
    // loaded once for the 4 queries (a last pass of fewer queries repeats its last one)
    const bits16* vb = vp + (kb / 2) * s.dim * 2;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      int64_t ri[4];
      for (int i = 0; i < 4; ++i) ri[i] = std::min<int64_t>(r0 + i, rows - 1);
      for (int64_t c0 = 0; c0 < vecs;) {  // 4 vectors of 16 dims at a time, then 2, then 1
        if (vecs - c0 >= 4) {
          weigh_values<4>(weights, acc, vb, ri, c0, s.dim);
          c0 += 4;
        } else if (vecs - c0 >= 2) {
          weigh_values<2>(weights, acc, vb, ri, c0, s.dim);
          c0 += 2;
        } else {
          weigh_values<1>(weights, acc, vb, ri, c0, s.dim);
          c0 += 1;
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
    bits16* o = out + ((first + r) * s.heads + head) * s.dim;
    for (int64_t c = 0; c < vecs; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 16), to_bf16(_mm512_mul_ps(_mm512_load_ps(acc[r] + c * 16), inv)));
  }
}

at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, Shape s, float scale) {
  check(s.dim % 16 == 0 && s.dim <= kMaxHeadDim, "head_dim must be a multiple of 16, <= 256");
  s.key_tiles = (s.total + kKeyBlock - 1) / kKeyBlock * (kKeyBlock / 16);
  s.key_pairs = (s.total + kKeyBlock - 1) / kKeyBlock * kKeyBlock / 2;
  at::Tensor out = at::empty({s.n, s.heads, s.dim}, q.options());
  if (s.n == 0) return out;
  const auto* qp = reinterpret_cast<const bits16*>(q.data_ptr<c10::BFloat16>());
  std::vector<bits16> keys(s.kv_heads * s.key_tiles * 16 * s.dim), values(s.kv_heads * s.key_pairs * 2 * s.dim);
  pack_keys(reinterpret_cast<const bits16*>(k.data_ptr<c10::BFloat16>()), s, keys.data());
  pack_values(reinterpret_cast<const bits16*>(v.data_ptr<c10::BFloat16>()), s, values.data());
  auto* op = reinterpret_cast<bits16*>(out.data_ptr<c10::BFloat16>());
  for_each_item(s, kQueryBlock, [&](int64_t first, int64_t last, int64_t head) {
    attend_block(qp, keys.data(), values.data(), s, scale, head, first, last, op);
  });
  return out;
}

}  // namespace bf16
#endif  // AVX-512 BF16

}  // namespace

// q [n, Hq, D], k, v [Hkv, start + n, D], float32 (any x86 CPU the build targets) or bfloat16 (a
// CPU with AVX-512 BF16), D contiguous in each; returns [n, Hq, D].
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t start,
                             double scale) {
  check(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q must be [n, Hq, D], k and v [Hkv, T, D]");
  const auto dtype = q.scalar_type();
  check(k.scalar_type() == dtype && v.scalar_type() == dtype, "q, k and v must have one dtype");
  check(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "D must be contiguous in q, k and v");
  Shape s{};
  s.n = q.size(0);
  s.heads = q.size(1);
  s.dim = q.size(2);
  s.kv_heads = k.size(0);
  s.total = k.size(1);
  s.start = start;
  check(v.sizes() == k.sizes() && k.size(2) == s.dim, "k and v must be [Hkv, T, D] with q's D");
  check(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "query heads must be a multiple of kv heads");
  check(start >= 0 && s.total == start + s.n, "k and v must hold start + n tokens");
  s.group = s.heads / s.kv_heads;
  s.q_row = q.stride(0);
  s.q_head = q.stride(1);
  s.k_head = k.stride(0);
  s.k_token = k.stride(1);
  s.v_head = v.stride(0);
  s.v_token = v.stride(1);
  if (dtype == at::kFloat) return f32::run(q, k, v, s, static_cast<float>(scale));
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (dtype == at::kBFloat16) return bf16::run(q, k, v, s, static_cast<float>(scale));
  check(false, "float32 or bfloat16 only");
#else
  check(false, "float32 only on this CPU (bfloat16 needs AVX-512 BF16)");
#endif
  return at::Tensor();
}

TORCH_LIBRARY_FRAGMENT(moonbus, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, int start, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(moonbus, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
