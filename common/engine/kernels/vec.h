// Vectors of float32 for the engine's kernels: AVX-512 (16 lanes), AVX2 with FMA (8 lanes) or one
// lane, by what the build's -march has; and exp(x) for x <= 0, written so that a loop over it
// vectorises. Shared by paged_attention.cpp and prefill_attention.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace moonbus_vec {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// ---- AVX-512 (16 lanes), AVX2 (8 lanes) or one lane
#if defined(__AVX512F__)
constexpr int kLanes = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2(vf n) {  // 2^n for whole n in [-126, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const c10::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float vhmax(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2(vf n) {  // 2^n for whole n in [-126, 127]
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int kLanes = 1;
using vf = float;
inline vf vzero() { return 0.f; }
inline vf vset(float x) { return x; }
inline vf vload(const float* p) { return *p; }
inline vf vload(const c10::BFloat16* p) { return to_float(*p); }
inline void vstore(float* p, vf x) { *p = x; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmax(vf a, vf b) { return a < b ? b : a; }
inline float vsum(vf x) { return x; }
inline float vhmax(vf x) { return x; }
inline vf vround(vf x) { return std::nearbyint(x); }
inline vf vpow2(vf n) {  // 2^n for whole n in [-126, 127]
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
#endif

// A loaded vector kept in a register: a compiler otherwise reloads it from memory for each FMA
// that reads it (a memory operand per FMA), and a loop that reads one vector in several FMAs
// runs at the loads' rate, not the FMAs'.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline vf vkeep(vf x) {
  asm("" : "+x"(x));
  return x;
}
#else
inline vf vkeep(vf x) { return x; }
#endif

// exp(x) for x <= 0 (a score minus the running max), float32-accurate to a few ulp: 2^n * p(r)
// with x = n ln2 + r, |r| <= ln2 / 2, p Cephes' degree-6 polynomial of expf (kExp*: the scalar
// and the vector form compute the same one).
constexpr float kExpLog2e = 1.44269504088896341f, kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                            1.6666665459e-1f, 5.0000001201e-1f};

// Scalar, written so that a loop over it vectorises where the compiler can.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::nearbyint(x * kExpLog2e);
  const float r = (x - n * kExpLn2Hi) - n * kExpLn2Lo;
  float p = kExpP[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpP[i];
  p = p * r * r + r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// kLanes at a time
inline vf vexp_nonpositive(vf x) {
  x = vmax(x, vset(-87.f));
  const vf n = vround(vmul(x, vset(kExpLog2e)));
  const vf r = vfma(n, vset(-kExpLn2Lo), vfma(n, vset(-kExpLn2Hi), x));
  vf p = vset(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = vfma(p, r, vset(kExpP[i]));
  return vmul(vfma(vmul(p, r), r, vadd(r, vset(1.f))), vpow2(n));
}

// The largest of x[0, n) (-inf when n is 0): whole vectors, then the rest one at a time.
inline float max_of(const float* x, int64_t n) {
  const int64_t full = n / kLanes * kLanes;
  vf m = vset(-INFINITY);
  for (int64_t i = 0; i < full; i += kLanes) m = vmax(m, vload(x + i));
  float out = vhmax(m);
  for (int64_t i = full; i < n; ++i) out = std::max(out, x[i]);
  return out;
}

// x[i] = exp(x[i] - m) for i < n, each x[i] <= m (a softmax's weights before their sum divides
// them); returns their sum.
inline float exp_in_place(float* x, int64_t n, float m) {
  const int64_t full = n / kLanes * kLanes;
  const vf vm = vset(m);
  vf vtotal = vzero();
  for (int64_t i = 0; i < full; i += kLanes) {
    const vf p = vexp_nonpositive(vsub(vload(x + i), vm));
    vtotal = vadd(vtotal, p);
    vstore(x + i, p);
  }
  float total = vsum(vtotal);
  for (int64_t i = full; i < n; ++i) {
    const float p = exp_nonpositive(x[i] - m);
    total += p;
    x[i] = p;
  }
  return total;
}

}  // namespace moonbus_vec
