"""The pipelined Llama (every schedule, pipe in {2, 4}, with data / FSDP) equals the 1-device model."""

import os

import jax
import numpy as np
import pytest

from helpers import ROOT, assert_parity, loss_grads_and_steps, set_rule, tiny_config
from parallax.defaults import load_config_file
from parallax.errors import ConfigError
from parallax.plan import abstract_batch, make_plan
from parallax.trainer import Trainer

TOL = 1e-5
LAYERS = 8  # divisible into p * v stages for p in {2, 4}, v in {1, 2}
VIRTUAL = {"interleaved_1f1b": 2, "zbv": 2, "v_half": 2, "v_min": 2, "dualpipev": 2}


def _config(schedule="1f1b", remat=False, **mesh):
    config = tiny_config(**mesh)
    config.model.num_layers = LAYERS
    config.pipeline.update(schedule=schedule, virtual_stages=VIRTUAL.get(schedule, 1), remat=remat,
                           microbatches=4)
    return config


@pytest.fixture(scope="module")
def reference():
    return loss_grads_and_steps(_config(), jax.devices()[:1], steps=5)


# pipe 4 for every schedule; pipe 2 too where a schedule's table changes shape with it (the V placements:
# zbv, v_half, v_min). 1f1b at pipe 2 runs in the vocab-parallel, tensor / seq and MoE cases.
# gpipe: the executor's own parity tests (tests/test_pipeline_executor.py) and its end-to-end runs.
CASES = [(s, p) for s in ("1f1b", "interleaved_1f1b", "zb_h1", "zbv", "v_half", "v_min") for p in (2, 4)
         if p == 4 or s in ("zbv", "v_min")]  # v_half at pipe 2 dropped (CI time, 2026-12-07): its table at pipe
# 4 and the V placement at pipe 2 (zbv, v_min) run


