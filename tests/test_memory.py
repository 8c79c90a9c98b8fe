"""launch/plan.py and parallax.memory: XLA's per-device memory of the compiled train step, the analytic
estimate beside it, and the fits / does-not-fit contract, on simulated CPU devices and (with libtpu) for a
TPU topology."""

import importlib.util
import os
import re
import types

import jax
import pytest

from helpers import ROOT, run_launcher, tiny_config
from parallax import memory as memory_lib
from parallax.memory import MemoryReport, advice, memory_report


@pytest.mark.parametrize("mesh", [dict(data=8), dict(fsdp=8), dict(pipe=2, fsdp=2, data=2), dict(tensor=2, fsdp=4),
                                  dict(pipe=2, fsdp=2, data=2, schedule="2bw")],
                         ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_analytic_state_matches_xla_arguments_within_15_percent(mesh):
    mesh = dict(mesh)
    schedule = mesh.pop("schedule", None)
    config = tiny_config(**mesh)
    config.model.num_layers = 4
    if schedule:  # 2bw's state also holds the previous weights and the microbatches in flight
        config.pipeline.update(schedule=schedule, microbatches=4)
    report = memory_report(config, jax.devices())
    assert abs(report.analytic_state - report.xla_arguments) <= 0.15 * report.xla_arguments
    assert report.xla_temp > 0 and report.peak >= report.xla_arguments
    assert (report.path_state > report.params) == bool(schedule)  # holds a copy of the weights and more


def test_fsdp_shards_the_state_per_device():
    dense = memory_report(tiny_config(data=8), jax.devices())
    sharded = memory_report(tiny_config(fsdp=8), jax.devices())
    assert sharded.params < dense.params / 2 and sharded.optimizer < dense.optimizer / 2


def _plan(*args):
    return run_launcher("plan", *args, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_plan_says_whether_it_fits_on_the_last_line_and_in_the_exit_status():
    args = [f"--config={ROOT}/configs/tiny.py", "--config.mesh.data=2", "--config.mesh.fsdp=2"]
    fits = _plan(*args, "--hbm_gib=1", "--chip=h100", "--dcn_axes=data")  # and the step-time estimate
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert fits.stdout.strip().splitlines()[-1].endswith("hbm_gib=1 fits=yes")
    assert "\nestimated step on NVIDIA H100 SXM: " in fits.stdout and " (DCN)" in fits.stdout, fits.stdout
    bad = _plan(*args, "--chip=h100", "--dcn_axes=pod")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "config error: --dcn_axes=pod: 'pod' is not a mesh axis (data, expert, fsdp, pipe, replica, seq, tensor)"], \
        bad.stderr
    too_small = _plan(*args, "--hbm_gib=1e-6")
    assert too_small.returncode == 1 and too_small.stdout.strip().splitlines()[-1].endswith("fits=no")
    assert "does not fit; try:" in too_small.stdout
    inferred = _plan(f"--config={ROOT}/configs/tiny.py")  # data=-1
    assert inferred.returncode == 2 and "pass --devices=N" in inferred.stderr


def test_plan_compiles_for_a_tpu_topology_and_checks_the_mesh_against_its_devices():
    pytest.importorskip("libtpu")
    args = [f"--config={ROOT}/configs/tiny.py", "--topology=v5p:2x2x1"]
    run = _plan(*args, "--config.mesh.data=2", "--config.mesh.fsdp=2")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "4 x TPU v5 (--topology=v5p:2x2x1, compiled by XLA:TPU" in run.stdout
    assert run.stdout.strip().splitlines()[-1].endswith("hbm_gib=95 fits=yes")  # v5p's HBM by default
    assert "| the compiler's peak (peak_memory_in_bytes" in run.stdout  # XLA:TPU's own, beside the sum
    mismatched = _plan(*args, "--config.mesh.data=8")
    assert mismatched.returncode == 2
    assert "(4 devices)" in mismatched.stderr and "has 8 devices" in mismatched.stderr
    # two slices over the data-center network, data over DCN, priced at v5p's DCN in the estimate
    two = _plan(*args, "--slices=2", "--config.mesh.data=2", "--config.mesh.fsdp=4", "--config.dcn.data=2")
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
    assert "8 x TPU v5 in 2 slices (--topology=v5p:2x2x1" in two.stdout
    assert re.search(r"all-reduce over data: \d+ x", two.stdout) and " across slices)" in two.stdout


def test_pipelined_plan_compiles_for_a_tpu_topology_with_the_attention_kernel():
    """A pipelined step (zbv, an uneven layout, the vocabulary layers over the pipe ranks) compiled by XLA:TPU
    calls splash attention inside the executor's stages (the executor's region is manual over every mesh
    axis: a Mosaic kernel cannot sit in an automatically partitioned one), and plan.py prints each pipe
    rank's balance."""
    pytest.importorskip("libtpu")
    run = _plan(f"--config={ROOT}/configs/tiny.py", "--topology=v5p:2x2x1", "--config.mesh.data=2",
                "--config.mesh.pipe=2", "--config.pipeline.schedule=zbv", "--config.pipeline.virtual_stages=2",
                "--config.model.num_layers=3", "--config.pipeline.layout=auto", "--config.pipeline.vocab_parallel=true",
                "--config.model.attention_impl=splash", "--config.train.seq_len=128", "--config.model.attention_block=128")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert re.search(r"kernels: [1-9]\d* tpu_custom_call", run.stdout), run.stdout[-2000:]
    assert "| 1 | 1,2 | 2 |" in run.stdout  # rank 1's stages hold 2 of the 3 layers


@pytest.mark.parametrize("model", ["llama", "moe"])
def test_tpu_compiler_keeps_the_weights_cast_inside_the_layer_scan(model):
    """XLA:TPU turns the bf16 cast of a layer's slice of the stacked fp32 weights into a slice of the whole
    stack cast once, at the top of the program (a bf16 copy of every layer's weights through both layer
    scans: 1.3 GiB a chip for Mixtral 8x7B's experts). The layer scan ties each weight to the layer's index
    (`parallax.model.apply_layer_aux`), so no convert at the top level yields a stacked [L, ...] weight
    (without the tie: 7 here, for both models, dropless MoE included)."""
    pytest.importorskip("libtpu")
    import re

    from parallax.memory import tpu_devices
    from parallax.plan import abstract_batch, make_plan
    from parallax.trainer import Trainer

    config = tiny_config(model, fsdp=4)
    config.model.update(dtype="bfloat16", remat="full", num_layers=4)
    if model == "moe":
        config.model.moe.dispatch = "ragged"
    trainer = Trainer(make_plan(config, 4, "tpu"), devices=tpu_devices("v5p:2x2x1"))
    batch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=trainer.batch_shardings[k])
             for k, a in abstract_batch(config).items()}
    # The grouped matmuls' Mosaic kernels refuse the suite's fp32 matmul precision on bf16 operands.
    with jax.default_matmul_precision("default"):
        text = trainer.train_step.lower(trainer.abstract_state(), batch).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    assert re.findall(r"= (bf16\[4,[0-9,]*\])\S* convert\(", entry) == []


