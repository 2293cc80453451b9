"""``gnnlm explain``: an input text and the train contexts it retrieves (GNN-LM Table 6).

The base LM encodes the text; the feature of its last token (the one that predicts the next
word) queries the pipeline's index; each retrieved train position p is shown as the train text
around it with its value — the token that followed it, which kNN-LM would predict — in brackets.
When the pipeline trained a GNN-LM, its next-token prediction is shown beside the base LM's:
every position of the text retrieves its windows and the GNN reads them as at evaluation
(``gnnlm.gnn.window_states``, each window computed once), at the k chosen on valid.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from gnnlm.gnn.dense import DenseGraph
from gnnlm.gnn.graph import METADATA, GraphConfig
from gnnlm.gnn.layer import GNNStack
from gnnlm.gnn.pq import PQFeatures, RawFeatures
from gnnlm.gnn.window_states import WindowStates
from gnnlm.models import BaseLM, is_hf, load_base_lm
from gnnlm.models.base import softcap
from gnnlm.retrieval.features import encode_text_positions, load_output_embedding, open_features
from gnnlm.retrieval.search import Searcher
from gnnlm.text.tokens import TokenStore
from gnnlm.workdir.artifacts import read_manifest
from gnnlm.workdir.checkpoints import datamodule_args, load_checkpoint, model_state
from gnnlm.workdir.layout import Workdir


def retrieved_contexts(workdir: Workdir, key: str, metric: str, model: BaseLM, text: str,
                       top: int = 3, left: int = 12, right: int = 6) -> list[dict]:
    """Top ``top`` neighbours of the text's last position, with their train contexts."""
    store = TokenStore.open(workdir.tokens)
    tokenizer = store.tokenizer
    ids = _text_ids(store, text)
    searcher = Searcher.for_workdir(workdir, key, metric)
    _, train = open_features(workdir.features("train"), expect_lm=model.identity())
    query = encode_text_positions(model, ids, store.bos_id,
                                  store.bos_each_window)[key][-1:]                   # [1, d]
    sims, positions = searcher.search(query.astype(np.float32), top)
    train_tokens = np.asarray(train["targets"])  # targets[p] = the token after position p
    rows = []
    for sim, p in zip(sims[0], positions[0]):
        if p < 0:
            continue
        before = tokenizer.decode(train_tokens[max(0, p - left): p])
        value = tokenizer.decode(train_tokens[p: p + 1]).strip()
        after = tokenizer.decode(train_tokens[p + 1: p + 1 + right]).strip()
        rows.append({"position": int(p), "similarity": float(sim), "value": value,
                     "context": f"{before.rstrip()} [{value}] {after}".strip()})
    return rows


