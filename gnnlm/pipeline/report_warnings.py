"""The report's Warnings block, what makes its numbers untrustworthy: the data's checks
(``gnnlm.pipeline.data_checks``: unknown tokens, near-copies of valid/test in the datastore),
trained heads worse than the base LM on valid, and keys whose retrieval does not discriminate
(``gnnlm.retrieval.sanity``)."""
from __future__ import annotations

from gnnlm.models import protocols
from gnnlm.pipeline import data_checks
from gnnlm.pipeline.report_tables import row_label
from gnnlm.retrieval import sanity
from gnnlm.workdir import rows


def warnings_block(report: dict, heads: dict) -> list[dict]:
    """The Warnings block: the data's checks, heads worse than the base LM on valid, and keys
    whose retrieval does not discriminate."""
    worse = data_checks.heads_worse_than_base(
        report["valid_ppl"], rows_on_the_base_lm(list(report["ppl"]), heads, report["protocols"]))
    found = data_checks.report_warnings(
        report["unk_share"], report["datastore_overlap"], worse,
        label=lambda name: row_label(report, name), unk_token=report["unk_token"],
        context=report["near_copy"]["context"])
    return found + [sanity.warning(key, facts, row_label(report, facts["row"]))
                    for key, facts in report.get("retrieval_sanity", {}).items()
                    if facts["degenerate"]]


def rows_on_the_base_lm(names: list[str], heads: dict, row_protocol: dict) -> list[str]:
    """The rows that stand for a trained head on the base LM's features, read the base LM's way,
    and so should beat it on valid: the head's own row, or ``<head>+base`` where the report
    interpolates the head with the base LM (a learned W_ds is a datastore, not a whole LM).
    Segment models are separate LMs, not heads, and are not compared with the base LM."""
    base = protocols.layout(row_protocol["base"])
    return [rows.with_base(name) if rows.with_base(name) in names else name for name in names
            if name in heads and protocols.layout(row_protocol[name]) == base]
