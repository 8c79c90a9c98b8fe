"""Train a model from a config file.

    python launch/train.py --config=configs/quickstart.py --workdir=/tmp/quickstart [--cpu_devices=8] \
        [--config.train.steps=100 --config.mesh.fsdp=2 ...]

Rerunning the same command with the same workdir resumes from the latest checkpoint. A config error exits
with status 2 and one line naming the key, the value and what would be valid; a non-finite loss exits 1
with one line; SIGTERM saves a checkpoint and exits 143, and so does Ctrl-C (SIGINT), exiting 130 (a second
Ctrl-C stops at once without saving, also exit 130 with one line).
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.common import cli_main  # noqa: E402


def run(config, flags):
    from parallax.train import TrainingError, train_and_evaluate

    try:
        result = train_and_evaluate(config, flags.workdir)
    except TrainingError as e:
        print(f"training stopped: {e}", file=sys.stderr)
        sys.exit(1)
    if result.preempted:  # 128 + the signal (SIGTERM, or a preemption notice: 143; Ctrl-C: 130): the
        sys.exit(128 + (result.stop_signal or signal.SIGTERM))  # scheduler sees an interrupted job, a rerun resumes


if __name__ == "__main__":
    cli_main(run, needs_config=True)
