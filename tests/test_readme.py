"""The README stays true.

- Its numbers are those of the committed runs, ``results/wikitext2-cpu/`` (``make demo`` from an
  empty work directory on a clean clone of the commit the run names),
  ``results/wikitext2-smollm2-cpu/`` and the SPALM comparison's two runs: their tables,
  retrieval facts and stage times, every one compared with the files.
- Every ``gnnlm ...`` and ``make ...`` command it shows names a command or target that exists,
  and every config file it names is there and is YAML.
- The test counts it states are what pytest collects.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO

RUN = REPO / "results" / "wikitext2-cpu"
MINUS = "\N{MINUS SIGN}"


def _signed(value: float, digits: int = 2) -> str:
    """A number as the README writes it: a minus sign, not a hyphen."""
    return f"{value:.{digits}f}".replace("-", MINUS)


README = REPO / "README.md"


def _section(heading: str) -> str:
    """The README's section that starts with ``heading``, up to the next heading of its level
    or above (a sub-section of it stays in)."""
    text = README.read_text()
    start = text.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    found = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, start + 1)
    return text[start:found.start() if found else len(text)]


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads((RUN / "results.json").read_text())


@pytest.fixture(scope="module")
def stage_times() -> dict:
    return json.loads((RUN / "stage_times.json").read_text())


@pytest.fixture(scope="module")
def section() -> str:
    """The README's section on the demo, up to the next section."""
    return _section("### On a 2-core CPU: `make demo`")


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


# -- the same demo on other CPU kernels: two more committed runs -----------------------------

ROWS = (("base", "base"), ("+kNN", "knn"), ("+GNN", "gnn"), ("+GNN+kNN", "gnn+knn"))


def _run(folder: str) -> tuple[dict, dict]:
    """A committed run's results and stage times."""
    return (json.loads((REPO / "results" / folder / "results.json").read_text()),
            json.loads((REPO / "results" / folder / "stage_times.json").read_text()))


@pytest.fixture(scope="module")
def other_cpus() -> str:
    """The paragraph on the demo's table from other CPU kernels, flowed onto one line."""
    text = " ".join(_section("### On a 2-core CPU: `make demo`").split())
    return text[text.index("**Another CPU, the same table.**"):]


def test_the_table_ran_under_the_makefile_s_pins(results, other_cpus):
    """The table's run held every library to the AVX2 kernels the Makefile's demo pins, and the
    README names those pins."""
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    pins = dict(word.split("=") for word in
                re.search(r"^AVX2_PINS := (.*)$", makefile, re.M).group(1).split())
    assert re.search(r"^demo: setup\n\tenv \$\(DEMO_PINS\) ", makefile, re.M)
    kernels = results["environment"]["cpu_kernels"]
    assert kernels["pinned"] == pins and kernels["torch_capability"] == "AVX2"
    assert (REPO / "results" / "wikitext2-cpu" / "results.md").read_text().count(
        "AVX2 kernels (pinned)") == 1
    assert "`" + " ".join(f"{name}={value}" for name, value in pins.items()) + "`" in other_cpus


def test_an_avx2_only_cpu_printed_the_same_table(results, other_cpus):
    """The run made on a CPU without AVX-512 (before kernels were recorded): the same base-LM
    weights, the base LM's and kNN-LM's rows to the bit, GNN-LM's within 5e-7 (relative), every
    printed number equal."""
    other, other_times = _run("wikitext2-cpu-avx2")
    made_by = other["made_by"]
    assert made_by == other_times["made_by"] and made_by["dirty"] is False
    assert f"`results/wikitext2-cpu-avx2/`, commit {made_by['commit'][:7]}" in other_cpus
    assert other["base_lm"] == results["base_lm"]
    assert f"fingerprint {results['base_lm']['fingerprint']}" in other_cpus
    for split in ("valid_ppl", "ppl"):
        assert [other[split][name] for name in ("base", "knn")] == [
            results[split][name] for name in ("base", "knn")]
        for _, name in ROWS:
            assert abs(other[split][name] / results[split][name] - 1) < 5e-7
            assert f"{other[split][name]:.2f}" == f"{results[split][name]:.2f}"
    assert ("the base LM and kNN-LM rows to the bit, the GNN-LM rows within 5e-7 of the table's "
            "(relative)") in other_cpus


