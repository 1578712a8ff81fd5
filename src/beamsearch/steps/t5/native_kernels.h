// The native T5 step's kernels (included by native.cpp, one translation unit): 16-lane vector math (exp, dot,
// axpy, blocked softmax), RMS norm, ReLU, and the products: float32 through ATen (MKL or oneDNN), int8 with each
// input quantized once per row (symmetric, 127 levels) and one at::_int_mm.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t BLK = 16;        // scores per vector (one AVX-512 register, two AVX2 ones)
constexpr float MASKED = -1e30f;   // a masked score: finite, so that a fully masked row stays a number

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // aligned(4): loads may be unaligned
typedef int32_t i16 __attribute__((vector_size(64), aligned(4)));
typedef int8_t c16 __attribute__((vector_size(16), aligned(1)));  // 16 int8 lanes (a quantized block)
inline v16 load16(const float* p) { return *(const v16*)p; }
inline void store16(float* p, v16 v) { *(v16*)p = v; }
inline v16 splat(float x) { return v16{} + x; }
// the sum of 16 lanes, as a tree (4 dependent adds, not 15)
inline float hsum(v16 v) {
  float a[8];
  for (int i = 0; i < 8; ++i) a[i] = v[i] + v[i + 8];
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// e^x for x <= 0 on 16 lanes: 2^(x log2 e) as 2^floor * p(frac), p a degree-6 fit of 2^f on [0, 1) (relative error
// about 1e-7); below about -87 it gives 2^-125 (a masked score's weight, about 1e-38)
inline v16 vexp(v16 x) {
  v16 t = x * 1.44269504f;
  t = t < -125.f ? splat(-125.f) : t;
  v16 fi = __builtin_convertvector(__builtin_convertvector(t, i16), v16);
  fi = fi > t ? fi - 1.f : fi;  // floor for negative t
  v16 f = t - fi;
  v16 p = splat(2.1877505e-4f);
  p = p * f + 1.2387822e-3f; p = p * f + 9.6845804e-3f; p = p * f + 5.5480428e-2f;
  p = p * f + 2.4023050e-1f; p = p * f + 6.9314694e-1f; p = p * f + 1.0f;
  i16 bits = (__builtin_convertvector(fi, i16) + 127) << 23;
  return p * (v16)bits;
}

// sum a[i] * b[i], i < n
inline float dot(const float* a, const float* b, int64_t n) {
  v16 acc = {};
  int64_t i = 0;
  for (; i + BLK <= n; i += BLK) acc += load16(a + i) * load16(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[i] += w * x[i], i < n
inline void axpy(float w, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + BLK <= n; i += BLK) store16(y + i, load16(y + i) + w * load16(x + i));
  for (; i < n; ++i) y[i] += w * x[i];
}

// w[0..m) <- softmax(w[0..m)), m a multiple of BLK (the tail holds MASKED scores)
inline void softmax_blocks(float* w, int64_t m) {
  v16 top16 = splat(MASKED);
  for (int64_t j = 0; j < m; j += BLK) { v16 x = load16(w + j); top16 = x > top16 ? x : top16; }
  float top = MASKED;
  for (int i = 0; i < 16; ++i) top = std::max(top, top16[i]);
  v16 sum = {};
  for (int64_t j = 0; j < m; j += BLK) { v16 e = vexp(load16(w + j) - top); store16(w + j, e); sum += e; }
  const float inverse = 1.f / hsum(sum);
  for (int64_t j = 0; j < m; j += BLK) store16(w + j, load16(w + j) * inverse);
}

inline int64_t round_up(int64_t n) { return (n + BLK - 1) / BLK * BLK; }

// T5's RMS norm of rows [n, D] (no mean subtracted), times gain where given (else folded into the next product)
void rms(const at::Tensor& in, at::Tensor& out, double eps, const float* gain = nullptr) {
  const int64_t n = in.size(0), D = in.size(1);
  const float* a = in.data_ptr<float>();
  float* b = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const float* x = a + r * D;
    float* y = b + r * D;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < D; ++i) s += x[i] * x[i];
    const float k = 1.f / std::sqrt(s / D + (float)eps);
    if (gain) for (int64_t i = 0; i < D; ++i) y[i] = x[i] * k * gain[i];
    else for (int64_t i = 0; i < D; ++i) y[i] = x[i] * k;
  }
}

