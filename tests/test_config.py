"""Config contracts: every config file shape-checks; bad input exits 2 with one line naming the fix."""

import glob
import os
import sys

import pytest

from helpers import ROOT, run_launcher
from parallax.config import apply_override
from parallax.defaults import load_config_file
from parallax.errors import ConfigError
from parallax.sharding import make_rules
from parallax.trainer import shape_check

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
DEVICES = {"llama3_8b.py": 8, "llama3_70b.py": 64, "llama3_70b_pp.py": 64, "mixtral_8x7b.py": 64,
           "deepseek_v3.py": 512, "qwen3_30b_a3b.py": 32}


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_file_loads_and_passes_shape_inference(path):
    config = load_config_file(path)
    result = shape_check(config, DEVICES.get(os.path.basename(path), 8))
    assert result["params"] > 0 and result["loss_shape"] == ()


def test_shape_check_traces_pipelined_and_tensor_parallel_paths():
    config = load_config_file(os.path.join(ROOT, "configs/tiny.py"))
    config.mesh.update(data=1, pipe=2, tensor=2, seq=2)
    config.model.update(num_layers=4, attention="ulysses", num_kv_heads=4)
    assert shape_check(config, 8)["loss_shape"] == ()


def test_llama3_configs_have_the_published_sizes():
    assert shape_check(load_config_file(os.path.join(ROOT, "configs/llama3_8b.py")), 8)["params"] == 8_030_261_248
    assert shape_check(load_config_file(os.path.join(ROOT, "configs/llama3_70b.py")), 64)["params"] == 70_553_706_496


def test_override_parses_to_the_key_type():
    config = load_config_file(os.path.join(ROOT, "configs/tiny.py"))
    apply_override(config, "train.steps", "7")
    apply_override(config, "optim.lr", "0.5")
    apply_override(config, "train.async_checkpoint", "false")
    apply_override(config, "sharding.rules.batch", "data,fsdp")
    assert (config.train.steps, config.optim.lr, config.train.async_checkpoint) == (7, 0.5, False)
    assert config.sharding.rules.batch == ("data", "fsdp")
    apply_override(config, "sharding.rules.embed", "fsdp,seq")  # a str rule: several axes by commas
    assert make_rules(dict(config.sharding.rules))["embed"] == ("fsdp", "seq")
    with pytest.raises(ConfigError, match="unknown key 'stepz'"):
        apply_override(config, "train.stepz", "1")


BAD = [
    (["--config.mesh.data=3"], "config.mesh (data=3) has 3 devices but 8"),
    (["--config.mesh.data=8", "--config.train.global_batch_size=12"], "global_batch_size=12"),
    (["--config.mesh.data=8", "--config.train.microbatches=3"], "microbatches 3"),
    (["--config.model.num_heads=6"], "num_heads=6"),
    (["--config.mesh.data=2", "--config.mesh.tensor=4", "--config.model.num_kv_heads=2"], "num_kv_heads=2: not divisible by mesh.tensor=4"),
    (["--config.train.stepz=5"], "unknown key 'stepz'"),
    (["--config.train.steps=many"], "expected an int"),
    (["--config.model.dtype=float16"], "dtype='float16'"),
    (["--config.sharding.rules.embed=fsdpp"], "'fsdpp' is not a mesh axis"),
    (["--config.train.log_every=0"], "config.train.log_every=0: must be >= 1"),
]


@pytest.mark.parametrize("args,expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_exits_2_with_one_line(args, expected, tmp_path):
    proc = run_launcher("train", "--config=configs/tiny.py", f"--workdir={tmp_path}", "--cpu_devices=8", *args,
                        timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0]
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def test_a_mesh_on_one_visible_device_names_cpu_devices(tmp_path):
    one_device = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                          if not f.startswith("--xla_force_host_platform_device_count"))
    proc = run_launcher("train", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}", "--config.mesh.fsdp=2",
                        env={**os.environ, "XLA_FLAGS": one_device}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "config error: config.mesh.fsdp=2: does not divide the 1 device (data=-1 takes the rest); make it a divisor "
        "of 1; only 1 device visible: on CPU, simulate 2 with --cpu_devices=2"], proc.stderr
    assert not os.path.exists(tmp_path / "run")
    from parallax.mesh import resolve_axis_sizes
    with pytest.raises(ConfigError, match=r"^config.mesh \(fsdp=4\) has 4 devices but 2 are available; make the "
                                          r"product 2 \(or set one axis to -1\); only 2 devices visible: on CPU, "
                                          r"simulate 4 with --cpu_devices=4$"):
        resolve_axis_sizes({"data": 1, "fsdp": 4}, 2, "cpu")
    with pytest.raises(ConfigError, match=r"available; make the product 2 \(or set one axis to -1\)$"):
        resolve_axis_sizes({"data": 1, "fsdp": 4}, 2, "tpu")  # real chips: --cpu_devices is no fix