def test_the_cpu_s_own_kernels_printed_the_table_the_paragraph_gives(results, stage_times,
                                                                     other_cpus):
    """The unpinned run on the table's CPU: its kernels, weights and rows, how far they land
    from the table's, and what the pins cost against it, all as its files say."""
    other, other_times = _run("wikitext2-cpu-avx512")
    made_by = other["made_by"]
    assert made_by == other_times["made_by"] and made_by["dirty"] is False
    assert f"`results/wikitext2-cpu-avx512/`, commit {made_by['commit'][:7]}" in other_cpus
    kernels = other["environment"]["cpu_kernels"]
    assert kernels["torch_capability"] == "AVX512" and kernels["pinned"] == {}
    fingerprint = other["base_lm"]["fingerprint"]
    assert fingerprint != results["base_lm"]["fingerprint"]
    assert f"fingerprint {fingerprint}" in other_cpus
    printed = ", ".join(f"{label} {other['valid_ppl'][name]:.2f} / {other['ppl'][name]:.2f}"
                        for label, name in ROWS)
    assert printed in other_cpus
    apart = [abs(other[split][name] / results[split][name] - 1) * 100
             for split in ("valid_ppl", "ppl") for _, name in ROWS]
    assert f"{min(apart):.2f}% to {max(apart):.2f}% from the table" in other_cpus

    def gains(run: dict) -> list[float]:
        return [(run["ppl"][name] / run["ppl"]["base"] - 1) * 100 for _, name in ROWS[1:]]

    spread = max(abs(a - b) for a, b in zip(gains(other), gains(results)))
    assert f"within {spread:.2f} points of the table's" in other_cpus
    assert "(test: " + ", ".join(_signed(g, 1) + "%" for g in gains(other)) + ")" in other_cpus
    total = round(other_times["total_seconds"])
    ratio = other_times["total_seconds"] / stage_times["total_seconds"]
    assert f"took {total // 60} min {total % 60} s ({ratio:.2f}× the table's)" in other_cpus
    pinned = {s["stage"]: s["seconds"] for s in stage_times["stages"]}
    native = {s["stage"]: s["seconds"] for s in other_times["stages"]}
    cost = ", ".join(f"the {label} {pinned[stage] / native[stage]:.2f}×" for label, stage in (
        ("base LM's stage", "base_lm"), ("features'", "features"),
        ("neighbours'", "neighbors[final]")))
    cost += f" and GNN-LM's {pinned['gnn'] / native['gnn']:.2f}×"
    assert f"the pins cost {cost}" in other_cpus


SMOLLM2 = REPO / "results" / "wikitext2-smollm2-cpu"


@pytest.fixture(scope="module")
def smollm2() -> dict:
    return json.loads((SMOLLM2 / "results.json").read_text())


@pytest.fixture(scope="module")
def smollm2_section() -> str:
    """The README's section on SmolLM2-135M as the base LM, up to the next section."""
    return _section("### SmolLM2-135M as the frozen base LM")


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


# -- the SPALM comparison: two committed runs ------------------------------------------------

SPALM_RUNS = {
    # run folder: the Transformer-XL row the others are compared with, and the table's rows
    "wikitext2-spalm-cpu": ("transformer_xl", [
        "transformer", "transformer_xl", "transformer_xl+knn", "transformer_xl+knn[k=4]",
        "spalm_xl", "spalm_xl_variant"]),
    "wikitext2-spalm-scratch-cpu": ("transformer_xl_scratch", [
        "transformer_xl_scratch", "transformer_xl_scratch+knn",
        "transformer_xl_scratch+knn[k=4]", "spalm_xl_scratch"]),
}


