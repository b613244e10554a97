// RMSNorm as transformers' LlamaRMSNorm computes it, in one pass per row (torch's CPU rms_norm
// is a chain of a dozen ops, about 40 us a call at a decode step's few rows: 2 ms of a SmolLM2
// step's 22 ms went there).
//
//     x        [..., d]  float32 or bfloat16, d contiguous (rows may be strided)
//     weight   [d]       x's dtype
//     out      [..., d]  contiguous: in float32, x * rsqrt(mean(x^2) + eps); rounded to x's dtype;
//                        times the weight (in bfloat16 the product rounded once, as torch's
//                        bfloat16 multiply does; in float32 x * rstd * weight, torch's order)
//
// The sum of squares runs in float32 in this loop's own order, so a value can differ from
// torch's by a last-bit step of the float32 mean, which moves a rounded output now and then;
// the decode engine runs it (tests compare its tokens with transformers' up to a near-tie).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/reshape.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename scalar_t>
void norm_rows(const scalar_t* x, int64_t row_stride, const scalar_t* w, scalar_t* out, int64_t rows, int64_t d,
               float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * row_stride;
      scalar_t* o = out + r * d;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < d; ++i) {
        const float v = as_float(xr[i]);
        squares += v * v;
      }
      const float rstd = 1.f / std::sqrt(squares / static_cast<float>(d) + eps);
      for (int64_t i = 0; i < d; ++i) {
        const scalar_t normed = static_cast<scalar_t>(as_float(xr[i]) * rstd);
        o[i] = static_cast<scalar_t>(as_float(w[i]) * as_float(normed));
      }
    }
  });
}

void check(bool ok, const char* what) { TORCH_CHECK(ok, "rms_norm: ", what); }

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "x must be [..., d], weight [d]");
  check(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  check(x.stride(-1) == 1 && weight.is_contiguous(), "x's last dimension and the weight must be contiguous");
  const int64_t d = x.size(-1);
  // x's rows as one strided [rows, d] view (reshape copies only where they cannot be one)
  const at::Tensor flat = x.dim() == 2 ? x : x.reshape({-1, d});
  const int64_t rows = flat.size(0), row_stride = flat.stride(0);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(flat.data_ptr<float>(), row_stride, weight.data_ptr<float>(), out.data_ptr<float>(), rows, d,
                     static_cast<float>(eps));
  } else if (x.scalar_type() == at::kBFloat16) {
    norm_rows<c10::BFloat16>(flat.data_ptr<c10::BFloat16>(), row_stride, weight.data_ptr<c10::BFloat16>(),
                             out.data_ptr<c10::BFloat16>(), rows, d, static_cast<float>(eps));
  } else {
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(moonbus, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(moonbus, CPU, m) { m.impl("rms_norm", &rms_norm); }
