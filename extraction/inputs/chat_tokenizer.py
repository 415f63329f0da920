"""Tokenization: a conversation through the target's chat template, its loss mask, its bound.

ChatTokenizer renders a conversation (extraction/inputs/dataset.py's Conversation) with the chat
template, tokenizes it and marks the assistant's tokens; with a token bound (--max-length, else
the model's context) it cuts the sample to it, and a long text already before it is tokenized
(ChatTokenizer._cut_point says why that is safe). The tokenizer's identity for run.json
(tokenizer_hash, the template's hash) lives here too.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from extraction.backends.base import Sample

if TYPE_CHECKING:
    from extraction.inputs.dataset import Conversation

# Tokens beyond --max-length tokenized before the cut text is trusted to hold the first ones (see
# ChatTokenizer._cut_point).
CUT_SLACK_TOKENS = 64
_SPLIT = re.compile(r"\S(?=\s)")  # a non-space character followed by whitespace: cut after it


def sha256_text(text: str | None) -> str | None:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def tokenizer_hash(model_dir: str | os.PathLike) -> str:
    """sha256 over the tokenizer files present in the model directory (names + bytes)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        p = Path(model_dir) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def load_tokenizer(model_dir: str | os.PathLike) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.fspath(model_dir), trust_remote_code=True)


