"""gnnlm: retrieval-augmented language modelling (GNN-LM, kNN-LM, SPALM) on Lightning and PyG.

The sub-packages, from the bottom of the stack to the top: ``utils``, ``workdir`` (artifacts and
their folders), ``text`` (tokens), ``models`` (base LMs), ``retrieval`` (features, index,
neighbours, kNN-LM), ``gnn`` (GNN-LM), ``spalm``, ``lit`` (LightningModules), then the top-level
``datamodules``, and ``pipeline`` (config, stages, report); ``cli`` is the ``gnnlm`` command.
"""
# the configuration classes a checkpoint may hold register themselves where they are defined
# (gnnlm.workdir.checkpoints.checkpoint_safe): importing them here fills the registry whatever
# module a process imports first. Both are standard library only.
import gnnlm.gnn.settings  # noqa: F401
import gnnlm.text.settings  # noqa: F401