def test_int8_train_step_on_the_tpu_compiler_multiplies_on_the_int8_units():
    """config.quant.mode=int8 compiled by XLA:TPU (v5p, int8-native): the projections are int8 x int8 MXU
    convolutions accumulating in s32 in the scheduled program (7 projections forward and 7 dx backward per
    layer). The 8-bit weight gathers at real size: docs/quantization.md (Llama 3.1 8B on v5p:4x4x4 by
    launch/plan.py: 208 MiB of bf16 -> 104 MiB of s8; at this tiny size the compiler packs them into u32
    all-reduces instead)."""
    pytest.importorskip("libtpu")
    import re

    from parallax.memory import tpu_devices
    from parallax.plan import abstract_batch, make_plan
    from parallax.trainer import Trainer

    config = tiny_config(fsdp=4)
    config.model.update(dtype="bfloat16", num_layers=2)
    config.quant.mode = "int8"
    trainer = Trainer(make_plan(config, 4, "tpu"), devices=tpu_devices("v5p:2x2x1"))
    batch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=trainer.batch_shardings[k])
             for k, a in abstract_batch(config).items()}
    text = trainer.train_step.lower(trainer.abstract_state(), batch).compile().as_text()
    assert len(re.findall(r"= s32\[[0-9,]*\]\S* convolution\(", text)) >= 14


def test_offloaded_layer_inputs_and_optimizer_state_leave_the_chip_on_the_tpu_compiler():
    """model.remat='offload' on the TPU compiler: each layer's input lives in host memory between the forward
    and the backward (XLA's host temporaries), so the chip's temporaries are under remat='full''s; with
    optim.offload_state the optimizer state is a host-memory argument of the step, not a chip's."""
    pytest.importorskip("libtpu")
    from parallax.memory import memory_report, tpu_devices

    reports = {}
    for remat, state in (("full", False), ("offload", True)):
        config = tiny_config(fsdp=4)
        config.model.update(dtype="bfloat16", remat=remat, num_layers=4, d_model=256, num_heads=4, num_kv_heads=2,
                            d_ff=512)
        config.train.update(global_batch_size=8, seq_len=1024)
        config.optim.offload_state = state
        reports[remat, state] = memory_report(config, tpu_devices("v5p:2x2x1"))
    full, both = reports["full", False], reports["offload", True]
    layer_inputs = 4 * 8 // 4 * 1024 * 256 * 2  # layers x rows per chip x seq x d_model x bf16
    assert full.host_temp == 0 and both.host_temp >= layer_inputs, (full.host_temp, both.host_temp)
    assert both.xla_temp < full.xla_temp, (both.xla_temp, full.xla_temp)
    assert full.host_arguments == 0 and both.host_arguments >= both.optimizer, (both.host_arguments, both.optimizer)
    assert both.xla_arguments <= full.xla_arguments - both.optimizer
    assert "host memory" in both.table()
    # The compiler's own peak is reported, is a chip's high-water mark (arguments included), and the report
    # takes the lower of it and the sum.
    for r in (full, both):
        assert r.xla_peak >= r.xla_arguments > 0 and r.peak == min(r.xla_peak, r.bound), r


