"""docs/api.md, the API reference, is what docs/api.py writes from the docstrings of flashbob and optim: a change to
a public name, a signature or a docstring without ``python docs/api.py`` fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("docs_api", ROOT / "docs" / "api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_matches_the_docstrings():
    api = _generator()
    written = (ROOT / "docs" / "api.md").read_text()
    assert written == api.render(), "docs/api.md is out of date with the docstrings: run python docs/api.py"


def test_api_reference_names_every_public_name():
    import flashbob
    import optim

    text = (ROOT / "docs" / "api.md").read_text()
    names = [f"flashbob.{name}" for name in flashbob.__all__ if not name.startswith("__")]
    names += [f"optim.{name}" for name in optim.__all__]
    missing = [name for name in names if f"### `{name}`" not in text]
    assert not missing, f"docs/api.md has no entry for {missing}"
