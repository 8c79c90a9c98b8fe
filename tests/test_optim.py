"""Muon and AdamW from logical names, LR schedules, and the one-step gradient delay.

Muon is checked against `optax.contrib.muon` given the same dimension numbers (our dims come from the
logical names; stacked 3-D weights are batches of matrices), against the 1-device run on sharded meshes,
and the delay against a hand-written loop that applies each gradient one step late.
"""
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from helpers import ROOT, assert_parity, loss_grads_and_steps, read_metrics, rel_err, tiny_config
from parallax import hlo, optim
from parallax.config import apply_override
from parallax.defaults import load_config_file
from parallax.errors import ConfigError
from parallax.plan import make_plan
from parallax.sharding import is_logical_names
from parallax.train import make_dataset, train_and_evaluate
from parallax.trainer import Trainer


def test_muon_dims_follow_the_logical_names():
    dims = optim.muon_dims
    assert dims(("layers", "embed", "heads", "head_dim")) == MuonDimensionNumbers((1,), (2, 3))  # wq
    assert dims(("layers", "heads", "head_dim", "embed")) == MuonDimensionNumbers((1, 2), (3,))  # wo
    assert dims(("layers", "embed", "mlp")) == MuonDimensionNumbers((1,), (2,))  # w_gate
    assert dims(("layers", "mlp", "embed")) == MuonDimensionNumbers((1,), (2,))  # w_down
    assert dims(("embed", "vocab")) is None and dims(("vocab", "embed")) is None  # head, embedding: AdamW
    assert dims(("positions", "embed")) is None  # outside the layer stack: AdamW (GPT-2's wpe)
    assert dims(("layers", "norm")) is None and dims(("layers", "heads", "head_dim")) is None  # vectors
    assert dims(("layers", "experts", "embed", "mlp")) == MuonDimensionNumbers((2,), (3,))  # experts: a batch dim
    assert dims(("layers", "experts", "mlp")) is None  # a stacked expert bias
    assert dims(("layers", "embed", "router")) is None  # a MoE router: always AdamW
    assert dims(("layers", "embed", "mlp"), exclude=("mlp",)) is None  # optim.muon.exclude


def test_weight_decay_applies_to_matrices_only():
    names = {"wq": ("layers", "embed", "heads", "head_dim"), "w_up": ("layers", "experts", "embed", "mlp"),
             "embedding": ("vocab", "embed"), "norm": ("layers", "norm"), "final_norm": ("embed",),
             "q_bias": ("layers", "heads", "head_dim"), "expert_bias": ("layers", "experts", "mlp")}
    assert optim.decay_mask(names) == {"wq": True, "w_up": True, "embedding": True, "norm": False,
                                       "final_norm": False, "q_bias": False, "expert_bias": False}


def _params_and_grads(config, steps=5):
    """Tiny Llama params and `steps` fixed random gradient trees (fp32) of the same shapes."""
    trainer = Trainer(config, devices=jax.devices()[:1])
    params = trainer.init_state()["params"]
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    grads = [jax.tree.unflatten(tree, [jnp.asarray(rng.normal(size=p.shape), jnp.float32) for p in leaves])
             for _ in range(steps)]
    return trainer, params, grads


def _run(tx, params, grads):
    state, out, update = tx.init(params), [], tx.update
    for g in grads:
        updates, state = update(g, state, params)
        out.append(updates)
        params = optax.apply_updates(params, updates)
    return out


def test_muon_equals_optax_contrib_muon_with_the_same_dimension_numbers():
    config = tiny_config(data=1)
    config.optim.update(name="muon", clip_norm=0.0, weight_decay=0.1, warmup_steps=2)
    trainer, params, grads = _params_and_grads(config)
    ours = _run(trainer.tx, params, grads)
    dims = jax.tree.map(optim.muon_dims, trainer.logical, is_leaf=is_logical_names)
    reference = optax.contrib.muon(
        learning_rate=optim.lr_schedule(optim.resolve(config.optim), config.train.steps), ns_coeffs=optim.NS_COEFFS, ns_steps=5,
        beta=0.95, weight_decay=0.1, nesterov=True, consistent_rms=0.2, muon_weight_dimension_numbers=dims)
    theirs = _run(reference, params, grads)
    stacked = 0
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for (path, x), y, d in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b),
                                   jax.tree.leaves(dims, is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))):
            if d is None:
                continue  # AdamW leaves: optax's muon pairs them with NAdam, ours with AdamW
            stacked += x.ndim >= 3
            assert rel_err(x, y) <= 1e-6, (step, jax.tree_util.keystr(path), rel_err(x, y))
    assert stacked > 0


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_lr_schedules_warm_up_then_follow_their_shape(schedule):
    config = tiny_config()
    config.optim.update(schedule=schedule, lr=1.0, warmup_steps=10, min_lr_ratio=0.1, decay_steps=100,
                        wsd_decay_fraction=0.2)
    lr = optim.lr_schedule(optim.resolve(config.optim), 100)
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(0.5) and float(lr(10)) == pytest.approx(1.0)
    final = {"cosine": 0.1, "wsd": 0.1, "constant": 1.0}[schedule]
    assert float(lr(100)) == pytest.approx(final, abs=1e-6)
    if schedule == "wsd":
        assert float(lr(80)) == pytest.approx(1.0) and float(lr(90)) == pytest.approx(0.55)
        config.optim.update(warmup_steps=90)  # a decay longer than what is left after the warmup is cut
        assert float(optim.lr_schedule(optim.resolve(config.optim), 100)(100)) == pytest.approx(0.1)


