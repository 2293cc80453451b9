"""GNN-LM's settings (Meng et al. 2022), light enough for a config to check without torch, PyG
or faiss: the retrieval graph's shape (``GraphConfig``, which a GNN-LM checkpoint saves among its
data module's hyper-parameters, hence ``checkpoint_safe``: it moved from ``gnnlm.graph`` and
``gnnlm.gnn.graph``, where checkpoints written before pickled it) and the PQ codes of its window
nodes' features (``PQConfig``). Building them is ``gnnlm.gnn.graph`` and ``gnnlm.gnn.pq``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from gnnlm.workdir.checkpoints import checkpoint_safe


@checkpoint_safe("gnnlm.gnn.graph.GraphConfig", "gnnlm.graph.GraphConfig")
@dataclass
class GraphConfig:
    """The retrieval graph of a block (paper defaults: l = r = 1, k = 128 of K = 1024, every
    window node linked to the context).

    Args:
        left: tokens kept before each retrieved one (l of the window p−l … p+r).
        right: tokens kept after each retrieved one (r).
        k: windows retrieved per token (the first k usable of the K stored neighbours).
        ctx_window: causal edges only from the last ``ctx_window`` tokens of the block (unset:
            the whole block).
        inter: ``window``: every window node sends to the token that retrieved it (the paper's
            Figure 1); ``retrieved``: only the retrieved token does (the reference
            implementation).
    """
    left: int = 1
    right: int = 1
    k: int = 32
    ctx_window: Optional[int] = None
    inter: Literal["window", "retrieved"] = "window"

    def __post_init__(self):
        # named as a `gnnlm fit` config writes them (data.init_args.graph.*): the user's fix
        if self.left < 0 or self.right < 0:
            raise ValueError(f"graph.left and graph.right (tokens on each side of a retrieved "
                             f"one) must be >= 0 (got left={self.left}, right={self.right}).")
        if self.k < 1:
            raise ValueError(f"graph.k (windows retrieved per token) must be >= 1 "
                             f"(got {self.k}).")
        if self.ctx_window is not None and self.ctx_window < 1:
            raise ValueError(f"graph.ctx_window must be >= 1, or null for the whole block "
                             f"(got {self.ctx_window}).")
        if self.inter not in ("window", "retrieved"):
            raise ValueError(f"inter must be 'window' (every window node → its ctx token) or "
                             f"'retrieved' (only the retrieved token) (got {self.inter!r}).")

    @property
    def width(self) -> int:
        """Nodes in one unclipped neighbour window."""
        return self.left + self.right + 1

    @property
    def layout(self) -> GraphLayout:
        """The graph's shape without k: what a model that reads these graphs needs to know."""
        return GraphLayout(left=self.left, right=self.right, ctx_window=self.ctx_window,
                           inter=self.inter)


@checkpoint_safe()
@dataclass
class GraphLayout:
    """The shape of the retrieval graph that the GNN-LM model reads (``GraphConfig`` without k):
    window sizes, ctx window and inter edges. k stays the data module's: the model reads it
    from each batch, so one model serves a k curriculum and any evaluation k. Checkpoint-safe:
    a GNN-LM checkpoint saves it among the model's hyper-parameters.

    Args:
        left: tokens kept before each retrieved one.
        right: tokens kept after each retrieved one.
        ctx_window: causal edges only from the last ``ctx_window`` tokens of the block.
        inter: which window nodes send to the token that retrieved the window.
    """
    left: int = 1
    right: int = 1
    ctx_window: Optional[int] = None
    inter: Literal["window", "retrieved"] = "window"

    @classmethod
    def of(cls, value: GraphLayout | GraphConfig | dict) -> GraphLayout:
        """``value``'s layout: a ``GraphConfig`` (checkpoints written before the layout left
        k out hold one) or a dict (hyper-parameters read back from YAML) loses its k."""
        if isinstance(value, GraphLayout):
            return value
        if isinstance(value, GraphConfig):
            return value.layout
        return cls(**{k: v for k, v in dict(value).items() if k != "k"})


@dataclass
class PQConfig:
    """PQ codes of the train features, which the graph's window nodes may read (GNN-LM §3.1,
    "Feature Quantization"). The key type is the pipeline's primary key (``knn.keys[0]``).

    Args:
        m: sub-quantizers of 8 bits, i.e. bytes per vector (unset: d/4); must divide d.
        opq: learn a rotation (OPQ) before the quantizer.
        train_sample: features the codec is trained on (a seeded sample).
        seed: the seed of the training sample (the held-out sample takes ``seed + 1``).
        chunk: features encoded per resumable step.
        clustering: what trains the codebooks' k-means: ``faiss`` (on the CPU), ``torch``
            (``gnnlm.retrieval.kmeans`` on torch's device, faiss the rest), ``auto`` (torch when
            torch sees a GPU; faiss for an OPQ codec, whose rotation and codebooks faiss trains
            together). Not part of the fingerprint, as the device is not.
    """
    m: Optional[int] = None
    opq: bool = True
    train_sample: int = 65536
    seed: int = 0
    chunk: int = 262144
    clustering: Literal["auto", "faiss", "torch"] = "auto"

    def __post_init__(self):
        if self.m is not None and self.m < 1:
            raise ValueError(f"pq.m (bytes per vector) must be >= 1, or null for d/4 "
                             f"(got {self.m}).")
        for name in ("train_sample", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"pq.{name} must be >= 1 (got {getattr(self, name)}).")
        if self.clustering not in ("auto", "faiss", "torch"):
            raise ValueError(f"pq.clustering must be 'auto', 'faiss' or 'torch' "
                             f"(got {self.clustering!r}).")
        if self.clustering == "torch" and self.opq:
            raise ValueError("pq.clustering: torch trains the product quantizer's codebooks "
                             "alone, but pq.opq: true learns a rotation with them, which faiss "
                             "trains: set pq.opq: false, or pq.clustering: auto or faiss.")

    def fingerprint_config(self) -> dict:
        # What runs the k-means does not name the artifact, as the device does not (an index's
        # ``clustering`` likewise); the manifest records it.
        return {name: value for name, value in vars(self).items() if name != "clustering"}
