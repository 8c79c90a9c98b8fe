"""Per-device memory of the real train step, by XLA's own analysis, beside an analytic estimate.

`memory_report(config, devices)` makes the plan and the `Trainer` for `devices` (real ones, or simulated
CPU devices standing in for real hardware), AOT-compiles `train_step` on abstract inputs (nothing is
allocated) and reads `compiled.memory_analysis()`. The analytic part counts what the shardings put on one
device: parameters, optimizer state, gradients (fp32, sharded like the parameters) and the batch.

The peak. Arguments + outputs + temporaries - aliased (the donated state is updated in place) is the
peak on XLA:CPU. On XLA:TPU it is an upper bound: its `temp_size_in_bytes` adds up temporaries that are
never live together. XLA:TPU also reports its own peak, `peak_memory_in_bytes`, the high-water mark of
its heap, and its compile-time HBM check holds a program to that. Measured (Mixtral 8x7B, v5p:4x4x4,
fsdp 8 x expert 8, 2,048 x 4,096 tokens): the sum 103.8 GiB, the compiler's peak 73.2 GiB, and the
compiler built the program for a 95.73 GiB chip; at 3,072 sequences it refused ("CompileTimeHbmOom: the
total memory required ... (100.39G) exceeds available HBM"). The compiler's figure counts host-memory
buffers (offload) too, so it is also only an upper bound where some are used: the peak on TPU is the lower
of the two. XLA:CPU's `peak_memory_in_bytes` counts the arguments only, and XLA:GPU's is not checked here:
there the peak is the sum.

On simulated CPU devices the figures are the CPU compiler's: the same program and shardings as on a GPU
or TPU, but another compiler's fusion and scheduling, so temporaries can differ from a TPU's. On
`tpu_devices(topology)`, compile-only devices of a TPU slice that libtpu describes without a TPU, they are
the TPU compiler's own.

`dry_run(config, workdir)` is `launch/train.py --dry_run`: every check a run makes before its first step,
this memory report among them, with nothing trained or written.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

import jax

from parallax import cost, hlo
from parallax import mesh as mesh_lib
from parallax.pipeline.simulate import flop_costs, simulate, steady_bubbles
from parallax.errors import ConfigError
from parallax.steps.pipeline import rank_balance
from parallax.plan import abstract_batch, make_plan
from parallax.trainer import Trainer

GIB = 2**30
# HBM per device, GiB: per chip from the Cloud TPU system-architecture pages (v4, v5e, v5p, v6e; they write
# "GB" for what the chips report in GiB); v3 exposes each of its chip's two TensorCores, 16 GiB each.
TPU_HBM_GIB = {"v3": 16, "v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
_MEGACORE = ("v4", "v5p")  # one device per chip (its two TensorCores as one), as JAX sees a real v4 / v5p


def tpu_generation(topology: str) -> str:
    """'v5p:4x4x4' -> 'v5p'."""
    return re.split("[:=_]", topology, maxsplit=1)[0]


def tpu_devices(topology: str, slices: int = 1) -> list:
    """Compile-only devices of the TPU slice `topology` (e.g. 'v5p:4x4x4', 'v5e:4x4', 'v4:2x2x2'), one per
    chip (per TensorCore on v3), as JAX sees them on the slice: jit compiles for them with libtpu's TPU
    compiler on any machine, no TPU needed. `slices` > 1: that many such slices (multi-slice, over DCN; each
    device's `slice_index` says which)."""
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError(f"--topology={topology} needs libtpu: pip install -e '.[tpu]' (Python 3.12, newest jax)")
    from jax.experimental import topologies

    megacore = {"chip_config_name": "megacore"} if tpu_generation(topology) in _MEGACORE else {}
    try:
        if slices < 1:
            raise ConfigError(f"--slices={slices}: a positive number of slices")
        multi = {"num_slices": slices} if slices > 1 else {}
        return list(topologies.get_topology_desc(topology, platform="tpu", **megacore, **multi).devices)
    except jax.errors.JaxRuntimeError as e:
        raise ConfigError(f"--topology={topology}: {str(e).splitlines()[0]}; e.g. v5p:4x4x4, v5e:4x4, v4:2x2x2, "
                          f"v6e:2x2") from None


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per device."""
    params: int  # analytic: this device's shards of the parameters
    optimizer: int  # analytic: its shards of the optimizer state
    gradients: int  # analytic: fp32 gradients of the trained parameters (LoRA: the adapters), sharded like them
    batch: int  # analytic: its rows of the batch arrays
    xla_arguments: int  # XLA: the step's inputs (state + batch) on this device
    xla_outputs: int
    xla_aliased: int  # outputs written in place of (donated) inputs
    xla_temp: int  # XLA: temporaries (activations, gradients, collectives' buffers, ...)
    path_state: int = 0  # analytic: the step path's own state: a steady schedule's (2bw) in-flight state (previous
    #                    weights, the pending gradient, the batch in flight, activation slots and inbox), or
    #                    DiLoCo's (the replicas' parameters, the outer momentum, rounding errors); 0 for others
    kernel_calls: int = 0  # custom calls of hand-written kernels in the compiled step (Mosaic tpu_custom_call)
    path_state_label: str = ""  # what `path_state` counts, in the step path's words (`StepPath.state_label`)
    ranks: tuple = ()  # pipelined plans: `parallax.steps.pipeline.rank_balance`, one dict per pipeline rank
    host_temp: int = 0  # XLA: temporaries in host memory (model.remat='offload': the layers' inputs), not in peak
    host_arguments: int = 0  # XLA: inputs in host memory (optim.offload_state: the optimizer state), not in peak
    xla_peak: int = 0  # XLA:TPU's own peak (`peak_memory_in_bytes`, arguments included); 0 where not reported
    gathered: tuple = ()  # ((element type, bytes), ...) the compiled step's all-gathers produce (each counted once)
    costs: object = None  # parallax.cost.StepCosts of the compiled step: FLOPs, bytes, collectives by mesh axes
    model_flops: float = 0.0  # the model's FLOPs per device and step (`Model.flops_per_token`; MFU's numerator)
    kernel_flops: float = 0.0  # the attention kernel's FLOPs per device and step (custom calls: not in `costs`)
    bubble: float | None = None  # pipelined plans: the schedule's lockstep bubble at its stages' counted FLOPs

    @property
    def bound(self) -> int:
        """Arguments + outputs + temporaries - aliased: the peak where the compiler reports none, an upper
        bound where it does (MaxText's "total memory")."""
        return self.xla_arguments + self.xla_outputs + self.xla_temp - self.xla_aliased

    @property
    def peak(self) -> int:
        """Where the compiler reports its own peak (XLA:TPU) the lower of it and `bound` (each bounds the
        chip's peak from above: the compiler's counts host-memory buffers too), else `bound`."""
        return min(self.xla_peak, self.bound) if self.xla_peak else self.bound

    @property
    def analytic_state(self) -> int:
        """The analytic counterpart of `xla_arguments`."""
        return self.params + self.optimizer + self.batch + self.path_state

    def table(self) -> str:
        rows = [("parameters (analytic)", self.params), ("optimizer state (analytic)", self.optimizer),
                ("gradients, fp32 (analytic)", self.gradients), ("batch (analytic)", self.batch)]
        if self.path_state:
            rows.append((f"{self.path_state_label} (analytic)", self.path_state))
        rows += [("state + batch (analytic)", self.analytic_state), ("XLA arguments", self.xla_arguments),
                ("XLA outputs", self.xla_outputs), ("XLA aliased (donated)", self.xla_aliased),
                ("XLA temporaries", self.xla_temp)]
        if self.xla_peak:
            rows += [("args + outputs + temp - aliased (an upper bound here)", self.bound),
                     ("the compiler's peak (peak_memory_in_bytes; host memory included)", self.xla_peak),
                     ("peak (the lower of the two)", self.peak)]
        else:
            rows.append(("peak = args + outputs + temp - aliased", self.peak))
        if self.host_arguments:
            rows.append(("host memory: XLA arguments (optim.offload_state; not in the peak)", self.host_arguments))
        if self.host_temp:
            rows.append(("host memory: XLA temporaries (model.remat=offload; not in the peak)", self.host_temp))
        unit, size = ("GiB", GIB) if self.peak >= GIB else ("MiB", 2**20)
        lines = [f"| per device | {unit} |", "|---|---|"] + [f"| {name} | {b / size:.3f} |" for name, b in rows]
        if self.ranks:
            from parallax.steps.pipeline import balance_table
            lines += ["", "Per pipeline rank (what its stages use and compute):", "", balance_table(self.ranks, self.peak)]
        return "\n".join(lines)


def _bytes_on_device(tree, shardings) -> int:
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def _bound(m) -> int:
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def _xla_peak(m, platform: str) -> int:
    """The compiler's own peak where it is one (XLA:TPU; see the module docstring), else 0. A figure below
    the arguments cannot be the chip's high-water mark (it would be a heap-only count, as XLA:CPU's is
    arguments-only): then 0, and the report keeps the sum rather than say a step fits that may not."""
    if platform != "tpu":
        return 0
    peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    return peak if peak >= m.argument_size_in_bytes else 0


def _peak(m, platform: str) -> int:
    return min(_xla_peak(m, platform) or _bound(m), _bound(m))


def compile_step(config, devices=None):
    """(trainer, compiled): the train step of `config` compiled for `devices` (default: all), nothing
    allocated. Of the programs the training loop runs (one per kind of step, e.g. DiLoCo's sync and
    non-sync steps), the one with the highest peak memory."""
    devices = list(jax.devices() if devices is None else devices)
    trainer = Trainer(make_plan(config, len(devices), devices[0].platform), devices=devices)
    state = trainer.abstract_state()
    batch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=trainer.batch_shardings[k])
             for k, a in abstract_batch(config).items()}
    # XLA:TPU stops at its first estimate over the chip's HBM; this lets it finish, so a step that does not
    # fit still gets its full figures.
    options = {"xla_tpu_no_crash_on_oom": True} if devices[0].platform == "tpu" else None

    return trainer, max((trainer.step_program(kind).lower(state, batch).compile(compiler_options=options)
                         for kind in trainer.path.step_kinds()),
                        key=lambda compiled: _peak(compiled.memory_analysis(), devices[0].platform))


