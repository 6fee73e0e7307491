"""Packaging: every package folder is listed in pyproject.toml, shipped data is present."""

from __future__ import annotations

import tomllib

from helpers import ROOT

MAPPED = {"api": "draftflow", "core": "draftflow.core", "plugins": "draftflow.plugins", "layers": "draftflow.layers", "tools": "draftflow.tools",
          "graphs": "draftflow.graphs"}


def test_every_package_folder_is_listed():
    """A plugin folder missing from [tool.setuptools] packages would vanish from a non-editable install."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, name in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"


def test_no_folder_shadows_the_package():
    """No top-level folder is named draftflow/, so running from the repo root imports the installed package."""
    assert not (ROOT / "draftflow").exists()
