"""A built work directory used as a language model (gnnlm.inference), on the test pipeline's
WikiText-2 slice: every row's scores of the test split are the report's; the next-token
distribution sums to one and is the score at the target; generation step by step equals
computing each prefix from scratch, for every row; seeded sampling repeats; ``gnnlm score`` and
``gnnlm generate`` print what the Python API gives, refuse bad input in one line and never
write into the work directory or wait for its lock; the README's example runs."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import gnnlm
from gnnlm.models.protocols import layout
from gnnlm.workdir.manifests import open_array, read_manifest
from tests.conftest import REPO, run_gnnlm
from tests.fakes import error_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lm(workdir):
    return gnnlm.load(workdir)


@pytest.fixture(scope="module")
def test_ids(workdir) -> np.ndarray:
    """The test split's tokens, as many as the pipeline scored."""
    n = read_manifest(workdir / "features" / "test")["n"]
    return np.asarray(open_array(workdir / "tokens", "test")[:n], dtype=np.int64)


def sliding_rows(lm, results) -> list[str]:
    """The rows read with the base LM's sliding windows (not the segment protocol)."""
    base = layout(results["protocols"]["base"])
    return [row for row in lm.rows if layout(results["protocols"][row]) == base]


def test_every_row_gives_the_report_s_per_token_test_scores(lm, workdir, results, test_ids):
    """The API is the model the table describes: the test split's tokens, scored under each
    row's protocol, give the report's stored per-token log-probabilities, bit for bit (a head's
    through the very ``predict`` that scored the report), and its perplexities."""
    assert {"base", "knn", "knn[att]", "gnn", "gnn+knn", "spalm", "spalm_ft", "transformer",
            "transformer_xl", "spalm_xl", "spalm_xl_variant", "learned_wds",
            "learned_wds+base", "learned_wds[n=3]"} <= set(lm.rows)
    stored = np.load(workdir / "reports" / "tests" / "test_logprobs.npz")
    scores = lm.score(test_ids, lm.rows)
    for row in lm.rows:
        got = scores[row]
        np.testing.assert_array_equal(got.logprobs, stored[row], err_msg=row)
        assert got.ppl == pytest.approx(results["ppl"][row], rel=1e-5), row
        assert got.protocol == results["protocols"][row], row
    assert scores["gnn"].settings.gnn_k == results["gnn_eval_k"]["chosen"]
    fitted = results["hparams"]["knn"]
    assert (scores["knn"].settings.knn_k, scores["knn"].settings.knn_temperature,
            scores["knn"].settings.lam) == (fitted["k"], fitted["temperature"], fitted["lambda"])


def test_settings_override_the_fitted_ones_and_are_checked(lm, test_ids):
    text = test_ids[:300]
    fitted = lm.score(text, "knn")
    other = lm.score(text, "knn", knn_k=8, knn_temperature=1.0, lam=0.5)
    assert (other.settings.knn_k, other.settings.lam) == (8, 0.5)
    assert other.ppl != pytest.approx(fitted.ppl)
    # λ = 0 leaves the base LM, exactly
    np.testing.assert_array_equal(lm.score(text, "knn", lam=0.0).logprobs,
                                  lm.score(text, "base").logprobs)
    with pytest.raises(ValueError, match="choose knn_k <= 64"):
        lm.score(text, "knn", knn_k=65)
    with pytest.raises(ValueError, match=r"gnn_k = 3 changes nothing here: the row does not "
                                         r"read it \(it reads knn_k, knn_temperature, lam\)"):
        lm.score(text, "knn", gnn_k=3)
    with pytest.raises(ValueError, match="has no row 'gnn2'; its rows are base, knn"):
        lm.score(text, "gnn2")


def test_each_head_is_scored_once_per_call_and_each_row_name_parsed_once(workdir, test_ids,
                                                                        monkeypatch):
    """``gnn`` and ``gnn+knn`` in one call run GNN-LM's predict once, on the CPU as every part
    of a served work directory (on a GPU machine too, where Lightning's ``auto`` would take the
    GPU); a row's name is parsed (``rows.row``) when the report is read, never again below the
    door: scoring every row and generating under ``gnn+knn`` parse nothing."""
    from gnnlm.inference import scoring
    from gnnlm.workdir import rows

    lm = gnnlm.load(workdir)
    predicted = []
    predict = scoring.predict_tokens
    monkeypatch.setattr(scoring, "predict_tokens",
                        lambda module, *args, **kwargs: predicted.append(
                            (type(module).__name__, kwargs.get("accelerator")))
                        or predict(module, *args, **kwargs))
    parsed = []
    parse = rows.row
    monkeypatch.setattr(rows, "row", lambda name: parsed.append(name) or parse(name))
    scores = lm.score(test_ids[:200], ["gnn", "gnn+knn", "spalm", "learned_wds",
                                       "learned_wds+base"])
    assert predicted == [("GNNLM", "cpu"), ("SpalmLM", "cpu"), ("LearnedDatastoreLM", "cpu")]
    np.testing.assert_array_equal(lm.score(test_ids[:200], "gnn").logprobs, scores["gnn"].logprobs)
    lm.generate("The game", row="gnn+knn", max_new_tokens=2, greedy=True)
    assert parsed == []
    gnnlm.load(workdir)
    assert set(parsed) >= set(lm.rows)  # at the door


