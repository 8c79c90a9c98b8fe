"""The model contract: parallax holds no model; GPT-2 (a second family, through the contract only) and a
user's model named by import path match their 1-device runs on every layout; contract errors are clear."""

import ast
import glob
import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

from helpers import ROOT, assert_parity, loss_grads_and_steps, read_metrics, run_launcher, tiny_config
from parallax.defaults import load_config_file
from parallax.errors import ConfigError
from parallax.plan import make_plan

TOL = 1e-5
LIBRARY = sorted(glob.glob(os.path.join(ROOT, "parallax", "**", "*.py"), recursive=True))


def test_library_imports_no_model_and_names_none_but_by_config():
    for path in LIBRARY:
        text = open(path).read()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "models" or n.startswith("models.") for n in names), (path, names)
        assert "gpt" not in text.lower(), path  # not one line of the library mentions GPT-2


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))), ids=os.path.basename)
def test_every_config_names_its_model(path):
    assert load_config_file(path).model.name in ("llama", "gpt2", "moe", "mistral", "mixtral", "qwen3_moe", "qwen2", "qwen3",
                                                 "gemma2", "gemma3")


@pytest.fixture(scope="module")
def gpt2_reference():
    return loss_grads_and_steps(_gpt2(), jax.devices()[:1])


def _gpt2(schedule="1f1b", attention="dense", microbatches=1, **mesh):
    config = tiny_config("gpt2", **mesh)
    config.model.update(num_layers=4, attention=attention)
    config.train.microbatches = microbatches
    config.pipeline.update(schedule=schedule, virtual_stages=2 if schedule in ("interleaved_1f1b", "zbv") else 1)
    return config


# GPT-2's own paths (learned positions, the tied head, biases, LayerNorm) on each kind of layout: the compiler's
# sharding (fsdp), the manual region (tensor, seq, accumulation), a pipeline with tensor / fsdp inside its
# stages (1F1B), and the split backward on a pipeline (zb_h1) and with the V placement that puts the tied
# table's two uses on one rank (zbv). Plain data parallelism, 1F1B over data and the interleaved schedule
# run in Llama's cases (dropped here for CI time, 2026-12-07).
GPT2_CASES = [
    ("fsdp=8", {}, dict(fsdp=8)),
    ("tensor=2,fsdp=4", {}, dict(tensor=2, fsdp=4)),
    ("seq=2,data=4-ulysses", dict(attention="ulysses"), dict(seq=2, data=4)),
    ("seq=2,tensor=2,fsdp=2-ring", dict(attention="ring"), dict(seq=2, tensor=2, fsdp=2)),
    ("tensor=2,data=4-accumulate2", dict(microbatches=2), dict(tensor=2, data=4)),
    ("pipe=2,tensor=2,fsdp=2", {}, dict(pipe=2, tensor=2, fsdp=2)),
] + [(f"pipe=2,data=4-{s}", dict(schedule=s), dict(pipe=2, data=4))
     for s in ("zb_h1", "zbv")]


@pytest.mark.slow
@pytest.mark.parametrize("options,mesh", [c[1:] for c in GPT2_CASES], ids=[c[0] for c in GPT2_CASES])
def test_gpt2_matches_single_device(gpt2_reference, options, mesh):
    assert_parity(loss_grads_and_steps(_gpt2(**options, **mesh), jax.devices()), gpt2_reference, TOL)


def test_gpt2_every_gradient_is_nonzero(gpt2_reference):
    for path, g in jax.tree_util.tree_flatten_with_path(gpt2_reference[1])[0]:
        assert np.abs(np.asarray(g)).max() > 0, jax.tree_util.keystr(path)


def _train(workdir, devices, *overrides):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "tests"), "JAX_PLATFORMS": "cpu"}
    run = run_launcher("train", f"--config={ROOT}/tests/user_model_config.py", f"--workdir={workdir}",
                       f"--cpu_devices={devices}", *overrides, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return read_metrics(workdir)


@pytest.mark.slow
def test_user_model_by_import_path_trains_pipelined_from_the_launcher(tmp_path):
    ref = _train(tmp_path / "one", 1)
    got = _train(tmp_path / "pipe", 4, "--config.mesh.pipe=2", "--config.mesh.fsdp=2")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=TOL)
    evals = [(r["eval_loss"], s["eval_loss"]) for r, s in zip(got, ref) if "eval_loss" in r]
    assert len(evals) == 2
    np.testing.assert_allclose(*zip(*evals), rtol=TOL)
    assert os.listdir(tmp_path / "pipe" / "checkpoints")


@pytest.mark.parametrize("change,match", [
    (dict(name="llama3"), "not a registered model"),
    (dict(name="no_such_module_xyz:Model"), "cannot import module 'no_such_module_xyz'"),
    (dict(name="parallax.model:Nope"), "has no attribute 'Nope'"),
    (dict(name="parallax.plan:Plan"), "not a subclass of parallax.model.Model"),
    (dict(name="gpt2"), "config.model.head_dim: not a key of model 'gpt2'"),
], ids=["unregistered", "no-module", "no-class", "not-a-model", "other-model-keys"])
def test_bad_model_name_is_one_line_naming_the_fix(change, match):
    config = tiny_config(data=8)
    config.model.update(change)
    with pytest.raises(ConfigError, match=match) as info:
        make_plan(config, 8)
    assert "\n" not in str(info.value)