def test_lr_schedule_edges_no_warmup_a_one_step_decay_and_decay_steps_0():
    def lr_at(steps, total=100, **settings):
        config = tiny_config()
        config.optim.update(lr=1.0, min_lr_ratio=0.1, **settings)
        lr = optim.lr_schedule(optim.resolve(config.optim), total)
        return [float(lr(s)) for s in steps]
    cos = dict(schedule="cosine", warmup_steps=10)
    assert 0.2 < lr_at([55], decay_steps=100, **cos)[0] < 0.9  # on the way down the cosine
    mid, last = lr_at([100, 200], total=200, decay_steps=0, **cos)  # decay_steps=0: decays over train.steps
    assert 0.2 < mid < 0.9 and last == pytest.approx(0.1)
    assert lr_at([10, 11], decay_steps=10, **cos) == pytest.approx([1.0, 0.1])  # no steps left: 1-step decay
    for schedule in ("wsd", "constant"):  # no warmup: lr from step 0; a 1-step warmup reaches lr at step 1
        assert lr_at([0, 50], schedule=schedule, warmup_steps=0, decay_steps=100) == [1.0, 1.0], schedule
        assert lr_at([0, 1], schedule=schedule, warmup_steps=1, decay_steps=100) == [0.0, 1.0], schedule
    wsd = dict(schedule="wsd", warmup_steps=10)
    # a fraction rounding to 0 steps still decays, over one step; so does a run with no steps after warmup
    assert lr_at([99, 100], decay_steps=100, wsd_decay_fraction=1e-3, **wsd) == pytest.approx([1.0, 0.1])
    assert lr_at([10, 11], decay_steps=10, wsd_decay_fraction=0.2, **wsd) == pytest.approx([1.0, 0.1])


def test_schedule_surprises_are_one_line_warnings_at_the_start():
    def warnings(steps, **settings):
        config = tiny_config()
        config.optim.update(lr=1.0, **settings)
        return optim.schedule_warnings(optim.resolve(config.optim), steps)
    assert warnings(100, warmup_steps=10, decay_steps=0) == []
    assert warnings(100, warmup_steps=100, decay_steps=100) == []  # the warmup ends with the run
    got = warnings(10, warmup_steps=20)
    # step 10 (count 9) of a 20-step linear warmup to 1.0: 9 / 20
    assert len(got) == 1 and "optim.warmup_steps=20 > train.steps=10" in got[0] and "is 0.45)" in got[0], got
    got = warnings(10, warmup_steps=0, decay_steps=4, min_lr_ratio=0.0, schedule="cosine")
    assert len(got) == 1 and "steps 5-10 train at the schedule's final LR 0 (min_lr_ratio=0: they change nothing)" \
        in got[0], got
    got = warnings(10, warmup_steps=0, decay_steps=4, min_lr_ratio=0.1, schedule="wsd")
    assert len(got) == 1 and "final LR 0.1;" in got[0] and "raise decay_steps to 10" in got[0], got
    assert warnings(10, warmup_steps=0, decay_steps=4, schedule="constant") == []  # no end to run past
    assert all("\n" not in line and line.startswith("warning: ") for line in warnings(10, warmup_steps=20, decay_steps=4))


def test_bad_optimizer_settings_are_one_line_errors():
    for key, value, match in [("name", "lion", "expected one of adamw, muon, sgd"),
                              ("grad_delay", 2, "expected 0 or 1"),
                              ("schedule", "linear", "expected one of cosine, wsd, constant"),
                              ("muon.rms", 0.0, "rms=0.0 > 0"), ("muon.exclude", "vocabs", "'vocabs' is not a"),
                              ("delay_correction", "ef", "expected one of none, error_feedback"),
                              ("delay_correction", "error_feedback", "set optim.grad_delay=1")]:
        config = tiny_config(data=8)
        apply_override(config, f"optim.{key}", str(value))
        with pytest.raises(ConfigError, match=match):
            make_plan(config, 8)


