"""The shard directory: a tokenized corpus as many files, what `launch/prepare_data.py` writes and
`data.source=tokens` with `data.path=DIR` trains on.

    DIR/manifest.json          format, tokenizer (kind, hash, ids), dtype, sources, and per shard: name,
                               source, tokens, documents, smallest / largest id, SHA-256 of its tokens
    DIR/tokenizer/             a copy of the tokenizer (`parallax.tokenizer`), so the corpus decodes alone
    DIR/NAME.uint16.bin        the shard's documents, concatenated (uint32 when the vocabulary needs it);
                               each document ends with the eos id (and starts with bos if the tokenizer adds it)
    DIR/NAME.docs.npy          int64: the offset where each of the shard's documents starts (docs[0] == 0)
    DIR/NAME.mask.bin          chat shards trained on the assistant's tokens only (`parallax.chat`): one uint8 per
                               token, 1 where the token is a training target; its manifest entry says `mask`
                               and carries its SHA-256 (the manifest's format is then parallax-shards/2, which
                               a reader that would ignore the mask refuses)

A shard holds whole documents, so every shard starts a document. A shard is committed by renaming its
`.docs.npy` into place after its `.bin` and mask (each written to a temporary name first): a reader never sees a
half-written shard, and a restarted preparation redoes only shards without a committed `.docs.npy`. The
manifest is written last: a directory without one is a preparation that has not finished.

Reading is lazy: opening a directory reads the manifest and stats each shard file (sizes checked against
the manifest), nothing else; a shard's tokens (memory-mapped) and its document index are read when a row
first touches it. So the start-up time does not grow with the corpus, only (by a stat) with the number of
shards.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os

import numpy as np

from parallax.errors import ConfigError

FORMAT = "parallax-shards/1"
FORMAT_MASKED = "parallax-shards/2"  # some shards carry a loss mask (NAME.mask.bin)
FORMATS = (FORMAT, FORMAT_MASKED)
MANIFEST = "manifest.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class ShardError(ConfigError):
    """A shard directory that cannot be read as one; the message names the file and the fix (one line: the
    launchers exit 2 with it, also when a damaged window is found while training)."""


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def token_file(name: str, dtype: str) -> str:
    return f"{name}.{dtype}.bin"


def docs_file(name: str) -> str:
    return f"{name}.docs.npy"


def mask_file(name: str) -> str:
    return f"{name}.mask.bin"


def write_shard(directory: str, name: str, documents: list, dtype: str, masks: list | None = None) -> dict:
    """Writes one shard of `documents` (1-D arrays or lists of ids) and returns its manifest entry (without `source`).
    `masks`: one uint8 array per document (1: a training target), written as the shard's loss mask.
    The tokens go first, then the mask, and the document index last, each through a temporary file and a rename."""
    lengths = np.fromiter((len(d) for d in documents), np.int64, len(documents))
    tokens = np.concatenate([np.asarray(d, DTYPES[dtype]) for d in documents]) if documents else \
        np.zeros(0, DTYPES[dtype])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(documents) else \
        np.zeros(0, np.int64)
    path = os.path.join(directory, token_file(name, dtype))
    _write_atomically(path, tokens.tobytes())
    extra = {}
    if masks is not None:
        mask = np.concatenate([np.asarray(m, np.uint8) for m in masks]) if masks else np.zeros(0, np.uint8)
        if len(mask) != len(tokens) or (len(mask) and mask.max() > 1):
            raise ValueError(f"shard {name}: {len(mask)} mask values for {len(tokens)} tokens (or not 0 / 1)")
        _write_atomically(os.path.join(directory, mask_file(name)), mask.tobytes())
        extra = {"mask": True, "mask_sha256": hashlib.sha256(mask.tobytes()).hexdigest()}
    index = os.path.join(directory, docs_file(name))
    buffer = io.BytesIO()
    np.save(buffer, starts)
    _write_atomically(index, buffer.getvalue())  # the commit: the shard exists from here on
    return {"name": name, "tokens": int(len(tokens)), "documents": int(len(documents)),
            "lowest": int(tokens.min()) if len(tokens) else 0, "highest": int(tokens.max()) if len(tokens) else 0,
            "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(), **extra}


def _write_atomically(path: str, data: bytes) -> None:
    """`data` into `path` through a temporary of this process (`*.PID.tmp`), synced before the rename, so
    that neither a kill nor a power loss leaves a renamed file with less than its bytes."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def committed(directory: str, name: str, dtype: str, masked: bool = False) -> bool:
    return os.path.isfile(os.path.join(directory, docs_file(name))) and \
        os.path.isfile(os.path.join(directory, token_file(name, dtype))) and \
        (not masked or os.path.isfile(os.path.join(directory, mask_file(name))))


