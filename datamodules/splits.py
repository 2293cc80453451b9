"""Where a data module reads a split: the work directory's artifacts, or a text in place of one.

Every data module reads a split's arrays through ``SplitArrays``: the positions' features by key
and their targets (``features/<split>``), and each position's stored neighbours under a key and
similarity (``neighbors/<key>-<metric>/<split>``). For train, valid and test they are the work
directory's memory-mapped artifacts, opened where they are read (in each DataLoader worker).

A text scored with a trained head (``gnnlm score``, ``gnnlm.inference.scoring``) is served as
one more split, ``TEXT``: its ``TextArrays`` are the same arrays computed for the text (the base
LM's features as the datastore stores them, the neighbours as the neighbours stage searched).
The text then goes through the loaders, batches and model steps that scored the report, so the
report and ``gnnlm score`` share one path per protocol: a split's own tokens give its scores.

Layer: ``datamodules`` sits between ``gnnlm.lit`` and ``gnnlm.pipeline``
(``datamodules/__init__.py``): imports go down to the library, never to the pipeline.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from gnnlm.retrieval.features import check_key, open_features
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import open_array, read_manifest

TEXT = "text"  # the split name a text is served under


@dataclass
class TextArrays:
    """A text's arrays as a split's artifacts hold them: ``targets`` int64 [n] (its token ids),
    ``features`` by key (float32 [n, d], float16 values, as stored) and ``neighbor_ids`` by
    ``(key, metric)`` (int64 [n, K], -1: none)."""
    targets: np.ndarray
    features: dict[str, np.ndarray] = field(default_factory=dict)
    neighbor_ids: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.targets)


class SplitArrays:
    """The arrays of the work directory's splits and, once given (``text``), of a text under
    the split name ``TEXT``. Pickles without the memory maps: each process opens its own."""

    def __init__(self, workdir: Workdir, text: Optional[TextArrays] = None):
        self.workdir, self.text = workdir, text
        self._features: dict[str, Mapping[str, np.ndarray]] = {}
        self._ids: dict[tuple[str, str, str], np.ndarray] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_features": {}, "_ids": {}}

    def _text(self) -> TextArrays:
        if self.text is None:
            raise ValueError(f"No text is given to serve as the split {TEXT!r}.")
        return self.text

    def n(self, split: str) -> int:
        """Positions of ``split`` (every one its features hold)."""
        return len(self._text()) if split == TEXT else self.workdir.n_positions(split)

    def check_key(self, split: str, key: str) -> None:
        """Refuse a feature ``key`` the split does not hold."""
        if split == TEXT:
            if key not in self._text().features:
                raise ValueError(f"The text's arrays have no {key!r} features.")
            return
        check_key(self.workdir.features_manifest(split), key)

    def features(self, split: str) -> Mapping[str, np.ndarray]:
        """``{key: [n, d] features as stored, "targets": [n]}`` of ``split``."""
        if split == TEXT:
            text = self._text()
            return {**text.features, "targets": text.targets}
        if split not in self._features:
            self._features[split] = open_features(self.workdir.features(split))[1]
        return self._features[split]

    def targets(self, split: str) -> np.ndarray:
        return self.features(split)["targets"]

    def neighbor_shape(self, key: str, metric: str, split: str) -> tuple[int, int]:
        """``(n, K)``: the positions whose neighbours are stored (train neighbours may cover
        only a prefix) and the neighbours stored per position."""
        if split == TEXT:
            n, stored = self._text_ids(key, metric).shape
            return n, stored
        manifest = read_manifest(self.workdir.neighbors(key, metric, split), kind="neighbors")
        return int(manifest["n"]), int(manifest["K"])

    def neighbor_ids(self, key: str, metric: str, split: str) -> np.ndarray:
        """The train positions each position of ``split`` retrieved ``[n, K]`` (-1: none)."""
        if split == TEXT:
            return self._text_ids(key, metric)
        if (key, metric, split) not in self._ids:
            self._ids[(key, metric, split)] = open_array(
                self.workdir.neighbors(key, metric, split), "ids")
        return self._ids[(key, metric, split)]

    def neighbors_location(self, key: str, metric: str, split: str) -> str:
        """Where the neighbours of ``split`` are, as messages name them."""
        if split == TEXT:
            return f"the text's neighbours under {key}-{metric}"
        return str(self.workdir.neighbors(key, metric, split))

    def _text_ids(self, key: str, metric: str) -> np.ndarray:
        ids = self._text().neighbor_ids.get((key, metric))
        if ids is None:
            raise ValueError(f"The text's arrays have no neighbours under {key}-{metric}.")
        return ids
