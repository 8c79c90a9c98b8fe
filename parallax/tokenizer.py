"""Tokenizers: the text <-> token ids of a run, named by `config.data.tokenizer`.

* `bytes` (and `""` for a byte-level `text` run): UTF-8 bytes are the ids 0..255 (today's quickstart).
* a Hugging Face tokenizer: a `tokenizer.json` file, or a directory holding one (a local HF model directory,
  read offline with the `tokenizers` library; its `tokenizer_config.json` names the eos / bos tokens).
* a SentencePiece model (`*.model` with a SentencePiece protobuf; `sentencepiece` package) or a tiktoken
  BPE file (`*.tiktoken`, or Llama 3's `tokenizer.model`, which is one; `tiktoken` package, Llama 3's
  split pattern and special tokens).

A tokenizer reports the ids it can emit (`vocab_size`), `eos_id` (ends every document) and `bos_id` (put
before every document and prompt when the tokenizer asks for it: `add_bos`). Its identity is `hash`, a
SHA-256 over its kind and the bytes of the files that define it, so a copy (a run's `WORKDIR/tokenizer/`,
a shard directory's `tokenizer/`) has the hash of the original: resume and training on shards compare
hashes, not paths. `copy_to(dir)` writes those files plus `parallax_tokenizer.json` (kind, hash, ids), and
`load(dir)` reads such a copy back.

For chat data (`parallax.chat`) an HF tokenizer carries its `chat_template` (tokenizer_config.json's, or the
`chat_template.jinja` file transformers >= 4.50 writes, which is then one of its files) and the
special-token strings a template reads (`template_tokens`: bos_token, eos_token, ...); `encode_chat`
encodes a rendered conversation with the template's control tokens as their ids.

Why these libraries and not our own BPE: `tokenizers` is the Rust implementation every HF model's
`tokenizer.json` is written for (byte-exact with `transformers`' fast tokenizers), and its trainer is what
`train_bpe` calls; SentencePiece and tiktoken files only load faithfully in their own libraries.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil

from parallax.errors import ConfigError

META_FILE = "parallax_tokenizer.json"
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.50 saves a tokenizer's chat template
# The tokenizer_config.json entries transformers hands a chat template as variables (its `special_tokens_map`).
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The eos token of a tokenizer whose config does not name one: the usual spellings, most specific first.
_EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
# Llama 3's pre-tokenizer split (its tiktoken `tokenizer.model` carries only the merges).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TIKTOKEN_SPECIALS = 256  # Llama 3: <|begin_of_text|>, <|end_of_text|>, then reserved tokens, after the merges


class Tokenizer:
    """The interface: `encode` / `encode_batch` (no special tokens), `decode`, and the ids."""

    kind: str
    vocab_size: int  # ids the tokenizer can emit: [0, vocab_size)
    eos_id: int | None
    bos_id: int | None = None
    add_bos: bool = False
    files: tuple = ()  # (name, path) of the files that define it
    source: str = ""  # what config.data.tokenizer named
    chat_template: str | None = None  # the Jinja chat template the tokenizer ships, if any
    template_tokens: dict = {}  # {"bos_token": "<s>", ...}: the strings a chat template may read

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def document(self, text: str) -> list[int]:
        """A document's ids as the corpus stores them: [bos] + text + [eos]."""
        return self.documents([text])[0]

    def documents(self, texts: list[str]) -> list[list[int]]:
        head = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        tail = [self.eos_id] if self.eos_id is not None else []
        return [head + ids + tail for ids in self.encode_batch(texts)]

    def prompt(self, text: str) -> list[int]:
        """A prompt's ids: [bos] + text (no eos)."""
        head = [self.bos_id] if self.add_bos and self.bos_id is not None else []
        return head + self.encode(text)

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A rendered conversation's ids, and each id's (start, end) character offsets in `text`. Unlike
        `encode`, the special tokens the text spells (a template's `<|im_start|>`) are their ids, as
        transformers' `apply_chat_template` encodes them; no bos is added (the template writes it)."""
        raise ConfigError(f"a {self.kind} tokenizer cannot encode a chat template's special tokens; use the "
                          "model's Hugging Face tokenizer (a tokenizer.json, or its directory)")

    @property
    def hash(self) -> str:
        digest = hashlib.sha256(self.kind.encode())
        for name, path in sorted(self.files):
            with open(path, "rb") as f:
                digest.update(b"\0" + name.encode() + b"\0" + f.read())
        if self.kind == "bytes":
            digest.update(f"\0eos={self.eos_id}".encode())
        return digest.hexdigest()

    def describe(self) -> str:
        return (f"{self.kind} tokenizer {self.source or ''} ({self.vocab_size} ids, eos {self.eos_id}, "
                f"bos {self.bos_id if self.add_bos else None})").replace("  ", " ")

    def meta(self) -> dict:
        return {"kind": self.kind, "hash": self.hash, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "bos_id": self.bos_id, "add_bos": self.add_bos, "files": sorted(n for n, _ in self.files)}

    def copy_to(self, directory: str) -> None:
        """Writes the defining files and `parallax_tokenizer.json` into `directory` (atomically per file)."""
        os.makedirs(directory, exist_ok=True)
        for name, path in self.files:
            target = os.path.join(directory, name)
            if os.path.abspath(path) != os.path.abspath(target):
                shutil.copyfile(path, target + ".tmp")
                os.replace(target + ".tmp", target)
        with open(os.path.join(directory, META_FILE + ".tmp"), "w") as f:
            json.dump(self.meta(), f, indent=2)
        os.replace(os.path.join(directory, META_FILE + ".tmp"), os.path.join(directory, META_FILE))


class ByteTokenizer(Tokenizer):
    kind = "bytes"

    def __init__(self, eos_id: int | None = None):
        self.eos_id = eos_id
        self.vocab_size = 256 if eos_id is None else max(256, eos_id + 1)
        self.source = "bytes"

    def encode_batch(self, texts):
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_chat(self, text):
        ids, offsets = [], []
        for i, char in enumerate(text):  # a byte tokenizer has no special tokens: the template's are text
            data = char.encode("utf-8")
            ids += data
            offsets += [(i, i + 1)] * len(data)
        return ids, offsets


def _token_content(value):
    """A tokenizer_config.json token entry: a string, or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer(Tokenizer):
    kind = "hf"

    def __init__(self, path: str):
        import tokenizers

        directory, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else \
            (os.path.dirname(path), path)
        try:
            self.tok = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 -- the library raises plain Exceptions for a bad file
            raise ConfigError(f"config.data.tokenizer={path!r}: {file} is not a readable tokenizer.json "
                              f"({str(e).splitlines()[0][:120]}); pass a file written by the tokenizers or "
                              "transformers library") from None
        self.files = [("tokenizer.json", file)]
        config = {}
        config_file = os.path.join(directory, "tokenizer_config.json")
        template_file = os.path.join(directory, CHAT_TEMPLATE_FILE)
        if os.path.basename(file) == "tokenizer.json" and os.path.isfile(config_file):
            self.files.append(("tokenizer_config.json", config_file))
            with open(config_file) as f:
                config = json.load(f)
        self.chat_template = _config_template(config.get("chat_template"))
        if os.path.basename(file) == "tokenizer.json" and os.path.isfile(template_file):
            self.files.append((CHAT_TEMPLATE_FILE, template_file))  # transformers reads it over the config's
            with open(template_file, encoding="utf-8") as f:
                self.chat_template = f.read()
        self.template_tokens = {k: _token_content(config[k]) for k in TEMPLATE_TOKENS
                                if isinstance(_token_content(config.get(k)), str)}
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        eos = _token_content(config.get("eos_token")) or next((t for t in _EOS_CANDIDATES if t in vocab), None)
        bos = _token_content(config.get("bos_token"))
        self.eos_id = vocab.get(eos) if eos else None
        self.bos_id = vocab.get(bos) if bos else None
        self.add_bos = bool(config.get("add_bos_token", False)) and self.bos_id is not None
        if self.bos_id is not None and "add_bos_token" not in config:  # Llama 3 adds it by its post-processor
            self.add_bos = self.bos_id in self.tok.encode("a", add_special_tokens=True).ids
        # Text is text: a literal "<|endoftext|>" in a document is encoded as its characters, not as the
        # eos id (which would end the document inside the row; tiktoken's encode_ordinary does the same).
        self.tok.encode_special_tokens = True
        self.source = path

    def encode_batch(self, texts):
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_chat(self, text):
        if not hasattr(self, "_chat_tok"):  # a second copy that reads special tokens: `tok` keeps text as text
            import tokenizers

            self._chat_tok = tokenizers.Tokenizer.from_str(self.tok.to_str())
            self._chat_tok.encode_special_tokens = False
        encoding = self._chat_tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, path: str):
        spm = _optional("sentencepiece", path)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"config.data.tokenizer={path!r}: not a readable SentencePiece model "
                              f"({str(e).splitlines()[0][:120]})") from None
        self.files = [("tokenizer.model", path)]
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.add_bos = self.bos_id is not None  # SentencePiece models (Llama 2, Gemma) start documents with it
        self.source = path

    def encode_batch(self, texts):
        return self.sp.encode(list(texts))

    def decode(self, ids) -> str:  # ids past the tokenizer's (a padded vocabulary's) are left out
        return self.sp.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])


class TiktokenTokenizer(Tokenizer):
    kind = "tiktoken"

    def __init__(self, path: str):
        tiktoken = _optional("tiktoken", path)
        ranks = {}
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        token, rank = line.split()
                        ranks[base64.b64decode(token)] = int(rank)
                    except ValueError:
                        raise ConfigError(f"config.data.tokenizer={path!r}:{number}: not a tiktoken BPE line "
                                          "(base64 token, space, rank)") from None
        n = len(ranks)
        names = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>"
                                                           for i in range(TIKTOKEN_SPECIALS - 2)]
        self.enc = tiktoken.Encoding(os.path.basename(path), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                     special_tokens={name: n + i for i, name in enumerate(names)})
        self.files = [("tokenizer.model" if path.endswith(".model") else "tokenizer.tiktoken", path)]
        self.vocab_size, self.bos_id, self.eos_id, self.add_bos = n + TIKTOKEN_SPECIALS, n, n + 1, True
        self.template_tokens = {"bos_token": names[0], "eos_token": names[1]}
        self.source = path

    def encode_batch(self, texts):
        return self.enc.encode_ordinary_batch(list(texts))

    def encode_chat(self, text):
        ids = self.enc.encode(text, allowed_special="all")
        _, starts = self.enc.decode_with_offsets(ids)
        return ids, list(zip(starts, starts[1:] + [len(text)]))

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids if int(i) < self.vocab_size - TIKTOKEN_SPECIALS])


def _config_template(value) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of {"name", "template"} (the "default" one)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _optional(package: str, path: str):
    try:
        return __import__(package)
    except ImportError:
        raise ConfigError(f"config.data.tokenizer={path!r} needs the {package} package; pip install {package} "
                          "(or parallax[data])") from None


def _is_sentencepiece(path: str) -> bool:
    """A SentencePiece model is a protobuf (binary); a tiktoken file is lines of base64 and a rank."""
    with open(path, "rb") as f:
        head = f.read(256)
    try:
        first = head.split(b"\n")[0].decode("ascii").split()
        return not (len(first) == 2 and first[1].isdigit())
    except UnicodeDecodeError:
        return True


def load(spec: str, eos_id: int | None = None, key: str = "config.data.tokenizer") -> Tokenizer:
    """The tokenizer `spec` names (see the module doc); `eos_id` is the byte tokenizer's optional eos. `key`:
    what the person typed to name it, which an error names (e.g. prepare_data.py's `--tokenizer`)."""
    try:
        return _load(spec, eos_id)
    except ConfigError as e:
        default = "config.data.tokenizer="
        if key == default[:-1] or not str(e).startswith(default):
            raise
        raise ConfigError(f"{key}={str(e)[len(default):]}") from None


def _load(spec: str, eos_id: int | None = None) -> Tokenizer:
    if spec in ("", "bytes"):
        return ByteTokenizer(eos_id)
    path = os.path.expanduser(spec)
    if not os.path.exists(path):
        raise ConfigError(f"config.data.tokenizer={spec!r}: no such file or directory; pass 'bytes', a "
                          "tokenizer.json, an HF model directory, or a SentencePiece / tiktoken model file")
    if os.path.isdir(path):
        meta = os.path.join(path, META_FILE)
        kind = json.load(open(meta))["kind"] if os.path.isfile(meta) else None
        if kind == "bytes":
            return ByteTokenizer(json.load(open(meta))["eos_id"])
        if os.path.isfile(os.path.join(path, "tokenizer.json")) and kind in (None, "hf"):
            return HFTokenizer(path)
        for name in ("tokenizer.model", "tokenizer.tiktoken"):
            if os.path.isfile(os.path.join(path, name)):
                return _load(os.path.join(path, name))
        raise ConfigError(f"config.data.tokenizer={spec!r}: the directory holds no tokenizer.json, "
                          "tokenizer.model or tokenizer.tiktoken; pass the directory of an HF model or a file")
    if path.endswith(".json"):
        return HFTokenizer(path)
    if path.endswith(".tiktoken") or (path.endswith(".model") and not _is_sentencepiece(path)):
        return TiktokenTokenizer(path)
    if path.endswith(".model"):
        return SentencePieceTokenizer(path)
    raise ConfigError(f"config.data.tokenizer={spec!r}: unknown kind of file; pass a tokenizer.json, an HF "
                      "model directory, a SentencePiece .model or a tiktoken .tiktoken / tokenizer.model")


def read_meta(directory: str) -> dict | None:
    """The `parallax_tokenizer.json` of a copy, or None where there is none."""
    path = os.path.join(directory, META_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def has_files(directory: str) -> bool:
    """Whether `directory` (e.g. an HF model directory) holds a tokenizer that `load` can read."""
    return any(os.path.isfile(os.path.join(directory, n)) for n in ("tokenizer.json", "tokenizer.model",
                                                                    "tokenizer.tiktoken"))


def padded_vocab(vocab_size: int, multiple: int) -> int:
    """`vocab_size` rounded up to a multiple of `multiple` (the model's vocabulary for a tokenizer)."""
    return -(-vocab_size // multiple) * multiple


EOS_TOKEN = "<|endoftext|>"


def train_bpe(texts, vocab_size: int, out_dir: str, show_progress: bool = True) -> HFTokenizer:
    """Trains a byte-level BPE of `vocab_size` ids (the byte-level scheme: no unknown token, any text encodes;
    `<|endoftext|>` is id 0 and the eos) on the iterable of strings `texts` with the `tokenizers` trainer,
    and writes `tokenizer.json` + `tokenizer_config.json` (loadable by `transformers` too) into `out_dir`."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ConfigError(f"--vocab_size={vocab_size}: a byte-level BPE needs at least 257 ids (256 bytes + eos)")
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "bos_token": None,
                   "add_bos_token": False, "model_max_length": 1 << 30}, f, indent=2)
    return HFTokenizer(out_dir)