def memory_report(config, devices=None, hlo_out: str = "") -> MemoryReport:
    """Compiles the train step of `config` for `devices` (default: all) and measures it; nothing is allocated.
    `hlo_out`: also write the compiled step's optimized HLO text there."""
    trainer, compiled = compile_step(config, devices)
    state = trainer.abstract_state()
    batch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=trainer.batch_shardings[k])
             for k, a in abstract_batch(config).items()}
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(text)
    kernel_calls = text.count('custom_call_target="tpu_custom_call"')
    params = _bytes_on_device(trainer.abstract_params, trainer.param_shardings)
    trainable = trainer.plan.trainable or jax.tree.map(lambda _: True, trainer.abstract_params)
    grads = sum(math.prod(s.shard_shape(a.shape)) * 4 for a, s, t in
                zip(jax.tree.leaves(trainer.abstract_params), jax.tree.leaves(trainer.param_shardings),
                    jax.tree.leaves(trainable)) if t)
    return MemoryReport(
        params=params,
        optimizer=_bytes_on_device(state["opt_state"], trainer.state_shardings["opt_state"]),
        gradients=grads,
        batch=_bytes_on_device(batch, trainer.batch_shardings),
        xla_arguments=memory.argument_size_in_bytes, xla_outputs=memory.output_size_in_bytes,
        xla_aliased=memory.alias_size_in_bytes, xla_temp=memory.temp_size_in_bytes,
        path_state=sum(_bytes_on_device(state[k], trainer.state_shardings[k]) for k in trainer.path.state_keys),
        kernel_calls=kernel_calls, path_state_label=trainer.path.state_label,
        host_temp=getattr(memory, "host_temp_size_in_bytes", 0) or 0,
        host_arguments=getattr(memory, "host_argument_size_in_bytes", 0) or 0,
        xla_peak=_xla_peak(memory, trainer.plan.platform),
        gathered=tuple(sorted(hlo.collective_bytes(text, "all-gather").items())),
        costs=cost.step_costs(text, dict(trainer.mesh.shape), slices=_slices(trainer), dcn=trainer.plan.dcn),
        ranks=tuple(rank_balance(trainer.plan)) if trainer.plan.schedule is not None else (),
        model_flops=_model_flops(trainer.plan, trainer.mesh.size),
        kernel_flops=_kernel_flops(trainer.plan, trainer.mesh.size) if kernel_calls or "custom_call_target=\"__cudnn"
        in text else 0.0,
        bubble=_bubble(trainer.plan))


