"""LightningModules: they wire the library's nn.Modules to the training loop and hold no maths.

- ``base.TokenLevelModule``: loss, token-weighted val/test perplexity, predict, the optimiser;
- ``lm.LanguageModel``: the built-in GPT base LM (optionally with Transformer-XL memory);
- ``gnn.GNNLM``: GNN-LM on the retrieval graph;
- ``heads``: SPALM's gate on frozen features or with the last block fine-tuned, learned W_ds;
- ``spalm.SpalmXL``: SPALM trained end to end (Transformer-XL + gate), and its baselines.
"""