@pytest.mark.slow
@pytest.mark.parametrize("schedule,pipe", CASES, ids=[f"{s}-pipe{p}" for s, p in CASES])
def test_pipelined_loss_grads_and_steps_match_single_device(reference, schedule, pipe):
    assert_parity(loss_grads_and_steps(_config(schedule, pipe=pipe, data=8 // pipe), jax.devices(), 5), reference, TOL)


@pytest.mark.slow
@pytest.mark.parametrize("pipe", [4])  # pipe 2: the tensor / fsdp, uneven, bf16 and MoE cases below
def test_dualpipev_matches_single_device(reference, pipe):
    """DualPipeV (its paired ticks run one action after the other here) needs 2 x pipe microbatches."""
    config = _config("dualpipev", pipe=pipe, data=8 // pipe)
    config.pipeline.microbatches = 2 * pipe
    assert_parity(loss_grads_and_steps(config, jax.devices(), 5), reference, TOL)


# (schedule, pipeline.remat, model.remat). pipeline.remat: a checkpointed layer scan inside the stages
# (each slot keeps the chunk's input). Without it each slot keeps every layer's residuals: with 'offload'
# those are the layer inputs in host memory (typed so: the slot ring, the idle branch's zeros), on XLA:CPU
# the same memory, so the numbers must not change; DualPipeV also overlaps a forward with a backward.
REMAT_CASES = [("1f1b", True, "offload"), ("zbv", True, "full"), ("dualpipev", False, "offload")]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,stage_remat,remat", REMAT_CASES, ids=["-".join(map(str, c)) for c in REMAT_CASES])
def test_pipeline_with_fsdp_and_remat_matches_single_device(reference, schedule, stage_remat, remat):
    config = _config(schedule, remat=stage_remat, data=2, fsdp=2, pipe=2)
    config.model.remat = remat
    if schedule == "dualpipev":
        config.pipeline.microbatches = 4
    assert_parity(loss_grads_and_steps(config, jax.devices(), steps=5), reference, TOL)


@pytest.mark.parametrize("stage_remat", [False, True])
def test_offloaded_layer_inputs_are_host_memory_in_the_pipelined_step(stage_remat):
    """model.remat='offload' is a memory-only feature, invisible on XLA:CPU (its host memory is the device's;
    the lowered program carries no placement): the step's jaxpr is where the suite sees it. Every layer
    input saved for the backward is typed host memory: in the pipeline's slot ring (a buffer of
    microbatch x seq x d_model arrays over the slots and the chunk's layers) without pipeline.remat, in the
    stage's own layer scan with it; nothing in host memory with remat='full'."""
    import re

    from parallax.plan import abstract_batch

    def host_arrays(remat):
        config = _config("1f1b", remat=stage_remat, data=2, fsdp=2, pipe=2)
        config.model.remat = remat
        trainer = Trainer(config, devices=jax.devices())
        batch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=trainer.batch_shardings[k])
                 for k, a in abstract_batch(config).items()}
        text = str(jax.make_jaxpr(trainer.loss_and_grads)(trainer.abstract_params, batch))
        return {tuple(map(int, s.split(","))) for s in re.findall(r"f32<host>\[([\d,]+)\]", text)}, config

    assert host_arrays("full")[0] == set()
    shapes, config = host_arrays("offload")
    rows = config.train.global_batch_size // config.pipeline.microbatches // 4  # a microbatch's rows per rank
    layer_input = (rows, config.train.seq_len, config.model.d_model)
    layers = LAYERS // 2  # per stage
    assert layer_input in {s[-3:] for s in shapes}, shapes
    ring = [s for s in shapes if len(s) == 5 and s[1:] == (layers, *layer_input)]
    assert bool(ring) == (not stage_remat), shapes  # [slots, layers, ...]: the ring only without pipeline.remat


# Tensor / sequence parallelism inside the stages: (schedule, mesh, attention, training steps checked).
# (Dropped for CI time, 2026-12-07: tensor x data, whose tensor path the fsdp x tensor cases run, and allgather
# over seq 4, whose gather the seq x tensor case runs.)
MODEL_PARALLEL_CASES = [
    ("zbv", dict(data=2, seq=2), "ulysses", 5),
    ("1f1b", dict(tensor=2, seq=2), "ulysses", 5),
    ("1f1b", dict(fsdp=2, tensor=2), "dense", 5),
    ("dualpipev", dict(fsdp=2, tensor=2), "dense", 5),
    ("1f1b", dict(seq=2, tensor=2), "allgather", 5),
    ("1f1b", dict(seq=2, data=2), "ring", 5),  # k|v shifted by all-to-alls within a stage (grouped_shift)
    ("zbv", dict(seq=2, tensor=2, zero_seq=True), "ring", 5),  # rules embed -> (fsdp, seq): weights over seq too
    ("1f1b", dict(seq=4), "usp", 5),  # Ulysses over pairs x ring over 2 pairs, the ring's shifts all-to-alls
]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,mesh,attention,steps", MODEL_PARALLEL_CASES,
                         ids=[f"{s}-" + ",".join(f"{k}={v}" for k, v in m.items()) + f"-{a}"
                              for s, m, a, _ in MODEL_PARALLEL_CASES])
def test_pipeline_with_tensor_and_sequence_parallel_stages_matches_single_device(
        reference, schedule, mesh, attention, steps):
    mesh = dict(mesh)
    zero_seq = mesh.pop("zero_seq", False)
    config = _config(schedule, pipe=2, **mesh)
    config.model.attention = attention
    if zero_seq:  # the stages gather each layer's shards over seq as over FSDP
        set_rule(config, "embed", ("fsdp", "seq"))
        assert Trainer(config, devices=jax.devices()).param_shardings["blocks"]["wq"].spec[:2] == ("pipe", "seq")
    assert_parity(loss_grads_and_steps(config, jax.devices(), steps), reference, TOL)


def test_sequence_collectives_inside_stages_stay_within_one_pipeline_rank():
    """usp inside pipeline stages (pipe 2 x seq 4: Ulysses over pairs, ring over 2 pairs) compiles to
    all-to-alls whose groups each lie within one pipeline rank -- the Ulysses pairs and the ring's grouped
    shifts -- and collective-permutes only between pipeline ranks (the executor's hops): no permute
    crosses seq ranks, the one XLA:CPU paired across the stages' switch branches."""
    from parallax import hlo
    from parallax.mesh import AXES

    config = _config("1f1b", pipe=2, seq=4)
    config.model.attention = "usp"
    trainer = Trainer(config, devices=jax.devices())
    batch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=trainer.batch_shardings[k])
             for k, a in abstract_batch(config).items()}
    text = trainer.loss_and_grads.lower(trainer.abstract_params, batch).compile().as_text()
    coords = np.stack(np.unravel_index(np.arange(8), trainer.mesh.devices.shape), axis=-1)  # program id -> coords
    pipe, seq = AXES.index("pipe"), AXES.index("seq")
    groups = {"all-to-all": set(), "collective-permute": set()}
    for c in hlo.collective_traffic(hlo.loop_body_text(text), 8):  # per tick (the batch's layout is made before)
        for group in c["groups"]:
            if len(group) > 1 and c["op"] in groups:
                groups[c["op"]].add(tuple(group))
    for group in groups["all-to-all"]:
        assert len({coords[d][pipe] for d in group}) == 1, f"all-to-all group {group} spans pipeline ranks"
    seq_of = {d: coords[d][seq] for d in range(8)}
    kinds = {tuple(sorted(seq_of[d] for d in g)) for g in groups["all-to-all"]}
    assert {(0, 1), (2, 3)} <= kinds and {(0, 2), (1, 3)} <= kinds, kinds  # Ulysses pairs; the rings
    for pair in groups["collective-permute"]:
        src, dst = (coords[d] for d in pair)
        assert src[pipe] != dst[pipe] and np.delete(src, pipe).tolist() == np.delete(dst, pipe).tolist(), pair


