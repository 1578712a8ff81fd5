"""The CPU follow-up of the H100 run's one worrying pattern (docs/performance.md#cuda-graphs): on the 1B Llama shape
in bfloat16 at beam 4, the graph path's best hypotheses equal transformers' on 0/16 and 4/64 examples while the eager
path's equal 16/16 and 64/64. Bug or rounding?

A small random Llama shaped like the 1B one (tied embeddings, llama3 rotary scaling, grouped-query attention with
fewer key/value heads than heads, mixed-length left-padded prompts of 8-32 tokens, 48 new tokens, EOS suppressed)
decodes the same batch three ways on the CPU, where ``cuda_graphs=True`` runs the same whole step uncaptured:
transformers' ``generate``, our eager lean path and the graph path. It prints

1. the best hypotheses equal between each pair, and where graphs and eager first part;
2. the raw logits of the graph step against the eager lean step for the first steps (rows with the same history);
3. the log-probabilities of transformers, eager and graphs against a float64 copy of the model run without a cache
   over the same histories (the exact answer to the dtype's rounding), and how many rows hold an exact tie among
   their 2K+1 best log-probabilities (a tie that only the order of the arithmetic breaks);
4. one attention call on hand-made tensors: the graph path's (an example's K x T keys under a mask) against each
   row over its own keys (the lean step's, transformers' ``sdpa``), each against float64.

Run from the repository root (one thread, about two minutes on a 2-core CPU; ``--beams 1``, greedy, prints the
counts of 1. and the attention call only)::

    check=benchmarks/gpu_results/2026-11-27-h100/bf16_beam_check.py
    for dtype in bfloat16 float32; do
        .venv/bin/python $check --dtype $dtype
        .venv/bin/python $check --dtype $dtype --vocab 32000 --hidden 512
    done
    .venv/bin/python $check --beams 1
    .venv/bin/python $check --beams 1 --vocab 32000 --hidden 512

Legend: B examples, K beams, N = B*K, V vocabulary, H query heads, G key/value heads, d head size.
"""

from __future__ import annotations

import argparse
import copy
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

import beamsearch
from beamsearch.graphs.beam import GraphBeamSearch
from beamsearch.steps.attention import additive, attend, group_mask
from beamsearch.steps.caches import StaticCache
from beamsearch.steps.llama.graph import GraphLlama
from beamsearch.steps.llama.lean import LeanLlamaState

PAD, EOS, BOS = 0, 1, 3
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--steps", type=int, default=6, help="steps whose logits are compared")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build(args: argparse.Namespace, dtype: torch.dtype) -> tuple[LlamaForCausalLM, dict]:
    """The model (random weights, as the suite's llama-1b: transformers' own initialisation) and the call."""
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                         max_position_embeddings=131072, tie_word_embeddings=True, rope_parameters=ROPE,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    draw = random.Random(3)
    prompts = [[draw.randrange(4, args.vocab) for _ in range(draw.randint(8, 32))] for _ in range(args.batch)]
    width = max(map(len, prompts))
    ids = torch.full((args.batch, width), PAD, dtype=torch.long)
    mask = torch.zeros((args.batch, width), dtype=torch.long)
    for row, tokens in enumerate(prompts):
        ids[row, width - len(tokens):] = torch.tensor(tokens)
        mask[row, width - len(tokens):] = 1
    call = dict(input_ids=ids, attention_mask=mask, num_beams=args.beams, max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens, do_sample=False, num_return_sequences=1, length_penalty=1.0,
                eos_token_id=EOS, pad_token_id=PAD)
    return model, call


class Recorder:
    """A logits processor that keeps the first ``limit`` steps' histories ``[N, t]`` and log-probs ``[N, V]``."""

    def __init__(self, limit: int):
        self.limit, self.steps = limit, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if len(self.steps) < self.limit:
            self.steps.append((input_ids.clone(), scores.float().clone()))
        return scores


