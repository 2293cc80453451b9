"""Retrieval over the train datastore, and kNN-LM (Khandelwal et al. 2020; Xu et al. 2023).

- ``settings``: ``IndexConfig``, ``NeighborsConfig`` and the checks of metrics, T and λ;
- ``features``: the datastore, every position of every split encoded by the frozen base LM;
- ``search``: the similarity convention, exact search, ``Searcher`` with exact re-ranking;
- ``tuning``: search settings measured against exact search, the fastest that reaches the
  target recall;
- ``index``: the FAISS index over train keys, its ``auto`` choice and resumable build;
- ``multi_gpu``: one FAISS index sharded over the GPUs of a process;
- ``neighbors``: top-K neighbours of every split, train queries masked for leakage;
- ``knn_cache``: the per-token inputs of kNN-LM, with how their neighbours were searched;
- ``knn``: kNN-LM maths on arrays, the (k, T, λ) sweep fitted on valid.
"""
