"""``lmforge data``: load dialogs or text, deduplicate, filter, split into train/validation.

Pipeline (each step counts what it removes; the counts are printed and written to
``OUT/data_report.json``):

1. load: chatterbot-corpus YAML dialogs (``chatterbot:english``, ``chatterbot:chinese`` or a
   ``.yml`` file) become ``{"messages": [user, assistant, user, ...]}``; JSONL files hold
   ``{"messages": [...]}`` or ``{"text": ...}`` records; plain text files hold one record per
   paragraph (blank-line separated). A malformed record stops with ``DataError`` naming file:line.
2. exact duplicates (normalized text hash) are removed;
3. quality heuristics in the style of Gopher (Rae et al. 2021, appendix A) and C4 (Raffel et al.
   2020): length bounds, symbol ratio, non-alphabetic ratio, repeated-line fraction, at least one
   assistant turn;
4. a word-list toxicity filter (``compress/data/resources/blocklist.txt``, as C4's bad-words list);
5. MinHash LSH near-duplicate removal (``compress.data.dedup``) over all records *before* the split,
   so no validation record near-duplicates a training one;
6. a seeded split by prompt: dialogs that open with the same user turn (after ``normalize``) form one
   group and land on the same side, so no held-out prompt is also a training prompt (the chatterbot
   corpus answers "tell me a joke" 29 ways); groups are shuffled and whole groups fill the
   validation split up to ``val_fraction`` (as scikit-learn's ``GroupShuffleSplit`` does).
   Optionally a fraction of training records gets noisy labels (assistant replies swapped between
   dialogs) for robustness experiments.

Outputs ``OUT/train.jsonl``, ``OUT/val.jsonl`` (one record a line) and ``OUT/data_report.json``.
Tokenization with the chat template, assistant-only loss masks and packing live in
``compress.data.packing`` and run when a training recipe reads these files.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from compress.data.dedup import MinHashConfig, exact_key, near_duplicates, normalize
from engine.checkpoint.outputs import DATA, check_output_dir, staged_output_dir
from engine.cli_options import add_config_option, config_fields, errors_name_flags
from engine.errors import UsageError
from engine.records import DataError, iter_jsonl, read_utf8, validate_record

DEFAULT_INPUT = "chatterbot:english"
DEFAULT_BLOCKLIST = Path(__file__).parent / "resources" / "blocklist.txt"
_SYMBOLS = set("#…{}[]<>|\\^~`@$%*_=+")
_MAX_EXAMPLES = 5  # removed records listed per filter in the report


@dataclasses.dataclass
class Record:
    """One training example and where it came from.

    Attributes:
        data: ``{"messages": [{"role", "content"}, ...]}`` or ``{"text": str}``.
        source: file it was read from.
        line: 1-based line of the record in that file.
    """

    data: dict[str, Any]
    source: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    @property
    def text(self) -> str:
        """All content, one turn (or the text) per line."""
        if "messages" in self.data:
            return "\n".join(m["content"] for m in self.data["messages"])
        return self.data["text"]


#: ``DataConfig.split_by`` values.
SPLIT_BY = ("prompt", "record")


@dataclasses.dataclass
class DataConfig:
    """Settings of ``lmforge data`` (recorded in ``data_report.json``).

    Attributes:
        inputs: ``chatterbot:LANG``, ``.yml`` dialog files, ``.jsonl`` or plain-text files.
        val_fraction: share of records held out for validation (at least one record).
        seed: seed of the shuffle before the split (and of the noise).
        split_by: ``prompt`` (dialogs with the same first user turn stay on one side; text records
            group by their first line) or ``record`` (each record on its own).
        min_chars / max_chars: bounds on the characters of a record's content.
        max_symbol_ratio: largest share of non-space characters that are symbols (``#{}<>|...``).
        max_non_alpha_ratio: largest share of non-space characters that are not letters
            (CJK characters count as letters).
        max_duplicate_line_fraction: largest share of lines (turns) repeating an earlier line.
        blocklist: word list file of the toxicity filter; ``None`` disables the filter.
        dedup_threshold / num_perm / shingle_size: MinHash LSH settings (``compress.data.dedup``).
        noise_ratio: share of training dialogs whose assistant replies are swapped with other
            dialogs' replies (label noise); 0 disables.
    """

    inputs: list[str] = dataclasses.field(default_factory=lambda: [DEFAULT_INPUT])
    val_fraction: float = 0.05
    seed: int = 0
    split_by: str = "prompt"
    min_chars: int = 2
    max_chars: int = 20000
    max_symbol_ratio: float = 0.1
    max_non_alpha_ratio: float = 0.5
    max_duplicate_line_fraction: float = 0.3
    blocklist: str | None = str(DEFAULT_BLOCKLIST)
    dedup_threshold: float = 0.8
    num_perm: int = 128
    shingle_size: int = 5
    noise_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise UsageError(f"val_fraction={self.val_fraction}: must be in (0, 1)")
        if self.split_by not in SPLIT_BY:
            raise UsageError(f"split_by={self.split_by!r}: use one of {', '.join(SPLIT_BY)} (--split-by)")
        if not 0.0 <= self.noise_ratio <= 1.0:
            raise UsageError(f"noise_ratio={self.noise_ratio}: must be in [0, 1]")
        if self.min_chars > self.max_chars:
            raise UsageError(f"min_chars={self.min_chars} > max_chars={self.max_chars}")
        if not self.inputs:
            raise UsageError("inputs is empty; pass at least one --input")
        self.minhash  # validates the MinHash settings

    @property
    def minhash(self) -> MinHashConfig:
        return MinHashConfig(self.dedup_threshold, self.num_perm, self.shingle_size, seed=self.seed + 1)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def chatterbot_dir(language: str) -> Path:
    """The installed chatterbot-corpus data directory of ``language`` (e.g. ``english``).

    Raises:
        DataError: the package is missing, or has no such language (lists those available).
    """
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "chatterbot:*: needs the package chatterbot-corpus; `pip install --no-deps chatterbot-corpus==1.3.3`"
        )
    root = Path(list(spec.submodule_search_locations)[0]) / "data"
    path = root / language
    if not path.is_dir():
        available = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise DataError(f"chatterbot:{language}: unknown language; available: {', '.join(available)}")
    return path


def load_chatterbot_file(path: Path, skipped: list[tuple[Record, str]] | None = None) -> list[Record]:
    """Dialogs of one chatterbot-corpus YAML file, turns alternating user/assistant.

    Args:
        path: the YAML file.
        skipped: when given, malformed dialogs are appended here as ``(record, reason)`` and
            skipped instead of raising (used for the shipped corpus, which has a few).

    Raises:
        DataError: invalid YAML, no ``conversations`` list, or (without ``skipped``) a dialog
            that is not a list of at least two strings (names file:line).
    """
    try:
        root = yaml.compose(read_utf8(path))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        raise DataError(f"{path}:{line}: invalid YAML ({getattr(exc, 'problem', exc)})") from exc
    conversations = None
    if isinstance(root, yaml.MappingNode):
        conversations = next((v for k, v in root.value if k.value == "conversations"), None)
    if not isinstance(conversations, yaml.SequenceNode):
        raise DataError(f"{path}:1: expected a mapping with a 'conversations' list (chatterbot-corpus format)")
    records = []
    for node in conversations.value:
        line = node.start_mark.line + 1
        turns = node.value if isinstance(node, yaml.SequenceNode) else None
        if not turns or len(turns) < 2 or not all(isinstance(t, yaml.ScalarNode) for t in turns):
            problem = "a conversation must be a list of at least two strings (user, assistant, ...)"
            if skipped is None:
                raise DataError(f"{path}:{line}: {problem}")
            text = str(node.value) if isinstance(node, yaml.ScalarNode) else repr(node.value)[:60]
            skipped.append((Record({"text": text}, str(path), line), problem))
            continue
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": str(t.value)} for i, t in enumerate(turns)
        ]
        records.append(Record({"messages": messages}, str(path), line))
    return records


def load_jsonl(path: Path) -> list[Record]:
    """Records of a JSONL file (blank lines skipped).

    Raises:
        DataError: not UTF-8, or a line that is not JSON or not a valid record (names file:line).
    """
    return [Record(validate_record(obj, str(path), line_no), str(path), line_no) for line_no, obj in iter_jsonl(path)]


def load_text(path: Path) -> list[Record]:
    """Paragraphs (blank-line separated) of a plain-text file as ``{"text": ...}`` records."""
    records, lines, start = [], [], 1
    for line_no, line in enumerate(read_utf8(path).splitlines(), start=1):
        if line.strip():
            if not lines:
                start = line_no
            lines.append(line.rstrip())
        elif lines:
            records.append(Record({"text": "\n".join(lines)}, str(path), start))
            lines = []
    if lines:
        records.append(Record({"text": "\n".join(lines)}, str(path), start))
    return records


def load_input(spec: str, skipped: list[tuple[Record, str]] | None = None) -> list[Record]:
    """Load one input: ``chatterbot:LANG``, a ``.yml``/``.yaml`` dialog file, ``.jsonl``, or text.

    Malformed records stop the run, except in the shipped corpus (``chatterbot:LANG``), whose
    few malformed dialogs are appended to ``skipped`` (counted and reported) when it is given.

    Raises:
        DataError: missing file, malformed record, or an input with no records (names file:line).
    """
    if spec.startswith("chatterbot:"):
        records = []
        for file in sorted(chatterbot_dir(spec.split(":", 1)[1]).glob("*.yml")):
            records.extend(load_chatterbot_file(file, skipped))
        return records
    path = Path(spec)
    if not spec.strip() or not path.is_file():
        what = "empty" if not spec.strip() else "a directory, not a file" if path.is_dir() else "input file not found"
        raise DataError(f"--input {spec!r}: {what}; pass chatterbot:LANG, a .yml, .jsonl or text file")
    if path.suffix in (".yml", ".yaml"):
        records = load_chatterbot_file(path)
    elif path.suffix == ".jsonl":
        records = load_jsonl(path)
    else:
        records = load_text(path)
    if not records:
        raise DataError(f"{path}:1: no records in the file (empty input)")
    return records


# --------------------------------------------------------------------------------------------
# Filters
# --------------------------------------------------------------------------------------------


def quality_problem(record: Record, config: DataConfig) -> str | None:
    """The first quality rule ``record`` breaks (a short reason), or ``None`` if it passes."""
    text = record.text
    if "messages" in record.data and not any(
        m["role"] == "assistant" and m["content"].strip() for m in record.data["messages"]
    ):
        return "no_assistant_turn"
    length = len(text.strip())
    if length < config.min_chars:
        return "too_short"
    if length > config.max_chars:
        return "too_long"
    chars = [c for c in text if not c.isspace()]
    if chars:
        if sum(c in _SYMBOLS for c in chars) / len(chars) > config.max_symbol_ratio:
            return "symbol_ratio"
        if sum(not c.isalpha() for c in chars) / len(chars) > config.max_non_alpha_ratio:
            return "non_alpha_ratio"
    lines = [normalize(line) for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and (len(lines) - len(set(lines))) / len(lines) > config.max_duplicate_line_fraction:
        return "repeated_lines"
    return None


def read_blocklist(path: str | Path) -> list[str]:
    """Entries of a block-list file (one a line, ``#`` comments), lower-cased.

    Raises:
        DataError: the file is missing.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: block-list file not found; pass --blocklist FILE or --blocklist none")
    return [w.strip().lower() for w in read_utf8(path).splitlines() if w.strip() and not w.startswith("#")]


def blocked_word(text: str, words: list[str]) -> str | None:
    """The first block-list entry in ``text``: whole words for ASCII entries, substrings otherwise."""
    lower = text.lower()
    for word in words:
        if word.isascii():
            if re.search(rf"(?<!\w){re.escape(word)}(?!\w)", lower):
                return word
        elif word in lower:
            return word
    return None


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FilterStep:
    """What one step removed: a count per reason and a few examples (``file:line``)."""

    name: str
    removed: Counter = dataclasses.field(default_factory=Counter)
    examples: list[str] = dataclasses.field(default_factory=list)

    def drop(self, record: Record, reason: str) -> None:
        self.removed[reason] += 1
        if len(self.examples) < _MAX_EXAMPLES:
            self.examples.append(f"{record.where} ({reason}): {record.text[:60]!r}")

    def to_json(self) -> dict[str, Any]:
        return {"removed": sum(self.removed.values()), "by_reason": dict(self.removed), "examples": self.examples}


def _run_filters(
    records: list[Record], config: DataConfig
) -> tuple[list[Record], list[FilterStep], list[tuple[Record, str]]]:
    """Apply steps 2-5; returns the kept records, each step's tally, and every removal."""
    removals: list[tuple[Record, str]] = []
    steps = {name: FilterStep(name) for name in ("exact_duplicate", "quality", "toxicity", "near_duplicate")}

    def drop(step: str, record: Record, reason: str) -> None:
        steps[step].drop(record, reason)
        removals.append((record, f"{step}: {reason}"))

    seen: dict[str, Record] = {}
    kept = []
    for r in records:
        key = exact_key(r.text)
        if key in seen:
            drop("exact_duplicate", r, f"same as {seen[key].where}")
        else:
            seen[key] = r
            kept.append(r)
    passed = []
    for r in kept:
        problem = quality_problem(r, config)
        if problem:
            drop("quality", r, problem)
        else:
            passed.append(r)
    words = read_blocklist(config.blocklist) if config.blocklist else []
    clean = []
    for r in passed:
        word = blocked_word(r.text, words) if words else None
        if word:
            drop("toxicity", r, word)
        else:
            clean.append(r)
    dupes = near_duplicates([r.text for r in clean], config.minhash)
    for i, j in dupes.items():
        drop("near_duplicate", clean[i], f"near {clean[j].where}")
    final = [r for i, r in enumerate(clean) if i not in dupes]
    # Reasons with "same as"/"near" vary per record; tally them under one key.
    for step in ("exact_duplicate", "near_duplicate"):
        steps[step].removed = Counter({step: sum(steps[step].removed.values())}) if steps[step].removed else Counter()
    return final, list(steps.values()), removals


def _empty_error(inputs: list[str], removals: list[tuple[Record, str]]) -> DataError:
    removals = sorted(removals, key=lambda item: (item[0].source, item[0].line))
    listing = "; ".join(f"{r.where} {why}" for r, why in removals[:10])
    more = f" (and {len(removals) - 10} more)" if len(removals) > 10 else ""
    return DataError(
        f"no records left after filtering {', '.join(inputs)}: {listing}{more}; "
        "loosen the filters (--min-chars, --max-non-alpha-ratio, --blocklist none, --dedup-threshold) or add data"
    )


def split_key(record: dict[str, Any], split_by: str) -> str:
    """The group a record splits with: its first user turn (or first text line), normalized.

    ``split_by="record"`` gives every record its own group (its whole normalized text).
    """
    if split_by == "record":
        return normalize(Record(record, "", 0).text)
    if "messages" in record:
        first = next(
            (m["content"] for m in record["messages"] if m["role"] == "user"), record["messages"][0]["content"]
        )
    else:
        first = record["text"].strip().splitlines()[0] if record["text"].strip() else ""
    return normalize(first)


def split_groups(keys: list[str], num_val: int, rng: random.Random) -> list[int]:
    """Indices of the validation records: whole groups (equal ``keys``) in a seeded random order.

    Groups are taken in shuffled order while they fit in ``num_val`` records; a group that would
    overshoot is skipped (smaller ones after it may still fit), so the split holds at most
    ``num_val`` records, at least one, and never splits a group. If every group is larger than
    ``num_val``, the first shuffled group alone is the validation split (at least one training
    record remains as long as there are two groups).

    Args:
        keys: one group key per record.
        num_val: the validation records wanted (>= 1).
        rng: the seeded generator of the shuffle.

    Returns:
        Indices into ``keys``, in the shuffled order.

    Raises:
        DataError: every record has the same key, so no split keeps groups whole.
    """
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    if len(groups) < 2:
        raise DataError(
            f"all {len(keys)} records open with the same prompt, so a split by prompt leaves one side empty; "
            "pass --split-by record or add data"
        )
    order = list(groups.values())
    rng.shuffle(order)
    val: list[int] = []
    for members in order:
        if len(val) + len(members) <= num_val:
            val.extend(members)
        if len(val) == num_val:
            break
    return val or order[0]


def add_label_noise(records: list[dict[str, Any]], ratio: float, rng: random.Random) -> int:
    """Swap assistant replies of ``ratio`` of the dialogs with replies from other dialogs.

    Text records get their words shuffled instead. Modifies ``records`` in place.

    Returns:
        How many records were made noisy.
    """
    count = int(round(ratio * len(records)))
    if count == 0:
        return 0
    replies = [m["content"] for r in records for m in r.get("messages", []) if m["role"] == "assistant"]
    for idx in rng.sample(range(len(records)), count):
        rec = records[idx]
        if "messages" in rec:
            rec["messages"] = [
                {**m, "content": rng.choice(replies)} if m["role"] == "assistant" and replies else m
                for m in rec["messages"]
            ]
        else:
            words = rec["text"].split()
            rng.shuffle(words)
            rec["text"] = " ".join(words)
    return count


def prepare(config: DataConfig, out: str | Path, *, verbose: bool = True) -> dict[str, Any]:
    """Run the whole pipeline and write ``train.jsonl``, ``val.jsonl`` and ``data_report.json``.

    Returns:
        The report (also written to ``OUT/data_report.json``).

    Raises:
        DataError: a malformed record, an empty input, or nothing (or a single record) left
            after filtering (names the files and lines removed and why).
        OutputDirError: ``out`` is unsafe to replace (``engine.checkpoint.outputs.check_output_dir``).
    """
    started = time.monotonic()
    sources = tuple(path for path in config.inputs if Path(path).exists())
    check_output_dir(out, kind=DATA, sources=sources)  # before the work, not after it
    records, loaded, skipped = [], {}, []
    for spec in config.inputs:
        before = len(skipped)
        got = load_input(spec, skipped)
        loaded[spec] = len(got) + len(skipped) - before  # malformed ones too: the "malformed" step removes them
        records.extend(got)
    final, steps, removals = _run_filters(records, config)
    malformed = FilterStep("malformed")
    for record, problem in skipped:
        malformed.drop(record, "malformed")
        if verbose:
            print(f"warning: skipped malformed dialog {record.where}: {problem}")
    steps.insert(0, malformed)
    if not final:
        raise _empty_error(config.inputs, removals)
    if len(final) < 2:
        raise DataError(
            f"only one record left after filtering ({final[0].where}); a train/validation split needs at least 2"
        )
    rng = random.Random(config.seed)
    num_val = min(len(final) - 1, max(1, math.ceil(config.val_fraction * len(final))))
    val_idx = split_groups([split_key(r.data, config.split_by) for r in final], num_val, rng)
    val = [final[i].data for i in val_idx]
    held = set(val_idx)
    train = [json.loads(json.dumps(r.data)) for i, r in enumerate(final) if i not in held]  # copies: noise edits them
    noised = add_label_noise(train, config.noise_ratio, rng)
    report = {
        "config": dataclasses.asdict(config),
        "loaded": loaded,
        "total_loaded": len(records) + len(skipped),
        "filters": {s.name: s.to_json() for s in steps},
        "noised": noised,
        "kept": len(final),
        "train": len(train),
        "val": len(val),
        "val_prompts_in_train": len({split_key(r, "prompt") for r in val} & {split_key(r, "prompt") for r in train}),
        "train_chars": sum(len(Record(r, "", 0).text) for r in train),
        "elapsed_s": round(time.monotonic() - started, 3),
    }
    with staged_output_dir(out, kind=DATA, sources=sources) as tmp:
        _write_jsonl(tmp / "train.jsonl", train)
        _write_jsonl(tmp / "val.jsonl", val)
        (tmp / "data_report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    if verbose:
        print(format_report(report))
    return report


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def format_report(report: dict[str, Any]) -> str:
    """A short human-readable table of what each step removed."""
    lines = [
        f"loaded {report['total_loaded']} records from {', '.join(f'{k} ({v})' for k, v in report['loaded'].items())}"
    ]
    for name, step in report["filters"].items():
        reasons = ", ".join(f"{k} {v}" for k, v in step["by_reason"].items())
        lines.append(
            f"  {name:<16} removed {step['removed']:>6}"
            + (f"  ({reasons})" if reasons and name in ("quality", "toxicity") else "")
        )
    if report["noised"]:
        lines.append(f"  label noise on {report['noised']} training records")
    lines.append(
        f"kept {report['kept']}: train {report['train']}, val {report['val']} "
        f"(validation prompts also in train: {report.get('val_prompts_in_train', 0)})"
    )
    return "\n".join(lines)


def read_data_file(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``train.jsonl`` / ``val.jsonl`` file (validated).

    Raises:
        DataError: missing file, malformed record, or an empty file (names file:line).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found; run `lmforge data --out DIR` first")
    records = [r.data for r in load_jsonl(path)]
    if not records:
        raise DataError(f"{path}:1: no records in the file (empty input)")
    return records


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DataConfig()
    parser.add_argument(
        "--input",
        action="append",
        dest="inputs",
        metavar="SPEC",
        help="chatterbot:LANG (english, chinese, ...), a .yml dialog file, .jsonl or text file; repeatable "
        f"(default {DEFAULT_INPUT})",
    )
    parser.add_argument(
        "--out", default="runs/data", help="output directory (train.jsonl, val.jsonl, data_report.json)"
    )
    add_config_option(parser, d, "val_fraction")
    add_config_option(parser, d, "seed")
    add_config_option(
        parser,
        d,
        "split_by",
        "'prompt': dialogs with the same first user turn stay on one side of the split; 'record': each record on "
        "its own (default %(default)s)",
        choices=SPLIT_BY,
    )
    add_config_option(parser, d, "min_chars")
    add_config_option(parser, d, "max_chars")
    add_config_option(parser, d, "max_symbol_ratio")
    add_config_option(parser, d, "max_non_alpha_ratio")
    add_config_option(parser, d, "max_duplicate_line_fraction")
    add_config_option(parser, d, "blocklist", "toxicity word list file, or 'none' to disable")
    add_config_option(parser, d, "dedup_threshold", "MinHash Jaccard threshold")
    add_config_option(parser, d, "num_perm", "MinHash permutations")
    add_config_option(parser, d, "shingle_size", "characters per shingle")
    add_config_option(parser, d, "noise_ratio", "share of training dialogs given swapped replies")


def run(args: argparse.Namespace) -> int:
    blocklist = None if str(args.blocklist).lower() == "none" else args.blocklist
    fields = [f.name for f in dataclasses.fields(DataConfig)]
    with errors_name_flags(fields, {"inputs": "--input", "threshold": "--dedup-threshold"}):
        config = DataConfig(
            **config_fields(DataConfig, args, inputs=args.inputs or [DEFAULT_INPUT], blocklist=blocklist)
        )
        prepare(config, args.out)
    print(f"wrote {args.out}/train.jsonl, val.jsonl, data_report.json")
    return 0
