"""Spec-Bench prompts (jsonl: ``question_id``, ``category``, ``turns``), shared by the CLIs.

Odd question ids are for evaluation, even ids only for calibrating data-aware clusterings: every
loader here takes one ``parity`` and returns nothing of the other, so the two sets never mix.
"""
from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

from . import ops

# The Spec-Bench questions ship with the package (data/README.md says where they come from).
DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "spec_bench_question.jsonl"
PARITIES = ("odd", "even")


def questions_by_category(path, parity: str = "odd") -> dict:
    """Questions with an odd (or even) ``question_id``, per category in file order, as dicts
    ``question_id``, ``category``, ``text`` (the first turn)."""
    if parity not in PARITIES:
        raise ValueError(f"parity must be 'odd' (evaluation) or 'even' (calibration), got {parity!r}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"no Spec-Bench prompts at {path}: expected a jsonl file with question_id, category "
                                f"and turns, such as {DEFAULT_PROMPTS}")
    by_category = defaultdict(list)
    # Of each question: one given twice (a file concatenated to itself) was counted twice. Its id
    # alone does not name it: sources merged into one file may number theirs alike.
    first_line = {}
    for line_no, line in enumerate(io.StringIO(_utf8_text(path), newline=None), 1):  # \n, \r\n or \r ends a line
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_no}: not a JSON line ({error})") from None
        # The types too: a list category failed as an unhashable key, a string turns gave its
        # first character as the prompt, and a number as the first turn failed in tokenisation;
        # an empty turn is no tokens without a chat template (a recording of padding, or a failure).
        if not isinstance(row, dict) or not {"question_id", "category", "turns"} <= row.keys() \
                or not ops._is_int(row["question_id"]) or not isinstance(row["category"], str) \
                or not isinstance(row["turns"], list) or not row["turns"] or not isinstance(row["turns"][0], str) \
                or not row["turns"][0].strip():
            raise ValueError(f"{path}:{line_no}: expected fields question_id (an int), category (a string) and a "
                             "non-empty turns list whose first turn is a string that is not blank")
        repeated = first_line.setdefault((row["question_id"], row["category"], row["turns"][0]), line_no)
        if repeated != line_no:
            raise ValueError(f"{path}:{line_no}: the question of line {repeated} again (question_id "
                             f"{row['question_id']}, its category and first turn): each question is counted once")
        if row["question_id"] % 2 == (parity == "odd"):
            by_category[row["category"]].append(dict(question_id=row["question_id"], category=row["category"], text=row["turns"][0]))
    if not by_category:
        raise ValueError(f"{path} holds no prompts with an {parity} question_id")
    return dict(by_category)


def _utf8_text(path) -> str:
    """The file's text; bytes that are not UTF-8 are a ValueError naming the file and line, not the
    codec's error alone."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        lines = io.StringIO(data[:error.start].decode("utf-8"), newline=None).readlines()
        line_no = len(lines) + (not lines or lines[-1].endswith("\n"))
        raise ValueError(f"{path}:{line_no}: not UTF-8 text ({error.reason})") from None


def load_prompts(path, num_prompts: int, parity: str = "odd") -> list:
    """``num_prompts`` Spec-Bench questions of one ``parity`` (odd by default: even ids are
    reserved for calibrating data-aware clusterings), taken round-robin over the categories,
    largest first, in file order, so that a few prompts already span the categories, whose
    acceptance rates differ widely. The first turn is the prompt."""
    ops._require_positive_int("num_prompts", num_prompts)  # 2.5 would give 3 prompts, 0 an empty run
    queues = sorted(questions_by_category(path, parity).values(), key=len, reverse=True)
    chosen: list = []
    while len(chosen) < num_prompts and any(queues):
        for queue in queues:
            if queue and len(chosen) < num_prompts:
                chosen.append(queue.pop(0))
    return chosen


def prompts_per_category(path, per_category: Optional[int], parity: str = "odd") -> list:
    """The first ``per_category`` questions of one ``parity`` from every category (all with None)."""
    if per_category is not None:
        ops._require_positive_int("per_category", per_category)
    return [row for rows in questions_by_category(path, parity).values() for row in rows[:per_category]]
