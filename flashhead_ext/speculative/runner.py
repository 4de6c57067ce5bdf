"""Timed runs of the driver over many prompts: configurations interleaved, summarised, tabled.

Each (mode, head) configuration runs every prompt; the order of configurations alternates from
one prompt to the next (forward, then reversed) after one short warm-up run of each, so slow
drifts of the machine (clock, caches, other load) fall evenly on all of them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

from .._cli import write_output
from ..bench.timing import format_table
from ..hf import apply_chat_template
from .draft import HEADS
from .driver import MODES


@dataclass(frozen=True)
class RunConfig:
    mode: str
    head: Optional[str]  # None for baseline, which uses no draft

    @property
    def label(self) -> str:
        return self.mode if self.head is None else f"{self.mode}/{self.head}"


def plan_configs(heads, modes) -> list:
    """Baseline once (it has no draft head), then every speculative mode with every head; a head or
    mode named twice runs once (else its prompts would be counted twice)."""
    heads, modes = list(dict.fromkeys(heads)), list(dict.fromkeys(modes))
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"modes must be drawn from {MODES}, got {mode!r}")
    for head in heads:
        if head not in HEADS:
            raise ValueError(f"heads must be drawn from {HEADS}, got {head!r}")
    if not modes:
        raise ValueError(f"modes must name at least one of {MODES}")
    speculative = [mode for mode in modes if mode != "baseline"]
    if speculative and not heads:
        raise ValueError(f"modes {', '.join(speculative)} need a draft head: heads must name at least one of {HEADS}")
    configs = [RunConfig("baseline", None)] if "baseline" in modes else []
    return configs + [RunConfig(mode, head) for head in heads for mode in modes if mode != "baseline"]


def encode_prompt(tokenizer, text: str) -> torch.Tensor:
    """Token ids ``[T]`` of a user turn, through the chat template when the tokenizer has one
    (with a fixed ``date_string``: :func:`flashhead_ext.hf.apply_chat_template`)."""
    if getattr(tokenizer, "chat_template", None):
        encoded = apply_chat_template(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_dict=True, return_tensors="pt")
    else:
        encoded = tokenizer(text, return_tensors="pt")
    return encoded["input_ids"][0]


def run_interleaved(decoders: dict, configs: list, prompts: list, max_new_tokens: int, *,
                    warmup_tokens: int = 8, progress: bool = True) -> list:
    """Runs every config on every prompt; returns one record per (prompt, config).

    ``decoders`` maps a config's head (None for baseline) to its :class:`SpeculativeDecoder`;
    ``prompts`` are dicts with ``input_ids`` plus metadata copied into the records. A record's
    ``matches_baseline`` says whether its tokens equal the baseline's for that prompt.
    """
    for config in configs:
        decoders[config.head].generate(prompts[0]["input_ids"], mode=config.mode, max_new_tokens=min(warmup_tokens, max_new_tokens))
    records = []
    for index, prompt in enumerate(tqdm(prompts, desc="prompts", disable=not progress)):
        order = configs if index % 2 == 0 else configs[::-1]
        outputs = {}
        for config in order:
            outputs[config] = decoders[config.head].generate(prompt["input_ids"], mode=config.mode, max_new_tokens=max_new_tokens)
        baseline = next((g.tokens for c, g in outputs.items() if c.head is None), None)
        for config in configs:
            generation = outputs[config]
            # Synthetic acceptance emits draft tokens by chance: comparing them with the baseline means nothing.
            comparable = baseline is not None and generation.stats.synthetic_acceptance is None
            records.append(dict(
                label=config.label, head=config.head, prompt_index=index,
                question_id=prompt.get("question_id"), category=prompt.get("category"),
                matches_baseline=generation.tokens == baseline if comparable else None,
                tokens=generation.tokens, **generation.stats.to_dict(),
            ))
    return records


def summarize(records: list, configs: list) -> list:
    """One row per config with the metrics of docs/speculative.md, totals over its prompts.

    Runs of the fast path also give the phase profile (``<phase>_share`` of decode time) and are
    labelled ``synthetic`` (in ``exact`` and ``synthetic_acceptance``) when their acceptance was drawn.
    """
    rows = []
    for config in configs:
        runs = [r for r in records if r["label"] == config.label]
        total = {key: sum(r[key] for r in runs) for key in (
            "new_tokens", "ttft_s", "decode_s", "rounds", "proposed", "accepted", "verify_calls",
            "append_calls", "host_syncs", "draft_s", "target_s")}
        # The fast path cannot time the draft head apart from the captured draft step.
        head_s = None if any(r["draft_head_s"] is None for r in runs) else sum(r["draft_head_s"] for r in runs)
        decode_tokens = total["new_tokens"] - len(runs)
        # The time the decode rates and shares divide: none without a decoded token (max_new_tokens
        # 1), whose few microseconds of bookkeeping read as 0 tok/s and a loop of 100%.
        per_decode_s = total["decode_s"] if decode_tokens > 0 else 0.0
        exact = [r["matches_baseline"] for r in runs if r["matches_baseline"] is not None]
        synthetic = {r.get("synthetic_acceptance") for r in runs} - {None}
        phases = {}
        for r in runs:
            for phase, seconds in r.get("phase_s", {}).items():
                phases[phase] = phases.get(phase, 0.0) + seconds
        overlapped = any(r.get("draft_overlaps_target") for r in runs)
        loop_s = None if overlapped else total["decode_s"] - total["draft_s"] - total["target_s"]
        rows.append(dict(
            label=config.label, mode=config.mode, head=config.head, samples=len(runs),
            new_tokens=total["new_tokens"], rounds=total["rounds"], proposed=total["proposed"],
            decode_tok_s=decode_tokens / per_decode_s if per_decode_s else None,
            ttft_ms=1000 * total["ttft_s"] / len(runs),
            decode_s=total["decode_s"],
            acceptance=total["accepted"] / total["proposed"] if total["proposed"] else None,
            mean_emitted=decode_tokens / total["rounds"] if total["rounds"] else None,
            verify_calls=total["verify_calls"], append_calls=total["append_calls"],
            syncs_per_round=total["host_syncs"] / total["rounds"] if total["rounds"] else None,
            draft_s=total["draft_s"],
            draft_share=total["draft_s"] / per_decode_s if per_decode_s else None,
            head_share=head_s / total["draft_s"] if total["draft_s"] and head_s is not None else None,
            overhead_ms_round=1000 * loop_s / total["rounds"] if total["rounds"] and loop_s is not None else None,
            overhead_share=loop_s / per_decode_s if per_decode_s and loop_s is not None else None,
            exact="synthetic" if synthetic else (f"{sum(exact)}/{len(exact)}" if exact else None),
            synthetic_acceptance=synthetic.pop() if len(synthetic) == 1 else None,
            **{f"{phase}_share": seconds / per_decode_s for phase, seconds in phases.items() if per_decode_s},
        ))
    base = next((r["decode_tok_s"] for r in rows if r["head"] is None), None)
    for row in rows:
        row["speedup"] = row["decode_tok_s"] / base if base and row["decode_tok_s"] else None
    return rows


COLUMNS = [
    ("label", "config", "s"), ("samples", "n", "d"), ("decode_tok_s", "tok/s", ".2f"), ("speedup", "speedup", ".3f"),
    ("ttft_ms", "TTFT ms", ".1f"), ("decode_s", "decode s", ".2f"), ("acceptance", "accept", ".3f"),
    ("mean_emitted", "emit/round", ".3f"), ("verify_calls", "verify", "d"), ("append_calls", "append", "d"),
    ("draft_s", "draft s", ".2f"), ("draft_share", "draft %", ".1%"), ("head_share", "head/draft", ".1%"),
    ("overhead_ms_round", "loop ms/round", ".2f"), ("overhead_share", "loop %", ".1%"), ("exact", "exact", "s"),
]
# The phase profile of the fast path (docs/speculative.md): shares of decode time.
PHASE_COLUMNS = [
    ("label", "config", "s"), ("propose_share", "propose", ".1%"), ("verify_share", "verify", ".1%"),
    ("finalize_share", "finalize", ".1%"), ("overhead_share", "loop overhead", ".1%"), ("exact", "exact", "s"),
]


def format_summary(rows: list) -> str:
    """The metrics table; the phase profile below it when the runs measured phases. Synthetic runs
    are announced in a line above the tables, besides their ``exact`` column."""
    text = format_table(rows, COLUMNS)
    if any(row.get("verify_share") is not None for row in rows):
        text += ("\n\nphase profile (share of decode time: propose, verify and finalize split it; loop overhead, the "
                 "time outside the model forwards, lies within them)\n" + format_table(rows, PHASE_COLUMNS))
    synthetic = sorted({row["synthetic_acceptance"] for row in rows if row.get("synthetic_acceptance") is not None})
    if synthetic:
        text = (f"SYNTHETIC ACCEPTANCE R={', '.join(map(str, synthetic))}: speculative runs accept proposals at random; "
                "their tokens are not the target's greedy output\n" + text)
    return text


def reading(rows: list) -> str:
    """What the table says, in a few lines under it: the best speculative config against the
    baseline (and why it is slower when it is), and what the FlashHead draft head changed; without
    a baseline run, that nothing checked the tokens."""
    lines = []
    if rows and not any(row["head"] is None for row in rows):
        lines.append("no baseline run: the tokens were not compared with the target's own (add baseline to --mode)")
    speculative = [row for row in rows if row["head"] is not None and row.get("speedup") is not None]
    if speculative:
        best = max(speculative, key=lambda row: row["speedup"])
        if best["speedup"] >= 1:
            lines.append(f"best: {best['label']}, {best['speedup']:.3f}x the baseline's decode tok/s")
        else:
            line = (f"speculation is slower than the baseline here (best: {best['label']}, {best['speedup']:.3f}x): a round "
                    f"emitted {best['mean_emitted']:.2f} tokens for a whole draft and a verify")
            if best["acceptance"] is not None and best["acceptance"] < 0.5 and best.get("synthetic_acceptance") is None:
                line += f", since {best['acceptance']:.1%} of the proposals were accepted; a stronger draft pays off"
            lines.append(line)
    by_label = {row["label"]: row for row in rows}
    for row in rows:
        dense = by_label.get(f"{row['mode']}/dense")
        if row["head"] != "flashhead" or dense is None or not dense["draft_s"] or not row["draft_s"]:
            continue
        change = f"{row['mode']}: FlashHead draft {_durations(row['draft_s'], dense['draft_s'])}"
        if row["head_share"] is not None and dense["head_share"] is not None:
            change += f"; the head's share of the draft {dense['head_share']:.1%} -> {row['head_share']:.1%}"
        lines.append(change)
    return "\n".join(lines)


def _durations(flash_s: float, dense_s: float) -> str:
    """The two draft times in one unit: seconds, or milliseconds where both are under one (a short
    run's 0.004 s would print as 0.00 s)."""
    if max(flash_s, dense_s) >= 1:
        return f"{flash_s:.2f} s against dense {dense_s:.2f} s"
    return f"{flash_s * 1e3:.1f} ms against dense {dense_s * 1e3:.1f} ms"


def write_json(path, meta: dict, rows: list, records: list) -> Path:
    return write_output(path, json.dumps(dict(meta=meta, summary=rows, runs=records), indent=1))


__all__ = ["RunConfig", "plan_configs", "encode_prompt", "run_interleaved", "summarize", "format_summary", "reading",
           "write_json"]
