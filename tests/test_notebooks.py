"""Every notebook executes top to bottom (tiny settings: LATIM_NOTEBOOK_TINY=1)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
NEEDS_TORCH = {"converted_transformers.ipynb"}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    if path.name in NEEDS_TORCH and importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    monkeypatch.setenv("LATIM_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute(env={**os.environ})
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_with_its_outputs_and_its_run_time(path):
    """A reader opening a notebook sees its figures and numbers (scripts/run_notebooks.py saves them) and
    is told how long it runs; no cell's output dumps a training log, a progress bar or a library's
    warning (with the path of the machine that ran it)."""
    import json

    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    shown = [c for c in code if c.get("outputs")]
    assert len(shown) >= len(code) / 2, [c["source"][:1] for c in code if not c.get("outputs")]
    assert "Runs in about" in "".join(nb["cells"][0]["source"])
    for c in code:
        for out in c["outputs"]:
            text = "".join(out.get("text", []))
            assert "'history'" not in text and "'training'" not in text
            assert out.get("name") != "stderr" or not any(
                noise in text for noise in ("site-packages", "it/s]", "[transformers]", "Warning:")
            ), text[:300]


def test_run_notebooks_refuses_an_unknown_name(capsys):
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
    try:
        import run_notebooks
    finally:
        sys.path.pop(0)
    assert run_notebooks.main(["no_such_notebook"]) == 2
    assert "no such notebook" in capsys.readouterr().err
