"""LightningModule that trains the built-in GPT base LM (AdamW, warmup + cosine, clipping).

The nn.Module (``gnnlm.models.gpt.GPT``) holds the network; this module only wires it to the
training loop. Evaluation batches carry a score mask (sliding windows or memory segments), so
``val/ppl`` and ``test/ppl`` are token-weighted over the whole split under a stated protocol.

With ``memory_length > 0`` (Transformer-XL short-term memory, Dai et al. 2019) the data module
serves contiguous segments per stream, and the memory of one batch is passed to the next
(``gnnlm.lit.memory``).

The checkpoint records ``vocab_fingerprint``, the fingerprint of the vocabulary the model is
trained on (the data module's ordered token list): a token id is only a row of the embedding,
so whoever reads the model with other tokens (the pipeline, a later fit or test) can tell that
the ids would mean other words, which equal vocabulary sizes do not show. ``gnnlm fit`` links
it from the data module's tokens; weights restored from a checkpoint are refused when theirs
differs.
"""
from __future__ import annotations

from typing import Optional

import torch

from gnnlm.lit.base import TokenLevelModule
from gnnlm.lit.memory import SegmentMemory
from gnnlm.lit.settings import OptimConfig
from gnnlm.models.gpt import GPT, GPTConfig
from gnnlm.utils.metrics import target_nll


class LanguageModel(SegmentMemory, TokenLevelModule):
    def __init__(self, vocab_size: int = 0, context_length: int = 256, n_layer: int = 4,
                 n_head: int = 4, d_model: int = 256, d_ff: int = 1024, dropout: float = 0.1,
                 tie_embeddings: bool = True, memory_length: int = 0,
                 optim: OptimConfig = OptimConfig(lr=1e-3, weight_decay=0.1),
                 vocab_fingerprint: Optional[str] = None):
        """The built-in GPT base LM.

        Args:
            vocab_size: the tokens' vocabulary size (linked from the data module).
            context_length: the most positions one window reads.
            n_layer: transformer blocks.
            n_head: attention heads per block.
            d_model: the hidden size d.
            d_ff: the feed-forward inner size.
            dropout: dropout probability in training.
            tie_embeddings: one matrix for the input and output embeddings.
            memory_length: Transformer-XL memory M, cached states per layer (0: none).
            optim: AdamW and its warmup + cosine schedule.
            vocab_fingerprint: the fingerprint of the vocabulary the ids mean (linked from the
                data module's tokens; a checkpoint's is restored with it).
        """
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(
            vocab_size=vocab_size, context_length=context_length, n_layer=n_layer, n_head=n_head,
            d_model=d_model, d_ff=d_ff, dropout=dropout, tie_embeddings=tie_embeddings,
            memory_length=memory_length))
        self.memory_length = memory_length
        self.optim = OptimConfig.of(optim)
        self.vocab_fingerprint = vocab_fingerprint

    def token_nll(self, batch: dict, stage: str):
        """NLL of every position; Transformer-XL memory is carried between batches of a stage."""
        memory = self.memory_for(stage, batch["input"].shape[0])
        feats = self.model(batch["input"], memory=memory)
        self.keep_memory(stage, feats.memory)
        logits = self.model.logits(feats.final)                           # [B, T, V]
        nll = target_nll(logits.flatten(0, 1), batch["target"].flatten())
        mask = batch.get("mask", torch.ones_like(batch["target"], dtype=torch.float))
        positions = batch.get("positions")
        return nll, mask.flatten().float(), None if positions is None else positions.flatten()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Weights restored from a checkpoint were trained on its recorded vocabulary."""
        saved = (checkpoint.get("hyper_parameters") or {}).get("vocab_fingerprint")
        self.check_vocabulary(saved, "the checkpoint's weights")

    def check_vocabulary(self, fingerprint: Optional[str], source: str) -> None:
        """Refuse ids of another vocabulary than the model's (``source`` names where
        ``fingerprint`` comes from); a model that records none takes this one."""
        recorded = self.vocab_fingerprint
        if fingerprint is None or recorded == fingerprint:
            return
        if recorded is None:  # the checkpoint saves the hyper-parameter
            self.vocab_fingerprint = self.hparams["vocab_fingerprint"] = fingerprint
            return
        raise ValueError(f"The model's vocabulary (fingerprint {recorded}) is not the one of "
                         f"{source} ({fingerprint}): token ids would mean different words. "
                         f"Train and evaluate a model with the corpus and tokenizer it was "
                         f"trained on.")
