"""Tensor, sequence and vocabulary parallelism in the trainer: parity with 1 device, and the compiled HLO.

Parity: fp32 loss and every gradient leaf within 1e-5 (relative) of the 1-device model, and 5 training
steps with the same losses, on packed synthetic documents, for each mesh of issue 4. HLO: the layer scan
compiles to one forward and one backward while loop; each holds exactly the collectives the design says
(docs/parallelism.md, "Tensor and sequence parallelism"), and no collective carries full-vocabulary logits.
"""
import math

import jax
import numpy as np
import pytest

from helpers import assert_parity, loss_grads_and_steps, set_rule, tiny_config
from parallax import hlo
from parallax.errors import ConfigError
from parallax.parallel.sequence import usp_degree
from parallax.plan import make_plan
from parallax.train import make_dataset, train_and_evaluate
from parallax.trainer import Trainer

TOL = 1e-5


def _config(attention="dense", kv_heads=2, zero_seq=False, **mesh):
    config = tiny_config(**mesh)
    config.model.attention = attention
    config.model.num_kv_heads = kv_heads
    if zero_seq:  # weights, gradients and optimizer state sharded over fsdp x seq, gathered per layer
        set_rule(config, "embed", ("fsdp", "seq"))
    return config


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(kv_heads):
        if kv_heads not in cache:
            cache[kv_heads] = loss_grads_and_steps(_config(kv_heads=kv_heads), jax.devices()[:1])
        return cache[kv_heads]
    return get


PARITY_MESHES = [
    dict(data=4, tensor=2),
    dict(data=2, tensor=4, kv_heads=4),  # 2 kv heads cannot split 4 ways (see the config error test)
    dict(data=4, seq=2, attention="ulysses"),
    dict(data=4, seq=2, attention="ring"),
    dict(data=2, seq=4, attention="ulysses"),  # 2 kv heads on 4 seq ranks: Ulysses repeats them
    dict(data=2, seq=4, attention="ring"),
    dict(fsdp=2, seq=2, tensor=2, attention="ulysses"),
    dict(fsdp=2, seq=2, tensor=2, attention="ring", zero_seq=True),  # rules embed -> (fsdp, seq)
    dict(data=2, seq=4, attention="allgather"),  # 2 kv heads on 4 seq ranks: no head constraint
    dict(data=2, seq=4, attention="usp"),  # Ulysses over pairs of seq ranks x ring over 2 (auto: 2 kv heads)
]


