"""Benchmarks (not tests): step time and tokens/s per mesh, and pipeline schedules' compiled memory and time.

    python launch/bench.py --cpu_devices=8 [--part=all|mesh|pipeline] [--steps=5]
    python launch/bench.py --cpu_devices=64 --part=muon   # Newton-Schulz on the 8B / 70B shapes (compile only)

Prints markdown tables. On simulated CPU devices the times measure the program, not a real interconnect;
the memory figures are XLA's own (`compiled.memory_analysis()`, per device); the Muon figures are XLA's
cost analysis and the collectives of the compiled optimizer update, per device.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_integer("cpu_devices", 8, "Simulated CPU devices (0: use the real devices).")
flags.DEFINE_enum("part", "all", ["all", "mesh", "pipeline", "muon"], "Which benchmark to run (all: mesh + pipeline).")
flags.DEFINE_integer("steps", 5, "Timed steps per configuration (after one compile step).")
FLAGS = flags.FLAGS


def _config(**mesh):
    from parallax.defaults import default_config

    config = default_config(model="llama")
    for axis in config.mesh:
        config.mesh[axis] = mesh.pop(axis, 1)
    config.model.update(num_layers=8, d_model=128, num_heads=4, num_kv_heads=2, d_ff=256, vocab_size=256)
    config.train.update(global_batch_size=16, seq_len=128)
    config.data.source = "synthetic"
    for key, value in mesh.items():  # dotted leftovers such as model__attention="ring"
        section, name = key.split("__")
        config[section][name] = value
    return config


def _time_steps(trainer, dataset, steps):
    import time

    import jax

    state = trainer.init_state()
    state, metrics = trainer.train_step(state, trainer.device_batch(dataset.batch(0)))  # compile
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        state, metrics = trainer.train_step(state, trainer.device_batch(dataset.batch(step)))
    jax.block_until_ready(metrics)
    return (time.perf_counter() - start) / steps, float(metrics["loss"])


def bench_meshes(steps):
    from parallax.train import make_dataset
    from parallax.trainer import Trainer

    cases = [("1 device", dict(), 1), ("data=8", dict(data=8), 8), ("fsdp=8", dict(fsdp=8), 8),
             ("data=2 fsdp=4", dict(data=2, fsdp=4), 8), ("data=4 tensor=2", dict(data=4, tensor=2), 8),
             ("data=4 seq=2 ulysses", dict(data=4, seq=2, model__attention="ulysses"), 8),
             ("data=4 seq=2 ring", dict(data=4, seq=2, model__attention="ring"), 8),
             ("data=4 pipe=2 1f1b", dict(data=4, pipe=2), 8)]
    import jax

    print("| mesh | step time (s) | tokens/s | loss after steps |\n|---|---|---|---|")
    for name, mesh, devices in cases:
        config = _config(**mesh)
        trainer = Trainer(config, devices=jax.devices()[:devices])
        dt, loss = _time_steps(trainer, make_dataset(config), steps)
        tokens = config.train.global_batch_size * config.train.seq_len
        print(f"| {name} | {dt:.3f} | {tokens / dt:,.0f} | {loss:.4f} |", flush=True)


def bench_pipeline(steps):
    import math

    import jax

    from parallax.train import make_dataset
    from parallax.trainer import Trainer

    from parallax.paths import SteadyPipelinePath
    from parallax.pipeline import work
    from parallax.pipeline.program import compile_schedule

    print("\n| schedule | p | m | ticks | matmul GFLOP per step (counted per branch) | temp MiB (compiled) |"
          "\n|---|---|---|---|---|---|")
    timed = {}  # schedule -> (trainer, dataset) at m = 8
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "2bw"):
        for m in (8, 16):
            config = _config(data=2, pipe=4)
            config.train.global_batch_size = 2 * m * 2
            config.pipeline.update(schedule=schedule, microbatches=m,
                                   virtual_stages=2 if schedule in ("interleaved_1f1b", "zbv") else 1)
            trainer = Trainer(config, devices=jax.devices()[:8])
            dataset = make_dataset(config)
            state = trainer.init_state()
            batch = trainer.device_batch(dataset.batch(0))
            step = trainer._loss_and_grads
            if isinstance(trainer.path, SteadyPipelinePath):  # 2bw: one window, finishing the previous batch
                def step(state, batch):
                    pipe = state["pipeline"]
                    return trainer.path.window(pipe["previous"], state["params"], pipe["batch"], batch,
                                               pipe["inflight"])
            else:
                state = state["params"]
            compiled = jax.jit(step).lower(state, batch).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
            jaxpr = jax.make_jaxpr(step)(state, batch)
            gflop = work.step_flops(jaxpr, compile_schedule(trainer.plan.schedule))["total"] / 1e9
            held = f"{temp:.2f}"
            if trainer.path.state_keys:  # 2bw: its slots and inbox are arguments (kept in the train state), not temp
                inflight = jax.tree.leaves(state["pipeline"]["inflight"])  # leading dim: the devices
                held += f" + {sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in inflight) / 2**20:.2f} in flight"
            print(f"| {schedule} | 4 | {m} | {trainer.pipeline.num_ticks} | {gflop:.3f} | {held} |", flush=True)
            if m == 8:
                timed[schedule] = trainer, dataset
    _time_interleaved(timed, steps)


def _time_interleaved(timed, steps, rounds=5):
    """Median train-step time per schedule, the schedules taking turns (`rounds` rounds of `steps` steps
    each), so that a slow spell of the machine does not fall on one schedule only."""
    import time

    import jax
    import numpy as np

    states = {}
    for name, (trainer, dataset) in timed.items():  # compile, and one step
        states[name] = trainer.train_step(trainer.init_state(), trainer.device_batch(dataset.batch(0)))
        jax.block_until_ready(states[name])
    times = {name: [] for name in timed}
    for r in range(rounds):
        for name, (trainer, dataset) in timed.items():
            state, _ = states[name]
            for k in range(steps):
                batch = trainer.device_batch(dataset.batch(1 + r * steps + k))
                start = time.perf_counter()
                state, metrics = trainer.train_step(state, batch)
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - start)
            states[name] = state, metrics
    base = float(np.median(times["1f1b"]))
    print(f"\nstep time at m = 8, median of {rounds} x {steps} steps (schedules taking turns):\n"
          "| schedule | step time (s) | / 1f1b |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {np.median(t):.3f} | {np.median(t) / base:.2f} |", flush=True)


def bench_muon():
    """Muon's optimizer update on the real configs' shapes, compiled for their meshes (abstract parameters,
    nothing allocated): XLA partitioning Newton-Schulz on the sharded matrices (plain) vs the stack
    resharded to whole matrices spread over all devices (parallax's)."""
    import math

    import jax

    from parallax import hlo, optim
    from parallax.defaults import load_config_file
    from parallax.trainer import Trainer, _opt_state_shardings

    print("\n| config | devices | Newton-Schulz | FLOPs per device | collectives | bytes moved per device |\n"
          "|---|---|---|---|---|---|")
    for path in ("configs/llama3_8b.py", "configs/llama3_70b.py"):
        config = load_config_file(path)
        config.optim.name = "muon"
        n = 1
        for axis in config.mesh:
            n *= max(int(config.mesh[axis]), 1)
        if n > len(jax.devices()):
            print(f"| {path} | {n} | skipped: run with --cpu_devices={n} | | | |")
            continue
        trainer = Trainer(config, devices=jax.devices()[:n])
        params = trainer.abstract_state()["params"]
        for label, mesh in (("plain", None), ("spread", trainer.mesh)):
            tx = optim.make_optimizer(config.optim, 100, trainer.logical, mesh)
            state = jax.eval_shape(tx.init, params)
            shardings = (trainer.param_shardings, _opt_state_shardings(state, trainer.param_shardings, trainer.mesh),
                         trainer.param_shardings)
            compiled = jax.jit(tx.update, in_shardings=shardings).lower(params, state, params).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            moved = sum(math.prod(shape) * 4 for _, shapes in hlo.collective_shapes(compiled)  # fp32 updates
                        for shape in shapes)
            counts = ", ".join(f"{v} {k}" for k, v in sorted(hlo.count_collectives(compiled).items()) if v)
            print(f"| {os.path.basename(path)} | {n} | {label} | {cost['flops']:.3g} | {counts} | "
                  f"{moved / 2**30:.1f} GiB |", flush=True)


def main(_):
    if FLAGS.cpu_devices:
        from parallax.mesh import simulate_cpu_devices

        simulate_cpu_devices(FLAGS.cpu_devices)
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    import jax

    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices; model: 8 layers, "
          f"d_model 128, batch 16 x 128 tokens (pipeline: 2 rows per microbatch per data shard)\n")
    if FLAGS.part in ("all", "mesh"):
        bench_meshes(FLAGS.steps)
    if FLAGS.part in ("all", "pipeline"):
        bench_pipeline(FLAGS.steps)
    if FLAGS.part == "muon":
        bench_muon()


if __name__ == "__main__":
    app.run(main)