void relu_in_place(at::Tensor& x) {
  float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] > 0.f ? p[i] : 0.f;
}

// A product's weight [in, out]: float, or int8 with a float scale per output column (weight = q[k, n] * scale[n]).
struct Product {
  at::Tensor w, scale;  // scale undefined: a float weight
};

// [out, in] weights -> products [in, out]; scales: one per weight, [out] for an int8 weight, empty for a float32 one
std::vector<Product> transposed(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales) {
  TORCH_CHECK(scales.size() == weights.size(), "one scale per weight");
  std::vector<Product> out;
  for (size_t i = 0; i < weights.size(); ++i) {
    Product p{weights[i].t().contiguous(), at::Tensor()};
    if (scales[i].numel() > 0) {  // an empty scale: that weight is float32
      TORCH_CHECK(p.w.scalar_type() == at::kChar && scales[i].numel() == p.w.size(1), "an int8 weight and its scales");
      p.scale = scales[i].to(at::kFloat).contiguous();
    }
    out.push_back(std::move(p));
  }
  return out;
}

// every n-th product of a list, from the first
std::vector<Product> every(const std::vector<Product>& all, size_t n, size_t first) {
  std::vector<Product> out;
  for (size_t i = first; i < all.size(); i += n) out.push_back(all[i]);
  return out;
}

// out = in @ p, or out += in @ p (accumulate): in [M, K] contiguous float, out [M, N] contiguous float
void product(at::Tensor& out, const at::Tensor& in, const Product& p, bool accumulate) {
  if (!p.scale.defined()) {
    if (accumulate) out.addmm_(in, p.w); else at::mm_out(out, in, p.w);
    return;
  }
  const int64_t M = in.size(0), K = in.size(1), N = p.w.size(1);
  at::Tensor q = at::empty({M, K}, at::TensorOptions().dtype(at::kChar));
  std::vector<float> row_scale(M);
  const float* x = in.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  const int64_t K16 = K / BLK * BLK;
  const float ROUND = 12582912.f;  // 1.5 * 2^23: (v + ROUND) - ROUND rounds |v| < 2^22 to the nearest even integer
  for (int64_t r = 0; r < M; ++r) {  // the input quantized once per product, per row and symmetric
    const float* xr = x + r * K;
    int8_t* qr = qp + r * K;
    v16 top = {};
    for (int64_t k = 0; k < K16; k += BLK) {
      v16 v = load16(xr + k);
      v = v < 0 ? -v : v;
      top = v > top ? v : top;
    }
    float most = 0.f;
    for (int i = 0; i < 16; ++i) most = std::max(most, top[i]);
    for (int64_t k = K16; k < K; ++k) most = std::max(most, std::fabs(xr[k]));
    const float scale = most > 0.f ? most / 127.f : 1.f, inverse = 1.f / scale;
    const v16 vi = splat(inverse), vr = splat(ROUND);
    for (int64_t k = 0; k < K16; k += BLK) {
      const v16 rounded = (load16(xr + k) * vi + vr) - vr;  // in [-127, 127]: |x| <= most
      *(c16*)(qr + k) = __builtin_convertvector(__builtin_convertvector(rounded, i16), c16);  // one narrowing store
    }
    for (int64_t k = K16; k < K; ++k) qr[k] = (int8_t)((xr[k] * inverse + ROUND) - ROUND);
    row_scale[r] = scale;
  }
  at::Tensor sums = at::_int_mm(q, p.w);  // [M, N] int32
  const int32_t* sp = sums.data_ptr<int32_t>();
  const float* column = p.scale.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {
    const int32_t* sr = sp + r * N;
    float* orow = o + r * N;
    const float rs = row_scale[r];
    if (accumulate)
      for (int64_t n = 0; n < N; ++n) orow[n] += (float)sr[n] * rs * column[n];
    else
      for (int64_t n = 0; n < N; ++n) orow[n] = (float)sr[n] * rs * column[n];
  }
}

// in @ p as a new tensor [M, N]
at::Tensor product(const at::Tensor& in, const Product& p) {
  at::Tensor out = at::empty({in.size(0), p.w.size(1)}, at::TensorOptions().dtype(at::kFloat));
  product(out, in.contiguous(), p, false);
  return out;
}

}  // namespace
