"""Workdirs, corpora and prepared shards at object-store URLs (`gs://BUCKET/...`, `s3://BUCKET/...`).

A run whose `--workdir` is a URL runs from a local copy (`Mirror`): at start it downloads what the local
copy lacks (config.json, metrics.jsonl, the tokenizer, goodput.json, ...) and the newest complete checkpoint
if it is newer than the local copy's; while the run trains a thread uploads every checkpoint step Orbax has
finished (its files first, then a `parallax_uploaded` marker, so a step cut short by a kill is never taken
as complete) and every other file that changed, and deletes the remote steps Orbax deleted locally; the end
of the run (and a stop on a signal) uploads the rest. A corpus at a URL (`data.path`) is downloaded once to
the local cache and read from there; `launch/prepare_data.py --output=URL` prepares locally and uploads.

Why a local copy rather than Orbax writing to the bucket: Orbax 0.12's TensorStore path takes only `gs://`
URLs (`s3://` is refused as not absolute), TensorStore's GCS driver looks for Google credentials (the
metadata server) even against an emulator, and `metrics.jsonl` is appended to, which object stores cannot
do. Through fsspec (s3fs, gcsfs) both stores take one code path, which the tests run against a real S3 server
(moto) on loopback. The cost: a step is on the bucket some seconds after Orbax finished it (a kill loses at
most that, and the local copy still holds it on the same machine), and the local disk holds the newest
checkpoints. The local copy lives under `PARALLAX_CACHE` (default `~/.cache/parallax`), `remote/<scheme>/
<bucket>/<path>`, so a rerun on the same machine finds it and another machine rebuilds it from the bucket.

One process mirrors: a URL workdir with several processes is refused (they would each upload their own
files of one Orbax checkpoint); on several hosts, mount the bucket (gcsfuse, mountpoint-s3) and pass the
mount's path.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time

from parallax.errors import ConfigError

SCHEMES = {"gs": "gcsfs", "s3": "s3fs"}
MARKER = "parallax_uploaded"  # written last into an uploaded checkpoint step
CHECKPOINTS = "checkpoints"
NOT_MIRRORED = ("local",)  # the per-process local checkpoint tier stays on its machine
# Orbax renames the steps it prunes into this subdirectory of a mirrored checkpoint directory (its
# `todelete_subdir`), so a step vanishes at once rather than file by file under an upload; `Mirror.push`
# empties it. Without this, an upload racing Orbax's deletion could mark a half-read step complete.
TRASH = "parallax_deleted"
SNAPSHOT = ".parallax_upload"  # hard links of the step being uploaded, in the local copy
_MIRRORED: set = set()  # local copies of the mirrors open in this process


def is_mirrored(directory) -> bool:
    """Whether `directory` is inside the local copy of an open `Mirror`."""
    path = os.path.abspath(str(directory))
    return any(path == m or path.startswith(m + os.sep) for m in _MIRRORED)


def is_remote(path) -> bool:
    return "://" in str(path) and str(path).split("://", 1)[0] in SCHEMES


def cache_root() -> str:
    return os.environ.get("PARALLAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "parallax")


def local_path(url: str) -> str:
    """Where the local copy of `url` lives (the same on every run and machine with the same cache root)."""
    scheme, rest = str(url).split("://", 1)
    return os.path.join(cache_root(), "remote", scheme, *[p for p in rest.split("/") if p not in ("", ".", "..")])


def filesystem(url: str, what: str):
    """The fsspec filesystem of `url`, after checking that its bucket answers with these credentials:
    a ConfigError naming `what` (e.g. `--workdir`), the URL and the fix otherwise."""
    scheme = str(url).split("://", 1)[0]
    if scheme not in SCHEMES:
        raise ConfigError(f"{what}={url}: only gs:// and s3:// URLs are read (or a local path)")
    module = SCHEMES[scheme]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{what}={url}: {scheme}:// needs the {module} package; pip install "
                          f"'parallax[remote]' (or {module})")
    import logging

    import fsspec

    for name in ("botocore", "aiobotocore", "s3fs", "gcsfs", "google"):  # their INFO lines would break one-line errors
        logging.getLogger(name).setLevel(logging.WARNING)
    options = {}
    if scheme == "gs" and os.environ.get("STORAGE_EMULATOR_HOST"):
        options["token"] = "anon"  # an emulator (gcsfs reads STORAGE_EMULATOR_HOST) takes no credentials
    fs = fsspec.filesystem(scheme, skip_instance_cache=True, **options)  # credentials as they are now
    bucket = str(url).split("://", 1)[1].split("/", 1)[0]
    if not bucket:
        raise ConfigError(f"{what}={url}: no bucket in the URL; expected {scheme}://BUCKET/PATH")
    try:
        fs.ls(bucket, refresh=True)
    except FileNotFoundError:
        raise ConfigError(f"{what}={url}: bucket {bucket!r} does not exist (or these credentials cannot see it); "
                          "create it or fix the URL") from None
    except PermissionError as e:
        raise ConfigError(f"{what}={url}: access to bucket {bucket!r} denied ({_first_line(e)}); check the "
                          "credentials or the bucket's permissions") from None
    except Exception as e:  # noqa: BLE001 -- botocore / google-auth raise their own types for missing credentials
        name = type(e).__name__
        if "Credential" in name or "credential" in str(e).lower():
            raise ConfigError(f"{what}={url}: no credentials for {scheme}:// ({name}); set "
                              f"{'AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)' if scheme == 's3' else 'GOOGLE_APPLICATION_CREDENTIALS (or gcloud auth application-default login)'}") from None
        raise ConfigError(f"{what}={url}: the store did not answer ({name}: {_first_line(e)}); check the URL, "
                          "the endpoint (AWS_ENDPOINT_URL) and the network") from None
    return fs


def _first_line(e) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _key(url: str) -> str:
    return str(url).split("://", 1)[1].rstrip("/")


def download_tree(fs, url: str, local: str, skip=()) -> int:
    """Downloads the files under `url` that `local` lacks (by relative path; `skip`: top-level names left
    out); returns how many."""
    root, n = _key(url), 0
    for path in sorted(fs.find(root)):
        rel = path[len(root):].lstrip("/")
        if not rel or rel.split("/", 1)[0] in skip:
            continue
        target = os.path.join(local, *rel.split("/"))
        if os.path.exists(target):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get(path, target + ".part")
        os.replace(target + ".part", target)
        n += 1
    return n


def upload_tree(fs, local: str, url: str, sent: dict | None = None, skip=()) -> int:
    """Uploads the files under `local` (`skip`: top-level names left out) whose (size, mtime) differ from
    `sent` (updated; None: all); returns how many."""
    root, n = _key(url), 0
    for dirpath, dirnames, names in os.walk(local):
        rel_dir = os.path.relpath(dirpath, local)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in skip]
            names = [f for f in names if f not in skip]
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            try:
                stat = os.stat(path)
            except FileNotFoundError:  # deleted while walking (a rewritten metrics file, a pruned step)
                continue
            rel = os.path.relpath(path, local).replace(os.sep, "/")
            if sent is not None and sent.get(rel) == (stat.st_size, stat.st_mtime):
                continue
            fs.put(path, f"{root}/{rel}")
            if sent is not None:
                sent[rel] = (stat.st_size, stat.st_mtime)
            n += 1
    return n


def fetch(url: str, what: str) -> str:
    """A local copy of the file or directory at `url` (downloaded once, completed if partial): its path."""
    fs = filesystem(url, what)
    local = local_path(url)
    if fs.isfile(_key(url)):
        if not os.path.exists(local):
            os.makedirs(os.path.dirname(local), exist_ok=True)
            fs.get(_key(url), local + ".part")
            os.replace(local + ".part", local)
        return local
    if not fs.exists(_key(url)):
        raise ConfigError(f"{what}={url}: nothing there; prepare the corpus there first "
                          "(launch/prepare_data.py --output=URL) or fix the URL")
    download_tree(fs, url, local)
    return local


def localize_paths(value: str, what: str) -> str:
    """`data.path` (comma-separated) with each URL replaced by its local copy."""
    parts = [p.strip() for p in str(value).split(",")]
    if not any(is_remote(p) for p in parts):
        return value
    return ",".join(fetch(p, what) if is_remote(p) else p for p in parts)


class Mirror:
    """A workdir at `url` run from its local copy `self.local` (the module's docstring)."""

    def __init__(self, url: str, what: str = "--workdir", every_s: float = 2.0):
        import jax

        if jax.process_count() > 1:
            raise ConfigError(f"{what}={url}: a gs:// or s3:// workdir is mirrored by one process, and this run has "
                              f"{jax.process_count()}; mount the bucket on every host (gcsfuse, mountpoint-s3) and "
                              "pass the mount's path")
        self.url = str(url).rstrip("/")
        self.what = what
        self.fs = filesystem(self.url, what)
        self.local = local_path(self.url)
        self.every_s = float(every_s)
        self._sent: dict = {}
        self._stop = threading.Event()
        self._thread = None
        self._lock = threading.Lock()
        _MIRRORED.add(os.path.abspath(self.local))

    # --- checkpoints -------------------------------------------------------------------------------------
    def _remote_steps(self) -> dict:
        """{step: complete} of the remote checkpoint directory."""
        root = f"{_key(self.url)}/{CHECKPOINTS}"
        if not self.fs.exists(root):
            return {}
        steps = {}
        for path in self.fs.ls(root, detail=False, refresh=True):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.isdigit():
                steps[int(name)] = self.fs.exists(f"{root}/{name}/{MARKER}")
        return steps

    def _local_steps(self) -> list[int]:
        directory = os.path.join(self.local, CHECKPOINTS)
        return sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []

    def pull(self, log=None) -> str:
        """Brings the local copy up to date with the bucket (files it lacks; the newest complete checkpoint if
        newer than the local newest); returns the local path."""
        os.makedirs(self.local, exist_ok=True)
        if self.fs.exists(_key(self.url)):
            download_tree(self.fs, self.url, self.local, skip=(CHECKPOINTS,) + NOT_MIRRORED)
        complete = sorted(s for s, done in self._remote_steps().items() if done)
        local = self._local_steps()
        if complete and (not local or complete[-1] > local[-1]):
            step = complete[-1]
            target = os.path.join(self.local, CHECKPOINTS, str(step))
            tmp = target + ".download"
            _rmtree(tmp)
            download_tree(self.fs, f"{self.url}/{CHECKPOINTS}/{step}", tmp)
            os.remove(os.path.join(tmp, MARKER))
            _rmtree(target)
            os.replace(tmp, target)
            if log:
                log(f"downloaded checkpoint step {step} from {self.url}")
        return self.local

    def push(self) -> None:
        """Uploads the files outside `checkpoints/` that changed, then the newest finished checkpoint step if
        the bucket lacks it (marker last), and deletes the bucket's other steps that are no longer local
        (never its newest complete one). Files first: a step marked complete in the bucket always has the
        config.json, tokenizer and metrics.jsonl rows of the steps before it.

        The step is uploaded from a snapshot of hard links taken first: Orbax renames a pruned step away at
        once (`TRASH`), so a snapshot finished while the step directory still exists is whole, and the upload
        may take longer than the checkpoint interval without racing the pruning."""
        with self._lock:
            upload_tree(self.fs, self.local, self.url, self._sent, skip=(CHECKPOINTS, SNAPSHOT) + NOT_MIRRORED)
            remote = self._remote_steps()
            local = self._local_steps()
            if local and not remote.get(local[-1]):
                step = local[-1]
                directory = os.path.join(self.local, CHECKPOINTS, str(step))
                snapshot = os.path.join(self.local, SNAPSHOT, str(step))
                if _link_tree(directory, snapshot):
                    upload_tree(self.fs, snapshot, f"{self.url}/{CHECKPOINTS}/{step}")
                    self.fs.pipe(f"{_key(self.url)}/{CHECKPOINTS}/{step}/{MARKER}", b"")
                    remote[step] = True
                _rmtree(os.path.join(self.local, SNAPSHOT))
            complete = [s for s, done in remote.items() if done]
            for step in remote:
                if step not in local and (not remote[step] or step < max(complete)):
                    self.fs.rm(f"{_key(self.url)}/{CHECKPOINTS}/{step}", recursive=True)
            trash = os.path.join(self.local, CHECKPOINTS, TRASH)
            for name in os.listdir(trash) if os.path.isdir(trash) else ():
                _rmtree(os.path.join(trash, name))

    def start(self) -> None:
        """Pushes every `every_s` seconds in the background until `close`."""
        def loop():
            while not self._stop.wait(self.every_s):
                try:
                    self.push()
                except Exception:  # noqa: BLE001 -- a failed upload is retried at the next tick and at close
                    pass
        self._thread = threading.Thread(target=loop, name="parallax-mirror", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the background pushes and pushes what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.push()
        finally:
            _MIRRORED.discard(os.path.abspath(self.local))


def _link_tree(source: str, target: str) -> bool:
    """Hard-links every file under `source` into `target`; True if `source` still exists afterwards (then
    the links are all of it: the directory is removed only by an atomic rename)."""
    _rmtree(target)
    try:
        for dirpath, _, names in os.walk(source):
            into = os.path.join(target, os.path.relpath(dirpath, source))
            os.makedirs(into, exist_ok=True)
            for name in names:
                os.link(os.path.join(dirpath, name), os.path.join(into, name))
    except FileNotFoundError:
        return False
    return os.path.isdir(source) and os.path.isdir(target)


def _rmtree(path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
