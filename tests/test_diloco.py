"""DiLoCo (`mesh.replica > 1`, parallax/steps/diloco.py): exactness against data parallelism and against a
reference loop written here, the communication of the inner and outer steps counted in the compiled HLO,
and the run around it (eval, checkpoints, bf16, config errors)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import max_leaf_rel_err, tiny_config
from parallax.errors import ConfigError
from parallax.plan import make_plan
from parallax.train import make_dataset
from parallax.trainer import Trainer

STEPS = 5


def _diloco(config, replica=2, every=1, lr=1.0, momentum=0.0, dtype="float32", **mesh):
    for axis in config.mesh:
        config.mesh[axis] = {"replica": replica, **mesh}.get(axis, 1)
    config.diloco.update(sync_every=every, outer_lr=lr, outer_momentum=momentum, pseudo_grad_dtype=dtype)
    return config


def _sgd(config):
    """A linear inner optimizer (plain SGD, no clipping): the mean of R steps is one step on the mean gradient."""
    config.optim.update(name="sgd", clip_norm=0.0, lr=0.5, warmup_steps=0, schedule="constant")
    return config


def _batch(data, step):
    """The dataset's batch with every token weighted 1: each replica's rows then carry the same weight
    total, so the replicas' equally weighted mean is the global batch's token mean (data parallelism's)."""
    batch = data.batch(step)
    return {**batch, "weights": np.ones_like(batch["weights"])}


def _run(config, devices, steps=STEPS):
    """(the step losses, the final global parameters) of `steps` steps of `config` on `devices`."""
    trainer = Trainer(config, devices=devices)
    data = make_dataset(config)
    state, losses = trainer.init_state(), []
    for step in range(steps):
        state, metrics = trainer.train_step(state, trainer.device_batch(_batch(data, step)))
        losses.append(float(trainer.path.fetch_metrics(metrics)["loss"]))
    return losses, jax.device_get(state["params"])


def _reference(model):
    """One device: (step losses, final parameters) of plain SGD on the whole batch, and each replica's
    (loss, gradients) of the first batch: the single-device loss of its own rows (the first / second half)."""
    config = _sgd(tiny_config(model))
    losses, params = _run(config, jax.devices()[:1])
    half = _sgd(tiny_config(model))
    half.train.global_batch_size //= 2
    trainer, batch = Trainer(half, devices=jax.devices()[:1]), _batch(make_dataset(config), 0)
    state = trainer.init_state()
    rows = [{k: v[r * 8:(r + 1) * 8] for k, v in batch.items()} for r in range(2)]
    return losses, params, [jax.device_get(trainer.loss_and_grads(state["params"], trainer.device_batch(b)))
                            for b in rows]


@pytest.fixture(scope="module")
def data_parallel_sgd():
    return _reference("llama")


@pytest.fixture(scope="module")
def moe_data_parallel_sgd():
    return _reference("moe")


@pytest.mark.parametrize("model,mesh", [("llama", dict(data=4)), ("llama", dict(fsdp=2, tensor=2)),
                                        ("llama", dict(pipe=2, data=2)), ("moe", dict(expert=2, data=2))],
                         ids=["data=4", "fsdp=2,tensor=2", "pipe=2,data=2", "moe-expert=2,data=2"])
def test_averaging_every_step_equals_data_parallel_training(model, mesh, request):
    """Each replica's first loss and every gradient leaf equal one device's on that replica's rows; and with
    H=1, outer SGD lr 1, momentum 0, fp32, the global parameters are the mean of the replicas' after each
    step, which for a linear inner optimizer is the data-parallel step on the global batch."""
    config = _diloco(_sgd(tiny_config(model)), **mesh)
    reference = "data_parallel_sgd" if model == "llama" else "moe_data_parallel_sgd"
    ref_losses, ref_params, ref_grads = request.getfixturevalue(reference)
    trainer = Trainer(config, devices=jax.devices())
    stacked = trainer.init_state()["diloco"]["params"]
    batch = trainer.device_batch(_batch(make_dataset(config), 0))
    first, grads, _ = jax.device_get(jax.jit(trainer.path.replica_grads)(stacked, batch))
    for r, (ref_loss, ref_grad) in enumerate(ref_grads):
        np.testing.assert_allclose(first[r], ref_loss, rtol=1e-5)
        err, where = max_leaf_rel_err(jax.tree.map(lambda g: g[r], grads), ref_grad)
        assert err <= 1e-5, f"replica {r}'s gradient {where} differs by {err:.2e}"
    losses, params = _run(config, jax.devices())
    err, where = max_leaf_rel_err(params, ref_params)
    print(f"worst parameter {where} {err:.2e}")
    assert err <= 1e-5, f"parameter {where} differs by {err:.2e}"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def _crossing(traffic, replica_size):
    """The collectives of `traffic` (`parallax.hlo.collective_traffic`) whose groups join devices of two
    replicas (the replica axis is the outermost: device i is in replica i // replica_size)."""
    return [c for c in traffic if any(len({d // replica_size for d in g}) > 1 for g in c["groups"])]


@pytest.mark.parametrize("model,mesh", [("llama", dict(data=2, tensor=2)), ("llama", dict(data=4)),
                                        ("moe", dict(expert=2, data=2)), ("muon", dict(fsdp=2, data=2)),
                                        ("llama", dict(pipe=2, data=2))],
                         ids=["data=2,tensor=2", "data=4", "moe-expert=2,data=2", "muon-fsdp=2,data=2",
                              "pipe=2,data=2"])
def test_inner_step_never_communicates_across_replicas(model, mesh):
    """The inner step's collectives (data, FSDP, tensor, the expert all-to-alls, Muon's resharding, the
    pipeline's permutes) all stay within a replica: the program of a step without a sync has no crossing
    collective, that of a sync step has; the whole step's crossing ones are the sync's, in its conditional branch."""
    from parallax.hlo import collective_traffic

    config = _diloco(tiny_config("llama" if model == "muon" else model), **mesh)
    if model == "muon":
        config.optim.name = "muon"
    trainer = Trainer(config, devices=jax.devices())
    state = trainer.abstract_state()
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_shardings[k])
             for k, v in make_dataset(trainer.config).batch(0).items()}
    # The programs the training loop runs: a step without a sync (kind -1), and one with (kind 0).
    traffic = collective_traffic(trainer.step_program(-1).lower(state, batch).compile().as_text(), 8)
    if model != "llama" or "tensor" in mesh or "pipe" in mesh:
        assert traffic, "the inner step has the tensor / expert / FSDP collectives of a replica"
    assert [(c["op"], c["arrays"]) for c in _crossing(traffic, 4)] == []
    sync = collective_traffic(trainer.step_program(0).lower(state, batch).compile().as_text(), 8)
    assert _crossing(sync, 4)


@pytest.fixture(scope="module")
def sync_trainers():
    """A DiLoCo trainer per pseudo-gradient dtype (replica 2 x data 2 x tensor 2), with its state and a batch."""
    out = {}
    for dtype in ("float32", "bfloat16", "int8"):
        trainer = Trainer(_diloco(tiny_config(), dtype=dtype, data=2, tensor=2), devices=jax.devices())
        out[dtype] = trainer
    return out


def test_outer_sync_moves_each_parameter_once_in_its_dtype(sync_trainers):
    """fp32: one all-reduce of the parameters' bytes; bf16 half of them; int8 an all-gather of a quarter
    (and a scale per tensor). Bytes one device sends over `replica`, against a ring all-reduce in fp32."""
    from parallax.hlo import collective_traffic

    sent = {}
    for dtype, trainer in sync_trainers.items():
        state = trainer.abstract_state()
        lowered = jax.jit(trainer.path.sync).lower(state["params"], state["diloco"], state["diloco"]["params"])
        crossing = _crossing(collective_traffic(lowered.compile().as_text(), 8), 4)
        sent[dtype] = sum(c["sent"] for c in crossing)
        print(dtype, [(c["op"], c["arrays"][:2]) for c in crossing])
    # XLA:CPU sums bf16 in fp32 (and its promotion pass aborts on some bf16 sums), so on CPU the bf16
    # pseudo-gradients travel in fp32; a plan for a TPU sends bf16 (its lowered program: the sums' dtype).
    tpu = Trainer(make_plan(sync_trainers["bfloat16"].config, 8, "tpu"), devices=jax.devices())
    state = tpu.abstract_state()
    text = jax.jit(tpu.path.sync).lower(state["params"], state["diloco"], state["diloco"]["params"]).as_text()
    sums = re.findall(r"stablehlo\.all_reduce.*?\n\s*\}\)\s*.*?:\s*\((tensor<[^)]*)\)", text, re.S)
    assert len(sums) >= len(jax.tree.leaves(state["params"])), sums
    assert sum("bf16" in s for s in sums) == len(jax.tree.leaves(state["params"])), sums
    sent["bfloat16"] /= 2

    def fp32_ring(trainer):  # a ring all-reduce over 2 replicas of one device's share of the fp32 parameters
        params = trainer.abstract_state()["params"]
        local = sum(np.prod(s.shard_shape(a.shape)) for a, s in zip(jax.tree.leaves(params),
                                                                    jax.tree.leaves(trainer.param_shardings)))
        return 2 * (2 - 1) / 2 * 4 * local
    ring = fp32_ring(trainer)
    print({k: v / ring for k, v in sent.items()})
    # Streaming, 2 fragments: each sync moves its own fragment alone; together, the parameters once (also
    # when a fragment is one pipeline rank's layers: its exchange splits another dim over `pipe`).
    config = _diloco(tiny_config(), every=2, pipe=2, tensor=2)
    config.diloco.fragments = 2
    streaming = Trainer(config, devices=jax.devices())
    state = streaming.abstract_state()
    parts = []
    for f in range(2):
        sync = jax.jit(lambda g, d, x, f=f: streaming.path.sync(g, d, x, f))
        text = sync.lower(state["params"], state["diloco"], state["diloco"]["params"]).compile().as_text()
        parts.append(sum(c["sent"] for c in _crossing(collective_traffic(text, 8), 4)))
    pipelined = fp32_ring(streaming)
    print("fragments", [p / pipelined for p in parts])
    assert all(0 < p < pipelined for p in parts)
    assert pipelined <= sum(parts) <= pipelined * 1.01
    assert ring <= sent["float32"] <= ring * 1.01
    assert ring / 2 <= sent["bfloat16"] <= ring / 2 * 1.01
    assert ring / 4 <= sent["int8"] <= ring / 4 * 1.05


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_exchange_rounds_each_replicas_pseudo_gradient_as_numpy_does(sync_trainers, dtype):
    """The exchange's values against numpy (replica 2 x data 2 x tensor 2, leaves split over tensor): each
    replica's pseudo-gradient plus its carried error, rounded to bf16, or to int8 with an absmax scale of the
    whole tensor (per layer of the stacked blocks; a shard's own maximum would be the easy bug), averaged
    over the replicas; the new errors are what the rounding lost; the squared norm is the replicas' mean."""
    import ml_dtypes

    trainer = sync_trainers[dtype]
    path, state = trainer.path, trainer.init_state()
    glob, inner = jax.device_get(state["params"]), state["diloco"]
    rng = np.random.default_rng(3)
    # per leaf, replica and layer a different magnitude: the scales differ across all three
    noise = lambda x: (rng.normal(size=x.shape) * np.exp(rng.normal(size=x.shape[:2] + (1,) * (x.ndim - 2))) * 1e-2
                       ).astype(np.float32)
    stacked = jax.tree.map(lambda g, a: (g[None] + noise(np.asarray(a))).astype(np.float32), glob,
                           jax.device_get(inner["params"]))
    error = jax.tree.map(lambda a: noise(np.asarray(a)) * 1e-2, jax.device_get(inner["error"]))
    put = lambda tree, like: jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), tree, like)
    mean, new_error, square = jax.device_get(jax.jit(lambda g, s, e: path.mean_pseudo_grad(g, s, e, path.param_specs))(
        state["params"], put(stacked, inner["params"]), put(error, inner["error"])))

    def rounded(x, blocks):
        if dtype == "bfloat16":
            return x.astype(ml_dtypes.bfloat16).astype(np.float32)
        return _int8(x, blocks)
    deltas = [{k: jax.tree.map(lambda g, p, e: g - p[r] + e[r], glob[k], stacked[k], error[k]) for k in glob}
              for r in range(2)]
    arrived = [{k: jax.tree.map(lambda x, k=k: rounded(x, k == "blocks"), v) for k, v in d.items()} for d in deltas]
    assert jax.tree.structure(mean) == jax.tree.structure(glob)  # a value per leaf (zip below would stop short)
    for got, want in zip(jax.tree.leaves(mean), jax.tree.leaves(jax.tree.map(lambda a, b: (a + b) / 2, *arrived))):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)  # a few fp32 ulps of 0.03 (the sum cancels)
    for r in range(2):
        lost = jax.tree.map(np.subtract, deltas[r], arrived[r])
        for got, want in zip(jax.tree.leaves(jax.tree.map(lambda e: e[r], new_error)), jax.tree.leaves(lost)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
    want_square = np.mean([_square_norm(d) for d in deltas])
    np.testing.assert_allclose(float(square), want_square, rtol=1e-5)


def _fragment(tree, f, fragments, layers=2):
    """Fragment f of a params tree (numpy): its layers of `blocks`, and for f = 0 everything else."""
    lo, hi = f * layers // fragments, (f + 1) * layers // fragments
    return {k: (jax.tree.map(lambda x: x[lo:hi], v) if k == "blocks" else v) for k, v in tree.items()
            if k == "blocks" or f == 0}


def _set_fragment(tree, part, f, fragments, layers=2):
    lo = f * layers // fragments
    out = {}
    for k, v in tree.items():
        if k == "blocks":
            out[k] = jax.tree.map(lambda x, y: np.concatenate([x[:lo], y, x[lo + y.shape[0]:]]), v, part[k])
        else:
            out[k] = part[k] if k in part else v
    return out


def _int8(x, per_layer):
    """x's int8 round trip (numpy): absmax scale per layer of a stacked [L, ...] leaf, else per tensor."""
    axes = tuple(range(1, x.ndim)) if per_layer and x.ndim > 1 else None
    scale = np.maximum(np.max(np.abs(x), axis=axes, keepdims=True), 1e-30) / 127.0
    return np.round(x / scale).astype(np.int8).astype(np.float32) * scale


OUTER_METRICS = ("outer_pseudo_grad_norm", "outer_divergence", "outer_fragment")


def _square_norm(tree):
    return float(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("fragments,overlap,dtype,mesh", [
    (1, 0, "float32", dict(data=2, tensor=2)), (2, 0, "float32", dict(data=2, tensor=2)),
    (2, 0, "float32", dict(pipe=2, tensor=2)), (2, 1, "float32", dict(data=2, tensor=2)),
    (1, 0, "int8", dict(data=2, tensor=2))],
    ids=["nesterov", "streaming", "streaming-pipe=2", "streaming-overlap", "int8-error-feedback"])
def test_outer_steps_match_a_reference_loop(fragments, overlap, dtype, mesh):
    """H=4, outer Nesterov SGD (lr 0.7, momentum 0.9), AdamW inside, 7 steps (syncs, then part of an inner
    phase): the global parameters and each replica's equal a loop written here, with one single-device run
    per replica on its own rows and the outer steps in numpy. Streaming: 2 fragments (a layer each, the
    embedding and head with the first) at steps 0 and 2 (mod 4); with overlap the exchange of the
    parameters after step t is applied after step t+1 and mixed half and half into the replicas' (run by the
    programs the training loop picks per kind of step, `Trainer.train_step_at`; the others by the one
    program that decides on the device). int8: each replica's pseudo-gradient plus its carried rounding
    error, rounded to int8 (a scale per layer; the error's carry from one sync to the next, which a tie
    rounded the other way on a last-bit difference would blur here, is checked exactly by
    `test_a_sync_carries_each_replicas_rounding_error_of_its_fragment`). Streaming runs replicas of a 1f1b
    pipeline (a fragment is one pipeline rank's layer). The outer metrics of each step (pseudo-gradient
    norm, the replicas' spread) against numpy's."""
    steps, every, lr, mu, mix = 7, 4, 0.7, 0.9, 0.5
    config = _diloco(tiny_config(), every=every, lr=lr, momentum=mu, dtype=dtype, **mesh)
    config.diloco.update(fragments=fragments, overlap=overlap, mix=mix)
    trainer = Trainer(config, devices=jax.devices())
    data = make_dataset(config)
    state = trainer.init_state()
    switched = trainer.init_state()
    logged = []  # each step's outer metrics (one value per replica, the same on each)
    for step in range(steps):  # overlap: each kind of step its own program, as the training loop runs them
        batch = trainer.device_batch(_batch(data, step))
        state, metrics = (trainer.train_step_at(step) if overlap else trainer.train_step)(state, batch)
        logged.append([float(jax.device_get(metrics["path"][k])[0]) for k in OUTER_METRICS])
        if overlap:  # and the one program that decides on the device (checked against the loop too)
            switched, _ = trainer.train_step(switched, batch)
    runs = [jax.device_get(state)] + ([jax.device_get(switched)] if overlap else [])

    half = tiny_config()
    half.train.global_batch_size //= 2
    ref = Trainer(half, devices=jax.devices()[:1])
    glob = jax.device_get(ref.init_state())["params"]
    replicas = [jax.device_get(ref.init_state()) for _ in range(2)]
    momentum = jax.tree.map(np.zeros_like, glob)
    errors = [jax.tree.map(np.zeros_like, glob) for _ in range(2)]
    offsets = [f * every // fragments for f in range(fragments)]
    want = [[np.nan] * 3 for _ in range(steps)]
    for step in range(steps):
        snapshot = [r["params"] for r in replicas]
        batch = _batch(data, step)
        for r in range(2):
            rows = {k: v[r * 8:(r + 1) * 8] for k, v in batch.items()}
            replicas[r] = jax.device_get(ref.train_step(replicas[r], ref.device_batch(rows))[0])
        point = step if overlap else step + 1
        for f in range(fragments):
            if point == 0 or (point - offsets[f]) % every:
                continue
            sent = snapshot if overlap else [r["params"] for r in replicas]
            g, m = _fragment(glob, f, fragments), _fragment(momentum, f, fragments)
            deltas = [jax.tree.map(lambda g, p: g - p, g, _fragment(p, f, fragments)) for p in sent]
            if dtype == "int8":  # fragments == 1 here: the whole trees
                deltas = [jax.tree.map(np.add, d, e) for d, e in zip(deltas, errors)]
            square = np.mean([_square_norm(d) for d in deltas])  # as sent, before rounding
            if dtype == "int8":
                arrived = [{k: jax.tree.map(lambda x, k=k: _int8(x, k == "blocks"), v) for k, v in d.items()}
                           for d in deltas]
                errors = [jax.tree.map(np.subtract, d, a) for d, a in zip(deltas, arrived)]
                deltas = arrived
            delta = jax.tree.map(lambda a, b: (a + b) / 2, *deltas)
            norm = np.sqrt(_square_norm(delta))  # the replicas' spread: mean |delta_r|^2 - |mean delta|^2
            want[step] = [norm, np.sqrt(max(square - norm ** 2, 0.0)), f]
            m = jax.tree.map(lambda m, d: mu * m + d, m, delta)
            g = jax.tree.map(lambda g, m, d: g - lr * (d + mu * m), g, m, delta)
            glob, momentum = _set_fragment(glob, g, f, fragments), _set_fragment(momentum, m, f, fragments)
            for r in range(2):
                mine = _fragment(replicas[r]["params"], f, fragments)
                mine = jax.tree.map(lambda p, x: mix * p + (1 - mix) * x, mine, g) if overlap else g
                replicas[r] = {**replicas[r], "params": _set_fragment(replicas[r]["params"], mine, f, fragments)}
    np.testing.assert_allclose(logged, want, rtol=1e-5, atol=0)  # NaN where no fragment syncs
    for got in runs:
        err, where = max_leaf_rel_err(got["params"], glob)
        print(f"global parameters: worst {where} {err:.2e}")
        assert err <= 1e-5, f"global parameter {where} differs by {err:.2e}"
        for r in range(2):  # each replica, from its own inner state, mid-phase
            mine = jax.tree.map(lambda a: a[r], got["diloco"]["params"])
            err, where = max_leaf_rel_err(mine, replicas[r]["params"])
            assert err <= 1e-5, f"replica {r}'s parameter {where} differs by {err:.2e}"


def test_a_diloco_run_evaluates_checkpoints_and_resumes_exactly_mid_phase(tmp_path):
    """bf16, int8 pseudo-gradients with error feedback, H=3, replicas of a 1f1b pipeline over FSDP: 4
    steps, then a rerun to 5 (the checkpoint at step 4 is one step into an inner phase) ends where an
    uninterrupted run of 5 steps ends; eval runs on the global parameters, and the outer metrics are logged
    on the sync step."""
    from helpers import read_metrics
    from parallax.train import train_and_evaluate

    def config(steps):
        c = _diloco(tiny_config(), every=3, lr=0.7, momentum=0.9, dtype="int8", fsdp=2, pipe=2)
        c.model.dtype = "bfloat16"
        c.train.update(steps=steps, eval_every=4, checkpoint_every=4, log_every=1)
        c.optim.decay_steps = 5
        return c
    quiet = dict(log=lambda *_: None)
    first = train_and_evaluate(config(4), str(tmp_path / "resumed"), **quiet)
    second = train_and_evaluate(config(5), str(tmp_path / "resumed"), **quiet)
    straight = train_and_evaluate(config(5), str(tmp_path / "straight"), **quiet)
    assert [r["step"] for r in second.history] == [5]
    assert np.isfinite(first.eval_loss) and 0 < first.eval_loss < 10
    for a, b in zip(jax.tree.leaves(jax.device_get(second.state)), jax.tree.leaves(jax.device_get(straight.state))):
        np.testing.assert_array_equal(a, b)
    records = read_metrics(tmp_path / "straight")
    assert [r["step"] for r in records if "outer_pseudo_grad_norm" in r] == [3]
    # the replicas saw different rows for 3 steps: they spread around their mean
    synced = [r for r in records if "outer_divergence" in r]
    assert all(r["outer_pseudo_grad_norm"] > 0 and r["outer_divergence"] > 0 for r in synced)


def test_diloco_config_errors_name_the_fix(tmp_path):
    from parallax.train import train_and_evaluate

    with pytest.raises(ConfigError, match="replica=2 with pipeline.schedule='2bw'.*use pipeline.schedule='1f1b'"):
        steady = _diloco(tiny_config(), pipe=2, data=2)
        steady.pipeline.schedule = "2bw"
        make_plan(steady, 8)
    with pytest.raises(ConfigError, match=r"pipeline.microbatches=4: global_batch_size=12 must be divisible by "
                                          r"data-parallel size 2 \(mesh.replica included\)"):
        small = _diloco(tiny_config(), pipe=2, tensor=2)
        small.train.global_batch_size = 12
        make_plan(small, 8)
    with pytest.raises(ConfigError, match="sync_every=0"):
        make_plan(_diloco(tiny_config(), every=0, data=4), 8)
    with pytest.raises(ConfigError, match="pseudo_grad_dtype='fp8'"):
        make_plan(_diloco(tiny_config(), dtype="fp8", data=4), 8)
    with pytest.raises(ConfigError, match="fragments=3: must divide model.num_layers=2"):
        bad = _diloco(tiny_config(), every=4, data=4)
        bad.diloco.fragments = 3
        make_plan(bad, 8)
    with pytest.raises(ConfigError, match="overlap=2 must be 0 or 1"):
        bad = _diloco(tiny_config(), data=4)
        bad.diloco.overlap = 2
        make_plan(bad, 8)
    bad = tiny_config(data=8)
    bad.sharding.rules.embed = "replica"
    with pytest.raises(ConfigError, match="no rule may name the 'replica' axis"):
        make_plan(bad, 8)
    # a DiLoCo checkpoint resumed without replicas: one line naming what to do
    run = _diloco(tiny_config(), data=4)
    run.train.update(steps=1, eval_every=0, checkpoint_every=1)
    train_and_evaluate(run, str(tmp_path), log=lambda *_: None)
    plain = tiny_config(data=8)
    plain.train.update(steps=2, eval_every=0)
    with pytest.raises(ConfigError, match="holds 2 DiLoCo replicas' states; resume with mesh.replica=2"):
        train_and_evaluate(plain, str(tmp_path), log=lambda *_: None)
    run.train.steps = 2
    run.diloco.pseudo_grad_dtype = "int8"  # its state would need rounding errors the checkpoint lacks
    with pytest.raises(ConfigError, match="diloco.pseudo_grad_dtype='int8'.*resume with diloco.pseudo_grad_dtype="
                                          "'float32'"):
        train_and_evaluate(run, str(tmp_path), log=lambda *_: None)


def test_a_cut_of_a_layer_stack_moves_the_axes_its_dims_no_longer_divide_to_its_largest_free_dim():
    """`_fit_spec` by hand: a fragment's arrays keep the stack's spec where it still divides; an axis (or
    several) of a dim it no longer divides moves, together, to the largest dim nothing splits that they
    divide (not merely the last one); with none, the dim is whole; a spec shorter than the shape is padded."""
    from jax.sharding import PartitionSpec as P

    from parallax.steps.diloco import _fit_spec

    sizes = {"pipe": 2, "fsdp": 2, "tensor": 4}
    cases = [((4, 6, 8), P("pipe", None, "fsdp"), P("pipe", None, "fsdp")),  # fits: unchanged
             ((4, 8), P("pipe"), P("pipe", None)),  # padded to the shape
             ((3, 8, 6), P("pipe", "fsdp", None), P(None, "fsdp", ("pipe",))),  # 3 layers over pipe 2
             ((3, 10, 6, 4), P("pipe"), P(None, ("pipe",), None, None)),  # the largest free dim, not the last
             ((6, 8, 12), P(("pipe", "fsdp"), None, None), P(None, None, ("pipe", "fsdp"))),  # both move: 4 | 12
             ((3, 5, 12), P("pipe", None, "tensor"), P(None, None, "tensor")),  # nowhere to go: whole
             ((3, 12, 9), P("pipe", None, None), P(None, ("pipe",), None)),  # 9 is larger but 2 does not divide it
             ((3, 4, 5), P("tensor", "pipe", None), P(None, "pipe", None))]  # a free dim of 5: not divisible by 4
    for shape, spec, want in cases:
        assert _fit_spec(shape, spec, sizes) == want, (shape, spec)


def test_each_fragment_syncs_at_its_own_steps_and_never_before_the_first_inner_step():
    """`step_kind` against schedules written out by hand: fragment f of F syncs when the parameters it
    exchanges have taken a multiple of H inner steps plus f H / F (the steps after step 0's, with overlap=0;
    the parameters a step starts from, one step later, with overlap=1), never at step 0 with overlap=1."""
    from parallax.steps.diloco import DilocoPath

    for every, fragments, overlap, layers, want in (
            (1, 1, 0, 2, [0, 0, 0, 0]),  # H = 1: after every step, the first included
            (1, 1, 1, 2, [-1, 0, 0, 0]),
            (4, 2, 0, 2, [-1, 1, -1, 0, -1, 1, -1, 0, -1, 1]),
            (4, 2, 1, 2, [-1, -1, 1, -1, 0, -1, 1, -1, 0, -1]),
            (6, 3, 0, 3, [-1, 1, -1, 2, -1, 0, -1, 1, -1, 2, -1, 0]),
            (6, 3, 1, 3, [-1, -1, 1, -1, 2, -1, 0, -1, 1, -1, 2, -1])):
        config = _diloco(tiny_config(), every=every)
        config.diloco.update(fragments=fragments, overlap=overlap)
        config.model.num_layers = layers
        path = DilocoPath(make_plan(config, 2, "cpu"), None)
        assert [path.step_kind(s) for s in range(len(want))] == want, (every, fragments, overlap)


def test_a_sync_carries_each_replicas_rounding_error_of_its_fragment():
    """int8 streaming (2 fragments, a layer each), fragment 1's sync on given replicas' parameters and
    carried errors, against numpy: its pseudo-gradients plus the errors carried in arrive rounded, the
    global layer moves by their mean (outer SGD, lr 1), every replica restarts from it, and each replica's
    new error is what its rounding lost, in that layer only; the other layer, its error and the parameters
    outside the stack stay as they were."""
    config = _diloco(tiny_config(), every=2, dtype="int8", data=2, tensor=2)
    config.diloco.fragments = 2
    trainer = Trainer(config, devices=jax.devices())
    path, state = trainer.path, trainer.init_state()
    glob, inner = jax.device_get(state["params"]), jax.device_get(state["diloco"])
    rng = np.random.default_rng(5)
    noise = lambda x, s: (rng.normal(size=x.shape) * s).astype(np.float32)
    exchanged = jax.tree.map(lambda g, a: (g[None] + noise(a, 1e-2)).astype(np.float32), glob, inner["params"])
    error = jax.tree.map(lambda a: noise(a, 1e-4), inner["error"])
    put = lambda tree, like: jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), tree, like)
    carried = {**state["diloco"], "error": put(error, state["diloco"]["error"])}
    new_glob, out, _ = jax.device_get(jax.jit(lambda g, d, x: path.sync(g, d, x, f=1))(
        state["params"], carried, put(exchanged, state["diloco"]["params"])))
    layer = lambda x: x[1:2]  # fragment 1: the second layer of the stack
    for name in glob["blocks"]:
        g, p, e = glob["blocks"][name], exchanged["blocks"][name], error["blocks"][name]
        deltas = [layer(g) - layer(p[r]) + layer(e[r]) for r in range(2)]
        arrived = [_int8(d, True) for d in deltas]
        want = layer(g) - (arrived[0] + arrived[1]) / 2
        np.testing.assert_allclose(layer(new_glob["blocks"][name]), want, rtol=1e-6, atol=1e-8, err_msg=name)
        np.testing.assert_array_equal(new_glob["blocks"][name][:1], g[:1], err_msg=name)
        for r in range(2):
            np.testing.assert_allclose(layer(out["params"]["blocks"][name][r]), want, rtol=1e-6, atol=1e-8)
            np.testing.assert_allclose(layer(out["error"]["blocks"][name][r]), deltas[r] - arrived[r], rtol=1e-5,
                                       atol=1e-8, err_msg=name)
            np.testing.assert_array_equal(out["error"]["blocks"][name][r][:1], e[r][:1], err_msg=name)
            np.testing.assert_array_equal(out["params"]["blocks"][name][r][:1], inner["params"]["blocks"][name][r][:1])
    for name in glob:  # the embedding, final norm and head sync with fragment 0
        if name != "blocks":
            for got, want in zip(jax.tree.leaves(new_glob[name]), jax.tree.leaves(glob[name])):
                np.testing.assert_array_equal(got, want)
            for got, want in zip(jax.tree.leaves(out["error"][name]), jax.tree.leaves(error[name])):
                np.testing.assert_array_equal(got, want)


def test_the_outer_step_is_sgd_with_momentum_with_or_without_nesterov_on_rounding_without_feedback():
    """int8 without error feedback, outer lr 0.7 and momentum 0.9 with a momentum carried in: the sync
    against numpy, as optax.sgd: m' = 0.9 m + mean, and the step is mean + 0.9 m' (Nesterov) or m'; the
    pseudo-gradients arrive rounded with nothing carried (the state holds no error)."""
    config = _diloco(tiny_config(), lr=0.7, momentum=0.9, dtype="int8", data=2, tensor=2)
    config.diloco.error_feedback = False
    trainer = Trainer(config, devices=jax.devices())
    path, state = trainer.path, trainer.init_state()
    assert "error" not in state["diloco"]
    glob = jax.device_get(state["params"])
    rng = np.random.default_rng(7)
    noise = lambda x, s: (rng.normal(size=x.shape) * s).astype(np.float32)
    exchanged = jax.tree.map(lambda g, a: (g[None] + noise(a, 1e-2)).astype(np.float32), glob,
                             jax.device_get(state["diloco"]["params"]))
    momentum = jax.tree.map(lambda m: noise(m, 1e-2), jax.device_get(state["diloco"]["momentum"]))
    put = lambda tree, like: jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), tree, like)
    inner = {**state["diloco"], "momentum": put(momentum, state["diloco"]["momentum"])}
    deltas = [{k: jax.tree.map(lambda g, p: g - p[r], glob[k], exchanged[k]) for k in glob} for r in range(2)]
    arrived = [{k: jax.tree.map(lambda x, k=k: _int8(x, k == "blocks"), v) for k, v in d.items()} for d in deltas]
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *arrived)
    m = jax.tree.map(lambda m, d: 0.9 * m + d, momentum, mean)
    for nesterov in (True, False):
        path.nesterov = nesterov
        new_glob, out, _ = jax.device_get(jax.jit(lambda g, d, x: path.sync(g, d, x))(
            state["params"], inner, put(exchanged, state["diloco"]["params"])))
        step = jax.tree.map(lambda m, d: d + 0.9 * m, m, mean) if nesterov else m
        want = jax.tree.map(lambda g, s: g - 0.7 * s, glob, step)
        assert "error" not in out
        for got, w in zip(jax.tree.leaves(new_glob), jax.tree.leaves(want)):
            np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-8, err_msg=str(nesterov))
        for got, w in zip(jax.tree.leaves(out["momentum"]), jax.tree.leaves(m)):
            np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-8)
