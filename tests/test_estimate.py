"""parallax/estimate.py: the step-time roofline from counted costs and published chip figures, by hand."""

import pytest

from parallax.cost import StepCosts
from parallax.errors import ConfigError
from parallax.estimate import CHIPS, estimate


def _costs():
    costs = StepCosts(flops=459e12, bytes=2765e9 / 2)  # on v5p: 1 s of matmuls at peak, 0.5 s of HBM traffic
    costs.collectives = {
        ("all-gather", ("fsdp",)): {"count": 4, "bytes": 0.0, "sent": 100e9},  # 100 GB over one ICI axis
        ("reduce-scatter", ("fsdp",)): {"count": 4, "bytes": 0.0, "sent": 100e9},
        ("all-reduce", ("data",)): {"count": 1, "bytes": 0.0, "sent": 6.25e9 / 2},  # 3.125 GB
    }
    return costs


def test_compute_memory_and_each_axis_at_the_published_figures():
    # v5p: 1200 GB/s bidirectional ICI per chip over a 3D torus: 600 out, 100 per link, 200 along one axis's
    # two links; DCN 50 Gbps = 6.25 GB/s per chip.
    ici = estimate(_costs(), "v5p")
    assert ici.compute_s == pytest.approx(1.0) and ici.memory_s == pytest.approx(0.5)
    assert ici.collectives_s == pytest.approx({("fsdp",): 1.0, ("data",): 3.125 / 200})
    assert ici.overlapped_s == pytest.approx(1.015625) and ici.serial_s == pytest.approx(2.015625)
    dcn = estimate(_costs(), "v5p", dcn_axes=("data",))
    assert dcn.collectives_s[("data",)] == pytest.approx(0.5)
    assert dcn.overlapped_s == pytest.approx(1.5) and dcn.serial_s == pytest.approx(2.5)
    assert dcn.utilisation(dcn.serial_s) == pytest.approx(0.4)
    lines = dcn.lines()
    assert lines[0] == ("estimated step on TPU v5p: 1.5 s - 2.5 s (collectives all hidden - none hidden); compute "
                        "1 s at peak, memory 500 ms (an upper bound), collectives 1.5 s: fsdp 1 s, data 500 ms (DCN)")
    assert lines[1] == "  hardware FLOPs utilisation 40.0% - 66.7%; exposed collectives 0% - 60.0% of the step"
    # int8 matmuls at the int8 peak where one is published (v5e: 393 TOP/s against 197 TFLOP/s)
    assert estimate(_costs(), "v5e", int8=True).compute_s == pytest.approx(459 / 393)
    assert estimate(_costs(), "v5p", int8=True).compute_s == pytest.approx(1.0)  # none published: bf16's
    assert CHIPS["h100"].link == pytest.approx(450e9) and CHIPS["h100"].dcn == pytest.approx(50e9)


def test_unknown_chips_and_unpriced_dcn_axes_are_one_line():
    with pytest.raises(ConfigError, match=r"^--chip=tpu9: no figures for it; known: v5p, v5e, v6e, h100, h200$"):
        estimate(_costs(), "tpu9")
    with pytest.raises(ConfigError, match=r"^--dcn_axes=data: no published DCN bandwidth for TPU v6e"):
        estimate(_costs(), "v6e", dcn_axes=("data",))
