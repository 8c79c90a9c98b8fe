"""Throughput metrics: tokens/s per device and MFU (model FLOPs utilisation) where the device's peak is known.

MFU = model FLOPs per second per device / the device's peak bf16 dense FLOP/s. Model FLOPs are the model's
own count per trained token (`Model.flops_per_token`: 6 per parameter a token multiplies, plus attention),
so rematerialisation and pipeline bubbles lower MFU rather than inflate it. A device kind not in
`PEAK_FLOPS` (a CPU, an unlisted accelerator) has no MFU: the metric is left out, never guessed.
"""

from __future__ import annotations

import dataclasses

import jax

# Peak bf16 dense FLOP/s per chip (vendor figures, no sparsity), by `jax.Device.device_kind`. TPUs match
# exactly ("TPU v4 lite" is v4i, not v4); GPUs by the first substring that occurs in the device kind.
TPU_PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12, "TPU v5e": 197e12,  # v5e reports itself as "TPU v5 lite"
    "TPU v5": 459e12, "TPU v5p": 459e12,  # v5p reports itself as "TPU v5"
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,  # Trillium
}
GPU_PEAK_FLOPS = (  # (substring of device_kind, peak); the more specific first
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
    ("H200", 989e12),
    ("A100", 312e12),
)


def peak_flops(device_kind: str) -> float | None:
    """Peak bf16 dense FLOP/s of one device of this kind, or None if unknown (CPU, unlisted chips)."""
    if device_kind in TPU_PEAK_FLOPS:
        return TPU_PEAK_FLOPS[device_kind]
    for name, peak in GPU_PEAK_FLOPS:
        if name in device_kind:
            return peak
    return None


@dataclasses.dataclass(frozen=True)
class Throughput:
    """Per-run constants that turn a step time into throughput metrics."""
    tokens_per_step: int  # global batch x sequence length
    num_devices: int
    flops_per_token: float  # the model's training FLOPs per token
    device_kind: str
    peak: float | None  # FLOP/s per device, None when unknown

    def metrics(self, step_time_s: float) -> dict:
        """{tokens_per_sec, tokens_per_sec_per_device[, mfu]} for one step of `step_time_s` seconds."""
        tokens_per_sec = self.tokens_per_step / step_time_s
        out = {"tokens_per_sec": tokens_per_sec, "tokens_per_sec_per_device": tokens_per_sec / self.num_devices}
        if self.peak:
            out["mfu"] = out["tokens_per_sec_per_device"] * self.flops_per_token / self.peak
        return out

    def describe(self) -> str:
        """One line for the run's start: FLOPs per token and the peak MFU is measured against (or n/a)."""
        peak = (f"peak {self.peak / 1e12:g} TFLOP/s per {self.device_kind}" if self.peak else
                f"MFU n/a (no peak FLOP/s known for device kind {self.device_kind!r})")
        return f"{self.flops_per_token / 1e6:.3g} MFLOP per token (model); {peak}"


def throughput(plan, mesh) -> Throughput:
    """The `Throughput` of a plan's model on `mesh` (devices of one kind)."""
    t = plan.train
    kind = mesh.devices.flat[0].device_kind if hasattr(mesh, "devices") else jax.devices()[0].device_kind
    return Throughput(tokens_per_step=t.global_batch_size * t.seq_len, num_devices=int(mesh.size),
                      flops_per_token=plan.flops_per_token, device_kind=kind, peak=peak_flops(kind))