def run_all(model, call: dict, args: argparse.Namespace):
    """transformers, eager and graphs: ``{name: (sequences, recorded steps)}`` and the raw logits of the eager and
    graph steps ``{name: [[N, V]]}`` (each path's first ``args.steps`` model steps after the prompt)."""
    rows, raw = args.batch * args.beams, {"eager": [], "graphs": []}
    patched = []
    for cls, name in ((LeanLlamaState, "eager"), (GraphLlama, "graphs")):
        def decode(self, tokens, position, original=cls.decode, name=name):
            logits = original(self, tokens, position)
            if len(raw[name]) < args.steps:
                raw[name].append(logits[:rows].clone())
            return logits

        patched.append((cls, cls.decode))
        cls.decode = decode
    graph_steps = Recorder(args.steps)
    select = GraphBeamSearch.select

    def recording_select(self, logits):  # the graph path takes no host-side processor: record at its selection
        history = self.live.tokens[: args.batch, :, : int(self.length)].reshape(rows, -1)
        graph_steps(history, torch.log_softmax(logits[:rows].float(), dim=-1))
        return select(self, logits)

    GraphBeamSearch.select = recording_select
    try:
        with torch.no_grad():
            hf_steps, eager_steps = Recorder(args.steps), Recorder(args.steps)
            out = {"HF": (model.generate(**call, logits_processor=LogitsProcessorList([hf_steps])), hf_steps.steps),
                   "eager": (beamsearch.generate(model, **call, logits_processor=LogitsProcessorList([eager_steps])),
                             eager_steps.steps),
                   "graphs": (beamsearch.generate(model, **call, cuda_graphs=True), graph_steps.steps)}
    finally:
        GraphBeamSearch.select = select
        for cls, original in patched:
            cls.decode = original
    return out, raw


