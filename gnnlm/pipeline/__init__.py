"""``gnnlm pipeline`` and what reads its work directory: the config, the stages, the report.

- ``config``: the pipeline config's ``*Config`` dataclasses, the parser, ``load_config``;
- ``config_files``: ``gnnlm fit`` YAMLs read and merged as LightningCLI merges them;
- ``config_checks``: the checks at load that span several files, and the machine's;
- ``config_help``: the short ``--help`` and ``--help=SECTION``;
- ``arguments``: the commands' help, answered without importing their modules;
- ``stages``: every stage in order, each skipped when its artifact is complete;
- ``stage_times``: the wall time of each stage of a run (``stage_times.json``);
- ``training``: the trained parts (base LM and heads) through LightningCLI: identity, fit,
  resume, starting weights, and the parse of their configs;
- ``scoring``: a head's per-token scores on valid and test, its evaluation k and protocol;
- ``data_checks``: unknown tokens, near-copies of valid/test in the datastore, worse heads;
- ``ablations``: Xu et al. (2023)'s kNN-LM ablations, one table;
- ``rows``: the one registry of report rows: names, labels, order;
- ``results``: ``Results``, what the stages hand the report;
- ``report``: ``results.json``, ``results.md``, per-token scores and plots;
- ``sweep``: ``gnnlm sweep``, the λ × T × k grid from the kNN caches;
- ``explain``: ``gnnlm explain``, the train contexts a text retrieves.
"""
