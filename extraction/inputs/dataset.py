"""Dataset rows in, conversations out: ShareGPT and OpenAI JSONL, stable ids, row errors.

A row's id is its `id` field when it has one, else a hash of its normalized messages, so a
resume, a second node and a re-ordered file all agree on which sample is which. Rows that cannot
be used become `RowError`s (line number + reason) and the run goes on without them.

A row is data, not truth: whatever a line holds (invalid JSON, JSON nested a hundred thousand
deep, a lone surrogate such as JSON's "\\ud83d" - half an emoji, common in scraped chat data -
in its text or id) becomes one RowError in the scan and never an exception: every string the scan
lets through (ids, message contents) is valid Unicode, so hashing, node assignment, shard names,
the tokenizer and errors.jsonl can encode it without a check of their own.

A row is bounded: one longer than --max-row-bytes is a row error, read past in pieces, never parsed
(DEFAULT_MAX_ROW_BYTES); the dataset is opened without blocking (a FIFO is refused, not waited on).
Tokenization is extraction/inputs/chat_tokenizer.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from extraction.inputs import config
from extraction.inputs.preflight import open_regular_file

ROLE_NAMES = {
    "system": "system",
    "developer": "system",  # OpenAI's newer name for the system turn
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
}


# The row shapes a dataset may hold, for messages that tell a user what a row must look like.
ROW_SHAPES = (
    "'conversations' (ShareGPT: a list of {\"from\", \"value\"} turns)",
    "'messages' (OpenAI: a list of {\"role\", \"content\"} turns)",
)

# A row longer than this (bytes, without its newline) is a row error, never parsed or tokenized:
# parsing and rendering cost a multiple of its size (a 20 MB row reached 9.3 GB). A few MiB hold a
# conversation far past any model's context (128k tokens are ~0.5 MiB of text). --max-row-bytes.
DEFAULT_MAX_ROW_BYTES = config.DEFAULT_MAX_ROW_BYTES
_SKIP_CHUNK = 1 << 20  # an over-long row is read past in pieces of this size


class RowError(ValueError):
    """A dataset row that cannot become a sample; `line` is 1-based."""

    def __init__(self, line: int, reason: str, sample_id: str | None = None):
        self.line = line
        self.reason = reason
        self.sample_id = sample_id
        super().__init__(f"line {line}: {reason}")

    def to_record(self) -> dict[str, Any]:
        return {"kind": "row", "line": self.line, "sample_id": self.sample_id, "reason": self.reason}


@dataclass
class Conversation:
    sample_id: str
    messages: list[dict[str, str]]
    line: int


@dataclass
class DatasetEntry:
    """Where a valid row lives, so 37k conversations need not sit in memory at once."""

    sample_id: str
    line: int
    offset: int


@dataclass
class DatasetScan:
    path: str
    entries: list[DatasetEntry] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)
    sha256: str = ""


def _brief(value: Any) -> str:
    """A short, safe description of a value from a row for a reason: a string's start, or the
    type of anything else (never its whole repr: that may be huge or nested too deep to print)."""
    if isinstance(value, str):
        return repr(value[:60]) + ("..." if len(value) > 60 else "")
    if value is None or isinstance(value, bool | int | float):
        text = repr(value)
        return text if len(text) <= 60 else text[:60] + "..."
    return f"a JSON {'array' if isinstance(value, list) else 'object'}"


def _valid_text(text: str, where: str) -> str:
    """`text`, when it is valid Unicode (encodable as UTF-8); ValueError naming the first lone
    surrogate otherwise. JSON lets a row hold "\\ud83d" alone; nothing downstream can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{where} holds a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}): "
            "not valid Unicode text (half of a UTF-16 pair, e.g. a cut emoji); fix or drop the row"
        ) from None
    return text


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: keep the text ones, refuse anything else
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else None
                what = f"type {_brief(kind)}" if isinstance(part, dict) else _brief(part)
                raise ValueError(f"{where}: only text content parts are supported, got {what}")
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string, got {type(content).__name__}")


