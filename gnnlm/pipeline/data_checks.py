"""Checks on what a report's numbers rest on, and the warnings where they cannot be trusted.

A perplexity is only as meaningful as the tokens and the retrieval behind it, and neither shows
in the number itself:

- **Unknown tokens.** A word tokenizer with ``max_vocab`` (or a tokenizer with an unknown token)
  maps every word it does not know to one id. A split that is mostly that id gets a perplexity
  that measures how well ``<unk>`` is predicted, not the text (a test split 92% ``<unk>`` once
  scored 1.5M without a remark). ``unk_share`` is the share of each split's positions (those the
  report scores; for train, the datastore's) whose token is the unknown id; None when the
  tokenizer has no such id (byte-level BPE).
- **Overlap with the datastore.** A valid or test position whose nearest train key sits after
  the same text (the ``n`` tokens before it equal the query's) lets retrieval copy the
  continuation. ``near_copies`` finds those positions from the stored top-1 neighbour and the
  token streams, by content rather than by score. When valid overlapped train far more than
  test did, λ = 0.45 fitted on valid (kNN −58% on valid) then made test worse (+17%), and nothing
  hinted why: a share that is high, or that differs between valid and test, is reported.
- **Heads worse than the base LM.** A trained head on the base LM's features that ends worse
  than the base LM on valid has not learned what it is there for; its test row is no gain of the
  method.

``measure`` reads a work directory; ``report_warnings`` turns what was measured into the
report's warning lines. Everything here is numpy on the stored arrays: no model is run.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import numpy as np

from gnnlm.workdir.layout import EVAL_SPLITS, SPLITS, Workdir
from gnnlm.workdir.manifests import is_complete, open_array, read_manifest

# WikiText-2 keeps the `<unk>` of its source in the text: its train, valid and test splits are
# 2.6%, 5.4% and 6.2% `<unk>` (word level, every position). Cut to its 10,000 most frequent
# words (Penn Treebank's size, the test pipeline's) they are 9.7%, 11.6% and 12.4%; to 5,000
# words 15.8%, 17.0% and 17.8%: coarser but usual setups, comparable among runs of the same
# vocabulary. Beyond 20% of a split (2,000 words: 25–26%) one token for every missing word is a
# fifth of what is predicted, and the perplexity is largely that token's.
UNK_WARN = 0.20
# A valid/test split above 10% with more than twice train's share holds words the vocabulary was
# not built for: the LM learned `<unk>` at train's rate and pays for it on every one (a test
# split 92% `<unk>` scored 1.5M). WikiText-2's test has 2.4x train's share, but only 6.2%.
UNK_SHIFT, UNK_SHIFT_RATIO = 0.10, 2.0
# Tokens before a position that must equal those before its top-1 train neighbour for a
# near-copy: 32 words is a passage, not a phrase (at character level 32 characters are a few
# words that recur by chance, so 128 there: about 20 words).
NEAR_COPY_CONTEXT = {"char": 128}
DEFAULT_NEAR_COPY_CONTEXT = 32
# On the whole of WikiText-2 (final keys, cosine, IVF4096,SQ8) 0.06% of valid and 0.006% of
# test positions have a near-copy as top-1 neighbour. A near-copy lets retrieval read the next
# token off the datastore, gaining several nats there: 1% of positions gaining 4 nats moves the
# mean log-probability by 0.04, perplexity by 4%, the size of the gains the report compares.
OVERLAP_WARN = 0.01
# Valid's and test's shares "differ a lot" when they are at least this many times apart (and one
# of them reaches OVERLAP_WARN): then k, T and λ fitted on valid are fitted to another mix.
OVERLAP_RATIO = 2.0


def near_copy_context(level: str) -> int:
    """The ``n`` of ``near_copies`` for a tokenizer kind (``TokenStore.level``)."""
    return NEAR_COPY_CONTEXT.get(level, DEFAULT_NEAR_COPY_CONTEXT)


def unk_id(tokenizer: Any) -> Optional[int]:
    """The id a tokenizer gives text it does not know, or None when it has none.

    Word and character tokenizers carry ``unk_id``. A Hugging Face tokenizer names its unknown
    token in its model (``unk_token`` of BPE/WordPiece/WordLevel, ``unk_id`` of Unigram); a
    byte-level BPE has none, since every byte has a token."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        unk = getattr(tokenizer, "unk_id", None)
        return None if unk is None else int(unk)
    model = json.loads(backend.to_str()).get("model", {})
    if model.get("unk_token") is not None:
        found = backend.token_to_id(model["unk_token"])
        return None if found is None else int(found)
    if model.get("unk_id") is not None:
        return int(model["unk_id"])
    return None