def shard_entry(directory: str, name: str, dtype: str, eos_id: int | None, masked: bool = False) -> dict:
    """The manifest entry of a committed shard, read back from its files (a restarted preparation); a shard
    whose index does not fit its tokens (or whose mask does not) is a ShardError. `eos_id`: what every
    document ends with (None: chat documents, which end as their template ends them)."""
    tokens = np.fromfile(os.path.join(directory, token_file(name, dtype)), DTYPES[dtype])
    starts = load_index(os.path.join(directory, docs_file(name)), "delete the shard's files and rerun to write "
                        "it again")
    extra = {}
    if masked:
        mask = np.fromfile(os.path.join(directory, mask_file(name)), np.uint8)
        if len(mask) != len(tokens) or (len(mask) and mask.max() > 1):
            raise ShardError(f"shard {name!r} in {directory!r} is damaged (its mask does not fit its tokens); "
                             "delete its files and rerun to write it again")
        extra = {"mask": True, "mask_sha256": hashlib.sha256(mask.tobytes()).hexdigest()}
    if len(starts) and (starts[0] != 0 or starts[-1] >= len(tokens) or (eos_id is not None and tokens[-1] != eos_id)):
        raise ShardError(f"shard {name!r} in {directory!r} is damaged (its index does not fit its tokens); "
                         "delete its files and rerun to write it again")
    return {"name": name, "tokens": int(len(tokens)), "documents": int(len(starts)),
            "lowest": int(tokens.min()) if len(tokens) else 0, "highest": int(tokens.max()) if len(tokens) else 0,
            "sha256": hashlib.sha256(tokens.tobytes()).hexdigest(), **extra}