def test_model_named_by_file_path_plans_like_the_registered_one():
    config = tiny_config(data=8)
    by_name = make_plan(config, 8)
    config.model.name = os.path.join(ROOT, "models", "llama.py") + ":Llama"  # a file with a dataclass
    by_path = make_plan(config, 8)
    assert by_path.model_class.__name__ == "Llama" and by_path.model_class is not by_name.model_class
    assert jax.tree.map(lambda a: a.shape, by_path.abstract_params) == \
        jax.tree.map(lambda a: a.shape, by_name.abstract_params)


_MY_CONFIG = """from parallax.defaults import default_config


def get_config():
    config = default_config(model="{name}")
    config.model.update(num_layers=2, vocab_size=64, width=16)
    return config
"""


def test_relative_model_file_is_found_next_to_the_config_file_and_stored_absolute(tmp_path, monkeypatch):
    """`model.name=my_model.py:Class` in project/my_config.py names project/my_model.py from any directory,
    and the config (so the workdir's config.json) holds it absolute: sampling from elsewhere finds it."""
    from parallax.defaults import load_saved_config

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir(), elsewhere.mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "user_model.py"), project / "my_model.py")
    (project / "my_config.py").write_text(_MY_CONFIG.format(name="my_model.py:ResidualMLP"))
    monkeypatch.chdir(elsewhere)
    config = load_config_file("../project/my_config.py")
    assert config.model.name == f"{project}/my_model.py:ResidualMLP"
    monkeypatch.chdir(tmp_path)
    assert load_saved_config(config.to_json_best_effort()).model.name == config.model.name
    assert make_plan(config, 1).model_class.__name__ == "ResidualMLP"
    old = json.loads(config.to_json_best_effort())  # saved before names were stored absolute
    old["model"]["name"] = "my_model.py:ResidualMLP"
    monkeypatch.chdir(project)  # from where that run started: found
    assert load_saved_config(json.dumps(old)).model.name == config.model.name
    monkeypatch.chdir(elsewhere)  # elsewhere: the line says the name comes from a saved config
    with pytest.raises(ConfigError, match="comes from a saved config .* write the file's absolute path"):
        load_saved_config(json.dumps(old))


def test_missing_relative_model_file_exits_2_naming_both_places(tmp_path):
    (tmp_path / "my_config.py").write_text(_MY_CONFIG.format(name="my_model.py:ResidualMLP"))
    proc = run_launcher("train", f"--config={tmp_path}/my_config.py", f"--workdir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "config error: config.model.name='my_model.py:ResidualMLP': "
        f"no file my_model.py next to the config file ({tmp_path}/my_model.py) or in the current directory "
        f"({ROOT}/my_model.py); name the file relative to the config file, or by an absolute path"], proc.stderr
    assert not os.path.exists(tmp_path / "run")


def test_model_without_tensor_parallelism_rejects_mesh_tensor():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    config = load_config_file(os.path.join(ROOT, "tests", "user_model_config.py"))
    config.mesh.update(data=4, tensor=2)
    with pytest.raises(ConfigError, match="does not implement tensor parallelism"):
        make_plan(config, 8)


def test_readme_example_is_the_tested_user_model():
    page = open(os.path.join(ROOT, "docs", "custom-models.md")).read()  # the docs' "Bring your own model"
    start = page.index("```python", page.index("# Bring your own model")) + len("```python\n")
    assert page[start:page.index("```", start)] in open(os.path.join(ROOT, "tests", "user_model.py")).read()


def test_gpt2_trains_on_documents_longer_than_its_position_table(tmp_path):
    """Issue 23: windows that start deep in a long document used to carry positions >= max_positions (counted
    from the document's true start), which the learned table read as NaN: a non-finite loss at step 1."""
    from parallax.train import train_and_evaluate

    config = tiny_config("gpt2")  # max_positions=64, synthetic documents of up to 2 * seq_len tokens
    config.train.update(seq_len=64, global_batch_size=4, steps=2, eval_every=0, checkpoint_every=0, log_every=1)
    result = train_and_evaluate(config, str(tmp_path), devices=jax.devices()[:1], log=lambda *_: None)
    assert [r["step"] for r in result.history] == [1, 2]
    assert np.isfinite([r["loss"] for r in result.history]).all()


def test_gpt2_position_outside_its_table_embeds_as_nan_not_a_clipped_row():
    from flax import nnx

    from models.gpt2 import GPT2

    config = tiny_config("gpt2")
    model = GPT2(config.model, nnx.Rngs(0))
    P = config.model.max_positions
    positions = np.array([[0, P - 1, P, -1]], np.int32)
    x = np.asarray(model.embed({"inputs": np.zeros_like(positions), "positions": positions}))  # (1, 4, D)
    assert np.isfinite(x[0, :2]).all() and np.isnan(x[0, 2:]).all()
