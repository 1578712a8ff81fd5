"""Tiny configs of every text-generation architecture the sweep (``test_architectures.py``) decodes.

Each entry names a transformers config class and the keyword arguments that make it tiny (hidden size 16-32, one or
two layers, a 64-token vocabulary); the model is built from it with random weights (nothing downloaded). Its output
head is untied and redrawn with a large scale and its EOS row boosted, as ``tiny_hf.tiny_model`` does, so that
next-token distributions are peaked and input-dependent and hypotheses finish at varied steps. A config class the
installed release lacks is reported by :func:`missing_reason` (the sweep skips that family by name).
"""

from __future__ import annotations

import functools

import torch

VOCAB = 64
EOS_BOOST = 1.3  # the EOS row's scale over the others: hypotheses finish at varied steps
BOS, EOS, PAD = 0, 1, 2
FIRST_PLAIN = 3  # every family's special tokens are below it
TOKENS = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
UNTIED = {"vocab_size": VOCAB, "tie_word_embeddings": False, **TOKENS}

# decoder-only families named like Llama's config
LLAMA = {**UNTIED, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# BERT-like encoders run as causal decoders (is_decoder=True)
BERT = {**UNTIED, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 64, "is_decoder": True}
# GPT-2-like names
GPT = {**UNTIED, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
# encoder-decoder families named like BART's config
BART = {**UNTIED, "d_model": 32, "encoder_layers": 1, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "max_position_embeddings": 64,
        "decoder_start_token_id": EOS, "forced_eos_token_id": None}
# encoder-decoder families named like T5's config
T5 = {**UNTIED, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
      "decoder_start_token_id": PAD, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16}
# one stack of T5Gemma (its encoder and its decoder)
T5GEMMA_STACK = {**LLAMA, "head_dim": 8, "sliding_window": 4, "query_pre_attn_scalar": 8}

# family -> (config class, its tiny keyword arguments)
DECODERS: dict[str, tuple[str, dict]] = {
    "gpt2": ("GPT2Config", GPT),
    "gpt_bigcode": ("GPTBigCodeConfig", GPT),
    "openai-gpt": ("OpenAIGPTConfig", GPT),
    "ctrl": ("CTRLConfig", {**GPT, "dff": 64}),
    "gptj": ("GPTJConfig", {**GPT, "rotary_dim": 4, "n_inner": 64}),
    "codegen": ("CodeGenConfig", {**GPT, "rotary_dim": 4, "n_inner": 64, "n_ctx": 64}),
    "gpt_neo": ("GPTNeoConfig", {**UNTIED, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                                 "attention_types": [[["global", "local"], 1]], "window_size": 4,
                                 "max_position_embeddings": 64}),
    "gpt_neox": ("GPTNeoXConfig", LLAMA),
    "gpt_neox_japanese": ("GPTNeoXJapaneseConfig", {**LLAMA, "intermediate_multiple_size": 2}),
    "bloom": ("BloomConfig", {**UNTIED, "hidden_size": 32, "n_layer": 2, "n_head": 4}),
    "opt": ("OPTConfig", {**UNTIED, "hidden_size": 32, "word_embed_proj_dim": 32, "ffn_dim": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}),
    "falcon": ("FalconConfig", {**UNTIED, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "max_position_embeddings": 64}),
    "falcon_new": ("FalconConfig", {**UNTIED, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_kv_heads": 2, "new_decoder_architecture": True,
                                    "max_position_embeddings": 64}),
    "falcon_alibi": ("FalconConfig", {**UNTIED, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "alibi": True, "max_position_embeddings": 64}),
    "mpt": ("MptConfig", {**UNTIED, "d_model": 32, "n_heads": 4, "n_layers": 2, "expansion_ratio": 2,
                          "max_seq_len": 64}),
    "xglm": ("XGLMConfig", {**UNTIED, "d_model": 32, "ffn_dim": 64, "num_layers": 2, "attention_heads": 4,
                            "max_position_embeddings": 64}),
    "biogpt": ("BioGptConfig", {**LLAMA, "num_key_value_heads": 4}),
    "persimmon": ("PersimmonConfig", LLAMA),
    "phi": ("PhiConfig", LLAMA),
    "phi3": ("Phi3Config", LLAMA),  # the shape issue 35 reported
    "phimoe": ("PhimoeConfig", {**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "llama": ("LlamaConfig", LLAMA),
    "mistral": ("MistralConfig", {**LLAMA, "sliding_window": None}),
    "mistral_sliding": ("MistralConfig", {**LLAMA, "sliding_window": 4}),
    "mixtral": ("MixtralConfig", {**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": None}),
    "ministral": ("MinistralConfig", {**LLAMA, "head_dim": 8}),
    "qwen2": ("Qwen2Config", LLAMA),
    "qwen2_moe": ("Qwen2MoeConfig", {**LLAMA, **MOE, "shared_expert_intermediate_size": 32}),
    "qwen3": ("Qwen3Config", {**LLAMA, "head_dim": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", {**LLAMA, **MOE, "head_dim": 8}),
    "gemma": ("GemmaConfig", {**LLAMA, "head_dim": 8}),
    "gemma2": ("Gemma2Config", {**LLAMA, "head_dim": 8, "sliding_window": 4}),
    "gemma3_text": ("Gemma3TextConfig", {**LLAMA, "head_dim": 8, "sliding_window": 4}),
    "stablelm": ("StableLmConfig", LLAMA),
    "starcoder2": ("Starcoder2Config", {**LLAMA, "sliding_window": None}),
    "olmo": ("OlmoConfig", LLAMA),
    "olmo2": ("Olmo2Config", LLAMA),
    "olmo3": ("Olmo3Config", {**LLAMA, "sliding_window": 4}),
    "olmoe": ("OlmoeConfig", {**LLAMA, "num_experts": 4, "num_experts_per_tok": 2}),
    "cohere": ("CohereConfig", {**LLAMA, "logit_scale": 1.0}),
    "cohere2": ("Cohere2Config", {**LLAMA, "logit_scale": 1.0, "sliding_window": 4}),
    "granite": ("GraniteConfig", {**LLAMA, "logits_scaling": 1.0}),
    "granitemoe": ("GraniteMoeConfig", {**LLAMA, "logits_scaling": 1.0, "num_local_experts": 4,
                                        "num_experts_per_tok": 2}),
    "granitemoeshared": ("GraniteMoeSharedConfig", {**LLAMA, "logits_scaling": 1.0, "num_local_experts": 4,
                                                    "num_experts_per_tok": 2, "shared_intermediate_size": 32}),
    "glm": ("GlmConfig", {**LLAMA, "head_dim": 8}),
    "glm4": ("Glm4Config", {**LLAMA, "head_dim": 8}),
    "helium": ("HeliumConfig", {**LLAMA, "head_dim": 8}),
    "nemotron": ("NemotronConfig", LLAMA),
    "jetmoe": ("JetMoeConfig", {**UNTIED, "hidden_size": 32, "num_hidden_layers": 2, "num_key_value_heads": 2,
                                "kv_channels": 8, "intermediate_size": 64, "num_local_experts": 4,
                                "num_experts_per_tok": 2, "max_position_embeddings": 64}),
    "diffllama": ("DiffLlamaConfig", LLAMA),
    "bitnet": ("BitNetConfig", LLAMA),
    "ernie4_5": ("Ernie4_5Config", {**LLAMA, "head_dim": 8}),
    "exaone4": ("Exaone4Config", {**LLAMA, "head_dim": 8, "sliding_window": 4}),
    "seed_oss": ("SeedOssConfig", {**LLAMA, "head_dim": 8}),
    "smollm3": ("SmolLM3Config", LLAMA),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", {**LLAMA, "head_dim": 8}),
    "apertus": ("ApertusConfig", LLAMA),
    "arcee": ("ArceeConfig", LLAMA),
    "vaultgemma": ("VaultGemmaConfig", {**LLAMA, "head_dim": 8, "sliding_window": 4}),
    "llama4_text": ("Llama4TextConfig", {**LLAMA, "head_dim": 8, "intermediate_size_mlp": 64, "num_local_experts": 2,
                                         "interleave_moe_layer_step": 2}),
    "gpt_oss": ("GptOssConfig", {**LLAMA, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "sliding_window": 4}),
    "deepseek_v2": ("DeepseekV2Config", {**LLAMA, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
                                         "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
                                         "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1,
                                         "topk_group": 1}),
    "deepseek_v3": ("DeepseekV3Config", {**LLAMA, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
                                         "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
                                         "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                         "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1,
                                         "topk_group": 1}),
    "minicpm3": ("MiniCPM3Config", {**LLAMA, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 16,
                                    "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
                                    "dim_model_base": 32}),
    "rwkv": ("RwkvConfig", {**UNTIED, "hidden_size": 32, "num_hidden_layers": 2, "attention_hidden_size": 32,
                            "intermediate_size": 64, "context_length": 64}),
    "recurrent_gemma": ("RecurrentGemmaConfig", {**LLAMA, "num_key_value_heads": 1, "lru_width": 32,
                                                 "attention_window_size": 8,
                                                 "block_types": ["recurrent", "attention"]}),
    "jamba": ("JambaConfig", {**LLAMA, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
                              "expert_layer_offset": 1, "num_experts": 2, "mamba_d_state": 4, "mamba_d_conv": 2,
                              "mamba_expand": 2, "mamba_dt_rank": 4, "use_mamba_kernels": False}),
    "lfm2": ("Lfm2Config", {**LLAMA, "layer_types": ["conv", "full_attention"], "block_auto_adjust_ff_dim": False}),
    "qwen3_next": ("Qwen3NextConfig", {**LLAMA, **MOE, "head_dim": 8, "shared_expert_intermediate_size": 32,
                                       "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                                       "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                       "layer_types": ["linear_attention", "full_attention"]}),
    "minimax": ("MiniMaxConfig", {**LLAMA, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "block_size": 4, "layer_types": ["linear_attention", "full_attention"]}),
    "falcon_h1": ("FalconH1Config", {**LLAMA, "head_dim": 8, "mamba_d_ssm": 32, "mamba_n_heads": 4,
                                     "mamba_d_head": 8, "mamba_d_state": 4, "mamba_d_conv": 2,
                                     "mamba_chunk_size": 4}),
    "trocr": ("TrOCRConfig", {**UNTIED, "d_model": 32, "decoder_layers": 2, "decoder_attention_heads": 4,
                              "decoder_ffn_dim": 64, "max_position_embeddings": 64}),
    "big_bird": ("BigBirdConfig", {**BERT, "attention_type": "original_full"}),
    "megatron-bert": ("MegatronBertConfig", BERT),
    "rembert": ("RemBertConfig", {**BERT, "input_embedding_size": 16, "output_embedding_size": 32}),
    "roformer": ("RoFormerConfig", {**BERT, "embedding_size": 32}),
    "xlm-roberta": ("XLMRobertaConfig", BERT),
    "xlm-roberta-xl": ("XLMRobertaXLConfig", BERT),
    "data2vec-text": ("Data2VecTextConfig", BERT),
    "camembert": ("CamembertConfig", BERT),
    "ernie": ("ErnieConfig", BERT),
    "roberta-prelayernorm": ("RobertaPreLayerNormConfig", BERT),
    "bert-generation": ("BertGenerationConfig", BERT),
    "modernbert-decoder": ("ModernBertDecoderConfig", {**BERT, "local_attention": 4, "global_attn_every_n_layers": 2}),
    "cohere2_moe": ("Cohere2MoeConfig", {**LLAMA, **MOE, "logit_scale": 1.0, "sliding_window": 4}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {**LLAMA, "head_dim": 8, "moe_num_experts": 4, "moe_k": 2,
                                            "moe_intermediate_size": 32, "moe_layer_start_index": 1}),
    "glm4_moe": ("Glm4MoeConfig", {**LLAMA, "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1,
                                   "topk_group": 1}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", {**LLAMA, "head_dim": 8, "num_experts": 4, "moe_topk": 2}),
    "flex_olmo": ("FlexOlmoConfig", {**LLAMA, "num_experts": 4, "num_experts_per_tok": 2}),
    "doge": ("DogeConfig", {**LLAMA, "keep_window_size": 8}),
    "nanochat": ("NanoChatConfig", LLAMA),
    "exaone_moe": ("ExaoneMoeConfig", {**LLAMA, **MOE, "head_dim": 8, "sliding_window": 4}),
    "gemma4_text": ("Gemma4TextConfig", {**LLAMA, "head_dim": 8, "global_head_dim": 8, "sliding_window": 4,
                                         "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8}),
    "bert": ("BertConfig", BERT),
    "roberta": ("RobertaConfig", BERT),
    "electra": ("ElectraConfig", {**BERT, "embedding_size": 32}),
    "mamba": ("MambaConfig", {**UNTIED, "hidden_size": 32, "state_size": 4, "num_hidden_layers": 2,
                              "expand": 2, "conv_kernel": 2}),
    "falcon_mamba": ("FalconMambaConfig", {**UNTIED, "hidden_size": 32, "state_size": 4, "num_hidden_layers": 2,
                                           "expand": 2, "conv_kernel": 2}),
}

ENCODER_DECODERS: dict[str, tuple[str, dict]] = {
    "t5": ("T5Config", T5),
    "t5_gated": ("T5Config", {**T5, "feed_forward_proj": "gated-gelu"}),
    "mt5": ("MT5Config", T5),
    "umt5": ("UMT5Config", T5),
    "longt5": ("LongT5Config", {**T5, "local_radius": 2, "global_block_size": 2}),
    "switch_transformers": ("SwitchTransformersConfig", {**T5, "num_experts": 4, "expert_capacity": 8,
                                                         "num_sparse_encoder_layers": 1,
                                                         "num_sparse_decoder_layers": 1}),
    "bart": ("BartConfig", BART),
    "mbart": ("MBartConfig", BART),
    "plbart": ("PLBartConfig", BART),
    "mvp": ("MvpConfig", BART),
    "marian": ("MarianConfig", {**BART, "decoder_start_token_id": PAD}),
    "pegasus": ("PegasusConfig", {**BART, "decoder_start_token_id": PAD}),
    "pegasus_x": ("PegasusXConfig", {**BART, "decoder_start_token_id": PAD, "block_size": 4, "num_global_tokens": 2}),
    "bigbird_pegasus": ("BigBirdPegasusConfig", {**BART, "attention_type": "original_full"}),
    # decoder start tokens under which the random model's greedy output depends on the source
    "blenderbot": ("BlenderbotConfig", {**BART, "decoder_start_token_id": PAD}),
    "blenderbot-small": ("BlenderbotSmallConfig", {**BART, "decoder_start_token_id": PAD}),
    "m2m_100": ("M2M100Config", {**BART, "decoder_start_token_id": BOS}),
    "nllb-moe": ("NllbMoeConfig", {**BART, "num_experts": 4, "expert_capacity": 8, "encoder_sparse_step": 1,
                                   "decoder_sparse_step": 2}),
    "led": ("LEDConfig", {**BART, "max_encoder_position_embeddings": 64, "max_decoder_position_embeddings": 64,
                          "attention_window": 4}),
    "t5gemma": ("T5GemmaConfig", {**UNTIED, "decoder_start_token_id": BOS,
                                  "encoder": T5GEMMA_STACK, "decoder": T5GEMMA_STACK}),
    "encoder-decoder": ("EncoderDecoderConfig", {**UNTIED, "decoder_start_token_id": BOS,
                                                  "encoder": {**BERT, "model_type": "bert", "is_decoder": False},
                                                  "decoder": {**BERT, "model_type": "bert",
                                                              "add_cross_attention": True}}),
    # two encoder layers: 4.57's FSMT cache takes the encoder's layer count
    "fsmt": ("FSMTConfig", {**BART, "encoder_layers": 2, "src_vocab_size": VOCAB, "tgt_vocab_size": VOCAB,
                            "langs": ["en", "de"]}),
    "prophetnet": ("ProphetNetConfig", {**UNTIED, "hidden_size": 32, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
                                        "num_encoder_layers": 2, "num_decoder_layers": 2,
                                        "num_encoder_attention_heads": 4, "num_decoder_attention_heads": 4,
                                        "max_position_embeddings": 64, "num_buckets": 8, "relative_max_distance": 16,
                                        # its learned positions count from the pad id: 0
                                        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                        "decoder_start_token_id": 0}),
}

ARCHITECTURES = {**DECODERS, **ENCODER_DECODERS}


def missing_reason(name: str) -> str | None:
    """Why the installed transformers cannot build the family ``name`` (its config class is not there), or None."""
    import transformers

    config_class = ARCHITECTURES[name][0]
    if getattr(transformers, config_class, None) is None:
        return f"transformers {transformers.__version__} has no {config_class} (the family came later)"
    return None


@functools.cache
def tiny_architecture(name: str, seed: int = 0):
    """The family ``name``'s tiny model in eval mode: random weights, the output head redrawn (peaked, input-dependent
    distributions), the EOS row boosted so that hypotheses finish at varied steps."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    config_class, kwargs = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(seed)
    auto = AutoModelForSeq2SeqLM if name in ENCODER_DECODERS else AutoModelForCausalLM
    model = auto.from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():  # the init's small scale makes the output ignore the input (or the source)
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5)
        tables = [model.get_input_embeddings().weight]
        decoder = model.get_decoder() if model.config.is_encoder_decoder else None
        if hasattr(decoder, "get_input_embeddings"):  # not FSMT's (its encoder's are another vocabulary's)
            tables.append(decoder.get_input_embeddings().weight)
        # embedded tokens of unit scale (as loud as sinusoidal positions), also where the model scales them by
        # sqrt(d_model) (scale_embedding); a table shared by encoder and decoder is drawn once
        scaled = getattr(model.config, "scale_embedding", False)
        for index, table in enumerate(tables):
            if all(table is not other for other in tables[:index]):
                table.normal_(0.0, table.shape[1] ** -0.5 if scaled else 1.0)
        output = model.get_output_embeddings()
        if output.weight is model.get_input_embeddings().weight:  # T5 ties them whatever its config says (5.x)
            output.weight = torch.nn.Parameter(torch.empty_like(output.weight))
        head = output.weight
        head.normal_(0.0, 0.8)
        head[config.eos_token_id] *= EOS_BOOST
    return model


def padded_batch(model, rows: int = 3, length: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[B, S]`` (none special) and a mask with padding of mixed lengths, none in the first row: left
    padding for a decoder-only model, right padding for an encoder-decoder model."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_PLAIN, VOCAB, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(1, rows):
        cut = min(row * 2 - 1, length - 2)  # 1, 3, ... padded positions
        padding = slice(length - cut, None) if model.config.is_encoder_decoder else slice(0, cut)
        ids[row, padding], mask[row, padding] = model.config.pad_token_id, 0
    return ids, mask
