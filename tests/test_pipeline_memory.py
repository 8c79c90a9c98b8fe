"""What the pipeline keeps on a device: stage weights stay where they live (no collective moves the layer
stack), FSDP shards them inside the stages, and each end stage holds only the parameters it reads.

XLA's own figures of the compiled step on 8 simulated devices (`parallax.memory.memory_report`, HLO text).
"""
import math

import jax
import pytest

from helpers import tiny_config
from parallax import hlo
from parallax.steps import PipelinePath
from parallax.memory import memory_report
from parallax.plan import abstract_batch, make_plan
from parallax.trainer import Trainer

D, F, L = 256, 1024, 4  # big weights, small activations: weight memory dominates


def _config(schedule="1f1b", **mesh):
    config = tiny_config(**mesh)
    config.model.update(num_layers=L, d_model=D, d_ff=F, num_heads=4, num_kv_heads=2, vocab_size=64)
    config.train.update(global_batch_size=16, seq_len=16)
    config.pipeline.update(schedule=schedule, microbatches=4)
    return config


def _compiled(config):
    trainer = Trainer(config, devices=jax.devices())
    batch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=trainer.batch_shardings[k])
             for k, a in abstract_batch(config).items()}
    return trainer.loss_and_grads.lower(trainer.abstract_state()["params"], batch).compile()


@pytest.mark.parametrize("schedule,fsdp", [("1f1b", 1), ("1f1b", 2), ("zbv", 2)])
def test_no_collective_moves_the_layer_stack_in_or_out_of_the_pipeline(schedule, fsdp):
    """No collective is larger than one rank's share of one weight (its stages, its FSDP shard): no
    all-gather / all-reduce of the stack. 1f1b places stage s on rank s, so the executor layout is a
    reshape and weights do not move at all; zbv's V placement permutes stages between ranks, which XLA does
    with collective-permutes of one share each (weights in, gradients out)."""
    config = _config(schedule, pipe=2, fsdp=fsdp, data=4 // fsdp)
    stage_share = L * D * F // (2 * fsdp)  # w_gate's elements on one device
    sizes = [(math.prod(s), op, s) for op, shapes in hlo.collective_shapes(_compiled(config)) for s in shapes]
    print(sorted(sizes, reverse=True)[:4])
    assert max(n for n, _, _ in sizes) <= stage_share
    moved = [n for n, op, _ in sizes if op == "collective-permute" and n >= stage_share // 4]
    assert bool(moved) == (schedule == "zbv")


@pytest.mark.slow
def test_fsdp_inside_stages_shrinks_weight_and_optimizer_bytes_linearly():
    reports = {f: memory_report(_config(pipe=2, fsdp=f, data=4 // f), jax.devices()) for f in (1, 2, 4)}
    for f, r in reports.items():
        print(f"fsdp={f}: arguments {r.xla_arguments / 2**20:.1f} MiB, temp {r.xla_temp / 2**20:.1f} MiB, "
              f"peak {r.peak / 2**20:.1f} MiB")
    state = {f: r.xla_arguments for f, r in reports.items()}
    assert state[2] < 0.55 * state[1] and state[4] < 0.55 * state[2]
    # The gathered layer is not kept for the backward, so the step's peak shrinks too.
    assert reports[4].peak < 0.6 * reports[1].peak


@pytest.mark.parametrize("model,first,last", [
    ("llama", {"['embedding']"}, {"['final_norm']", "['head']"}),
    ("gpt2", {"['wte']", "['wpe']"}, {"['wte']", "['lnf_scale']", "['lnf_bias']"}),  # tied: wte in both
])
def test_first_stage_gets_the_embedding_and_last_stage_the_head_only(model, first, last):
    plan = make_plan(tiny_config(model, pipe=2, data=4), 8)
    path = PipelinePath(plan, None)
    assert (path.first_keys, path.last_keys) == (frozenset(first), frozenset(last))


@pytest.mark.parametrize("schedule,pipe", [("1f1b", 4), ("zbv", 2)])
def test_inputs_reach_only_the_rank_that_reads_them(schedule, pipe):
    """Tokens go to the first stage's rank, targets and weights to the last's (zbv: both rank 0); segment
    ids and positions, which every layer reads, to every rank. The routed arrays are stored split over
    `pipe` along the sequence (each device holds T/p of them) and gathered by p - 1 single-pair permutes
    into that rank, once per step: no other collective moves them."""
    import re

    import numpy as np

    from parallax.train import make_dataset

    config = _config(schedule, pipe=pipe, data=8 // pipe)
    config.pipeline.virtual_stages = 2 if schedule == "zbv" else 1
    trainer = Trainer(config, devices=jax.devices())
    assert trainer.path.routed == {"inputs": "first", "targets": "last", "weights": "last"}
    batch = trainer.device_batch(make_dataset(config).batch(0))
    T, m, rows = config.train.seq_len, config.pipeline.microbatches, config.train.global_batch_size // (8 // pipe)
    for key, array in batch.items():
        held = {s.data.shape for s in array.addressable_shards}
        assert held == {(rows, T // pipe if key in ("inputs", "targets", "weights") else T)}, (key, held)
    first, last = (0, pipe - 1) if schedule == "1f1b" else (0, 0)
    rank = {int(d.id): r for r in range(pipe)
            for d in np.take(trainer.mesh.devices, r, axis=trainer.mesh.axis_names.index("pipe")).ravel()}
    text = trainer.train_step.lower(trainer.abstract_state(), {
        k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=trainer.batch_shardings[k])
        for k, a in abstract_batch(config).items()}).compile().as_text()
    piece = f"[{m},{rows // m},{T // pipe}]"
    targets = []
    for line in text.splitlines():
        if piece in line.split("=", 1)[-1].split("(", 1)[0] and "collective-permute(" in line:
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?,", line).group(1)
            targets.append({rank[int(t)] for _, t in re.findall(r"(\d+),(\d+)", pairs)})
        elif re.search(r"s32\[[^\]]*\][^=]*(all-gather|all-reduce|all-to-all)", line):
            raise AssertionError(f"an int input moves by another collective: {line.strip()[:160]}")
    assert sorted(map(sorted, targets)) == sorted([[first]] * (pipe - 1) + [[last]] * 2 * (pipe - 1))


@pytest.mark.parametrize("model", ["llama", "gpt2", "moe"])
def test_which_inputs_are_routed_sees_through_the_chunked_loss(model):
    """What decides the routing is what each part's value depends on: the cross-entropy chunks every
    batch key at seq_len > its chunk (2048 > 1024 here), tokens included, without reading the tokens. MoE
    layers read the weights (their balance statistics count real tokens), so only tokens and targets go."""
    import os

    from helpers import ROOT
    from parallax.defaults import load_config_file

    if model == "moe":
        config = load_config_file(os.path.join(ROOT, "configs", "moe_tiny.py"))
        for axis in config.mesh:
            config.mesh[axis] = 1
        config.mesh.update(pipe=2, data=4)
    else:
        config = tiny_config(model, pipe=2, data=4)
        config.model.num_layers = 4
    config.train.seq_len = 2048
    if model == "gpt2":
        config.model.max_positions = 2048
    config.pipeline.update(schedule="1f1b", microbatches=4)
    plan = make_plan(config, 8)
    routed = PipelinePath(plan, plan.make_mesh(jax.devices())).routed
    want = {"inputs": "first", "targets": "last"} if model == "moe" else \
        {"inputs": "first", "targets": "last", "weights": "last"}
    assert routed == want
