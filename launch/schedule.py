"""Prints a pipeline schedule's timeline, its async bubble and a one-line lockstep summary.

  python launch/schedule.py --schedule=1f1b --stages=4 --microbatches=8 [--virtual=2] \
      [--costs=F=1,B=1,W=1] [--png=FILE]

A bad argument prints one line on stderr and exits with status 2.
"""
import os

from absl import app, flags

from launch.common import plain_cli

from parallax.pipeline.render import render_png, render_summary
from parallax.pipeline.schedule import DEFAULT, KINDS, make_schedule
from parallax.pipeline.simulate import parse_costs

FLAGS = flags.FLAGS
flags.DEFINE_string("schedule", DEFAULT, f"one of {', '.join(KINDS)}")
flags.DEFINE_integer("stages", 4, "pipeline ranks p")
flags.DEFINE_integer("microbatches", 8, "microbatches m")
flags.DEFINE_integer("virtual", 1, f"chunks per rank v ({', '.join(n for n, k in KINDS.items() if k.chunks is None)}; "
                     f"{', '.join(n for n, k in KINDS.items() if k.chunks == 2)} always use 2)")
flags.DEFINE_string("costs", "", "action costs, e.g. F=1,B=1,W=1 (BW defaults to B+W; FB, a dualpipev tick that pairs an F "
                    "and a backward, to F+BW)")
flags.DEFINE_string("png", "", "also write the lockstep timeline to this PNG file")


_fail, _parse_flags = plain_cli("schedule")


def main(argv):
    del argv
    try:
        costs = parse_costs(FLAGS.costs)
    except ValueError as e:
        _fail(f"--costs={FLAGS.costs}: {e}")
    try:
        schedule = make_schedule(FLAGS.schedule, FLAGS.stages, FLAGS.microbatches, FLAGS.virtual)
    except ValueError as e:  # ScheduleError is a ValueError
        _fail(str(e))
    if FLAGS.png and not os.path.isdir(os.path.dirname(os.path.abspath(FLAGS.png))):
        _fail(f"--png={FLAGS.png}: its directory does not exist; create it or write elsewhere")
    if FLAGS.png:
        render_png(schedule, FLAGS.png, costs)
    print(render_summary(schedule, costs))



def cli():
    """The `parallax-schedule` console script (pyproject.toml); also `python launch/schedule.py`."""
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    cli()
