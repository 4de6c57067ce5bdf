"""Where a warning points: the user's line, past the package's and its hosts' frames."""
import sys
from types import FrameType
from typing import Optional

# Packages between a user's line and a warning: torch's module calls and compiler.disable
# wrappers, a transformers model's forward, accelerate's hooks.
_PASSED_THROUGH = ("flashhead_ext", "torch", "transformers", "accelerate")


def callers_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, for the function that calls this one, of the first frame
    outside ``_PASSED_THROUGH``: the user's line, which the paths to a warning (attach, a forward,
    a setter, a state-dict load) reach at different depths."""
    level = 2  # the caller of the function that warns
    frame: Optional[FrameType] = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _PASSED_THROUGH:
        level, frame = level + 1, frame.f_back
    return level
