"""A step-time estimate from the counted costs of a compiled step (`parallax.cost.StepCosts`) and published chip
figures: compute at the chip's peak, memory traffic at its HBM bandwidth, each collective at the bandwidth of
the links it crosses (ICI inside a slice, NVLink inside a node; the data-center network or InfiniBand for the
mesh axes named as crossing slices or nodes).

What it is and is not: a roofline, not a simulation. `compute_s` and `memory_s` overlap (the larger bounds a
step), and the collectives either hide entirely behind them (`overlapped_s`, the lower bound) or not at all
(`serial_s`, the upper bound); where between the two a real step lands depends on what the compiled schedule
puts between a collective's start and its done, which this does not read yet. `bytes` is an upper bound of
the memory traffic (see `parallax.cost`), so `memory_s` is too.

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

    def utilisation(self, seconds: float) -> float:
        """The counted matmul FLOPs over the chip's peak in `seconds` (hardware FLOPs: remat's recompute
        counts, unlike MFU's model FLOPs)."""
        return self.compute_s / seconds if seconds > 0 else 0.0

    def lines(self) -> list[str]:
        per_axis = ", ".join(f"{','.join(axes) or 'one device'} {_t(s)}"
                             + (" (DCN)" if set(axes) & set(self.dcn_axes) else "")
                             for axes, s in sorted(self.collectives_s.items(), key=lambda kv: -kv[1]))
        return [f"estimated step on {self.chip.name}: {_t(self.overlapped_s)} - {_t(self.serial_s)} "
                f"(collectives all hidden - none hidden); compute {_t(self.compute_s)} at peak, memory "
                f"{_t(self.memory_s)} (an upper bound), collectives {_t(self.comm_s)}"
                + (f": {per_axis}" if per_axis else ""),
                f"  hardware FLOPs utilisation {100 * self.utilisation(self.serial_s):.1f}% - "
                f"{100 * self.utilisation(self.overlapped_s):.1f}%; exposed collectives 0% - "
                f"{100 * self.comm_s / self.serial_s if self.serial_s else 0:.1f}% of the step",
                f"  figures: {self.chip.source}"]


def _t(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def estimate(costs, chip: Chip | str, dcn_axes=(), int8: bool = False) -> Estimate:
    """The roofline of one step of `costs` (`parallax.cost.StepCosts`, per device) on `chip` (a `Chip` or a
    key of `CHIPS`). `dcn_axes`: mesh axes whose collectives cross slices or nodes (priced at `chip.dcn`);
    `int8`: the matmuls at the int8 peak."""
    from parallax.errors import ConfigError

    if isinstance(chip, str):
        if chip not in CHIPS:
            raise ConfigError(f"--chip={chip}: no figures for it; known: {', '.join(CHIPS)}")
        chip = CHIPS[chip]
    peak = chip.peak_int8 if int8 and chip.peak_int8 else chip.peak_bf16
    dcn_axes = tuple(dcn_axes)
    if dcn_axes and chip.dcn is None:
        raise ConfigError(f"--dcn_axes={','.join(dcn_axes)}: no published DCN bandwidth for {chip.name}; plan "
                          "without DCN axes or pick a chip with one")
    collectives = {}
    for axes, sent in costs.by_axes("sent").items():
        bandwidth = chip.dcn if set(axes) & set(dcn_axes) else chip.link
        collectives[axes] = collectives.get(axes, 0.0) + sent / bandwidth
    return Estimate(chip, costs.flops / peak, costs.bytes / chip.hbm, collectives, dcn_axes)
