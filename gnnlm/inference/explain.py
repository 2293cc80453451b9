"""``gnnlm explain``: an input text and the train contexts it retrieves (GNN-LM Table 6).

The base LM reads the text (the sliding windows of text that grows, ``gnnlm.models.decode``);
the feature of its last position (the one that predicts the next word) queries the train keys
as the pipeline searched them (``gnnlm.retrieval.lookup``); each retrieved train position p is
shown as the train text around it with its value — the token that followed it, which kNN-LM
would predict — in brackets. The base LM's and, when the pipeline trained one, GNN-LM's most
likely next tokens follow (``TrainedLM.next_token_logprobs``, GNN-LM at the k chosen on valid).
"""
from __future__ import annotations

import torch

from gnnlm.inference.decoding import Decoder
from gnnlm.inference.model import TrainedLM
from gnnlm.workdir import rows
from gnnlm.workdir.layout import Workdir


def train_context(lm: TrainedLM, position: int, left: int = 12, right: int = 6) -> str:
    """The train text around datastore ``position`` with its value in brackets:
    ``... before [value] after ...``."""
    key, metric = lm.primary_retrieval()
    train = lm.lookup(key, metric).train_targets  # targets[p] = the token after position p
    before = lm.decode(train[max(0, position - left):position]).rstrip()
    value = lm.decode(train[position:position + 1]).strip()
    after = lm.decode(train[position + 1:position + 1 + right]).strip()
    return f"{before} [{value}] {after}".strip()


def retrieved_contexts(lm: TrainedLM, text: str, top: int = 3) -> list[dict]:
    """The ``top`` neighbours of the text's last position: datastore position, similarity,
    value and train context."""
    key, metric = lm.primary_retrieval()
    base = lm.served.row(rows.BASE)
    decoder = Decoder(lm, base, lm.settings(base), incremental=False)
    decoder.start(torch.from_numpy(lm.encode(text, prompt=True))[None])
    sims, ids = (a[0, -1, :top] for a in decoder.neighbours(key, metric))
    values = lm.lookup(key, metric).values(ids)
    return [{"position": int(p), "similarity": float(s), "value": lm.decode([v]).strip(),
             "context": train_context(lm, int(p))}
            for s, p, v in zip(sims, ids, values) if p >= 0]


def next_tokens(lm: TrainedLM, text: str, top: int = 5) -> dict[str, list[tuple[str, float]]]:
    """The base LM's and GNN-LM's (when trained) ``top`` next tokens with their probabilities."""
    shown = {"base LM": rows.BASE}
    if rows.GNN in lm.rows:
        shown[f"GNN-LM (k = {lm.settings(rows.GNN).gnn_k})"] = rows.GNN
    out = {}
    for name, row in shown.items():
        probs, tokens = lm.next_token_logprobs(text, row).exp().topk(top)
        out[name] = [(lm.decode([int(t)]).strip(), float(p)) for p, t in zip(probs, tokens)]
    return out


def main(args: list[str]) -> list[dict]:
    """``gnnlm explain -c PIPELINE.yaml --text "..." [--top 3]``: prints the retrieved train
    contexts and the next tokens; writes nothing."""
    from gnnlm.pipeline.arguments import explain_options
    from gnnlm.pipeline.config import check_built, config_parser, to_config

    parser = explain_options(config_parser("gnnlm explain", description=main.__doc__))
    namespace = parser.parse_args(args)
    text, top = namespace.pop("text"), namespace.pop("top")
    cfg = to_config(parser, namespace)
    workdir = Workdir(cfg.root)
    own = {"--text", "--top"}  # explain's options: the rest is the pipeline's command line
    pipeline_args = [a for i, a in enumerate(args) if a.split("=")[0] not in own
                     and not (i and args[i - 1] in own)]
    check_built("gnnlm explain", pipeline_args,
                [*([] if cfg.base_lm.ckpt else [workdir.model("base_lm")]), workdir.tokens,
                 workdir.features("train"),
                 workdir.neighbors(cfg.knn.primary, cfg.knn.metric, "test")])
    lm = TrainedLM(workdir.root, cfg.name if workdir.report(cfg.name).is_dir() else None)
    found = retrieved_contexts(lm, text, top)
    print(f"Input: {text}")
    for i, row in enumerate(found, 1):
        print(f"Extracted {i} (sim {row['similarity']:.3f}): {row['context']}")
    for name, tokens in next_tokens(lm, text).items():
        print(f"Next token, {name}: " + ", ".join(f"{t} ({p:.3f})" for t, p in tokens))
    return found