def test_print_config_fed_back_as_the_config_trains_the_same_run(tmp_path):
    from parallax.defaults import config_from_args
    from parallax.train import train_and_evaluate

    overrides = ["--config.train.steps=3", "--config.train.eval_every=0", "--config.train.checkpoint_every=0",
                 "--config.optim.lr=0.003", "--config.mesh.fsdp=2"]
    printed = {}
    for form in ("python", "json"):
        proc = run_launcher("train", "--config=configs/tiny.py", *overrides, f"--print_config={form}",
                            f"--workdir={tmp_path / 'untouched'}", timeout=120)
        assert proc.returncode == 0, proc.stderr
        printed[form] = tmp_path / f"resolved.{'py' if form == 'python' else 'json'}"
        printed[form].write_text(proc.stdout)
    assert not os.path.exists(tmp_path / "untouched")
    original = config_from_args(os.path.join(ROOT, "configs/tiny.py"), [tuple(o[9:].split("=")) for o in overrides])
    resolved = load_config_file(str(printed["python"]))
    assert resolved.to_json_best_effort() == original.to_json_best_effort()
    assert load_config_file(str(printed["json"])).to_json_best_effort() == original.to_json_best_effort()
    runs = [train_and_evaluate(c, str(tmp_path / name), log=lambda *_: None).history
            for c, name in ((original, "original"), (resolved, "resolved"))]
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]] and len(runs[0]) == 3


