"""A built work directory used as a language model: score any text, next-token distributions and
generation with every row of its report, from Python (``gnnlm.load``) and the command line
(``gnnlm score``, ``gnnlm generate``); kNN-LM inside Hugging Face ``generate()``
(``KNNLogitsProcessor``).

- ``served``: the rows a work directory's report scored and the settings fitted on valid;
- ``heads``: its trained heads, read back as ``nn.Module``s;
- ``model``: ``TrainedLM`` (``gnnlm.load``), its parts loaded when a row first needs them;
- ``scoring``: a text scored as the pipeline scored its splits;
- ``decoding``: the next-token distribution of text that grows, from scratch or incrementally;
- ``generation``: greedy and sampled generation; ``sampling``: its settings, checked without
  torch;
- ``hf``: kNN-LM as a Hugging Face ``LogitsProcessor``;
- ``commands``: ``gnnlm score`` and ``gnnlm generate``; ``explain``: ``gnnlm explain``.
"""
