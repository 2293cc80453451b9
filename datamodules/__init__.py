"""The Lightning data modules: one layer of the stack, between ``gnnlm.lit`` and
``gnnlm.pipeline``.

    utils < workdir < text < models < retrieval < gnn < spalm < lit < datamodules < pipeline
      < inference < cli

The package stays beside ``gnnlm/`` (a ``gnnlm fit`` YAML names a data module as
``datamodules.<module>.<Class>``), but its imports follow the layer rule as if it were
``gnnlm.datamodules``: a data module may import the library below ``gnnlm.lit`` (token streams,
the base LM's protocols, features, neighbours, graphs, the work directory) and ``gnnlm.lit``
itself, never ``gnnlm.pipeline``, ``gnnlm.inference`` or the CLI; ``gnnlm.pipeline.runner`` runs
them through LightningCLI. ``tests/test_layers.py`` checks it with the rest of the package.

A data module serves the data, and a model never reads it: what a model needs of the data is
linked into its init arguments by ``gnnlm.lit.cli.GnnlmCLI``.
"""
