"""Parity of the pipeline executor with single-device `jax.value_and_grad`, its memory and its tick count.

Toy model: embedding (vocab 32, d 16) -> L residual MLP layers (`x + mask * tanh(rms(x) g @ w1) @ w2`,
the mask comes from the microbatch inputs) -> rms norm + linear head + weighted softmax cross-entropy
normalised by the global weight sum.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
import pytest

from helpers import rel_err
from parallax.pipeline import executor, layout, program, work
from parallax.pipeline.executor import StageCall
from parallax.pipeline.schedule import B, BW, F, IDLE, W, make_schedule, unroll

VOCAB, D, FF, T, ROWS, LAYERS, M = 32, 16, 32, 4, 8, 8, 4
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)]


def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def first_fn(fp, mb):
    return fp["emb"][mb["tokens"]]  # (rows, T, D)


def layer_fn(wl, x, mb):
    h = jnp.tanh((rms(x) * wl["g"]) @ wl["w1"]) @ wl["w2"]  # (rows, T, D)
    return x + mb["mask"][..., None].astype(x.dtype) * h


def stage_fn(w, x, mb):  # a chunk of layers as one black box
    return jax.lax.scan(lambda x, wl: (layer_fn(wl, x, mb), None), x, w)[0]


def last_fn(lp, x, mb):
    logits = (rms(x) * lp["g"]) @ lp["head"]  # (rows, T, VOCAB)
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, mb["labels"][..., None], -1)[..., 0]
    return jnp.sum(mb["weight"] * ce)


def make_model(layers=LAYERS, m=M, rows=ROWS, d=D, ff=FF, t=T, seed=0):
    """Params with stacked layers `[L, ...]` and microbatched inputs `[m, rows, t]`."""
    k = jax.random.split(jax.random.key(seed), 8)
    params = {
        "first": {"emb": jax.random.normal(k[0], (VOCAB, d))},
        "layers": {"w1": jax.random.normal(k[1], (layers, d, ff)) / np.sqrt(d),
                   "w2": jax.random.normal(k[2], (layers, ff, d)) / np.sqrt(ff),
                   "g": 1 + 0.1 * jax.random.normal(k[3], (layers, d))},
        "last": {"g": jnp.ones(d), "head": jax.random.normal(k[4], (d, VOCAB)) / np.sqrt(d)},
    }
    weight = jax.random.uniform(k[5], (m, rows, t))
    inputs = {"tokens": jax.random.randint(k[6], (m, rows, t), 0, VOCAB),
              "labels": jax.random.randint(k[7], (m, rows, t), 0, VOCAB),
              "mask": (jax.random.uniform(k[3], (m, rows, t)) > 0.2).astype(jnp.float32),
              "weight": weight / weight.sum()}
    return params, inputs


def reference_loss(params, inputs):
    flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), inputs)  # the whole batch at once
    x = first_fn(params["first"], flat)
    return last_fn(params["last"], stage_fn(params["layers"], x, flat), flat)


@functools.cache
def reference():
    params, inputs = make_model()
    return jax.jit(jax.value_and_grad(reference_loss))(params, inputs)


def pipelined(sched, mesh, remat=False, layered=False):
    """jitted (params with stacked layers, inputs) -> (loss, grads with stacked layers). `layered`: the
    executor gets `layer_fn` (it runs a chunk's layers itself) instead of the chunk's `stage_fn`."""
    fn = {"layer_fn": layer_fn} if layered else {"stage_fn": stage_fn}

    def run(params, inputs):
        staged = {"first": params["first"], "stages": layout.to_pipeline_layout(params["layers"], sched),
                  "last": params["last"]}
        loss, g = executor.pipeline_value_and_grad(
            sched, StageCall(first_fn=first_fn, last_fn=last_fn, mesh=mesh, remat=remat, **fn), staged, inputs)
        return loss, {"first": g["first"], "layers": layout.from_pipeline_layout(g["stages"], sched),
                      "last": g["last"]}
    return jax.jit(run)


def assert_matches_reference(loss, grads):
    ref_loss, ref_grads = reference()
    assert rel_err(loss, ref_loss) <= 1e-5
    errs = jax.tree.map(rel_err, grads, ref_grads)
    worst = max(jax.tree.leaves(errs))
    assert worst <= 1e-5, errs


# The executor gets `layer_fn` (it runs the chunk's layers) or the chunk's `stage_fn` (a black box); the two
# differ in the split backward, so the black box runs at p=4 only for the split schedules.
GRAD_CASES = [(name, v, p, remat, layered) for name, v in SCHEDULES for p in (2, 4) for remat in (False, True)
              for layered in (True, False) if layered or p == 2 or name in ("zb_h1", "zbv")]


@pytest.mark.parametrize("name,v,p,remat,layered", GRAD_CASES, ids=[
    f"{n}-{p}-{'remat' if r else 'stored'}-{'layer_fn' if l else 'stage_fn'}" for n, _, p, r, l in GRAD_CASES])
def test_schedule_grads_match_unpipelined(name, v, p, remat, layered):
    sched = make_schedule(name, p, M, v)
    mesh = jax.make_mesh((8 // p, p), ("data", "pipe"))
    params, inputs = make_model()
    assert_matches_reference(*pipelined(sched, mesh, remat, layered)(params, inputs))


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name,v", SCHEDULES, ids=[n for n, _ in SCHEDULES])
def test_forward_only_program_runs_only_the_forwards_and_gives_the_loss(name, v, p):
    sched = make_schedule(name, p, M, v)
    full, fwd = program.compile_schedule(sched), program.compile_schedule(sched, forward_only=True)
    assert set(fwd.branches) <= {program.Op.IDLE, program.Op.F, program.Op.F_FIRST, program.Op.F_LAST}
    kinds = fwd.code[..., program.Field.BRANCH]  # indices into fwd.branches, where 0 is idle
    assert (kinds != 0).sum() == M * sched.num_stages  # every F once
    assert fwd.num_ticks < full.num_ticks and (kinds != 0).any(axis=1).all()  # no all-idle tick left
    mesh = jax.make_mesh((8 // p, p), ("data", "pipe"))
    params, inputs = make_model()

    @jax.jit
    def loss(params, inputs):
        staged = {"first": params["first"], "stages": layout.to_pipeline_layout(params["layers"], sched),
                  "last": params["last"]}
        return executor.pipeline_loss(sched, StageCall(first_fn=first_fn, stage_fn=stage_fn, last_fn=last_fn, mesh=mesh),
                                      staged, inputs)
    assert rel_err(loss(params, inputs), reference()[0]) <= 1e-5


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zbv", 2)])
def test_grads_match_unpipelined_on_data_fsdp_pipe_mesh(name, v):
    sched = make_schedule(name, 2, M, v)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "pipe"))
    params, inputs = make_model()
    assert_matches_reference(*pipelined(sched, mesh)(params, inputs))


def stage_fn_tensor_parallel(w, x, mb):
    """`stage_fn` with w1 split by columns and w2 by rows over `tensor` (one psum per layer)."""
    def layer(x, wl):
        h = jax.lax.psum(jnp.tanh((rms(x) * wl["g"]) @ wl["w1"]) @ wl["w2"], "tensor")  # (rows, T/s, D)
        return x + mb["mask"][..., None].astype(x.dtype) * h, None
    return jax.lax.scan(layer, x, w)[0]


def last_fn_tensor_parallel(lp, x, mb):
    """`last_fn`, complete on every tensor rank: the executor sums a value only over the axes it varies
    over, and the weights enter the region varying over every manual axis, so the replicated head's loss
    is averaged over `tensor` (as a vocabulary-parallel loss is psummed)."""
    return jax.lax.pmean(last_fn(lp, x, mb), "tensor")


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zbv", 2)])
def test_grads_match_unpipelined_with_tensor_and_seq_manual_axes(name, v):
    """The default suite's executor test of the model axes: stage weights split over `tensor` (with the
    stage's own psum), tokens split over `seq` (summed by the executor), on pipe 2 x tensor 2 x seq 2."""
    sched = make_schedule(name, 2, M, v)
    mesh = jax.make_mesh((2, 2, 2), ("pipe", "tensor", "seq"))
    params, inputs = make_model()

    def run(params, inputs):
        staged = {"first": params["first"], "stages": layout.to_pipeline_layout(params["layers"], sched),
                  "last": params["last"]}
        specs = {"stages": {"w1": P(None, None, "tensor"), "w2": P(None, "tensor", None), "g": P()}}
        loss, g = executor.pipeline_value_and_grad(
            sched, StageCall(first_fn=first_fn, stage_fn=stage_fn_tensor_parallel, last_fn=last_fn_tensor_parallel,
                             mesh=mesh, param_specs=specs, input_spec=P("seq")), staged, inputs)
        return loss, {"first": g["first"], "layers": layout.from_pipeline_layout(g["stages"], sched),
                      "last": g["last"]}
    assert_matches_reference(*jax.jit(run)(params, inputs))


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zbv", 2)])
def test_adam_steps_match_unpipelined_training(name, v):
    sched = make_schedule(name, 2, M, v)
    mesh = jax.make_mesh((4, 2), ("data", "pipe"))
    params, inputs = make_model()
    opt = optax.adam(1e-2)
    grad_fns = {"pipe": pipelined(sched, mesh), "ref": jax.value_and_grad(reference_loss)}
    losses = {}
    for key, grad_fn in grad_fns.items():
        @jax.jit
        def step(params, opt_state):
            loss, grads = grad_fn(params, inputs)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        state = (params, opt.init(params))
        losses[key] = []
        for _ in range(5):
            *state, loss = step(*state)
            losses[key].append(float(loss))
    np.testing.assert_allclose(losses["pipe"], losses["ref"], rtol=1e-5)
    assert losses["ref"][-1] < losses["ref"][0]


def _tick_scan_lengths(jaxpr):
    """Lengths of the scans in the shard_map body that scan over the int32 instruction table (an int32
    [ticks, ...] operand whose leading dim is the scan length; works whatever the scan's param names)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            return [e.params["length"] for e in eqn.params["jaxpr"].eqns if e.primitive.name == "scan"
                    and any(getattr(x.aval, "dtype", None) == jnp.int32 and x.aval.ndim == 3
                            and x.aval.shape[0] == e.params["length"] for x in e.invars)]
    raise AssertionError("no shard_map in the jaxpr")


@pytest.mark.parametrize("name,v,p", [("1f1b", 1, 4), ("zbv", 2, 2)])
def test_scan_runs_schedule_num_ticks(name, v, p):
    sched = make_schedule(name, p, M, v)
    mesh = jax.make_mesh((8 // p, p), ("data", "pipe"))
    params, inputs = make_model()
    staged = {"first": params["first"], "stages": layout.to_pipeline_layout(params["layers"], sched),
              "last": params["last"]}
    jaxpr = jax.make_jaxpr(lambda staged, inputs: executor.pipeline_value_and_grad(
        sched, StageCall(first_fn=first_fn, stage_fn=stage_fn, last_fn=last_fn, mesh=mesh), staged, inputs))(
        staged, inputs)
    assert _tick_scan_lengths(jaxpr.jaxpr) == [sched.num_ticks]
    assert program.compile_schedule(sched).num_ticks == sched.num_ticks


def test_collectives_are_one_ppermute_per_send_pattern_and_one_final_reduction():
    """Each distinct set of sending pairs is one ppermute in the loop, run only on its ticks."""
    sched = make_schedule("zbv", 4, M, 2)
    mesh = jax.make_mesh((2, 4), ("data", "pipe"))
    params, inputs = make_model()
    staged = {"first": params["first"], "stages": layout.to_pipeline_layout(params["layers"], sched),
              "last": params["last"]}
    hlo = jax.jit(lambda staged, inputs: executor.pipeline_value_and_grad(
        sched, StageCall(first_fn=first_fn, stage_fn=stage_fn, last_fn=last_fn, mesh=mesh), staged, inputs)).lower(
        staged, inputs).compile().as_text()
    ops = {}  # computation -> collective op names in it
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            comp = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
        for op in ("all-reduce", "collective-permute", "all-gather", "all-to-all"):
            if re.search(rf"= .*\b{op}(-start)?\(", line):
                ops.setdefault(comp, []).append(op)
    loop_ops = sorted(op for comp, found in ops.items() if comp != "ENTRY" for op in found)
    prog = program.compile_schedule(sched)
    patterns = len(prog.send_patterns("up")[1]) + len(prog.send_patterns("down")[1])
    assert patterns >= 2 and loop_ops == ["collective-permute"] * patterns  # zbv sends both up and down
    assert ops["ENTRY"].count("all-reduce") <= 2  # the gradients and the loss, once, after the loop


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2)])
def test_1f1b_like_buffers_do_not_grow_with_microbatches(name, v):
    sizes = set()
    for m in (8, 16, 32):
        prog = program.compile_schedule(make_schedule(name, 4, m, v))
        sizes.add((prog.inbox_size, prog.num_slots))
    assert len(sizes) == 1, sizes


def test_gpipe_uses_more_temp_memory_per_microbatch_than_1f1b():
    p, rows, d, ff, t = 4, 16, 64, 128, 16
    mesh = jax.make_mesh((2, p), ("data", "pipe"))
    temp = {}
    for name in ("gpipe", "1f1b"):
        for remat in (False, True):
            for m in (8, 16):
                sched = make_schedule(name, p, m)
                params, inputs = make_model(m=m, rows=rows, d=d, ff=ff, t=t)
                compiled = pipelined(sched, mesh, remat).lower(params, inputs).compile()
                temp[name, remat, m] = compiled.memory_analysis().temp_size_in_bytes
    print("\ntemp bytes per device, p=4, rows=16, T=16, d=64, ff=128, 8 layers:")
    for (name, remat, m), b in sorted(temp.items()):
        print(f"  {name:5s} remat={remat!s:5s} m={m:2d}: {b / 2**20:.3f} MiB")
    for remat in (False, True):
        gpipe_growth = temp["gpipe", remat, 16] - temp["gpipe", remat, 8]
        one_f_one_b_growth = temp["1f1b", remat, 16] - temp["1f1b", remat, 8]
        assert gpipe_growth > 0
        assert gpipe_growth > 2 * max(one_f_one_b_growth, 0)


def test_layers_not_divisible_into_stages_raise_with_fix():
    sched = make_schedule("interleaved_1f1b", 2, M, 2)
    params, _ = make_model(layers=6)
    with pytest.raises(ValueError, match=r"6 layers do not split evenly into 4 pipeline stages; "
                                         r"use a layer count divisible by 4 or give pipeline.layout"):
        layout.to_pipeline_layout(params["layers"], sched)


def test_layout_round_trips():
    for name, v in SCHEDULES:
        sched = make_schedule(name, 4, M, v)
        stacked = np.arange(8 * 3).reshape(8, 3)
        staged = layout.to_pipeline_layout(stacked, sched)
        assert staged.shape == (4, v, 8 // (4 * v), 3)
        r, c = sched.rank_of_stage(1)
        np.testing.assert_array_equal(staged[r, c, 0], stacked[8 // (4 * v)])
        np.testing.assert_array_equal(layout.from_pipeline_layout(staged, sched), stacked)


# Uneven layouts (layers per stage, padded to the largest stage; the padding slots skipped under a cond):
# a stage of no layers, a fused and a split backward, stored residuals and remat, two chunks per rank.
UNEVEN_CASES = [("1f1b", 1, 2, (3, 5), False), ("1f1b", 1, 2, (0, 8), True), ("zb_h1", 1, 4, (1, 3, 3, 1), False),
                ("zbv", 2, 2, (1, 3, 3, 1), False), ("zbv", 2, 2, (2, 1, 4, 1), True)]


@pytest.mark.parametrize("name,v,p,layers,remat", UNEVEN_CASES,
                         ids=[f"{n}-{p}-{'-'.join(map(str, l))}{'-remat' if r else ''}" for n, _, p, l, r in UNEVEN_CASES])
def test_uneven_layout_grads_match_unpipelined(name, v, p, layers, remat):
    sched = make_schedule(name, p, M, v).with_layers(layers)
    params, inputs = make_model()
    staged = layout.to_pipeline_layout(params["layers"], sched)
    assert staged["w1"].shape[:3] == (p, v, max(layers))
    np.testing.assert_array_equal(layout.from_pipeline_layout(staged, sched)["w1"], params["layers"]["w1"])
    mesh = jax.make_mesh((8 // p, p), ("data", "pipe"))
    run = pipelined(sched, mesh, remat, layered=True)
    assert " cond[" in str(jax.make_jaxpr(run)(params, inputs))  # padding slots are skipped at run time
    assert_matches_reference(*run(params, inputs))


def test_uneven_layout_must_hold_the_model_layers():
    sched = make_schedule("1f1b", 2, M)
    with pytest.raises(ValueError, match=r"one layer count >= 0 per stage \(2"):
        sched.with_layers((8,))
    with pytest.raises(ValueError, match="holds 7 layers, the model 8; give counts that sum to 8"):
        layout.to_pipeline_layout(make_model()[0]["layers"], sched.with_layers((3, 4)))


def test_bf16_model_accumulates_float32_grads():
    sched = make_schedule("zb_h1", 2, M)
    mesh = jax.make_mesh((4, 2), ("data", "pipe"))
    params, inputs = make_model()
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    loss, grads = pipelined(sched, mesh)(bf16, inputs)
    ref_loss, ref_grads = reference()
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    assert rel_err(loss, ref_loss) <= 2e-2  # bf16 weights and activations vs the fp32 model
    assert max(jax.tree.leaves(jax.tree.map(rel_err, grads, ref_grads))) <= 5e-2


def _step_flops(sched, mesh, layered):
    fn = {"layer_fn": layer_fn} if layered else {"stage_fn": stage_fn}
    params, inputs = make_model()

    def run(params, inputs):
        staged = {"first": params["first"], "stages": layout.to_pipeline_layout(params["layers"], sched),
                  "last": params["last"]}
        return executor.pipeline_value_and_grad(sched, StageCall(first_fn=first_fn, last_fn=last_fn, mesh=mesh, **fn),
                                                staged, inputs)
    return work.step_flops(jax.make_jaxpr(run)(params, inputs), program.compile_schedule(sched))


@pytest.mark.parametrize("p", [2, 4])
def test_split_backward_does_the_work_of_the_fused_one(p):
    """zb_h1 / zbv with `layer_fn`: B + W = BW per stage, so the step's matmul FLOPs equal 1F1B's; the
    black-box chunk's W re-runs the chain of input cotangents (more work: the gap this split closes)."""
    mesh = jax.make_mesh((8 // p, p), ("data", "pipe"))
    base = _step_flops(make_schedule("1f1b", p, M), mesh, True)
    for name, v in (("zb_h1", 1), ("zbv", 2)):
        got = _step_flops(make_schedule(name, p, M, v), mesh, True)
        assert got["total"] == base["total"], (name, got, base)
        assert got["B"] + got["W"] == base["BW"] // v and got["W"] > 0 and got["B"] > 0, (name, got, base)
        opaque = _step_flops(make_schedule(name, p, M, v), mesh, False)
        assert opaque["W"] == base["BW"] // v and opaque["total"] > base["total"], (name, opaque)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name,v", SCHEDULES, ids=[n for n, _ in SCHEDULES])
def test_messages_moved_are_the_ones_the_schedule_uses(name, v, p):
    """The executor's permutes move exactly the messages the schedule consumes on another rank: each
    (sender, receiver) pair of a tick's pattern has a receiver that files the message in its inbox."""
    prog = program.compile_schedule(make_schedule(name, p, 8, v))
    moved = work.messages_moved(prog)
    assert moved["sent"] == moved["needed"] < moved["every_tick"], moved
    for direction, field, shift in (("up", program.Field.FROM_UP, -1), ("down", program.Field.FROM_DOWN, 1)):
        index, patterns = prog.send_patterns(direction)
        for t, i in enumerate(index.tolist()):
            receivers = set(np.flatnonzero(prog.code[t, :, field] >= 0).tolist())
            pairs = set(patterns[i - 1]) if i else set()
            assert {dst for _, dst in pairs} == receivers and all(src == (dst + shift) % p for src, dst in pairs)


def _interpret(prog, sched, forward_only, windows=1):
    """Runs `prog` on symbolic messages, as the executor's tick does: each rank reads its inbox entry
    `_IN`, then its output goes to its own entry `_LOCAL` and, through the up / down `ppermute` pairs, to
    the entries `_FROM_UP` / `_FROM_DOWN` of its neighbours. Checks every read finds the message the action
    needs; returns the actions run and each message's (rank, arrival tick, last read tick).

    A steady program runs `windows` times back to back with its inbox carried over, as training steps run
    it; microbatches are then numbered across steps (step k's are k*m .. k*m+m-1), and the reads of the
    microbatches in flight before the first step (negative numbers, never sent) are not checked."""
    p, last, m = sched.num_ranks, sched.num_stages - 1, sched.num_microbatches
    code = prog.code.copy()
    code[..., program.Field.BRANCH] = np.array(prog.branches)[code[..., program.Field.BRANCH]]
    kinds = {program.Op.F: F, program.Op.F_FIRST: F, program.Op.F_LAST: F, program.Op.B: B, program.Op.B_FIRST: B,
             program.Op.W: W, program.Op.BW: BW, program.Op.BW_FIRST: BW}
    inbox = [{} for _ in range(p)]
    arrived, last_read, ran, carried = {}, {}, [], {"up": set(), "down": set()}
    for t in range(prog.num_ticks * windows):
        k, t_in = divmod(t, prog.num_ticks)
        out = [None] * p
        for r in range(p):
            br, mb, c, slot, src, local, _, _, version = (int(x) for x in code[t_in, r])
            if br == program.Op.IDLE:  # reads nothing; its microbatch / chunk / slot are valid indices (0)
                assert (mb, c, slot, src, local, version) == (0, 0, 0, -1, -1, 0)
                continue
            if prog.steady:  # field mb indexes [previous step's m, this step's m]; version 1: this step's
                assert version == (mb >= m)
                mb += (k - 1) * m
            else:
                assert version == 0
            stage = int(sched.stage_of[r, c])
            kind = kinds[br]  # W has no stage-0 variant: it runs no `first_fn` pullback
            assert (br in (program.Op.F_FIRST, program.Op.B_FIRST, program.Op.BW_FIRST)) == (stage == 0 and kind != W)
            assert (br == program.Op.F_LAST) == (stage == last and kind == F), (t, r)
            ran.append((t, r, kind, mb, c, slot))
            need = ("x", mb, stage) if kind == F else ("g", mb, stage)
            if (kind != F or stage > 0) and mb >= 0:
                assert 0 <= src < prog.inbox_size and inbox[r].get(src) == need, (t, r, src, need, inbox[r])
                last_read[r, need] = t
            elif kind != F or stage > 0:  # sent before the first step: nothing to check but the entry
                assert 0 <= src < prog.inbox_size
            else:
                assert src == -1
            if kind == F:
                out[r] = ("x", mb, stage + 1) if stage < last else None if forward_only else ("g", mb, stage)
            elif kind != W and stage > 0:
                out[r] = ("g", mb, stage - 1)
        for r in range(p):
            writes = [(code[t_in, r, program.Field.LOCAL], r, None)]
            writes += [(code[t_in, r, program.Field.FROM_UP], s, "up") for s, d in prog.up_perm if d == r]
            writes += [(code[t_in, r, program.Field.FROM_DOWN], s, "down") for s, d in prog.down_perm if d == r]
            for e, s, way in writes:
                if e >= 0:
                    if way:
                        carried[way].add((s, r))
                    assert e < prog.inbox_size and out[s] is not None, (t, r, e, s)
                    inbox[r][int(e)] = out[s]
                    arrived[r, out[s]] = t
    return ran, {k: (k[0], arrived[k], last_read.get(k)) for k in arrived}, carried


@pytest.mark.parametrize("forward_only", [False, True])
@pytest.mark.parametrize("name,v,p,m", [(n, v, p, m) for n, v in SCHEDULES for p in (2, 4) for m in (4, 8)
                                        if n != "interleaved_1f1b" or m % p == 0])
def test_compiled_program_delivers_every_message_to_the_entry_its_reader_reads(name, v, p, m, forward_only):
    sched = make_schedule(name, p, m, v)
    prog = program.compile_schedule(sched, forward_only=forward_only)
    table = sched.table
    if forward_only:
        table = np.where(table[..., :1] == F, table, np.array([IDLE, -1, -1, -1], table.dtype))
        table = table[(table[..., 0] != IDLE).any(axis=1)]
        assert (table[..., 0] != IDLE).any(axis=1).all() and prog.num_ticks == len(table)
    assert prog.code.dtype == np.int32 and prog.code.shape == (len(table), p, program.NUM_FIELDS)
    assert program.Op.IDLE in prog.branches and list(prog.branches) == sorted(set(prog.branches))
    assert prog.num_slots == sched.num_slots
    ran, msgs, carried = _interpret(prog, sched, forward_only)
    # every action of the table runs, at its tick and rank, on its microbatch, chunk and slot
    expected = [(int(t), int(r), *(int(x) for x in table[t, r])) for t, r in np.argwhere(table[..., 0] != IDLE)]
    assert sorted(ran) == sorted(expected)
    # the branches used are exactly those of the actions that run
    used = set(np.array(prog.branches)[prog.code[..., program.Field.BRANCH]].ravel().tolist())
    assert set(prog.branches) == used | {program.Op.IDLE}
    # every message is read after it arrives, and only pairs that carry a message are permuted
    assert all(u is not None and u > a for _, a, u in msgs.values())
    assert set(prog.up_perm) == carried["up"] and set(prog.down_perm) == carried["down"]
    assert all(d == (s + 1) % p for s, d in prog.up_perm) and all(d == (s - 1) % p for s, d in prog.down_perm)
    assert list(prog.up_perm) == sorted(prog.up_perm) and list(prog.down_perm) == sorted(prog.down_perm)
    # the inbox is as small as the messages live at once allow (an entry read at tick u is free at its end)
    live = max(sum(a <= t < u for (r, _), (_, a, u) in msgs.items() if r == rank)
               for rank in range(p) for t in range(prog.num_ticks))
    assert prog.inbox_size == max(live, 1 if msgs else 0)


def test_compile_schedule_refuses_a_one_stage_schedule():
    with pytest.raises(ValueError, match=r"^1f1b: the pipeline executor needs at least 2 stages, got 1; "
                                         r"use pipe >= 2 or call jax.value_and_grad directly$"):
        program.compile_schedule(make_schedule("1f1b", 1, 4))


def _edited(sched, **fields):
    return dataclasses.replace(sched, **{k: np.array(v) for k, v in fields.items()})


def test_compile_schedule_refuses_a_message_read_too_early_or_never_or_by_a_far_rank():
    sched = make_schedule("gpipe", 2, 2)
    fix = "; run parallax.pipeline.validate.validate on the schedule and fix what it reports"
    # rank 1's forward of microbatch 0 moved to the tick its input is produced in
    table = sched.table.copy()
    (t,), = np.argwhere((table[:, 1, 0] == F) & (table[:, 1, 1] == 0))
    table[t - 1, 1], table[t, 1] = table[t, 1], [IDLE, -1, -1, -1]
    with pytest.raises(ValueError, match=rf"^gpipe: \('x', 0, 1\) is produced at tick {t - 1} but used at tick "
                                         rf"{t - 1}{re.escape(fix)}$"):
        program.compile_schedule(_edited(sched, table=table))
    # rank 0's backward of microbatch 1 dropped: the cotangent rank 1 sends it is never read
    table = sched.table.copy()
    (t0,), = np.argwhere((table[:, 0, 0] == BW) & (table[:, 0, 1] == 1))
    (t1,), = np.argwhere((table[:, 1, 0] == BW) & (table[:, 1, 1] == 1))
    table[t0, 0] = [IDLE, -1, -1, -1]
    with pytest.raises(ValueError, match=rf"^gpipe: \('g', 1, 0\) is produced at tick {t1} but used at tick -1"
                                         rf"{re.escape(fix)}$"):
        program.compile_schedule(_edited(sched, table=table))
    # stages 1 and 2 of a 4-rank 1f1b swapped between ranks 1 and 2: rank 0 feeds rank 2
    sched = make_schedule("1f1b", 4, 4)
    order = [0, 2, 1, 3]
    with pytest.raises(ValueError, match=r"^1f1b: stage 1 on rank 2 takes input from rank 0, which is not a "
                                         r"neighbour; place consecutive stages on neighbouring ranks$"):
        program.compile_schedule(_edited(sched, table=sched.table[:, order], stage_of=sched.stage_of[order]))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (3, 5), (4, 4), (4, 8)])
def test_steady_program_run_step_after_step_delivers_every_message_and_runs_the_unrolled_schedule(p, m):
    """2bw's program, run 4 times with its inbox carried from step to step, runs exactly the actions of
    the schedule's windows back to back (`unroll`), each read finding its message, also a message sent in
    the step before; version 0 (the previous weights) exactly for the previous step's microbatches."""
    sched = make_schedule("2bw", p, m)
    prog = program.compile_schedule(sched)
    assert prog.steady and prog.num_versions == 2 and prog.num_ticks == 2 * m
    ran, msgs, carried = _interpret(prog, sched, False, windows=4)
    full = unroll(sched, 4)
    expected = [(int(t), int(r), *(int(x) for x in full.table[t, r]))
                for t, r in np.argwhere(full.table[..., 0] != IDLE)]
    assert sorted(a for a in ran if 0 <= a[3] < 3 * m) == sorted(expected)
    assert all(u is not None and u > a for (_, key), (_, a, u) in msgs.items() if 0 <= key[1] < 3 * m)
    assert set(prog.up_perm) == carried["up"] and set(prog.down_perm) == carried["down"]
    with pytest.raises(ValueError, match="2bw: a steady schedule has no forward-only program"):
        program.compile_schedule(sched, forward_only=True)


def _steady_runner(sched, mesh, remat):
    def staged(params):
        return {"first": params["first"], "stages": layout.to_pipeline_layout(params["layers"], sched),
                "last": params["last"]}

    def unstage(g):
        return {"first": g["first"], "layers": layout.from_pipeline_layout(g["stages"], sched), "last": g["last"]}

    def step(previous, params, previous_inputs, inputs, inflight):
        both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), previous_inputs, inputs)
        (lp, gp), (lc, gc), inflight = executor.pipeline_steady_step(
            sched, StageCall(first_fn=first_fn, last_fn=last_fn, layer_fn=layer_fn, mesh=mesh, remat=remat),
            staged(params), staged(previous), both, inflight)
        return (lp, unstage(gp)), (lc, unstage(gc)), inflight
    return jax.jit(step)


