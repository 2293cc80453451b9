"""The work directory: the one owner of every artifact's path.

Stages take a ``Workdir`` and say which split, key type and similarity they mean; nothing else
in the package joins path pieces. The layout, in pipeline order::

    tokens/                               token streams + tokenizer (gnnlm.text.tokens)
    models/<name>/                        trained models: base_lm, gnn, spalm, ...
                                          (gnnlm.pipeline.training)
    features/<split>/                     final/att features, targets, log p_LM
                                          (gnnlm.retrieval.features)
    features/output_embedding/            the base LM's W, b (heads on frozen features read it)
    index/<key>-<metric>/                 FAISS index over train keys (gnnlm.retrieval.index)
    neighbors/<key>-<metric>/<split>/     top-K ids and similarities (gnnlm.retrieval.neighbors)
    knn_cache/<key>-<metric>-<scores>/<split>/  per-token kNN-LM inputs (gnnlm.retrieval.knn_cache)
    pq/<key>/                             PQ codes of train features (gnnlm.gnn.pq)
    ablations/                            Xu et al. ablation table (gnnlm.pipeline.ablations)
    logs/<name>/                          Lightning logs of trained models
    reports/<name>/                       results.json, results.md, plots (gnnlm.pipeline.report)

A work directory can be moved or named by a relative path: manifests identify their inputs by
content fingerprints, never by absolute paths.
"""
from __future__ import annotations

import os
from pathlib import Path

from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.refusals import ArtifactError

SPLITS = ("train", "valid", "test")
EVAL_SPLITS = ("valid", "test")


def retrieval_tag(key: str, metric: str) -> str:
    """The name of an index and its neighbours: the key type and the similarity."""
    return f"{key}-{metric}"


def check_workdir(root: str | os.PathLike, field: str = "workdir") -> None:
    """Refuse a work directory that is no folder to write into, before anything runs: an empty
    path (``--workdir=``, which ``Path`` reads as the current directory, so every artifact
    folder would land beside the user's own files) and a path that is an existing file."""
    if not str(root).strip():
        raise ValueError(f"{field} is an empty path: name the folder the artifacts go to, "
                         f"e.g. runs/wikitext2 ('.' for the current directory).")
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{field} {path} is a file, not a folder: name another path (the "
                         f"folder is made if absent).")
    for parent in path.parents:  # `mkdir -p` would stop at a file on the way
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"{field} {path} lies under {parent}, which is a file, not a "
                             f"folder: name another path.")


class Workdir:
    def __init__(self, root: str | os.PathLike):
        check_workdir(root, "The work directory (workdir)")
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"Workdir({str(self.root)!r})"

    def __fspath__(self) -> str:
        return str(self.root)

    # -- artifacts, in pipeline order ------------------------------------------------------
    @property
    def tokens(self) -> Path:
        return self.root / "tokens"

    def model(self, name: str) -> Path:
        """A trained model's folder: the base LM, a head, a Transformer-XL comparison."""
        return self.root / "models" / name

    @property
    def base_lm_checkpoint(self) -> Path:
        """Where the pipeline keeps a base LM it trained itself."""
        return self.model("base_lm") / "model.ckpt"

    def features(self, split: str) -> Path:
        return self.root / "features" / split

    @property
    def output_embedding(self) -> Path:
        return self.root / "features" / "output_embedding"

    def index(self, key: str, metric: str) -> Path:
        return self.root / "index" / retrieval_tag(key, metric)

    def neighbors(self, key: str, metric: str, split: str) -> Path:
        return self.root / "neighbors" / retrieval_tag(key, metric) / split

    def train_neighbors(self) -> list[Path]:
        """The train neighbours this work directory holds, one folder per key type and
        similarity (``neighbors/<key>-<metric>/train``), in name order."""
        return sorted((self.root / "neighbors").glob("*/train"))

    def knn_cache(self, key: str, metric: str, scores: str, split: str) -> Path:
        return self.root / "knn_cache" / f"{retrieval_tag(key, metric)}-{scores}" / split

    def pq(self, key: str) -> Path:
        return self.root / "pq" / key

    @property
    def ablations(self) -> Path:
        return self.root / "ablations"

    def logs(self, name: str) -> Path:
        return self.root / "logs" / name

    def report(self, name: str) -> Path:
        return self.root / "reports" / name

    def check_layout(self) -> None:
        """Refuse a work directory of the earlier layout, whose trained models are in
        ``heads/``: its features record their base LM there, so nothing in it can be reused."""
        if (self.root / "heads").is_dir() and not (self.root / "models").exists():
            raise ArtifactError(
                f"{self.root} keeps its trained models in heads/, the layout of an earlier "
                f"gnnlm (now models/), and its manifests point there: give another workdir, or "
                f"move this one aside, and the pipeline builds every stage again.")

    # -- what the manifests say --------------------------------------------------------------
    def features_manifest(self, split: str) -> dict:
        return read_manifest(self.features(split), kind="features")

    def n_positions(self, split: str) -> int:
        return int(self.features_manifest(split)["n"])

    def resolve(self, path: str | os.PathLike) -> Path:
        """A path recorded relative to the work directory (absolute paths stay as they are)."""
        path = Path(path)
        return path if path.is_absolute() else self.root / path

    def relative(self, path: str | os.PathLike) -> str:
        """``path`` relative to the work directory when it lies inside it (for manifests)."""
        path = Path(path).resolve()
        try:
            return str(path.relative_to(self.root.resolve()))
        except ValueError:
            return str(path)
