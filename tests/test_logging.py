"""Run logs for people: TensorBoard events equal to metrics.jsonl, tokens/s per device and MFU, profiler
traces (`train.profile_steps`), and launch/plot.py's PNG from a real run's workdir."""

import glob
import json
import math
import os
import sys

import jax
import pytest

from helpers import ROOT, read_metrics, run_launcher, tiny_config
from parallax.config import apply_override
from parallax.errors import ConfigError
from parallax.plan import make_plan
from parallax.summary import TensorBoardWriter, read_scalars
from parallax.throughput import Throughput, peak_flops
from parallax.train import train_and_evaluate


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 4-step run on data=8 with steps 2..3 profiled: (workdir, metrics.jsonl records, log lines)."""
    workdir = str(tmp_path_factory.mktemp("run"))
    config = tiny_config(data=8)
    config.train.update(steps=4, eval_every=2, checkpoint_every=0, profile_steps=(2, 3))
    lines = []
    train_and_evaluate(config, workdir, log=lines.append)
    return workdir, read_metrics(workdir), lines


@pytest.mark.slow  # the run fixture: about 40 s on 2 busy cores
def test_tensorboard_events_hold_the_metrics_jsonl_scalars(run):
    workdir, records, _ = run
    scalars = read_scalars(os.path.join(workdir, "tb"))
    expected = {}
    for r in records:
        for key, value in r.items():
            if key not in ("step", "includes_compile"):
                expected.setdefault(key, []).append((r["step"], value))
    assert {"loss", "eval_loss", "lr", "grad_norm", "tokens_per_sec", "tokens_per_sec_per_device"} <= set(expected)
    assert set(scalars) == set(expected)
    for key, values in expected.items():
        assert [s for s, _ in scalars[key]] == [s for s, _ in values], key
        for (_, got), (_, want) in zip(scalars[key], values):
            assert got == pytest.approx(want, rel=1e-6), key  # float32 in the event file


@pytest.mark.slow  # the run fixture: about 40 s on 2 busy cores
def test_tokens_per_device_and_no_mfu_on_cpu(run):
    _, records, lines = run
    for r in records:
        assert r["tokens_per_sec_per_device"] == pytest.approx(r["tokens_per_sec"] / 8)
        assert r["tokens_per_sec"] == pytest.approx(16 * 32 / r["step_time_s"])
        assert "mfu" not in r  # no peak known for a CPU: no number at all
    assert any("MFU n/a" in line and "'cpu'" in line for line in lines)


@pytest.mark.slow  # the run fixture: about 40 s on 2 busy cores
def test_profile_steps_leave_a_trace(run):
    workdir, _, _ = run
    traces = glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


@pytest.mark.slow  # the run fixture: about 40 s on 2 busy cores
def test_plot_writes_a_png_from_a_runs_workdir(run, tmp_path):
    workdir, _, _ = run
    out = tmp_path / "curves.png"
    flags = [f"--workdir={workdir}", f"--compare={workdir}", f"--out={out}"]
    result = run_launcher("plot", *flags)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = run_launcher("plot", *flags[:1])  # default: WORKDIR/metrics.png
    assert result.returncode == 0 and os.path.getsize(os.path.join(workdir, "metrics.png")) > 0, result.stderr


@pytest.mark.parametrize("contents", [None, "", '{"step": 1, "lo'], ids=["missing", "empty", "torn"])
def test_plot_without_logged_steps_exits_2_naming_the_workdir(tmp_path, contents):
    if contents is not None:
        (tmp_path / "metrics.jsonl").write_text(contents)
    result = run_launcher("plot", f"--workdir={tmp_path}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"plot: {tmp_path}: ") and "train" in lines[0], result.stderr
    assert not (tmp_path / "metrics.png").exists()


def test_bad_profile_steps_exit_2_with_the_fix(tmp_path):
    result = run_launcher("train", f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}",
                          f"--workdir={tmp_path / 'w'}", "--config.train.profile_steps=5,2")
    assert result.returncode == 2
    assert result.stderr.startswith("config error: config.train.profile_steps=(5, 2): expected two steps FIRST,LAST")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("value", ["3", "0,2", "2,11", "a,b", "1,2,3"])
def test_profile_steps_must_be_two_steps_within_the_run(value):
    config = tiny_config(data=8)  # train.steps=10
    apply_override(config, "train.profile_steps", value)
    with pytest.raises(ConfigError, match=r"config.train.profile_steps=.*FIRST,LAST .*train.steps=10"):
        make_plan(config, 8)
    apply_override(config, "train.profile_steps", "2,10")
    make_plan(config, 8)


def test_tensorboard_resume_purges_the_steps_a_killed_run_logged_after_its_checkpoint(tmp_path):
    first = TensorBoardWriter(tmp_path, 0)
    for step in (1, 2, 3, 4):  # a run killed after step 4, last checkpoint at step 2
        first.write({"step": step, "loss": float(step), "includes_compile": step == 1})
    first.close()
    second = TensorBoardWriter(tmp_path, 2)
    for step in (3, 4, 5):
        second.write({"step": step, "loss": 10.0 * step})
    second.close()
    assert read_scalars(str(tmp_path)) == {"loss": [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]}


def test_peak_flops_table_knows_the_accelerators_by_device_kind():
    assert peak_flops("TPU v4") == 275e12
    assert peak_flops("TPU v5 lite") == 197e12 and peak_flops("TPU v5") == 459e12  # v5e, v5p
    assert peak_flops("TPU v6 lite") == 918e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    for kind in ("cpu", "TPU v4 lite", "NVIDIA GeForce RTX 4090", ""):
        assert peak_flops(kind) is None


def test_mfu_is_model_flops_per_second_over_the_peak():
    speed = Throughput(tokens_per_step=1000, num_devices=4, flops_per_token=6e9, device_kind="TPU v4",
                       peak=275e12)
    m = speed.metrics(step_time_s=0.01)  # 100k tokens/s, 25k per device, 1.5e14 FLOP/s per device
    assert m["tokens_per_sec_per_device"] == pytest.approx(25_000)
    assert m["mfu"] == pytest.approx(1.5e14 / 275e12)
    assert "mfu" not in Throughput(1000, 4, 6e9, "cpu", None).metrics(0.01)


def _llama_flops_by_hand(m, seq_len):
    """6 x (matmul parameters: attention, MLP, head; no embedding lookup; norms) + 12 L H Dh T."""
    D, H, K, Dh, F, V, L = m.d_model, m.num_heads, m.num_kv_heads, m.d_model // m.num_heads, m.d_ff, m.vocab_size, \
        m.num_layers
    per_layer = D * H * Dh + 2 * D * K * Dh + H * Dh * D + 3 * D * F + 2 * D
    return 6 * (L * per_layer + D * V + D) + 12 * L * H * Dh * seq_len


@pytest.mark.parametrize("model", ["llama", "gpt2", "moe"])
def test_flops_per_token_counts_matmul_params_and_attention(model):
    config = tiny_config(model)
    plan = make_plan(config, 1)
    m, t = config.model, config.train.seq_len
    got = plan.model_class.flops_per_token(plan.model_config, t, plan.abstract_params, plan.logical)
    if model == "llama":
        assert got == _llama_flops_by_hand(m, t)
    elif model == "gpt2":  # tied head counts, the position table is a lookup
        n = plan.num_params - math.prod(plan.abstract_params["wpe"].shape)
        assert got == 6 * n + 12 * m.num_layers * m.d_model * t
    else:  # routed experts count top_k / num_experts of their parameters
        experts = sum(math.prod(v.shape) for k, v in plan.abstract_params["blocks"].items() if k.startswith("we_"))
        dense = plan.num_params - experts - math.prod(plan.abstract_params["embedding"].shape)
        layers = m.num_layers + m.moe.first_dense
        dh = m.head_dim or m.d_model // m.num_heads
        assert got == pytest.approx(6 * (dense + experts * m.moe.top_k / m.moe.num_experts)
                                    + 12 * layers * m.num_heads * dh * t)
        assert got < 6 * (plan.num_params - math.prod(plan.abstract_params["embedding"].shape)) + \
            12 * layers * m.num_heads * dh * t


def test_a_model_without_a_flops_hook_counts_6_per_non_lookup_parameter():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from parallax.defaults import load_config_file
    config = load_config_file(os.path.join(ROOT, "tests", "user_model_config.py"))
    plan = make_plan(config, 1)
    got = plan.model_class.flops_per_token(plan.model_config, 16, plan.abstract_params, plan.logical)
    assert got == 6 * (plan.num_params - math.prod(plan.abstract_params["table"].shape))


def test_progress_line_shows_mfu_only_when_logged():
    from parallax.train import _progress_line
    record = {"step": 5, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1e4, "step_time_s": 0.1}
    assert "mfu" not in _progress_line(record, 10, 1.0)
    assert "mfu 41.2%" in _progress_line({**record, "mfu": 0.412}, 10, 1.0)


def test_plot_reads_a_step_that_completed_no_batch_and_draws_its_eval(tmp_path):
    """A 2bw run's first row has no loss (no batch completed) but may have an eval loss: plots keep the row
    (its eval point) and draw the train loss from the rows that have one."""
    from parallax.plots import plot_runs, read_metrics as plot_metrics

    rows = [{"step": 1, "lr": 1e-3, "eval_loss": 5.0, "tokens_per_sec": 10.0},
            {"step": 2, "loss": 4.0, "grad_norm": 1.0, "lr": 1e-3, "eval_loss": 4.5, "tokens_per_sec": 10.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["step"] for r in plot_metrics(str(tmp_path))] == [1, 2]
    out = plot_runs([str(tmp_path)], str(tmp_path / "curves.png"))
    assert open(out, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_every_logged_curve_per_run_and_per_mixture_source():
    """The panels and lines `plot_runs` draws, against the rows: learning rate, gradient norm, eval loss per
    mixture source, MFU in percent; the first step (compilation) left out of the speed panels only."""
    from parallax.plots import curves

    a = [{"step": 1, "loss": 4.0, "grad_norm": 2.0, "lr": 1e-4, "tokens_per_sec_per_device": 5.0, "mfu": 0.1,
          "includes_compile": True},
         {"step": 2, "loss": 3.0, "grad_norm": 1.5, "lr": 2e-4, "tokens_per_sec_per_device": 50.0, "mfu": 0.4,
          "eval_loss": 3.5, "eval_loss/code": 3.2, "eval_loss/web": 3.9}]
    b = [{"step": 1, "loss": 5.0, "lr": 1e-3, "tokens_per_sec": 7.0}]  # no grad norm, eval or MFU logged
    got = curves([a, b], ["a", "b"])
    assert list(got) == ["train loss", "eval loss", "learning rate", "gradient norm", "tokens/s per device", "MFU (%)"]
    assert got["train loss"] == {"a": ([1, 2], [4.0, 3.0]), "b": ([1], [5.0])}
    assert got["eval loss"] == {"a": ([2], [3.5]), "a/code": ([2], [3.2]), "a/web": ([2], [3.9])}
    assert got["learning rate"] == {"a": ([1, 2], [1e-4, 2e-4]), "b": ([1], [1e-3])}
    assert got["gradient norm"] == {"a": ([1, 2], [2.0, 1.5])}
    assert got["tokens/s per device"] == {"a": ([2], [50.0]), "b": ([1], [7.0])}
    assert got["MFU (%)"] == {"a": ([2], [40.0])}
    assert list(curves([b], ["b"])) == ["train loss", "learning rate", "tokens/s per device"]


def _wandb_records(path):
    """The protobuf records of an offline W&B run file (`run-ID.wandb`): a 7-byte header (':W&B', magic,
    version), then LevelDB's log format (32 KiB blocks; each chunk: CRC 4, length 2, type 1: full / first /
    middle / last). Read here, independently of wandb, which ships no reader."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = open(path, "rb").read(), 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4) and pending:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_the_metrics_and_the_config_and_a_resume_continues_it(tmp_path, monkeypatch):
    """train.wandb_project with wandb_mode=offline: 2 steps, then a rerun to 4 resumes the same W&B run (the
    id kept in the workdir); each run file holds its steps' metrics.jsonl values, the config once (the first);
    off by default; a bad mode is one line."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    workdir = str(tmp_path / "run")
    config = tiny_config()
    config.train.update(steps=2, eval_every=2, checkpoint_every=2, log_every=1, wandb_project="parallax-test",
                        wandb_mode="offline")
    config.optim.decay_steps = 4
    train_and_evaluate(config, workdir, devices=jax.devices()[:1], log=lambda *_: None)
    config.train.steps = 4
    train_and_evaluate(config, workdir, devices=jax.devices()[:1], log=lambda *_: None)
    run_id = open(os.path.join(workdir, "wandb_run_id")).read().strip()
    files = sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", f"run-{run_id}.wandb")))
    assert len(files) == 2, os.listdir(os.path.join(workdir, "wandb"))
    logged, configs = {}, []
    for path in files:
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                logged[items["_step"]] = items
            elif kind == "config":
                configs.append({i.key or "/".join(i.nested_key) for i in record.config.update})
            elif kind == "run":
                configs.append({k.key for k in record.run.config.update})
    want = {r["step"]: r for r in read_metrics(workdir)}
    assert sorted(logged) == [1, 2, 3, 4] == sorted(want)
    for step, r in want.items():
        for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "eval_loss"):
            if key in r:
                assert logged[step][key] == pytest.approx(r[key], rel=1e-6), (step, key)
    assert sum("model" in c for c in configs) == 1, configs  # the config, logged by the first run only
    assert not tiny_config().train.wandb_project  # off by default
    config.train.wandb_mode = "cloud"
    with pytest.raises(ConfigError, match=r"config.train.wandb_mode='cloud': expected online or offline"):
        make_plan(config, 1)
