// The fast T5 step as one C++ call per decoding step, and T5's encoder as one call per batch (native.py says what it
// computes; beamsearch/extension.py builds it at first use, extension.cpp registers it). Products go through ATen
// (at::mm_out, addmm_ with the residual: MKL or oneDNN, without Python or autograd); norms, attention, ReLU run as
// plain loops over GCC/Clang vectors.
// int8 models: each product's input is quantized once (per row, symmetric, 127 levels), multiplied by the int8
// weight in one at::_int_mm (int32 sums), and scaled back by row and by output column.
//
// The self-attention cache is never copied: each step keeps its own [L, N, 3I] product (queries, keys, values of
// every layer) and the parent row of each of its rows in the step before; a row's keys at earlier positions are
// found by walking that chain once per step (shared by the layers). A beam reorder or the removal of finished
// examples is the parent index given to the next step.
//
// Legend: B examples, N rows, S source length, Sp S rounded up to 16, L layers, H heads, d head size, I = H*d,
// D model width, F feed-forward width, V vocabulary, t positions so far.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "native_kernels.h"

// A model's weights, folded and stacked by packed.py, transposed once here to [in, out].
struct T5Weights {
  int64_t L, D, H, d, I, F, V;
  double eps, encoder_eps;
  at::Tensor embed;                    // decoder embedding [V, D] (the model's)
  Product output, cross_kv;            // [D, V], [D, 2*L*I]
  std::vector<Product> qkv, self_out, cross_query, cross_out, inner, outer;  // per decoder layer
  at::Tensor encoder_embed, encoder_gain;                                     // [V, D], [D]
  std::vector<Product> e_qkv, e_out, e_inner, e_outer;                        // per encoder layer

  // decoder: 6 weights per layer (qkv, self_out, cross_query, cross_out, inner, outer), then the output and the
  // cross-attention keys and values; encoder: 4 per layer. Weights [out, in]; scales: one per weight in the same
  // order (decoder, output, cross_kv, encoder): [out] for an int8 weight, empty for a float one.
  T5Weights(std::vector<at::Tensor> decoder, at::Tensor embed_, std::vector<at::Tensor> encoder,
            at::Tensor encoder_embed_, at::Tensor encoder_gain_, std::vector<at::Tensor> scales, int64_t heads,
            double eps_, double encoder_eps_)
      : H(heads), eps(eps_), encoder_eps(encoder_eps_) {
    TORCH_CHECK(decoder.size() % 6 == 2 && encoder.size() % 4 == 0, "T5Weights: 6 weights per decoder layer, the "
                "output and cross_kv, 4 per encoder layer");
    TORCH_CHECK(scales.size() == decoder.size() + encoder.size(), "T5Weights: one scale per weight");
    const size_t n = decoder.size();
    auto all = transposed(decoder, std::vector<at::Tensor>(scales.begin(), scales.begin() + n));
    output = all[n - 2]; cross_kv = all[n - 1];
    all.resize(n - 2);
    qkv = every(all, 6, 0); self_out = every(all, 6, 1); cross_query = every(all, 6, 2);
    cross_out = every(all, 6, 3); inner = every(all, 6, 4); outer = every(all, 6, 5);
    auto enc = transposed(encoder, std::vector<at::Tensor>(scales.begin() + n, scales.end()));
    e_qkv = every(enc, 4, 0); e_out = every(enc, 4, 1); e_inner = every(enc, 4, 2); e_outer = every(enc, 4, 3);
    embed = embed_.contiguous(); encoder_embed = encoder_embed_.contiguous();
    encoder_gain = encoder_gain_.contiguous();
    L = (int64_t)qkv.size(); D = embed.size(1); V = output.w.size(1); I = qkv[0].w.size(1) / 3; d = I / H;
    F = inner[0].w.size(1);
    TORCH_CHECK(L > 0 && I == H * d && cross_kv.w.size(1) == 2 * L * I, "T5Weights: inconsistent shapes");
  }

