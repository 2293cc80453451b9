"""A built work directory's parts, each loaded when first needed: the report's rows (parsed once,
``gnnlm.inference.served``), the tokenizer and the BOS rule, the base LM, the retrieval over
each key's train keys, the trained heads with their data modules (``gnnlm.inference.heads``)
and GNN-LM's window states.

``LMParts`` is what scoring, decoding and generation read (``gnnlm.inference.scoring``,
``decoding``, ``generation``); ``gnnlm.inference.model.TrainedLM`` puts them together behind
``gnnlm.load``. Reading never writes into the work directory and takes no lock, so a running
pipeline is not disturbed.
"""
from __future__ import annotations

import warnings
from functools import cached_property
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from gnnlm.gnn.window_states import WindowStates
from gnnlm.inference.heads import GNNHead, Head, load_head
from gnnlm.inference.served import NotServed, RowSettings, Served, ServedRow
from gnnlm.models import BaseLM, hf_options, is_hf, load_base_lm
from gnnlm.models.base import LogitTransform
from gnnlm.retrieval.features import load_output_embedding
from gnnlm.retrieval.lookup import Lookup
from gnnlm.text.bos import BosRule
from gnnlm.text.tokens import TokenStore
from gnnlm.workdir import rows
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.refusals import ArtifactError

Text = Union[str, list[int], np.ndarray]


