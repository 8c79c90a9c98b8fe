"""A step-time estimate from the counted costs of a compiled step (`parallax.cost.StepCosts`) and published chip
figures: compute at the chip's peak, memory traffic at its HBM bandwidth, each collective at the bandwidth of
the links it crosses (ICI inside a slice, NVLink inside a node; the data-center network or InfiniBand for the
mesh axes named as crossing slices or nodes).

What it is and is not: a roofline read against the compiled schedule, not a simulation. `compute_s` and
`memory_s` overlap (the larger bounds a step). A collective hides behind the compute the compiled program
runs while it is in flight (`parallax.cost` `windows`: the instructions between an async collective's
start and its done): what its window's compute (or memory traffic) does not cover is exposed, and a
synchronous collective (XLA:CPU's, or one the scheduler left alone) is exposed whole. `seconds` is the
estimate: max(compute, memory) + exposed; `overlapped_s` (every collective hidden) and `serial_s` (none)
bound it. A collective whose device groups span slices (`StepCosts` `dcn_sent`, or an axis named in
`dcn_axes`) runs at the data-center network's bandwidth: a ring is as fast as its slowest link. `bytes` is
an upper bound of the memory traffic (see `parallax.cost`), so `memory_s` is too. A pipeline's ticks are
counted at their costliest action (`parallax.cost`), which is at least the lockstep time; its bubble
(`bubble`, from `parallax.pipeline.simulate` at the stages' counted FLOPs) is reported beside, not
subtracted.
MFU is the model's FLOPs (`Model.flops_per_token`, no recompute) over the chip's peak in `seconds`.

Per-axis link bandwidth: an axis's ring runs along one dimension of the torus (TPU) and sends to both of its
neighbours at once, so a device sends at 2 / (2 x torus dimensions) of the chip's outgoing ICI bandwidth
(half the bidirectional figure). An axis laid over several torus dimensions gets more; this takes one (a
conservative figure). GPUs: half of NVLink's bidirectional figure inside a node; one NIC per GPU between
nodes.
"""

from __future__ import annotations

import dataclasses

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_bf16: float  # FLOP/s, dense
    peak_int8: float | None  # OP/s, dense (None: not published)
    hbm: float  # bytes/s
    link: float  # bytes/s one device sends along one mesh axis inside a slice / node (the module's rule)
    dcn: float | None  # bytes/s one device sends across slices / nodes (None: not published)
    source: str
    latency: float = 0.0  # seconds each collective costs besides its bytes (the alpha of alpha-beta; 0: not modelled)


# Published figures (the vendors' pages named in `source`, read 2026-12-07).
CHIPS = {
    "v5p": Chip("TPU v5p", 459e12, None, 2765 * GB, link=1200 * GB / 2 / 3, dcn=50e9 / 8,
                source="cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, HBM 2765 GB/s, ICI 1200 GB/s "
                       "bidirectional per chip (3D torus), DCN 50 Gbps per chip"),
    "v5e": Chip("TPU v5e", 197e12, 393e12, 819 * GB, link=400 * GB / 2 / 2, dcn=2 * 100e9 / 8 / 8,
                source="cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 393 TOP/s int8, HBM 819 GB/s, ICI 400 GB/s "
                       "bidirectional per chip (2D torus), 2 x 100 Gbps NICs per 8-chip host"),
    "v6e": Chip("TPU v6e", 918e12, 1836e12, 1638 * GB, link=800 * GB / 2 / 2, dcn=None,
                source="cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 1836 TOP/s int8, HBM 1638 GB/s, ICI "
                       "800 GB/s bidirectional per chip (2D torus); DCN per chip not published"),
    "h100": Chip("NVIDIA H100 SXM", 989e12, 1979e12, 3350 * GB, link=900 * GB / 2, dcn=400e9 / 8,
                 source="NVIDIA H100 datasheet: 989 TFLOP/s bf16 and 1979 TOP/s int8 dense, HBM3 3.35 TB/s, NVLink "
                        "900 GB/s bidirectional; one 400 Gb/s InfiniBand NIC per GPU (DGX H100)"),
    "h200": Chip("NVIDIA H200 SXM", 989e12, 1979e12, 4800 * GB, link=900 * GB / 2, dcn=400e9 / 8,
                 source="NVIDIA H200 datasheet: 989 TFLOP/s bf16 and 1979 TOP/s int8 dense, HBM3e 4.8 TB/s, NVLink "
                        "900 GB/s bidirectional; one 400 Gb/s InfiniBand NIC per GPU"),
}


