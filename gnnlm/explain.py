"""``gnnlm explain``: an input text and the train contexts it retrieves (GNN-LM Table 6).

The base LM encodes the text; the feature of its last token (the one that predicts the next
word) queries the pipeline's index; each retrieved train position p is shown as the train text
around it with its value — the token that followed it, which kNN-LM would predict — in brackets.
"""
from __future__ import annotations

import numpy as np

from gnnlm.datastore import encode_text_positions, open_features
from gnnlm.models import load_base_lm
from gnnlm.search import Searcher
from gnnlm.tokens import TokenStore
from gnnlm.workdir import Workdir


def retrieved_contexts(workdir: Workdir, key: str, metric: str, base_lm: str, text: str,
                       top: int = 3, left: int = 12, right: int = 6) -> list[dict]:
    """Top ``top`` neighbours of the text's last position, with their train contexts."""
    store = TokenStore.open(workdir.tokens)
    tokenizer = store.tokenizer
    ids = tokenizer.encode(text)
    if len(ids) and store.level == "word" and tokenizer.tokens(ids[-1:]) == ["<eos>"]:
        ids = ids[:-1]  # the word tokenizer ends every line with <eos>; the query is mid-line
    if len(ids) == 0:
        raise ValueError("explain needs a non-empty --text.")
    model = load_base_lm(base_lm)
    searcher = Searcher.for_workdir(workdir, key, metric)
    _, train = open_features(workdir.features("train"), expect_lm=model.identity())
    query = encode_text_positions(model, ids, store.bos_id)[key][-1:]       # [1, d]
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


def main(args: list[str]) -> list[dict]:
    """``gnnlm explain -c PIPELINE.yaml --text "..." [--top 3]``: prints the retrieved train
    contexts; writes nothing."""
    from gnnlm.config import config_parser, to_config

    parser = config_parser("gnnlm explain", description=main.__doc__)
    parser.add_argument("--text", type=str, required=True, help="the input context")
    parser.add_argument("--top", type=int, default=3, help="retrieved contexts to show")
    namespace = parser.parse_args(args)
    text, top = namespace.pop("text"), namespace.pop("top")
    cfg = to_config(parser, namespace)
    workdir = Workdir(cfg.workdir)
    base_lm = cfg.base_lm.ckpt or str(workdir.base_lm_checkpoint)
    rows = retrieved_contexts(workdir, cfg.knn.primary, cfg.knn.metric, base_lm, text, top)
    print(f"Input: {text}")
    for i, row in enumerate(rows, 1):
        print(f"Extracted {i} (sim {row['similarity']:.3f}): {row['context']}")
    return rows
