"""flashhead_ext: FlashHead retrieval heads as torch ops (CPU reference + CUDA kernels)."""
from . import _loader

BUILD_INFO = _loader.load_extension()

from . import ops  # noqa: E402
from .assets import flash_head_for, load_assets, save_assets  # noqa: E402
from .clustering import build_clusters, calibrate_clusters  # noqa: E402
from .head import DenseHead, FlashHead  # noqa: E402
from .hf import attach, detach, load_smollm2  # noqa: E402  (transformers is imported only when used)

__version__ = "0.1.0"
__all__ = ["ops", "FlashHead", "DenseHead", "build_clusters", "calibrate_clusters", "flash_head_for", "load_assets",
           "save_assets", "attach", "detach", "load_smollm2", "BUILD_INFO", "cuda_kernels_built"]


def cuda_kernels_built() -> bool:
    """True when the CUDA kernels were compiled into this build (independent of any GPU being present)."""
    return bool(BUILD_INFO.WITH_CUDA)