def next_token_predictions(workdir: Workdir, key: str, metric: str, model: BaseLM, text: str,
                           top: int = 5) -> Optional[dict]:
    """The base LM's and the trained GNN-LM's ``top`` next tokens after ``text``, with their
    probabilities, or None when the work directory has no trained GNN-LM head."""
    head = workdir.model("gnn")
    if not (head / "manifest.json").is_file():
        return None
    manifest = read_manifest(head)
    checkpoint = load_checkpoint(head / manifest["ckpt"])
    hp = {k: v for k, v in checkpoint["hyper_parameters"].items() if not k.startswith("_")}
    if hp["kind"] != "gnnlm":
        return None  # the HGT baseline has no window states
    data = datamodule_args(head / manifest["ckpt"])
    graph = data.get("graph") or GraphConfig()
    graph = graph if isinstance(graph, GraphConfig) else GraphConfig(**dict(graph))
    k = (manifest.get("eval_k") or {}).get("chosen", graph.k)
    graph = dataclasses.replace(graph, k=k)
    # the GNN-LM module saves every init argument: the stack is rebuilt from them as it built it
    stack = GNNStack(hp["feature_dim"], METADATA, num_layers=hp["num_layers"], heads=hp["heads"],
                     norm=hp["norm"], edge_aggr=hp["edge_aggr"], readout=("ctx",))
    stack.load_state_dict(model_state(checkpoint, "gnn."))
    stack.eval()

    store = TokenStore.open(workdir.tokens)
    ids = _text_ids(store, text)
    node_key = data.get("key", key)
    feats = encode_text_positions(model, ids, store.bos_id,
                                  store.bos_each_window)[node_key][1:]  # [n, d], row t → t+1
    feats = feats[-int(data.get("block_size", 64)):]                       # one block
    _, retrieved = Searcher.for_workdir(workdir, node_key, metric).search(feats, k)
    node_features = (RawFeatures(workdir.features("train"), node_key)
                     if data.get("node_features", "pq") == "raw"
                     else PQFeatures(workdir.pq(node_key)))
    states = WindowStates(stack, node_features, workdir.n_positions("train"), graph)
    n = feats.shape[0]
    layout = DenseGraph(torch.ones(1, n, dtype=torch.bool),
                        torch.zeros(1, n, 0, 1, dtype=torch.bool), graph.left, graph.inter,
                        graph.ctx_window,
                        torch.from_numpy(retrieved.astype(np.int64))[None])
    weight, bias = load_output_embedding(workdir)
    with torch.no_grad():
        h = {"base LM": torch.from_numpy(feats[-1]),
             f"GNN-LM (k = {k})": states(torch.from_numpy(feats)[None], layout)[0, -1]}
        rows = {}
        for name, hidden in h.items():
            logits = softcap(torch.nn.functional.linear(hidden.float(), weight.float(), bias),
                             model.logit_softcap)
            probs, tokens = torch.softmax(logits, -1).topk(top)
            rows[name] = [(store.tokenizer.decode([int(t)]).strip(), float(p))
                          for p, t in zip(probs, tokens)]
    return rows


def _text_ids(store: TokenStore, text: str) -> np.ndarray:
    ids = store.tokenizer.encode(text)
    if len(ids) and store.level == "word" and store.tokenizer.tokens(ids[-1:]) == ["<eos>"]:
        ids = ids[:-1]  # the word tokenizer ends every line with <eos>; the query is mid-line
    if len(ids) == 0:
        raise ValueError("explain needs a non-empty --text.")
    return np.asarray(ids)


def main(args: list[str]) -> list[dict]:
    """``gnnlm explain -c PIPELINE.yaml --text "..." [--top 3]``: prints the retrieved train
    contexts; writes nothing."""
    from gnnlm.pipeline.config import check_built, config_parser, to_config

    parser = config_parser("gnnlm explain", description=main.__doc__)
    parser.add_argument("--text", type=str, required=True, help="the input context")
    parser.add_argument("--top", type=int, default=3, help="retrieved contexts to show")
    namespace = parser.parse_args(args)
    text, top = namespace.pop("text"), namespace.pop("top")
    cfg = to_config(parser, namespace)
    workdir = Workdir(cfg.workdir)
    own = {"--text", "--top"}  # explain's options: the rest is the pipeline's command line
    pipeline_args = [a for i, a in enumerate(args) if a.split("=")[0] not in own
                     and not (i and args[i - 1] in own)]
    check_built("gnnlm explain", pipeline_args,
                [*([] if cfg.base_lm.ckpt else [workdir.model("base_lm")]), workdir.tokens,
                 workdir.features("train"), workdir.index(cfg.knn.primary, cfg.knn.metric)])
    base_lm = cfg.base_lm.ckpt or str(workdir.base_lm_checkpoint)
    model = load_base_lm(base_lm, cfg.base_lm.options() if is_hf(base_lm) else None)  # once
    rows = retrieved_contexts(workdir, cfg.knn.primary, cfg.knn.metric, model, text, top)
    print(f"Input: {text}")
    for i, row in enumerate(rows, 1):
        print(f"Extracted {i} (sim {row['similarity']:.3f}): {row['context']}")
    predictions = next_token_predictions(workdir, cfg.knn.primary, cfg.knn.metric, model, text)
    for name, tokens in (predictions or {}).items():
        print(f"Next token, {name}: " + ", ".join(f"{t} ({p:.3f})" for t, p in tokens))
    return rows