def test_the_next_token_distribution_sums_to_one_and_is_the_score_at_the_target(lm, results,
                                                                               test_ids):
    """Within the base LM's window both read the same context: the distribution after a prefix,
    at the token that follows, is that token's score (segment rows cut a text into streams and
    are left out)."""
    text = test_ids[:41]
    for row in sliding_rows(lm, results):
        scored = lm.score(text, row).logprobs[-1]
        dist = lm.next_token_logprobs(text[:-1], row)
        assert dist.shape == (lm.vocab_size,) and dist.dtype == torch.float32
        assert float(dist.exp().sum()) == pytest.approx(1.0, abs=1e-4), row
        assert float(dist[text[-1]]) == pytest.approx(float(scored), abs=1e-5), row


# rows whose heads read the base LM's features rounded to float16, as the datastore stores
# them: where the cache's float32 rounding crosses a float16 boundary, one coordinate moves by
# a float16 step (measured: probabilities 5e-5 apart at most, log-probabilities 1.2e-3)
ROUNDED_INPUTS = ("gnn", "gnn+knn", "spalm")  # and every learned_wds row


def test_each_generated_token_s_distribution_is_the_prefix_s_from_scratch(lm, test_ids):
    """Incremental decoding (KV caches, one search per token, GNN-LM's context nodes appended,
    SPALM's segments with memory) against next_token_logprobs of the same prefix: past the
    base LM's window of 64 (it slides), GNN-LM's block of 64 and SPALM's segment of 64."""
    prompt = test_ids[100:150]
    for row in lm.rows:
        out = lm.generate(prompt, row, max_new_tokens=24, greedy=True, keep_distributions=True)
        assert out.ids.shape == (24,) and out.distributions.shape == (24, lm.vocab_size)
        rounded = row in ROUNDED_INPUTS or row.startswith("learned_wds")
        for step in range(0, 24, 3):
            prefix = np.concatenate([prompt, out.ids[:step]])
            scratch = lm.next_token_logprobs(prefix, row)
            torch.testing.assert_close(out.distributions[step].exp(), scratch.exp(), rtol=0,
                                       atol=1e-4 if rounded else 1e-5,
                                       msg=f"{row}, step {step}")
            if not rounded:
                torch.testing.assert_close(out.distributions[step], scratch, rtol=0,
                                           atol=1e-4, msg=f"{row}, step {step}")
        np.testing.assert_allclose(out.logprobs, out.distributions.max(-1).values, atol=1e-6)


