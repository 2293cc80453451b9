"""Progress of the report's predict passes (``predict_tokens``): plain lines with tokens,
tokens/s and ETA when output is redirected, naming a GNN-LM data module's evaluation k."""
from __future__ import annotations

import logging

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from gnnlm.pipeline.scoring import predict_tokens


class Positions(pl.LightningDataModule):
    """Positions 0 … n-1 of a split in batches of 5; ``eval_k`` as a GNN-LM data module has."""

    def __init__(self, n: int, eval_k=None):
        super().__init__()
        self.n, self.eval_k, self.predict_split = n, eval_k, "valid"

    def connect(self, predict_split=None):
        self.predict_split = predict_split or self.predict_split

    def predict_dataloader(self):
        return DataLoader(torch.arange(self.n), batch_size=5)


class Uniform(pl.LightningModule):
    """log p(target) = log(1/10) for every position."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def predict_step(self, batch, batch_idx):
        return {"positions": batch, "logprob": torch.full((len(batch),), -np.log(10.0))}


class Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_predict_pass_prints_tokens_rate_and_eta_per_batch_when_redirected(monkeypatch,
                                                                             capsys):
    monkeypatch.delenv("GNNLM_QUIET", raising=False)
    monkeypatch.setenv("GNNLM_PROGRESS_SECONDS", "0")     # a line after every batch
    said = Said()
    for package in ("pytorch_lightning", "lightning_fabric"):   # where Lightning's lines go
        logging.getLogger(package).addHandler(said)
    try:
        scores = predict_tokens(Uniform(), Positions(12, eval_k=16), "valid", 12)
    finally:
        for package in ("pytorch_lightning", "lightning_fabric"):
            logging.getLogger(package).removeHandler(said)
    assert np.allclose(scores["logprob"], -np.log(10.0))
    captured = capsys.readouterr()
    lines = [line.strip() for line in captured.err.splitlines() if "score Uniform" in line]
    assert [line.split(": ")[1].split(",")[0] for line in lines] == [
        "5/12 tokens", "10/12 tokens", "12/12 tokens"]
    assert all(line.startswith("score Uniform valid at k = 16: ") and " token/s, " in line
               and ", ETA " in line for line in lines)
    # Lightning's device lines, which every Trainer says, are not repeated per pass
    assert not [m for m in said.messages if m.startswith("GPU available")]


def test_a_short_pass_prints_one_line_with_its_totals(monkeypatch, capsys):
    monkeypatch.delenv("GNNLM_QUIET", raising=False)
    monkeypatch.setenv("GNNLM_PROGRESS_SECONDS", "1000")
    predict_tokens(Uniform(), Positions(12), "test", 12)
    lines = [line.strip() for line in capsys.readouterr().err.splitlines() if "score" in line]
    assert len(lines) == 1 and lines[0].startswith("score Uniform test: 12/12 tokens, ")