# Keys of an OpenAI turn passed on to the chat template besides role and content, by role: an
# assistant's tool calls and a tool's answer to one, which templates that know tools render (one
# that does not ignores them). Nothing else is passed on (a row's other keys never change its id).
TOOL_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}


def _valid_json(value: Any, where: str) -> Any:
    """`value` (a row's JSON), when every string in it is valid Unicode; ValueError otherwise."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{where} holds a lone surrogate: not valid Unicode text; fix or drop the row"
        ) from None
    return value


def _message(turn: Any, where: str, role_key: str, text_key: str) -> dict[str, Any]:
    """One turn as {role, content[, tool keys]}; ValueError says what is wrong.

    Tool use (OpenAI shape): an assistant turn that only calls tools has `content` null or absent
    (kept as "" beside its `tool_calls`, a list of objects); a `tool` turn answers with its
    `tool_call_id`/`name`. Those keys go to the chat template as given (TOOL_KEYS)."""
    if not isinstance(turn, dict):
        raise ValueError(f"{where} must be an object")
    if role_key not in turn:
        raise ValueError(f"{where} needs '{role_key}' and '{text_key}'")
    given_role = turn[role_key]
    role = ROLE_NAMES.get(given_role.lower()) if isinstance(given_role, str) else None
    if role is None:
        raise ValueError(f"{where}: unknown role {_brief(given_role)}")
    tool_calls = turn.get("tool_calls") if role == "assistant" else None
    if tool_calls is not None and (
        not isinstance(tool_calls, list) or not tool_calls or not all(isinstance(c, dict) for c in tool_calls)
    ):
        raise ValueError(f"{where}: tool_calls must be a list of objects, got {_brief(tool_calls)}")
    if text_key not in turn and tool_calls is None:
        raise ValueError(f"{where} needs '{role_key}' and '{text_key}'")
    raw = turn.get(text_key)
    if raw is None and (tool_calls is not None or role == "tool"):
        raw = ""
    message: dict[str, Any] = {
        "role": role,
        "content": _valid_text(_content_text(raw, where), f"{where}.{text_key}"),
    }
    for key in TOOL_KEYS.get(role, ()):
        if turn.get(key) is not None:
            message[key] = _valid_json(turn[key], f"{where}.{key}")
    return message


def normalize_row(row: Any) -> tuple[str | None, list[dict[str, Any]]]:
    """(given id or None, [{role, content[, tool keys]}]) from either shape; ValueError says what
    is wrong. At least one assistant turn must hold something to train on (text or a tool call)."""
    if not isinstance(row, dict):
        raise ValueError(f"row must be a JSON object, got {type(row).__name__}")
    if "conversations" in row:
        turns, role_key, text_key, shape = row["conversations"], "from", "value", "conversations"
    elif "messages" in row:
        turns, role_key, text_key, shape = row["messages"], "role", "content", "messages"
    else:
        raise ValueError(f"row has neither {ROW_SHAPES[0]} nor {ROW_SHAPES[1]}")
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'{shape}' must be a non-empty list")
    messages = [_message(turn, f"{shape}[{i}]", role_key, text_key) for i, turn in enumerate(turns)]
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn: nothing to train on")
    given = row.get("id")
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, str | int) or str(given).strip() == "":
            raise ValueError(f"'id' must be a non-empty string or integer, got {_brief(given)}")
        given = _valid_text(str(given), "'id'")
    if not any(m["role"] == "assistant" and (m["content"].strip() or m.get("tool_calls")) for m in messages):
        raise ValueError(
            "every assistant turn is empty: nothing to train on (fill the assistant's reply or drop the row)"
        )
    return given, messages


def _id_of_bad_row(row: Any) -> str | None:
    """The `id` a rejected row gives, for its RowError: only a usable one (valid text), since the
    record goes to errors.jsonl and people grep for it."""
    given = row.get("id") if isinstance(row, dict) else None
    if isinstance(given, bool) or not isinstance(given, str | int):
        return None
    try:
        return _valid_text(str(given), "'id'")
    except ValueError:
        return None


def content_id(messages: list[dict[str, str]]) -> str:
    """The stable id of a row without one: a hash of its normalized messages."""
    canon = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    # surrogatepass: the same bytes as "strict" for valid text (all a scanned row can hold); for a
    # lone surrogate, a hash instead of a UnicodeEncodeError
    return "h" + hashlib.sha256(canon.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def parse_line(raw: bytes, line: int) -> Conversation:
    """One JSONL line -> Conversation; RowError with the line number otherwise."""
    try:
        row = json.loads(raw)
    except RecursionError:
        raise RowError(line, "invalid JSON: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise RowError(line, f"invalid JSON: {e}") from None
    try:
        given, messages = normalize_row(row)
    except (ValueError, RecursionError) as e:
        reason = str(e) if isinstance(e, ValueError) else "nested too deeply"
        raise RowError(line, reason, _id_of_bad_row(row)) from None
    return Conversation(given if given is not None else content_id(messages), messages, line)


def _bounded_lines(f: BinaryIO, limit: int, digest: Any) -> Iterator[tuple[int, bytes | None, int, int]]:
    """(offset, line, size with its newline, length without) for each line of `f`, every byte into
    `digest`; `line` is None when its length is over `limit`: it is then read past in pieces, so no
    more than `limit` + a piece is ever in memory for one line."""
    offset = 0
    while True:
        raw = f.readline(limit + 2)
        if not raw:
            return
        digest.update(raw)
        size, last = len(raw), raw
        if size == limit + 2 and not raw.endswith(b"\n"):  # longer still: skip to its end
            while True:
                more = f.readline(_SKIP_CHUNK)
                digest.update(more)
                size += len(more)
                last = more or last
                if not more or more.endswith(b"\n"):
                    break
        length = size - last.endswith(b"\n")
        yield offset, (raw if length <= limit else None), size, length
        offset += size


def open_dataset(path: str | os.PathLike) -> BinaryIO:
    """The dataset for reading (preflight.open_regular_file: a regular file, never blocking on a
    FIFO; OSError naming it otherwise)."""
    return os.fdopen(open_regular_file(path), "rb")


def scan_dataset(path: str | os.PathLike, max_row_bytes: int = DEFAULT_MAX_ROW_BYTES) -> DatasetScan:
    """Read the file once: valid rows' ids and offsets, row errors (incl. duplicate ids and rows
    over `max_row_bytes`), sha256 of the whole file."""
    scan = DatasetScan(path=os.fspath(path))
    digest = hashlib.sha256()
    first_line: dict[str, int] = {}
    with open_dataset(path) as f:
        for line_no, (start, raw, _size, length) in enumerate(
            _bounded_lines(f, max_row_bytes, digest), start=1
        ):
            if raw is None:
                reason = (
                    f"row is {length} bytes, over the {max_row_bytes}-byte bound (--max-row-bytes): "
                    "split the conversation or raise the bound"
                )
                scan.errors.append(RowError(line_no, reason))
                continue
            if not raw.strip():
                continue
            try:
                conv = parse_line(raw, line_no)
            except RowError as e:
                scan.errors.append(e)
                continue
            except Exception as e:  # noqa: BLE001 - one row must never stop the run at every start
                scan.errors.append(RowError(line_no, f"unusable row ({type(e).__name__}: {str(e)[:200]})"))
                continue
            if conv.sample_id in first_line:
                scan.errors.append(
                    RowError(
                        line_no,
                        f"duplicate id {_brief(conv.sample_id)} (first on line {first_line[conv.sample_id]})",
                        conv.sample_id,
                    )
                )
                continue
            first_line[conv.sample_id] = line_no
            scan.entries.append(DatasetEntry(conv.sample_id, line_no, start))
    scan.sha256 = digest.hexdigest()
    return scan


def read_conversations(
    path: str | os.PathLike, entries: list[DatasetEntry], max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
) -> Iterator[Conversation]:
    """The conversations of `entries`, re-read from their offsets (in the order given); a line is
    read up to `max_row_bytes` (the scan's bound), however the file changed since."""
    with open_dataset(path) as f:
        for e in entries:
            f.seek(e.offset)
            yield parse_line(f.readline(max_row_bytes + 2), e.line)
