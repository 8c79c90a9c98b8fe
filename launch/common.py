"""Shared flag handling for the launch scripts: --config, strict --config.* overrides, --workdir,
--cpu_devices, and the exit-status contract (2 for a config error, with one line on stderr; 130 for a
Ctrl-C that stops at once, also with one line)."""

import os
import sys

from absl import app, flags


def cli_main(run, needs_config):
    """Parses flags (config overrides strictly), then calls `run(config_or_None, FLAGS)`.

    `needs_config="optional"`: the command builds its config itself (e.g. from a checkpoint's), so `run`
    gets `(path_or_None, overrides)` in place of the config, and applies the overrides with the same rules."""
    from parallax.config import split_overrides
    from parallax.errors import ConfigError

    try:
        argv, overrides = split_overrides(sys.argv)
    except ConfigError as e:
        _config_exit(e)
    flags.DEFINE_string("config", None, "Path to a config file with get_config().")
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics.jsonl and config.json.")
    flags.DEFINE_integer("cpu_devices", 0, "Simulate this many CPU devices (before jax starts).")
    flags.DEFINE_string("coordinator", None, "host:port of process 0, for a multi-process (multi-host) run; "
                        "short for --config.dist.coordinator.")
    flags.DEFINE_integer("num_processes", None, "Processes in a multi-process run (--config.dist.num_processes).")
    flags.DEFINE_integer("process_id", None, "This process's id in a multi-process run (--config.dist.process_id).")
    flags.DEFINE_bool("platform_flags", True, "Set the compiler's overlap flags for this platform (TPU: "
                      "LIBTPU_INIT_ARGS, GPU: XLA_FLAGS) unless the variable already sets them; see "
                      "docs/parallelism.md.")
    for name in ("config", "workdir", "cpu_devices", "coordinator", "num_processes", "process_id", "platform_flags"):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])  # listed by --help, not --helpfull
    extra_flags = getattr(run, "define_flags", None)
    if extra_flags:
        extra_flags()

    def main(argv):
        try:
            _main(argv)
        except KeyboardInterrupt:  # a Ctrl-C the run did not turn into a save (a second one, or too early)
            _interrupted_exit(flags.FLAGS.workdir if getattr(run, "resumes", False) else None)

    def _main(_):
        from absl import logging

        logging.set_verbosity(logging.WARNING)  # keep orbax's and jax's INFO chatter out of the progress display
        from parallax.mesh import simulate_cpu_devices

        if flags.FLAGS.cpu_devices:
            simulate_cpu_devices(flags.FLAGS.cpu_devices)
        elif flags.FLAGS.platform_flags:
            _platform_flags()
        inspect_only = getattr(run, "inspect_only", lambda _: False)(flags.FLAGS)  # e.g. train.py --dry_run
        if not flags.FLAGS.workdir and not inspect_only:
            _config_exit(ConfigError("--workdir is required, e.g. --workdir=/tmp/run1"))
        workdir = flags.FLAGS.workdir
        if workdir and os.path.exists(workdir) and not os.path.isdir(workdir):
            _config_exit(ConfigError(f"--workdir={workdir}: a file, not a directory; pass a directory (a new "
                                     "path is created)"))
        config = None
        if needs_config == "optional":
            config = (flags.FLAGS.config, overrides)
        elif needs_config:
            if not flags.FLAGS.config:
                _config_exit(ConfigError("--config is required, e.g. --config=configs/quickstart.py"))
            from parallax.defaults import config_from_args
            try:
                config = config_from_args(flags.FLAGS.config, overrides)
            except ConfigError as e:
                _config_exit(e)
        elif overrides:
            _config_exit(ConfigError("--config.* overrides are not used by this command"))
        try:
            # After the config (it may name the coordinator), before anything touches the devices.
            if not inspect_only:
                _initialize_distributed(config, flags.FLAGS.workdir)
            try:
                run(config, flags.FLAGS)
            except SystemExit:  # a deliberate stop (e.g. 143 after saving on SIGTERM): not a lost process
                _mark_done()
                raise
            _mark_done()
        except ConfigError as e:
            _config_exit(e)
        except Exception as e:  # noqa: BLE001 -- a lost peer surfaces as whatever the runtime raised
            _peer_exit(e, flags.FLAGS.workdir)

    app.run(main, argv=argv, flags_parser=parse_flags)


def parse_flags(argv):
    """absl's flags parser for a launcher whose errors are config errors: a misspelled or unknown flag, a
    value of the wrong type or a stray argument prints one line (`config error: ...`, naming the flag and
    absl's close match) and exits 2 (absl alone: two lines, exit 1). Pass it to `app.run(main, flags_parser=...)`."""
    return _parse_flags(argv, _config_exit)


