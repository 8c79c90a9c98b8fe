"""Orbax checkpoints: async saves every N steps, keep the latest N, exact resume.

A checkpoint holds the whole train state (params, optimizer state, step); the data position is the step
itself, because a batch is a pure function of (seed, step). Orbax writes to a temporary directory and
renames it when complete, so a half-written checkpoint is never listed or restored. Restoring takes the
target shardings from an abstract state, so the arrays land directly on the current mesh.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_managers import preservation_policy, save_decision_policy


class Checkpointer:
    """Thin wrapper around `ocp.CheckpointManager` for one workdir."""

    def __init__(self, directory, every: int, keep: int, async_save: bool = True):
        if "://" not in str(directory):  # Orbax wants absolute local paths; gs:// and other URLs stay as they are
            directory = os.path.abspath(directory)
        self.directory = epath.Path(directory)
        self.every = int(every)
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=save_decision_policy.FixedIntervalPolicy(max(self.every, 1)),
            preservation_policy=preservation_policy.LatestN(int(keep)),
            enable_async_checkpointing=async_save,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state, step: int | None = None):
        """Restores `step` (default: latest) onto the shardings of `abstract_state` (ShapeDtypeStructs)."""
        step = self.latest_step() if step is None else step
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))

    def maybe_save(self, step: int, state, force: bool = False) -> bool:
        """Saves when the interval says so (or `force`); returns whether a save started."""
        if self.every <= 0 and not force:
            return False
        return self.manager.save(step, args=ocp.args.StandardSave(state), force=force)

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()

