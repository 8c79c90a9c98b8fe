"""Orbax checkpoints: async saves every N steps, keep the latest N, exact resume.

A checkpoint holds the whole train state (params, optimizer state, step); the data position is the step
itself, because a batch is a pure function of (seed, step). Orbax writes to a temporary directory and
renames it when complete, so a half-written checkpoint is never listed or restored. Restoring takes the
target shardings from an abstract state, so the arrays land directly on the current mesh.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading

import jax
import numpy as np

import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from orbax.checkpoint.checkpoint_managers import preservation_policy, save_decision_policy

from parallax import remote
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

    def __init__(self, directory, every: int, keep: int, async_save: bool = True, cleanup: bool = True,
                 local: LocalTier | None = None):
        """`cleanup=False` for a reader (e.g. sampling while a run trains), which must not delete the temp
        directory of a save in progress, nor create the directory. `local`: the fast tier (`LocalTier`),
        saved between the persistent saves; restores take the newest step of either."""
        self.local = local
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
            # a workdir mirrored to a bucket: pruned steps are renamed away at once, not deleted under an upload
            todelete_subdir=remote.TRASH if remote.is_mirrored(self.directory) else None,
        )
        with _quiet():
            self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        steps = [s for s in [self.manager.latest_step()] + (self.local.steps() if self.local else []) if s is not None]
        return max(steps) if steps else None

    def complete_steps(self) -> list[int]:
        """The steps saved (in either tier), once every save in flight has finished."""
        self.manager.wait_until_finished()
        return sorted(set(self.manager.all_steps()) | set(self.local.steps() if self.local else []))

    def _local_has(self, step) -> bool:
        return self.local is not None and step in self.local.steps()

    def where(self, step: int) -> str:
        """Where `step` is restored from, for the log."""
        return str(self.local.directory) + " (the local tier)" if self._local_has(step) else str(self.directory)

    def saved_tree(self, step: int) -> dict:
        """The state tree saved at `step`, its leaves Orbax's array metadata (`.shape`, `.dtype`); read
        from the checkpoint's metadata, no array is loaded. A local-tier step has this run's layout."""
        if self._local_has(step):
            return dict(self.local.abstract)
        with _quiet():
            meta = ocp.StandardCheckpointer().metadata(self.directory / str(step) / "default")
        return dict(meta.item_metadata.tree)

    def restore(self, abstract_state, step: int | None = None):
        """Restores `step` (default: latest) onto the shardings of `abstract_state` (ShapeDtypeStructs); a
        checkpoint that cannot be read (corrupt, or not written by a run of this config) is a ConfigError.
        Top-level entries of the checkpoint that `abstract_state` does not name are not read (e.g. a 2bw
        run's `pipeline`, when sampling or exporting from its checkpoint on another mesh)."""
        step = self.latest_step() if step is None else step
        if self._local_has(step):
            return self.local.restore(step)
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
        """Saves when the interval or a preemption says so (or `force`), else to the local tier when it is
        due; returns whether a save started."""
        if self.manager.save(step, args=ocp.args.StandardSave(state), force=force):
            return True
        if self.local is not None and self.local.due(step):
            self.local.save(step, state)
            return True
        return False

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()
        if self.local is not None:
            self.local.wait()



class LocalTier:
    """The fast tier: every `every` steps, each process writes the shards of the state its own devices hold
    to its own local directory (`DIR/process_<i>/<step>/`), in a background thread, keeping the newest
    `keep`. Nothing crosses the network and nothing waits for another process, so it can run every step; the
    persistent tier (Orbax, above) still saves every `train.checkpoint_every` steps, and a restore takes the
    newest step of either.

    A local step restores only onto the layout it was written from (the same processes, devices and
    shardings: each process reads back exactly its own shards), and only if every process holds it: at
    start the processes exchange the steps they hold (`process_allgather`) and keep the newest they share.
    A process whose directory is gone (a replaced machine) or was written on another mesh shares none, so
    the run resumes from the persistent tier and the stale local steps are deleted.

    Why not Orbax's emergency CheckpointManager: it restores a lost process's local checkpoint from a peer
    replica, so it needs the state replicated along a mesh axis whose groups are whole slices (its
    `replica_axis_index`), with one primary slice writing the persistent tier. parallax shards parameters and
    optimizer state over every process (FSDP), where no peer holds a lost process's shards; this tier covers
    that case by falling back to the persistent tier, and is an exact byte copy either way.

    A step's files: `shards.bin` (each distinct shard's bytes, one copy of a shard replicated over this
    process's devices) and `meta.json` (its layout and offsets), written to `<step>.tmp` and renamed when
    complete, so a step directory is either whole or absent.
    """

    def __init__(self, directory, every: int, keep: int, abstract_state):
        self.directory = epath.Path(os.path.abspath(str(directory))) / f"process_{jax.process_index()}"
        self.every, self.keep = int(every), int(keep)
        self.abstract = abstract_state
        self._names, leaves = _named_leaves(abstract_state)
        self._layout = [_layout(a) for a in leaves]
        self._thread, self._error, self._written = None, None, set()
        mine = self._usable()
        self.shared = _shared_steps(mine, self.keep)
        for step in set(self._on_disk()) - set(self.shared):  # stale, torn or another layout's: never restored
            _remove(self.directory / str(step))
        for tmp in self.directory.glob("*.tmp") if self.directory.exists() else ():
            _remove(tmp)

    def _on_disk(self) -> list[int]:
        if not self.directory.exists():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit())

    def _usable(self) -> list[int]:
        """This process's complete steps written from this layout, newest `keep`."""
        steps = []
        for step in self._on_disk():
            try:
                meta = json.loads((self.directory / str(step) / "meta.json").read_text())
            except (OSError, ValueError):
                continue
            if meta.get("names") == self._names and meta.get("layout") == self._layout and \
                    meta.get("processes") == jax.process_count():
                steps.append(step)
        return steps[-self.keep:]

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def steps(self) -> list[int]:
        """The steps this tier can restore: those all processes shared at start, and those written since."""
        self.wait()
        return sorted(set(self.shared) | self._written)

    def save(self, step: int, state) -> None:
        """Copies this process's shards to host memory now (the next step may donate the buffers), and
        writes them in the background."""
        self.wait()
        blobs = []
        for leaf, layout in zip(jax.tree.leaves(state), self._layout):
            held = {}
            for shard in leaf.addressable_shards:
                key = json.dumps(_index(shard.index, leaf.shape))
                if key not in held:
                    held[key] = np.asarray(shard.data)
            blobs.append([held[json.dumps(index)] for index in _distinct(layout)])
        self._thread = threading.Thread(target=self._write, args=(int(step), blobs), daemon=True)
        self._thread.start()

    def _write(self, step, blobs):
        try:
            final, tmp = self.directory / str(step), self.directory / f"{step}.tmp"
            _remove(tmp)
            tmp.mkdir(parents=True)
            offsets, at = [], 0
            with open(str(tmp / "shards.bin"), "wb") as f:
                for arrays in blobs:
                    offsets.append([])
                    for a in arrays:
                        data = np.ascontiguousarray(a).tobytes()
                        f.write(data)
                        offsets[-1].append([at, len(data)])
                        at += len(data)
            (tmp / "meta.json").write_text(json.dumps(dict(
                step=step, names=self._names, layout=self._layout, offsets=offsets, processes=jax.process_count())))
            _remove(final)
            os.rename(str(tmp), str(final))
            self._written.add(step)
            steps = self._on_disk()  # drop later steps left by an earlier attempt, and all but the newest `keep`
            for old in [s for s in steps if s > step] + [s for s in steps if s <= step][:-self.keep]:
                _remove(self.directory / str(old))
                self._written.discard(old)
                self.shared = [s for s in self.shared if s != old]
        except BaseException as e:  # noqa: BLE001 -- re-raised on the training thread by wait()
            self._error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise ConfigError(f"the local checkpoint tier {self.directory} could not be written ({type(error).__name__}: "
                              f"{error}); free disk space there or set train.local_checkpoint_dir") from error

    def restore(self, step: int):
        """The state of `step`, each shard read back onto the devices of this process that hold it."""
        self.wait()
        root = self.directory / str(step)
        meta = json.loads((root / "meta.json").read_text())
        data = np.fromfile(str(root / "shards.bin"), dtype=np.uint8)
        leaves, treedef = jax.tree.flatten(self.abstract)
        out = []
        for abstract, layout, offsets in zip(leaves, self._layout, meta["offsets"]):
            by_index = {}
            for index, (at, size) in zip(_distinct(layout), offsets):
                shape = tuple(b - a for a, b in index)
                by_index[json.dumps(index)] = np.frombuffer(data[at:at + size].tobytes(), dtype=abstract.dtype).reshape(shape)
            sharding = abstract.sharding
            arrays = [jax.device_put(by_index[json.dumps(_index(index, abstract.shape))],
                                     jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind))
                      for device, index in sharding.addressable_devices_indices_map(abstract.shape).items()]
            out.append(jax.make_array_from_single_device_arrays(abstract.shape, sharding, arrays))
        return jax.tree.unflatten(treedef, out)


def _named_leaves(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(path) for path, _ in flat], [leaf for _, leaf in flat]


def _index(index, shape) -> list:
    """A shard's index (a tuple of slices) as [[start, stop], ...] over `shape`."""
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def _layout(abstract) -> list:
    """[[device id, index], ...] of the devices of this process holding `abstract` (its sharding), sorted."""
    held = abstract.sharding.addressable_devices_indices_map(abstract.shape)
    return sorted([d.id, _index(index, abstract.shape)] for d, index in held.items())


def _distinct(layout) -> list:
    """The distinct indices of a layout, in a fixed order: one copy each is written."""
    seen = []
    for _, index in layout:
        if index not in seen:
            seen.append(index)
    return seen


def _shared_steps(mine: list[int], keep: int) -> list[int]:
    """The steps every process holds (each contributes its newest `keep`; -1 pads)."""
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return list(mine)
    padded = np.full(keep, -1, np.int32)
    padded[:len(mine)] = mine
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(jax.process_count(), keep)
    shared = set(every[0].tolist())
    for row in every[1:]:
        shared &= set(row.tolist())
    return sorted(s for s in shared if s >= 0)


def _remove(path) -> None:
    shutil.rmtree(str(path), ignore_errors=True)