def test_optimizer_settings_are_checked_at_their_range_boundaries():
    def error(section="", **settings):
        config = tiny_config(data=8)
        (config.optim[section] if section else config.optim).update(settings)
        try:
            optim.resolve(config.optim)
        except ConfigError as e:
            return str(e)
    for ok in [dict(section="muon", scale="width"), dict(section="muon", scale="rms"), dict(wsd_decay_fraction=1.0),
               dict(wsd_decay_fraction=1e-3), dict(section="muon", ns_steps=1), dict(section="muon", beta=0.0),
               dict(section="muon", beta=0.999), dict(section="sgd", momentum=0.0),
               dict(section="sgd", momentum=0.999)]:
        assert error(**ok) is None, ok
    for bad in (1.0, -0.1):
        assert error("sgd", momentum=bad) == f"config.optim.sgd.momentum={bad}: expected a value in [0, 1)"
    assert error(wsd_decay_fraction=0.0) == error(wsd_decay_fraction=1.5).replace("1.5", "0.0") == (
        "config.optim.wsd_decay_fraction=0.0: expected a fraction in (0, 1]")
    for bad in [dict(ns_steps=0), dict(beta=1.0), dict(beta=1.5), dict(beta=-0.1)]:
        assert error("muon", **bad).startswith("config.optim.muon: ns_steps="), bad
    assert error("muon", scale="WIDTH") == "config.optim.muon.scale='WIDTH': expected one of rms, width"


@pytest.mark.parametrize("correction", ["none", "error_feedback"])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_grad_delay_applies_each_gradient_one_step_late(name, correction):
    """Against a loop written out by hand: step 0 changes nothing, step t applies the gradient of t-1;
    with error feedback it applies 2 u[t] - u[t-1] (u the undelayed optimizer's update, u[-1] = 0)."""
    config = tiny_config(data=1)
    config.optim.update(name=name, grad_delay=1, delay_correction=correction, warmup_steps=0)
    delayed = Trainer(config, devices=jax.devices()[:1])
    data = make_dataset(config)
    state = delayed.init_state()
    config.optim.update(grad_delay=0, delay_correction="none")
    plain = Trainer(config, devices=jax.devices()[:1])
    params = jax.tree.map(jnp.copy, state["params"])  # train_step donates the state
    opt_state, stale = plain.tx.init(params), None
    previous = jax.tree.map(jnp.zeros_like, params)
    for step in range(4):
        batch = delayed.device_batch(data.batch(step))
        state, _ = delayed.train_step(state, batch)
        _, grads = plain.loss_and_grads(params, batch)
        if stale is not None:
            updates, opt_state = plain.tx.update(stale, opt_state, params)
            applied = updates
            if correction == "error_feedback":
                applied = jax.tree.map(lambda u, p: 2 * u - p, updates, previous)
                previous = updates
            params = optax.apply_updates(params, applied)
        stale = grads
        err = max(rel_err(a, b) for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(params)))
        assert err <= 1e-6, (step, err)
        if step == 0:  # nothing applied yet
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state["params"]),
                                                            jax.tree.leaves(params)))
    if correction == "error_feedback":  # the correction did something: the weights differ from the plain delay
        config.optim.update(grad_delay=1)
        uncorrected = Trainer(config, devices=jax.devices()[:1])
        other = uncorrected.init_state()
        for step in range(4):
            other, _ = uncorrected.train_step(other, uncorrected.device_batch(data.batch(step)))
        assert max(rel_err(a, b) for a, b in zip(jax.tree.leaves(state["params"]),
                                                 jax.tree.leaves(other["params"]))) > 1e-3


MESHES = [dict(fsdp=8), dict(fsdp=4, tensor=2), dict(pipe=2, fsdp=2, tensor=2)]


@pytest.fixture(scope="module")
def muon_references():
    out = {}
    for delay in DELAYS:
        config = tiny_config(data=1)
        config.optim.update(name="muon", grad_delay=delay[0], delay_correction=delay[1], lr=1e-2,
                            warmup_steps=0)  # every step moves
        out[delay] = loss_grads_and_steps(config, jax.devices()[:1])
    return out


DELAYS = [(0, "none"), (1, "none"), (1, "error_feedback")]


@pytest.mark.slow
@pytest.mark.parametrize("delay", DELAYS, ids=lambda d: f"delay={d[0]},{d[1]}")
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_muon_on_sharded_meshes_matches_one_device(muon_references, mesh, delay):
    config = tiny_config(**mesh)
    config.optim.update(name="muon", grad_delay=delay[0], delay_correction=delay[1], lr=1e-2, warmup_steps=0)
    assert_parity(loss_grads_and_steps(config, jax.devices()), muon_references[delay], 1e-5)