def _parse_flags(argv, fail):
    try:
        rest = flags.FLAGS(argv)
    except flags.UnrecognizedFlagError as e:
        from absl.flags import _helpers

        close = _helpers.get_flag_suggestions(e.flagname, list(flags.FLAGS))
        hint = f"; did you mean {' or '.join('--' + c for c in close)}?" if close else ""
        fail(f"--{e.flagname}: unknown flag{hint} (--helpshort lists this command's flags)")
    except flags.Error as e:  # absl's "flag --name=value: why" (a wrong type, a value out of bounds)
        message = " ".join(str(e).split())
        fail(message[len("flag "):] if message.startswith("flag --") else message)
    if len(rest) > 1:
        fail(f"unexpected arguments {rest[1:]}; pass everything as --flag=value")
    return rest


def _platform_flags():
    """`parallax.mesh.apply_platform_flags` for the detected platform, printed (before jax starts)."""
    from parallax.mesh import apply_platform_flags, detect_platform

    platform = detect_platform()
    variable, added = apply_platform_flags(platform)
    if added:
        print(f"platform flags ({platform}): {variable} += {' '.join(added)} (--noplatform_flags: none; set "
              f"{variable} to override one)", flush=True)


def _config_exit(error):
    from parallax.errors import EXIT_BAD_INPUT

    print(f"config error: {error}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def _latest_checkpoint(workdir):
    """The latest step saved under `workdir/checkpoints`, or None (read from the directory names: no jax)."""

    ckpts = os.path.join(workdir or "", "checkpoints")
    steps = [int(n) for n in (os.listdir(ckpts) if os.path.isdir(ckpts) else []) if n.isdigit()]
    return max(steps, default=None)


def _interrupted_exit(workdir):
    """One line and exit 130 (128 + SIGINT) at once: `os._exit`, so no thread (an async save) is waited for.
    `workdir`: a training run's (the line says where a rerun resumes); None for a launcher that does not train."""
    if workdir is None:
        sys.stdout.flush()
        print("interrupted (SIGINT)", file=sys.stderr, flush=True)
        os._exit(130)
    step = _latest_checkpoint(workdir)
    resume = "" if step is None else f"; rerun the same command to resume from the last checkpoint (step {step})"
    sys.stdout.flush()
    print(f"interrupted (SIGINT): stopped at once without saving{resume}", file=sys.stderr, flush=True)
    os._exit(130)


def _mark_done():
    from parallax import distributed

    distributed.mark_done()


def _initialize_distributed(config, workdir):
    """Joins a multi-process run when the flags, `config.dist` or the environment say so (parallax/distributed.py)."""
    import ml_collections

    from parallax import distributed

    dist = ml_collections.ConfigDict(dict(config.dist) if config is not None and "dist" in config
                                     else _default_dist())
    f = flags.FLAGS
    for key, value in (("coordinator", f.coordinator), ("num_processes", f.num_processes),
                       ("process_id", f.process_id)):
        if value is not None:
            dist[key] = value
    if config is not None and "dist" in config:
        config.dist.update(dict(dist))  # what ran is what config.json records
    distributed.initialize(dist, on_lost=lambda process: _peer_exit(
        RuntimeError(f"no heartbeat for config.dist.heartbeat_timeout_s={dist.heartbeat_timeout_s} s"), workdir,
        lost=process))


def _default_dist():
    from parallax.defaults import default_config

    return dict(default_config("llama").dist)


def _peer_exit(error, workdir, lost=None):
    """In a multi-process run, an error of JAX's runtime (a collective or the coordination service failing) means
    a lost peer: one line naming it and the checkpoint a rerun resumes from, exit 3. Anything else, and any
    error of a single-process run, is re-raised as it was."""
    import jax

    from parallax import distributed
    from parallax.errors import EXIT_PEER_LOST

    runtime_error = getattr(jax.errors, "JaxRuntimeError", RuntimeError)
    if lost is None and (not isinstance(error, runtime_error) or jax.process_count() == 1):
        raise error
    print(distributed.lost_peer_line(error, jax.process_index(), jax.process_count(), _latest_checkpoint(workdir),
                                     lost=lost), file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)  # not sys.exit: JAX's shutdown would wait for the lost peer


def plain_cli(program: str):
    """(fail, parse_flags) for a launcher without a config: `fail(message)` prints `program: message` on
    stderr and exits 2; `parse_flags` is absl's flags parser that fails the same way on a bad flag or a
    stray argument (pass it to `app.run(main, flags_parser=...)`)."""
    def fail(message: str):
        print(f"{program}: {message}", file=sys.stderr)
        sys.exit(2)

    return fail, lambda argv: _parse_flags(argv, fail)
