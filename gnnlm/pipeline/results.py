"""What the pipeline's stages hand the report: ``Results``, filled in as the stages finish.

Scores are per-token log p(target) by row (``gnnlm.workdir.rows``) and split; everything else
is what a stage recorded (its artifact's manifest), read once by the stage that built it, so the
report reads no manifest again.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from gnnlm.retrieval.sanity import Sanity


@dataclass
class KeyRetrieval:
    """One key type's retrieval stages: the index's manifest (None when nothing reads an index
    of this key) and what it is for (``stages.index_use``), the neighbours' manifests by split
    (train only for the primary key), the kNN caches' manifests by evaluation split."""
    index: Optional[dict]
    neighbors: dict[str, dict]
    knn_caches: dict[str, dict]
    index_use: Optional[str] = None


@dataclass
class Results:
    """The pipeline's results, as the report reads them.

    ``base_lm``: the frozen LM's identity (name, weights' fingerprint, sizes);
    ``base_lm_manifest``: its trained model's manifest (empty when a checkpoint was given);
    ``features``: the features' manifests by split; ``scores[row][split]``: per-token log
    p(target) (interpolations: test only); ``hparams[row]``: what an interpolation fitted on
    valid; ``heads[row]``: a trained head's manifest; ``pq``: the PQ codes' manifest when this
    run's GNN-LM reads them; ``knn_recall``: R(c_t), the primary key's neighbours per test
    token whose value is the target (Meng et al. 2022 eq. 6); ``data_checks``:
    ``gnnlm.pipeline.data_checks.measure``'s shares; ``ablations``: the ablation stage's
    result, if it ran; ``environment``: the machine and versions the report is written on
    (``gnnlm.utils.environment.describe``); ``retrieval_sanity[key]``: how much the key's
    retrieval discriminates at its kNN row's fitted point (``gnnlm.retrieval.sanity``);
    ``words[split]``: for a subword tokenizer, the words of the text valid's and test's scored
    tokens cover (``gnnlm.text.words``; empty otherwise); ``fitted_on[row]``: the valid tokens an
    interpolation's ``valid_ppl`` is over."""
    name: str
    dataset: str
    level: str
    base_lm: dict
    base_lm_manifest: dict
    features: dict[str, dict]
    scores: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    hparams: dict[str, dict] = field(default_factory=dict)
    retrieval: dict[str, KeyRetrieval] = field(default_factory=dict)
    heads: dict[str, dict] = field(default_factory=dict)
    pq: Optional[dict] = None
    knn_recall: Optional[np.ndarray] = None
    data_checks: dict = field(default_factory=dict)
    ablations: Optional[dict] = None
    environment: Optional[dict] = None
    retrieval_sanity: dict[str, Sanity] = field(default_factory=dict)
    words: dict[str, int] = field(default_factory=dict)
    fitted_on: dict[str, int] = field(default_factory=dict)

    @property
    def test_tokens(self) -> int:
        """The test split's positions: every row scores each of them once."""
        return int(self.features["test"]["n"])

    def add_interpolation(self, name: str, test_logprob: np.ndarray, hparams: dict,
                          valid_tokens: Optional[int] = None) -> None:
        """A row fitted on valid: its test scores, what it fitted, and over how many valid
        tokens its fitted ``valid_ppl`` is (None: not known, so not converted per word)."""
        self.scores[name] = {"test": test_logprob}
        self.hparams[name] = hparams
        if valid_tokens is not None:
            self.fitted_on[name] = int(valid_tokens)
