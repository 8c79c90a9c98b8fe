"""Meshes over several slices (`config.dcn`): each axis's devices laid out slice-major, and in the compiled
train step only the collectives over the axes mapped over the data-center network cross slices.

The slices are simulated CPU devices in consecutive groups (one process), and, where libtpu is installed,
the TPU compiler's own multi-slice topology (devices with a `slice_index`). Which collectives cross is read
from the optimized HLO: a collective crosses when one of its device groups holds devices of two slices
(`parallax.cost`, its `slices` argument), the slice of each device taken from the devices, not from the
mesh code under test.
"""
import re

import jax
import numpy as np
import pytest

from helpers import tiny_config
from parallax import mesh as mesh_lib
from parallax.errors import ConfigError
from parallax.memory import memory_report


def _crossing(report):
    """{(op, axes): (count, crossing count)} of the compiled step's collectives."""
    return {key: (c["count"], c["dcn_count"]) for key, c in report.costs.collectives.items() if c["count"]}


def _check_only_dcn_axes_cross(report, dcn_axis):
    crossing = _crossing(report)
    over = {key for key in crossing if dcn_axis in key[1]}
    assert over, crossing  # the axis communicates at all
    for (op, axes), (count, crossed) in crossing.items():
        # every collective over the DCN axis crosses slices; none of the others does
        assert crossed == (count if dcn_axis in axes else 0), (op, axes, crossing)


