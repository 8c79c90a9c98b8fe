"""Will a config fit? AOT-compiles the real train step for N simulated devices and prints XLA's per-device
memory beside an analytic estimate; nothing is allocated, no accelerator is needed.

    python launch/plan.py --config=configs/llama3_8b.py [--devices=N] [--hbm_gib=80] [--config.a.b=VALUE ...]

N defaults to the product of the config's mesh sizes (so a config for real hardware spells its mesh out;
with an axis of -1, pass --devices). The last line is `peak_gib=X hbm_gib=Y fits=yes|no`; the exit status
is 0 when it fits, 1 when it does not (with what to change), 2 for a config error.
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from launch.common import _config_exit  # noqa: E402

flags.DEFINE_string("config", None, "Path to a config file with get_config().")
flags.DEFINE_integer("devices", 0, "Devices to plan for (0: the product of the config's mesh sizes).")
flags.DEFINE_float("hbm_gib", 80.0, "Memory per device, GiB (80: an 80 GB GPU; 95: a TPU v5p chip).")
FLAGS = flags.FLAGS


def main(argv, overrides):
    del argv
    from parallax.config import ConfigError, config_from_args

    if not FLAGS.config:
        _config_exit(ConfigError("--config is required, e.g. --config=configs/llama3_8b.py"))
    try:
        config = config_from_args(FLAGS.config, overrides)
    except ConfigError as e:
        _config_exit(e)
    sizes = [int(v) for v in config.mesh.values()]
    devices = FLAGS.devices or (math.prod(sizes) if min(sizes) > 0 else 0)
    if devices <= 0:
        _config_exit(ConfigError(f"config.mesh has an inferred axis (-1): pass --devices=N, or spell every mesh "
                                 f"size out ({dict(config.mesh)})"))
    from parallax.mesh import simulate_cpu_devices

    simulate_cpu_devices(devices)
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    import jax

    from parallax.memory import GIB, advice, memory_report

    try:
        report = memory_report(config, jax.devices()[:devices])
    except ConfigError as e:
        _config_exit(e)
    fits = report.peak <= FLAGS.hbm_gib * GIB
    print(f"{FLAGS.config}: {devices} devices ({jax.devices()[0].platform}, simulated), XLA's memory analysis of "
          f"the compiled train step\n")
    print(report.table())
    if not fits:
        print("\ndoes not fit; try:\n" + "\n".join(f"- {a}" for a in advice(config, report, FLAGS.hbm_gib * GIB)))
    print(f"\npeak_gib={report.peak / GIB:.2f} hbm_gib={FLAGS.hbm_gib:g} fits={'yes' if fits else 'no'}")
    sys.exit(0 if fits else 1)


if __name__ == "__main__":
    from parallax.config import ConfigError, split_overrides

    try:
        argv, overrides = split_overrides(sys.argv)
    except ConfigError as e:
        _config_exit(e)
    app.run(lambda a: main(a, overrides), argv=argv)
