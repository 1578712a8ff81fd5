"""The README's quick-start example: beam search over a character bigram model, then a Hugging Face model.

Run with ``make run``. The bigram model is counted from a few lines of text below, so the n-best
lists are real (if tiny) language-model output; the Hugging Face part shows the drop-in
``beamsearch.generate`` on a tiny random T5 and checks it against ``model.generate``.
"""

from __future__ import annotations

import torch

import beamsearch

TEXT = """the quick brown fox jumps over the lazy dog. the dog sleeps. the fox runs to the den.
then the brown dog chases the fox over the hill and the fox hides in the den."""


def bigram_step(text: str):
    """A character bigram model as a step function: ``(tokens [N, t], state) -> (logits [N, V], state)``."""
    alphabet = sorted(set(text))
    index = {c: i for i, c in enumerate(alphabet)}
    counts = torch.ones(len(alphabet), len(alphabet))  # add-one smoothing
    for a, b in zip(text, text[1:], strict=False):
        counts[index[a], index[b]] += 1
    log_probs = torch.log(counts / counts.sum(dim=1, keepdim=True))

    def step(tokens, state):
        return log_probs[tokens[:, -1]], state

    return step, alphabet, index


def main() -> None:
    step, alphabet, index = bigram_step(TEXT)
    prompts = ["the ", "fox "]
    input_ids = torch.tensor([[index[c] for c in p] for p in prompts])
    result = beamsearch.search(step, input_ids, num_beams=5, num_return_sequences=3, max_new_tokens=12,
                               eos_token_id=index["."], no_repeat_ngram_size=3)
    print("Beam search (5 beams, 3-best, no repeated 3-grams) over a character bigram model:")
    for b, prompt in enumerate(prompts):
        for j in range(3):
            length = int(result.lengths[b, j])
            text = "".join(alphabet[t] for t in result.sequences[b, j, :length].tolist())
            reason = beamsearch.FinishReason(int(result.finish_reason[b, j])).name.lower()
            print(f"  {prompt!r:8} #{j + 1}  score {float(result.sequences_scores[b, j]):7.3f}  {text!r}  ({reason})")

    try:
        from transformers import T5Config, T5ForConditionalGeneration
    except ImportError:
        print("transformers is not installed: skipping the Hugging Face example (pip install beamsearch[hf])")
        return
    config = T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).eval()
    source = torch.randint(2, 64, (2, 7))
    kwargs = dict(num_beams=4, num_return_sequences=2, max_new_tokens=10, return_dict_in_generate=True,
                  output_scores=True)
    ours = beamsearch.generate(model, input_ids=source, **kwargs)
    theirs = model.generate(input_ids=source, **kwargs)
    print("\nDrop-in generate() on a tiny random T5 (4 beams, 2 returned):")
    for row, score in zip(ours.sequences.tolist(), ours.sequences_scores.tolist(), strict=True):
        print(f"  {score:8.4f}  {row}")
    same = torch.equal(ours.sequences, theirs.sequences)
    print(f"identical to model.generate: {same}")


if __name__ == "__main__":
    main()