  // The encoder on the source tokens only (the padding is left out of products and attention): ids [B, S] int64,
  // mask [B, S] (nonzero: a token; none: every position), bias [H, S, S] (the model's compute_bias). Returns the
  // last hidden state [B, S, D], final norm applied, zeros at the padding.
  at::Tensor encode(at::Tensor ids, c10::optional<at::Tensor> mask, at::Tensor bias) {
    const int64_t B = ids.size(0), S = ids.size(1), Sp = round_up(S);
    ids = ids.to(at::kLong).contiguous();
    bias = bias.contiguous();
    std::vector<int64_t> row(B * S, -1), flat;  // [B*S] -> row among the tokens (-1: padding), and back
    at::Tensor m = mask.has_value() && mask->defined() ? mask->to(at::kLong).contiguous() : at::Tensor();
    const int64_t* mp = m.defined() ? m.data_ptr<int64_t>() : nullptr;
    for (int64_t r = 0; r < B * S; ++r)
      if (!mp || mp[r] != 0) { row[r] = (int64_t)flat.size(); flat.push_back(r); }
    const int64_t M = (int64_t)flat.size();
    auto f = at::TensorOptions().dtype(at::kFloat);
    at::Tensor X = at::empty({M, D}, f), Hn = at::empty({M, D}, f), QKV = at::empty({M, 3 * I}, f),
               A = at::empty({M, I}, f), FF = at::empty({M, F}, f);
    const int64_t* id = ids.data_ptr<int64_t>();
    const float* e = encoder_embed.data_ptr<float>();
    float* xp = X.data_ptr<float>();
    for (int64_t r = 0; r < M; ++r) std::copy(e + id[flat[r]] * D, e + id[flat[r]] * D + D, xp + r * D);
    const float* eb = bias.data_ptr<float>();
    for (size_t l = 0; l < e_qkv.size(); ++l) {
      rms(X, Hn, encoder_eps);
      product(QKV, Hn, e_qkv[l], false);
      const float* q = QKV.data_ptr<float>();
      float* ap = A.data_ptr<float>();
      at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> w(Sp);
        for (int64_t r = begin; r < end; ++r) {
          const int64_t b = flat[r] / S, i = flat[r] % S;
          const int64_t* keys = row.data() + b * S;
          for (int64_t h = 0; h < H; ++h) {
            const float* qi = q + r * 3 * I + h * d;
            for (int64_t j = 0; j < Sp; ++j)
              w[j] = (j < S && keys[j] >= 0) ? dot(qi, q + keys[j] * 3 * I + I + h * d, d) + eb[(h * S + i) * S + j]
                                             : MASKED;
            softmax_blocks(w.data(), Sp);
            float* out = ap + r * I + h * d;
            std::fill(out, out + d, 0.f);
            for (int64_t j = 0; j < S; ++j)
              if (keys[j] >= 0) axpy(w[j], q + keys[j] * 3 * I + 2 * I + h * d, out, d);
          }
        }
      });
      product(X, A, e_out[l], true);
      rms(X, Hn, encoder_eps);
      product(FF, Hn, e_inner[l], false);
      relu_in_place(FF);
      product(X, FF, e_outer[l], true);
    }
    rms(X, Hn, encoder_eps, encoder_gain.data_ptr<float>());
    at::Tensor out = at::zeros({B * S, D}, f);
    out.index_copy_(0, at::tensor(flat, at::TensorOptions().dtype(at::kLong)), Hn);
    return out.view({B, S, D});
  }
};

// One decode: the cross-attention keys and values of its examples, and the steps so far.
struct T5Decode {
  std::shared_ptr<T5Weights> w;
  int64_t B, S, Sp;
  at::Tensor cross_keys, cross_values;  // [L, B, H, d, Sp] (keys transposed per head, zero-padded), [L, B, S, I]
  std::vector<float> cross_mask;        // [B, Sp]: 0 at a token, MASKED elsewhere
  at::Tensor bias;                      // [H, T]: the self-attention bias by distance (query - key)
  std::vector<at::Tensor> past;         // per position: [L, N_t, 3I] (queries, keys, values)
  std::vector<std::vector<int64_t>> parent;  // per position: each row's row at the position before
  std::vector<int64_t> example;         // per row of the last step: its example

