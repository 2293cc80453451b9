"""The README's demo numbers are those of the committed run, ``results/wikitext2-cpu/``
(``make demo`` from an empty work directory on a clean clone of the commit the run names): its
tables, its retrieval facts and its stage times, every one compared with the files."""
from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO

RUN = REPO / "results" / "wikitext2-cpu"
MINUS = "\N{MINUS SIGN}"


def _signed(value: float, digits: int = 2) -> str:
    """A number as the README writes it: a minus sign, not a hyphen."""
    return f"{value:.{digits}f}".replace("-", MINUS)


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads((RUN / "results.json").read_text())


@pytest.fixture(scope="module")
def stage_times() -> dict:
    return json.loads((RUN / "stage_times.json").read_text())


@pytest.fixture(scope="module")
def section() -> str:
    """The README's section on the demo, up to the next section."""
    text = (REPO / "README.md").read_text()
    start = text.index("### On a 2-core CPU: `make demo`")
    return text[start:text.index("\n### ", start + 1)]


def test_the_run_names_a_commit_of_this_repository_and_had_no_changes(results, stage_times,
                                                                       section):
    made_by = results["made_by"]
    assert made_by == stage_times["made_by"] and made_by["dirty"] is False
    assert f"`make demo` on a clean clone of commit {made_by['commit'][:7]}" in section
    assert (RUN / "results.md").read_text().endswith(
        f"Written by gnnlm {made_by['gnnlm']}, commit {made_by['commit'][:12]}.\n")


def test_the_demo_table_is_the_committed_run_s(results, section):
    ppl, valid, hp = results["ppl"], results["valid_ppl"], results["hparams"]
    base = ppl["base"]

    def row(label: str, name: str) -> str:
        change = "" if name == "base" else _signed((ppl[name] / base - 1) * 100, 1) + "%"
        return f"| {label} | {valid[name]:.2f} | {ppl[name]:.2f} |" + (
            f" {change} |" if change else " |")

    knn, gnn_knn = hp["knn"], hp["gnn+knn"]
    assert [line for line in section.splitlines() if line.startswith("| base LM |")] == [
        row("base LM", "base")]
    expected = [
        row(f"+kNN (k = {knn['k']}, T = {knn['temperature']:g}, λ = {knn['lambda']:g}, "
            f"`{knn['key']}` keys, {knn['similarity']})", "knn"),
        row(f"+GNN (trained with k = 16, evaluated with k = {results['gnn_eval_k']['chosen']})",
            "gnn"),
        row(f"+GNN+kNN (λ = {gnn_knn['lambda']:g})", "gnn+knn")]
    for line in expected:
        assert line in section
    assert f"Every row scores the same {results['tokens']:,} test tokens" in section


def test_the_evaluation_k_table_is_the_committed_run_s(results, section):
    curve = results["gnn_eval_k"]
    ks = sorted(curve["valid_ppl"], key=int)
    cells = [f"**{curve['valid_ppl'][k]:.2f}**" if int(k) == curve["chosen"]
             else f"{curve['valid_ppl'][k]:.2f}" for k in ks]
    assert f"| k at evaluation | {' | '.join(ks)} |" in section
    assert f"| valid ppl | {' | '.join(cells)} |" in section
    seconds = [f"{curve['seconds'][k]:.0f}" for k in ks]
    assert f"| seconds | {' | '.join(seconds)} |" in section


def test_the_recall_buckets_are_the_committed_run_s(results, section):
    for bucket in results["knn_recall_buckets"]:
        low, high = bucket["recall_range"]
        recall = f"{low}" if low == high else f"{low}–{high}"
        assert (f"| {recall} | {bucket['tokens']:,} | {_signed(bucket['base_logprob'])} | "
                f"{_signed(bucket['model_logprob'])} |") in section


def test_the_retrieval_facts_are_the_committed_run_s(results, section):
    final = results["retrieval"]["final"]
    recall = final["recall"]
    leakage = results["gnn_leakage"]
    for said in (f"nprobe {final['nprobe']}", f"recall@10 {recall['recall@10']:.3f}",
                 f"recall@100 {recall['recall@100']:.3f}",
                 f"{final['queries_per_s']:,.0f} queries/s",
                 f"{final['masked_fraction']:.2%} of train neighbours were masked",
                 f"replaced {leakage['windows_replaced']:.2%} of retrieved windows",
                 f"dropped {leakage['nodes_dropped']:.2%} of window nodes"):
        assert said in " ".join(section.split())


