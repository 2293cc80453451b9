"""Hand-made artifacts for unit tests: a features datastore like ``build_features`` writes."""
from __future__ import annotations

import hashlib

import numpy as np

from gnnlm.artifacts import ArtifactBuilder


def write_features(path, final, att=None, targets=None, lm_logprob=None,
                   lm=("fake-lm", "weights-a"), split="train") -> dict:
    """A features artifact at ``path`` with the manifest extras ``build_features`` writes.

    ``att`` defaults to ``final``, ``targets`` to zeros; ``lm`` = (name, fingerprint) of the
    base LM said to have made it.
    """
    n, d = final.shape
    att = final if att is None else att
    targets = np.zeros(n, dtype=np.int32) if targets is None else targets
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
                                     "base_lm": {"name": lm[0], "fingerprint": lm[1]}})
