"""``gnnlm score`` and ``gnnlm generate``: a built work directory's rows from the command line.

    gnnlm score    runs/wikitext2-cpu --file my.txt [--rows base knn] [--json]
    gnnlm generate runs/wikitext2-cpu --prompt "The game was" --row gnn+knn --max_new_tokens 20

Both only read the work directory: they take no lock (a pipeline running on it goes on) and
write nothing into it. Bad input is refused before any model is loaded, in one line; what
needs no model (the options, the text, the work directory and its rows) before torch is
imported, at once.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

from gnnlm.inference.served import NotServed

SETTINGS = ("knn_k", "knn_temperature", "lam", "gnn_k")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``gnnlm <command>: error: ...``, exit 2) like every
    other error of the ``gnnlm`` command, rather than a usage block."""

    def error(self, message: str):
        raise NotServed(f"{message} (gnnlm {self.prog.split()[-1]} --help lists the options).")


def _parser(command: str, description: str) -> Parser:
    parser = Parser(prog=f"gnnlm {command}", description=description)
    parser.add_argument("workdir", help="a work directory `gnnlm pipeline` built")
    parser.add_argument("--report", default=None,
                        help="which of its reports (needed when it holds several)")
    parser.add_argument("--knn_k", type=int, help="kNN-LM's neighbours (default: fitted)")
    parser.add_argument("--knn_temperature", type=float,
                        help="kNN-LM's temperature T (default: fitted)")
    parser.add_argument("--lam", type=float,
                        help="the interpolation weight λ of an interpolated row (default: fitted)")
    parser.add_argument("--gnn_k", type=int, help="GNN-LM's windows per token (default: "
                                                  "the k chosen on valid)")
    return parser


def _overrides(namespace: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(namespace, name) for name in SETTINGS}


def read_text_file(path: str) -> str:
    """A UTF-8 text file's content, refused in one line when missing or not UTF-8 text (the
    corpus reader's checks: a binary, an archive, UTF-16 are named as such)."""
    from gnnlm.text.text_files import read_text

    if not Path(path).is_file():
        raise NotServed(f"No file {path}: give a text file to score.")
    try:
        return read_text(path, give="give a plain text file to score")
    except ValueError as err:
        raise NotServed(str(err)) from None


def check_served(workdir: str, report: Optional[str], rows: list[str]) -> None:
    """The work directory, its report and the ``rows`` asked for, checked from the report alone
    (``Served``, no torch): a mistake there is answered at once, not after torch and the
    models have loaded (seconds)."""
    from gnnlm.inference.served import Served
    from gnnlm.workdir.layout import Workdir

    served = Served(Workdir(workdir), report)
    for row in rows:
        served.row(row)


def _notes(command: str, caught: list) -> None:
    """What the library said once (``warnings``), as one line each on stderr."""
    for warning in caught:
        print(f"gnnlm {command}: note: {warning.message}", file=sys.stderr)


def score_main(args: list[str]) -> dict:
    """``gnnlm score WORKDIR --text TEXT | --file FILE [--rows ROW ...] [--json]``: every
    token's log p under each row, as the pipeline scores a split; prints tokens, unknown-token
    share and perplexity per row."""
    parser = _parser("score", score_main.__doc__ or "")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the text to score")
    source.add_argument("--file", help="a UTF-8 text file to score")
    parser.add_argument("--rows", nargs="+", default=None,
                        help="rows to score (default: every row of the report)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    namespace = parser.parse_args(args)
    text = namespace.text if namespace.file is None else read_text_file(namespace.file)
    if not text.strip():
        raise NotServed("the text is empty: give at least one word to score.")
    check_served(namespace.workdir, namespace.report, namespace.rows or [])
    from gnnlm.inference.model import TrainedLM

    lm = TrainedLM(namespace.workdir, namespace.report)
    chosen = namespace.rows or lm.rows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = lm.score(text, list(chosen), **_overrides(namespace))
    _notes("score", caught)
    first = scores[chosen[0]]
    summary = {"workdir": str(lm.workdir.root), "report": lm.served.name,
               "tokens": first.tokens, "unk_share": first.unk_share,
               "rows": {row: {"ppl": s.ppl, "protocol": s.protocol,
                              "settings": {k: getattr(s.settings, k) for k in s.settings.read()}}
                        for row, s in scores.items()}}
    if namespace.json:
        print(json.dumps(summary, indent=2))
        return summary
    unk = "" if first.unk_share is None else f", {first.unk_share:.1%} unknown"
    print(f"{lm.workdir.root} (report {lm.served.name}): {first.tokens:,} tokens{unk}")
    print(f"  {'row':<12} {'ppl':>10}  settings")
    for row, values in summary["rows"].items():
        settings = ", ".join(f"{k}={v}" for k, v in values["settings"].items())
        print(f"  {row:<12} {values['ppl']:10.2f}  {settings}")
    return summary


def generate_main(args: list[str]) -> Optional[list]:
    """``gnnlm generate WORKDIR --prompt TEXT [--row ROW] [--max_new_tokens N] [--greedy |
    --temperature T --top_k K --top_p P] [--seed S] [--show-retrieval]``: the prompt's
    continuation under the row."""
    parser = _parser("generate", generate_main.__doc__ or "")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--row", default="base", help="the row that generates (default: base)")
    parser.add_argument("--max_new_tokens", type=int, default=20, help="tokens to generate")
    parser.add_argument("--greedy", action="store_true", help="take the most likely token")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default 1)")
    parser.add_argument("--top_k", type=int, help="sample among the k most likely tokens")
    parser.add_argument("--top_p", type=float, help="sample within this probability mass")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling repeatable")
    parser.add_argument("--show-retrieval", dest="show_retrieval", action="store_true",
                        help="per generated token, the top retrieved train context")
    namespace = parser.parse_args(args)
    from gnnlm.inference.sampling import check_sampling

    check_sampling(namespace.max_new_tokens, namespace.greedy, namespace.temperature,
                   namespace.top_k, namespace.top_p)
    if not namespace.prompt.strip():
        raise NotServed("the prompt is empty: give at least one word to continue.")
    check_served(namespace.workdir, namespace.report, [namespace.row])
    from gnnlm.inference.explain import train_context
    from gnnlm.inference.model import TrainedLM

    lm = TrainedLM(namespace.workdir, namespace.report)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = lm.generate(namespace.prompt, namespace.row, namespace.max_new_tokens,
                             greedy=namespace.greedy, temperature=namespace.temperature,
                             top_k=namespace.top_k, top_p=namespace.top_p, seed=namespace.seed,
                             show_retrieval=namespace.show_retrieval, **_overrides(namespace))
    _notes("generate", caught)
    print(result.text)
    if namespace.show_retrieval:
        for token, logprob, found in zip(result.ids, result.logprobs, result.retrieved):
            print(f"  {lm.decode([token]).strip():<14} log p {float(logprob):6.2f}  retrieved "
                  f"(sim {found.similarity:.3f}): {train_context(lm, found.position)}")
    return [result]
