"""LightningModules: they wire the library's nn.Modules to the training loop and hold no maths.

- ``base.TokenLevelModule``: loss, token-weighted val/test perplexity, predict, the optimiser;
- ``lm.LanguageModel``: the built-in GPT base LM (optionally with Transformer-XL memory);
- ``gnn.GNNLM``: GNN-LM on the retrieval graph;
- ``heads``: SPALM's gate on frozen features or with the last block fine-tuned, learned W_ds;
- ``spalm.SpalmXL``: SPALM trained end to end (Transformer-XL + gate), and its baselines;
- ``memory.SegmentMemory``: the Transformer-XL memory both memory models carry between segments;
- ``gates.PerTokenGate``: the per-token mean gate every SPALM model predicts;
- ``datastore.AttachDatastore``: the callback that hands a model the datastore's arrays;
- ``optim``: AdamW with warmup + cosine decay, and parameter groups with their own rate;
- ``progress_log.ProgressLog``: progress lines where a bar cannot be seen;
- ``config_errors``: an unknown key of a ``gnnlm fit`` config said with its section;
- ``cli.GnnlmCLI``: LightningCLI with the links from data modules to models.
"""

# LightningCLI's subcommands (``gnnlm fit`` ...), here so that the ``gnnlm`` command can name them
# without importing Lightning, and ``cli.GnnlmCLI`` without importing the command above it
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
