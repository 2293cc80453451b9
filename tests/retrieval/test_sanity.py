"""Whether retrieval discriminates (gnnlm.retrieval.sanity), the report's warning when it does
not, the report's plots, and the words results.md, the printed table and sweep.md use for the
same caches' neighbours and scores."""
from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from gnnlm.pipeline.report import PLOTS, print_table, write_report
from gnnlm.retrieval import sanity
from gnnlm.retrieval.knn import default_temperatures
from tests.conftest import REPO, run_gnnlm
from tests.pipeline.test_report import _results


def test_the_spread_of_a_query_s_top_k_and_the_share_that_lies_flat():
    sims = np.array([[0.9, 0.5, 0.1, 0.0],            # spread 0.4 at k = 2, 0.9 at k = 4
                     [1.0, 1.0 - 5e-5, 1.0 - 2e-4, 0.2],  # flat at k = 2, not at k = 3
                     [0.3, 0.7, 0.5, 0.6],              # unsorted (exact scores, index order)
                     [0.8, -np.inf, -np.inf, -np.inf]], dtype=np.float32)  # one neighbour
    assert sanity.spread(sims, 2) == pytest.approx([0.4, 5e-5, 0.4, np.nan], abs=1e-6,
                                                   nan_ok=True)
    at_2 = sanity.similarity_spread(sims, 2, tolerance=1e-4)
    assert at_2["queries"] == 3 and at_2["flat_share"] == pytest.approx(1 / 3)
    assert at_2["median_spread"] == pytest.approx(0.4, abs=1e-6)
    at_3 = sanity.similarity_spread(sims, 3, tolerance=1e-4)
    assert at_3["flat_share"] == 0.0
    assert sanity.similarity_spread(sims[3:], 2, 1e-4)["queries"] == 0
    # the tolerance: 5% of the smallest T of the metric's grid, 1e-4 for cosine
    assert sanity.flat_tolerance("cos") == pytest.approx(1e-4)
    assert sanity.flat_tolerance("l2") == pytest.approx(0.05 * min(default_temperatures("l2")))


def _cache(flat: bool, n: int = 2000, K: int = 16, seed: int = 0) -> dict:
    """A cosine kNN cache: top-1 near 1 and, when ``flat``, every neighbour within 1e-5 of it
    (keys that all point the same way); otherwise neighbours a few hundredths apart, the
    target's value on the best ones."""
    rng = np.random.default_rng(seed)
    step = 1e-6 if flat else 3e-3
    sims = 0.999 - np.cumsum(rng.uniform(0.2, 1.0, (n, K)) * step, axis=1)
    hits = rng.random((n, K)) < np.linspace(0.5, 0.05, K)[None]
    lm = np.log(rng.uniform(0.005, 0.3, n))
    return {"sims": sims.astype(np.float32), "hits": hits, "lm_logprob": lm.astype(np.float32)}


GRID = ([4, 16], default_temperatures("cos"), [0.0, 0.1, 0.25, 0.5])


def test_keys_that_all_point_the_same_way_are_degenerate_and_t_changes_nothing():
    measured = sanity.retrieval_sanity(_cache(flat=True), "cos",
                                       {"k": 16, "temperature": 0.002, "lambda": 0.25}, GRID)
    facts = measured.facts
    assert facts["degenerate"] and facts["flat_share"] == 1.0
    assert facts["spread_at_k"] < 2e-5 and facts["temperature_on_grid_edge"]
    assert facts["temperature_effect"] < 1e-3
    assert measured.valid_grid.shape == (len(GRID[1]), len(GRID[2]))
    # every row of the λ × T grid alike: T has no effect
    assert np.ptp(measured.valid_grid, axis=0).max() < 1e-3 * measured.valid_grid.min()


def test_neighbours_hundredths_apart_are_not_degenerate_and_t_matters():
    facts = sanity.retrieval_sanity(_cache(flat=False), "cos",
                                    {"k": 16, "temperature": 0.01, "lambda": 0.25}, GRID).facts
    assert not facts["degenerate"] and facts["flat_share"] == 0.0
    assert facts["spread_at_k"] > 1e-2 and not facts["temperature_on_grid_edge"]
    assert facts["temperature_effect"] > 0.01


def _with_sanity(tmp_path, flat: bool):
    wd, results = _results(tmp_path)
    results.retrieval_sanity["final"] = sanity.retrieval_sanity(
        _cache(flat, n=200), "cos", {"k": 4, "temperature": 0.01, "lambda": 0.25}, GRID)
    return wd, results


def test_a_degenerate_key_is_warned_of_in_results_json_md_and_the_printed_table(tmp_path,
                                                                                capsys):
    wd, results = _with_sanity(tmp_path, flat=True)
    report = write_report(wd, results)
    warned = [w for w in report["warnings"] if w["kind"] == "degenerate_retrieval"]
    assert len(warned) == 1 and warned[0]["key"] == "final"
    assert report["retrieval_sanity"]["final"]["row"] == "knn"
    said = warned[0]["message"]
    assert "+kNN's gain is smoothing" in said and "train it longer" in said
    assert f"- ⚠ {said}" in (wd.report("run") / "results.md").read_text()
    print_table(report, wd)
    assert f"⚠ {said}" in capsys.readouterr().out
    assert json.loads((wd.report("run") / "results.json").read_text())["warnings"] == \
        report["warnings"]


