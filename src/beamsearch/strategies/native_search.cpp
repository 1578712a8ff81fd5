// The search strategies' per-step bookkeeping in one call each (native_search.py says when they run).
//
// Beam search (beam_update): from the step's C candidates
// per example (their totals and positions in [K*V], chosen by the caller as transformers chooses them), the
// candidates' hypotheses, the stopping verdicts (the length limit and the end tokens), the finished pool's merge,
// the next live beams, whether each example can still improve, and the parent row of each new beam. The same
// arithmetic as strategies/beam.py, in the same float32 operations and order; the two selections by score call
// at::topk, as the Python step does, so that ties are ordered alike.
//
// Legend: B examples (active), K beams, C candidates per example, V vocabulary, L = max_length (tokens' width),
// G generated positions, t tokens so far (start tokens included), t0 start tokens.
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr float MASK = -1e9f;  // strategies/base.py's MASK
enum Reason : int64_t { NONE = 0, EOS = 1, MAX_LENGTH = 2, STOP_CRITERION = 3 };  // results.FinishReason

// A pool's fields, contiguous: tokens [B, M, L] int64, scores [B, M] float, token_log_probs [B, M, G] float,
// beam_indices [B, M, G] int64, and for a finished pool finished [B, M] bool, reasons [B, M] int64.
struct Pool {
  at::Tensor tokens, scores, log_probs, beams, finished, reasons;
  static Pool of(const std::vector<at::Tensor>& fields) {
    TORCH_CHECK(fields.size() == 4 || fields.size() == 6, "a pool is 4 fields (live) or 6 (finished)");
    Pool p{fields[0].contiguous(), fields[1].contiguous(), fields[2].contiguous(), fields[3].contiguous(), {}, {}};
    TORCH_CHECK(p.tokens.scalar_type() == at::kLong && p.scores.scalar_type() == at::kFloat &&
                p.log_probs.scalar_type() == at::kFloat && p.beams.scalar_type() == at::kLong,
                "pool fields: tokens int64, scores float32, token_log_probs float32, beam_indices int64");
    if (fields.size() == 6) {
      p.finished = fields[4].contiguous(); p.reasons = fields[5].contiguous();
      TORCH_CHECK(p.finished.scalar_type() == at::kBool && p.reasons.scalar_type() == at::kLong,
                  "pool fields: finished bool, reasons int64");
    }
    return p;
  }
  std::vector<at::Tensor> fields() const {
    if (finished.defined()) return {tokens, scores, log_probs, beams, finished, reasons};
    return {tokens, scores, log_probs, beams};
  }
};

// to[b, j] = from[b, m], field by field (flags and reasons only where both pools have them)
void copy_hypothesis(const Pool& from, int64_t b, int64_t m, Pool& to, int64_t j) {
  const int64_t M = from.scores.size(1), J = to.scores.size(1), L = from.tokens.size(2), G = from.log_probs.size(2);
  const int64_t src = b * M + m, dst = b * J + j;
  std::copy_n(from.tokens.data_ptr<int64_t>() + src * L, L, to.tokens.data_ptr<int64_t>() + dst * L);
  std::copy_n(from.log_probs.data_ptr<float>() + src * G, G, to.log_probs.data_ptr<float>() + dst * G);
  std::copy_n(from.beams.data_ptr<int64_t>() + src * G, G, to.beams.data_ptr<int64_t>() + dst * G);
  to.scores.data_ptr<float>()[dst] = from.scores.data_ptr<float>()[src];
  if (to.finished.defined() && from.finished.defined()) {
    to.finished.data_ptr<bool>()[dst] = from.finished.data_ptr<bool>()[src];
    to.reasons.data_ptr<int64_t>()[dst] = from.reasons.data_ptr<int64_t>()[src];
  }
}

Pool empty_pool(const Pool& p, int64_t B, int64_t M, bool finished) {
  const int64_t L = p.tokens.size(2), G = p.log_probs.size(2);
  Pool out{at::empty({B, M, L}, p.tokens.options()), at::empty({B, M}, p.scores.options()),
           at::empty({B, M, G}, p.log_probs.options()), at::empty({B, M, G}, p.beams.options()), {}, {}};
  if (finished) {
    out.finished = at::empty({B, M}, at::TensorOptions().dtype(at::kBool));
    out.reasons = at::empty({B, M}, at::TensorOptions().dtype(at::kLong));
  }
  return out;
}