# The head and loss split over the pipe ranks along the vocabulary (pipeline.vocab_parallel): the V
# placement (head on rank 0) and 1F1B's (head on rank p-1), with tensor (vocabulary over pipe x tensor) and FSDP.
VOCAB_CASES = [("1f1b", dict(pipe=2, data=4)), ("zbv", dict(pipe=4, data=2)), ("v_half", dict(pipe=4, data=2)),
               ("1f1b", dict(pipe=2, tensor=2, data=2)), ("zbv", dict(pipe=2, fsdp=2, data=2))]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,mesh", VOCAB_CASES,
                         ids=[f"{s}-" + ",".join(f"{k}={v}" for k, v in m.items()) for s, m in VOCAB_CASES])
def test_vocab_parallel_head_matches_single_device(reference, schedule, mesh):
    config = _config(schedule, **mesh)
    config.pipeline.vocab_parallel = True
    assert make_plan(config, 8).rules["vocab"][0] == "pipe"  # stored as the executor reads it
    assert_parity(loss_grads_and_steps(config, jax.devices(), 5), reference, TOL)


@pytest.mark.parametrize("schedule", ["v_min"])  # dualpipev's (51 s) dropped for CI time: its pairs run in fp32 above
def test_v_schedules_train_in_bf16_evaluate_and_resume(tmp_path, schedule):
    from helpers import bf16_train_eval_resume
    bf16_train_eval_resume(_config(schedule, pipe=2, data=4), tmp_path)


@pytest.fixture(scope="module")
def reference7():
    config = _config()
    config.model.num_layers = 7
    return loss_grads_and_steps(config, jax.devices()[:1], steps=5)


# Uneven layouts of 7 layers: explicit on 2 stages, `auto` on 4 (1F1B) and on the 4 stages of 2 ranks of zbv
# (dualpipev places its chunks as zbv does; with unequal chunks its pairs run one after the other, the two
# branches `tick` runs -- dropped for CI time, 2026-12-04).
UNEVEN_CASES = [("1f1b", 2, "3,4"), ("1f1b", 4, "auto"), ("zbv", 2, "1,3,2,1")]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,pipe,layout", UNEVEN_CASES, ids=[f"{s}-pipe{p}-{l}" for s, p, l in UNEVEN_CASES])
def test_uneven_layout_matches_single_device(reference7, schedule, pipe, layout):
    config = _config(schedule, pipe=pipe, data=8 // pipe)
    config.model.num_layers, config.pipeline.layout = 7, layout
    plan = make_plan(config, 8)
    assert plan.rules["layers"] is None  # 7 layers: the stack is stored whole over `pipe`
    assert len(set(plan.schedule.layers)) > 1 and sum(plan.schedule.layers) == 7, plan.schedule.layers
    assert_parity(loss_grads_and_steps(config, jax.devices(), 5), reference7, TOL)


def test_rank_balance_counts_every_layer_once_and_auto_evens_the_flops():
    """`rank_balance` (plan.py's per-rank table): FLOPs over ranks = 3 x batch x (layers + embedding + head),
    parameters over ranks = the model's; here `auto` (the shortest simulated step) gives the head's rank fewer
    layers, and a smaller spread of FLOPs."""
    from parallax.steps.pipeline import rank_balance
    ratios = {}
    for layout in ("even", "auto"):
        config = _config("1f1b", pipe=4, data=2)
        config.model.update(num_layers=8, vocab_size=2048)  # a head of about 1.4 layers' FLOPs
        config.pipeline.layout = layout
        plan = make_plan(config, 8)
        rows, flops = rank_balance(plan), plan.parts.flops(plan.remat)
        total = 3 * config.train.global_batch_size * (8 * flops["layer"] + flops["embed"] + flops["loss"])
        assert abs(sum(r["flops"] for r in rows) / total - 1) < 1e-9
        size = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(plan.abstract_params))
        assert sum(r["params"] for r in rows) == size  # untied: embedding and head each on one rank
        ratios[layout] = max(r["flops"] for r in rows) / min(r["flops"] for r in rows)
        if layout == "auto":
            assert rows[-1]["layers"] < rows[1]["layers"], rows
    assert ratios["auto"] < ratios["even"], ratios