def test_a_discriminating_key_is_not_warned_of_and_every_report_writes_its_plots(tmp_path):
    wd, results = _with_sanity(tmp_path, flat=False)
    report = write_report(wd, results)
    assert not report["retrieval_sanity"]["final"]["degenerate"]
    assert not [w for w in report["warnings"] if w["kind"] == "degenerate_retrieval"]
    out = wd.report("run")
    expected = {name.format(key="final") for name in PLOTS}
    assert expected <= set(report["plots"])
    for name in report["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Plots: " in (out / "results.md").read_text()


@pytest.mark.integration
def test_an_lm_trained_80_steps_gives_a_degenerate_datastore_the_report_warns_of(
        wikitext_root, tmp_path):
    """The README's own-corpus example on a WikiText-2 slice (its 2-layer base LM trained 80
    steps): its `final` keys all point the same way; the report warns, writes its plots, and
    results.md, the printed table and sweep.md name the neighbours and scores alike."""
    corpus = tmp_path / "my-corpus"
    corpus.mkdir()
    for split, lines in (("train", 1500), ("valid", 150), ("test", 150)):
        text = (wikitext_root / "wikitext-2" / f"{split}.txt").read_text()
        (corpus / f"{split}.txt").write_text("\n".join(text.split("\n")[:lines]) + "\n")
    (tmp_path / "configs").symlink_to(REPO / "configs")
    config = "configs/examples/own_corpus/pipeline.yaml"
    args = shlex.split((REPO / config).read_text().splitlines()[0].removeprefix("# "))[1:]
    args = [f"--corpus.path={corpus}" if a.startswith("--corpus.path=") else a for a in args]
    args += ["--gnn.config=null", "--neighbors.train_queries=1000"]  # kNN-LM alone: no heads
    printed = run_gnnlm(args, tmp_path, timeout=900).stdout
    report = tmp_path / "runs" / "my-corpus" / "reports" / "my-corpus"
    results = json.loads((report / "results.json").read_text())
    facts = results["retrieval_sanity"]["final"]
    # measured: 38% of valid queries flat at k = 64, T changes valid ppl by 0.08%
    assert facts["degenerate"] and facts["temperature_effect"] < 0.005
    warned = [w for w in results["warnings"] if w["kind"] == "degenerate_retrieval"]
    assert len(warned) == 1
    assert warned[0]["message"] in (report / "results.md").read_text()
    assert warned[0]["message"] in printed
    for name in PLOTS:
        assert (report / name.format(key="final")).stat().st_size > 0

    run_gnnlm(["sweep", "-c", config, f"--corpus.path={corpus}", *args[-2:]], tmp_path)
    sweep_md = (report / "sweep" / "sweep.md").read_text()
    hp = results["hparams"]["knn"]
    words = f"{hp['neighbours']} + {hp['scores']} scores"
    assert f"key final, cos: {words}" in sweep_md
    assert "Note: T changes valid perplexity by" in sweep_md       # 0.08% measured
    assert f"+kNN: {words}" in printed
    markdown = (report / "results.md").read_text()
    assert f"neighbours={hp['neighbours']}, scores={hp['scores']}" in markdown
    # a Flat index's measured agreement sits beside "exact neighbours", not as "recall"
    retrieval = markdown.split("\nRetrieval:\n", 1)[1]
    assert "exact neighbours (index Flat: every key scored)" in retrieval
    assert "against exact search" not in retrieval and "faiss scores" not in sweep_md


def test_a_flat_index_s_line_says_exact_neighbours_and_gives_its_agreement_not_recall():
    """A Flat index scores every key: its neighbours are the exact ones, as the kNN-LM rows'
    label says; what the index stage measured against exact search is agreement (ties), not the
    recall of an approximate search."""
    from gnnlm.pipeline.ablations import neighbours_label
    from gnnlm.pipeline.report import _retrieval_facts
    from gnnlm.pipeline.report_markdown import _retrieval_line
    from gnnlm.pipeline.results import KeyRetrieval

    table = [{"nprobe": 1, "rerank": 0.0, "depth": 128, "recall@10": 0.9494, "recall@100": 0.97,
              "recall@64": 0.96, "queries_per_s": 900.0}]
    index = {"factory": "Flat", "tuning": table}
    test = {"backend": "index", "factory": "Flat", "nprobe": 1, "rerank": 0.0, "K": 64,
            "queries_per_s": 1000.0}
    line = _retrieval_line("final", _retrieval_facts(KeyRetrieval(index, {"test": test}, {})))
    assert neighbours_label(test) == "exact neighbours"
    assert line.startswith("- key final: exact neighbours (index Flat: every key scored), K = 64")
    assert "0.9494/0.97/0.96 of neighbours (the rest tie" in line
    assert "recall" not in line and "nprobe" not in line and "re-ranking" not in line