@pytest.mark.slow
def test_muon_on_a_moe_model_with_expert_parallelism_matches_one_device():
    """Expert weights [layers, experts, d_in, d_out] are L x E matrices spread over the mesh; the router
    goes to AdamW; expert=2 x tensor=2 x fsdp=2 equals one device."""
    def config(**mesh):
        c = load_config_file(os.path.join(ROOT, "configs", "moe_tiny.py"))
        for axis in c.mesh:
            c.mesh[axis] = mesh.get(axis, 1)
        c.optim.update(name="muon", lr=1e-2, warmup_steps=0)
        return c
    reference = loss_grads_and_steps(config(data=1), jax.devices()[:1], steps=3)
    assert_parity(loss_grads_and_steps(config(expert=2, tensor=2, fsdp=2), jax.devices(), steps=3), reference, 1e-5)


@pytest.mark.slow
def test_resume_in_the_middle_of_a_delayed_corrected_muon_run_is_exact(tmp_path):
    def config(steps):
        c = tiny_config(data=2, fsdp=4)
        c.train.update(steps=steps, log_every=1, checkpoint_every=3, eval_every=0)
        c.optim.update(name="muon", grad_delay=1, delay_correction="error_feedback", warmup_steps=1,
                       decay_steps=6)
        return c

    def losses(workdir):
        return [(r["step"], r["loss"]) for r in read_metrics(workdir)]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train_and_evaluate(config(6), straight, log=lambda *_: None)
    train_and_evaluate(config(3), resumed, log=lambda *_: None)
    train_and_evaluate(config(6), resumed, log=lambda *_: None)
    assert losses(resumed) == losses(straight) and len(losses(straight)) == 6


def _compiled_update(config, spread: bool):
    """The optimizer update alone, compiled for the trainer's shardings (`spread`: Muon's Newton-Schulz on
    whole matrices spread over the mesh; else XLA partitions it on the sharded matrices)."""
    from parallax.trainer import _opt_state_shardings
    trainer = Trainer(config, devices=jax.devices())
    params = trainer.abstract_state()["params"]
    tx = optim.make_optimizer(optim.resolve(config.optim), 100, trainer.logical, trainer.mesh if spread else None)
    state = jax.eval_shape(tx.init, params)
    shardings = (trainer.param_shardings, _opt_state_shardings(state, trainer.param_shardings, trainer.mesh),
                 trainer.param_shardings)
    return jax.jit(tx.update, in_shardings=shardings).lower(params, state, params).compile(), trainer


def _dot_shapes(compiled):
    import re
    return [tuple(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"= f32\[([0-9,]*)\][^=\n]*? dot\(", compiled.as_text())]


@pytest.mark.parametrize("mesh,layers", [(dict(fsdp=8), 8), (dict(fsdp=8), 6), (dict(fsdp=8), 12),
                                         (dict(fsdp=4, tensor=2), 8), (dict(pipe=2, fsdp=4), 8)],
                         ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()) if isinstance(m, dict) else f"L={m}")
def test_sharded_newton_schulz_runs_each_matrix_once_on_one_device(mesh, layers):
    """L layers on N = 8 devices: every device orthogonalises ceil(L / N) whole matrices of each Muon leaf
    (every NS matmul is on whole matrices, batched only when L > N; a stack that does not divide is padded),
    3 matmuls x 5 steps per leaf. The momentum reaches the whole matrices by all-to-alls only, also when
    split over fsdp x tensor, moving several times fewer bytes than XLA's partitioning of the plain
    iteration, which gathers every step."""
    config = tiny_config(**mesh)
    config.model.update(num_layers=layers, d_model=64, d_ff=256)
    config.optim.update(name="muon")
    compiled, trainer = _compiled_update(config, spread=True)
    muon_leaves = sum(optim.muon_dims(n) is not None for n in jax.tree.leaves(trainer.logical, is_leaf=is_logical_names))
    dots = _dot_shapes(compiled)
    per_device = -(-layers // 8)
    assert all(len(s) == 2 if per_device == 1 else (len(s) == 3 and s[0] == per_device) for s in dots), sorted(set(dots))
    assert len(dots) == 3 * 5 * muon_leaves
    def moved(c):
        return sum(math.prod(s) * 4 for _, shapes in hlo.collective_shapes(c) for s in shapes)
    plain = _compiled_update(config, spread=False)[0]
    print(f"spread {hlo.count_collectives(compiled)} {moved(compiled)} B; plain {hlo.count_collectives(plain)} "
          f"{moved(plain)} B")
    assert hlo.count_collectives(compiled)["all-gather"] == 0 and moved(compiled) * 4 < moved(plain)
