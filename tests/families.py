"""Tiny random-weight models of the Hugging Face families the base-LM adapter is tested with,
built locally from their configs, and a BPE tokenizer shaped as each family's own.

Each entry says how the family's tokenizer opens a text (``bos``: the token prepended to every
sequence, or None) and where the last block's FFN input can be captured independently of the
adapter's path (``ffn_input``: a norm's output, or the FFN's input where no norm feeds it).
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
