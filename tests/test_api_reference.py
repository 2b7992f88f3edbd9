"""docs/api.md is generated from the docstrings (tools/api_reference.py); the committed
page must be what the tool writes for the pyfa under test, and document every export."""

import importlib.util
from pathlib import Path

import pyfa

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "tools" / "api_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_api_page_is_current():
    tool = _tool()
    expected = tool.render(pyfa)
    assert tool.PAGE.read_text() == expected, "docs/api.md is stale: run python tools/api_reference.py"


def test_every_export_is_documented():
    text = _tool().render(pyfa)
    assert "(no docstring)" not in text
    for name in pyfa.__all__:
        assert f"### `pyfa.{name}" in text, name
