"""Train a model from a config file.

    python launch/train.py --config=configs/quickstart.py --workdir=/tmp/quickstart [--cpu_devices=8] \
        [--config.train.steps=100 --config.mesh.fsdp=2 ...]

Rerunning the same command with the same workdir resumes from the latest checkpoint. A config error exits
with status 2 and one line naming the key, the value and what would be valid; a non-finite loss exits 5
with one line; SIGTERM saves a checkpoint and exits 143, and so does Ctrl-C (SIGINT), exiting 130 (a second
Ctrl-C stops at once without saving, also exit 130 with one line); a lost peer exits 3 and a hang
(train.hang_timeout_s / hang_factor) 4, its stacks in WORKDIR/hang/. The table: docs/checkpoints.md, "Exit
statuses".

    python launch/train.py --config=FILE [--config.a.b=V ...] --print_config[=python|json] > resolved.py
    python launch/train.py --config=FILE [--config.a.b=V ...] --dry_run [--workdir=DIR] [--cpu_devices=8]

--print_config prints the config with every key spelled out, as a config file (python, the default: feed it
back with --config=resolved.py) or as the JSON a run saves in its workdir; --dry_run runs every check a run
makes before its first step (data, plan, shapes, resuming the workdir, compiled memory) and trains and writes
nothing. Every config key, its default and what it means: docs/config-keys.md.
"""

import signal
import sys


from absl import flags as absl_flags

from launch.common import cli_main


def define_flags():
    absl_flags.DEFINE_enum("print_config", None, ["python", "json"], "Print the resolved config (every key, "
                           "defaults included) as a config file or as JSON, and exit; --print_config alone: python.")
    absl_flags.DEFINE_bool("dry_run", False, "Make every check a run makes before its first step (data, plan, "
                           "shapes, resume, compiled memory), print a summary and exit; nothing is written.")


def inspect_only(flags):
    """--print_config and --dry_run need no workdir and join no multi-process run."""
    return bool(flags.print_config or flags.dry_run)


def run(config, flags):
    from parallax.errors import EXIT_NON_FINITE
    from parallax.goodput import process_start_time
    from parallax.train import TrainingError, train_and_evaluate

    if flags.print_config:
        from parallax.defaults import config_source

        command = " ".join(a for a in sys.argv[1:] if not a.startswith("--print_config"))
        print(config_source(config, f"launch/train.py {command}") if flags.print_config == "python"
              else config.to_json_best_effort(indent=2))
        return
    if flags.dry_run:
        from parallax.memory import dry_run

        print(dry_run(config, flags.workdir))
        return

    try:
        result = train_and_evaluate(config, flags.workdir, started=process_start_time())
    except TrainingError as e:
        print(f"training stopped: {e}", file=sys.stderr)
        sys.exit(EXIT_NON_FINITE)
    if result.preempted:  # 128 + the signal (SIGTERM, or a preemption notice: 143; Ctrl-C: 130): the
        sys.exit(128 + (result.stop_signal or signal.SIGTERM))  # scheduler sees an interrupted job, a rerun resumes


run.define_flags, run.inspect_only, run.resumes = define_flags, inspect_only, True


def cli():
    """The `parallax-train` console script (pyproject.toml); also `python launch/train.py`."""
    sys.argv = ["--print_config=python" if a == "--print_config" else a for a in sys.argv]
    cli_main(run, needs_config=True)


if __name__ == "__main__":
    cli()
