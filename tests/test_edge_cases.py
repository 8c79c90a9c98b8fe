"""Numeric edge cases the parity tests never reach, because their logits stay small and their batches tidy:
cross-entropy with logits of magnitude 1e3 (fp32 and bf16) and targets on every vocabulary shard boundary,
attention rows with nothing to attend to, single-token documents, and batches with no weight at all.
References are float64 NumPy, written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from helpers import rel_err, tiny_config
from parallax.parallel import flash, sequence, vocab
from parallax.parallel.manual import Parallelism
from parallax.train import make_dataset
from parallax.trainer import Trainer

VOCAB = 96


def _ce64(logits, targets, weights):
    """float64 loss sum and its gradient w.r.t. the logits (softmax - onehot, weighted)."""
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    p = np.exp(x - m)
    lse = np.log(p.sum(-1)) + m[..., 0]
    picked = np.take_along_axis(x, np.asarray(targets)[..., None], -1)[..., 0]
    w = np.asarray(weights, np.float64)
    grad = p / p.sum(-1, keepdims=True)
    np.put_along_axis(grad, np.asarray(targets)[..., None], np.take_along_axis(grad, np.asarray(targets)[..., None], -1) - 1, -1)
    return float(np.sum(w * (lse - picked))), grad * w[..., None]


def _boundary_targets(t):
    """[2, 4t] targets: the first and last id of every one of the t vocabulary shards, twice over."""
    per = VOCAB // t
    ids = [i for r in range(t) for i in (r * per, r * per + per - 1)]
    row = np.array(ids * 2, np.int32)
    return np.stack([row, row[::-1]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_cross_entropy_with_huge_logits_on_shard_boundaries(t, dtype):
    rng = np.random.default_rng(t)
    targets = _boundary_targets(t)
    logits = jnp.asarray(1e3 * rng.normal(size=(*targets.shape, VOCAB)), dtype)
    # the target is sometimes the largest logit by far, sometimes far below it
    logits = logits.at[0, :, :].add(jnp.asarray(np.eye(VOCAB)[targets[0]] * 2e3, dtype))
    weights = jnp.ones(targets.shape, jnp.float32)
    mesh = jax.make_mesh((t,), ("tensor",), (AxisType.Auto,), devices=jax.devices()[:t])
    fn = jax.shard_map(vocab.vocab_parallel_cross_entropy, mesh=mesh, in_specs=(P(None, None, "tensor"), P(), P()),
                       out_specs=P())
    loss, grad = jax.jit(jax.value_and_grad(fn))(logits, jnp.asarray(targets), weights)
    want, want_grad = _ce64(np.asarray(logits.astype(jnp.float32)), targets, weights)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad, np.float32)).all()
    assert rel_err(loss, want) <= 1e-6
    # bf16 logits get a bf16 gradient: its rounding (2^-8) is the bound there
    assert rel_err(np.asarray(grad, np.float32), want_grad) <= (1e-6 if dtype == "float32" else 4e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunked_dense_cross_entropy_with_huge_logits(dtype):
    """`par.chunked` over sequence chunks (the padded last chunk included) of the dense cross-entropy."""
    rng = np.random.default_rng(7)
    targets = np.concatenate([_boundary_targets(4), _boundary_targets(4)[:, :5]], axis=1)  # T = 21
    logits = jnp.asarray(1e3 * rng.normal(size=(*targets.shape, VOCAB)), dtype)
    weights = jnp.asarray(rng.integers(0, 2, targets.shape), jnp.float32).at[:, 0].set(1)
    par = Parallelism(loss_chunk=4)

    def loss(lg):
        return par.chunked(lambda xc, bc: par.cross_entropy(xc, bc), lg, {"targets": jnp.asarray(targets),
                                                                            "weights": weights})
    got, grad = jax.jit(jax.value_and_grad(loss))(logits)
    want, want_grad = _ce64(np.asarray(logits.astype(jnp.float32)), targets, weights)
    assert rel_err(got, want) <= 1e-6
    assert rel_err(np.asarray(grad, np.float32), want_grad) <= (1e-6 if dtype == "float32" else 4e-3)


def test_attention_rows_with_no_visible_key_are_finite_and_leave_the_others_alone():
    """Queries of a segment absent from the keys (a fully masked row) and single-token documents:
    blockwise == reference on every row that sees a key, finite everywhere (values and gradients), and
    the masked rows' inputs change nothing else."""
    rng = np.random.default_rng(0)
    b, t, h, kh, dh = 2, 24, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, dh)), jnp.float32) for n in (h, kh, kh))
    seg = np.repeat(np.arange(1, t + 1, dtype=np.int32)[None], b, 0)  # every token its own document
    seg[1, 8:16] = 3  # row 1: one document of 8 tokens in the middle
    pos = np.where(seg == 3, np.arange(t) - 8, 0).astype(np.int32)
    q_seg = seg.copy()
    q_seg[:, -4:] = 999  # the last 4 queries of each row belong to no key's document: nothing to attend
    q_seg, seg, pos = map(jnp.asarray, (q_seg, seg, pos))

    def run(fn, q, k, v):
        return fn(q, k, v, q_seg, seg, pos, pos)
    blockwise = lambda *a: flash.blockwise_attention(*a, block=8)
    ref = run(sequence.attention_reference, q, k, v)
    got = run(blockwise, q, k, v)
    assert np.isfinite(np.asarray(got)).all() and np.isfinite(np.asarray(ref)).all()
    seen = np.asarray(q_seg != 999)
    assert rel_err(np.asarray(got)[seen], np.asarray(ref)[seen]) <= 1e-5
    # a single-token document attends to itself only: its output is its own value (GQA: kv head h // 2)
    np.testing.assert_allclose(np.asarray(got)[0, 0], np.repeat(np.asarray(v)[0, 0], h // kh, 0), rtol=1e-5)
    grads = jax.grad(lambda *a: jnp.sum(jnp.where(seen[..., None, None], run(blockwise, *a), 0) ** 2),
                     argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert float(jnp.abs(grads[0][:, -4:]).max()) == 0  # masked queries influence nothing
    q2 = q.at[:, -4:].set(1e4)  # nor do their (huge) values change any other row
    np.testing.assert_array_equal(np.asarray(run(blockwise, q2, k, v))[seen], np.asarray(got)[seen])


@pytest.mark.parametrize("mesh", [dict(data=1), dict(data=2, tensor=2, fsdp=2), dict(pipe=2, data=4)],
                         ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_a_batch_with_no_weight_gives_zero_loss_and_zero_gradients(mesh):
    config = tiny_config(**mesh)
    n = int(np.prod(list(mesh.values())))
    trainer = Trainer(config, devices=jax.devices()[:n])
    batch = make_dataset(config).batch(0)
    batch["weights"] = np.zeros_like(batch["weights"])
    loss, grads = jax.device_get(trainer.loss_and_grads(trainer.init_state()["params"], trainer.device_batch(batch)))
    assert float(loss) == 0.0
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        assert np.all(np.asarray(g) == 0), jax.tree_util.keystr(path)