def test_dry_run_checks_and_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    proc = run_launcher("train", "--config=configs/tiny.py", f"--workdir={workdir}", "--cpu_devices=8",
                        "--config.mesh.fsdp=2", "--dry_run", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "mesh data=4 fsdp=2 (8 cpu devices)" in proc.stdout and "peak" in proc.stdout, proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run: every check passed; nothing was trained")
    assert not os.path.exists(workdir)
    proc = run_launcher("train", "--config=configs/tiny.py", f"--workdir={workdir}", "--cpu_devices=8",
                        "--config.mesh.data=3", "--dry_run", timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "config error: config.mesh (data=3) has 3 devices but 8 are available; make the product 8 (or set one "
        "axis to -1)"], proc.stderr
    assert not os.path.exists(workdir)


def test_printed_config_loads_back_with_non_finite_values_and_any_command(tmp_path):
    """Non-finite floats are printed as float('inf'), and the command that printed it stays a comment, so a
    path with a backslash or triple quotes does not break the file."""
    from parallax.defaults import config_source

    config = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
    config.optim.clip_norm = float("inf")
    path = tmp_path / "resolved.py"
    path.write_text(config_source(config, 'launch/train.py --config.data.path=C:\\Users\\x """ \n'))
    again = load_config_file(str(path))
    assert again.optim.clip_norm == float("inf")
    assert again.to_json_best_effort() == config.to_json_best_effort()


def test_dry_run_decides_resume_as_training_does(tmp_path):
    """Checkpoints without config.json: refused as training refuses them; a config.json without a checkpoint
    (a run killed before its first save): a new run, as training starts one."""
    import jax

    from parallax.memory import dry_run

    config = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
    for axis in config.mesh:
        config.mesh[axis] = 1
    orphan = tmp_path / "orphan"
    (orphan / "checkpoints" / "3").mkdir(parents=True)
    with pytest.raises(ConfigError, match="has checkpoints .* but no config.json"):
        dry_run(config, str(orphan), jax.devices()[:1])
    killed = tmp_path / "killed"
    killed.mkdir()
    other = load_config_file(os.path.join(ROOT, "configs", "tiny.py"))
    other.optim.lr = 0.5
    (killed / "config.json").write_text(other.to_json_best_effort())
    assert "a new run" in dry_run(config, str(killed), jax.devices()[:1])
    assert sorted(os.listdir(killed)) == ["config.json"]


def test_config_keys_page_is_current():
    """docs/config-keys.md is what parallax/configdoc.py prints now: a key added, removed or re-commented
    without regenerating the page fails here (`python -m parallax.configdoc > docs/config-keys.md`)."""
    from parallax.configdoc import config_keys_page

    page = config_keys_page()
    assert open(os.path.join(ROOT, "docs", "config-keys.md")).read() == page, (
        "docs/config-keys.md is out of date: python -m parallax.configdoc > docs/config-keys.md")
    for section, node in load_config_file(os.path.join(ROOT, "configs", "moe_tiny.py")).items():
        if section != "sharding":
            assert all(f"`{section}.{key}`" in page for key in node if not hasattr(node[key], "keys")), section


BAD_FILES = [
    ("def get_config(:\n    pass\n", r"--config=\S+bad.py:1: SyntaxError: "),
    ("from parallax.defaults import default_config\n\ndef get_config():\n    return 1 / 0\n",
     r"--config=\S+bad.py:4: ZeroDivisionError: division by zero \(return 1 / 0\); fix the config file"),
    ("from parallax.defaults import default_config\n\ndef get_config():\n    config = default_config('llama')\n"
     "    config.train.stpes = 5\n    return config\n",
     r"--config=\S+bad.py:5: unknown key 'stpes' \(config.train.stpes = 5\); close valid keys: steps"),
    ("from parallax.defaults import default_config\n\ndef get_config():\n    config = default_config('llama')\n"
     "    config.model.update(num_layer=4)\n    return config\n",
     r"--config=\S+bad.py:5: unknown key 'num_layer' .*; close valid keys: num_layers"),
]


@pytest.mark.parametrize("text,expected", BAD_FILES, ids=["syntax", "raises", "typo", "typo-in-update"])
def test_bad_config_file_is_one_line_naming_file_and_line(text, expected, tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected) as info:
        load_config_file(str(path))
    assert "\n" not in str(info.value)


def test_bad_config_file_exits_2_from_the_launcher(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(BAD_FILES[2][0])
    proc = run_launcher("train", f"--config={path}", f"--workdir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "bad.py:5: unknown key 'stpes'" in lines[0] and "steps" in lines[0], proc.stderr
    assert not os.path.exists(tmp_path / "run")


def test_default_config_is_locked_but_user_model_keys_come_from_its_defaults():
    from parallax.defaults import default_config
    config = default_config("llama")
    with pytest.raises(AttributeError, match="cannot be added since the config is locked"):
        config.optim.learning_rate = 1.0
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    user = load_config_file(os.path.join(ROOT, "tests", "user_model_config.py"))
    assert user.model.width == 16 and user.is_locked


def test_readme_python_tour_runs_up_to_training(monkeypatch):
    """The README's Python API block, imports and config lines (everything before it trains), runs as
    written: a moved function breaks it here, not in a user's first session."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    start = readme.index("```python", readme.index("## The Python API")) + len("```python\n")
    lines = readme[start:readme.index("```", start)].splitlines()
    setup = "\n".join(lines[:next(i for i, line in enumerate(lines) if line.startswith("result ="))])
    scope = {}
    monkeypatch.chdir(ROOT)  # the README's paths are relative to the checkout
    exec(setup, scope)  # noqa: S102 -- the README's own code
    assert scope["config"].train.steps == 100


def test_platform_flags_are_added_per_platform_and_a_users_setting_wins():
    from parallax.mesh import PLATFORM_FLAGS, TPU_FUSION_FLAGS, apply_platform_flags, detect_platform

    env = {"LIBTPU_INIT_ARGS": "--xla_tpu_overlap_compute_collective_tc=false --my_flag=1"}
    variable, added = apply_platform_flags("tpu", env, generation="v5p")
    assert variable == "LIBTPU_INIT_ARGS" and "--xla_tpu_overlap_compute_collective_tc=true" not in added
    assert env[variable].split() == ["--xla_tpu_overlap_compute_collective_tc=false", "--my_flag=1", *added]
    assert len(added) == len(PLATFORM_FLAGS["tpu"][1]) - 1 and not set(added) & set(TPU_FUSION_FLAGS[1])
    assert apply_platform_flags("tpu", env, generation="v5p") == ("LIBTPU_INIT_ARGS", [])  # idempotent
    assert apply_platform_flags("tpu", env, generation="v5e")[1] == list(TPU_FUSION_FLAGS[1])  # v5e only
    env = {}
    assert apply_platform_flags("gpu", env) == ("XLA_FLAGS", ["--xla_gpu_enable_latency_hiding_scheduler=true"])
    assert apply_platform_flags("cpu", env) == ("", []) and list(env) == ["XLA_FLAGS"]
    old = os.environ.get("JAX_PLATFORMS")
    try:
        os.environ["JAX_PLATFORMS"] = "cuda,cpu"
        assert detect_platform() == "gpu"
    finally:
        os.environ.pop("JAX_PLATFORMS") if old is None else os.environ.update(JAX_PLATFORMS=old)


SAVED_BEFORE_RENAMES = os.path.join(ROOT, "tests", "saved", "config_86d63e5.json")


def test_a_config_json_saved_before_the_settings_redesign_resumes_and_trains(tmp_path):
    """tests/saved/config_86d63e5.json is the config.json a run of 86d63e5 wrote (tiny llama, Muon, fsdp 2,
    4 steps, muon_beta=0.9, b2=0.98, muon_ns_steps=4 in the flat optimizer keys since renamed). A workdir whose
    checkpoint it describes resumes under today's code, and the resumed run equals one never stopped."""
    from helpers import read_metrics
    from parallax.train import train_and_evaluate
    with open(SAVED_BEFORE_RENAMES) as f:
        saved = f.read()
    assert '"muon_beta"' in saved and '"b1"' in saved  # the old spelling: what the migration must read
    config = load_config_file(SAVED_BEFORE_RENAMES)
    assert (config.optim.name, config.optim.muon.beta, config.optim.adamw.b2, config.optim.muon.ns_steps) == (
        "muon", 0.9, 0.98, 4)
    assert "muon_beta" not in config.optim and "b2" not in config.optim  # moved, not copied
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    first = load_config_file(SAVED_BEFORE_RENAMES)
    first.train.steps = 2  # optim.decay_steps=4 keeps the LR schedule of the whole run
    train_and_evaluate(first, str(stopped), log=lambda *_: None)
    (stopped / "config.json").write_text(saved)  # the workdir as 86d63e5 would have left it
    train_and_evaluate(load_config_file(SAVED_BEFORE_RENAMES), str(stopped), log=lambda *_: None)
    train_and_evaluate(load_config_file(SAVED_BEFORE_RENAMES), str(straight), log=lambda *_: None)
    resumed, never_stopped = read_metrics(stopped), read_metrics(straight)
    assert [r["step"] for r in resumed if "loss" in r] == [1, 2, 3, 4]
    assert [(r["step"], r["loss"]) for r in resumed if "loss" in r] == [
        (r["step"], r["loss"]) for r in never_stopped if "loss" in r]


def test_a_renamed_key_names_its_new_name(tmp_path):
    config = load_config_file(os.path.join(ROOT, "configs/tiny.py"))
    with pytest.raises(ConfigError, match=r"^config.optim.muon_beta: renamed to optim.muon.beta; pass "
                                          r"--config.optim.muon.beta=0.9$"):
        apply_override(config, "optim.muon_beta", "0.9")
    old = tmp_path / "old.py"
    old.write_text("from parallax.defaults import default_config\n\n\ndef get_config():\n"
                   "    config = default_config(model='llama')\n    config.optim.update(sgd_momentum=0.9)\n"
                   "    return config\n")
    with pytest.raises(ConfigError, match=r"old.py:6: unknown key 'sgd_momentum' .*; it was renamed to "
                                          r"optim.sgd.momentum$"):
        load_config_file(str(old))