def unk_share(tokens: np.ndarray, unk: Optional[int]) -> Optional[float]:
    """Share of ``tokens`` equal to ``unk`` (None: the tokenizer has no unknown token)."""
    if unk is None:
        return None
    tokens = np.asarray(tokens)
    return float(np.count_nonzero(tokens == unk) / max(len(tokens), 1))


def _back(tokens: np.ndarray, index: np.ndarray, bos_id: int) -> np.ndarray:
    """``tokens[index]`` with index -1 the BOS that opens the stream (``gnnlm.models.encode``)."""
    return np.where(index >= 0, np.asarray(tokens[np.maximum(index, 0)], dtype=np.int64), bos_id)


def near_copies(query_tokens: np.ndarray, train_tokens: np.ndarray, top1: np.ndarray,
                bos_id: int, n: int = DEFAULT_NEAR_COPY_CONTEXT) -> np.ndarray:
    """Bool [N]: position t's top-1 train neighbour ``top1[t]`` is a near-copy of it.

    Position t reads the stream ``[bos] + tokens`` up to stream[t] and predicts tokens[t]
    (``gnnlm.models.encode``), and likewise train position p. A near-copy: the last m = min(n, t +
    1) tokens that t reads, BOS included near the start, equal the last m that p reads (the whole
    left context when it is shorter than n). A missing neighbour (-1) is no copy.

    Vectorised over positions: one pass per token back (at most n), each over the candidates that
    still match, so the cost is a few gathers of N tokens whatever the split's length."""
    top1 = np.asarray(top1, dtype=np.int64)
    positions = np.arange(len(top1), dtype=np.int64)
    length = np.minimum(n, positions + 1)                        # [N] tokens compared
    copies = np.zeros(len(top1), dtype=bool)
    # p must have read at least as many tokens as are compared
    candidates = np.flatnonzero((top1 >= 0) & (top1 + 1 >= length))
    for back in range(n):
        done = length[candidates] <= back                        # every compared token equal
        copies[candidates[done]] = True
        candidates = candidates[~done]
        query = _back(query_tokens, candidates - 1 - back, bos_id)
        train = _back(train_tokens, top1[candidates] - 1 - back, bos_id)
        candidates = candidates[query == train]
    copies[candidates] = True
    return copies


def measure(workdir: Workdir, key: str, metric: str, store: Any = None) -> dict:
    """What results.json records of a work directory's data: ``unk_share`` per split (of the
    positions that have features) and ``datastore_overlap`` per evaluation split (share of
    positions whose top-1 neighbour under ``key``/``metric`` is a near-copy; None where the
    split has no neighbours). ``store`` is the ``TokenStore`` when the caller has it open."""
    if store is None:
        from gnnlm.text.tokens import TokenStore

        store = TokenStore.open(workdir.tokens)
    unk = unk_id(store.tokenizer)
    tokens = {split: store.split(split)[:workdir.n_positions(split)] for split in SPLITS}
    n = near_copy_context(store.level)
    overlap: dict[str, Optional[float]] = {}
    for split in EVAL_SPLITS:
        path = workdir.neighbors(key, metric, split)
        if not is_complete(path):
            overlap[split] = None
            continue
        ids = open_array(path, "ids", read_manifest(path, kind="neighbors"))
        top1 = np.asarray(ids[:, 0], dtype=np.int64)
        copies = near_copies(tokens[split][:len(top1)], tokens["train"], top1, store.bos_id, n)
        overlap[split] = float(copies.mean()) if len(copies) else 0.0
    return {"unk_token": None if unk is None else store.tokenizer.tokens([unk])[0],
            "unk_share": {split: unk_share(tokens[split], unk) for split in SPLITS},
            "datastore_overlap": overlap,
            "near_copy": {"key": key, "metric": metric, "context": n}}


