"""The notebooks in notebooks/ run top to bottom on CPU (8 simulated devices), so none rots; the quickstart
draws its loss curve and its sharding picture; the committed notebooks carry no outputs."""

import os

import nbformat
import pytest

from helpers import ROOT

NOTEBOOKS = ("quickstart", "custom_model", "schedules", "fine_tuning")
STEPS = "12"  # PARALLAX_NOTEBOOK_STEPS: enough to log, evaluate, checkpoint and sample


def _read(name):
    return nbformat.read(os.path.join(ROOT, "notebooks", f"{name}.ipynb"), as_version=4)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebooks_have_no_outputs(name):
    nb = _read(name)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}.ipynb cell {i} has outputs"


def _execute(name, tmp_path, monkeypatch):
    """Runs the notebook in a fresh kernel that imports this checkout, from an empty directory."""
    from nbclient import NotebookClient

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("PARALLAX_NOTEBOOK_STEPS", STEPS)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = _read(name)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    return nb


def _images(cell):
    return [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]


def _tagged(nb, tag):
    cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, tag
    return cells[0]


@pytest.mark.slow
def test_quickstart_notebook_trains_and_draws_the_loss_and_the_sharding(tmp_path, monkeypatch):
    nb = _execute("quickstart", tmp_path, monkeypatch)
    assert _images(_tagged(nb, "loss-plot")), "the loss plot cell shows no PNG"
    assert _images(_tagged(nb, "sharding-picture")), "the sharding picture cell shows no PNG"
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "backend cpu: 8 x cpu" in text and "mesh data=2 fsdp=4" in text
    assert f"step {STEPS}/{STEPS}" in text and "sample:" in text


@pytest.mark.slow
def test_custom_model_notebook_trains_a_notebook_model_on_pipe_and_fsdp(tmp_path, monkeypatch):
    nb = _execute("custom_model", tmp_path, monkeypatch)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "'fsdp': 2, 'pipe': 2" in text and "schedule 1f1b" in text
    assert f"step {STEPS}/{STEPS}" in text
    assert "P('pipe', 'fsdp')" in text  # stacked block weights: layers over pipe, embed over fsdp
    assert _images(_tagged(nb, "loss-plot"))


@pytest.mark.slow
def test_fine_tuning_notebook_imports_trains_lora_samples_and_exports_what_transformers_repeats(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the notebook's stand-in model and its last check need '.[dev]'")
    nb = _execute("fine_tuning", tmp_path, monkeypatch)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "mesh fsdp=2 pipe=2" in text and f"step {STEPS}/{STEPS}" in text
    assert "as a peft adapter directory" in text and "same as parallax: True" in text


def test_schedules_notebook_draws_every_schedule(tmp_path, monkeypatch):
    nb = _execute("schedules", tmp_path, monkeypatch)
    from parallax.pipeline.schedule import SCHEDULES
    assert sum(len(_images(c)) for c in nb.cells) == len(SCHEDULES) + 2  # timelines, bubble plot, slots plot
