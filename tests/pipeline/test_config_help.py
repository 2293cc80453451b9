"""gnnlm.pipeline.config_help: the short ``--help`` and ``--help=SECTION`` read from the config
dataclasses' Google-style docstrings, on a small config of its own and on ``PipelineConfig``
(the commands' output is in tests/test_errors_cli.py)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

import pytest

from gnnlm.pipeline.config_help import google_args, section_help, sections, short_help


@dataclass
class Tokenizer:
    """How text becomes ids.

    Args:
        kind: word or hf
    """
    kind: str = "word"


@dataclass
class Corpus:
    """The corpus of a run.

    A second paragraph, which the section's help shows too.

    Args:
        name: the corpus's folder under the data directory, a name
            that runs over two lines
        tokenizer: how its text becomes ids

    Returns:
        nothing (a section after Args ends them)
    """
    name: str = "wikitext-2"
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    undocumented: int = 3


@dataclass
class Run:
    """A run.

    Args:
        seed: the seed of everything
        corpus: the text to model
    """
    seed: int = 0
    corpus: Optional[Corpus] = None
    extra: bool = False


def test_google_args_are_the_description_and_one_line_per_argument():
    description, args = google_args(Corpus)
    assert description == ("The corpus of a run.\n\n"
                           "A second paragraph, which the section's help shows too.")
    assert args == {"name": "the corpus's folder under the data directory, a name that runs over "
                            "two lines",
                    "tokenizer": "how its text becomes ids"}

    class Plain:
        """Only a description."""

    assert google_args(Plain) == ("Only a description.", {})


def test_sections_are_the_fields_in_order_with_their_meaning():
    assert sections(Run) == {"seed": "the seed of everything", "corpus": "the text to model",
                             "extra": ""}


def test_a_section_s_help_lists_every_field_nested_ones_by_dotted_name():
    text = section_help("gnnlm pipeline", "corpus", Run)
    lines = text.splitlines()
    assert lines[0] == "corpus: the text to model"
    assert "A second paragraph, which the section's help shows too." in text
    assert "on the command line --corpus.FIELD=VALUE" in text
    fields = [line.split()[0] for line in lines if line.startswith("  ") and "=" in line]
    assert fields == ["name", "tokenizer.kind", "undocumented"]
    name = next(i for i, line in enumerate(lines) if line.split()[:1] == ["name"])
    assert lines[name].split(maxsplit=1)[1] == "str = 'wikitext-2'"
    assert lines[name + 1].strip().startswith("the corpus's folder under the data directory")


def test_a_plain_setting_s_help_is_its_type_and_default():
    assert section_help("gnnlm pipeline", "seed", Run).splitlines() == [
        "seed: the seed of everything", "", "  --seed  int = 0"]


def test_an_unknown_section_is_refused_listing_the_sections():
    with pytest.raises(ValueError) as err:
        section_help("gnnlm sweep", "corpsu", Run)
    assert str(err.value) == ("gnnlm sweep has no section 'corpsu': the sections are seed, corpus, "
                              "extra.")


def test_the_short_help_lists_the_command_s_own_options_and_the_sections():
    parser = argparse.ArgumentParser(prog="gnnlm explain")
    parser.add_argument("--text", required=True, help="the input context")
    parser.add_argument("--top", type=int, help="retrieved contexts to show")
    parser.add_argument("--seed", help="a section's field, listed with the sections")
    text = short_help(parser, "gnnlm explain", "Explains.\n\nA second paragraph.", Run)
    usage = text.split("\n\n")[0]
    assert usage.startswith("usage: gnnlm explain -c CONFIG [-c OVERLAY ...]")
    # a required option is not in brackets, an optional one is; a section's is not an option
    assert "--text TEXT [--top TOP] [--debug]" in " ".join(usage.split())
    assert "--seed" not in usage
    assert "Explains." in text and "A second paragraph." in text
    section_lines = [line.split(maxsplit=1) for line in text.splitlines()
                     if line.startswith("  ") and not line.lstrip().startswith("-")
                     and line[2] != " "]
    assert section_lines[:2] == [["seed", "the seed of everything"],
                                 ["corpus", "the text to model"]]
    assert any(line.split()[:2] == ["--text", "TEXT"] and line.endswith("the input context")
               for line in text.splitlines())


def test_every_section_and_field_of_the_pipeline_config_says_what_it_is_for():
    from gnnlm.pipeline.config import PipelineConfig

    named = sections(PipelineConfig)
    assert named and all(named.values()), [name for name, text in named.items() if not text]
    for name in named:
        text = section_help("gnnlm pipeline", name, PipelineConfig)
        assert text.startswith(f"{name}: {named[name]}")
        lines = text.splitlines()
        # each field's line (type = default) is followed by its meaning, indented under it
        for i, line in enumerate(lines):
            if line.startswith("  ") and line[2] != " " and " = " in line and i > 2:
                assert i + 1 < len(lines) and lines[i + 1].startswith(" " * 30), (name, line)
