"""Greedy speculative decoding with dense or FlashHead draft heads (docs/speculative.md).

``SpeculativeDecoder(target, draft, head, k=6).generate(ids, mode="deferred")`` returns the target's
own greedy tokens with per-run counters and times; :func:`early_exit_draft` makes a draft from a
target's first layers; ``cli.main`` is ``python -m flashhead_ext spec``.
"""
from .draft import HEADS, early_exit_draft, make_draft_head
from .driver import MODES, Generation, GenerationStats, SpeculativeDecoder

__all__ = ["SpeculativeDecoder", "Generation", "GenerationStats", "MODES", "HEADS", "early_exit_draft", "make_draft_head"]