@pytest.mark.parametrize("mesh", PARITY_MESHES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_loss_grads_and_steps_match_single_device(references, mesh):
    kv_heads = mesh.get("kv_heads", 2)
    config = _config(**mesh)
    if mesh.get("zero_seq"):  # each rank stores 1/(fsdp x seq) of a weight's rows
        assert Trainer(config, devices=jax.devices()).param_shardings["blocks"]["wq"].spec[1] == ("fsdp", "seq")
    assert_parity(loss_grads_and_steps(config, jax.devices()), references(kv_heads), TOL)


# Per layer and step, in the forward and in the backward loop body (the table in docs/parallelism.md).
def _tp(t):
    return {"all-gather": 2, "reduce-scatter": 2} if t > 1 else {}


def _expected(tensor=1, seq=1, attention="dense"):
    fwd = dict(_tp(tensor))
    if attention == "ulysses":
        fwd["all-to-all"] = 2  # q|k|v in, output back; the segment-id gather is loop-invariant (hoisted)
    if attention == "ring":
        fwd["collective-permute"] = seq - 1  # k|v blocks; the ids|positions permutes are hoisted
    if attention == "usp":  # Ulysses within groups of u seq ranks, ring over seq / u groups (the ids are hoisted)
        u = usp_degree(seq, 4 // tensor, 2 // tensor)  # tiny: 4 heads, 2 kv heads
        fwd["all-to-all"], fwd["collective-permute"] = 2, seq // u - 1
    bwd = dict(fwd)  # each collective's transpose is one collective of the same size
    if attention == "allgather":
        fwd["all-gather"] = fwd.get("all-gather", 0) + 1  # k|v; the ids|positions gather is hoisted
        bwd["reduce-scatter"] = bwd.get("reduce-scatter", 0) + 1  # its transpose: the k|v cotangents
    full = dict.fromkeys(hlo.COLLECTIVES, 0)
    return [{**full, **fwd}, {**full, **bwd}]


HLO_MESHES = [
    dict(tensor=2),
    dict(seq=2, attention="ulysses"),
    dict(seq=4, attention="ring"),
    dict(seq=2, tensor=2, attention="ulysses"),
    dict(seq=2, tensor=2, attention="ring"),
    dict(seq=4, attention="allgather"),
    dict(seq=8, attention="usp"),
]


@pytest.mark.parametrize("mesh", HLO_MESHES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_layer_collectives_in_compiled_hlo_match_design(mesh):
    config = _config(**mesh)
    config.model.vocab_size = 128  # a size no other dimension has, to spot logits
    config.model.loss_chunk = 0  # the layer loops only (the chunked loss is checked below)
    n = config.mesh.tensor * config.mesh.seq
    trainer = Trainer(config, devices=jax.devices()[:n])
    batch = trainer.device_batch(make_dataset(config).batch(0))
    params = jax.eval_shape(trainer.init_state)["params"]
    compiled = trainer.loss_and_grads.lower(params, batch).compile()
    found = hlo.loop_body_collectives(compiled)
    print(f"{mesh}: expected {_expected(**{k: v for k, v in mesh.items()})}, found {found}")
    assert found == _expected(**mesh)
    # No collective moves a full-vocabulary logits tensor (nor anything as large as one rank's).
    tokens = config.train.global_batch_size * config.train.seq_len // config.mesh.seq
    m = config.model
    # All-gather attention's k|v of the whole sequence: [2, B, T, K/t, Dh], by design (and here as large).
    kv = (2, config.train.global_batch_size, config.train.seq_len, m.num_kv_heads // config.mesh.tensor,
          m.d_model // m.num_heads)
    for op, shapes in hlo.collective_shapes(compiled):
        for shape in shapes:
            assert not (len(shape) >= 2 and shape[-1] == 128 and math.prod(shape[:-1]) >= 128), (op, shape)
            if mesh.get("attention") == "allgather" and shape == kv and op in ("all-gather", "reduce-scatter"):
                continue
            assert math.prod(shape) < tokens * 128 // config.mesh.tensor, (op, shape)
    if mesh.get("attention") == "allgather":  # the one all-gather per layer is the k|v one
        assert ("all-gather", (kv,)) in hlo.collective_shapes(compiled)


def test_chunked_vocab_parallel_loss_adds_one_loop_each_way_with_per_chunk_collectives():
    """loss_chunk=8 on T=32 with tensor=2: a 4-step loop in the forward and one in the backward. Per chunk the
    forward gathers the stream over `tensor` and all-reduces two per-token statistics (max, sum-exp|target);
    the backward recomputes that and reduce-scatters the stream's gradient. No logits cross ranks."""
    config = _config(tensor=2)
    config.model.update(vocab_size=128, loss_chunk=8)
    trainer = Trainer(config, devices=jax.devices()[:2])
    batch = trainer.device_batch(make_dataset(config).batch(0))
    compiled = trainer.loss_and_grads.lower(jax.eval_shape(trainer.init_state)["params"], batch).compile()
    full = dict.fromkeys(hlo.COLLECTIVES, 0)
    layers = {**full, **_tp(2)}
    loss_fwd = {**full, "all-gather": 1, "all-reduce": 2}
    loss_bwd = {**full, "all-gather": 1, "all-reduce": 2, "reduce-scatter": 1}
    found = hlo.loop_body_collectives(compiled)
    print(found)
    assert sorted(map(str, found)) == sorted(map(str, [layers, layers, loss_fwd, loss_bwd]))
    for op, shapes in hlo.collective_shapes(compiled):
        for shape in shapes:
            assert not (len(shape) >= 2 and shape[-1] == 128 and math.prod(shape[:-1]) >= 128), (op, shape)


@pytest.mark.parametrize("mesh,model,train,match", [
    (dict(tensor=4), {}, {}, "num_kv_heads=2: not divisible by mesh.tensor=4"),
    (dict(seq=4), dict(attention="ring"), dict(seq_len=36), r"ring: seq_len=36 is not divisible by 2\*seq=8"),
    (dict(seq=2), {}, {}, "set attention to 'ulysses', 'allgather' or 'ring'"),
    (dict(seq=2, tensor=4), dict(num_kv_heads=4), dict(seq_len=36), r"mesh.seq\*mesh.tensor=8"),
    (dict(tensor=2, seq=4), dict(attention="ulysses"), {}, "ulysses: num_heads=2 is not divisible"),
    (dict(seq=8), dict(attention="usp", ulysses_degree=8), {}, "ulysses: num_heads=4 is not divisible by 8"),
    (dict(seq=4), dict(attention="usp", ulysses_degree=3), {}, "ulysses_degree=3: usp's Ulysses groups must divide"),
    (dict(seq=4), dict(attention="ring", ulysses_degree=2), {}, "ulysses_degree=2: only attention='usp' uses it"),
], ids=["kv_heads_vs_tensor", "ring_seq_len", "dense_with_seq", "sp_seq_len", "ulysses_heads", "usp_heads",
        "usp_degree_divides_seq", "usp_degree_without_usp"])
def test_bad_parallel_config_raises_one_line_error_naming_the_fix(mesh, model, train, match):
    config = tiny_config(**{"data": 8 // math.prod(mesh.values()), **mesh})
    config.model.update(model)
    config.train.update(train)
    with pytest.raises(ConfigError, match=match) as info:
        make_plan(config, 8)
    assert "\n" not in str(info.value)


def _short_documents(batch, rng):
    """`batch` with each row re-cut into many short documents (2 to 12 tokens), the first starting mid-
    document (its positions do not start at 0), and some rows ending in padding (segment 0, weight 0)."""
    import numpy as np
    seg, pos, w = (np.array(batch[k]) for k in ("segment_ids", "positions", "weights"))
    b, t = seg.shape
    for row in range(b):
        start, doc, offset = 0, 1, int(rng.integers(1, 20))
        end = t - (int(rng.integers(1, 6)) if row % 2 else 0)
        while start < end:
            n = min(int(rng.integers(2, 13)), end - start)
            seg[row, start:start + n], pos[row, start:start + n] = doc, offset + np.arange(n)
            start, doc, offset = start + n, doc + 1, 0
        seg[row, end:], pos[row, end:], w[row, end:] = 0, np.arange(t - end), 0
    return {**batch, "segment_ids": seg, "positions": pos, "weights": w.astype(batch["weights"].dtype)}


def test_balanced_layout_on_rows_of_many_short_documents_matches_single_device(tmp_path):
    """model.seq_layout=balanced (all-gather attention over seq 4): each rank's tokens are pieces of about
    equal causal work, per row. Loss and every gradient as one device, and 3 steps, on rows of many short
    documents; the ranks' work is closer to the mean than zigzag's on the same rows; in bf16 it trains,
    evaluates, checkpoints and resumes."""
    from helpers import bf16_train_eval_resume
    import numpy as np

    from parallax.parallel import sequence

    def config(**mesh):
        c = tiny_config(**mesh)
        c.train.seq_len, c.model.attention_block = 64, 2  # 8 pieces of 2 tokens per rank
        return c
    rng = np.random.default_rng(0)
    one = config()
    batches = [_short_documents(b, rng) for b in (make_dataset(one).batch(i) for i in range(3))]

    def run(config, devices):
        trainer = Trainer(config, devices=devices)
        state = trainer.init_state()
        loss, grads = jax.device_get(trainer.loss_and_grads(state["params"], trainer.device_batch(batches[0])))
        losses = []
        for batch in batches:
            state, metrics = trainer.train_step(state, trainer.device_batch(batch))
            losses.append(float(metrics["loss"]))
        return float(loss), grads, losses
    balanced = config(seq=4, data=2)
    balanced.model.update(attention="allgather", seq_layout="balanced")
    assert_parity(run(balanced, jax.devices()), run(one, jax.devices()[:1]), TOL)

    seg, pos = np.concatenate([b["segment_ids"] for b in batches]), np.concatenate([b["positions"] for b in batches])
    t = seg.shape[1]
    zigzag = sequence.ring_layout(np.broadcast_to(np.arange(t), seg.shape), 4, axis=1)
    spread = {name: sequence.attention_work(seg, pos, order, 4) for name, order in
              [("zigzag", zigzag), ("balanced", sequence.balanced_order(seg, pos, 4, sequence.balanced_chunks(16, 2)))]}
    ratio = {name: work.max() / work.mean() for name, work in spread.items()}
    assert ratio["balanced"] < ratio["zigzag"] and ratio["balanced"] <= 1.10, ratio
    bf16_train_eval_resume(balanced, tmp_path)


def test_balanced_layout_needs_allgather_attention():
    config = _config("ring", data=4, seq=2)
    config.model.seq_layout = "balanced"
    with pytest.raises(ConfigError, match="seq_layout='balanced' with attention='ring'"):
        make_plan(config, 8)


def test_usp_trains_in_bf16_evaluates_and_resumes_with_another_ulysses_degree(tmp_path):
    """usp over seq 4 (auto: Ulysses over pairs x ring over 2) in bf16: trains, evaluates and checkpoints;
    the run resumes as Ulysses over all 4 ranks (`ulysses_degree` may change on resume: the same math)."""
    from helpers import bf16_train_eval_resume
    config = _config("usp", data=2, seq=4)
    assert make_plan(config, 8).parallelism.ulysses == 2
    bf16_train_eval_resume(config, tmp_path)
    config.model.ulysses_degree, config.train.steps = 4, 5
    result = train_and_evaluate(config, str(tmp_path), log=lambda *_: None)
    assert [r["step"] for r in result.history] == [5] and np.isfinite(result.history[-1]["loss"])
