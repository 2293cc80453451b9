"""The work directory: artifact folders, their paths, and the runs that write them.

- ``fingerprints``: fingerprints, file sha256, the artifacts this process read or built;
- ``refusals``: ``ArtifactError``, what differs and the ``--rebuild`` that remakes an artifact;
- ``manifests``: manifests with every file's sha256 and their own, read back and checked;
- ``integrity``: an artifact's files and sources against its manifest;
- ``builder``: ``ArtifactBuilder``, atomic completion (``<name>.partial`` → ``<name>``),
  resumable chunked builds;
- ``rows``: the report's rows, their names and labels, the ``models/`` folder of each trained
  row's head and the row each folder holds;
- ``layout``: ``Workdir``, the one owner of every artifact's path;
- ``lock``: one run per work directory (``flock`` on ``<workdir>/.lock``);
- ``checkpoints``: ``gnnlm fit`` checkpoints read as plain data, the classes they may hold;
- ``ranks``: one job on N processes (Lightning Fabric) or in this one;
- ``shards``: sharded resumable chunk loops, a progress file per rank;
- ``predates``: a manifest without its own checksum, read only where none has one;
- ``reports``: a report's seal (its sha256, the artifacts it was computed from) and its check;
- ``verify``: ``gnnlm verify``, every artifact's files against its manifest, every report's seal.
"""
