"""lmforge data: loaders, dedup, filters, errors, tokenization masks and packing."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from compress.data.dedup import MinHashConfig, cross_duplicates, near_duplicates
from compress.data.packing import IGNORE_INDEX, pack, tokenize_and_pack, tokenize_record
from compress.data.prepare import (
    DataConfig,
    DataError,
    load_input,
    prepare,
    read_data_file,
    split_groups,
    split_key,
)
from tests.conftest import DIALOG, DIALOG_ASSISTANT_TEXT

BASE = [
    "The quick brown fox jumps over the lazy dog near the river bank every single morning.",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "A binary search halves the interval at each step until the target value is found.",
    "Mount Everest is the highest mountain above sea level, on the border of Nepal and China.",
    "Python lists are dynamic arrays; appending is amortized constant time.",
]


def _dialog(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_minhash_removes_planted_near_duplicates_and_keeps_distinct():
    near = [
        BASE[0].replace("every single morning", "every morning"),  # a word dropped
        BASE[2].replace("target value", "target item"),  # a word changed
        BASE[3] + " ",  # whitespace only
    ]
    texts = BASE + near
    removed = near_duplicates(texts, MinHashConfig(threshold=0.7, num_perm=128))
    assert removed == {5: 0, 6: 2, 7: 3}
    # Distinct texts alone: nothing removed.
    assert near_duplicates(BASE, MinHashConfig(threshold=0.7)) == {}
    pairs = cross_duplicates(BASE, near, MinHashConfig(threshold=0.7))
    assert sorted((i, j) for i, j, _ in pairs) == [(0, 0), (2, 1), (3, 2)]
    assert all(0.7 <= sim <= 1.0 for *_, sim in pairs)


def test_prepare_counts_every_filter_and_split_has_no_leak(tmp_path):
    records = [_dialog(f"Question {i}: {t}", f"Answer about {t}") for i, t in enumerate(BASE)]
    records += [
        _dialog("Question 0: " + BASE[0], "Answer about " + BASE[0]),  # exact duplicate of #0
        _dialog("Question 1: " + BASE[1], "Answer about " + BASE[1].replace("glucose", "sugar")),  # near duplicate
        _dialog("Why?", "You are an idiot."),  # blocked word
        _dialog("{}<>", "#$%^&*@@"),  # symbols
        _dialog("x", "1234567890 1234567890"),  # mostly digits
        {"text": "line one\nline one\nline one\nline two"},  # repeated lines
        {"messages": [{"role": "user", "content": "only a question"}]},  # nothing to learn
    ]
    src = _write_jsonl(tmp_path / "in.jsonl", records)
    report = prepare(
        DataConfig(inputs=[str(src)], val_fraction=0.4, dedup_threshold=0.7), tmp_path / "out", verbose=False
    )
    f = report["filters"]
    assert report["total_loaded"] == 12
    assert f["exact_duplicate"]["removed"] == 1
    assert f["near_duplicate"]["removed"] == 1
    assert f["toxicity"]["by_reason"] == {"idiot": 1}
    assert f["quality"]["by_reason"] == {
        "symbol_ratio": 1,
        "non_alpha_ratio": 1,
        "repeated_lines": 1,
        "no_assistant_turn": 1,
    }
    assert report["kept"] == 5 and report["train"] + report["val"] == 5 and report["val"] == 2
    assert json.loads((tmp_path / "out" / "data_report.json").read_text())["kept"] == 5
    prepare(DataConfig(inputs=[str(src)], val_fraction=0.4, dedup_threshold=0.7), tmp_path / "again", verbose=False)
    assert (tmp_path / "again" / "val.jsonl").read_text() == (tmp_path / "out" / "val.jsonl").read_text()  # fixed seed
    train = read_data_file(tmp_path / "out" / "train.jsonl")
    val = read_data_file(tmp_path / "out" / "val.jsonl")
    text = lambda r: "\n".join(m["content"] for m in r["messages"])  # noqa: E731
    assert cross_duplicates([text(r) for r in train], [text(r) for r in val], MinHashConfig(threshold=0.5)) == []


def test_malformed_records_name_file_and_line(tmp_path):
    good = json.dumps(_dialog("hi", "hello"))
    cases = {
        "bad_json.jsonl": ([good, good, '{"messages": [}'], ":3: not valid JSON"),
        "bad_role.jsonl": ([good, json.dumps({"messages": [{"role": "bot", "content": "x"}]})], ":2: messages[0]"),
        "no_keys.jsonl": ([json.dumps({"prompt": "x"})], ":1: record has neither"),
    }
    for name, (lines, expected) in cases.items():
        path = _write_jsonl(tmp_path / name, lines)
        with pytest.raises(DataError, match=re.escape(f"{name}{expected}")):
            load_input(str(path))
    yml = tmp_path / "dialogs.yml"
    yml.write_text("conversations:\n- - Hello\n  - Hi\n- Just one string\n")
    with pytest.raises(DataError, match=r"dialogs.yml:4: a conversation must be a list"):
        load_input(str(yml))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty.txt:1: no records"):
        load_input(str(empty))


def test_nothing_left_after_filtering_names_file_and_lines(tmp_path):
    src = _write_jsonl(tmp_path / "toxic.jsonl", [_dialog("hey", "shut up, moron"), _dialog("#", "@@@###")])
    with pytest.raises(
        DataError,
        match=r"no records left after filtering .*toxic.jsonl:1 toxicity: moron; .*toxic.jsonl:2 quality: symbol_ratio",
    ):
        prepare(DataConfig(inputs=[str(src)]), tmp_path / "out", verbose=False)


def test_chatterbot_english_default_and_chinese(tmp_path):
    report = prepare(DataConfig(), tmp_path / "en", verbose=False)
    assert report["loaded"] == {"chatterbot:english": 2026} and report["total_loaded"] == 2026
    assert report["filters"]["malformed"]["removed"] == 1  # trivia.yml:35 of the shipped corpus
    assert report["filters"]["exact_duplicate"]["removed"] > 1000
    assert report["kept"] == report["train"] + report["val"] and report["val"] == math.ceil(0.05 * report["kept"])
    first = read_data_file(tmp_path / "en" / "train.jsonl")[0]
    assert [m["role"] for m in first["messages"]][:2] == ["user", "assistant"]
    zh = load_input("chatterbot:chinese")
    assert len(zh) == 467
    assert any(
        r.data["messages"][:2] == [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "嗨"}]
        for r in zh
    )


def test_noise_ratio_swaps_replies_in_train_only(tmp_path):
    records = [_dialog(f"Question number {i} about {t}", f"Reply {i} for {t}") for i in range(4) for t in BASE]
    src = _write_jsonl(tmp_path / "in.jsonl", records)
    clean = prepare(DataConfig(inputs=[str(src)], dedup_threshold=0.95), tmp_path / "clean", verbose=False)
    noisy = prepare(
        DataConfig(inputs=[str(src)], dedup_threshold=0.95, noise_ratio=0.5), tmp_path / "noisy", verbose=False
    )
    assert noisy["noised"] == round(0.5 * clean["train"])
    assert (tmp_path / "clean" / "val.jsonl").read_text() == (tmp_path / "noisy" / "val.jsonl").read_text()
    changed = sum(
        a != b
        for a, b in zip(
            read_data_file(tmp_path / "clean" / "train.jsonl"), read_data_file(tmp_path / "noisy" / "train.jsonl")
        )
    )
    assert 0 < changed <= noisy["noised"]


def test_text_loader_splits_paragraphs(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first paragraph\nstill first\n\n\nsecond paragraph\n")
    records = load_input(str(path))
    assert [(r.data["text"], r.line) for r in records] == [("first paragraph\nstill first", 1), ("second paragraph", 5)]


def test_loss_mask_covers_only_assistant_turns(tokenizer):
    ids, labels = tokenize_record(tokenizer, DIALOG, max_length=512)
    assert len(ids) == len(labels)
    trained = tokenizer.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert trained == DIALOG_ASSISTANT_TEXT
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels))
    assert DIALOG["messages"][0]["content"] in tokenizer.decode(ids)  # the prompt is in the input, not the loss
    text_ids, text_labels = tokenize_record(tokenizer, {"text": "plain text"}, max_length=512)
    assert text_labels == text_ids and text_ids[-1] == tokenizer.eos_token_id


def test_packing_fills_rows_and_pads_with_ignored_labels(tokenizer):
    records = [_dialog(f"Question {i}?", f"Answer {i}.") for i in range(10)]
    lengths = [len(tokenize_record(tokenizer, r, 64)[0]) for r in records]
    packed = tokenize_and_pack(tokenizer, records, max_length=64)
    assert packed.input_ids.shape[1] == 64
    assert len(packed) == len(records) // (64 // lengths[0])  # whole examples per row
    assert int(packed.attention_mask.sum()) == sum(lengths)
    pad = packed.attention_mask == 0
    assert bool((packed.labels[pad] == IGNORE_INDEX).all())
    with pytest.raises(ValueError, match="no label tokens"):
        pack([([1, 2, 3], [IGNORE_INDEX] * 3)], 8, 0)


def test_split_by_prompt_keeps_every_prompt_on_one_side(tmp_path):
    # 12 prompts, one asked 5 times with different answers (as chatterbot's "tell me a joke")
    records = [_dialog("Tell me a joke", f"Joke number {i}: {BASE[i % len(BASE)]}") for i in range(5)]
    records += [_dialog(f"Question {i}: {t}", f"Answer about {t}") for i, t in enumerate(BASE)]
    records += [_dialog(f"Question {i}: {t}", f"Another answer: {t[::-1]}") for i, t in enumerate(BASE[:3])]
    src = _write_jsonl(tmp_path / "in.jsonl", records)
    for seed in range(6):
        config = DataConfig(inputs=[str(src)], val_fraction=0.3, seed=seed, blocklist=None, dedup_threshold=0.95)
        report = prepare(config, tmp_path / f"out{seed}", verbose=False)
        train = read_data_file(tmp_path / f"out{seed}" / "train.jsonl")
        val = read_data_file(tmp_path / f"out{seed}" / "val.jsonl")
        prompts = lambda rs: {r["messages"][0]["content"].lower() for r in rs}  # noqa: E731
        assert prompts(train) & prompts(val) == set() and report["val_prompts_in_train"] == 0
        assert 1 <= len(val) <= math.ceil(0.3 * report["kept"]) and len(train) + len(val) == report["kept"]


def test_split_groups_takes_whole_groups_and_rejects_a_single_prompt():
    keys = ["a"] * 6 + ["b", "c", "d", "e"]
    val = split_groups(keys, 3, random.Random(0))
    assert len(val) == 3 and "a" not in {keys[i] for i in val}  # the 6-record group never fits
    assert sorted(split_groups(["a"] * 6 + ["b"], 1, random.Random(0))) == [6]
    with pytest.raises(DataError, match="--split-by record"):
        split_groups(["same"] * 4, 1, random.Random(0))
    assert split_key(_dialog("  Tell  me a JOKE ", "x"), "prompt") == split_key(
        _dialog("tell me a joke", "y"), "prompt"
    )