def chat_template_of(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or json.dumps(template, sort_keys=True)
    return template


class ChatTokenizer:
    """Applies the target's chat template and marks assistant tokens in the loss mask.

    An assistant turn's span is found by rendering the conversation up to it twice: with the
    generation prompt (ends where the assistant text starts) and with the turn itself (ends after
    its closing tokens, which the drafter must learn too). Templates that rewrite earlier turns
    fall back to finding the content text itself.

    Runs in the runner's tokenizer process (or, with Runner(tokenizer_process=False), on a thread
    beside the forward pass, which is why it keeps its time under the GIL short): a conversation's prefixes
    are rendered in two batched template calls, a fast tokenizer's Rust backend is called directly
    (`encode_batch` releases the GIL; the transformers wrapper around it is Python), and the loss
    mask is computed on tensors. The direct call is trusted only after it gave exactly what
    `tokenizer(...)` gives on the first text; otherwise the wrapper is used throughout.
    """

    def __init__(self, tokenizer: Any, max_length: int | None = None):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.use_offsets = bool(getattr(tokenizer, "is_fast", False))
        backend = getattr(tokenizer, "_tokenizer", None) if self.use_offsets else None
        self._backend = backend if callable(getattr(backend, "encode_batch", None)) else None
        self._backend_checked = False
        self._batched_render = True
        self._render_checked = False
        self._chars_per_token: int | None = None  # the vocabulary's longest token, in characters
        self._cut_checked = False  # the first cut text was compared with the whole text's tokens
        self._cut_ok = True

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def render_many(
        self, conversations: list[list[dict[str, str]]], add_generation_prompt: bool
    ) -> list[str]:
        """render() of each conversation, in one batched template call where the tokenizer has
        one (checked against single renders the first time)."""
        if not conversations:
            return []
        if self._batched_render:
            try:
                out = self.tokenizer.apply_chat_template(
                    conversations, tokenize=False, add_generation_prompt=add_generation_prompt
                )
            except Exception:  # a row the template refuses (raised again below), or no batches
                out = None
            ok = (
                isinstance(out, list)
                and len(out) == len(conversations)
                and all(isinstance(t, str) for t in out)
            )
            if ok and self._render_checked:
                return out
            singles = [self.render(c, add_generation_prompt) for c in conversations]  # a row's own error
            self._batched_render = ok and out == singles
            self._render_checked = True
            return singles
        return [self.render(c, add_generation_prompt) for c in conversations]

    def _render_all(self, messages: list[dict[str, str]]) -> tuple[str, dict[int, str], dict[int, str]]:
        """(whole conversation, {k: render(messages[:k], gen prompt)}, {k: render(messages[:k+1])})
        for the assistant turns k: every render assistant_spans needs, in two template calls."""
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        n = len(messages)
        before_ks = [k for k in turns if k]
        befores = dict(zip(before_ks, self.render_many([messages[:k] for k in before_ks], True), strict=True))
        upto_ks = [k for k in turns if k + 1 < n]  # messages[:n] is the whole conversation
        rendered = self.render_many([messages[: k + 1] for k in upto_ks] + [messages], False)
        text = rendered[-1]
        uptos = dict(zip(upto_ks, rendered[:-1], strict=True))
        if turns and turns[-1] == n - 1:
            uptos[n - 1] = text
        return text, befores, uptos

    def assistant_spans(
        self,
        messages: list[dict[str, str]],
        text: str,
        rendered: tuple[dict[int, str], dict[int, str]] | None = None,
    ) -> list[tuple[int, int]]:
        befores, uptos = rendered if rendered is not None else self._render_all(messages)[1:]
        spans = []
        cursor = 0
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = befores[k] if k else ""
            upto = uptos[k]
            if k and text.startswith(before) and text.startswith(upto) and len(before) >= cursor:
                spans.append((len(before), len(upto)))
                cursor = len(upto)
                continue
            pos = text.find(m["content"], cursor)
            if pos < 0:
                raise ValueError(f"assistant turn {k} not found in the rendered chat template")
            spans.append((pos, pos + len(m["content"])))
            cursor = pos + len(m["content"])
        return spans

    def _ids_and_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if self._backend is not None and self._backend_checked:
            enc = self._backend.encode_batch([text], add_special_tokens=False)[0]
            return enc.ids, enc.offsets
        ref = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(ref["input_ids"]), [tuple(o) for o in ref["offset_mapping"]]
        if self._backend is not None:  # first text: the wrapper has configured the backend; compare
            enc = self._backend.encode_batch([text], add_special_tokens=False)[0]
            if list(enc.ids) != ids or [tuple(o) for o in enc.offsets] != offsets:
                self._backend = None
            self._backend_checked = True
        return ids, offsets

    def _cut_point(self, text: str) -> int | None:
        """Where `text` may be cut before tokenizing without changing its first max_length tokens,
        or None (no bound, no cut needed or none found, a slow tokenizer, or cuts found unsafe).

        Why it is safe: no token covers more characters than the vocabulary's longest token (L),
        so the first N = max_length + CUT_SLACK_TOKENS tokens lie within the first N * L characters.
        The cut is at the first place after that where a non-space character is followed by
        whitespace: the pre-tokenizers of byte-level BPE and SentencePiece tokenizers split there,
        and tokens never cross such a split, so every token before the cut is the whole text's.
        A normalizer that drops characters would break the first argument, so the first cut is
        checked (_check_cut) and cuts are given up if it fails."""
        if self.max_length is None or not self.use_offsets or not self._cut_ok:
            return None
        if self._chars_per_token is None:
            vocab = self.tokenizer.get_vocab()
            self._chars_per_token = max((len(t) for t in vocab), default=1) or 1
        at = (self.max_length + CUT_SLACK_TOKENS) * self._chars_per_token
        if len(text) <= at + 1:
            return None
        return _split_after(text, at)

    def _check_cut(self, text: str, cut: int) -> tuple[list[int], list[tuple[int, int]]] | None:
        """The first cut's check: the cut text's first max_length tokens (ids and offsets) must be
        those of a text reaching at least twice as far (the next split after 2 * cut, or the whole
        text when it ends before), and the cut text must hold more than max_length tokens. Returns
        the cut text's tokens when it holds (and keeps cutting), None when it does not (and gives
        cuts up for good). Never the whole of a long text (issue #49 item 7: the first long row
        cost ~500 MiB a MiB of text): what is tokenized stays within a few times the cut."""
        n = self.max_length or 0
        far = _split_after(text, 2 * cut) if len(text) > 2 * cut + 1 else len(text)
        longer = self._ids_and_offsets(text[: far if far is not None else 2 * cut])
        cut_ids = self._ids_and_offsets(text[:cut])
        self._cut_ok = list(longer[0][:n]) == list(cut_ids[0][:n]) and len(cut_ids[0]) > n
        self._cut_ok = self._cut_ok and [tuple(o) for o in longer[1][:n]] == [
            tuple(o) for o in cut_ids[1][:n]
        ]
        self._cut_checked = True
        return cut_ids if self._cut_ok else None

    def encode(self, conv: Conversation) -> Sample:
        text, befores, uptos = self._render_all(conv.messages)
        spans = self.assistant_spans(conv.messages, text, (befores, uptos))
        cut = self._cut_point(text)
        checked = None
        if cut is not None and not self._cut_checked:  # once: the cut must change no kept token
            checked = self._check_cut(text, cut)
            cut = cut if checked is not None else None
        if self.use_offsets:
            ids, offsets = checked or self._ids_and_offsets(text if cut is None else text[:cut])
            mask_t = _span_mask(offsets, spans)
        else:  # slow tokenizers have no offsets: tokenize piece by piece at span boundaries
            ids, mask, pos = [], [], 0
            for s1, e1 in spans + [(len(text), len(text))]:
                for piece, flag in ((text[pos:s1], 0), (text[s1:e1], 1)):
                    if piece:
                        got = self.tokenizer.encode(piece, add_special_tokens=False)
                        ids += got
                        mask += [flag] * len(got)
                pos = e1
            mask_t = torch.tensor(mask, dtype=torch.long)
        full = len(ids) if cut is None else None  # the whole text's count is unknown after a cut
        truncated = self.max_length is not None and len(ids) > self.max_length
        if truncated:
            ids, mask_t = ids[: self.max_length], mask_t[: self.max_length].clone()
        if not ids:
            raise ValueError("the chat template produced no tokens")
        return Sample(
            sample_id=conv.sample_id,
            input_ids=torch.from_numpy(np.array(ids, dtype=np.int64)),
            loss_mask=mask_t,
            truncated=truncated,
            meta={"line": conv.line, "num_tokens_full": full},
        )


def _split_after(text: str, at: int) -> int | None:
    """The end of the first split (a non-space character followed by whitespace) from character
    `at` on, looked for within reach (up to 2 * at + 64 Ki characters), or None."""
    split = _SPLIT.search(text, at - 1, 2 * at + (1 << 16))
    return split.end() if split is not None else None


def _span_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> torch.Tensor:
    """1 for each token whose character range [s, e) overlaps a span [s1, e1): s < e1 and e > s1."""
    if not offsets:
        return torch.zeros(0, dtype=torch.long)
    flat = np.fromiter(itertools.chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets))
    off = torch.from_numpy(flat).view(-1, 2)  # ~4x cheaper than torch.tensor(list of tuples)
    start, end = off[:, 0], off[:, 1]
    mask = torch.zeros(len(offsets), dtype=torch.bool)
    for s1, e1 in spans:
        mask |= (start < e1) & (end > s1)
    return mask.long()
