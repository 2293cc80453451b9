"""Tiny random-weight models of the Hugging Face families the base-LM adapter is tested with,
built locally from their configs, and a BPE tokenizer shaped as each family's own.

Each entry says how the family's tokenizer opens a text (``bos``: the token prepended to every
sequence, or None) and where the last block's FFN input can be captured independently of the
adapter's path (``ffn_input``: the output of the norm that feeds it; where the FFN reads the
residual stream instead, as in OLMo 2's post-norm blocks, ``ffn_residual``: the block's input
plus that norm's output). ``pipeline`` marks the families the end-to-end test runs through the
pipeline (kNN-LM on a WikiText-2 slice, generation); the others are checked at the adapter
(features, logits, log-probabilities and tokenizer).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

SPECIALS = ["<|endoftext|>", "<s>", "</s>", "<bos>", "<eos>", "<pad>"]


@dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[int, dict], Any]   # (vocab size, special ids) -> model
    bos: Optional[str]                  # prepended to every sequence by the tokenizer
    eos: str
    ffn_input: str                      # module whose output is the last FFN's input
    pad_vocab: int = 0                  # extra output rows beyond the tokenizer's (Pythia, ...)
    ffn_residual: bool = False          # the FFN reads block input + ffn_input's output
    pipeline: bool = True               # run end to end through the pipeline


def _small(**extra) -> dict:
    return {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64, "max_position_embeddings": 256, **extra}


def _gpt2(vocab, ids):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=256, n_embd=32, n_layer=2,
                                      n_head=4, bos_token_id=ids["<|endoftext|>"],
                                      eos_token_id=ids["<|endoftext|>"]))


def _neox(vocab, ids):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab, **_small(),
                                            bos_token_id=ids["<|endoftext|>"],
                                            eos_token_id=ids["<|endoftext|>"]))


def _llama_like(config_name: str, model_name: str, bos: str, eos: str, **extra):
    def build(vocab, ids):
        import transformers
        config = getattr(transformers, config_name)(
            vocab_size=vocab, **_small(num_key_value_heads=2, **extra),
            bos_token_id=ids[bos], eos_token_id=ids[eos], pad_token_id=ids["<pad>"])
        return getattr(transformers, model_name)(config)
    return build


def _bloom(vocab, ids):
    """ALiBi positions: the config has no context length (features.context gives it)."""
    from transformers import BloomConfig, BloomForCausalLM
    return BloomForCausalLM(BloomConfig(vocab_size=vocab, hidden_size=32, n_layer=2, n_head=4,
                                        bos_token_id=ids["<|endoftext|>"],
                                        eos_token_id=ids["<|endoftext|>"],
                                        pad_token_id=ids["<pad>"]))


def _mpt(vocab, ids):
    """ALiBi positions up to ``max_seq_len``."""
    from transformers import MptConfig, MptForCausalLM
    return MptForCausalLM(MptConfig(vocab_size=vocab, d_model=32, n_heads=4, n_layers=2,
                                    expansion_ratio=2, max_seq_len=256,
                                    bos_token_id=ids["<|endoftext|>"],
                                    eos_token_id=ids["<|endoftext|>"]))


def _opt(vocab, ids):
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, ffn_dim=64,
                                    max_position_embeddings=256, word_embed_proj_dim=32,
                                    bos_token_id=ids["</s>"], eos_token_id=ids["</s>"],
                                    pad_token_id=ids["<pad>"]))


def _phi(vocab, ids):
    from transformers import PhiConfig, PhiForCausalLM
    return PhiForCausalLM(PhiConfig(vocab_size=vocab, **_small(),
                                    bos_token_id=ids["<|endoftext|>"],
                                    eos_token_id=ids["<|endoftext|>"]))


FAMILIES = {f.name: f for f in [
    Family("gpt2", _gpt2, None, "<|endoftext|>", "transformer.h.-1.ln_2"),
    Family("gpt_neox", _neox, None, "<|endoftext|>", "gpt_neox.layers.-1.post_attention_layernorm",
           pad_vocab=29),
    Family("llama", _llama_like("LlamaConfig", "LlamaForCausalLM", "<s>", "</s>"), "<s>", "</s>",
           "model.layers.-1.post_attention_layernorm"),
    Family("mistral", _llama_like("MistralConfig", "MistralForCausalLM", "<s>", "</s>",
                                  sliding_window=64),
           "<s>", "</s>", "model.layers.-1.post_attention_layernorm"),
    Family("qwen2", _llama_like("Qwen2Config", "Qwen2ForCausalLM", "<|endoftext|>",
                                "<|endoftext|>"),
           None, "<|endoftext|>", "model.layers.-1.post_attention_layernorm", pad_vocab=13),
    Family("opt", _opt, "</s>", "</s>", "model.decoder.layers.-1.final_layer_norm"),
    Family("phi", _phi, None, "<|endoftext|>", "model.layers.-1.input_layernorm"),
    Family("gemma", _llama_like("GemmaConfig", "GemmaForCausalLM", "<bos>", "<eos>", head_dim=8),
           "<bos>", "<eos>", "model.layers.-1.post_attention_layernorm"),
    Family("gemma2", _llama_like("Gemma2Config", "Gemma2ForCausalLM", "<bos>", "<eos>",
                                 head_dim=8, final_logit_softcapping=3.0, sliding_window=64),
           "<bos>", "<eos>", "model.layers.-1.pre_feedforward_layernorm"),
    # ALiBi positions: Bloom's of any length, MPT's up to max_seq_len
    Family("bloom", _bloom, None, "<|endoftext|>", "transformer.h.-1.post_attention_layernorm"),
    Family("mpt", _mpt, None, "<|endoftext|>", "transformer.blocks.-1.norm_2"),
    # scaled logits (Command R's and Granite 3.0's own scales): Cohere multiplies by
    # logit_scale, Granite divides by logits_scaling; Cohere's block is parallel
    Family("cohere", _llama_like("CohereConfig", "CohereForCausalLM", "<bos>", "<eos>",
                                 logit_scale=0.0625),
           "<bos>", "<eos>", "model.layers.-1.input_layernorm"),
    Family("granite", _llama_like("GraniteConfig", "GraniteForCausalLM", "<|endoftext|>",
                                  "<|endoftext|>", logits_scaling=8.0, embedding_multiplier=12.0,
                                  residual_multiplier=0.22, attention_multiplier=0.125),
           None, "<|endoftext|>", "model.layers.-1.post_attention_layernorm"),
    # checked at the adapter only
    Family("mixtral", _llama_like("MixtralConfig", "MixtralForCausalLM", "<s>", "</s>",
                                  num_local_experts=4, num_experts_per_tok=2),
           "<s>", "</s>", "model.layers.-1.post_attention_layernorm", pipeline=False),
    Family("qwen3", _llama_like("Qwen3Config", "Qwen3ForCausalLM", "<|endoftext|>",
                                "<|endoftext|>", head_dim=8),
           None, "<|endoftext|>", "model.layers.-1.post_attention_layernorm", pipeline=False),
    Family("gemma3_text", _llama_like("Gemma3TextConfig", "Gemma3ForCausalLM", "<bos>", "<eos>",
                                      head_dim=8, sliding_window=64),
           "<bos>", "<eos>", "model.layers.-1.pre_feedforward_layernorm", pipeline=False),
    Family("phi3", _llama_like("Phi3Config", "Phi3ForCausalLM", "<|endoftext|>",
                               "<|endoftext|>"),
           None, "<|endoftext|>", "model.layers.-1.post_attention_layernorm", pipeline=False),
    Family("olmo", _llama_like("OlmoConfig", "OlmoForCausalLM", "<|endoftext|>",
                               "<|endoftext|>"),
           None, "<|endoftext|>", "model.layers.-1.post_attention_layernorm", pipeline=False),
    Family("olmo2", _llama_like("Olmo2Config", "Olmo2ForCausalLM", "<|endoftext|>",
                                "<|endoftext|>"),
           None, "<|endoftext|>", "model.layers.-1.post_attention_layernorm", ffn_residual=True,
           pipeline=False),
    Family("stablelm", _llama_like("StableLmConfig", "StableLmForCausalLM", "<|endoftext|>",
                                   "<|endoftext|>"),
           None, "<|endoftext|>", "model.layers.-1.post_attention_layernorm", pipeline=False),
]}


def train_bpe(text: str, vocab_size: int = 512):
    """A byte-level BPE (the ``tokenizers`` backend) with every family's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(text.splitlines(keepends=True), trainer)
    return backend


def family_tokenizer(backend, family: Family):
    """The BPE with the family's post-processor: BOS before every text where the family has one."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    own = Tokenizer.from_str(backend.to_str())
    if family.bos is not None:
        own.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B",
            special_tokens=[(family.bos, own.token_to_id(family.bos))])
    return PreTrainedTokenizerFast(tokenizer_object=own, bos_token=family.bos or family.eos,
                                   eos_token=family.eos, pad_token="<pad>")


def build_family(family: Family, backend, seed: int = 0):
    """``(model, tokenizer)``: random weights (seeded), the vocabulary padded where the family
    pads it."""
    tokenizer = family_tokenizer(backend, family)
    ids = {t: backend.token_to_id(t) for t in SPECIALS}
    torch.manual_seed(seed)
    model = family.build(backend.get_vocab_size() + family.pad_vocab, ids).eval()
    return model, tokenizer


def save_family(family: Family, backend, folder: Path, seed: int = 0) -> Path:
    """A model folder as the Hub has them: safetensors weights, config and its own tokenizer."""
    model, tokenizer = build_family(family, backend, seed)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
