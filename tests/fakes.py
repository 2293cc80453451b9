"""Hand-made artifacts for unit tests: a features datastore like ``build_features`` writes, the
base LM's output embedding, a ``gnnlm fit``-style checkpoint of a tiny built-in LM, a corpus
folder; ``randomise``, a GNN stack with no parameter at its initial value; and ``error_of``,
which runs ``gnnlm`` and returns its one error line."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from gnnlm.cli import main
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.manifests import MANIFEST_SHA256
from gnnlm.workdir.predates import own_manifests, work_directory_of


def as_older_code_wrote_it(path, edit) -> dict:
    """Rewrite the manifest of the artifact at ``path`` as an older gnnlm wrote it: ``edit``
    applied to it (a function of the dict), and without the checksum of its own content, which
    older manifests did not have; so are the other manifests of its work directory (its own
    folders), as an older gnnlm wrote them too (one without its checksum among manifests with
    theirs is refused). Returns the manifest written."""
    file = path / "manifest.json"
    manifest = json.loads(file.read_text())
    edit(manifest)
    manifest.pop(MANIFEST_SHA256, None)
    file.write_text(json.dumps(manifest))
    for other, _, _ in own_manifests(work_directory_of(path)):
        content = json.loads(other.read_text())
        if content.pop(MANIFEST_SHA256, None) is not None:
            other.write_text(json.dumps(content))
    return manifest


def write_features(path, final, att=None, targets=None, lm_logprob=None,
                   lm=("fake-lm", "weights-a"), split="train", vocab_size=None) -> dict:
    """A features artifact at ``path`` (e.g. ``workdir.features(split)``) with the manifest
    extras ``build_features`` writes.

    ``att`` defaults to ``final``, ``targets`` to zeros, ``vocab_size`` to the largest target
    + 1; ``lm`` = (name, fingerprint) of the base LM said to have made it.
    """
    n, d = final.shape
    att = final if att is None else att
    targets = np.zeros(n, dtype=np.int32) if targets is None else targets
    vocab_size = int(np.max(targets, initial=0)) + 1 if vocab_size is None else vocab_size
    digest = hashlib.sha256(np.ascontiguousarray(final).tobytes()).hexdigest()[:16]
    builder = ArtifactBuilder(path, kind="features", config={"split": split},
                              inputs={"base_lm": lm[0], "base_lm_fingerprint": lm[1],
                                      "data": digest})
    with builder:
        builder.array("final", np.float16, (n, d))[:] = final
        builder.array("att", np.float16, (n, d))[:] = att
        builder.array("targets", np.int32, (n,))[:] = targets
        if lm_logprob is not None:
            builder.array("lm_logprob", np.float32, (n,))[:] = lm_logprob
        return builder.finish(extra={"n": n, "dim": d, "keys": ["final", "att"],
                                     "vocab_size": vocab_size,
                                     "base_lm": {"name": lm[0], "fingerprint": lm[1]}})


def write_output_embedding(workdir, weight, bias=None, lm=("fake-lm", "weights-a")) -> dict:
    """The ``output_embedding`` artifact ``build_output_embedding`` writes, from arrays."""
    weight = np.asarray(weight, dtype=np.float32)
    builder = ArtifactBuilder(workdir.output_embedding, kind="output_embedding",
                              inputs={"base_lm_fingerprint": lm[1]})
    with builder:
        builder.array("weight", np.float32, weight.shape)[...] = weight
        if bias is not None:
            builder.array("bias", np.float32, np.shape(bias))[...] = bias
        return builder.finish(extra={"base_lm": {"name": lm[0], "fingerprint": lm[1]},
                                     "vocab_size": int(weight.shape[0]),
                                     "dim": int(weight.shape[1])})


def save_lm_checkpoint(path, seed=0, **sizes):
    """A tiny built-in LM saved as a ``gnnlm fit`` checkpoint (what ``load_base_lm`` reads).

    Returns ``(str(path), the LanguageModel)``; ``sizes`` override the GPT hyper-parameters.
    """
    import pytorch_lightning as pl
    import torch

    from gnnlm.lit.lm import LanguageModel

    torch.manual_seed(seed)
    args = {"vocab_size": 50, "context_length": 16, "n_layer": 3, "n_head": 2, "d_model": 16,
            "d_ff": 32, "dropout": 0.2, **sizes}
    lm = LanguageModel(**args)
    torch.save({"state_dict": lm.state_dict(), "hyper_parameters": dict(lm.hparams),
                "pytorch-lightning_version": pl.__version__}, path)
    return str(path), lm


def error_of(args, capsys) -> str:
    """Run ``gnnlm args``; it must exit with status 2 and print exactly one error line."""
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if line.startswith("gnnlm ")]
    assert len(errors) == 1 and lines[-1] == "(rerun with --debug for the traceback)", lines
    return errors[0]


def write_corpus(root, **splits):
    """A corpus folder of train/valid/test.txt (``splits`` overrides a split's text or bytes)."""
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        text = splits.get(split, "the cat sat on the mat\n")
        (root / f"{split}.txt").write_bytes(text if isinstance(text, bytes) else text.encode())
    return root


def randomise(stack, seed=0):
    """Every parameter of a ``GNNStack`` random, the initial identities included: W^ATT and
    W^FEA start at I and μ at 1 for every relation (eq. 2–3), which would hide a path that reads
    one relation's (or edge type's) parameters for another's. Scaled to keep the softmax away
    from one-hot."""
    g = torch.Generator().manual_seed(seed)

    def noise(p, scale):
        return scale * torch.randn(p.shape, generator=g, dtype=p.dtype)

    with torch.no_grad():
        for name, p in stack.named_parameters():
            if ".w_att." in name or ".w_fea." in name:               # [H, D_h, D_h]
                p.copy_(noise(p, 1 / p.shape[-1] ** 0.5))
            elif ".mu." in name:                                      # [H], per edge type
                p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=g, dtype=p.dtype))
            elif ".norm." in name:                                    # LayerNorm weight, bias
                p.copy_((1.0 if name.endswith("weight") else 0.0) + noise(p, 0.3))
            else:                                                     # W^q, W^k, W^v, W^o
                p.copy_(noise(p, 1 / p.shape[-1] ** 0.5))
    return stack