def _kernel_flops(plan, num_devices: int) -> float:
    """The FLOPs per device and step of attention run by a kernel (splash, cuDNN: custom calls, whose work the
    HLO does not show), from the model's sizes: the scores and the weighted sum over the causal half of the
    window (the kernels skip masked tiles), three passes, a fourth where remat recomputes the forward."""
    from parallax.model import attention_flops_per_token

    m, t = plan.model_config, plan.train
    if plan.attention.impl not in ("splash", "cudnn"):
        return 0.0
    head_dim = int(m.get("head_dim", 0) or m.d_model // m.num_heads)
    per_token = attention_flops_per_token(int(m.num_layers), int(m.num_heads), head_dim, t.seq_len) / 2
    recompute = 4 / 3 if plan.remat in ("full", "offload") else 1.0
    return per_token * recompute * t.global_batch_size * t.seq_len / num_devices


def _bubble(plan) -> float | None:
    """A pipelined plan's lockstep bubble (`parallax.pipeline.simulate`) at its stages' counted FLOPs
    (`Parts.flops`, as `flop_costs` prices each action); a steady schedule's in its steady state."""
    schedule = plan.schedule
    if schedule is None:
        return None
    f = plan.parts.flops(plan.remat)
    costs = flop_costs(schedule, plan.num_layers, f["layer"], f["embed"], f["loss"], plan.pipeline.vocab_parallel)
    if schedule.steady:
        return steady_bubbles(schedule, 3, costs, mode="lockstep")[-1]
    return simulate(schedule, costs).bubble


def _slices(trainer) -> list[int] | None:
    """The slice of each device of the trainer's mesh, in the mesh's order (the program's device ids); None
    on one slice."""
    slices = math.prod(trainer.plan.dcn.values()) if trainer.plan.dcn else 1
    return mesh_lib.device_slices(list(trainer.mesh.devices.flat), slices) if slices > 1 else None


def _model_flops(plan, num_devices: int) -> float:
    """The model's training FLOPs per device and step: `Model.flops_per_token` x the step's tokens / devices
    (DiLoCo's replicas each train their share of the batch)."""
    t = plan.train
    return plan.flops_per_token * t.global_batch_size * t.seq_len / num_devices


def _latest_step(workdir: str):
    """The latest checkpoint step in `workdir` (None: none), read without creating anything there."""
    from etils import epath

    from parallax import checkpoint as ckpt_lib

    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        return None
    reader = ckpt_lib.Checkpointer(epath.Path(workdir) / "checkpoints", 0, 1, cleanup=False)
    try:
        return reader.latest_step()
    finally:
        reader.close()


def dry_run(config, workdir: str | None = None, devices=None) -> str:
    """What a run of `config` in `workdir` would check before its first step, without running or writing
    anything: the data (read, not written), the plan and every config check, the loss and gradients traced
    on the run's step path (`shape_check`), whether `workdir`'s checkpoints would resume with this config,
    and XLA's compiled memory of the train step on `devices` (default: all). Returns a few lines; raises
    ConfigError (one line) where the run would."""
    from parallax.train import check_workdir, make_dataset, resolve_data
    from parallax.trainer import shape_check

    devices = list(jax.devices() if devices is None else devices)
    config, tokenizer = resolve_data(config)
    dataset = make_dataset(config, tokenizer)
    plan = make_plan(config, len(devices), devices[0].platform)
    checked = shape_check(config, len(devices))
    if not workdir:
        resume = "no --workdir: not checked against one"
    else:
        start = _latest_step(workdir)
        check_workdir(config, workdir, start, tokenizer)
        resume = (f"{workdir}: a new run (no checkpoint there)" if start is None else
                  f"{workdir}: this config continues the run there (a rerun resumes from step {start})")
    report = memory_report(config, devices)
    mesh = " ".join(f"{a}={n}" for a, n in plan.sizes.items() if n > 1) or "single device"
    unit, size = ("GiB", GIB) if report.peak >= GIB else ("MiB", 2**20)
    return "\n".join([
        f"mesh {mesh} ({len(devices)} {devices[0].platform} devices); model {config.model.name} "
        f"{checked['params'] / 1e6:.2f}M params; {checked['tokens_per_step']} tokens per step; {dataset.describe()}",
        f"workdir: {resume}",
        f"memory per device (XLA's analysis of the compiled train step): peak {report.peak / size:.3f} {unit}, "
        f"of which parameters + optimizer state {(report.params + report.optimizer) / size:.3f} {unit}",
        "dry run: every check passed; nothing was trained and the workdir was not touched (launch/plan.py: does it "
        "fit a device's HBM?)"])


def advice(config, report: MemoryReport, hbm_bytes: float) -> list[str]:
    """What to change when the step does not fit, largest lever first."""
    out = []
    # What the peak holds above the arguments (on TPU the compiler's peak: its temp figure overstates).
    if report.peak - report.xla_arguments > report.xla_arguments:
        if config.mesh.pipe != 1:
            out.append(f"activations dominate: raise pipeline.microbatches (now {config.pipeline.microbatches}) "
                       f"so each microbatch in flight through the stages is smaller")
            if not config.pipeline.remat:
                out.append("set pipeline.remat=True to recompute each stage's activations in the backward")
        else:
            out.append(f"activations dominate: raise train.microbatches (now {config.train.microbatches}; "
                       f"gradient accumulation) so each microbatch's activations fit")
        if config.model.remat == "none":
            out.append("set model.remat=full (or dots) to recompute activations in the backward")
    if report.xla_arguments > 0.5 * hbm_bytes:
        out.append("parameters + optimizer state dominate: shard them further (raise mesh.fsdp, mesh.tensor "
                   "or mesh.pipe)")
    return out or ["use more devices or a smaller batch per device"]
