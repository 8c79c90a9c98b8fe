"""The plan that chooses: a search over meshes (with the axes that span slices), pipeline schedules and
microbatches, remat and accumulation, for a model, a batch and a number of chips.

Two stages, so that it runs on a laptop in minutes:
1. **Analytic**: every candidate priced from the model's sizes alone (`analytic`): compute at the chip's peak
   (remat's recompute included, a pipeline's lockstep bubble from `parallax.pipeline.simulate`), and the
   bytes each mesh axis moves per step by the textbook counts (FSDP: the weights gathered in bf16 for the
   forward, the backward and remat's recompute of every microbatch, the gradients reduce-scattered in fp32;
   data: the gradients all-reduced once; tensor: two all-reduces of the activations per layer each way;
   pipe: each microbatch's activation and its gradient across each stage boundary), each at the bandwidth of
   the link it crosses (`parallax.estimate.CHIPS`: ICI / NVLink, or DCN for an axis that spans slices). FSDP's
   and data's collectives are taken as hidden behind compute (what the compiler's async collectives do),
   tensor's and pipe's as exposed. Memory from the same sizes (fp32 parameters, AdamW state and gradients
   over the axes that shard them; with full remat one bf16 residual per layer and microbatch in flight, else
   a layer's intermediates). This ranks; it decides nothing.
2. **Compiled**: the candidates that can win (analytic memory within `memory_slack` of the chip's HBM, by
   analytic time) are compiled in order, the real train step (`parallax.memory.memory_report`: the TPU
   compiler for a TPU topology), until `compile_top` fit or the next compile (taken as long as the slowest so
   far) would end past the time budget; each gets the
   compiler's peak and the estimate of its compiled schedule (`parallax.estimate`). The winner is the
   fastest compiled candidate that fits.

The search covers the axes a dense model uses (data, fsdp, tensor, pipe; with several slices, which of data,
fsdp and pipe spans them), with sequence, expert and replica axes of 1. The base config's other settings
(the 8-bit modes, offload, attention, chunking) are kept, not searched.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time

from parallax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Candidate:
    mesh: tuple  # ((axis, size), ...) of data, fsdp, tensor, pipe
    dcn_axis: str | None  # the axis that spans the slices (None: one slice)
    schedule: str | None  # pipeline schedule with pipe > 1
    microbatches: int  # train.microbatches (pipe = 1) or pipeline.microbatches (pipe > 1)
    remat: str  # model.remat (full, none), or with a pipeline "stage": full and pipeline.remat (chunk inputs only)

    @property
    def sizes(self) -> dict:
        return dict(self.mesh)

    def label(self) -> str:
        mesh = " ".join(f"{a}={n}" for a, n in self.mesh if n > 1) or "one device"
        dcn = f" [{self.dcn_axis} over DCN]" if self.dcn_axis else ""
        pipe = f" {self.schedule}" if self.schedule else ""
        return f"{mesh}{dcn}{pipe} mb={self.microbatches} remat={self.remat}"

    def apply(self, config, slices: int):
        """A copy of `config` set to this candidate."""
        config = copy.deepcopy(config)
        for axis in config.mesh:
            config.mesh[axis] = self.sizes.get(axis, 1)
        for axis in config.dcn:
            config.dcn[axis] = slices if axis == self.dcn_axis else 1
        config.model.remat = "full" if self.remat == "stage" else self.remat
        config.pipeline.remat = self.remat == "stage"
        if self.schedule:
            config.pipeline.schedule = self.schedule
            config.pipeline.microbatches = self.microbatches
            config.pipeline.virtual_stages = 2 if self.schedule == "zbv" else 1
            config.train.microbatches = 1
        else:
            config.train.microbatches = self.microbatches
        return config


@dataclasses.dataclass
class Row:
    candidate: Candidate
    analytic_s: float
    analytic_gib: float
    axis_bytes: dict  # {axis: bytes one device sends per step}, analytic
    compiled: bool = False
    peak_gib: float | None = None
    fits: bool | None = None
    estimate: object = None  # parallax.estimate.Estimate of the compiled step
    sent: dict = dataclasses.field(default_factory=dict)  # {mesh axes: bytes one device sends}, compiled
    error: str = ""


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """What the analytic stage reads of a model: from its plan on one device."""
    params: float  # parameters
    layer_params: float  # of one layer
    flops_per_token: float  # model FLOPs (forward + backward)
    layers: int
    d_model: int
    d_ff: int
    heads: int
    kv_heads: int
    seq_len: int
    batch: int  # global batch, rows

    @classmethod
    def of(cls, config) -> "ModelSizes":
        from parallax import mesh as mesh_lib
        from parallax.plan import make_plan

        single = copy.deepcopy(config)
        mesh_lib.set_sizes(single)
        single.train.microbatches = 1
        plan = make_plan(single, 1, "tpu")
        m, t = config.model, plan.train
        blocks = sum(math.prod(x.shape) for x in _leaves(plan.abstract_params.get("blocks", {})))
        return cls(params=plan.num_params, layer_params=blocks / int(m.num_layers), flops_per_token=plan.flops_per_token,
                   layers=int(m.num_layers), d_model=int(m.d_model), d_ff=int(m.get("d_ff", 4 * m.d_model)),
                   heads=int(m.num_heads), kv_heads=int(m.get("num_kv_heads", m.num_heads)), seq_len=t.seq_len,
                   batch=t.global_batch_size)


def _leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def _powers_of_two(n: int) -> list[int]:
    return [2**k for k in range(int(math.log2(n)) + 1) if n % 2**k == 0]


def candidates(sizes: ModelSizes, devices: int, slices: int = 1, schedules=("1f1b", "zbv"),
               remats=("full", "none"), max_tensor: int = 8) -> list[Candidate]:
    """Every candidate the search considers for `devices` chips in `slices` slices (the product of the
    mesh is `devices`; the DCN axis's size a multiple of `slices`), of the valid ones only: heads and KV
    heads divisible by tensor, layers by pipe (zbv: by 2 pipe), the batch's rows by data x fsdp and by the
    microbatches."""
    out = []
    for tensor in [t for t in _powers_of_two(devices // slices) if t <= max_tensor]:
        if sizes.heads % tensor or sizes.kv_heads % tensor:
            continue
        for pipe in _powers_of_two(devices // tensor):
            if pipe > 1 and sizes.layers % pipe:
                continue
            rest = devices // (tensor * pipe)
            for fsdp in _powers_of_two(rest):
                data = rest // fsdp
                rows = sizes.batch // (data * fsdp) if sizes.batch % (data * fsdp) == 0 else 0
                if not rows:
                    continue
                mesh = (("data", data), ("fsdp", fsdp), ("tensor", tensor), ("pipe", pipe))
                dcn_axes = [None] if slices == 1 else [a for a, n in mesh if a != "tensor" and n % slices == 0]
                for dcn_axis in dcn_axes:
                    for remat in remats:
                        if pipe == 1:
                            for mb in _powers_of_two(rows):
                                out.append(Candidate(mesh, dcn_axis, None, mb, remat))
                            continue
                        for schedule in schedules:
                            if schedule == "zbv" and sizes.layers % (2 * pipe):
                                continue
                            for mb in (pipe, 2 * pipe, 4 * pipe):
                                if rows % mb == 0:
                                    out += [Candidate(mesh, dcn_axis, schedule, mb, r)
                                            for r in ((remat, "stage") if remat == "full" else (remat,))]
    return out


def _bubble(schedule: str, pipe: int, microbatches: int) -> float:
    from parallax.pipeline.schedule import make_schedule
    from parallax.pipeline.simulate import simulate

    return simulate(make_schedule(schedule, pipe, microbatches, 2 if schedule == "zbv" else 1)).bubble


def analytic(c: Candidate, sizes: ModelSizes, chip, slices: int = 1) -> tuple[float, float, dict]:
    """(step seconds, GiB per device, {axis: bytes one device sends}) of candidate `c` (see the module's
    docstring)."""
    s = c.sizes
    data, fsdp, tensor, pipe = s["data"], s["fsdp"], s["tensor"], s["pipe"]
    devices = data * fsdp * tensor * pipe
    rows = sizes.batch // (data * fsdp)  # per batch shard
    passes = c.microbatches  # microbatches per step on each device
    tokens_mb = rows // passes * sizes.seq_len
    # remat full recomputes each layer's forward once; a pipeline stage's remat the stage's forward once more
    recompute = {"full": 4 / 3, "stage": 5 / 3}.get(c.remat, 1.0)
    compute = sizes.flops_per_token * sizes.batch * sizes.seq_len / devices * recompute / chip.peak_bf16
    if pipe > 1:
        compute /= 1 - _bubble(c.schedule, pipe, c.microbatches)
    weights = sizes.params / (tensor * pipe)  # this device's stage's parameters, before FSDP
    ring = lambda n: (n - 1) / n  # noqa: E731
    sent = {}
    gathers = (2 + (c.remat == "full") + 2 * (c.remat == "stage")) * passes
    sent["fsdp"] = (gathers * 2 + 4 * passes) * weights * ring(fsdp) if fsdp > 1 else 0.0
    sent["data"] = 2 * 4 * weights / fsdp * ring(data) if data > 1 else 0.0
    layers = sizes.layers / pipe
    sent["tensor"] = (4 + 2 * (c.remat == "full") + 4 * (c.remat == "stage")) * 2 * ring(tensor) * tokens_mb * sizes.d_model * 2 * layers * passes \
        if tensor > 1 else 0.0
    sent["pipe"] = 2 * 2 * tokens_mb * sizes.d_model * passes if pipe > 1 else 0.0

    def seconds(axis):
        return sent[axis] / (chip.dcn if axis == c.dcn_axis else chip.link)
    hidden = seconds("fsdp") + seconds("data")
    step = max(compute, hidden) + seconds("tensor") + seconds("pipe")
    # memory: fp32 parameters, AdamW's two moments, fp32 gradients, over the axes that shard them
    state = 16 * weights / fsdp
    residual = tokens_mb * sizes.d_model * 2
    in_flight = min(pipe, c.microbatches) if pipe > 1 else 1
    working = tokens_mb * (6 * sizes.d_model + 3 * sizes.d_ff / tensor) * 2 * 2  # one layer, forward + grads
    if c.remat == "stage":  # each microbatch in flight holds its chunk's input; one stage's residuals in its backward
        activations = residual * in_flight + residual * layers + working
    elif c.remat == "full":
        activations = residual * layers * in_flight + working
    else:
        activations = (working + residual * 4) * layers * in_flight
    gathered = 2 * 2 * sizes.layer_params / tensor  # a layer's bf16 weights, and the next one's prefetched
    return step, (state + activations + gathered) / 2**30, {a: b for a, b in sent.items() if b}


def search(config, devices_fn, num_devices: int, chip, hbm_gib: float, slices: int = 1, budget_s: float = 600,
           compile_top: int = 4, memory_slack: float = 1.25, progress=None) -> list[Row]:
    """Rows of the search (see the module's docstring), the compiled ones first, fastest first.
    `devices_fn()`: the devices to compile for (called once); `progress(fitted, label)`: before each compile."""
    import jax

    from parallax.estimate import estimate
    from parallax.memory import GIB, memory_report

    start = time.monotonic()
    sizes = ModelSizes.of(config)
    rows = []
    for c in candidates(sizes, num_devices, slices):
        step, gib, sent = analytic(c, sizes, chip, slices)
        rows.append(Row(c, step, gib, sent))
    if not rows:
        raise ConfigError(f"no mesh of {num_devices} devices in {slices} slice(s) divides this model and batch "
                          f"({sizes.heads} heads, {sizes.layers} layers, {sizes.batch} rows)")
    rows.sort(key=lambda r: (r.analytic_s, r.analytic_gib))
    hopeful = [r for r in rows if r.analytic_gib <= memory_slack * hbm_gib]
    devices = devices_fn()
    fitted, spent = 0, []
    for row in hopeful:
        # stop when the next compile (as long as the slowest so far) would end past the budget
        if fitted >= compile_top or time.monotonic() - start + max(spent, default=0.0) > budget_s:
            break
        began = time.monotonic()
        if progress:
            progress(fitted, row.candidate.label())
        try:
            report = memory_report(row.candidate.apply(config, slices), devices)
        except ConfigError as e:
            row.error = str(e)
            continue
        except jax.errors.JaxRuntimeError as e:  # the compiler refused it (e.g. a buffer over its size limit)
            row.error = f"the compiler failed: {str(e).splitlines()[0]}"
            spent.append(time.monotonic() - began)
            continue
        spent.append(time.monotonic() - began)
        row.compiled, row.peak_gib = True, report.peak / GIB
        row.fits = report.peak <= hbm_gib * GIB
        row.sent = report.costs.by_axes("sent")
        row.estimate = estimate(report.costs, chip, int8=config.quant.mode != "none",
                                model_flops=report.model_flops, bubble=report.bubble, kernel_flops=report.kernel_flops)
        fitted += row.fits
    compiled = sorted((r for r in rows if r.compiled), key=lambda r: (not r.fits, r.estimate.seconds))
    return compiled + [r for r in hopeful if not r.compiled] + [r for r in rows if r not in hopeful]


def _t(seconds: float) -> str:
    from parallax.estimate import _t as t
    return t(seconds)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g}"


def table(rows: list[Row], shown: int = 12, hbm_gib: float | None = None, memory_slack: float = 1.25) -> str:
    """The markdown table of the search's rows: the compiled ones, then those not compiled that might fit
    (within `memory_slack` of `hbm_gib` by the analytic memory)."""
    if hbm_gib is not None:
        rows = [r for r in rows if r.compiled or r.analytic_gib <= memory_slack * hbm_gib]
    lines = ["| # | candidate | analytic step | analytic GiB | compiled peak GiB | fits | estimated step | MFU | "
             "exposed collectives | GB sent per device: by axis (compiled; DCN) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for k, r in enumerate(rows[:shown]):
        e = r.estimate
        if e is not None:
            axes = ", ".join(f"{','.join(a) or '-'} {_gb(b)}" for a, b in
                             sorted(r.sent.items(), key=lambda kv: -kv[1])[:3] if b)
            est = (_t(e.seconds), f"{100 * e.mfu:.1f}%" if e.mfu else "-",
                   f"{100 * e.exposed_s / e.seconds:.1f}%", axes + (f"; {e.dcn_s:.3g} s over DCN" if e.dcn_s else ""))
        else:
            est = ("-", "-", "-", ", ".join(f"{a} {_gb(b)}" for a, b in r.axis_bytes.items()) + " (analytic)")
        peak = f"{r.peak_gib:.2f}" if r.peak_gib is not None else ("failed" if r.error else "not compiled")
        fits = {True: "yes", False: "no", None: "-"}[r.fits]
        lines.append(f"| {k + 1} | {r.candidate.label()} | {_t(r.analytic_s)} | {r.analytic_gib:.1f} | {peak} | "
                     f"{fits} | " + " | ".join(est) + " |")
    return "\n".join(lines)
