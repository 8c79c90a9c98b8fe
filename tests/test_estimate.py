"""parallax/estimate.py: the step-time roofline from counted costs and published chip figures, by hand."""

import pytest

from parallax.cost import StepCosts
from parallax.errors import ConfigError
from parallax.estimate import CHIPS, estimate


def _window(op, axes, sent, flops, times=4, dcn_sent=0.0):
    return {"op": op, "axes": axes, "sent": sent, "dcn_sent": dcn_sent, "times": times, "flops": flops, "bytes": 0.0}


def _costs():
    costs = StepCosts(flops=459e12, bytes=2765e9 / 2)  # on v5p: 1 s of matmuls at peak, 0.5 s of HBM traffic
    costs.collectives = {
        ("all-gather", ("fsdp",)): {"count": 4, "bytes": 0.0, "sent": 100e9},  # 100 GB over one ICI axis
        ("reduce-scatter", ("fsdp",)): {"count": 4, "bytes": 0.0, "sent": 100e9},
        ("all-reduce", ("data",)): {"count": 1, "bytes": 0.0, "sent": 6.25e9 / 2},  # 3.125 GB
    }
    # as scheduled: each gather (25 GB, 125 ms on ICI) in flight over 100 ms of matmuls, each reduce-scatter
    # over 200 ms, the all-reduce synchronous
    costs.windows = [_window("all-gather", ("fsdp",), 25e9, 0.1 * 459e12),
                     _window("reduce-scatter", ("fsdp",), 25e9, 0.2 * 459e12),
                     _window("all-reduce", ("data",), 6.25e9 / 2, 0.0, times=1)]
    return costs


def test_compute_memory_and_each_axis_at_the_published_figures():
    # v5p: 1200 GB/s bidirectional ICI per chip over a 3D torus: 600 out, 100 per link, 200 along one axis's
    # two links; DCN 50 Gbps = 6.25 GB/s per chip.
    ici = estimate(_costs(), "v5p", model_flops=0.5 * 459e12)
    assert ici.compute_s == pytest.approx(1.0) and ici.memory_s == pytest.approx(0.5)
    assert ici.collectives_s == pytest.approx({("fsdp",): 1.0, ("data",): 3.125 / 200})
    assert ici.overlapped_s == pytest.approx(1.015625) and ici.serial_s == pytest.approx(2.015625)
    # exposed: 4 gathers x 25 ms, the all-reduce whole
    assert ici.exposed_s == pytest.approx(4 * 0.025 + 3.125 / 200) and ici.seconds == pytest.approx(1.115625)
    assert ici.mfu == pytest.approx(0.5 / 1.115625)
    dcn = estimate(_costs(), "v5p", dcn_axes=("data",))
    assert dcn.collectives_s[("data",)] == pytest.approx(0.5) and dcn.dcn_s == pytest.approx(0.5)
    assert dcn.overlapped_s == pytest.approx(1.5) and dcn.serial_s == pytest.approx(2.5)
    assert dcn.seconds == pytest.approx(1.6) and dcn.utilisation(dcn.serial_s) == pytest.approx(0.4)
    lines = dcn.lines()
    assert lines[0] == ("estimated step on TPU v5p: 1.6 s (hardware FLOPs utilisation 62.5%; exposed collectives "
                        "600 ms, 37.5% of the step)")
    assert lines[1] == ("  compute 1 s at peak, memory 500 ms (an upper bound), collectives 1.5 s (500 ms across "
                        "slices): fsdp 1 s, data 500 ms (DCN); bounds 1.5 s (all hidden) - 2.5 s (none hidden)")
    # counted as crossing slices (the devices' groups span them): the crossing bytes at DCN, the rest at ICI
    crossing = _costs()
    crossing.collectives[("all-reduce", ("data",))]["dcn_sent"] = 6.25e9 / 2
    crossing.windows[2]["dcn_sent"] = 6.25e9 / 2
    assert estimate(crossing, "v5p").seconds == pytest.approx(dcn.seconds)
    # a per-collective latency (alpha) where a chip has one (fitted on CPU): each execution of a collective
    import dataclasses
    slow = dataclasses.replace(CHIPS["v5p"], latency=1e-3)
    assert estimate(_costs(), slow).seconds == pytest.approx(ici.seconds + (4 + 4 + 1) * 1e-3 - 4 * 1e-3)
    # int8 matmuls at the int8 peak where one is published (v5e: 393 TOP/s against 197 TFLOP/s)
    assert estimate(_costs(), "v5e", int8=True).compute_s == pytest.approx(459 / 393)
    assert estimate(_costs(), "v5p", int8=True).compute_s == pytest.approx(1.0)  # none published: bf16's
    assert CHIPS["h100"].link == pytest.approx(450e9) and CHIPS["h100"].dcn == pytest.approx(50e9)