SPALM_CURVE_LABELS = {
    "transformer": "transformer (no memory)", "transformer_xl": "Transformer-XL",
    "spalm_xl": "SPALM, the paper's equations",
    "spalm_xl_variant": "SPALM (+gate bias, +memory scale)",
    "transformer_xl_scratch": "Transformer-XL, from scratch",
    "spalm_xl_scratch": "SPALM, the paper's equations, from scratch"}


def _spalm_label(name: str, hparams: dict) -> str:
    """How the README's SPALM tables name a row (the same in both pairs)."""
    if "+knn" in name:
        fitted = hparams[name]
        return (f"+ kNN-LM (k = {fitted['k']}, T = {fitted['temperature']:g}, "
                f"λ = {fitted['lambda']:g})")
    return {"transformer": "transformer (no memory)", "spalm_xl_variant":
            "SPALM (+gate bias, +memory scale)"}.get(
        name, "SPALM, the paper's equations (k = 4)" if name.startswith("spalm")
        else "Transformer-XL (M = 128)")


@pytest.fixture(scope="module")
def spalm_section() -> str:
    """The README's section on the SPALM comparison, up to the next section."""
    return _section("### SPALM against Transformer-XL")


@pytest.mark.parametrize("run", sorted(SPALM_RUNS))
def test_the_spalm_tables_are_the_committed_runs(run, spalm_section):
    """Every row: the step its weights were kept from, valid and test perplexity, and the test
    change against that pair's Transformer-XL; the run's commit and its time."""
    folder = REPO / "results" / run
    results = json.loads((folder / "results.json").read_text())
    stage_times = json.loads((folder / "stage_times.json").read_text())
    baseline, names = SPALM_RUNS[run]
    ppl, valid, training = results["ppl"], results["valid_ppl"], results["training"]
    for name in names:
        trained = training[name.split("+")[0]]
        change = "" if name == baseline else \
            _signed((ppl[name] / ppl[baseline] - 1) * 100, 1).replace("+", "") + "%"
        if change and not change.startswith(MINUS):
            change = "+" + change
        line = (f"| {_spalm_label(name, results['hparams'])} | {trained['kept_step']} / "
                f"{trained['steps']} | {valid[name]:.2f} | {ppl[name]:.2f} | {change} |")
        assert line in spalm_section, line
    for name in names:  # each trained row's valid curve, before training and every 100 steps
        if "+" not in name:
            curve = training[name]["valid_curve"]
            cells = " | ".join(f"{score:,.1f}" for score in curve["scores"])
            assert f"| {SPALM_CURVE_LABELS[name]} | {cells} |" in spalm_section, name
    made_by = results["made_by"]
    assert made_by == stage_times["made_by"] and made_by["dirty"] is False
    text = " ".join(spalm_section.split())
    assert f"`{run}` (commit {made_by['commit'][:7]}" in text
    total = round(stage_times["total_seconds"])
    assert f"took {total // 60} min {total % 60} s" in text


# -- the commands the README shows -----------------------------------------------------------

COMMAND = re.compile(r"^(?:# )?((?:gnnlm|make) .*)")


