"""The installable package: every Python package of the source tree is listed for setuptools
(an editable install finds an unlisted one through the source folder; a wheel does not)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = None


def _listed() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    if tomllib is not None:
        return set(tomllib.loads(text)["tool"]["setuptools"]["packages"])
    line = next(li for li in text.splitlines() if li.startswith("packages = "))
    return {p.strip().strip('"') for p in line.split("=", 1)[1].strip(" []").split(",")}


def test_every_package_is_listed_for_setuptools() -> None:
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "vkxsplit").rglob("__init__.py")}
    assert found, "no package found under vkxsplit/"
    # folders of package data only (no __init__.py) are listed too, or setuptools warns
    data = {"vkxsplit.spv", "vkxsplit.static"}
    assert all((ROOT / d.replace(".", "/")).is_dir() for d in data)
    assert found | data == _listed(), f"pyproject.toml packages differ from the tree: missing " \
                                      f"{(found | data) - _listed()}, stale {_listed() - found - data}"
