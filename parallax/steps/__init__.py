"""Step paths: how one train / eval step runs the model on a mesh (`base.StepPath` is the interface).

`PATHS` is the one list of them and `make_path` the one place that picks one for a plan: the first whose
`runs(plan)` holds. A new kind of step (DiLoCo's replicas and outer step, `diloco.py`) is a new module
with a `StepPath` subclass and one entry here.
"""
from parallax.steps.base import DensePath, ManualPath, StepPath
from parallax.steps.diloco import DilocoPath
from parallax.steps.pipeline import PipelinePath
from parallax.steps.steady import SteadyPipelinePath

PATHS = (DilocoPath, SteadyPipelinePath, PipelinePath, ManualPath, DensePath)


def make_path(plan, mesh) -> StepPath:
    """The step path `plan` runs, on `mesh` (None: for the static facts alone, e.g. in tests)."""
    return next(cls for cls in PATHS if cls.runs(plan))(plan, mesh)


def check_resume(saved: dict, now: dict) -> None:
    """Every path's rules for resuming a run of flat config `saved` with `now` (`StepPath.check_resume`)."""
    for cls in PATHS:
        cls.check_resume(saved, now)


__all__ = ["PATHS", "DensePath", "DilocoPath", "ManualPath", "PipelinePath", "StepPath", "SteadyPipelinePath",
           "check_resume",
           "make_path"]
