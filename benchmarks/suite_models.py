"""The benchmark suite's workloads: models, inputs and generation options, identical for every engine.

Each workload builds (or loads) one Hugging Face model, saves it with ``save_pretrained`` into a temporary
directory next to a tokenizer (the CTranslate2 converter reads the vocabulary and the special tokens from
it), and gives the same inputs as padded tensors (for transformers, beamsearch and the floor) and as token
lists (for CTranslate2).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
G2P_DIR = ROOT / "src" / "beamsearch" / "models" / "g2p_cmudict"
G2P_WORDS = ROOT / "src" / "beamsearch" / "data" / "cmudict" / "test.tsv"

# Special token ids of the random-weight models (the saved word-level tokenizer names them).
PAD, EOS, UNK, BOS = 0, 1, 2, 3
FIRST_WORD = 4  # random inputs are drawn from [FIRST_WORD, vocab)

T5_SMALL = dict(d_model=512, d_ff=2048, layers=6, heads=8, vocab=32128)
GPT2_SMALL = dict(n_embd=768, n_inner=3072, n_layer=12, n_head=12, vocab=50257)
# A small Llama-shaped decoder: grouped-query attention (8 query heads sharing 4 key/value heads, head size 64)
LLAMA_SMALL = dict(hidden=512, intermediate=1408, layers=8, heads=8, kv_heads=4, vocab=32000)
# The Llama 3.2 1B shape (1.24B parameters, tied embeddings, llama3 rotary scaling), in bfloat16 on the device
LLAMA_1B = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256)
SOURCE_LENGTH = 32
NEW_TOKENS = 48
GPT2_PROMPT_LENGTHS = (8, 32)  # mixed prompt lengths, left-padded
# Scale of the end token's output row in "t5-small-eos": the end token's logit follows a random direction of
# the decoder's last hidden state, so hypotheses end at varied steps (measured on the greedy outputs of 64
# sources: lengths spread from 1 to 48, about a third reach 48; tuned by hand, fixed here).
EOS_ROW_SCALE = 160.0
LAYER_STD, EMBEDDING_STD = 0.3, 3.0


@dataclass
class Workload:
    """One model with its inputs and the generation options every engine gets."""

    name: str
    description: str
    model: torch.nn.Module
    encoder_decoder: bool
    hf_dir: Path | None  # save_pretrained output with a tokenizer: what CTranslate2 converts (None: not saved)
    vocabulary: list[str]  # token string of each id, as the converted model names them
    sources: list[list[int]]  # unpadded inputs, one per example (the prompt for decoder-only models)
    max_new_tokens: int
    eos: bool  # False: EOS suppressed (min_new_tokens = max_new_tokens), every engine runs all steps
    pad_token_id: int
    eos_token_id: int
    start_token_id: int | None  # the decoder start token (encoder-decoder models)
    notes: list[str] = field(default_factory=list)
    int8_model: torch.nn.Module | None = None  # beamsearch.quantize_int8(model), made on first use

    @property
    def lean_t5(self) -> bool:
        """Whether beamsearch runs this model with the lean T5 step."""
        from beamsearch.steps.t5.lean import lean_t5_reason

        return lean_t5_reason(self.model, {"encoder_outputs": True}, needs_attention=False) is None

    @property
    def lean_gpt2(self) -> bool:
        """Whether beamsearch runs this model with the lean GPT-2 step."""
        from beamsearch.steps.gpt2.lean import lean_gpt2_reason

        return lean_gpt2_reason(self.model, {}, needs_attention=False) is None

    @property
    def lean_llama(self) -> bool:
        """Whether beamsearch runs this model with the lean Llama step."""
        from beamsearch.steps.llama.lean import lean_llama_reason

        return lean_llama_reason(self.model, {}, needs_attention=False) is None

    @property
    def lean(self) -> bool:
        """Whether beamsearch runs this model with one of its lean steps (what compile_step compiles)."""
        return self.lean_t5 or self.lean_gpt2 or self.lean_llama

    def batch(self, size: int, device: str) -> dict[str, torch.Tensor]:
        """The first ``size`` inputs, padded (right for encoders, left for decoder-only prompts)."""
        chosen = [self.sources[i % len(self.sources)] for i in range(size)]
        width = max(map(len, chosen))
        ids = torch.full((size, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((size, width), dtype=torch.long)
        for row, tokens in enumerate(chosen):
            if self.encoder_decoder:
                ids[row, : len(tokens)] = torch.tensor(tokens)
                mask[row, : len(tokens)] = 1
            else:
                ids[row, width - len(tokens) :] = torch.tensor(tokens)
                mask[row, width - len(tokens) :] = 1
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}

    def token_lists(self, size: int) -> list[list[str]]:
        return [[self.vocabulary[i] for i in self.sources[k % len(self.sources)]] for k in range(size)]

    def generation_kwargs(self, num_beams: int) -> dict:
        """Options for transformers and beamsearch (identical), the stopping rule matched to CTranslate2."""
        kwargs = {"num_beams": num_beams, "max_new_tokens": self.max_new_tokens, "do_sample": False,
                  "num_return_sequences": 1, "length_penalty": 1.0}
        if self.eos:
            kwargs["min_new_tokens"] = 0
            if num_beams > 1:
                kwargs["early_stopping"] = True  # stop at K finished hypotheses: CTranslate2's patience 1
        else:
            kwargs["min_new_tokens"] = self.max_new_tokens
        return kwargs

    def ct2_kwargs(self, num_beams: int) -> dict:
        """The same options in CTranslate2's names (its length normalisation also counts the end token)."""
        return {"beam_size": num_beams, "patience": 1.0, "length_penalty": 1.0, "num_hypotheses": 1,
                "return_end_token": True, "min_length": self.max_new_tokens if not self.eos else 0,
                "max_length": self.max_new_tokens}


