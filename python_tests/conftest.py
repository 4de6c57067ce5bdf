"""GPU marking and skipping, and the shared ``device`` fixture.

A test runs on the GPU when it is marked ``gpu`` or when one of its parameters names a CUDA device
(the marker is then applied here). Without a usable GPU those tests are skipped, and the reason is
printed in the report header and summary: either torch sees no CUDA device, or this flashhead_ext
build has no CUDA kernels (a CPU-only build, e.g. FLASHHEAD_SKIP_CUDA_BUILD=1 or no nvcc at build time).
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# torch.compile's caches (inductor's and AOTAutograd's) key graphs without this extension's build,
# so a warm cache would hand the compile tests graphs traced with another build's kernels; each
# test process compiles into a fresh directory instead.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="flashhead-tests-inductor-")
atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import pytest
import torch

import flashhead_ext
from helpers import DEVICES


def gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    if not flashhead_ext.cuda_kernels_built():
        return ("this flashhead_ext build has no CUDA kernels (flashhead_ext.cuda_kernels_built() is False): "
                "rebuild with nvcc/CUDA_HOME present and FLASHHEAD_SKIP_CUDA_BUILD unset")
    return None


def _names_cuda(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.startswith("cuda")


SKIP_PREFIX = "GPU test skipped: "


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(_names_cuda(v) for v in callspec.params.values()):
            item.add_marker(pytest.mark.gpu)
        if reason is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=SKIP_PREFIX + reason))
        elif item.get_closest_marker("two_gpus") is not None and torch.cuda.device_count() < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs two GPUs, torch sees {torch.cuda.device_count()}"))


def pytest_report_header(config):
    reason = gpu_skip_reason()
    if reason is None:
        return f"flashhead GPU tests: run on {torch.cuda.get_device_name()}"
    return f"flashhead GPU tests: skipped, {reason}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if SKIP_PREFIX in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(f"flashhead: {len(skipped)} GPU tests skipped: {gpu_skip_reason()}")


@pytest.fixture(params=DEVICES)
def device(request):
    """Each test using it runs on the CPU and (marked gpu) on CUDA."""
    return request.param