def test_unknown_chips_and_unpriced_dcn_axes_are_one_line():
    with pytest.raises(ConfigError, match=r"^--chip=tpu9: no figures for it; known: v5p, v5e, v6e, h100, h200$"):
        estimate(_costs(), "tpu9")
    with pytest.raises(ConfigError, match=r"^--dcn_axes=data: no published DCN bandwidth for TPU v6e"):
        estimate(_costs(), "v6e", dcn_axes=("data",))
    crossing = _costs()
    crossing.collectives[("all-reduce", ("data",))]["dcn_sent"] = 1.0
    with pytest.raises(ConfigError, match=r"^a mesh over several slices: no published DCN bandwidth for TPU v6e"):
        estimate(crossing, "v6e")


def test_crossing_bytes_latency_kernels_and_memory_bound_windows_by_hand():
    """v5p, 1 s of matmuls at peak. Two collectives cross slices in part (their crossing bytes at DCN's 6.25
    GB/s, the rest at 200 GB/s); one sends nothing (a group of one: no latency either); a window whose
    memory traffic (not its FLOPs) covers its collective; a latency of 1 ms per collective; kernels' FLOPs at
    the bf16 peak; a pipeline's bubble carried through."""
    import dataclasses

    chip = dataclasses.replace(CHIPS["v5p"], latency=1e-3)
    costs = StepCosts(flops=459e12, bytes=0.0)
    costs.collectives = {
        ("all-gather", ("fsdp",)): {"count": 2, "bytes": 0.0, "sent": 20e9, "dcn_sent": 6.25e9},  # 1 s over DCN
        ("all-reduce", ("data",)): {"count": 1, "bytes": 0.0, "sent": 12.5e9, "dcn_sent": 12.5e9},  # 2 s over DCN
        ("all-reduce", ("tensor",)): {"count": 3, "bytes": 0.0, "sent": 0.0, "dcn_sent": 0.0},
    }
    costs.windows = [
        # 13.75 GB at ICI (68.75 ms) + 6.25 GB at DCN (1 s) + 1 ms, in flight over 2765 GB of HBM traffic (1 s)
        {"op": "all-gather", "axes": ("fsdp",), "sent": 20e9, "dcn_sent": 6.25e9, "times": 1, "flops": 0.0,
         "bytes": 2765e9},
        {"op": "all-reduce", "axes": ("data",), "sent": 12.5e9, "dcn_sent": 12.5e9, "times": 1, "flops": 0.0,
         "bytes": 0.0},
        {"op": "all-reduce", "axes": ("tensor",), "sent": 0.0, "dcn_sent": 0.0, "times": 3, "flops": 0.0,
         "bytes": 0.0},
    ]
    e = estimate(costs, chip, kernel_flops=459e12 / 2, bubble=0.25, model_flops=459e12)
    assert e.collectives_s == pytest.approx({("fsdp",): 13.75 / 200 + 1 + 2e-3, ("data",): 2 + 1e-3,
                                             ("tensor",): 0.0})
    assert e.dcn_s == pytest.approx(3.0)
    assert e.compute_s == pytest.approx(1.5) and e.kernel_s == pytest.approx(0.5) and e.memory_s == 0.0
    assert e.exposed_s == pytest.approx(0.06875 + 1.001 - 1.0 + 2.001)
    assert e.seconds == pytest.approx(1.5 + e.exposed_s) and e.mfu == pytest.approx(1 / e.seconds)
    assert e.bubble == 0.25 and e.utilisation(0.0) == 0.0 and e.utilisation(3.0) == pytest.approx(0.5)
    lines = e.lines()
    assert lines[0] == (f"estimated step on TPU v5p: {e.seconds:.3g} s (MFU {100 / e.seconds:.1f}%, hardware FLOPs "
                        f"utilisation {150 / e.seconds:.1f}%; exposed collectives {e.exposed_s:.3g} s, "
                        f"{100 * e.exposed_s / e.seconds:.1f}% of the step); pipeline bubble 25.0% (the lockstep "
                        f"simulator at the stages' counted FLOPs; already in the counted ticks)")
    assert lines[1].startswith("  compute 1.5 s at peak (500 ms of it in attention kernels, from the model's "
                               "sizes), memory 0 ms (an upper bound), collectives 3.07 s (3 s across slices): "
                               "data 2 s, fsdp 1.07 s, tensor 0 ms; bounds")
    with pytest.raises(ConfigError, match=r"^--dcn_axes=data,fsdp: no published DCN bandwidth for TPU v6e"):
        estimate(costs, "v6e", dcn_axes=("data", "fsdp"))