def float64_log_probs(reference, history: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` float64 log-probs of the next token after each history ``[n, t]`` (prompt left-padded as
    ``prompt_mask [n, P]``), one forward without a cache, positions as transformers' ``cumsum(mask) - 1``."""
    generated = history.shape[1] - prompt_mask.shape[1]
    mask = torch.cat([prompt_mask, torch.ones(history.shape[0], generated, dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = reference(input_ids=history, attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
    return torch.log_softmax(logits, dim=-1)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def report_searches(out: dict, args: argparse.Namespace, prompt_length: int) -> None:
    def equal(a: str, b: str) -> int:
        x, y = out[a][0], out[b][0]
        width = min(x.shape[1], y.shape[1])
        return int((x[:, :width] == y[:, :width]).all(dim=1).sum())

    print(f"best hypotheses equal: eager=HF {equal('eager', 'HF')}/{args.batch}, "
          f"graphs=HF {equal('graphs', 'HF')}/{args.batch}, graphs=eager {equal('graphs', 'eager')}/{args.batch}")
    graphs, eager = out["graphs"][0], out["eager"][0]
    parts = [int(row.nonzero()[0]) - prompt_length if row.any() else None for row in graphs != eager]
    print("first new token where graphs and eager part, per example:", parts)


def report_logits(out: dict, raw: dict, dtype: torch.dtype) -> None:
    print("raw logits, graph step against eager lean step (rows with the same history):")
    for step, (eager, graphs, (history_e, _), (history_g, _)) in enumerate(
            zip(raw["eager"], raw["graphs"], out["eager"][1][1:], out["graphs"][1][1:], strict=False), start=1):
        same = (history_e == history_g).all(dim=1)
        difference = (graphs[same] - eager[same]).abs()
        largest = eager[same].abs().max()
        spacing = float(torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(largest))))
        print(f"  step {step}: {int(same.sum())}/{same.numel()} rows; largest |logit| {float(largest):.3g} "
              f"({_name(dtype)} spacing there {spacing:.3g}); max |difference| {float(difference.max()):.3g} "
              f"({float(difference.max() / largest):.2e} of the largest logit), mean {float(difference.mean()):.3g}; "
              f"{float((difference > 0).double().mean()) * 100:.0f}% of the entries differ")


def report_log_probs(out: dict, model, call: dict, args: argparse.Namespace) -> None:
    reference = copy.deepcopy(model).double()
    prompt_mask = call["attention_mask"].repeat_interleave(args.beams, dim=0)  # [N, P]
    keep = torch.arange(args.vocab) != EOS  # min_new_tokens sets EOS to -inf in the processed log-probs
    print("log-probs (EOS left out) against float64 over the same histories; max |error| HF / eager / graphs "
          "(mean eager / graphs); rows whose 2K+1 best log-probs (eager) hold an exact tie:")
    steps = zip(out["HF"][1], out["eager"][1], out["graphs"][1], strict=False)
    for step, ((history_h, hf), (history_e, eager), (history_g, graphs)) in enumerate(steps):
        same = (history_e == history_g).all(dim=1) & (history_e == history_h).all(dim=1)
        exact = float64_log_probs(reference, history_e[same], prompt_mask[same])[:, keep]
        hf, eager, graphs = hf[same][:, keep], eager[same][:, keep], graphs[same][:, keep]
        gaps = torch.topk(eager, 2 * args.beams + 1, dim=-1).values.diff(dim=-1).abs().min(dim=-1).values

        errors = [float((x.double() - exact).abs().max()) for x in (hf, eager, graphs)]
        means = [float((x.double() - exact).abs().mean()) for x in (eager, graphs)]
        print(f"  step {step}: {int(same.sum())}/{same.numel()} rows; "
              f"graphs-eager {float((graphs - eager).abs().max()):.3g}, "
              f"eager-HF {float((eager - hf).abs().max()):.3g}; "
              f"vs float64 {errors[0]:.3g} / {errors[1]:.3g} / {errors[2]:.3g} (mean {means[0]:.3g} / {means[1]:.3g}); "
              f"exact ties {int((gaps == 0).sum())}/{gaps.numel()}")


def report_attention(dtype: torch.dtype, args: argparse.Namespace) -> None:
    """One attention call on random tensors: the graph path's packed, masked call against each row's own keys."""
    torch.manual_seed(args.seed)
    b, k, heads, groups, size, capacity, prompt = 16, args.beams, args.heads, args.kv_heads, 64, 64, 20
    cache = StaticCache(1, b, capacity, k, groups, size, dtype, "cpu")
    keys, values = (torch.randn(b, groups, prompt, size).to(dtype) for _ in range(2))
    cache.fill_prompt(0, keys, values)
    position = torch.tensor(prompt)
    cache.claim(position)
    new_key, new_value = (torch.randn(b * k, groups, size).to(dtype) for _ in range(2))
    cache.write(0, position, new_key, new_value)
    query = torch.randn(b * k, heads, size).to(dtype)
    mask = group_mask(additive(cache.allowed(position), dtype), heads // groups)
    graphs = attend(query, *cache.grouped(0), mask, size**-0.5).view(b * k, heads, size)
    own_keys = torch.cat([keys.repeat_interleave(k, 0), new_key[:, :, None]], dim=2)  # [N, G, P+1, d]
    own_values = torch.cat([values.repeat_interleave(k, 0), new_value[:, :, None]], dim=2)

    def own(q, key, value):
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], key, value, scale=size**-0.5,
                                                                enable_gqa=True)[:, :, 0]

    eager = own(query, own_keys, own_values)
    exact = own(query.double(), own_keys.double(), own_values.double())
    difference = (graphs.double() - eager.double()).abs()
    print(f"one attention call ({_name(dtype)}, [N={b * k}, H={heads}, d={size}] over {prompt + 1} keys, G={groups}): "
          f"graphs and eager differ in {float((difference > 0).double().mean()) * 100:.1f}% of the outputs, "
          f"by at most {float(difference.max()):.3g}; max |error| vs float64 eager "
          f"{float((eager.double() - exact).abs().max()):.3g}, "
          f"graphs {float((graphs.double() - exact).abs().max()):.3g}")


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    print(f"== {args.dtype}: vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
          f"{args.kv_heads} key/value heads; batch {args.batch}, beam {args.beams}, {args.new_tokens} new tokens, "
          f"seed {args.seed}")
    model, call = build(args, dtype)
    out, raw = run_all(model, call, args)
    report_searches(out, args, call["input_ids"].shape[1])
    report_logits(out, raw, dtype)
    report_log_probs(out, model, call, args)
    report_attention(dtype, args)


if __name__ == "__main__":
    main()
