"""From a corpus to token streams: the first stage of the pipeline.

- ``settings``: ``TokenizerConfig``, checked without the tokenizers library;
- ``corpus``: finding a corpus (a path, ``$GNNLM_DATA/<name>``, a download);
- ``text_files``: reading a text file, refused in one line when it is not UTF-8 text;
- ``tokens``: word, character, BPE and Hugging Face tokenizers; token streams in
  ``<workdir>/tokens``.
"""