// Args: values [B, C] float and positions [B, C] int64 (the candidates: totals and beam * V + token, best first),
// log_probs [B*K, V] float (after the processors), live (4 fields, [B, K, ...]), finished (6 fields),
// can_improve [B] bool, example_ids [B] int64 (each example's place in the full batch), length t, prompt t0,
// max_length L, eos ids, length_penalty, early_stopping (0: False, 1: True, 2: "never").
// Returns: the live pool's 4 fields, the finished pool's 6, can_improve [B] bool, the new beams' parent rows [B*K]
// int64, [B + 2] int64: per example whether it is done, then whether every candidate hit a criterion and whether
// every beam continues its own row; and nan [B] bool: the examples with a NaN candidate total.
std::vector<at::Tensor> beam_update(at::Tensor values, at::Tensor positions, at::Tensor log_probs,
                                    std::vector<at::Tensor> live_fields, std::vector<at::Tensor> pool_fields,
                                    at::Tensor can_improve, at::Tensor example_ids, int64_t t, int64_t t0,
                                    int64_t max_length, std::vector<int64_t> eos, double length_penalty,
                                    int64_t early_stopping) {
  values = values.contiguous(); positions = positions.contiguous(); log_probs = log_probs.contiguous();
  can_improve = can_improve.contiguous(); example_ids = example_ids.contiguous();
  const Pool live = Pool::of(live_fields), pool = Pool::of(pool_fields);
  const int64_t B = values.size(0), C = values.size(1), K = live.scores.size(1), V = log_probs.size(1);
  const int64_t L = live.tokens.size(2), G = live.log_probs.size(2), position = t - t0;
  TORCH_CHECK(values.scalar_type() == at::kFloat && positions.scalar_type() == at::kLong &&
              log_probs.scalar_type() == at::kFloat, "values float32, positions int64, log_probs float32");
  TORCH_CHECK(log_probs.size(0) == B * K && pool.scores.size(1) == K && C >= K && t < L && position < G &&
              position >= 0 && can_improve.numel() == B && example_ids.numel() == B, "beam_update: shapes");
  const float* val = values.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* lp = log_probs.data_ptr<float>();
  const int64_t* ids = example_ids.data_ptr<int64_t>();
  const bool* improve = can_improve.data_ptr<bool>();
  const bool at_limit = t + 1 >= max_length;
  auto is_eos = [&](int64_t token) {
    for (int64_t e : eos) if (token == e) return true;
    return false;
  };

  // the candidates: their parents' hypotheses with one more token
  Pool cand = empty_pool(live, B, C, true);
  std::vector<char> hits(B * C);
  at::Tensor nan = at::zeros({B}, at::TensorOptions().dtype(at::kBool));  // [B]: a NaN among the candidates
  bool* np = nan.data_ptr<bool>();
  bool all_hit = true;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t p = pos[b * C + c], parent = p / V, token = p % V;
      TORCH_CHECK(p >= 0 && p < K * V, "beam_update: a candidate position out of [0, K*V)");
      copy_hypothesis(live, b, parent, cand, c);
      const int64_t i = b * C + c;
      cand.tokens.data_ptr<int64_t>()[i * L + t] = token;
      cand.log_probs.data_ptr<float>()[i * G + position] = lp[(b * K + parent) * V + token];
      cand.beams.data_ptr<int64_t>()[i * G + position] = parent + ids[b] * K;
      cand.scores.data_ptr<float>()[i] = val[i];
      if (std::isnan(val[i])) np[b] = true;
      const bool eos_hit = is_eos(token);
      hits[i] = at_limit || eos_hit;
      all_hit = all_hit && hits[i];
      // what enters the finished pool: the first K candidates that stopped, by their penalised score
      const bool just = hits[i] && c < K;
      cand.finished.data_ptr<bool>()[i] = just;
      cand.reasons.data_ptr<int64_t>()[i] = !just ? NONE : eos_hit ? EOS : at_limit ? MAX_LENGTH : STOP_CRITERION;
    }

  // the finished pool: merge [pool | candidates scored sum / generated ** length_penalty, masked] and keep K
  const float norm = (float)std::pow((double)(t + 1 - t0), length_penalty);
  at::Tensor merged = at::empty({B, K + C}, values.options());
  float* mp = merged.data_ptr<float>();
  const float* ps = pool.scores.data_ptr<float>();
  const bool* pf = pool.finished.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    bool full = early_stopping == 1;
    for (int64_t k = 0; k < K; ++k) { full = full && pf[b * K + k]; mp[b * (K + C) + k] = ps[b * K + k]; }
    for (int64_t c = 0; c < C; ++c) {
      float s = val[b * C + c] / norm;
      s = s + (full ? MASK : 0.f);
      s = s + (improve[b] ? 0.f : MASK);
      s = s + (cand.finished.data_ptr<bool>()[b * C + c] ? 0.f : MASK);
      mp[b * (K + C) + K + c] = s;
    }
  }
  const at::Tensor keep_pool = std::get<1>(at::topk(merged, K)).contiguous();  // [B, K]
  Pool finished = empty_pool(pool, B, K, true);
  const int64_t* kp = keep_pool.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t m = kp[b * K + k];
      if (m < K) { copy_hypothesis(pool, b, m, finished, k); continue; }
      copy_hypothesis(cand, b, m - K, finished, k);
      finished.scores.data_ptr<float>()[b * K + k] = mp[b * (K + C) + m];
    }

  // the live beams: the best K candidates that did not stop
  at::Tensor running = at::empty({B, C}, values.options());
  float* rp = running.data_ptr<float>();
  for (int64_t i = 0; i < B * C; ++i) rp[i] = val[i] + (hits[i] ? MASK : 0.f);
  const at::Tensor keep_live = std::get<1>(at::topk(running, K)).contiguous();  // [B, K]
  Pool next = empty_pool(live, B, K, false);
  const int64_t* kl = keep_live.data_ptr<int64_t>();
  at::Tensor parent_rows = at::empty({B * K}, at::TensorOptions().dtype(at::kLong));
  int64_t* pr = parent_rows.data_ptr<int64_t>();
  bool identity = true;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t c = kl[b * K + k];
      copy_hypothesis(cand, b, c, next, k);
      next.scores.data_ptr<float>()[b * K + k] = rp[b * C + c];
      pr[b * K + k] = b * K + pos[b * C + c] / V;
      identity = identity && pr[b * K + k] == b * K + k;
    }

  // can each example still improve: its best live beam, normalised, against its worst finished hypothesis
  const int64_t best_length = (early_stopping == 2 && length_penalty > 0.0) ? max_length - t0 : t + 1 - t0;
  const float best_norm = (float)std::pow((double)best_length, length_penalty);
  at::Tensor improves = at::empty({B}, at::TensorOptions().dtype(at::kBool));
  at::Tensor flags = at::empty({B + 2}, at::TensorOptions().dtype(at::kLong));
  bool* ip = improves.data_ptr<bool>();
  int64_t* fp = flags.data_ptr<int64_t>();
  const float* fs = finished.scores.data_ptr<float>();
  const bool* ff = finished.finished.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    const float best = next.scores.data_ptr<float>()[b * K] / best_norm;
    float lowest = fs[b * K];
    bool all_finished = true;
    for (int64_t k = 1; k < K; ++k)  // torch.min: the least, NaN once one is met
      lowest = std::isnan(fs[b * K + k]) || fs[b * K + k] < lowest ? fs[b * K + k] : lowest;
    bool better = false;
    for (int64_t k = 0; k < K; ++k) {
      better = better || best > (ff[b * K + k] ? lowest : MASK);
      all_finished = all_finished && ff[b * K + k];
    }
    ip[b] = improve[b] && better;
    fp[b] = !ip[b] || (early_stopping == 1 && all_finished);
  }
  fp[B] = all_hit; fp[B + 1] = identity;
  std::vector<at::Tensor> out = next.fields();
  for (const at::Tensor& f : finished.fields()) out.push_back(f);
  out.insert(out.end(), {improves, parent_rows, flags, nan});
  return out;
}

