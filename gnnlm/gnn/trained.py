"""A GNN-LM the pipeline trained, read back from its work directory as plain data.

``models/gnn/`` holds the checkpoint ``gnnlm fit`` wrote (a ``gnnlm.lit.gnn.GNNLM`` on a
``datamodules.graph.GraphDataModule``) and the manifest that records the evaluation k chosen on
valid. The GNN stack is rebuilt from the module's saved init arguments and loaded with its
weights; the graph's shape, the retrieval key and similarity, the block size and the node
features come from the data module's saved arguments. No Lightning is imported, and no code from
the checkpoint runs (``gnnlm.workdir.checkpoints``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from gnnlm.gnn.graph import METADATA, GraphConfig
from gnnlm.gnn.layer import GNNStack
from gnnlm.gnn.pq import PQFeatures, RawFeatures
from gnnlm.gnn.window_states import NodeFeatures, WindowStates
from gnnlm.workdir.artifacts import read_manifest
from gnnlm.workdir.checkpoints import load_checkpoint, model_state
from gnnlm.workdir.layout import Workdir


@dataclass
class TrainedGNN:
    """A trained GNN-LM in evaluation mode and how the pipeline scored with it.

    ``graph`` carries the k chosen on valid (``eval_k``: the valid perplexity of each k the
    pipeline tried, or None when it tried one); ``key``/``metric`` name the neighbours its
    windows come from; ``block_size`` the tokens of one evaluation block (causal ctx edges run
    within a block), ``eval_batch_size`` the blocks scored at once; ``node_features`` ``raw``
    or ``pq``."""
    stack: GNNStack
    graph: GraphConfig
    key: str
    metric: str
    block_size: int
    eval_batch_size: int
    node_features: str
    eval_k: Optional[dict]
    max_windows: Optional[int]

    def window_states(self, workdir: Workdir, k: Optional[int] = None) -> WindowStates:
        """The window-state table over the work directory's train node features (read
        lazily: a window's nodes are read when a token first retrieves it), for ``k`` windows
        per token (None: the chosen k)."""
        features: NodeFeatures = (RawFeatures(workdir.features("train"), self.key)
                                  if self.node_features == "raw"
                                  else PQFeatures(workdir.pq(self.key)))
        graph = self.graph if k is None else dataclasses.replace(self.graph, k=k)
        return WindowStates(self.stack, features, workdir.n_positions("train"), graph,
                            max_windows=self.max_windows)


def load_trained_gnn(workdir: Workdir, folder: str = "gnn") -> TrainedGNN:
    """The GNN-LM of ``models/<folder>/``. Raises ``ValueError`` for the HGT baseline, whose
    layers are PyG's ``HGTConv`` and have no window states."""
    path = workdir.model(folder)
    manifest = read_manifest(path, kind="trained_model")
    checkpoint = load_checkpoint(path / manifest["ckpt"])
    hp = {k: v for k, v in checkpoint["hyper_parameters"].items() if not k.startswith("_")}
    data = {k: v for k, v in dict(checkpoint.get("datamodule_hyper_parameters") or {}).items()
            if not k.startswith("_")}
    if hp.get("kind", "gnnlm") != "gnnlm":
        raise ValueError(f"{path} holds the HGT baseline (kind {hp['kind']!r}), which is scored "
                         f"with one window per retrieval only: its rows are not served here.")
    graph = data.get("graph") or GraphConfig()
    graph = graph if isinstance(graph, GraphConfig) else GraphConfig(**dict(graph))
    eval_k = manifest.get("eval_k")
    chosen = int((eval_k or {}).get("chosen") or data.get("eval_k") or graph.k)
    # the module saved every init argument: the stack is rebuilt as it built it
    stack = GNNStack(hp["feature_dim"], METADATA, num_layers=hp["num_layers"], heads=hp["heads"],
                     dropout=hp.get("dropout", 0.0), norm=hp.get("norm", "none"),
                     edge_aggr=hp.get("edge_aggr", "sum"), readout=("ctx",))
    stack.load_state_dict(model_state(checkpoint, "gnn."))
    stack.eval()
    for p in stack.parameters():
        p.requires_grad_(False)
    return TrainedGNN(stack=stack, graph=dataclasses.replace(graph, k=chosen),
                      key=data.get("key", "final"), metric=data.get("metric", "cos"),
                      block_size=int(data.get("block_size", 64)),
                      eval_batch_size=int(data.get("eval_batch_size", 8)),
                      node_features=data.get("node_features", "pq"), eval_k=eval_k,
                      max_windows=hp.get("max_windows"))