def test_the_stage_times_are_the_committed_run_s(stage_times, section):
    seconds = {s["stage"]: s["seconds"] for s in stage_times["stages"]}
    total = round(stage_times["total_seconds"])
    text = " ".join(section.split())
    assert f"`make demo` took {total // 60} min {total % 60} s" in text
    for label, stage in (("base LM", "base_lm"), ("features of the three splits", "features"),
                         ("index", "index[final]"), ("neighbours", "neighbors[final]"),
                         ("kNN caches", "knn_cache[final]"), ("GNN-LM", "gnn")):
        assert re.search(rf"\b{re.escape(label)} {seconds[stage]:,.0f} s\b", text), label


SMOLLM2 = REPO / "results" / "wikitext2-smollm2-cpu"


@pytest.fixture(scope="module")
def smollm2() -> dict:
    return json.loads((SMOLLM2 / "results.json").read_text())


@pytest.fixture(scope="module")
def smollm2_section() -> str:
    """The README's section on SmolLM2-135M as the base LM, up to the next section."""
    text = (REPO / "README.md").read_text()
    start = text.index("### SmolLM2-135M as the frozen base LM")
    return text[start:text.index("\n### ", start + 1)]


def test_the_smollm2_run_names_its_commit_and_had_no_changes(smollm2, smollm2_section):
    made_by = smollm2["made_by"]
    stage_times = json.loads((SMOLLM2 / "stage_times.json").read_text())
    assert made_by == stage_times["made_by"] and made_by["dirty"] is False
    assert f"a clean clone of commit {made_by['commit'][:7]}" in smollm2_section
    total = round(stage_times["total_seconds"])
    assert f"took {total // 60} min {total % 60} s" in " ".join(smollm2_section.split())


def test_the_smollm2_table_is_the_committed_run_s(smollm2, smollm2_section):
    """Every row per token and per word, each fitted setting, and the tokens and words scored."""
    ppl, valid, per_word, hp = (smollm2["ppl"], smollm2["valid_ppl"], smollm2["ppl_per_word"],
                                smollm2["hparams"])
    base = ppl["base"]

    def row(label: str, name: str) -> str:
        change = "" if name == "base" else _signed((ppl[name] / base - 1) * 100, 1) + "%"
        return (f"| {label} | {valid[name]:.2f} | {ppl[name]:.2f} | {per_word[name]:.2f} |"
                f"{f' {change} |' if change else ' |'}")

    knn, att, gnn_knn = hp["knn"], hp["knn[att]"], hp["gnn+knn"]
    expected = [
        row("base LM", "base"),
        row(f"+kNN (k = {knn['k']}, T = {knn['temperature']:g}, λ = {knn['lambda']:g}, "
            f"`final` keys)", "knn"),
        row(f"+kNN (k = {att['k']}, T = {att['temperature']:g}, λ = {att['lambda']:g}, "
            f"`att` keys)", "knn[att]"),
        row(f"+GNN (evaluated with k = {smollm2['gnn_eval_k']['chosen']})", "gnn"),
        row(f"+GNN+kNN (λ = {gnn_knn['lambda']:g})", "gnn+knn")]
    for line in expected:
        assert line in smollm2_section
    words, tokens = smollm2["words"], smollm2["scored_tokens"]
    text = " ".join(smollm2_section.split())
    assert f"the same {tokens['test']:,} test tokens ({words['test']:,} words)" in text
    assert f"first {tokens['valid']:,} valid tokens" in text


def test_the_smollm2_datastore_curve_is_the_committed_run_s(smollm2, smollm2_section):
    curve = smollm2["ablations"]["subsample_curve"]
    base = smollm2["ablations"]["rows"][0]["test_ppl"]
    lines = smollm2_section.splitlines()
    for point in curve:
        change = _signed((point["test_ppl"] / base - 1) * 100, 1)
        line = next(x for x in lines if x.startswith(f"| {point['fraction']:.0%} | "))
        assert line.endswith(f" | {point['test_ppl']:.2f} | {change}% |"), line
