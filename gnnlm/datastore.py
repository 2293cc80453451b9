"""Features (the datastore): every position of a split encoded by the frozen base LM.

For split s, ``workdir.features(s)`` holds, per position t (see ``gnnlm.encode``):

- ``final`` float16 [N, d]: the last layer's output after the final norm (what the softmax
  reads; GNN-LM's key and node feature) and ``att`` float16 [N, d]: the last block's input to
  its FFN (kNN-LM's key; Xu et al. §3);
- ``targets`` int32 [N]: the value of position t, the token that follows it;
- ``lm_logprob`` float32 [N]: log p_LM(target) (valid/test by default; the kNN-LM cache).

The manifest records the base LM (its weights' fingerprint, which identifies it; its name; and
where it is, relative to the work directory when inside it), the tokens fingerprint, and the
context/stride protocol. Windows are written in fixed chunks with progress recorded after each,
so a killed build resumes at the next chunk and ends with the same bytes.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from gnnlm.artifacts import ArtifactBuilder, ArtifactError, open_array, read_manifest
from gnnlm.devices import torch_device
from gnnlm.encode import encode_windows, protocol, sliding_windows
from gnnlm.models.base import FEATURE_KEYS, BaseLM
from gnnlm.tokens import TokenStore
from gnnlm.workdir import SPLITS, Workdir


def build_features(model: BaseLM, store: TokenStore, workdir: Workdir, split: str,
                   context: int, stride: int, with_logprob: bool = True,
                   batch_size: int = 16, chunk_windows: int = 256,
                   max_tokens: int | None = None, device: str = "auto",
                   location: Optional[str] = None, rebuild: bool = False,
                   stop_after_chunks: int | None = None) -> dict:
    """Encode ``split`` into ``workdir.features(split)`` (skips a complete build; resumes a
    partial one).

    ``max_tokens`` keeps a prefix of the split. ``location`` records where the base LM can be
    loaded from (a checkpoint path, kept relative to the work directory, or ``hf:<name>``).
    ``stop_after_chunks`` stops early without completing (used to test resumption).
    """
    out_dir = workdir.features(split)
    tokens = np.asarray(store.split(split)[:max_tokens])
    n = len(tokens)
    if n == 0:
        raise ValueError(f"Split {split!r} of {store.path} has no tokens.")
    context = min(context, n, model.context_length)
    stride = min(stride, context)
    builder = ArtifactBuilder(
        out_dir, kind="features",
        config={"split": split, "context": context, "stride": stride, "max_tokens": max_tokens,
                "with_logprob": with_logprob, "chunk_windows": chunk_windows},
        inputs={"base_lm_fingerprint": model.fingerprint(),
                "tokens": store.manifest["fingerprint"]},
        rebuild=rebuild)
    if builder.is_complete():
        return read_manifest(out_dir)
    starts, _ = sliding_windows(n, context, stride)
    n_chunks = -(-len(starts) // chunk_windows)
    on = torch_device(device)
    model = model.to(on).eval()
    t0 = time.perf_counter()
    with builder:
        d = model.hidden_size
        arrays = {key: builder.array(key, np.float16, (n, d)) for key in FEATURE_KEYS}
        targets = builder.array("targets", np.int32, (n,))
        logprob = builder.array("lm_logprob", np.float32, (n,)) if with_logprob else None
        for chunk in builder.chunks(n_chunks, f"features {split}", stop_after_chunks):
            window_range = (chunk * chunk_windows, min((chunk + 1) * chunk_windows, len(starts)))
            for batch in encode_windows(model, tokens, store.bos_id, context, stride,
                                        window_range, batch_size, with_logprob, on):
                span = slice(batch.start, batch.start + batch.final.shape[0])
                arrays["final"][span] = batch.final.cpu().numpy().astype(np.float16)
                arrays["att"][span] = batch.att.cpu().numpy().astype(np.float16)
                if logprob is not None and batch.logprob is not None:
                    logprob[span] = batch.logprob.cpu().numpy()
        if builder.interrupted:
            return {}
        targets[:] = tokens.astype(np.int32)
        identity = {**model.identity(), "location": location}
        return builder.finish(extra={
            "n": n, "dim": d, "protocol": protocol(context, stride), "keys": list(FEATURE_KEYS),
            "base_lm": identity, "vocab_size": store.vocab_size,
            "seconds": round(time.perf_counter() - t0, 2)})


def open_features(path: str | Path, expect_lm: dict | None = None) -> tuple[dict, dict]:
    """Open a features artifact: ``(manifest, {name: memmap})``.

    ``expect_lm`` (a base LM's ``identity()``) refuses features made by another model.
    """
    manifest = read_manifest(path, kind="features")
    if expect_lm is not None and manifest["base_lm"]["fingerprint"] != expect_lm["fingerprint"]:
        made = manifest["base_lm"]
        raise ArtifactError(
            f"The datastore at {path} was made by base LM {made['name']} (weights "
            f"{made['fingerprint']}), not by {expect_lm['name']} (weights "
            f"{expect_lm['fingerprint']}): queries and keys would live in different spaces. "
            f"Rebuild the features with this base LM or use the one that made them.")
    return manifest, {name: open_array(path, name, manifest) for name in manifest["arrays"]}


def check_key(manifest: dict, key: str) -> None:
    if key not in FEATURE_KEYS:
        raise ValueError(f"key must be one of {FEATURE_KEYS} (got {key!r}).")
    if key not in manifest["arrays"]:
        raise ArtifactError(f"The features have no {key!r} array (they have "
                            f"{sorted(manifest['arrays'])}).")


def build_output_embedding(model: BaseLM, workdir: Workdir) -> dict:
    """Save the base LM's output embedding ``W [V, d]`` (and bias) for heads on frozen features."""
    out_dir = workdir.output_embedding
    builder = ArtifactBuilder(out_dir, kind="output_embedding",
                              inputs={"base_lm_fingerprint": model.fingerprint()})
    if builder.is_complete():
        return read_manifest(out_dir)
    weight, bias = model.output_embedding()
    with builder:
        builder.array("weight", np.float32, weight.shape)[...] = weight.detach().float().numpy()
        if bias is not None:
            builder.array("bias", np.float32, bias.shape)[...] = bias.detach().float().numpy()
        return builder.finish(extra={"base_lm": model.identity(),
                                     "vocab_size": int(weight.shape[0]),
                                     "dim": int(weight.shape[1])})


def load_output_embedding(workdir: Workdir) -> tuple[torch.Tensor, torch.Tensor | None]:
    path = workdir.output_embedding
    manifest = read_manifest(path, kind="output_embedding")
    weight = torch.from_numpy(np.array(open_array(path, "weight", manifest)))
    bias = (torch.from_numpy(np.array(open_array(path, "bias", manifest)))
            if "bias" in manifest["arrays"] else None)
    return weight, bias


def build_all_features(model: BaseLM, store: TokenStore, workdir: Workdir, context: int,
                       stride: int, splits: Sequence[str] = SPLITS, train_logprob: bool = False,
                       max_tokens: Optional[dict[str, int]] = None, **kwargs) -> dict[str, dict]:
    """Features for every split (``lm_logprob`` for train only when asked: it costs a softmax),
    and the output embedding that heads on these features project through."""
    build_output_embedding(model, workdir)
    limits = max_tokens or {}
    return {s: build_features(model, store, workdir, s, context, stride,
                              with_logprob=(s != "train" or train_logprob),
                              max_tokens=limits.get(s), **kwargs)
            for s in splits}


@torch.no_grad()
def encode_text_positions(model: BaseLM, ids: np.ndarray, bos_id: int) -> dict[str, np.ndarray]:
    """Features of ``[bos] + ids``, float32 [len(ids) + 1, d]: row t predicts ids[t], the last
    row the token after the text (for ``explain``)."""
    stream = torch.from_numpy(np.concatenate([[bos_id], ids]).astype(np.int64))[None]
    feats = model.eval()(stream[:, -model.context_length:])
    return {"final": feats.final[0].float().numpy(), "att": feats.att[0].float().numpy()}
