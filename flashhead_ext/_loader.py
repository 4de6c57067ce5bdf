"""Loads flashhead_ext._C after checking it was built against the torch that is installed.

A compiled torch extension is tied to one torch build; loading it under another fails with an
opaque undefined-symbol error, or worse, loads and misbehaves. Say what to rebuild instead.
"""
from __future__ import annotations

from pathlib import Path

import torch

# --no-cache-dir: installed by name from an index, pip reuses the wheel it built from the sdist
# before, whichever torch that was against, so the reinstall put the stale build back.
REBUILD_HINT = (
    "Rebuild it against the installed torch: "
    "pip install --no-build-isolation --force-reinstall --no-deps --no-cache-dir <flashhead_ext's source directory or sdist>"
)


def build_info():
    try:
        from . import _build_info
    except ImportError as err:
        # Run from a source checkout's root, Python imports the checkout, not the copy pip installed.
        raise ImportError(
            f"flashhead_ext was imported from {Path(__file__).parent}, which holds no built extension "
            "(no _build_info.py beside it). From a source checkout's root, Python imports the checkout "
            "rather than an installed copy: run elsewhere, or install the checkout in place "
            "(pip install --no-build-isolation -e <path>)"
        ) from err
    return _build_info


def load_extension():
    info = build_info()
    if info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"flashhead_ext._C was built against torch {info.TORCH_VERSION} "
            f"({f'CUDA {info.CUDA_VERSION} kernels' if info.CUDA_VERSION else 'CPU references only'}) "
            f"but torch {torch.__version__} ({f'CUDA {torch.version.cuda}' if torch.version.cuda else 'a CPU build'}) is "
            f"installed. {REBUILD_HINT}"
        )
    try:
        from . import _C  # noqa: F401  (registers torch.ops.flashhead.*)
    except ImportError as err:
        raise ImportError(f"flashhead_ext._C failed to load: {err}. {REBUILD_HINT}") from err
    return info
