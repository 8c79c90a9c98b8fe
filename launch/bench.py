"""Benchmarks (not tests): step time and tokens/s per mesh, and pipeline schedules' compiled memory and time.

    python launch/bench.py --cpu_devices=8 [--part=all|mesh|pipeline] [--steps=5]

Prints markdown tables. On simulated CPU devices the times measure the program, not a real interconnect;
the memory figures are XLA's own (`compiled.memory_analysis()`, per device).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_integer("cpu_devices", 8, "Simulated CPU devices (0: use the real devices).")
flags.DEFINE_enum("part", "all", ["all", "mesh", "pipeline"], "Which benchmark to run.")
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
    import jax

    from parallax.train import make_dataset
    from parallax.trainer import Trainer

    print("\n| schedule | p | m | ticks | temp MiB (compiled) | step time (s) |\n|---|---|---|---|---|---|")
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"):
        for m in (8, 16):
            config = _config(data=2, pipe=4)
            config.train.global_batch_size = 2 * m * 2
            config.pipeline.update(schedule=schedule, microbatches=m,
                                   virtual_stages=2 if schedule in ("interleaved_1f1b", "zbv") else 1)
            trainer = Trainer(config, devices=jax.devices()[:8])
            dataset = make_dataset(config)
            state = trainer.init_state()
            batch = trainer.device_batch(dataset.batch(0))
            compiled = trainer.loss_and_grads.lower(state["params"], batch).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
            dt = f"{_time_steps(trainer, dataset, steps)[0]:.3f}" if m == 8 else "-"  # time one m per schedule
            print(f"| {schedule} | 4 | {m} | {trainer.pipeline.num_ticks} | {temp:.2f} | {dt} |", flush=True)


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


if __name__ == "__main__":
    app.run(main)