@pytest.mark.parametrize("mesh, dcn", [
    (dict(data=2, fsdp=2, tensor=2), "fsdp"),
    (dict(data=2, fsdp=2, tensor=2), "data"),
    (dict(pipe=2, fsdp=2, tensor=2), "pipe"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_only_the_axes_mapped_over_dcn_carry_collectives_between_slices(mesh, dcn):
    config = tiny_config(**mesh)
    config.dcn[dcn] = 2
    if dcn == "pipe":
        config.pipeline.schedule = "1f1b"
        config.pipeline.microbatches = 2
    devices = jax.devices()[:8]
    report = memory_report(config, devices)
    _check_only_dcn_axes_cross(report, dcn)
    # the collectives that cross slices run at DCN's bandwidth in the estimate
    from parallax.estimate import estimate

    est = estimate(report.costs, "v5p")
    assert est.dcn_s > 0 and est.dcn_s == pytest.approx(report.costs.dcn_sent() / (50e9 / 8))


def test_each_slice_holds_a_contiguous_part_of_the_axes_that_span_slices():
    """By hand: data=2 x fsdp=2 x tensor=2 on 8 devices in 2 slices (ids 0-3, 4-7)."""
    config = tiny_config(data=2, fsdp=2, tensor=2)
    sizes = mesh_lib.resolve_axis_sizes(config.mesh, 8, "cpu")
    devices = jax.devices()[:8]
    for axis, expected in (("fsdp", [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]),
                           ("data", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])):
        dcn = mesh_lib.resolve_dcn({axis: 2}, sizes)
        mesh = mesh_lib.make_mesh(config.mesh, devices, dcn)
        ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(2, 2, 2)
        assert ids.tolist() == expected, axis
    # given in another order, the same slices (by device id)
    shuffled = [devices[i] for i in (5, 2, 7, 0, 1, 6, 3, 4)]
    assert mesh_lib.device_slices(shuffled, 2) == [1, 0, 1, 0, 0, 1, 0, 1]


def test_impossible_splits_are_one_line_errors():
    sizes = mesh_lib.resolve_axis_sizes({"data": 2, "fsdp": 4}, 8, "cpu")
    cases = [({"tensor": 2}, r"^config\.dcn\.tensor=2: tensor collectives run in every layer and stay inside a "
                             r"slice; span slices with replica, data, fsdp, pipe$"),
             ({"fsdp": 3}, r"^config\.dcn\.fsdp=3 does not divide config\.mesh\.fsdp=4: each slice holds an equal "
                           r"part of the axis; make mesh\.fsdp a multiple of 3$"),
             ({"data": 0}, r"^config\.dcn\.data=0: the slices an axis spans are a positive count"),
             ({"pipes": 2}, r"^config\.dcn: unknown axes \['pipes'\]")]
    for dcn, message in cases:
        with pytest.raises(ConfigError, match=message):
            mesh_lib.resolve_dcn(dcn, sizes)

    class Chip:  # a TPU device of a slice (every chip of a multi-host slice: processes are not slices there)
        def __init__(self, i, s):
            self.id, self.slice_index, self.process_index, self.platform = i, s, i % 4, "tpu"
    with pytest.raises(ConfigError, match=r"^config\.dcn \(4 slices\) but the 8 devices are in 2 TPU slices "
                                          r"\(slice_index\); make the product of config\.dcn's sizes 2$"):
        mesh_lib.device_slices([Chip(i, i // 4) for i in range(8)], 4)
    assert mesh_lib.device_slices([Chip(i, 1 - i // 4) for i in range(8)], 2) == [1] * 4 + [0] * 4

    class Host:  # a CPU / GPU device of a multi-process run (whose slice_index is 0): its process is its slice
        def __init__(self, i, p):
            self.id, self.process_index, self.slice_index, self.platform = i, p, 0, "cpu"
    assert mesh_lib.device_slices([Host(i, i % 2) for i in range(8)], 2) == [0, 1] * 4
    three = [Host(i, i % 3) for i in range(6)]
    assert mesh_lib.device_slices(three, 3) == [0, 1, 2] * 2
    with pytest.raises(ConfigError, match=r"^config\.dcn \(2 slices\) but the 6 devices are in 3 processes \(one "
                                          r"node each\); make the product of config\.dcn's sizes 3$"):
        mesh_lib.device_slices(three, 2)
    with pytest.raises(ConfigError, match=r"^config\.dcn: 3 slices do not divide the 8 devices$"):
        mesh_lib.device_slices([Host(i, 0) for i in range(8)], 3)


def test_a_two_slice_plan_compiles_on_the_tpu_compiler_and_crosses_slices_over_its_dcn_axis_only():
    """Two slices of v5p:2x2x1 (8 chips; `slice_index` from the TPU compiler's topology), data=2 x fsdp=4, one
    of the two over DCN. The TPU compiler's program is one slice's: its collectives' device groups are the
    slice's 4 chips, and what crosses slices is a transfer to the Megascale runtime, whose kind the compiler
    writes on it: the data axis over DCN moves the gradients' sums (ALL_REDUCE) only; the fsdp axis over
    DCN moves FSDP's gathers of the weights too."""
    pytest.importorskip("libtpu")
    from parallax import hlo
    from parallax.memory import compile_step, tpu_devices

    devices = tpu_devices("v5p:2x2x1", slices=2)
    assert sorted({d.slice_index for d in devices}) == [0, 1]
    kinds = {}
    for axis in ("data", "fsdp"):
        config = tiny_config(data=2, fsdp=4)
        config.dcn[axis] = 2
        trainer, compiled = compile_step(config, devices)
        text = compiled.as_text()
        assert all(max(len(g) for g in c["groups"]) <= 4 for c in hlo.collective_traffic(text, 4))
        kinds[axis] = set(re.findall(r'_xla_megascale_transfer_type="([A-Z_]+)"', text))
    assert kinds["data"] == {"ALL_REDUCE"}
    assert "ALL_GATHER" in kinds["fsdp"], kinds  # the weights' gathers cross (the compiler's own kinds)


def test_a_mesh_over_slices_matches_one_device_and_trains_in_bf16_evaluates_and_resumes(tmp_path):
    """fsdp=2 x tensor=2 x data=2 with fsdp over two simulated slices: the layout is a device permutation, so
    the loss, every gradient leaf and 5 steps' losses equal one device's (fp32, 1e-5); then in bf16 it trains,
    evaluates, checkpoints and resumes on the same layout."""
    from helpers import assert_parity, loss_grads_and_steps
    from parallax.train import train_and_evaluate

    config = tiny_config(data=2, fsdp=2, tensor=2)
    config.dcn.fsdp = 2
    reference = tiny_config()
    assert_parity(loss_grads_and_steps(config, jax.devices()[:8]), loss_grads_and_steps(reference, jax.devices()[:1]))
    config.model.dtype = "bfloat16"
    config.train.update(steps=2, log_every=1, eval_every=2, checkpoint_every=1)
    config.optim.decay_steps = 100
    first = train_and_evaluate(config, str(tmp_path), log=lambda *_: None)
    assert np.isfinite(first.history[-1]["loss"]) and "eval_loss" in first.history[-1]
    config.train.steps = 3
    said = []
    again = train_and_evaluate(config, str(tmp_path), log=said.append)
    assert any("at step 2" in line and "resumed from" in line for line in said), said
    assert [r["step"] for r in again.history] == [3]
