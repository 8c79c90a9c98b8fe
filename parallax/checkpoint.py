"""Orbax checkpoints: async saves every N steps, keep the latest N, exact resume.

A checkpoint holds the whole train state (params, optimizer state, step); the data position is the step
itself, because a batch is a pure function of (seed, step). Orbax writes to a temporary directory and
renames it when complete, so a half-written checkpoint is never listed or restored. Restoring takes the
target shardings from an abstract state, so the arrays land directly on the current mesh.
"""

from __future__ import annotations

import contextlib
import os

import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint.checkpoint_managers import preservation_policy, save_decision_policy

from parallax.errors import ConfigError


@contextlib.contextmanager
def _quiet():
    """Orbax logs unreadable checkpoint metadata as errors while listing and restoring; a failure is reported
    as one ConfigError line instead, so its log lines would only break the one-line contract."""
    level = logging.get_verbosity()
    logging.set_verbosity(logging.FATAL)
    try:
        yield
    finally:
        logging.set_verbosity(level)


class Checkpointer:
    """Thin wrapper around `ocp.CheckpointManager` for one workdir.

    Saves every `every` steps and, when JAX's preemption service is running (multi-process runs started with
    `jax.distributed.initialize`), at the step Orbax's `PreemptionCheckpointingPolicy` says all hosts agreed
    on after a preemption notice. Temporary directories a killed save left behind (`*.orbax-checkpoint-tmp*`)
    are deleted when the manager starts (`cleanup_tmp_directories`).
    """

    def __init__(self, directory, every: int, keep: int, async_save: bool = True, cleanup: bool = True):
        """`cleanup=False` for a reader (e.g. sampling while a run trains), which must not delete the temp
        directory of a save in progress, nor create the directory."""
        if "://" not in str(directory):  # Orbax wants absolute local paths; gs:// and other URLs stay as they are
            directory = os.path.abspath(directory)
        self.directory = epath.Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ConfigError(f"{self.directory}: is a file, not a checkpoint directory; move it away or use a "
                              "new --workdir")
        self.every = int(every)
        policies = [save_decision_policy.PreemptionCheckpointingPolicy()]
        if self.every > 0:
            policies.insert(0, save_decision_policy.FixedIntervalPolicy(self.every))
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=save_decision_policy.AnySavePolicy(policies),
            preservation_policy=preservation_policy.LatestN(int(keep)),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=cleanup,
            create=cleanup,  # a reader of a run with no checkpoint yet leaves no empty directory behind
        )
        with _quiet():
            self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def complete_steps(self) -> list[int]:
        """The steps saved, once every save in flight has finished."""
        self.manager.wait_until_finished()
        return sorted(self.manager.all_steps())

    def saved_tree(self, step: int) -> dict:
        """The state tree saved at `step`, its leaves Orbax's array metadata (`.shape`, `.dtype`); read
        from the checkpoint's metadata, no array is loaded."""
        with _quiet():
            meta = ocp.StandardCheckpointer().metadata(self.directory / str(step) / "default")
        return dict(meta.item_metadata.tree)

    def restore(self, abstract_state, step: int | None = None):
        """Restores `step` (default: latest) onto the shardings of `abstract_state` (ShapeDtypeStructs); a
        checkpoint that cannot be read (corrupt, or not written by a run of this config) is a ConfigError.
        Top-level entries of the checkpoint that `abstract_state` does not name are not read (e.g. a 2bw
        run's `pipeline`, when sampling or exporting from its checkpoint on another mesh)."""
        step = self.latest_step() if step is None else step
        try:
            try:
                with _quiet():
                    return self.manager.restore(step, args=ocp.args.StandardRestore(abstract_state))
            except Exception as first:  # noqa: BLE001 -- retried below when the checkpoint holds more than asked for
                try:
                    extra = set(self.saved_tree(step)) - set(abstract_state)
                except Exception:  # noqa: BLE001 -- unreadable metadata: report the restore's own error
                    extra = set()
                if not extra:
                    raise first
            with _quiet():  # the entries asked for alone, read from the step's item directory
                return ocp.PyTreeCheckpointer().restore(
                    self.directory / str(step) / "default", args=ocp.args.PyTreeRestore(
                        item=abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
                        partial_restore=True))
        except Exception as e:  # noqa: BLE001 -- Orbax raises many types here; all mean "not this run's checkpoint"
            reason = (str(e).strip().splitlines() or [""])[0][:200]
            raise ConfigError(f"checkpoint {self.directory / str(step)} cannot be restored ({type(e).__name__}: "
                              f"{reason}); it is corrupt or from another run: move that step directory away to "
                              "resume from an earlier one, or use a new --workdir") from None

    def reached_preemption(self, step: int) -> bool:
        """Whether JAX's preemption service says every host should save at `step` and stop."""
        return bool(self.manager.reached_preemption(step))

    def maybe_save(self, step: int, state, force: bool = False) -> bool:
        """Saves when the interval or a preemption says so (or `force`); returns whether a save started."""
        return self.manager.save(step, args=ocp.args.StandardSave(state), force=force)

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()