  // hidden [B, S, D] (the encoder output), mask [B, S] (nonzero: a token; none: every position), bias [H, T]
  T5Decode(std::shared_ptr<T5Weights> weights, at::Tensor hidden, c10::optional<at::Tensor> mask, at::Tensor bias_)
      : w(std::move(weights)) {
    const int64_t L = w->L, H = w->H, d = w->d, I = w->I;
    B = hidden.size(0); S = hidden.size(1); Sp = round_up(S);
    set_bias(bias_);
    hidden = hidden.contiguous().view({B * S, w->D});
    at::Tensor m = mask.has_value() && mask->defined() ? mask->to(at::kLong).contiguous() : at::Tensor();
    const int64_t* mp = m.defined() ? m.data_ptr<int64_t>() : nullptr;
    std::vector<int64_t> flat;
    cross_mask.assign(B * Sp, MASKED);
    for (int64_t r = 0; r < B * S; ++r)
      if (!mp || mp[r] != 0) { flat.push_back(r); cross_mask[(r / S) * Sp + r % S] = 0.f; }
    at::Tensor tokens = hidden.index_select(0, at::tensor(flat, at::TensorOptions().dtype(at::kLong)));
    at::Tensor kv = product(tokens, w->cross_kv);  // [M, 2*L*I]: (layer, key or value, head, d)
    auto f = at::TensorOptions().dtype(at::kFloat);
    cross_keys = at::zeros({L, B, H, d, Sp}, f);
    cross_values = at::zeros({L, B, S, I}, f);
    float* ck = cross_keys.data_ptr<float>();
    float* cv = cross_values.data_ptr<float>();
    const float* p = kv.data_ptr<float>();
    for (size_t r = 0; r < flat.size(); ++r) {
      const int64_t b = flat[r] / S, s = flat[r] % S;
      for (int64_t l = 0; l < L; ++l) {
        const float* k = p + r * 2 * L * I + 2 * l * I;
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < d; ++i) ck[(((l * B + b) * H + h) * d + i) * Sp + s] = k[h * d + i];
        std::copy(k + I, k + 2 * I, cv + ((l * B + b) * S + s) * I);
      }
    }
  }

  void set_bias(at::Tensor bias_) { bias = bias_.to(at::kFloat).contiguous(); }
  int64_t capacity() const { return bias.size(1); }
  int64_t length() const { return (int64_t)past.size(); }

  // The rows' parents: given (a reorder, an expansion, finished examples left out) or the rows of the step before.
  void link(int64_t N, const c10::optional<at::Tensor>& parents) {
    const int64_t t = length();
    std::vector<int64_t> link(N);
    if (t == 0) {
      TORCH_CHECK(N == B && !(parents.has_value() && parents->defined()), "the first position has one row per example");
      for (int64_t n = 0; n < N; ++n) { link[n] = n; }
      example = link;
    } else if (parents.has_value() && parents->defined()) {
      at::Tensor p = parents->to(at::kLong).contiguous();
      TORCH_CHECK(p.numel() == N, "one parent per row");
      const int64_t* pp = p.data_ptr<int64_t>();
      const int64_t before = (int64_t)example.size();
      std::vector<int64_t> moved(N);
      for (int64_t n = 0; n < N; ++n) {
        TORCH_CHECK(pp[n] >= 0 && pp[n] < before, "a parent row out of range");
        link[n] = pp[n]; moved[n] = example[pp[n]];
      }
      example = moved;
    } else {
      TORCH_CHECK(N == (int64_t)example.size(), "a step without parents has the rows of the step before");
      for (int64_t n = 0; n < N; ++n) link[n] = n;
    }
    parent.push_back(std::move(link));
  }

  // One position for every row: tokens [N] int64, parents [N] (rows of the step before; none: the same rows).
  // Returns the logits [N, V], a new tensor.
  at::Tensor step(at::Tensor tokens, c10::optional<at::Tensor> parents) {
    const int64_t L = w->L, D = w->D, H = w->H, d = w->d, I = w->I, T = capacity();
    const int64_t N = tokens.size(0), t = length();
    TORCH_CHECK(t < T, "step: no position bias past the capacity (grow it first)");
    link(N, parents);
    tokens = tokens.to(at::kLong).contiguous();
    auto f = at::TensorOptions().dtype(at::kFloat);
    past.push_back(at::empty({L, N, 3 * I}, f));
    // each row's rows at every position so far, shared by the layers: [N, t+1]
    std::vector<int64_t> chain(N * (t + 1));
    for (int64_t n = 0; n < N; ++n) {
      int64_t r = n;
      int64_t* c = chain.data() + n * (t + 1);
      c[t] = r;
      for (int64_t j = t; j > 0; --j) { r = parent[j][r]; c[j - 1] = r; }
    }
    std::vector<int64_t> rows(t + 1);
    for (int64_t j = 0; j <= t; ++j) rows[j] = past[j].size(1);
    at::Tensor X = at::empty({N, D}, f), Hn = at::empty({N, D}, f), A = at::empty({N, I}, f),
               Q = at::empty({N, I}, f), FF = at::empty({N, w->F}, f);
    const int64_t* tok = tokens.data_ptr<int64_t>();
    const float* e = w->embed.data_ptr<float>();
    float* xp = X.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n) {
      TORCH_CHECK(tok[n] >= 0 && tok[n] < w->embed.size(0), "a token out of the vocabulary");
      std::copy(e + tok[n] * D, e + tok[n] * D + D, xp + n * D);
    }
    const float* bs = bias.data_ptr<float>();
    const int64_t m = round_up(t + 1);
    for (int64_t l = 0; l < L; ++l) {
      rms(X, Hn, w->eps);
      at::Tensor now = past[t].select(0, l);  // [N, 3I]
      product(now, Hn, w->qkv[l], false);
      float* ap = A.data_ptr<float>();
      const float* q = now.data_ptr<float>();
      std::vector<const float*> layer(t + 1);  // each position's rows of this layer: [N_j, 3I]
      for (int64_t j = 0; j <= t; ++j) layer[j] = past[j].data_ptr<float>() + l * rows[j] * 3 * I;
      at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> weights(H * m);
        for (int64_t n = begin; n < end; ++n) {
          const int64_t* c = chain.data() + n * (t + 1);
          const float* qn = q + n * 3 * I;
          std::fill(weights.begin(), weights.end(), MASKED);
          for (int64_t j = 0; j <= t; ++j) {
            const float* k = layer[j] + c[j] * 3 * I + I;
            for (int64_t h = 0; h < H; ++h) weights[h * m + j] = dot(qn + h * d, k + h * d, d) + bs[h * T + (t - j)];
          }
          for (int64_t h = 0; h < H; ++h) softmax_blocks(weights.data() + h * m, m);
          float* out = ap + n * I;
          std::fill(out, out + I, 0.f);
          for (int64_t j = 0; j <= t; ++j) {
            const float* v = layer[j] + c[j] * 3 * I + 2 * I;
            for (int64_t h = 0; h < H; ++h) axpy(weights[h * m + j], v + h * d, out + h * d, d);
          }
        }
      });
      product(X, A, w->self_out[l], true);
      rms(X, Hn, w->eps);
      product(Q, Hn, w->cross_query[l], false);
      cross_attention(l, Q, A);
      product(X, A, w->cross_out[l], true);
      rms(X, Hn, w->eps);
      product(FF, Hn, w->inner[l], false);
      relu_in_place(FF);
      product(X, FF, w->outer[l], true);
    }
    rms(X, Hn, w->eps);
    return product(Hn, w->output);
  }

  // Each row's attention over its example's encoder output: queries [N, I] -> out [N, I] (scores vectorized over
  // source positions, the keys being stored transposed per head)
  void cross_attention(int64_t l, const at::Tensor& queries, at::Tensor& out) {
    const int64_t H = w->H, d = w->d, I = w->I, N = queries.size(0);
    const float* q = queries.data_ptr<float>();
    const float* keys = cross_keys.data_ptr<float>() + l * B * H * d * Sp;
    const float* values = cross_values.data_ptr<float>() + l * B * S * I;
    float* op = out.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> w_(Sp);
      float* wt = w_.data();
      for (int64_t n = begin; n < end; ++n) {
        const int64_t b = example[n];
        const float* qn = q + n * I;
        for (int64_t h = 0; h < H; ++h) {
          const float* kt = keys + ((b * H + h) * d) * Sp;
          const float* qh = qn + h * d;
          for (int64_t j = 0; j < Sp; j += BLK) {
            v16 a0 = load16(cross_mask.data() + b * Sp + j), a1 = {}, a2 = {}, a3 = {};  // 4 chains: FMA latency
            int64_t i = 0;
            for (; i + 4 <= d; i += 4) {
              a0 += qh[i] * load16(kt + i * Sp + j);
              a1 += qh[i + 1] * load16(kt + (i + 1) * Sp + j);
              a2 += qh[i + 2] * load16(kt + (i + 2) * Sp + j);
              a3 += qh[i + 3] * load16(kt + (i + 3) * Sp + j);
            }
            for (; i < d; ++i) a0 += qh[i] * load16(kt + i * Sp + j);
            store16(wt + j, (a0 + a1) + (a2 + a3));
          }
          softmax_blocks(wt, Sp);
          float* o = op + n * I + h * d;
          std::fill(o, o + d, 0.f);
          for (int64_t j = 0; j < S; ++j) axpy(wt[j], values + (b * S + j) * I + h * d, o, d);
        }
      }
    });
  }
};

// in [M, K] @ one product: weight [out, in] (float32, or int8 with scale [out]); what the tests check products by
at::Tensor product_of(at::Tensor in, at::Tensor weight, c10::optional<at::Tensor> scale) {
  const bool int8 = scale.has_value() && scale->defined();
  return product(in.to(at::kFloat).contiguous(), transposed({weight}, {int8 ? *scale : at::empty({0})})[0]);
}

void register_t5(pybind11::module_& m) {
  m.def("product", &product_of);
  pybind11::class_<T5Weights, std::shared_ptr<T5Weights>>(m, "T5Weights")
      .def(pybind11::init<std::vector<at::Tensor>, at::Tensor, std::vector<at::Tensor>, at::Tensor, at::Tensor,
                          std::vector<at::Tensor>, int64_t, double, double>())
      .def("encode", &T5Weights::encode);
  pybind11::class_<T5Decode>(m, "T5Decode")
      .def(pybind11::init<std::shared_ptr<T5Weights>, at::Tensor, c10::optional<at::Tensor>, at::Tensor>())
      .def("set_bias", &T5Decode::set_bias).def("capacity", &T5Decode::capacity)
      .def("length", &T5Decode::length).def("step", &T5Decode::step);
}
