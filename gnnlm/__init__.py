"""gnnlm: retrieval-augmented language modelling (GNN-LM, kNN-LM, SPALM) on Lightning and PyG.

The sub-packages, from the bottom of the stack to the top: ``utils``, ``workdir`` (artifacts and
their folders), ``text`` (tokens), ``models`` (base LMs), ``retrieval`` (features, index,
neighbours, kNN-LM), ``gnn`` (GNN-LM), ``spalm``, ``lit`` (LightningModules), then the top-level
``datamodules``, ``pipeline`` (config, stages, report) and ``inference`` (a built work directory
used as a language model); ``cli`` is the ``gnnlm`` command.

``gnnlm.load(workdir)`` opens a work directory that ``gnnlm pipeline`` built: score any text,
next-token distributions and generation with each row of its report; ``gnnlm.KNNLogitsProcessor``
makes a Hugging Face base LM's ``generate()`` a kNN-LM.
"""
from typing import Any

# the configuration classes a checkpoint may hold register themselves where they are defined
# (gnnlm.workdir.checkpoints.checkpoint_safe): importing them here fills the registry whatever
# module a process imports first. All are standard library only.
import gnnlm.gnn.settings  # noqa: F401
import gnnlm.lit.settings  # noqa: F401
import gnnlm.text.settings  # noqa: F401

# what ``gnnlm.<name>`` gives, imported (with torch, faiss) when first asked for
_LAZY = {"load": "gnnlm.inference.model", "TrainedLM": "gnnlm.inference.model",
         "KNNLogitsProcessor": "gnnlm.inference.hf"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gnnlm' has no attribute {name!r}")
