"""The report's rows and lines in words, shared by results.md (``gnnlm.pipeline.report_markdown``)
and the printed table (``gnnlm.pipeline.report.print_table``): each row's label, the rows grouped
into one table per protocol, the perplexity columns and each row's cells, and the one-line
summaries of the data's checks, of the trainings that were not one run, and of how much each
key's retrieval discriminates."""
from __future__ import annotations

from gnnlm.models import protocols
from gnnlm.models.protocols import Protocol
from gnnlm.pipeline import data_checks
from gnnlm.workdir import rows


def row_label(results: dict, name: str) -> str:
    """``name``'s label, with the deviations from its paper the report records for it."""
    return rows.label(name, results.get("deviations", {}).get(name))


def protocol_tables(results: dict) -> list[tuple[Protocol, list[str]]]:
    """The rows grouped by layout (``gnnlm.models.protocols.layout``), in table order."""
    groups: dict[tuple, tuple[Protocol, list[str]]] = {}
    for name in results["ppl"]:
        protocol = results["protocols"][name]
        groups.setdefault(protocols.layout(protocol), (protocol, []))[1].append(name)
    return list(groups.values())


def ppl_headers(results: dict) -> list[str]:
    """The perplexity columns: valid and test, and for a subword tokenizer each per token and
    per word (``gnnlm.pipeline.per_word``)."""
    if "ppl_per_word" not in results:
        return ["valid ppl", "test ppl"]
    return ["valid ppl / token", "test ppl / token", "valid ppl / word", "test ppl / word"]


def ppl_cells(results: dict, name: str) -> list[str]:
    """``name``'s perplexities in ``ppl_headers``' order; empty where a row has none."""
    values = [results["valid_ppl"].get(name), results["ppl"][name]]
    if "ppl_per_word" in results:
        values += [results["valid_ppl_per_word"].get(name), results["ppl_per_word"].get(name)]
    return ["" if v is None else f"{v:.2f}" for v in values]


def data_line(results: dict) -> str:
    """The share of each split unknown to the vocabulary and of valid/test that retrieves a
    near-copy of its own text from the datastore (``gnnlm.pipeline.data_checks``)."""
    def shares(values: dict) -> str:
        return ", ".join(f"{split} {data_checks.percent(v)}" for split, v in values.items()
                         if v is not None)

    unk = results["unk_share"]
    if all(v is None for v in unk.values()):
        line = "Data: the tokenizer has no unknown token"
    else:
        line = (f"Data: tokens unknown to the vocabulary (`{results.get('unk_token')}`): "
                f"{shares(unk)}")
    overlap = results.get("datastore_overlap") or {}
    if any(v is not None for v in overlap.values()):
        near = results.get("near_copy", {})
        line += (f"; positions whose nearest train key is a near-copy (the "
                 f"{near.get('context', data_checks.DEFAULT_NEAR_COPY_CONTEXT)} tokens before "
                 f"both equal): {shares(overlap)}")
    return line + "."


def training_lines(results: dict) -> list[str]:
    """One line per ``training_notes`` entry of a report."""
    lines = []
    for note in results.get("training_notes") or []:
        said = []
        if note.get("resumed_from_steps"):
            said.append("resumed from step " + ", ".join(map(str, note["resumed_from_steps"])))
        if note.get("stopped_by") == "max_time":
            bound = note.get("max_steps", -1)  # -1: bound by epochs, not steps
            said.append(f"stopped by max_time at step {note['steps']}"
                        + (f" of max_steps {bound}" if bound > 0 else ""))
        if note.get("stopped_by") == "diverged":  # its validation metric became NaN or inf
            said.append(f"diverged at step {note['steps']} (kept step {note.get('kept_step')})")
        lines.append(f"{row_label(results, note['row'])}: {'; '.join(said)}")
    return lines


def sanity_line(facts: dict) -> str:
    """How much one key's retrieval discriminates (``gnnlm.retrieval.sanity``), in words."""
    if not facts["queries"]:
        return "no valid query has k neighbours: retrieval's spread not measured"
    k, K = facts["k"], facts["K"]
    line = (f"median similarity spread (top-1 minus top-k) of a valid query's top {k} (fitted "
            f"k) {facts['spread_at_k']:.2e}")
    if K != k:
        line += f", of its top {K} {facts['spread_at_K']:.2e}"
    line += (f"; {data_checks.percent(facts['flat_share'])} of queries with their top {k} "
             f"within {facts['flat_tolerance']:.0e}")
    if facts["temperature_effect"] is not None:
        line += (f"; T changes valid ppl by {data_checks.percent(facts['temperature_effect'])} "
                 f"across the grid")
    if facts["temperature_on_grid_edge"]:
        line += f" (fitted T = {facts['temperature']:g}, on the grid's edge)"
    return line + (" — degenerate" if facts["degenerate"] else "")