def heads_worse_than_base(valid_ppl: Mapping[str, float], rows: Iterable[str]) -> list[dict]:
    """The ``rows`` whose valid perplexity is above the base LM's (``valid_ppl["base"]``)."""
    base = valid_ppl.get("base")
    if base is None:
        return []
    return [{"row": row, "valid_ppl": float(valid_ppl[row]), "base_valid_ppl": float(base)}
            for row in rows if row in valid_ppl and valid_ppl[row] > base]


def percent(share: float) -> str:
    """A share as the report prints it (two decimals below 1%, where they matter)."""
    return f"{share:.2%}" if share < 0.01 else f"{share:.1%}"


def report_warnings(unk: Mapping[str, Optional[float]],
                    overlap: Mapping[str, Optional[float]], worse: Iterable[Mapping[str, Any]],
                    label: Callable[[str], str] = str, unk_token: Optional[str] = "<unk>",
                    context: int = DEFAULT_NEAR_COPY_CONTEXT) -> list[dict]:
    """The report's warnings, each ``{"kind", "message", ...the numbers}``, from the measured
    shares (``measure``) and the heads worse than the base LM (``heads_worse_than_base``);
    ``label`` names a row as the tables do. Empty when nothing is to be warned of."""
    found: list[dict] = []
    train = unk.get("train")
    for split in SPLITS:
        share = unk.get(split)
        if share is None:
            continue
        shifted = (split != "train" and train is not None and share > UNK_SHIFT
                   and share > UNK_SHIFT_RATIO * train)
        if not shifted and share <= UNK_WARN:
            continue
        head = f"{percent(share)} of {split} tokens are unknown to the vocabulary (`{unk_token}`"
        head += f"; train {percent(train)})" if split != "train" and train is not None else ")"
        why = (f"over {UNK_SHIFT_RATIO:g}x train's share: the vocabulary was not built for this "
               f"text, and the LM, which learned `{unk_token}` at train's rate, pays for it on "
               f"every one, so the perplexity is inflated by it" if shifted else
               f"over {UNK_WARN:.0%} (WikiText-2's test: 6.2%; with 5,000 words, 17.8%): one "
               f"token stands for every word the vocabulary lacks, and the perplexity is "
               f"largely that token's")
        found.append({"kind": "unk_share", "split": split, "share": share, "train": train,
                      "message": f"{head}: {why}; compare it only with runs of the same "
                                 f"vocabulary."})
    valid, test = overlap.get("valid"), overlap.get("test")
    shares = {s: v for s, v in (("valid", valid), ("test", test)) if v is not None}
    if any(v >= OVERLAP_WARN for v in shares.values()):
        listed = ", ".join(f"{s} {percent(v)}" for s, v in shares.items())
        found.append({
            "kind": "datastore_overlap", **shares,
            "message": f"{listed} of positions retrieve a near-copy of their text (their "
                       f"nearest train key follows the same {context} tokens): retrieval reads "
                       f"their next token off the datastore, so the retrieval rows' gains there "
                       f"measure duplicated text, not modelling."})
    if valid is not None and test is not None and max(valid, test) >= OVERLAP_WARN \
            and max(valid, test) >= OVERLAP_RATIO * min(valid, test):
        found.append({
            "kind": "overlap_mismatch", "valid": valid, "test": test,
            "message": f"valid and test overlap the datastore differently (near-copies: valid "
                       f"{percent(valid)}, test {percent(test)}): k, T and λ fitted on valid "
                       f"may not transfer to test, and test rows can be worse than valid "
                       f"suggests."})
    for row in worse:
        found.append({
            "kind": "worse_than_base", **row,
            "message": f"{label(row['row'])} is no better than the base LM on valid "
                       f"({row['valid_ppl']:.2f} vs {row['base_valid_ppl']:.2f}): its training "
                       f"did not improve on the LM it reads, so its test row is no gain of the "
                       f"method."})
    return found