def test_a_run_resumes_with_another_layout(tmp_path):
    """Checkpoints hold the stacked layers and the whole head, whatever the layout: 2 steps with one layout
    and the vocabulary-parallel head, 2 more resumed with another layout and without it, give the losses of 4
    steps uninterrupted; `auto` with the vocabulary-parallel head in bf16 evaluates and resumes."""
    from helpers import bf16_train_eval_resume
    from parallax.train import train_and_evaluate

    def run(layout, steps, workdir, vocab_parallel=False):
        config = _config("1f1b", pipe=2, data=4)
        config.pipeline.update(layout=layout, vocab_parallel=vocab_parallel)
        config.train.update(steps=steps, eval_every=0, checkpoint_every=2, log_every=1)
        config.optim.decay_steps = 4
        return [r["loss"] for r in train_and_evaluate(config, str(workdir), log=lambda *_: None).history]
    whole = run("even", 4, tmp_path / "whole")
    first, second = run("3,5", 2, tmp_path / "split", vocab_parallel=True), run("6,2", 4, tmp_path / "split")
    np.testing.assert_allclose(first + second, whole, rtol=TOL)
    config = _config("1f1b", pipe=4, data=2)
    config.model.num_layers = 7
    config.pipeline.update(layout="auto", vocab_parallel=True)
    bf16_train_eval_resume(config, tmp_path / "bf16")


@pytest.mark.parametrize("change,expected", [
    (dict(model=dict(num_layers=6)), "num_layers=6: not divisible into 4 pipeline stages"),
    (dict(pipeline=dict(layout="3,3")), "config.pipeline.layout='3,3': give 'even', 'auto' or 4 layer counts"),
    (dict(pipeline=dict(layout="2,2,2,1")), "summing to model.num_layers=8, e.g. '2,2,2,2'"),
    (dict(pipeline=dict(vocab_parallel=True), model=dict(vocab_size=66)), "pad the vocabulary to 68"),
    (dict(pipeline=dict(vocab_parallel=True, schedule="2bw")), "runs with the flushing schedules and one replica"),
    (dict(pipeline=dict(schedule="interleaved_1f1b", virtual_stages=2, microbatches=2)), "set microbatches=4"),
    (dict(pipeline=dict(schedule="pipedream")), "unknown schedule 'pipedream'"),
    (dict(pipeline=dict(microbatches=3)), "pipeline.microbatches=3"),
    (dict(train=dict(microbatches=2)), "set train.microbatches=1"),
], ids=["layers", "layout-stages", "layout-sum", "vocab-size", "vocab-2bw", "interleaved-m", "unknown", "batch", "accumulation"])
def test_bad_pipeline_config_names_the_fix(change, expected):
    config = _config("1f1b", pipe=4, data=2)
    for section, values in change.items():
        config[section].update(values)
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(")) as info:
        make_plan(config, 8)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("mesh", [dict(pipe=2, tensor=2, fsdp=2), dict(pipe=2, seq=2, data=2)],
                         ids=["pipe=2,tensor=2,fsdp=2", "pipe=2,seq=2,data=2"])
def test_zero_bubble_schedules_do_the_matmul_work_of_1f1b_on_llama(mesh):
    """The trained model's step (the Llama blocks' split backward, with tensor / FSDP collectives, remat
    policy and Ulysses inside): zb_h1 and zbv count the same matmul FLOPs as 1F1B, within 5%."""
    from parallax.pipeline import work
    from parallax.pipeline.program import compile_schedule
    flops = {}
    for schedule in ("1f1b", "zb_h1", "zbv"):
        config = _config(schedule, **mesh)
        config.model.attention = "ulysses" if mesh.get("seq") else "dense"
        trainer = Trainer(config, devices=jax.devices())
        batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract_batch(config))
        jaxpr = jax.make_jaxpr(trainer._loss_and_grads)(trainer.abstract_params, batch)
        flops[schedule] = work.step_flops(jaxpr, compile_schedule(trainer.plan.schedule))
    print({s: f["total"] for s, f in flops.items()})
    for schedule in ("zb_h1", "zbv"):
        assert abs(flops[schedule]["total"] / flops["1f1b"]["total"] - 1) <= 0.05, flops
        assert flops[schedule]["W"] > 0 and flops[schedule]["B"] > 0


def test_vocab_parallel_refusal_names_every_obstacle_of_the_model_at_plan_time():
    """GPT-2 ties its head to its embedding and adds a table of positions: the plan (not the step path, after
    compiling began) refuses `pipeline.vocab_parallel` naming both."""
    config = load_config_file(os.path.join(ROOT, "configs", "gpt2_tiny.py"))
    config.mesh.update(pipe=2, data=4)
    config.pipeline.update(vocab_parallel=True, microbatches=2)
    with pytest.raises(ConfigError, match=r"vocab_parallel=True: .*untied head; its embedding reads "
                                          r"\['wpe'\] besides a lookup table .*set pipeline.vocab_parallel=False"):
        make_plan(config, 8)
