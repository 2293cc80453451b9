"""gnnlm.lit.gates: a SPALM module's predict output carries each scored token's gate, its mean
over the d dimensions, beside the token's log-probability; training and evaluation read the NLL
alone (the three SPALM heads through their forward passes are in tests/lit/test_heads.py)."""
from __future__ import annotations

from typing import Optional

import torch

from gnnlm.lit.gates import PerTokenGate


class FixedGate(PerTokenGate):
    """``gated_nll`` of given tensors, as a SPALM head computes them for a batch."""

    def __init__(self, nll, mask, positions, gate: Optional[torch.Tensor]):
        self.out = (nll, mask, positions, gate)
        self.stages: list[str] = []

    def gated_nll(self, batch, stage: str):
        self.stages.append(stage)
        return self.out


NLL = torch.tensor([0.5, 1.0, 2.0, 4.0])
MASK = torch.tensor([1.0, 0.0, 1.0, 1.0])
POSITIONS = torch.tensor([10, 11, 12, 13])
GATE = torch.tensor([[0.0, 1.0], [0.5, 0.5], [0.25, 0.75], [1.0, 1.0]], dtype=torch.bfloat16)


def test_predict_gives_each_scored_token_s_mean_gate_in_float32():
    module = FixedGate(NLL, MASK, POSITIONS, GATE)
    out = module.predict_step({}, 0)
    assert module.stages == ["predict"]
    assert set(out) == {"positions", "logprob", "gate"}
    assert out["positions"].tolist() == [10, 12, 13]           # the unscored token left out
    assert out["logprob"].tolist() == [-0.5, -2.0, -4.0]
    assert out["gate"].dtype == torch.float32
    assert out["gate"].tolist() == [0.5, 0.5, 1.0]


def test_a_module_without_long_term_memory_predicts_no_gate():
    out = FixedGate(NLL, MASK, POSITIONS, None).predict_step({}, 0)
    assert set(out) == {"positions", "logprob"}


def test_training_and_evaluation_read_the_nll_without_the_gate():
    module = FixedGate(NLL, MASK, POSITIONS, GATE)
    nll, mask, positions = module.token_nll({}, "val")
    assert module.stages == ["val"]
    assert nll is NLL and mask is MASK and positions is POSITIONS