class LMParts:
    """A work directory's parts (see the module docstring); ``TrainedLM`` uses them."""

    def __init__(self, workdir: Union[str, Path], report: Optional[str] = None):
        self.workdir = Workdir(workdir)
        self.served = Served(self.workdir, report)
        try:
            self.store = TokenStore.open(self.workdir.tokens)
            self.features = self.workdir.features_manifest("train")
        except ArtifactError as err:
            raise NotServed(f"{err} ({self.workdir.root} is not a whole work directory: run "
                            f"`gnnlm pipeline` on it.)") from None
        # the windows of the datastore (a split shorter than them was read in one window)
        config = self.features["config"]
        self.context, self.stride = int(config["context"]), int(config["stride"])
        # the BOS rule the features were built under, applied by every route (gnnlm.text.bos)
        self.bos = BosRule.recorded(self.features, self.store.manifest)
        self.bos_id, self.bos_each_window = self.bos.id, self.bos.each_window
        self.vocab_size = int(self.features["vocab_size"])
        self.logit_transform = LogitTransform.of(self.features["base_lm"])
        self._lookups: dict[tuple[str, str], Lookup] = {}
        self._heads: dict[str, Head] = {}
        self._warned_slide = self._warned_cache = False

    # -- what it serves ---------------------------------------------------------------------
    @property
    def rows(self) -> list[str]:
        """The rows of the work directory's report, in table order."""
        return list(self.served.rows)

    def settings(self, row: Union[str, ServedRow], **overrides: Optional[float]) -> RowSettings:
        """A row's settings: what the pipeline fitted on valid, with ``overrides``
        (``knn_k``, ``knn_temperature``, ``lam``, ``gnn_k``), checked against what is stored."""
        served = self.served.row(row) if isinstance(row, str) else row
        reads_gnn = served.head == rows.GNN
        settings = served.fitted(self.gnn().graph.k if reads_gnn else None)
        settings = settings.override(**overrides)
        stored = {"knn_k": lambda: self.lookup(*served.retrieval[:2]).K,
                  "gnn_k": lambda: self.lookup(self.gnn().trained.key,
                                               self.gnn().trained.metric).K}
        for name, K in stored.items():
            value = getattr(settings, name)
            if value is not None and value > K():
                raise NotServed(f"{name} = {value} but {K()} neighbours are stored per "
                                f"position: choose {name} <= {K()}.")
        return settings

    def primary_retrieval(self) -> tuple[str, str]:
        """The key and similarity of the report's kNN-LM row (GNN-LM's when it has none)."""
        for name in self.rows:
            served = self.served.row(name)
            if served.row.is_knn_lm:
                return served.retrieval[:2]
        gnn = self.gnn().trained
        return gnn.key, gnn.metric

    # -- its parts, each loaded when first needed ---------------------------------------------
    @cached_property
    def base_lm_spec(self) -> str:
        location = self.features["base_lm"].get("location")
        if not location:
            raise NotServed(f"The features in {self.workdir.features('train')} do not record "
                            f"where their base LM is.")
        # hf:<name> as given; a checkpoint or a GGUF file relative to the work directory
        return location if location.startswith("hf:") else str(self.workdir.resolve(location))

    @cached_property
    def base_lm_options(self) -> Optional[dict]:
        return hf_options(self.features["base_lm"]) if is_hf(self.base_lm_spec) else None

    @cached_property
    def base_lm(self) -> BaseLM:
        """The frozen base LM, checked to be the one the datastore was built with."""
        model = load_base_lm(self.base_lm_spec, self.base_lm_options)
        made = self.features["base_lm"]["fingerprint"]
        if model.fingerprint() != made:
            raise NotServed(f"The base LM at {self.base_lm_spec} (weights {model.fingerprint()}) "
                            f"is not the one the datastore of {self.workdir.root} was built "
                            f"with ({made}).")
        return model

    @cached_property
    def output_embedding(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The base LM's output embedding (W [V, d], b [V]; zeros without a bias), float32, as
        the heads on its features read it."""
        weight, bias = load_output_embedding(self.workdir)
        return weight.float(), (torch.zeros(weight.shape[0]) if bias is None else bias.float())

    def lookup(self, key: str, metric: str) -> Lookup:
        """Retrieval over the train keys of ``key`` under ``metric``, as the pipeline searched."""
        if (key, metric) not in self._lookups:
            self._lookups[(key, metric)] = Lookup(self.workdir, key, metric)
        return self._lookups[(key, metric)]

    def head(self, row: ServedRow) -> Head:
        """The trained head a row reads (``gnn+knn``: GNN-LM; ``<head>+base``: the head)."""
        folder = row.folder
        if folder not in self._heads:
            self._heads[folder] = load_head(self.workdir, folder, self.base_lm,
                                            self.base_lm_spec, self.base_lm_options)
        return self._heads[folder]

    def gnn(self) -> GNNHead:
        """The trained GNN-LM."""
        gnn = self.head(self.served.row(rows.GNN))
        assert isinstance(gnn, GNNHead)
        return gnn

    def window_states(self) -> WindowStates:
        """GNN-LM's window-state table, one for every k (a window's states do not depend on how
        many windows a token reads), shared by scoring and decoding: each retrieved window
        computed once, then kept."""
        return self.gnn().window_states()

    # -- text -----------------------------------------------------------------------------
    def encode(self, text: Text, prompt: bool = False) -> np.ndarray:
        """Token ids of ``text`` (ids are taken as they are), as the corpus was tokenized: every
        line ends with the tokenizer's end of line (``<eos>``, a newline). A prompt is continued
        where it stops: its last line stays open unless the text ends with a newline. Ids are
        the text's tokens in every route, BOS being put before them (``prompt_ids``)."""
        if isinstance(text, str):
            tokenizer = self.store.tokenizer
            ids = tokenizer.encode_prompt(text) if prompt else tokenizer.encode(text)
        else:
            ids = np.asarray(text, dtype=np.int64).reshape(-1)
            if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
                raise NotServed(f"token ids must lie in [0, {self.vocab_size}) (got "
                                f"{ids.min()} … {ids.max()}).")
        if len(ids) == 0:
            raise NotServed("the text is empty: give at least one token of text.")
        return np.asarray(ids, dtype=np.int64)

    def prompt_ids(self, prompt: Text) -> list[int]:
        """The stream a prompt is read as under the work directory's BOS rule: BOS, then its
        tokens (``encode(prompt, prompt=True)``). What Hugging Face's ``generate`` must be given
        as ``input_ids`` (``torch.tensor([lm.prompt_ids(prompt)])``) to read what
        ``next_token_logprobs`` and ``generate`` read; its tokens after BOS are the ids to give
        those (``prompt_ids(prompt)[1:]``)."""
        return [int(i) for i in self.bos.stream(self.encode(prompt, prompt=True))]

    def decode(self, ids) -> str:
        return self.store.tokenizer.decode([int(i) for i in ids])

    def unk_share(self, ids: np.ndarray) -> Optional[float]:
        """The share of ``ids`` that are the tokenizer's unknown token (None: it has none)."""
        unk = getattr(self.store.tokenizer, "unk_id", None)
        return None if unk is None else float(np.mean(ids == unk))

    def note_slide(self, length: int) -> None:
        """Say once that a text outgrows the base LM's window, and how it slides."""
        if length > self.context and not self._warned_slide:
            self._warned_slide = True
            warnings.warn(f"the text ({length} tokens with BOS) is longer than the base LM's "
                          f"window of {self.context}: windows slide by {self.stride} tokens as "
                          f"in scoring, so each token reads at least "
                          f"{self.context - self.stride} tokens of left context.", stacklevel=3)

    def note_cache_rounding(self) -> None:
        """Say once that a base LM in half precision decodes through its key/value cache to its
        own rounding, not to a window read from scratch's."""
        dtype = self.features["base_lm"].get("dtype", "float32")
        if dtype != "float32" and not self._warned_cache:
            self._warned_cache = True
            warnings.warn(f"the base LM computes in {dtype}: generation reads it through its "
                          f"key/value cache, whose sums round otherwise than a window read from "
                          f"scratch (score, next_token_logprobs): SmolLM2-135M in bfloat16 "
                          f"differed by up to 0.15 nats at a step. generate(..., "
                          f"incremental=False) reads every prefix from scratch.", stacklevel=4)