@pytest.mark.parametrize("p,remat", [(2, False), (4, False), (4, True)])
def test_steady_step_finishes_each_batch_with_the_weights_its_forwards_used(p, remat):
    """Three 2bw steps with three weight versions: batch k's forwards run in step k with weights k, its last
    backwards in step k+1 with weights k again (`previous`); the two parts sum to `jax.value_and_grad` of
    the unpipelined model at weights k (fp32, 1e-5). Step 0 starts from an empty pipeline."""
    sched = make_schedule("2bw", p, M)
    mesh = jax.make_mesh((8 // p, p), ("data", "pipe"))
    weights = [make_model(seed=s)[0] for s in range(3)]
    batches = [make_model(seed=10 + s)[1] for s in range(3)]
    step = _steady_runner(sched, mesh, remat)
    first = jax.jit(lambda w, b: _steady_runner(sched, mesh, remat).__wrapped__(w, w, b, b, None))
    _, pending, inflight = first(weights[0], batches[0])
    for k in (1, 2):
        done, new, inflight = step(weights[k - 1], weights[k], batches[k - 1], batches[k], inflight)
        loss = pending[0] + done[0]
        grads = jax.tree.map(jnp.add, pending[1], done[1])
        ref_loss, ref_grads = jax.value_and_grad(reference_loss)(weights[k - 1], batches[k - 1])
        assert rel_err(loss, ref_loss) <= 1e-5
        errs = jax.tree.map(rel_err, grads, ref_grads)
        assert max(jax.tree.leaves(errs)) <= 1e-5, errs
        # both steps did part of it: the last backwards of stage 0 run in the next step
        assert rel_err(pending[1]["first"]["emb"], ref_grads["first"]["emb"]) > 1e-2
        assert float(jnp.abs(done[1]["first"]["emb"]).sum()) > 0
        pending = new


_SCHEDULED = '''
%body (p: f32[8]) -> f32[8] {
  %p = f32[8] parameter(0)
  %all-to-all-start = ((f32[8]), f32[8], u32[], u32[]) async-start(%p), calls=%wrapped, metadata={op_name="jit(f)/pair_forward/all_to_all"}
  %fusion.1 = f32[8] fusion(%p), kind=kLoop, calls=%f1, metadata={op_name="jit(f)/pair_backward/transpose(jvp())/mul"}
  %kernel = f32[8] custom-call(%p), custom_call_target="tpu_custom_call", backend_config={"k":
}}, metadata={op_name="jit(f)/pair_backward/splash"}
  %fusion.2 = f32[8] fusion(%p), kind=kLoop, calls=%f2, metadata={op_name="jit(f)/pair_forward/jvp()/add"}
  %all-to-all-done = f32[8] async-done(%all-to-all-start), metadata={op_name="jit(f)/pair_forward/all_to_all"}
  %all-to-all-start.1 = ((f32[8]), f32[8], u32[], u32[]) async-start(%fusion.1), calls=%wrapped.1, metadata={op_name="jit(f)/pair_backward/all_to_all"}
  %all-to-all-done.1 = f32[8] async-done(%all-to-all-start.1), metadata={op_name="jit(f)/pair_backward/all_to_all"}
  %all-gather-start = (f32[8], f32[16]) all-gather-start(%p), dimensions={0}
  %fusion.3 = f32[8] fusion(%p), kind=kLoop, calls=%f3
  %all-gather-done = f32[16] all-gather-done(%all-gather-start)
  ROOT %out = f32[8] add(%all-to-all-done, %all-to-all-done.1)
}
'''


def test_collective_windows_count_the_other_lanes_compute_between_start_and_done():
    """`hlo.collective_windows` on a scheduled body: the forward's all-to-all encloses two fusions and a kernel
    printed over two lines (its op name on the second), two of them the backward's; the backward's encloses
    nothing; the all-gather is another op."""
    from parallax import hlo
    assert hlo.collective_windows(_SCHEDULED) == [
        {"computation": "body", "lane": 0, "compute": 3, "other": 2},
        {"computation": "body", "lane": 1, "compute": 0, "other": 0}]
    assert [w["compute"] for w in hlo.collective_windows(_SCHEDULED, op="all-gather")] == [1]