def load_index(path: str, fix: str, mmap_mode=None) -> np.ndarray:
    """A shard's document index: a 1-D int64 .npy array; anything else (junk bytes, a pickle, another
    array) is a one-line ShardError naming the file and `fix` (not numpy's advice to unpickle it)."""
    try:
        with open(path, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise ValueError("no .npy header")
        starts = np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
        if starts.dtype != np.int64 or starts.ndim != 1:
            raise ValueError(f"holds {starts.dtype}{list(starts.shape)}, not a list of int64 offsets")
    except (OSError, ValueError, EOFError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ShardError(f"shard index {path!r} is damaged ({reason}); {fix}") from None
    return starts


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise ShardError(f"{directory!r} is not a directory; pass a directory that launch/prepare_data.py wrote")
    if not os.path.isfile(path):
        partial = any(n.endswith(".docs.npy") for n in os.listdir(directory))
        raise ShardError(f"{directory!r} has no {MANIFEST}: " + (
            "its preparation did not finish; rerun the same launch/prepare_data.py command to complete it"
            if partial else "not a shard directory; write one with launch/prepare_data.py"))
    try:
        with open(path) as f:
            manifest = json.load(f)
        if manifest.get("format") not in FORMATS:
            raise ValueError(f"format {manifest.get('format')!r}, expected one of {FORMATS}")
        manifest["tokenizer"]["hash"], manifest["shards"], DTYPES[manifest["dtype"]]  # noqa: B018 -- present
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ShardError(f"{path}: not a readable shard manifest ({type(e).__name__}: {e}); prepare the "
                         "directory again with launch/prepare_data.py") from None
    return manifest


class Shard:
    """One shard: its tokens (memory-mapped) and document starts, read on first use."""

    def __init__(self, directory: str, entry: dict, dtype: str):
        self.directory, self.name, self.dtype = directory, entry["name"], dtype
        self.n_tokens, self.n_docs = entry["tokens"], entry["documents"]
        self.lowest, self.highest = int(entry.get("lowest", 0)), int(entry.get("highest", np.iinfo(DTYPES[dtype]).max))
        self.path = os.path.join(directory, token_file(self.name, dtype))
        self.has_mask = bool(entry.get("mask", False))
        self.mask_path = os.path.join(directory, mask_file(self.name))

    def check(self) -> None:
        """Present, readable and of the manifest's size: a stat, not a read."""
        paths = (self.path, os.path.join(self.directory, docs_file(self.name))) + ((self.mask_path,) if self.has_mask
                                                                                 else ())
        for path in paths:
            if not os.path.isfile(path) or not os.access(path, os.R_OK):
                raise ShardError(f"shard {path!r} is missing or unreadable; restore it, or prepare "
                                 f"{self.directory!r} again with launch/prepare_data.py")
        size = os.path.getsize(self.path)
        if size != self.n_tokens * DTYPES[self.dtype].itemsize:
            raise ShardError(f"shard {self.path!r} holds {size} bytes, but the manifest says {self.n_tokens} "
                             f"{self.dtype} tokens; the file was changed or truncated: prepare the directory again")
        if self.has_mask and os.path.getsize(self.mask_path) != self.n_tokens:
            raise ShardError(f"shard mask {self.mask_path!r} holds {os.path.getsize(self.mask_path)} bytes, but the "
                             f"manifest says {self.n_tokens} tokens; the file was changed or truncated: prepare the "
                             "directory again")

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the shard, checked against the id range its manifest records: bytes changed after
        the shard was written (same size, so `check` passes) show as ids outside it, and are refused here,
        before they reach the model (a min and a max over the window: nothing next to reading it)."""
        piece = np.asarray(self.tokens[a:b])
        if piece.size:
            lo, hi = int(piece.min()), int(piece.max())
            if lo < self.lowest or hi > self.highest:
                bad = hi if hi > self.highest else lo
                at = a + int(np.argmax(piece == bad))
                raise ShardError(f"shard {self.path!r} holds id {bad} at token {at}, outside the ids "
                                 f"[{self.lowest}, {self.highest}] its manifest records: the file was changed after "
                                 "it was written; prepare the directory again with launch/prepare_data.py")
        return piece

    def read_mask(self, a: int, b: int) -> np.ndarray:
        """Loss-mask values [a, b) of the shard (uint8; all 1 for a shard without a mask), checked to be 0 or 1
        (a changed file shows as other bytes)."""
        if not self.has_mask:
            return np.ones(max(b - a, 0), np.uint8)
        piece = np.asarray(self.mask[a:b])
        if piece.size and piece.max() > 1:
            at = a + int(np.argmax(piece > 1))
            raise ShardError(f"shard mask {self.mask_path!r} holds {int(piece.max())} at token {at}, not 0 or 1: the "
                             "file was changed after it was written; prepare the directory again")
        return piece

    @functools.cached_property
    def mask(self) -> np.ndarray:
        if self.n_tokens == 0:
            return np.zeros(0, np.uint8)
        return np.memmap(self.mask_path, dtype=np.uint8, mode="r")

    @functools.cached_property
    def tokens(self) -> np.ndarray:
        if self.n_tokens == 0:
            return np.zeros(0, DTYPES[self.dtype])
        return np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")

    @functools.cached_property
    def starts(self) -> np.ndarray:
        path = os.path.join(self.directory, docs_file(self.name))
        starts = load_index(path, f"prepare {self.directory!r} again with launch/prepare_data.py", mmap_mode="r")
        if len(starts) != self.n_docs:
            raise ShardError(f"shard index {path!r} lists {len(starts)} documents, the manifest {self.n_docs}; "
                             "prepare the directory again")
        return starts


class ShardStream:
    """Global token offsets [lo, hi) of the shards concatenated: the `_Stream` interface of `parallax.data`
    (`len`, `num_docs`, `window`) without loading the corpus."""

    def __init__(self, shards: list, lo: int = 0, hi: int | None = None):
        self.shards = shards
        self.bounds = np.concatenate([[0], np.cumsum([s.n_tokens for s in shards])]).astype(np.int64)
        self.lo, self.hi = lo, int(self.bounds[-1]) if hi is None else hi

    def __len__(self) -> int:
        return self.hi - self.lo

    @property
    def has_mask(self) -> bool:
        """Whether any shard carries a loss mask (then `loss_mask` differs from all ones somewhere)."""
        return any(s.has_mask for s in self.shards)

    def _docs_before(self, g: int) -> int:
        """Documents starting before global offset g."""
        k = int(np.searchsorted(self.bounds, g, side="right")) - 1
        if k >= len(self.shards):
            return sum(s.n_docs for s in self.shards)
        done = sum(s.n_docs for s in self.shards[:k])
        return done + int(np.searchsorted(self.shards[k].starts, g - self.bounds[k], side="left"))

    @property
    def num_docs(self) -> int:
        return self._docs_before(self.hi) - self._docs_before(self.lo)

    def first_start_at_or_after(self, g: int) -> int | None:
        """The global offset of the first document start >= g, or None (no later document)."""
        k = int(np.searchsorted(self.bounds, g, side="right")) - 1
        while 0 <= k < len(self.shards):
            starts = self.shards[k].starts
            i = int(np.searchsorted(starts, g - self.bounds[k], side="left"))
            if i < len(starts):
                return int(self.bounds[k] + starts[i])
            k += 1
        return None

    def window(self, offset: int, n: int):
        """Tokens [offset, offset + n) of this stream (fewer at its end) and the document starts inside
        them, relative to `offset`, with 0 first (the document the window begins in)."""
        g0, g1 = self.lo + offset, min(self.lo + offset + n, self.hi)
        pieces, starts = [], [np.zeros(1, np.int64)]
        k = int(np.searchsorted(self.bounds, g0, side="right")) - 1
        while g0 < g1:
            shard, base = self.shards[k], int(self.bounds[k])
            a, b = g0 - base, min(g1, int(self.bounds[k + 1])) - base
            if b > a:
                pieces.append(shard.read(a, b))
                s = shard.starts
                i0, i1 = np.searchsorted(s, [a, b], side="left")
                inner = np.asarray(s[i0:i1], np.int64) + base - (self.lo + offset)
                starts.append(inner[inner > 0])
            g0, k = base + b, k + 1
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
        return tokens, np.concatenate(starts)

    def loss_mask(self, offset: int, n: int) -> np.ndarray:
        """The loss mask of tokens [offset, offset + n) (fewer at the end), as `window` reads the tokens."""
        g0, g1 = self.lo + offset, min(self.lo + offset + n, self.hi)
        pieces = []
        k = int(np.searchsorted(self.bounds, g0, side="right")) - 1
        while g0 < g1:
            base = int(self.bounds[k])
            a, b = g0 - base, min(g1, int(self.bounds[k + 1])) - base
            if b > a:
                pieces.append(self.shards[k].read_mask(a, b))
            g0, k = base + b, k + 1
        return np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)