def test_sampling_with_a_seed_repeats_and_batches_decode_each_prompt_as_alone(lm):
    sample = {"temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 11}
    first = lm.generate("the game was", "knn", 12, **sample)
    assert lm.generate("the game was", "knn", 12, **sample).text == first.text
    prompts = ["the game was", "in the first", "he was born in the"]
    batch = lm.generate(prompts, "gnn+knn", 8, greedy=True)
    for prompt, out in zip(prompts, batch):
        alone = lm.generate(prompt, "gnn+knn", 8, greedy=True)
        assert out.text == alone.text
        np.testing.assert_allclose(out.logprobs, alone.logprobs, atol=1e-5)


def test_gnnlm_score_and_generate_print_what_the_api_gives(lm, workdir):
    text = "The game was released in Japan in 2011 .\nIt was well received .\n"
    printed = json.loads(run_gnnlm(["score", str(workdir), "--text", text, "--rows", "base",
                                    "knn", "gnn+knn", "--json"], REPO).stdout)
    scores = lm.score(text, ["base", "knn", "gnn+knn"])
    assert printed["tokens"] == scores["base"].tokens == 16  # 14 words, two <eos>
    assert printed["unk_share"] == pytest.approx(scores["base"].unk_share)
    for row, score in scores.items():
        assert printed["rows"][row]["ppl"] == pytest.approx(score.ppl, rel=1e-6)
    table = run_gnnlm(["score", str(workdir), "--text", text], REPO).stdout
    assert all(f"  {row} " in table for row in lm.rows)
    generated = run_gnnlm(["generate", str(workdir), "--prompt", "The game was", "--row",
                           "gnn+knn", "--max_new_tokens", "6", "--greedy", "--show-retrieval"],
                          REPO).stdout.splitlines()
    expected = lm.generate("The game was", "gnn+knn", 6, greedy=True)
    assert generated[0] == expected.text
    assert len(generated) == 7 and all("retrieved (sim " in line for line in generated[1:])
    assert all("[" in line and "]" in line for line in generated[1:])


def test_a_half_precision_base_lm_says_once_that_its_cache_rounds_otherwise(workdir):
    """Generation through a bf16 base LM's key/value cache is not a prefix read from scratch to
    float32's 1e-5: one note says so, and how to read every prefix from scratch."""
    import warnings

    lm = gnnlm.load(workdir)
    lm.features["base_lm"]["dtype"] = "bfloat16"   # as a bf16 Hugging Face model records it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm.next_token_logprobs("The game", "base")
        lm.generate("The game", "base", 2, greedy=True, incremental=False)
        assert caught == []
        lm.generate("The game", "base", 2, greedy=True)
        lm.generate("The game", "knn", 2, greedy=True)
    assert len(caught) == 1
    assert "computes in bfloat16" in str(caught[0].message)
    assert "incremental=False" in str(caught[0].message)


def test_reproduce_measures_the_served_scores_against_the_report(lm, workdir, results,
                                                                  tmp_path, capsys):
    """``gnnlm reproduce``: served where the work directory was built, every row's score of the
    test split is the report's to the bit, and a prefix's next-token score the report's to float
    rounding; the figures go to JSON (its bad input is in the table of
    ``test_bad_input_is_one_line_and_writes_nothing``)."""
    from gnnlm.cli import main

    out = tmp_path / "reproduce.json"
    main(["reproduce", str(workdir), "--rows", "base", "knn", "gnn+knn", "--decode", "gnn+knn",
          "--positions", "8", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert figures["tokens"] == results["tokens"] and figures["built_on"] == "cpu"
    for row in ("base", "knn", "gnn+knn"):
        assert figures["rows"][row]["equal"] and figures["rows"][row]["max_abs"] == 0, row
        assert figures["rows"][row]["report_ppl"] == results["ppl"][row]
    decoded = figures["decoding"]["gnn+knn"]
    assert decoded["positions"] == 8 and decoded["max_abs"] < 1e-4
    printed = capsys.readouterr().out.splitlines()
    assert printed[1].startswith("  score    base")
    assert "equal: max |Δ log p| 0.00e+00" in printed[1]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file's size and modification time (the lock file, which runs write, aside)."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and p.name != ".lock"}


def test_reading_takes_no_lock_and_writes_nothing(workdir):
    from gnnlm.workdir.lock import lock_workdir

    before = snapshot(workdir)
    held = lock_workdir(workdir, "pipeline")  # as a running pipeline holds it
    try:
        run_gnnlm(["score", str(workdir), "--text", "the game", "--rows", "gnn"], REPO,
                  timeout=600)
        run_gnnlm(["generate", str(workdir), "--prompt", "the game", "--row", "spalm_xl",
                   "--max_new_tokens", "3"], REPO, timeout=600)
    finally:
        held.release()
    assert snapshot(workdir) == before


@pytest.mark.parametrize("args,message", [
    (["score", "{empty}", "--text", "a"], "is not a built gnnlm work directory: it holds no "
                                          "reports/<name>/results.json"),
    (["score", "{missing}", "--text", "a"], "does not exist: give the work directory"),
    (["score", "{workdir}", "--text", "a", "--rows", "gnn", "bogus"],
     "has no row 'bogus'; its rows are base, knn, knn[att], gnn, gnn+knn"),
    (["generate", "{workdir}", "--prompt", "a", "--row", "bogus"], "has no row 'bogus'"),
    (["score", "{workdir}", "--text", "  \n"], "the text is empty"),
    (["score", "{workdir}", "--file", "{latin1}"], "is not UTF-8 text: byte 0xe9 at offset 7"),
    (["score", "{workdir}", "--file", "{missing}"], "No file"),
    (["generate", "{workdir}", "--prompt", "a", "--top_p", "1.5"], r"top_p must lie in (0, 1]"),
    (["generate", "{workdir}", "--prompt", "a", "--top_p", "0"], r"top_p must lie in (0, 1]"),
    (["generate", "{workdir}", "--prompt", "a", "--max_new_tokens", "0"],
     "max_new_tokens must be at least 1 (got 0)"),
    (["score", "{workdir}"], "one of the arguments --text --file is required"),
    (["reproduce", "{workdir}", "--decode", "bogus"], "has no row 'bogus'"),
    (["reproduce", "{empty}"], "is not a built gnnlm work directory"),
    (["reproduce", "{workdir}", "--positions", "0"], "--positions must be at least 1 (got 0)"),
    (["reproduce", "{workdir}", "--json", "{missing}/served.json"],
     "its folder does not exist"),
])
def test_bad_input_is_one_line_and_writes_nothing(args, message, workdir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "latin1.txt").write_bytes("the caf\xe9 was open\n".encode("latin-1"))
    names = {"workdir": str(workdir), "empty": str(tmp_path / "empty"),
             "missing": str(tmp_path / "nowhere"), "latin1": str(tmp_path / "latin1.txt")}
    before = snapshot(workdir)
    line = error_of([a.format(**names) for a in args], capsys)
    assert line.startswith(f"gnnlm {args[0]}: error: ") and message in line, line
    assert snapshot(workdir) == before and not list((tmp_path / "empty").iterdir())


def test_the_readme_example_runs(workdir, capsys):
    """The README's "Use a trained model" code, on the test pipeline's work directory."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Use a trained model"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(code.replace('"runs/wikitext2-cpu"', repr(str(workdir))), {})
    printed = capsys.readouterr().out
    assert "ppl" in printed and printed.count("\n") >= 3
