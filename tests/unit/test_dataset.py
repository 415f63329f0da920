"""Dataset rows -> samples: both shapes, stable ids, assistant-only loss mask, bad rows kept out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extraction.inputs.chat_tokenizer import ChatTokenizer, load_tokenizer, tokenizer_hash
from extraction.inputs.dataset import Conversation, content_id, read_conversations, scan_dataset

MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is up?"},
    {"role": "assistant", "content": "The sky."},
    {"role": "user", "content": "And down?"},
    {"role": "assistant", "content": "The ground!"},
]
SHAREGPT = {
    "conversations": [
        {"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
        for m in MSGS
    ]
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_both_shapes_same_id_and_tokens(tmp_path: Path, tok) -> None:
    ds = _write(tmp_path / "d.jsonl", [{"messages": MSGS}, {"id": 17, **SHAREGPT}])
    scan = scan_dataset(ds)
    assert scan.errors == []
    ids = [e.sample_id for e in scan.entries]
    assert ids == [content_id(MSGS), "17"]
    convs = list(read_conversations(ds, scan.entries))
    assert convs[0].messages == convs[1].messages == MSGS
    ct = ChatTokenizer(tok)
    a, b = (ct.encode(c) for c in convs)
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    # The id does not depend on where the row is or what else is in the file.
    again = scan_dataset(
        _write(
            tmp_path / "e.jsonl",
            [
                {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
                {"messages": MSGS},
            ],
        )
    )
    assert again.entries[1].sample_id == ids[0]


def test_loss_mask_is_exactly_the_assistant_turns(tok) -> None:
    ct = ChatTokenizer(tok)
    s = ct.encode(Conversation("x", MSGS, 1))
    text = tok.decode(s.input_ids)
    assert text == tok.apply_chat_template(MSGS, tokenize=False)
    masked = s.input_ids[s.loss_mask.bool()]
    # Assistant content plus its closing tokens; never a user/system word or an assistant header.
    assert tok.decode(masked) == "The sky.<|end|><|eos|>The ground!<|end|><|eos|>"
    runs = [tok.decode(s.input_ids[i:j]) for i, j in _runs(s.loss_mask.tolist())]
    assert runs == ["The sky.<|end|><|eos|>", "The ground!<|end|><|eos|>"]
    assert not s.truncated and s.meta["num_tokens_full"] == len(s.input_ids)


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_truncation_recorded(tok) -> None:
    full = ChatTokenizer(tok).encode(Conversation("x", MSGS, 1))
    cut = ChatTokenizer(tok, max_length=10).encode(Conversation("x", MSGS, 1))
    assert cut.truncated and len(cut.input_ids) == 10
    assert cut.meta["num_tokens_full"] == len(full.input_ids) > 10
    assert cut.input_ids.tolist() == full.input_ids[:10].tolist()
    assert cut.loss_mask.tolist() == full.loss_mask[:10].tolist()


def test_malformed_rows_logged_with_line_and_reason(tmp_path: Path) -> None:
    ds = _write(
        tmp_path / "bad.jsonl",
        [
            {"messages": MSGS},  # 1 ok
            "{not json",  # 2
            {"text": "no conversation"},  # 3
            {"messages": [{"role": "user", "content": "only a question"}]},  # 4
            {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},  # 5
            {"conversations": [{"from": "human"}]},  # 6
            {"messages": MSGS},  # 7 duplicate of line 1 (same content, no id)
            {"id": "a", **SHAREGPT},  # 8 ok
            {"id": "a", "messages": MSGS[:3]},  # 9 duplicate id
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url"}]},
                    {"role": "assistant", "content": "y"},
                ]
            },  # 10
            [1, 2],  # 11
            {"id": True, "messages": MSGS},  # 12
        ],
    )
    scan = scan_dataset(ds)
    assert [e.line for e in scan.entries] == [1, 8]
    reasons = {e.line: e.reason for e in scan.errors}
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 9, 10, 11, 12]
    assert "invalid JSON" in reasons[2]
    assert "neither 'conversations'" in reasons[3]
    assert "no assistant turn" in reasons[4]
    assert "unknown role 'wizard'" in reasons[5]
    assert "needs 'from' and 'value'" in reasons[6]
    assert "duplicate id" in reasons[7] and "line 1" in reasons[7]
    assert "duplicate id 'a'" in reasons[9] and "line 8" in reasons[9]
    assert "only text content parts" in reasons[10]
    assert "JSON object" in reasons[11]
    assert "'id' must be" in reasons[12]


def test_hashes_follow_content(tmp_path: Path, tiny_model_dir: Path) -> None:
    a = scan_dataset(_write(tmp_path / "a.jsonl", [{"messages": MSGS}]))
    b = scan_dataset(_write(tmp_path / "b.jsonl", [{"messages": MSGS}]))
    c = scan_dataset(_write(tmp_path / "c.jsonl", [{"messages": MSGS}, {"messages": MSGS[:3]}]))
    assert a.sha256 == b.sha256 != c.sha256
    h = tokenizer_hash(tiny_model_dir)
    assert len(h) == 64 and h == tokenizer_hash(tiny_model_dir)
    assert tokenizer_hash(tmp_path) != h


def _reference_encode(tok, conv: Conversation, max_length: int | None) -> tuple[list[int], list[int], bool]:
    """The tokenizer thread's first algorithm, kept as the oracle: one template render per prefix,
    the transformers wrapper, a per-token Python loop for the mask."""

    def render(messages, gen=False):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    messages = conv.messages
    text = render(messages)
    spans, cursor = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:k], True) if k else ""
        upto = render(messages[: k + 1])
        if k and text.startswith(before) and text.startswith(upto) and len(before) >= cursor:
            spans.append((len(before), len(upto)))
            cursor = len(upto)
            continue
        pos = text.find(m["content"], cursor)
        spans.append((pos, pos + len(m["content"])))
        cursor = pos + len(m["content"])
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [int(any(s < e1 and e > s1 for s1, e1 in spans)) for s, e in enc["offset_mapping"]]
    truncated = max_length is not None and len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask, truncated


def _odd_conversations() -> list[Conversation]:
    shapes = [
        MSGS,
        [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "ok"}],
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "more?"},
        ],
        [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "x"}],  # content repeated
        [{"role": "user", "content": "é ✓ 日本"}, {"role": "assistant", "content": "ünï ✓ <|end|> 語"}],
    ]
    return [Conversation(f"odd{i}", m, i + 1) for i, m in enumerate(shapes)]


@pytest.mark.parametrize("max_length", [None, 64])
def test_fast_paths_give_the_reference_ids_and_masks(tmp_path: Path, tok, max_length) -> None:
    # Batched renders, the Rust backend called directly and the tensor mask must change nothing.
    from extraction.testbed.tiny import write_tiny_dataset

    ds = write_tiny_dataset(tmp_path / "d.jsonl", 300, seed=4)
    convs = list(read_conversations(ds, scan_dataset(ds).entries)) + _odd_conversations()
    ct = ChatTokenizer(tok, max_length=max_length)
    for conv in convs:
        s = ct.encode(conv)
        ids, mask, truncated = _reference_encode(tok, conv, max_length)
        assert s.input_ids.tolist() == ids, conv.sample_id
        assert s.loss_mask.tolist() == mask, conv.sample_id
        assert s.loss_mask.dtype == s.input_ids.dtype == __import__("torch").long
        assert s.truncated == truncated and s.loss_mask.untyped_storage().nbytes() == 8 * len(mask)
    assert ct._backend is not None and ct._backend_checked and ct._batched_render  # the fast paths ran


def test_a_backend_that_disagrees_is_not_used(tok) -> None:
    class Wrong:
        def encode_batch(self, texts, add_special_tokens=False):
            return [type("E", (), {"ids": [0], "offsets": [(0, 1)]})() for _ in texts]

    ct = ChatTokenizer(tok)
    ct._backend = Wrong()
    conv = Conversation("x", MSGS, 1)
    s = ct.encode(conv)
    ids, mask, _ = _reference_encode(tok, conv, None)
    assert ct._backend is None and s.input_ids.tolist() == ids and s.loss_mask.tolist() == mask
    assert ct.encode(conv).input_ids.tolist() == ids


def test_a_row_whose_assistant_turns_are_all_empty_is_a_row_error(tmp_path: Path) -> None:
    user = {"role": "user", "content": "q"}
    ds = _write(
        tmp_path / "d.jsonl",
        [
            {"messages": [user, {"role": "assistant", "content": ""}]},  # 1
            {"messages": [user, {"role": "assistant", "content": " \n"}]},  # 2
            {
                "messages": [
                    user,
                    {"role": "assistant", "content": ""},
                    user,
                    {"role": "assistant", "content": "a"},
                ]
            },
        ],
    )
    scan = scan_dataset(ds)
    assert [e.line for e in scan.entries] == [3]
    reasons = {e.line: e.reason for e in scan.errors}
    assert sorted(reasons) == [1, 2]
    assert all("every assistant turn is empty" in r for r in reasons.values()), reasons


def test_developer_role_and_tool_call_turns_are_accepted(tmp_path: Path, tok) -> None:
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    row = {
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": call},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "f"},
            {"role": "assistant", "content": "Sunny."},
        ]
    }
    no_content = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": call}]}
    scan = scan_dataset(_write(tmp_path / "d.jsonl", [row, no_content]))
    assert scan.errors == [] and len(scan.entries) == 2
    conv, conv2 = read_conversations(tmp_path / "d.jsonl", scan.entries)
    assert conv.messages[0] == {"role": "system", "content": "Be brief."}  # developer = system
    assert conv.messages[2] == {"role": "assistant", "content": "", "tool_calls": call}
    assert conv.messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "f"}
    sample = ChatTokenizer(tok).encode(conv)
    assert tok.decode(sample.input_ids[sample.loss_mask.bool()]).endswith("Sunny.<|end|><|eos|>")


def test_odd_tool_fields_are_row_errors(tmp_path: Path) -> None:
    user = {"role": "user", "content": "x"}
    ds = _write(
        tmp_path / "d.jsonl",
        [
            {"messages": [user, {"role": "assistant", "content": None}]},  # 1 null, no tool call
            {"messages": [user, {"role": "assistant", "content": None, "tool_calls": "f()"}]},  # 2
            {
                "messages": [user, {"role": "assistant", "content": None, "tool_calls": [{"x": "\ud83d"}]}]
            },  # 3
        ],
    )
    reasons = {e.line: e.reason for e in scan_dataset(ds).errors}
    assert sorted(reasons) == [1, 2, 3]
    assert "content must be a string" in reasons[1]
    assert "tool_calls must be a list of objects" in reasons[2]
    assert "lone surrogate" in reasons[3]


def test_a_row_over_the_byte_bound_is_a_row_error_and_never_read_whole(tmp_path: Path) -> None:
    small = {"messages": MSGS[:3]}
    big = {"messages": [MSGS[1], {"role": "assistant", "content": "x" * 5000}]}
    ds = _write(tmp_path / "d.jsonl", [small, big, {"id": 3, **SHAREGPT}])
    (tmp_path / "tail.jsonl").write_bytes(ds.read_bytes() + b'{"messages": "' + b"y" * 9000)  # no newline
    for path in (ds, tmp_path / "tail.jsonl"):
        scan = scan_dataset(path, max_row_bytes=4096)
        assert [e.line for e in scan.entries] == [1, 3]
        reasons = {e.line: e.reason for e in scan.errors}
        size = len(json.dumps(big))
        assert reasons[2] == (
            f"row is {size} bytes, over the 4096-byte bound (--max-row-bytes): split the conversation or raise the bound"
        )
        assert scan.sha256 == __import__("hashlib").sha256(path.read_bytes()).hexdigest()
        assert [c.sample_id for c in read_conversations(path, scan.entries)] == [content_id(MSGS[:3]), "3"]
    assert [e.line for e in scan_dataset(tmp_path / "tail.jsonl", max_row_bytes=4096).errors] == [2, 4]
    assert scan_dataset(ds).errors == []  # the default bound (DEFAULT_MAX_ROW_BYTES) is MiBs


def test_a_long_text_is_cut_before_it_is_tokenized_with_the_same_tokens(tok) -> None:
    long_reply = " ".join(f"word{i} and more." for i in range(4000))  # ~70k characters
    conv = Conversation("x", [MSGS[1], {"role": "assistant", "content": long_reply}], 1)
    full = ChatTokenizer(tok).encode(conv)
    ct = ChatTokenizer(tok, max_length=50)
    seen: list[int] = []
    real = ct._ids_and_offsets
    ct._ids_and_offsets = lambda text: (seen.append(len(text)), real(text))[1]  # type: ignore[method-assign]
    for _ in range(2):  # the first cut is checked against a longer start of the text, later ones trusted
        cut = ct.encode(conv)
        assert cut.input_ids.tolist() == full.input_ids[:50].tolist()
        assert cut.loss_mask.tolist() == full.loss_mask[:50].tolist()
        assert cut.truncated and cut.meta["num_tokens_full"] is None
    # Only the start of the text was tokenized, the first row's check included (issue #49 item 7:
    # it tokenized the whole text): the check's text reaches twice as far as the cut, at most.
    assert max(seen) < 5000 < len(long_reply), seen
    assert len(seen) == 3 and seen[1] == seen[2] < seen[0], seen  # the check's two texts, then one a row


def test_the_first_long_row_costs_no_more_than_its_bound(tok) -> None:
    """A 1 MiB row with --max-length 50: the first row (whose cut is checked) holds no tokens of
    the whole text. Before #49 it tokenized all of it with offsets: 230 MiB of Python objects at
    the peak (tracemalloc; the tokenizer's own Rust memory besides: RSS +985 MiB)."""
    import tracemalloc

    reply = " ".join(f"word{i} and more." for i in range(60000))  # ~1.2 M characters
    conv = Conversation("x", [MSGS[1], {"role": "assistant", "content": reply}], 1)
    ct = ChatTokenizer(tok, max_length=50)
    tracemalloc.start()
    try:
        sample = ct.encode(conv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sample.truncated and len(sample.input_ids) == 50
    # The rendered text itself is ~1.2 MB, held in a few renders: the peak stays near that.
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB for a {len(reply)}-character row"
