"""Shared flag handling for the launch scripts: --config, strict --config.* overrides, --workdir,
--cpu_devices, and the exit-status contract (2 for a config error, with one line on stderr)."""

import sys

from absl import app, flags


def cli_main(run, needs_config):
    """Parses flags (config overrides strictly), then calls `run(config_or_None, FLAGS)`.

    `needs_config="optional"`: the command builds its config itself (e.g. from a checkpoint's), so `run`
    gets `(path_or_None, overrides)` in place of the config, and applies the overrides with the same rules."""
    from parallax.config import ConfigError, split_overrides

    try:
        argv, overrides = split_overrides(sys.argv)
    except ConfigError as e:
        _config_exit(e)
    flags.DEFINE_string("config", None, "Path to a config file with get_config().")
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics.jsonl and config.json.")
    flags.DEFINE_integer("cpu_devices", 0, "Simulate this many CPU devices (before jax starts).")
    flags.DEFINE_string("coordinator", None, "host:port of process 0, for a multi-process (multi-host) run.")
    flags.DEFINE_integer("num_processes", 1, "Processes in a multi-process run.")
    flags.DEFINE_integer("process_id", 0, "This process's id in a multi-process run.")
    extra_flags = getattr(run, "define_flags", None)
    if extra_flags:
        extra_flags()

    def main(_):
        from absl import logging

        logging.set_verbosity(logging.WARNING)  # keep orbax's and jax's INFO chatter out of the progress display
        from parallax.mesh import simulate_cpu_devices

        if flags.FLAGS.cpu_devices:
            simulate_cpu_devices(flags.FLAGS.cpu_devices)
        if flags.FLAGS.coordinator:
            from parallax.mesh import initialize_distributed

            initialize_distributed(flags.FLAGS.coordinator, flags.FLAGS.num_processes, flags.FLAGS.process_id)
        if not flags.FLAGS.workdir:
            _config_exit(ConfigError("--workdir is required, e.g. --workdir=/tmp/run1"))
        config = None
        if needs_config == "optional":
            config = (flags.FLAGS.config, overrides)
        elif needs_config:
            if not flags.FLAGS.config:
                _config_exit(ConfigError("--config is required, e.g. --config=configs/quickstart.py"))
            from parallax.config import config_from_args
            try:
                config = config_from_args(flags.FLAGS.config, overrides)
            except ConfigError as e:
                _config_exit(e)
        elif overrides:
            _config_exit(ConfigError("--config.* overrides are not used by this command"))
        try:
            run(config, flags.FLAGS)
        except ConfigError as e:
            _config_exit(e)

    app.run(main, argv=argv)


def _config_exit(error):
    print(f"config error: {error}", file=sys.stderr)
    sys.exit(2)
