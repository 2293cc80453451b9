"""SPALM (Yogatama et al. 2021): a language model gated with retrieved long-term memory.

- ``gate``: the gate over the retrieved values, on frozen features or inside the model;
- ``model``: SPALM trained end to end, a Transformer-XL (Dai et al. 2019) with the gate;
- ``analysis``: the paper's analyses of every SPALM row: histograms of the per-token mean
  gate, valid perplexity against k, frequency buckets.
"""
