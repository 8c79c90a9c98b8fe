"""Preference pairs for DPO (`data.source='preference'`): a .jsonl of (prompt, chosen, rejected), tokenized as
TRL's DPOTrainer tokenizes them, one pair per batch row.

A row of the file is `{"prompt": ..., "chosen": ..., "rejected": ...}`, either three strings (plain text: the
tokenizer's eos text is appended to each response that lacks it, and prompt + response is encoded as one
text, as TRL does) or three lists of messages (conversational: the prompt rendered with the chat template's
generation prompt, and prompt + response rendered whole; `tools` as for chat rows). The response starts where
the prompt's ids and prompt + response's ids diverge (TRL's `common_prefix_length`). With `dpo.max_length`,
each of prompt + chosen and prompt + rejected keeps its first `max_length` ids, and a pair whose prompt alone
fills them is dropped (TRL's keep_start truncation). The pair then has to fit one row: prompt + chosen and
prompt + rejected, `train.seq_len + 1` tokens together; a longer pair is an error naming its line, not cut.

A batch row is those two documents (segment ids 1 and 2, positions from 0 in each, padding after), with
`weights` 1 on the targets that are response tokens, `sign` +1 on the chosen response's and -1 on the
rejected one's, and `ref_logps` the reference's sums (`dpo_settings.BATCH_KEYS`). So a pair never straddles
data shards or microbatches. Which pair a row holds is a function of (seed, step, row): the sampler 'epoch'
(a seeded permutation of the pairs per epoch) or 'random' (drawn with replacement); the eval split (the last
`data.eval_fraction` of the file's pairs) is read in order.

The reference's sums are computed once, by the run, from its starting parameters (`parallax.train`), and
handed to the dataset (`set_reference`); a batch needs them. Every bad row stops the run before anything is
written, with one line naming the file and line and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json

import numpy as np

from parallax import chat
from parallax.errors import ConfigError

SPLITS = ("train", "eval")
KEYS = ("prompt", "chosen", "rejected")


class PreferenceError(ConfigError):
    """A preference file or row that cannot be trained on; the message names the file, the line and the fix."""


@dataclasses.dataclass(frozen=True)
class Pair:
    prompt: tuple  # the prompt's ids (up to where it and prompt + response diverge)
    chosen: tuple  # the chosen response's ids
    rejected: tuple


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _is_conversational(record) -> bool:
    return isinstance(record.get("prompt"), list)


def tokenize_pair(tok, record: dict, template=None) -> Pair | None:
    """A row's ids as TRL's DPOTrainer makes them (before truncation). Raises ValueError / ChatError."""
    missing = [k for k in KEYS if k not in record]
    if missing:
        raise ValueError(f"no {', '.join(repr(k) for k in missing)} (a preference row has 'prompt', 'chosen' and "
                         "'rejected'; a row with only 'chosen' and 'rejected' needs its prompt split out)")
    if _is_conversational(record):
        if template is None:
            raise ValueError("a conversational row, but the tokenizer has no chat template; set dpo.chat_template")
        prompt = chat._messages(record["prompt"], "prompt")
        chosen, rejected = (chat._messages(record[k], k, "assistant") for k in ("chosen", "rejected"))
        tools = chat._tools(record)

        def ids(messages, **kw):
            return tok.encode_chat(chat.render(template, messages, tools=tools, **kw))[0]
        prompt_ids = ids(prompt, add_generation_prompt=True)
        with_chosen, with_rejected = ids(prompt + chosen), ids(prompt + rejected)
    else:
        if not all(isinstance(record[k], str) for k in KEYS):
            kinds = ", ".join(f"{k}: {type(record[k]).__name__}" for k in KEYS)
            raise ValueError(f"'prompt', 'chosen' and 'rejected' must be three strings or three lists of messages "
                             f"({kinds})")
        eos = tok.template_tokens.get("eos_token")
        if eos is None:
            raise ValueError("plain-text pairs end each response with the tokenizer's eos text, and this tokenizer "
                             "names none; use a Hugging Face tokenizer with an eos_token")
        head = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []

        def ids(text):  # transformers' tokenizer(text): special tokens the text spells are their ids
            return head + tok.encode_chat(text)[0]
        prompt_ids = ids(record["prompt"])
        chosen, rejected = (r if r.endswith(eos) else r + eos for r in (record["chosen"], record["rejected"]))
        with_chosen, with_rejected = ids(record["prompt"] + chosen), ids(record["prompt"] + rejected)
    n = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
    return Pair(tuple(prompt_ids[:n]), tuple(with_chosen[n:]), tuple(with_rejected[n:]))


def read_pairs(path: str, tok, settings, seq_len: int) -> tuple[list, int]:
    """(pairs, number dropped by max_length) of the file at `path`; raises PreferenceError (one line) for the
    first bad row."""
    template = None
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise PreferenceError(f"config.data.path={path!r}: cannot read it ({e.strerror}); point it at a .jsonl of "
                              "preference rows") from None
    pairs, dropped, limit = [], 0, settings.max_length
    with f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError:
                raise PreferenceError(f"{where}: not a JSON object; each line is one preference row") from None
            if not isinstance(record, dict):
                raise PreferenceError(f"{where}: not a JSON object; each line is one preference row")
            if template is None and _is_conversational(record) and (settings.chat_template or tok.chat_template):
                try:
                    template = chat.resolve(settings.chat_template, tok, "config.dpo.chat_template")
                except chat.ChatError as e:
                    raise PreferenceError(f"config.dpo.chat_template={settings.chat_template!r}: {e}") from None
            try:
                pair = tokenize_pair(tok, record, template)
            except (ValueError, chat.ChatError) as e:
                raise PreferenceError(f"{where}: {e}") from None
            if pair.chosen == pair.rejected:
                raise PreferenceError(f"{where}: 'chosen' equals 'rejected', a pair that prefers nothing (its loss is "
                                      "log 2 whatever the model); drop the row or fix its responses")
            if not pair.prompt:
                raise PreferenceError(f"{where}: the prompt is empty, so a response's first token is predicted from "
                                      "nothing; give the row a prompt")
            if not pair.chosen or not pair.rejected:
                raise PreferenceError(f"{where}: an empty response; drop the row or give it both responses")
            if limit:
                if len(pair.prompt) >= limit:  # TRL drops it: keep_start would leave no response token
                    dropped += 1
                    continue
                keep = limit - len(pair.prompt)
                pair = Pair(pair.prompt, pair.chosen[:keep], pair.rejected[:keep])
            tokens = 2 * len(pair.prompt) + len(pair.chosen) + len(pair.rejected)
            if tokens > seq_len + 1:
                raise PreferenceError(
                    f"{where}: the pair takes {tokens} tokens (prompt + chosen, then prompt + rejected in one row), "
                    f"more than train.seq_len + 1 = {seq_len + 1}; raise train.seq_len to {tokens - 1}, or cut "
                    f"pairs with dpo.max_length")
            pairs.append(pair)
    if not pairs:
        raise PreferenceError(f"config.data.path={path!r}: no preference rows"
                              + (f" ({dropped} dropped: prompts of dpo.max_length={limit} tokens or more)"
                                 if dropped else "") + "; point it at a .jsonl of prompt / chosen / rejected rows")
    return pairs, dropped


def pack_pair(pair: Pair | None, seq_len: int, ref=(0.0, 0.0)) -> dict:
    """One batch row ([seq_len] arrays) of `pair` (None: an empty row, weight 0 everywhere)."""
    row = np.zeros(seq_len + 1, np.int64)
    segments, positions = np.zeros(seq_len + 1, np.int32), np.zeros(seq_len + 1, np.int32)
    trained, sign = np.zeros(seq_len + 1, np.float32), np.zeros(seq_len + 1, np.float32)
    ref_logps = np.zeros(seq_len + 1, np.float32)
    at = 0
    if pair is not None:
        for segment, response, s, r in ((1, pair.chosen, 1.0, ref[0]), (2, pair.rejected, -1.0, ref[1])):
            doc = pair.prompt + response
            row[at:at + len(doc)] = doc
            segments[at:at + len(doc)] = segment
            positions[at:at + len(doc)] = np.arange(len(doc))
            first = at + len(pair.prompt)  # the response's first token: the target of the position before it
            trained[first:at + len(doc)] = 1.0
            sign[first:at + len(doc)] = s
            ref_logps[first] = r
            at += len(doc)
    # Targets are the next token: position t trains token t + 1 (of the same document, by construction).
    return {"inputs": row[:-1].astype(np.int32), "targets": row[1:].astype(np.int32),
            "segment_ids": segments[:-1], "positions": positions[:-1], "weights": trained[1:],
            "sign": sign[1:], "ref_logps": ref_logps[1:]}


class PreferenceDataset:
    """Batches of preference pairs for `(seed, step, split)` (`make_dataset`); the `parallax.data.Dataset`
    surface the training loop reads, plus the reference's sums (`set_reference`)."""

    source = "preference"
    mixture_sources = ()

    def __init__(self, path, pairs, dropped, seq_len, global_batch_size, seed, eval_fraction, sampler, tokenizer):
        n_eval = int(len(pairs) * eval_fraction)
        self.path, self.seq_len, self.global_batch_size, self.seed = path, seq_len, global_batch_size, seed
        self.sampler, self.dropped, self.tokenizer = sampler, dropped, tokenizer
        self.pairs = {"train": pairs[:len(pairs) - n_eval], "eval": pairs[len(pairs) - n_eval:]}
        self.reference = {split: None for split in SPLITS}

    @property
    def streams(self) -> dict:
        """Pairs per split (None where a split has none), as `Dataset.streams` says whether a split exists."""
        return {split: self.pairs[split] or None for split in SPLITS}

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 of every pair's ids and its split: what a stored reference was computed on."""
        digest = hashlib.sha256()
        for split in SPLITS:
            digest.update(f"\0{split}:{len(self.pairs[split])}".encode())
            for p in self.pairs[split]:
                digest.update(np.asarray([len(p.prompt), len(p.chosen), len(p.rejected), *p.prompt, *p.chosen,
                                          *p.rejected], np.int64).tobytes())
        return digest.hexdigest()

    def set_reference(self, split: str, sums: np.ndarray) -> None:
        """The reference's [pairs, 2] log-prob sums (chosen, rejected) of `split`'s pairs, in file order."""
        sums = np.asarray(sums, np.float32)
        if sums.shape != (len(self.pairs[split]), 2):
            raise ValueError(f"a {split} reference of shape {sums.shape} for {len(self.pairs[split])} pairs")
        self.reference[split] = sums

    def rows(self, split: str, indices, with_reference: bool = True) -> dict:
        """Batch rows of `split`'s pairs at `indices` (-1: an empty row), with the reference's sums."""
        ref = self.reference[split]
        if with_reference and ref is None:
            raise ValueError(f"the {split} pairs' reference log-probs are not set (set_reference)")
        packed = [pack_pair(self.pairs[split][i] if i >= 0 else None, self.seq_len,
                            ref[i] if with_reference and i >= 0 else (0.0, 0.0)) for i in indices]
        return {k: np.stack([p[k] for p in packed]) for k in packed[0]}

    def batch(self, step: int, split: str = "train", *, rows: tuple[int, int] | None = None,
              source: str | None = None) -> dict:
        """This host's rows `[lo, hi)` of the global batch of `step` (all rows by default)."""
        if source is not None:
            raise ValueError(f"source={source!r}: preference pairs have no mixture")
        lo, hi = rows if rows is not None else (0, self.global_batch_size)
        return self.rows(split, [self._pair(step, split, r) for r in range(lo, hi)])

    def _pair(self, step: int, split: str, row: int) -> int:
        n, g = len(self.pairs[split]), step * self.global_batch_size + row
        if split == "eval":
            return g % n
        if self.sampler == "random":
            return int(np.random.default_rng([self.seed, 0, step, row]).integers(n))
        epoch, i = divmod(g, n)
        return int(_permutation(self.seed, epoch, n)[i])

    def epoch(self, step: int) -> float:
        return step * self.global_batch_size / len(self.pairs["train"])

    def describe(self) -> str:
        dropped = f", {self.dropped} dropped by dpo.max_length" if self.dropped else ""
        return (f"preference pairs {self.path}: {len(self.pairs['train'])} train, {len(self.pairs['eval'])} eval"
                f"{dropped} ({self.tokenizer.describe()})")


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, 0, epoch]).permutation(n)


def make_dataset(path: str, tok, settings, *, seq_len: int, global_batch_size: int, seed: int,
                 eval_fraction: float, sampler: str) -> PreferenceDataset:
    """The pairs of the .jsonl at `path` tokenized with `tok` under `settings` (`DpoSettings`); raises
    PreferenceError (a ConfigError) naming the file and line of the first bad row."""
    if tok is None:
        raise PreferenceError("config.data.tokenizer='': preference pairs are text; set data.tokenizer to the "
                              "model's Hugging Face tokenizer (its directory or tokenizer.json)")
    if sampler not in ("random", "epoch"):
        raise PreferenceError(f"config.data.sampler={sampler!r}: use 'random' or 'epoch'")
    pairs, dropped = read_pairs(path, tok, settings, seq_len)
    return PreferenceDataset(path, pairs, dropped, seq_len, global_batch_size, seed, eval_fraction, sampler, tok)
