"""Features (the datastore): every position of a split encoded by the frozen base LM.

For split s, ``workdir.features(s)`` holds, per position t (see ``gnnlm.models.encode``):

- ``final`` float16 [N, d]: the last layer's output after the final norm (what the softmax
  reads; GNN-LM's key and node feature) and ``att`` float16 [N, d]: the last block's input to
  its FFN (kNN-LM's key; Xu et al. §3);
- ``targets`` int32 [N]: the value of position t, the token that follows it;
- ``lm_logprob`` float32 [N]: log p_LM(target) (valid/test by default; the kNN-LM cache).

The manifest records the base LM (its weights' fingerprint, which identifies it; its name; and
where it is, relative to the work directory when inside it), the tokens fingerprint, and the
context/stride protocol. Windows are written in fixed chunks with progress recorded after each,
so a killed build resumes at the next chunk and ends with the same bytes. With ``devices`` > 1
the chunks are shared among that many processes (``gnnlm.workdir.shards``,
``gnnlm.workdir.ranks``): the same bytes again, and a killed build resumes with any number of
processes.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch

from gnnlm.models.base import FEATURE_KEYS, BaseLM
from gnnlm.models.encode import (
    EncodedBatch,
    encode_windows,
    open_with_bos,
    protocol,
    sliding_windows,
)
from gnnlm.text.bos import BosRule
from gnnlm.text.tokens import TokenStore
from gnnlm.utils.metrics import check_finite
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import SPLITS, Workdir
from gnnlm.workdir.manifests import open_array, read_manifest
from gnnlm.workdir.ranks import Devices, Rank, run_on_ranks
from gnnlm.workdir.refusals import ArtifactError
from gnnlm.workdir.shards import ShardedJob, totals


def build_features(model: BaseLM, store: TokenStore, workdir: Workdir, split: str,
                   context: int, stride: int, with_logprob: bool = True,
                   batch_size: int = 16, chunk_windows: int = 256,
                   max_tokens: int | None = None, device: str = "auto",
                   location: Optional[str] = None, rebuild: bool = False,
                   stop_after_chunks: int | None = None, devices: Devices = 1,
                   strategy: str = "ddp_spawn") -> dict:
    """Encode ``split`` into ``workdir.features(split)`` (skips a complete build; resumes a
    partial one).

    ``max_tokens`` keeps a prefix of the split. ``location`` records where the base LM can be
    loaded from (a checkpoint path, kept relative to the work directory, or ``hf:<name>``).
    ``devices`` > 1 encodes on that many processes (one per GPU on CUDA, see
    ``gnnlm.workdir.ranks``), each writing its share of the chunks; the files are the same bytes as
    with one process, and a partial build resumes with any number of processes.
    ``stop_after_chunks`` stops each rank after that many chunks without completing (used to test
    resumption).
    """
    n = len(store.split(split)[:max_tokens])
    if n == 0:
        raise ValueError(f"Split {split!r} has no tokens to encode (features.max_tokens: "
                         f"{max_tokens}, tokens in {store.path}): give every split a positive "
                         f"prefix.")
    context = min(context, n, model.context_length or n)
    stride = min(stride, context)
    starts, _ = sliding_windows(n, context, stride)
    job = FeaturesJob(out_dir=workdir.features(split), model=model,
                      tokens_path=Path(store.path), tokens_manifest=store.manifest, split=split,
                      n=n, context=context, stride=stride,
                      with_logprob=with_logprob, batch_size=batch_size,
                      chunk_windows=chunk_windows, n_windows=len(starts),
                      max_tokens=max_tokens, location=location, rebuild=rebuild,
                      stop_after=stop_after_chunks)
    if job.builder().is_complete():
        return read_manifest(workdir.features(split))
    return run_on_ranks(job, devices, device, strategy)


@dataclass
class FeaturesJob(ShardedJob):
    """The features of one split on one rank: chunk c holds windows
    ``[c * chunk_windows, (c + 1) * chunk_windows)``, encoded in the same batches by any rank."""
    out_dir: Path
    model: BaseLM
    tokens_path: Path
    tokens_manifest: dict
    split: str
    n: int
    context: int
    stride: int
    with_logprob: bool
    batch_size: int
    chunk_windows: int
    n_windows: int
    max_tokens: Optional[int]
    location: Optional[str]
    rebuild: bool
    stop_after: Optional[int]

    @property
    def n_chunks(self) -> int:
        return -(-self.n_windows // self.chunk_windows)

    @property
    def desc(self) -> str:
        return f"features {self.split}"

    @property
    def bos_each_window(self) -> bool:
        return bool(self.tokens_manifest.get("bos_each_window", False))

    def builder(self) -> ArtifactBuilder:
        config = {"split": self.split, "context": self.context, "stride": self.stride,
                  "max_tokens": self.max_tokens, "with_logprob": self.with_logprob,
                  "chunk_windows": self.chunk_windows}
        if self.bos_each_window:
            config["bos_each_window"] = True
        inputs = {"base_lm_fingerprint": self.model.fingerprint(),
                  "tokens": self.tokens_manifest["fingerprint"]}
        keys = self.model.identity().get("keys")
        if keys:  # a Hugging Face model: where its features are read
            inputs["base_lm_keys"] = keys
        return ArtifactBuilder(self.out_dir, kind="features", config=config, inputs=inputs,
                               rebuild=self.rebuild)

    def tokens(self) -> np.ndarray:
        stream = open_array(self.tokens_path, self.split, self.tokens_manifest)
        return np.asarray(stream[:self.n])

    def setup(self, builder: ArtifactBuilder) -> None:
        n, d = self.n, self.model.hidden_size
        for key in FEATURE_KEYS:
            builder.array(key, np.float16, (n, d))
        builder.array("targets", np.int32, (n,))[:] = self.tokens().astype(np.int32)
        if self.with_logprob:
            builder.array("lm_logprob", np.float32, (n,))

    def work(self, rank: Rank, chunks: Iterator[tuple[int, dict]],
             arrays: dict[str, np.ndarray]) -> None:
        model = self.model.to(rank.device).eval()
        tokens = self.tokens()
        bos_id = int(self.tokens_manifest["bos_id"])
        for chunk, _ in chunks:
            window_range = (chunk * self.chunk_windows,
                            min((chunk + 1) * self.chunk_windows, self.n_windows))
            encode_into(arrays, encode_windows(model, tokens, bos_id, self.context, self.stride,
                                               window_range, self.batch_size,
                                               self.with_logprob, rank.device,
                                               self.bos_each_window),
                        str(self.out_dir / "lm_logprob.bin"))

    def extra(self, rank: Rank, done: dict[int, dict], wall_seconds: float) -> dict:
        identity = {**self.model.identity(), "location": self.location}
        # the softmax's size: a Hugging Face model may pad its vocabulary beyond the tokenizer's
        return {"n": self.n, "dim": self.model.hidden_size,
                "protocol": protocol(self.context, self.stride, self.bos_each_window),
                "bos_each_window": self.bos_each_window, "keys": list(FEATURE_KEYS),
                # the BOS rule every reader of the work directory applies (gnnlm.text.bos)
                "bos": BosRule(int(self.tokens_manifest["bos_id"]),
                               self.bos_each_window).record(),
                "base_lm": identity, "vocab_size": int(self.model.vocab_size),
                "seconds": wall_seconds, "devices": rank.world,
                "encode_seconds": round(float(totals(done).get("seconds", 0.0)), 2)}


class HostBatch(NamedTuple):
    """One encoded batch on its way to the host: the keys rounded to float16 on the device
    (half the bytes to copy; the same rounding, to nearest even, as on the host) and copied
    into pinned memory without waiting; ``arrived`` is set once the copies are done."""
    start: int
    final: torch.Tensor
    att: torch.Tensor
    logprob: Optional[torch.Tensor]
    arrived: Optional[torch.cuda.Event]

    @classmethod
    def of(cls, batch: EncodedBatch) -> HostBatch:
        device = batch.final.device
        if device.type != "cuda":  # the host, or a device without CUDA's events
            return cls(batch.start, batch.final.half().cpu(), batch.att.half().cpu(),
                       None if batch.logprob is None else batch.logprob.cpu(), None)

        def copy(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        final, att = copy(batch.final.half()), copy(batch.att.half())
        logprob = None if batch.logprob is None else copy(batch.logprob)
        arrived = torch.cuda.Event()
        arrived.record(torch.cuda.current_stream(device))
        return cls(batch.start, final, att, logprob, arrived)

    def write(self, arrays: dict[str, np.ndarray], logprob_file: str) -> None:
        """Into the position-indexed ``arrays``, once the copies have arrived; a log-probability
        that is not finite stops the build, naming ``logprob_file`` and the position."""
        if self.arrived is not None:
            self.arrived.synchronize()
        span = slice(self.start, self.start + self.final.shape[0])
        arrays["final"][span] = self.final.numpy()
        arrays["att"][span] = self.att.numpy()
        if self.logprob is not None and "lm_logprob" in arrays:
            values = self.logprob.numpy()
            check_finite(values, logprob_file,
                         "the base LM gives that target probability 0 or NaN (weights with "
                         "inf/NaN, or an overflow at this precision): check the checkpoint.",
                         start=self.start)
            arrays["lm_logprob"][span] = values


def encode_into(arrays: dict[str, np.ndarray], batches: Iterator[EncodedBatch],
                logprob_file: str) -> None:
    """Write every batch of ``batches`` (``encode_windows``) into ``arrays``, one behind: the
    host writes batch i - 1 while the device computes batch i, so on a GPU neither waits for
    the other (on a CPU the order of the same work). Every batch is written on return."""
    pending: Optional[HostBatch] = None
    for batch in batches:
        staged = HostBatch.of(batch)
        if pending is not None:
            pending.write(arrays, logprob_file)
        pending = staged
    if pending is not None:
        pending.write(arrays, logprob_file)


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
        # (.cpu(): a model placed by device_map keeps its weights on its GPU)
        builder.array("weight", np.float32, weight.shape)[...] = weight.detach().float().cpu()
        if bias is not None:
            builder.array("bias", np.float32, bias.shape)[...] = bias.detach().float().cpu()
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
def encode_text_positions(model: BaseLM, ids: np.ndarray, bos_id: int,
                          bos_each_window: bool = False) -> dict[str, np.ndarray]:
    """Features of ``[bos] + ids`` (its last ``context_length`` tokens, opening with BOS when
    the model reads one first in every window), float32 [rows, d]: row t predicts the token
    after stream[t], the last row the token after the text (for ``explain``)."""
    stream = torch.from_numpy(np.concatenate([[bos_id], ids]).astype(np.int64))[None]
    if model.context_length is not None:
        stream = stream[:, -model.context_length:]
    feats = model.eval()(open_with_bos(stream, bos_id) if bos_each_window else stream)
    return {"final": feats.final[0].float().numpy(), "att": feats.att[0].float().numpy()}