// Greedy search (greedy_update), in place on its rows [B, K, ...]: each row's argmax (at::max, as the Python step,
// so that ties and NaN pick the same token), pad tokens after a row's end, the token's log-prob from at::log_softmax
// (-inf where every token is masked), the stopping verdicts (the length limit and the end tokens), lengths and
// finish reasons. Args: scores [N, V] float (after the processors), tokens [B, K, L] int64, token_log_probs
// [B, K, G] float, running [B, K] bool, lengths [B, K] int64, reasons [B, K] int64, t, t0, max_length, eos ids, the
// pad id (-1: a search without end tokens, whose rows all stop together, pads nothing). Returns [done [B] int64 (no
// row of the example runs), nan [B] bool].
std::vector<at::Tensor> greedy_update(at::Tensor scores, at::Tensor tokens, at::Tensor log_probs, at::Tensor running,
                                      at::Tensor lengths, at::Tensor reasons, int64_t t, int64_t t0,
                                      int64_t max_length, std::vector<int64_t> eos, int64_t pad) {
  TORCH_CHECK(tokens.is_contiguous() && log_probs.is_contiguous() && running.is_contiguous() &&
              lengths.is_contiguous() && reasons.is_contiguous(), "greedy_update: rows updated in place, contiguous");
  TORCH_CHECK(scores.scalar_type() == at::kFloat && log_probs.scalar_type() == at::kFloat &&
              tokens.scalar_type() == at::kLong && running.scalar_type() == at::kBool &&
              lengths.scalar_type() == at::kLong && reasons.scalar_type() == at::kLong, "greedy_update: dtypes");
  const int64_t B = running.size(0), K = running.size(1), N = B * K, L = tokens.size(2), G = log_probs.size(2);
  const int64_t position = t - t0;
  TORCH_CHECK(scores.dim() == 2 && scores.size(0) == N && t < L && position >= 0 && position < G,
              "greedy_update: shapes");
  auto best = at::max(scores, -1);
  const at::Tensor top = std::get<0>(best).contiguous(), chosen = std::get<1>(best).contiguous();
  const at::Tensor all_log_probs = at::log_softmax(scores, -1).contiguous();
  const int64_t V = scores.size(1);
  const float* tp = top.data_ptr<float>();
  const int64_t* cp = chosen.data_ptr<int64_t>();
  const float* lp = all_log_probs.data_ptr<float>();
  int64_t* tok = tokens.data_ptr<int64_t>();
  float* tlp = log_probs.data_ptr<float>();
  bool* run = running.data_ptr<bool>();
  int64_t* len = lengths.data_ptr<int64_t>();
  int64_t* why = reasons.data_ptr<int64_t>();
  const bool at_limit = t + 1 >= max_length;
  at::Tensor done = at::empty({B}, at::TensorOptions().dtype(at::kLong));
  at::Tensor nan = at::zeros({B}, at::TensorOptions().dtype(at::kBool));
  int64_t* dp = done.data_ptr<int64_t>();
  bool* np = nan.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    bool any_running = false;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t n = b * K + k;
      const bool was_running = run[n];
      const int64_t token = (pad < 0 || was_running) ? cp[n] : pad;
      TORCH_CHECK(token >= 0 && token < V, "greedy_update: the pad id is outside the vocabulary");
      float log_prob = lp[n * V + token];
      if (tp[n] == -std::numeric_limits<float>::infinity()) log_prob = -std::numeric_limits<float>::infinity();
      log_prob = was_running ? log_prob : 0.f;
      tlp[n * G + position] = log_prob;
      if (std::isnan(log_prob)) np[b] = true;
      tok[n * L + t] = token;
      len[n] += was_running ? 1 : 0;
      bool eos_hit = false;
      for (int64_t e : eos) eos_hit = eos_hit || token == e;
      const bool stopped = at_limit || eos_hit;
      if (stopped && was_running) why[n] = eos_hit ? EOS : at_limit ? MAX_LENGTH : STOP_CRITERION;
      run[n] = was_running && !stopped;
      any_running = any_running || run[n];
    }
    dp[b] = !any_running;
  }
  return {done, nan};
}

}  // namespace

void register_search(pybind11::module_& m) {
  m.def("beam_update", &beam_update);
  m.def("greedy_update", &greedy_update);
}
