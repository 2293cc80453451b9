"""The base of the data modules that read ``gnnlm pipeline``'s work directory (features,
neighbours, PQ codes, tokens) rather than a corpus: the work directory, the one error for
artifacts that are not there yet, the sizes and base LM the CLI links into the model, the base
LM's output embedding, and the valid/test/predict loaders.

What is known only when the data module runs, not when it is configured, comes in through one
method, ``connect`` (as litgpt's data modules take their tokenizer): the split ``predict``
scores (``gnnlm.pipeline.scoring`` scores valid and test in turn with one data module), a text
to serve in place of a split (``datamodules.splits``: ``gnnlm score`` reads a text through the
loaders that scored the report) and, for GNN-LM's graphs, the evaluation k.

Layer: ``datamodules`` sits between ``gnnlm.lit`` and ``gnnlm.pipeline``
(``datamodules/__init__.py``): imports go down to the library, never to the pipeline.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from datamodules.splits import TEXT, SplitArrays, TextArrays
from gnnlm.models.base import LogitTransform
from gnnlm.models.encode import stream_tensor
from gnnlm.retrieval.features import load_output_embedding
from gnnlm.utils.devices import pin_memory
from gnnlm.utils.stopping import worker_init
from gnnlm.workdir.layout import SPLITS, Workdir
from gnnlm.workdir.manifests import is_complete
from gnnlm.workdir.refusals import ArtifactError


def loader_options() -> dict[str, Any]:
    """What every loader of these data modules is built with: batches pinned when there is a GPU
    to copy them to, and workers that a stop signal ends quietly whoever sent it
    (``gnnlm.utils.stopping.worker_init``)."""
    return {"pin_memory": pin_memory(), "worker_init_fn": worker_init}


class WorkdirDataModule(pl.LightningDataModule):
    """Subclasses check their own arguments, call ``super().__init__(workdir, predict_split)``
    and ``save_hyperparameters()``, read their manifests inside ``reading_artifacts(...)``, and
    implement ``eval_dataloader(split)`` (and ``train_dataloader``)."""

    def __init__(self, workdir: str, predict_split: str):
        super().__init__()
        self.workdir = Workdir(workdir)
        self.arrays = SplitArrays(self.workdir)  # what the loaders read of each split
        self.predict_split = ""
        self.connect(predict_split=predict_split)

    @classmethod
    def check_arguments(cls, **args: Any) -> None:
        """Refuse an argument that is wrong whatever the work directory holds (``args``: some
        of ``__init__``'s, by name). Each message starts with the argument's name
        (``k_schedule must ...``): ``__init__`` raises it as it is, and ``gnnlm pipeline``,
        which runs this on every head's parsed config when its config loads
        (``gnnlm.pipeline.head_checks.check_head``), names the file and the key. Subclasses
        add the checks of their own arguments."""
        split = args.get("predict_split")
        if split is not None and split not in SPLITS:
            raise ValueError(f"predict_split must be one of {', '.join(SPLITS)} "
                             f"(got {split!r}).")

    def connect(self, predict_split: Optional[str] = None,
                text: Optional[TextArrays] = None) -> None:
        """Settings known only at run time (None: unchanged): ``predict_split``, the split
        ``predict`` scores; ``text``, a text's arrays, which ``predict`` then scores in place of
        a split (under the split name ``TEXT``), in this process."""
        if text is not None:
            self.arrays.text = text
            predict_split = TEXT
        if predict_split is not None:
            if predict_split not in SPLITS and not (predict_split == TEXT
                                                    and self.arrays.text is not None):
                raise ValueError(f"predict_split must be one of {', '.join(SPLITS)} "
                                 f"(got {predict_split!r}).")
            self.predict_split = predict_split

    def workers(self, split: str) -> int:
        """DataLoader worker processes for ``split``: a text, held in memory and short, is read
        in this process."""
        return 0 if split == TEXT else int(getattr(self, "num_workers", 0))

    @contextlib.contextmanager
    def reading_artifacts(self, what: str) -> Iterator[None]:
        """Turn a missing or unfinished artifact into the one error that says what to run."""
        try:
            yield
        except ArtifactError as err:
            raise ArtifactError(f"{err} {type(self).__name__} reads the artifacts of `gnnlm "
                                f"pipeline` ({what}); run its retrieval stages first.") from err

    def check_train_neighbors(self, key: str, metric: str) -> None:
        """Refuse, saying what to run, a work directory whose pipeline searched valid and test
        but no train query of ``key``: it searches them only when its config has a head that
        reads neighbours, for its primary key (an unfinished search is left to
        ``read_manifest``'s own message)."""
        train = self.workdir.neighbors(key, metric, "train")
        if (is_complete(self.workdir.neighbors(key, metric, "valid")) and not is_complete(train)
                and not train.with_name(train.name + ".partial").exists()):
            raise ArtifactError(f"{type(self).__name__} reads the train neighbours, and "
                                f"{train} holds none: `gnnlm pipeline` searches train queries "
                                f"only when its config has a head that reads neighbours, and "
                                f"only for its primary key (knn.keys[0]); run it with this head "
                                f"in its config (e.g. --gnn.config=...), then fit again.")

    def use_features(self, train: dict) -> None:
        """The sizes the CLI links into the model, from the train features' manifest, and the
        base LM's logit scale and soft-capping (applied after its output embedding)."""
        self.vocab_size, self.feature_dim = train["vocab_size"], train["dim"]
        self.logit_transform = LogitTransform.of(train["base_lm"])

    def use_base_lm(self, train: dict, base_lm_path: Optional[str]) -> None:
        """The base LM the CLI links into models that run it: ``base_lm_path``, or where the
        train features say theirs is (``hf:<name>``, or a checkpoint path relative to the work
        directory, so the directory can move); and its weights' fingerprint, which the model
        checks."""
        identity = train["base_lm"]
        location = identity.get("location")
        if not base_lm_path and not location:
            raise ArtifactError(f"The features in {self.workdir.features('train')} do not record "
                                f"where their base LM is: pass base_lm_path.")
        self.base_lm = base_lm_path or (
            location if location.startswith("hf:") else str(self.workdir.resolve(location)))
        self.base_lm_fingerprint = identity["fingerprint"]

    def token_stream(self, split: str, n: int, bos_id: int) -> torch.Tensor:
        """The datastore's token stream of ``split``: ``[bos]`` + the first ``n`` targets of its
        features, so the tokens are exactly those the features were computed on."""
        return stream_tensor(np.asarray(self.arrays.targets(split)[:n]), bos_id)

    def output_embedding(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The base LM's output embedding ``(W [V, d], b [V] or None)``."""
        return load_output_embedding(self.workdir)

    def eval_dataloader(self, split: str) -> DataLoader:
        """The loader that scores every position of ``split`` once."""
        raise NotImplementedError

    def val_dataloader(self) -> DataLoader:
        return self.eval_dataloader("valid")

    def test_dataloader(self) -> DataLoader:
        return self.eval_dataloader("test")

    def predict_dataloader(self) -> DataLoader:
        return self.eval_dataloader(self.predict_split)