@dataclasses.dataclass(frozen=True)
class Estimate:
    chip: Chip
    compute_s: float
    memory_s: float
    collectives_s: dict  # {mesh axes: seconds}
    dcn_axes: tuple
    exposed_s: float = 0.0  # collectives' time not covered by the compute in their windows
    model_flops: float = 0.0  # per device and step (MFU's numerator); 0: unknown
    dcn_s: float = 0.0  # of the collectives' time, what crosses slices
    bubble: float | None = None  # a pipeline's lockstep bubble (simulator, at the stages' counted FLOPs)
    kernel_s: float = 0.0  # of `compute_s`, the attention kernel's (from the model's sizes, not the HLO)
    peak: float = 0.0  # the FLOP/s the compute is priced at (bf16, or int8 for 8-bit matmuls)

    @property
    def comm_s(self) -> float:
        return sum(self.collectives_s.values())

    @property
    def overlapped_s(self) -> float:
        """Every collective hidden behind compute or memory traffic: the lower bound."""
        return max(self.compute_s, self.memory_s, self.comm_s)

    @property
    def serial_s(self) -> float:
        """No collective hidden: the upper bound."""
        return max(self.compute_s, self.memory_s) + self.comm_s

    @property
    def seconds(self) -> float:
        """The estimate: compute or memory traffic, whichever is longer, plus the exposed collectives."""
        return max(self.compute_s, self.memory_s) + self.exposed_s

    def utilisation(self, seconds: float) -> float:
        """The counted matmul FLOPs over the chip's peak in `seconds` (hardware FLOPs: remat's recompute
        counts, unlike MFU's model FLOPs)."""
        return self.compute_s / seconds if seconds > 0 else 0.0

    @property
    def mfu(self) -> float | None:
        return self.model_flops / (self.seconds * self.peak) if self.model_flops and self.seconds and self.peak else None

    def lines(self) -> list[str]:
        per_axis = ", ".join(f"{','.join(axes) or 'one device'} {_t(s)}"
                             + (" (DCN)" if set(axes) & set(self.dcn_axes) else "")
                             for axes, s in sorted(self.collectives_s.items(), key=lambda kv: -kv[1]))
        mfu = f"MFU {100 * self.mfu:.1f}%, " if self.mfu is not None else ""
        return [f"estimated step on {self.chip.name}: {_t(self.seconds)} ({mfu}hardware FLOPs utilisation "
                f"{100 * self.utilisation(self.seconds):.1f}%; exposed collectives {_t(self.exposed_s)}, "
                f"{100 * self.exposed_s / self.seconds if self.seconds else 0:.1f}% of the step)"
                + (f"; pipeline bubble {100 * self.bubble:.1f}% (the lockstep simulator at the stages' counted "
                   f"FLOPs; already in the counted ticks)" if self.bubble is not None else ""),
                f"  compute {_t(self.compute_s)} at peak"
                + (f" ({_t(self.kernel_s)} of it in attention kernels, from the model's sizes)" if self.kernel_s else "")
                + f", memory {_t(self.memory_s)} (an upper bound), collectives "
                f"{_t(self.comm_s)}" + (f" ({_t(self.dcn_s)} across slices)" if self.dcn_s else "")
                + (f": {per_axis}" if per_axis else "")
                + f"; bounds {_t(self.overlapped_s)} (all hidden) - {_t(self.serial_s)} (none hidden)",
                f"  figures: {self.chip.source}"]


def _t(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def estimate(costs, chip: Chip | str, dcn_axes=(), int8: bool = False, model_flops: float = 0.0,
             bubble: float | None = None, kernel_flops: float = 0.0) -> Estimate:
    """The estimate of one step of `costs` (`parallax.cost.StepCosts`, per device) on `chip` (a `Chip` or a
    key of `CHIPS`). `dcn_axes`: mesh axes whose collectives are priced as crossing slices or nodes (a
    what-if for a program compiled for one slice; collectives counted as crossing, `dcn_sent`, are priced so
    anyway); `int8`: the matmuls at the int8 peak; `model_flops`: per device and step, for MFU;
    `kernel_flops`: the FLOPs of custom calls (an attention kernel's), which the HLO does not show, at the
    bf16 peak."""
    from parallax.errors import ConfigError

    if isinstance(chip, str):
        if chip not in CHIPS:
            raise ConfigError(f"--chip={chip}: no figures for it; known: {', '.join(CHIPS)}")
        chip = CHIPS[chip]
    peak = chip.peak_int8 if int8 and chip.peak_int8 else chip.peak_bf16
    dcn_axes = tuple(dcn_axes)
    if chip.dcn is None and (dcn_axes or costs.dcn_sent()):
        raise ConfigError(f"{'--dcn_axes=' + ','.join(dcn_axes) if dcn_axes else 'a mesh over several slices'}: "
                          f"no published DCN bandwidth for {chip.name}; plan within one slice or pick a chip with one")

    def seconds(axes, sent, dcn_sent):
        if set(axes) & set(dcn_axes):
            return sent / chip.dcn, sent / chip.dcn
        return (sent - dcn_sent) / chip.link + (dcn_sent / chip.dcn if dcn_sent else 0.0), (
            dcn_sent / chip.dcn if dcn_sent else 0.0)

    collectives, dcn_s = {}, 0.0
    for (_, axes), c in costs.collectives.items():
        t, over_dcn = seconds(axes, c["sent"], c.get("dcn_sent", 0.0))
        t += chip.latency * c["count"] if c["sent"] else 0.0
        collectives[axes] = collectives.get(axes, 0.0) + t
        dcn_s += over_dcn
    exposed = 0.0
    for w in costs.windows:
        t, _ = seconds(w["axes"], w["sent"], w["dcn_sent"])
        t += chip.latency if w["sent"] else 0.0
        exposed += w["times"] * max(0.0, t - max(w["flops"] / peak, w["bytes"] / chip.hbm))
    return Estimate(chip, costs.flops / peak + kernel_flops / chip.peak_bf16, costs.bytes / chip.hbm, collectives, dcn_axes, exposed_s=exposed,
                    model_flops=model_flops, dcn_s=dcn_s, bubble=bubble, peak=peak,
                    kernel_s=kernel_flops / chip.peak_bf16)