def test_plan_for_a_tpu_topology_without_libtpu_says_how_to_install_it():
    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is installed")
    run = _plan(f"--config={ROOT}/configs/tiny.py", "--topology=v5p:2x2x1", "--config.mesh.data=-1")
    assert run.returncode == 2 and "pip install -e '.[tpu]'" in run.stderr


def test_peak_is_the_compilers_own_where_reported_and_never_above_the_sum():
    """XLA:TPU's `peak_memory_in_bytes` (host buffers included) and args + outputs + temp - aliased both
    bound the chip's peak from above: the report takes the lower; without the compiler's, the sum."""
    sizes = dict(params=1, optimizer=1, gradients=1, batch=1, xla_arguments=10, xla_outputs=10, xla_aliased=10)
    assert MemoryReport(**sizes, xla_temp=100).peak == 110
    assert MemoryReport(**sizes, xla_temp=100, xla_peak=70).peak == 70
    assert MemoryReport(**sizes, xla_temp=50, xla_peak=70).peak == 60  # offload: host buffers in the 70
    assert "the compiler's peak" in MemoryReport(**sizes, xla_temp=100, xla_peak=70).table()
    stats = types.SimpleNamespace(argument_size_in_bytes=10, output_size_in_bytes=10, temp_size_in_bytes=100,
                                  alias_size_in_bytes=10, peak_memory_in_bytes=70)
    assert memory_lib._peak(stats, "tpu") == 70 and memory_lib._peak(stats, "cpu") == 110  # CPU's: args only
    stats.peak_memory_in_bytes = 5  # below the arguments: not a high-water mark, so the sum stands
    assert memory_lib._xla_peak(stats, "tpu") == 0 and memory_lib._peak(stats, "tpu") == 110


def test_advice_for_activations_names_the_pipeline_knobs_when_pipelined():
    report = MemoryReport(params=1, optimizer=1, gradients=1, batch=1, xla_arguments=10, xla_outputs=10,
                          xla_aliased=10, xla_temp=100)
    piped = advice(tiny_config(pipe=2, data=4), report, hbm_bytes=50)
    assert any("pipeline.microbatches" in a for a in piped) and any("pipeline.remat" in a for a in piped)
    assert not any("train.microbatches" in a for a in piped)
    assert any("train.microbatches" in a for a in advice(tiny_config(data=8), report, hbm_bytes=50))
    # On TPU the temporaries' figure overstates: a compiler's peak of little more than the arguments is no
    # case for smaller microbatches.
    tpu = MemoryReport(params=1, optimizer=1, gradients=1, batch=1, xla_arguments=40, xla_outputs=10,
                       xla_aliased=10, xla_temp=100, xla_peak=60)
    assert not any("microbatches" in a for a in advice(tiny_config(data=8), tpu, hbm_bytes=50))


@pytest.mark.slow
def test_gpt2_small_fits_8_devices_of_80_gb():
    run = _plan(f"--config={ROOT}/configs/gpt2_small.py", "--devices=8", "--hbm_gib=80")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama3_8b", "llama3_70b", "llama3_70b_pp"])
def test_llama3_configs_fit_80_gb_devices_by_xla_memory_analysis(name):
    """Each real-hardware config, bf16, on as many simulated devices as its mesh names (8, 64, 64)."""
    run = _plan(f"--config={ROOT}/configs/{name}.py", "--hbm_gib=80")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1].endswith("hbm_gib=80 fits=yes")
    rows = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in run.stdout.splitlines()
            if line.startswith("| ") and line.split("|")[2].strip()[:1].isdigit()}
    assert abs(rows["state + batch (analytic)"] - rows["XLA arguments"]) <= 0.15 * rows["XLA arguments"]


@pytest.mark.slow
def test_llama3_8b_at_maxtexts_setting_fits_a_v5p_chip_by_the_tpu_compiler():
    """MaxText 0.2.5's train_compile for this model, topology, batch and mesh needs 58.6 GiB per chip: fsdp 16 x
    tensor 4 on v5p:4x4x4, 8 sequences of 8192 per chip, remat full, no accumulation. parallax's step (auto
    attention: splash inside the manual region) must need no more, with the kernel in the compiled step."""
    pytest.importorskip("libtpu")
    run = _plan(f"--config={ROOT}/configs/llama3_8b.py", "--topology=v5p:4x4x4", "--config.mesh.fsdp=16",
                "--config.mesh.tensor=4", "--config.train.global_batch_size=512", "--config.train.microbatches=1")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    print(last)
    assert last.endswith("hbm_gib=95 fits=yes")
    assert float(last.split()[0].split("=")[1]) <= 58.6, last
    assert "kernels: 4 tpu_custom_call" in run.stdout, run.stdout[-1000:]
