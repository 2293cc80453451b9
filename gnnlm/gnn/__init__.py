"""GNN-LM (Meng et al. 2022): a GNN over the context and the train windows it retrieves.

- ``settings``: ``GraphConfig`` (the retrieval graph's shape) and ``PQConfig``;
- ``pq``: PQ codes of the train features, the window nodes' features;
- ``graph``: the graph's schema and its vectorised builder, with the leakage rule;
- ``layer``: the GNN-LM layer (eq. 1–4) by message passing, an HGT baseline, the stack;
- ``dense``: the same layer on the graph's regular layout, as batched dense ops;
- ``window_states``: evaluation with each retrieved window computed once.
"""
