"""Loads flashhead_ext._C after checking it was built against the torch that is installed.

A compiled torch extension is tied to one torch build; loading it under another fails with an
opaque undefined-symbol error, or worse, loads and misbehaves. Say what to rebuild instead.
"""
from __future__ import annotations

import torch

REBUILD_HINT = (
    "Rebuild it against the installed torch: "
    "pip install --no-build-isolation --force-reinstall --no-deps <path to flashhead_ext source>"
)


def build_info():
    try:
        from . import _build_info
    except ImportError as err:
        raise ImportError(
            "flashhead_ext has no compiled extension (flashhead_ext/_build_info.py is missing): "
            f"it was not built. {REBUILD_HINT}"
        ) from err
    return _build_info


def load_extension():
    info = build_info()
    if info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"flashhead_ext._C was built against torch {info.TORCH_VERSION} (CUDA {info.CUDA_VERSION}) "
            f"but torch {torch.__version__} (CUDA {torch.version.cuda}) is installed. {REBUILD_HINT}"
        )
    try:
        from . import _C  # noqa: F401  (registers torch.ops.flashhead.*)
    except ImportError as err:
        raise ImportError(f"flashhead_ext._C failed to load: {err}. {REBUILD_HINT}") from err
    return info