def _word_tokenizer(vocabulary: list[str], directory: Path) -> None:
    """A word-level tokenizer naming each id: all the converter needs (vocabulary and special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in enumerate(vocabulary)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)


def _names(vocab: int) -> list[str]:
    return ["<pad>", "</s>", "<unk>", "<s>"] + [f"t{i}" for i in range(FIRST_WORD, vocab)]


def _random_sources(count: int, vocab: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=generator).tolist()
    return [torch.randint(FIRST_WORD, vocab, (n,), generator=generator).tolist() for n in sizes]


def _t5_small(eos: bool, work: Path, count: int) -> Workload:
    from transformers import T5Config, T5ForConditionalGeneration

    shape = T5_SMALL
    config = T5Config(vocab_size=shape["vocab"], d_model=shape["d_model"], d_kv=shape["d_model"] // shape["heads"],
                      d_ff=shape["d_ff"], num_layers=shape["layers"], num_decoder_layers=shape["layers"],
                      num_heads=shape["heads"], pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        # Wider than T5's initialisation, so that the outputs vary token by token and the next-token
        # distributions are peaked but not degenerate (with T5's own init a random model repeats one token).
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "relative_attention_bias" not in name:
                parameter.normal_(0.0, LAYER_STD)
        model.shared.weight.normal_(0.0, EMBEDDING_STD)  # tied: input embedding and output layer
        if eos:  # the end token's row along a random unit direction: its logit varies step by step
            direction = torch.randn(shape["d_model"], generator=torch.Generator().manual_seed(1))
            model.shared.weight[EOS] = EOS_ROW_SCALE * direction / direction.norm()
    name = "t5-small-eos" if eos else "t5-small"
    directory = work / name
    model.save_pretrained(directory)
    vocabulary = _names(shape["vocab"])
    _word_tokenizer(vocabulary, directory)
    length = (SOURCE_LENGTH, SOURCE_LENGTH)
    stop = "EOS likely at varied lengths" if eos else "EOS suppressed"
    return Workload(
        name=name, description=f"random T5, t5-small shape {tuple(shape.values())}, source {SOURCE_LENGTH}, "
        f"{NEW_TOKENS} new tokens, {stop}",
        model=model, encoder_decoder=True, hf_dir=directory, vocabulary=vocabulary,
        sources=_random_sources(count, shape["vocab"], length, seed=2), max_new_tokens=NEW_TOKENS, eos=eos,
        pad_token_id=PAD, eos_token_id=EOS, start_token_id=PAD,
    )


def _g2p(work: Path, count: int) -> Workload:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    model = AutoModelForSeq2SeqLM.from_pretrained(G2P_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(G2P_DIR)
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    vocabulary = [token for token, _ in by_id]
    vocabulary += [f"<extra_id_{i}>" for i in range(model.config.vocab_size - len(vocabulary))]  # as the converter
    words = [line.split("\t")[0].lower() for line in G2P_WORDS.read_text(encoding="utf-8").splitlines() if line]
    random.Random(0).shuffle(words)  # varied lengths in every batch
    sources = tokenizer(words[:count])["input_ids"]
    max_new = int(model.generation_config.max_new_tokens or 32)
    return Workload(
        name="g2p", description=f"embedded G2P model (real T5, 3+3 layers, d_model 192), CMUdict test words, "
        f"up to {max_new} new tokens, EOS on",
        model=model, encoder_decoder=True, hf_dir=G2P_DIR, vocabulary=vocabulary, sources=sources,
        max_new_tokens=max_new, eos=True, pad_token_id=model.config.pad_token_id,
        eos_token_id=model.config.eos_token_id, start_token_id=model.config.decoder_start_token_id,
    )


def _decoder_only(name: str, model_class, config, vocab: int, shape_text: str, work: Path, count: int,
                  device: str = "cpu", dtype: torch.dtype | None = None) -> Workload:
    """A random decoder-only model saved with a word tokenizer, and batched prompts of mixed length (left-padded,
    EOS suppressed), the same for every decoder-only workload. With ``dtype`` the model is made on ``device`` in
    that dtype and not saved (no CTranslate2 conversion)."""
    torch.manual_seed(0)
    vocabulary = _names(vocab)
    if dtype is None:
        model = model_class(config).eval()
        directory = work / name
        model.save_pretrained(directory)
        _word_tokenizer(vocabulary, directory)
    else:
        with torch.device(device):
            model = model_class(config).to(dtype).eval()
        directory = None
    return Workload(
        name=name, description=f"{shape_text}, prompts of {GPT2_PROMPT_LENGTHS[0]}-{GPT2_PROMPT_LENGTHS[1]} tokens "
        f"left-padded, {NEW_TOKENS} new tokens, EOS suppressed",
        model=model, encoder_decoder=False, hf_dir=directory, vocabulary=vocabulary,
        sources=_random_sources(count, vocab, GPT2_PROMPT_LENGTHS, seed=3), max_new_tokens=NEW_TOKENS,
        eos=False, pad_token_id=PAD, eos_token_id=EOS, start_token_id=None,
    )


def _gpt2(work: Path, count: int) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = GPT2_SMALL
    config = GPT2Config(vocab_size=shape["vocab"], n_embd=shape["n_embd"], n_inner=shape["n_inner"],
                        n_layer=shape["n_layer"], n_head=shape["n_head"], n_positions=1024, bos_token_id=BOS,
                        eos_token_id=EOS, pad_token_id=PAD)
    return _decoder_only("gpt2", GPT2LMHeadModel, config, shape["vocab"],
                         f"random GPT-2, gpt2-small shape {tuple(shape.values())}", work, count)


def _llama(work: Path, count: int) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = LLAMA_SMALL
    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         max_position_embeddings=1024, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    return _decoder_only("llama", LlamaForCausalLM, config, shape["vocab"],
                         f"random Llama, shape {tuple(shape.values())} (hidden, intermediate, layers, heads, "
                         "key/value heads, vocab)", work, count)


def _llama_like(name: str, work: Path, count: int) -> Workload:
    """Qwen2 or Mistral on the small Llama shape: the models whose decoder layers are Llama's (Qwen2's attention
    biases drawn with std 0.02, as its other weights; Mistral without a sliding window), for the lean step's
    measurements on each."""
    import transformers

    shape = LLAMA_SMALL
    config_class, model_class, title = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2"),
                                        "mistral": ("MistralConfig", "MistralForCausalLM", "Mistral")}[name]
    extra = {"sliding_window": None} if name == "mistral" else {}
    config = getattr(transformers, config_class)(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=1024, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **extra)
    workload = _decoder_only(name, getattr(transformers, model_class), config, shape["vocab"],
                             f"random {title}, the Llama shape {tuple(shape.values())} (hidden, intermediate, "
                             "layers, heads, key/value heads, vocab)", work, count)
    if name == "qwen2":
        torch.manual_seed(1)
        with torch.no_grad():
            for layer in workload.model.model.layers:
                for product in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    product.bias.normal_(0.0, 0.02)
        workload.model.save_pretrained(workload.hf_dir)  # the CTranslate2 conversion reads the saved model
    return workload


def _llama_1b(work: Path, count: int, device: str) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = LLAMA_1B
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                         intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=64,
                         max_position_embeddings=131072, tie_word_embeddings=True, rope_parameters=rope,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    return _decoder_only("llama-1b", LlamaForCausalLM, config, shape["vocab"],
                         f"random Llama, Llama 3.2 1B shape {tuple(shape.values())} (hidden, intermediate, layers, "
                         "heads, key/value heads, vocab), bfloat16", work, count, device, torch.bfloat16)


MODELS = ("t5-small", "t5-small-eos", "g2p", "gpt2", "llama", "qwen2", "mistral", "llama-1b")


def build(name: str, work: Path, count: int, device: str = "cpu") -> Workload:
    """The workload ``name`` with ``count`` distinct inputs (batches take the first ones); ``device``: where
    llama-1b is made (the others are made on the CPU and moved by the caller)."""
    if name == "t5-small":
        return _t5_small(False, work, count)
    if name == "t5-small-eos":
        return _t5_small(True, work, count)
    if name == "g2p":
        return _g2p(work, count)
    if name == "gpt2":
        return _gpt2(work, count)
    if name == "llama":
        return _llama(work, count)
    if name in ("qwen2", "mistral"):
        return _llama_like(name, work, count)
    if name == "llama-1b":
        return _llama_1b(work, count, device)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
