"""The project's own metadata installs without a warning: setuptools reads ``pyproject.toml``
as ``pip install`` does (``make setup``), and nothing in it is deprecated."""
from __future__ import annotations

import re
import warnings

from tests.conftest import REPO


def test_pyproject_installs_without_a_deprecation_warning():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert [str(w.message).splitlines()[0] for w in caught] == []
    # the licence as an SPDX expression (a TOML table is deprecated), which setuptools reads
    # from version 77 on: the build requires it
    assert dist.metadata.license_expression == "Apache-2.0"
    requires = re.search(r"^requires = (.*?)(?:  #.*)?$", (REPO / "pyproject.toml").read_text(),
                         re.MULTILINE)
    assert requires is not None and requires.group(1) == '["setuptools>=77"]'
