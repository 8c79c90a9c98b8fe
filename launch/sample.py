"""Generate text from the latest checkpoint in a workdir (on one device, whatever mesh trained it).

    python launch/sample.py --workdir=/tmp/quickstart [--prompt="def main("] [--tokens=200]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from launch.common import cli_main  # noqa: E402


def define_flags():
    flags.DEFINE_string("prompt", "def ", "Text to continue (byte-level models).")
    flags.DEFINE_integer("tokens", 0, "How many tokens to sample (0: the config's train.sample_tokens).")
    flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 is greedy.")


def run(_, FLAGS):
    from parallax.sample import sample_from_workdir

    print(sample_from_workdir(FLAGS.workdir, FLAGS.prompt, FLAGS.tokens, FLAGS.temperature))


run.define_flags = define_flags

if __name__ == "__main__":
    cli_main(run, needs_config=False)
