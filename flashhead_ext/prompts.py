"""Spec-Bench prompts (jsonl: ``question_id``, ``category``, ``turns``), shared by the CLIs."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

# The repository's checkout sits beside shared/, which holds the Spec-Bench questions.
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl"


def load_prompts(path, num_prompts: int) -> list:
    """``num_prompts`` Spec-Bench questions (jsonl: ``question_id``, ``category``, ``turns``).

    Odd question ids only (even ids are reserved for calibrating data-aware clusterings), taken
    round-robin over the categories, largest first, in file order, so that a few prompts already
    span the categories, whose acceptance rates differ widely. The first turn is the prompt.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"no Spec-Bench prompts at {path}; pass --prompts PATH to a spec_bench_question.jsonl")
    by_category = defaultdict(list)
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not {"question_id", "category", "turns"} <= row.keys() or not row["turns"]:
                raise ValueError(f"{path}:{line_no}: expected fields question_id, category and a non-empty turns list")
            if row["question_id"] % 2 == 1:
                by_category[row["category"]].append(row)
    queues = sorted(by_category.values(), key=len, reverse=True)
    chosen = []
    while len(chosen) < num_prompts and any(queues):
        for queue in queues:
            if queue and len(chosen) < num_prompts:
                row = queue.pop(0)
                chosen.append(dict(question_id=row["question_id"], category=row["category"], text=row["turns"][0]))
    if not chosen:
        raise ValueError(f"{path} holds no prompts with an odd question_id")
    return chosen
