"""Parsing a trained part's ``gnnlm fit`` config as LightningCLI would, without building anything
(``check_fit_config``), and checking every trained part's config that way before the pipeline's
first stage (``check_fit_configs``), each head's parsed data module against the retrieval
artifacts the pipeline builds (``gnnlm.pipeline.head_checks``).
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from gnnlm.pipeline.head_checks import check_head
from gnnlm.utils.quiet import quiet_lightning

if TYPE_CHECKING:
    import pytorch_lightning as pl
    from jsonargparse import Namespace

    from gnnlm.pipeline.settings import PipelineSettings


class _Parsed(Exception):
    """Raised by ``check_fit_config`` once LightningCLI has parsed, before it builds anything,
    with the parsed ``fit`` namespace."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config


def check_fit_config(configs: list[str]) -> Namespace:
    """Parse ``gnnlm fit -c configs[0] -c configs[1] …`` without building anything and return
    the parsed ``fit`` namespace (every argument, with the classes' defaults for what the YAMLs
    leave out): an unknown key, a typo'd class path or a value of the wrong type stops the
    pipeline before its slow stages, with one message naming the files. A chain parsed before
    with the same texts is not parsed again."""
    texts: list[Optional[str]] = []
    for path in configs:
        try:
            texts.append(Path(path).read_text())
        except OSError:
            texts.append(None)  # the parser says what is wrong with it
    return _parsed_fit_config(tuple(configs), tuple(texts))


@functools.lru_cache(maxsize=64)
def _parsed_fit_config(configs: tuple[str, ...], texts: tuple[Optional[str], ...]) -> Namespace:
    """``check_fit_config``'s parse, once per chain of files and their texts."""
    import contextlib
    import io

    from gnnlm.lit.cli import GnnlmCLI

    class ParseOnly(GnnlmCLI):
        def before_instantiate_classes(self) -> None:
            raise _Parsed(self.config["fit"])

    quiet_lightning()
    printed = io.StringIO()
    seed_log = logging.getLogger("lightning_fabric.utilities.seed")
    level, seed_log.level = seed_log.level, logging.WARNING  # no "Seed set" line per check
    try:
        with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(io.StringIO()):
            ParseOnly(*cli_bases(), subclass_mode_model=True, subclass_mode_data=True,
                      args=["fit", *(a for c in configs for a in ("-c", c))])
    except _Parsed as parsed:
        return parsed.config
    except SystemExit:
        text = printed.getvalue()
        error = text[text.find("error:") + len("error:"):] if "error:" in text else text
        from gnnlm.lit.config_errors import unknown_key

        unknown = unknown_key(error)
        if unknown is not None:
            raise ValueError(f"The `gnnlm fit` config {' + '.join(configs)} does not parse: "
                             f"{unknown}") from None
        details = [line.strip() for line in error.splitlines()
                   if line.strip() and not line.strip().startswith(("Subtypes:", "- Expected a",
                                                                     "Given value"))]
        raise ValueError(f"The `gnnlm fit` config {' + '.join(configs)} does not parse: "
                         f"{' '.join(details)[:600]}") from None
    finally:
        seed_log.setLevel(level)
    raise AssertionError("LightningCLI returned without parsing")  # ParseOnly always raises


def check_fit_configs(cfg: PipelineSettings) -> None:
    """Parse every trained part's config (``check_fit_config``), then check each head's parsed
    data module against the retrieval artifacts the pipeline builds
    (``gnnlm.pipeline.head_checks.check_head``): before any work, nothing built."""
    for chain in cfg.fit_chains():
        check_fit_config(chain)
    for row, paths in cfg.heads().items():
        check_head(cfg, row, paths, check_fit_config(paths).data)


def cli_bases() -> tuple[type[pl.LightningModule], type[pl.LightningDataModule]]:
    """The base classes of a ``gnnlm fit`` config's model and data (``subclass_mode``: any
    subclass), as the pipeline builds and parses them."""
    import pytorch_lightning as pl

    return pl.LightningModule, pl.LightningDataModule
