"""Which pipeline stage reads which: the one declared graph that ``--rebuild`` closes downward.

An artifact is made from the artifacts it reads, so rebuilding one makes every artifact built
from it describe inputs the work directory no longer holds. ``--rebuild=[X]`` therefore rebuilds
X and every stage that reads X, directly or through another stage (``rebuild_set``), and the run
says which in one line before any work (``cascade_line``). A trained part (the base LM, a head,
the ablations' memory LM) that ``--rebuild`` does not name is in that set only through what it
reads: its weights were fit to those inputs, so it is retrained with them, and the line names it
as retrained.

The graph states what the stages' builders read (``gnnlm.pipeline.stages``): the features read
the tokens and the base LM; the index, the train features; the neighbours, the index and the
features; the kNN caches, the neighbours and the features; the PQ codes, the train features;
every head, what ``head_inputs`` names (features, train neighbours) and the token streams its data
module may open, and GNN-LM the PQ codes when its nodes read them; the ablations, the retrieval
artifacts and the memory LM. A test checks it against what each head of the test pipeline
must record reading (``tests/pipeline/test_identity.py``, checked there on that pipeline's
manifests).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from gnnlm.pipeline.fit_configs import check_fit_config
from gnnlm.pipeline.head_checks import reads_neighbors, reads_pq
from gnnlm.workdir import rows
from gnnlm.workdir.verify import find_artifacts

if TYPE_CHECKING:
    from gnnlm.pipeline.settings import PipelineSettings
    from gnnlm.workdir.layout import Workdir

# Every stage but the heads, in pipeline order, with the stages it reads.
STAGE_READS: dict[str, tuple[str, ...]] = {
    "tokens": (),
    "base_lm": ("tokens",),
    "features": ("tokens", "base_lm"),
    "index": ("features",),
    "neighbors": ("features", "index"),
    "knn_cache": ("features", "neighbors"),
    "pq": ("features",),
    # the heads come here, each a row (``head_reads``)
    "base_lm_xl": ("tokens",),
    "ablations": ("features", "index", "neighbors", "knn_cache", "base_lm_xl"),
}
HEADS_AFTER = "pq"  # the heads are built after this stage and before the next
# what every head reads: its fingerprinted inputs (``head_inputs``) and its data module's tokens
HEAD_READS: tuple[str, ...] = ("tokens", "features", "neighbors")
# the stages whose artifact is trained weights (besides the heads)
TRAINED = ("base_lm", "base_lm_xl")
# the folder under the work directory holding each stage's artifacts; a trained part's is
# models/<its folder>
FOLDERS = {"tokens": "tokens", "features": "features", "index": "index",
           "neighbors": "neighbors", "knn_cache": "knn_cache", "pq": "pq",
           "ablations": "ablations"}


def gnn_reads_pq(configs: list[str]) -> bool:
    """Whether GNN-LM's window nodes read the PQ codes (``head_checks.reads_pq`` of its parsed
    data module): then the pipeline builds them before it, and it reads them."""
    return reads_pq(check_fit_config(configs).data)


def heads_read_neighbors(cfg: PipelineSettings) -> bool:
    """Whether a head of this run reads the neighbours (``head_checks.reads_neighbors`` of its
    parsed data module): only then are the primary key's train queries searched."""
    return any(reads_neighbors(check_fit_config(configs).data)
               for configs in cfg.heads().values())


def head_reads(row: str, configs: list[str]) -> tuple[str, ...]:
    """The stages the head of ``row`` (trained with ``configs``) reads."""
    return HEAD_READS + (("pq",) if row == rows.GNN and gnn_reads_pq(configs) else ())


def stage_graph(cfg: PipelineSettings) -> dict[str, tuple[str, ...]]:
    """Every stage of this run, in pipeline order, with the stages it reads: ``STAGE_READS``
    with this run's heads, by row, after the PQ codes."""
    graph: dict[str, tuple[str, ...]] = {}
    for stage, reads in STAGE_READS.items():
        graph[stage] = reads
        if stage == HEADS_AFTER:
            graph.update({row: head_reads(row, configs) for row, configs in cfg.heads().items()})
    return graph


def named_stages(cfg: PipelineSettings, graph: dict[str, tuple[str, ...]]) -> set[str]:
    """The stages ``--rebuild`` names: ``all`` is every stage, ``heads`` every head and the
    ablations' memory LM."""
    if isinstance(cfg.rebuild, bool):
        return set(graph) if cfg.rebuild else set()
    named = set(cfg.rebuild)
    if "all" in named:
        return set(graph)
    if "heads" in named:
        named |= set(cfg.heads()) | {"base_lm_xl"}
    return named & set(graph)


def downstream(graph: dict[str, tuple[str, ...]], named: set[str]) -> set[str]:
    """``named`` and every stage of ``graph`` that reads one of them, directly or through
    another stage."""
    closed = set(named)
    changed = True
    while changed:  # the graph has a dozen stages: a few passes
        changed = False
        for stage, reads in graph.items():
            if stage not in closed and closed.intersection(reads):
                closed.add(stage)
                changed = True
    return closed


def rebuild_set(cfg: PipelineSettings) -> set[str]:
    """The stages this run rebuilds although complete: those ``--rebuild`` names, closed
    downward (``downstream``)."""
    graph = stage_graph(cfg)
    return downstream(graph, named_stages(cfg, graph))


def finished(workdir: Workdir, stage: str) -> bool:
    """Whether the work directory holds a complete artifact of ``stage``."""
    folder = (workdir.root / FOLDERS[stage] if stage in FOLDERS
              else workdir.model(rows.model_folder(stage)))
    return folder.is_dir() and bool(find_artifacts(folder)[0])


def cascade_line(cfg: PipelineSettings, workdir: Workdir) -> Optional[str]:
    """The one line that says which finished stages ``--rebuild`` also rebuilds because they
    read what it names, the trained ones among them named as retrained; None when there are
    none (or every stage is rebuilt: ``true``, ``all``)."""
    if isinstance(cfg.rebuild, bool) or "all" in cfg.rebuild:
        return None
    graph = stage_graph(cfg)
    named = named_stages(cfg, graph)
    also = [stage for stage in graph if stage in downstream(graph, named) - named
            and finished(workdir, stage)]
    if not also:
        return None
    read = [s for s in graph if s in named and downstream(graph, {s}) & set(also)]
    trained = [stage for stage in also if stage in TRAINED or stage in cfg.heads()]
    line = (f"--rebuild=[{','.join(cfg.rebuild)}] also rebuilds {', '.join(also)}, which "
            f"read{'s' if len(also) == 1 else ''} {' or '.join(read)} (directly or through "
            f"another stage)")
    if trained:
        line += (f"; {', '.join(trained)} {'is' if len(trained) == 1 else 'are'} retrained, as "
                 f"{'its' if len(trained) == 1 else 'their'} weights were fit to what is rebuilt")
    return line + "."