def _code() -> list[str]:
    """The command lines of the README's code: indented and fenced blocks (a trailing ``\\``
    joins the next line; ``#`` comments cut off) and inline spans that start with a command.
    A fenced YAML block's first line, ``# gnnlm ...``, is the command that runs it."""
    lines, fenced, block = [], False, []
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            block.append(line.strip())
    joined = "\n".join(block).replace("\\\n", " ")
    for line in joined.splitlines():
        found = COMMAND.match(line)
        if found:
            lines.append(re.split(r"\s+# ", found.group(1))[0])
    prose = re.sub(r"^```.*?^```", "", README.read_text(), flags=re.S | re.M)
    # a span opens with a run of backticks and closes with a run as long (``a `b` c``)
    spans = [" ".join(found.group(2).split()) for found in
             re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", prose, re.S)]
    lines += [span for span in spans if COMMAND.match(span)]
    return lines


def _words(line: str) -> list[str]:
    """A command line's words; ``[...]`` (an optional part) and ``...`` are not words."""
    line = re.sub(r"(?<![=\w])\[[^\]]*\]", " ", line)
    try:
        words = shlex.split(line)
    except ValueError:  # an unbalanced quote in prose: the plain split
        words = line.split()
    return [w for w in words if w != "..."]


def _commands(program: str) -> list[list[str]]:
    """Every ``program ...`` command the README shows, as words; a line that is the program's
    output (``gnnlm score: error: ...``) is none."""
    found = []
    for line in _code():
        words = _words(line)
        if words and words[0] == program and len(words) > 1 and not words[1].endswith(":"):
            found.append(words)
    return found


def test_the_readme_shows_commands_of_both_programs():
    """The parsing finds what the README shows, so the tests below check something."""
    gnnlm = {words[1] for words in _commands("gnnlm")}
    make = {words[1] for words in _commands("make")}
    assert {"pipeline", "fit", "score", "generate", "explain", "verify", "sweep"} <= gnnlm
    assert {"demo", "test", "test-unit", "setup", "lint"} <= make


def test_every_gnnlm_command_in_the_readme_exists_and_its_help_lists_it():
    from gnnlm.cli import COMMANDS
    from gnnlm.lit import LIGHTNING_COMMANDS

    known = {*COMMANDS, *LIGHTNING_COMMANDS}
    shown = {name for words in _commands("gnnlm") if not words[1].startswith("-")
             for name in words[1].split("/")}  # ``gnnlm validate/test/predict``
    assert shown <= known, f"the README shows gnnlm commands that do not exist: {shown - known}"
    # ``gnnlm --help`` imports no command (fast): every command it lists is one the CLI runs
    usage = subprocess.run([sys.executable, "-m", "gnnlm.cli", "--help"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0, usage.stderr
    for name in shown:
        assert re.search(rf"\b{name}\b", usage.stdout), name


def test_every_make_target_in_the_readme_is_in_the_makefile():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    shown = {words[1] for words in _commands("make")}
    assert shown <= targets, f"the README shows make targets the Makefile lacks: {shown - targets}"


def test_every_config_the_readme_names_exists_and_is_yaml():
    """Each ``-c`` file of a command, and each ``configs/...yaml`` path anywhere in the README."""
    given = {words[i + 1] for words in _commands("gnnlm") for i, word in enumerate(words[:-1])
             if word in ("-c", "--config") and words[i + 1].endswith((".yaml", ".yml"))}
    named = set(re.findall(r"\bconfigs/[\w./-]+?\.ya?ml\b", README.read_text()))
    assert given and named
    for path in sorted(given | named):
        file = REPO / path
        assert file.is_file(), f"the README names {path}, which does not exist"
        assert isinstance(yaml.safe_load(file.read_text()), dict), f"{path} holds no settings"


def test_the_pipeline_options_in_the_readme_are_fields_of_the_pipeline_config():
    """``gnnlm pipeline ... --section.field=value``: the section and field exist (the light
    config module; no stage runs)."""
    from dataclasses import fields, is_dataclass
    from typing import get_args, get_type_hints

    from gnnlm.pipeline.config import PipelineConfig

    sections = get_type_hints(PipelineConfig)  # an optional section: Optional[its dataclass]
    checked = 0
    for words in _commands("gnnlm"):
        if words[1] != "pipeline":
            continue
        for word in words[2:]:
            if not word.startswith("--") or word.startswith(("--help", "--debug")):
                continue
            section, _, name = word[2:].split("=", 1)[0].partition(".")
            assert section in sections, f"{word}: PipelineConfig has no section {section!r}"
            if name:
                kind = next((t for t in (sections[section], *get_args(sections[section]))
                             if is_dataclass(t)), None)
                assert kind is not None and name in {f.name for f in fields(kind)}, (
                    f"{word}: the {section} section has no field {name!r}")
            checked += 1
    assert checked


# -- the test counts it states -----------------------------------------------------------------

@pytest.mark.integration  # collecting every test module imports torch, Lightning, PyG, faiss:
def test_the_test_counts_the_readme_states_are_what_pytest_collects():  # not the edit loop
    """``make test`` runs all N tests and ``make test-unit`` M of them, as pytest collects
    them now (the markers ``make test-unit`` deselects)."""
    text = " ".join(_section("## The two commands").split())
    total = int(re.search(r"`make test` runs all ([\d,]+) tests", text).group(1).replace(",", ""))
    unit = int(re.search(r"`make test-unit` runs ([\d,]+) of them", text).group(1)
               .replace(",", ""))
    makefile = (REPO / "Makefile").read_text()
    marks = re.search(r"^test-unit:.*\n\t.*-m \"([^\"]+)\"", makefile, re.M).group(1)
    assert f'-m "{marks}"' in text  # the README says which tests the target leaves out
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", marks, "tests"], cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    # "924/1124 tests collected (...)", alone on its line or between rules of "="
    counts = re.search(r"^=* ?(\d+)/(\d+) tests collected", collected.stdout, re.M)
    assert counts, collected.stdout[-500:]
    assert (unit, total) == (int(counts.group(1)), int(counts.group(2))), (
        f"the README says {total} tests, {unit} of them in make test-unit; pytest collects "
        f"{counts.group(2)}, {counts.group(1)} of them without {marks}: update the README")


def _seconds(max_time: str) -> int:
    """Lightning's ``DD:HH:MM:SS`` as seconds."""
    days, hours, minutes, seconds = map(int, max_time.split(":"))
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def test_the_gpu_budget_is_the_configs_time_limits_and_fits_the_check_s_limit():
    """The README's budget of the GPU table: each `max_time` row is its config's limit (times
    the rows that share it), every trained part of pipeline.yaml has a limit in the table, and
    the parts add up to the total, which is the table's limit in scripts/gpu_check.sh (480 s,
    after the benchmark's 60 s, within the whole's 590 s)."""
    from gnnlm.pipeline.config_files import merged_yaml

    section = _section("### On one GPU")
    table = section[section.index("| part | budget (s) |"):].split("\n\n")[0]
    rows = re.findall(r"^\| (.+?) \| (\*\*)?(\d+)(\*\*)? \|", table, re.M)
    budget = {name: int(seconds) for name, _, seconds, _ in rows}
    total = budget.pop("**total**")
    check = (REPO / "scripts/gpu_check.sh").read_text()
    table_limit = int(re.search(r"TABLE_SECONDS:-(\d+)", check).group(1))
    bench_limit = int(re.search(r"BENCH_SECONDS:-(\d+)", check).group(1))
    assert sum(budget.values()) == total <= table_limit == 480
    check_limit = int(re.search(r"CHECK_SECONDS:-(\d+)", check).group(1))
    # and the install before the benchmark, and a stopped table's 30 s to exit
    assert table_limit + bench_limit <= check_limit - 20 - 30 and check_limit <= 590
    limited = {re.search(r"`(\w+\.yaml)`, `max_time`", name).group(1): (name, seconds)
               for name, seconds in budget.items() if "`max_time`" in name}
    pipeline = yaml.safe_load((REPO / "configs/wikitext2/pipeline.yaml").read_text())
    chains = [part["config"] for part in pipeline.values()
              if isinstance(part, dict) and part.get("config")]
    assert len(chains) == 9
    uses = {}
    for chain in chains:
        limit = merged_yaml(chain)["trainer"].get("max_time")
        assert limit is not None, chain                         # every trained part is bounded
        model_yaml = chain[1].rsplit("/", 1)[-1]                # the part's own YAML
        assert model_yaml in limited, chain
        uses.setdefault(model_yaml, set()).add(_seconds(limit))
    for model_yaml, (name, seconds) in limited.items():
        assert len(uses[model_yaml]) == 1, model_yaml           # the rows share one limit
        count = sum(chain[1].endswith(model_yaml) for chain in chains)
        if count > 1:
            assert f"{count} rows" in name, name
        assert seconds == count * uses[model_yaml].pop(), name
