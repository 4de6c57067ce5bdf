"""Timing helpers shared by the benchmarks: CUDA events, warm-up, medians, graph replay, run metadata."""
from __future__ import annotations

import contextlib
import datetime
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import BUILD_INFO, __version__
from .. import _provenance as provenance


@contextlib.contextmanager
def usage_error_past_memory(parser, what: str, device):
    """Runs the block; where its allocations do not fit ``device`` (torch.OutOfMemoryError on a
    GPU, the DefaultCPUAllocator's error on the CPU), a usage error naming ``what`` instead."""
    try:
        yield
    except RuntimeError as error:
        if not isinstance(error, torch.OutOfMemoryError) and "can't allocate memory" not in str(error):
            raise
        parser.error(f"{what}: its weights do not fit on {device} ({str(error).splitlines()[0]})")


def source_commit(mark_dirty: bool = False) -> str:
    """Short commit of the code this package runs: the FLASHHEAD_COMMIT variable where set; else
    the checkout that tracks this package's files (an editable or in-place build, "+dirty"
    appended with ``mark_dirty`` when it has uncommitted changes); else the commit recorded when
    the installed copy was built; else "unknown"."""
    # Resolved: a strict editable install runs the package through links outside the checkout.
    return (provenance.source_commit(Path(__file__).resolve().parents[1] / "__init__.py", mark_dirty)
            or build_commit() or "unknown")


def build_commit() -> Optional[str]:
    """The commit the loaded extension was built from ("+dirty" for uncommitted code; None for a build
    outside a checkout): an editable install runs the checkout's Python code, but its kernels are
    those of the last build."""
    return getattr(BUILD_INFO, "SOURCE_COMMIT", None)


def utc_stamp() -> str:
    """The date and time a result file records, in UTC."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def run_metadata(device: str) -> dict:
    """The run's device (``device``, as the CLIs' --device: a CPU run on a machine with a GPU is
    a CPU run), versions, date and commit, recorded with every result file."""
    meta = {
        "date": utc_stamp(),
        "commit": source_commit(mark_dirty=True),  # a run of uncommitted code says so
        "build_commit": build_commit(),
        "version": __version__,
        "torch": torch.__version__,
        "device": "cpu",
    }
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        index = torch.device(device).index
        meta.update(device=props.name, cuda_index=torch.cuda.current_device() if index is None else index,
                    sms=props.multi_processor_count, l2_bytes=getattr(props, "L2_cache_size", None),
                    memory_bytes=props.total_memory)
    return meta


def on_device(device: str):
    """A context in which ``device``, where it is a CUDA device, is the current one: the events,
    graphs, streams and copies that name no device then land on it, as on the tensors the run
    made there (``cuda:1`` otherwise times and captures ``cuda:0``'s stream). No-op on the CPU."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def median_us(samples_ms: list[float]) -> float:
    return 1000.0 * statistics.median(samples_ms)


def time_calls(fn: Callable[[], object], *, calls_per_sample: int, samples: int = 30, warmup: int = 5,
               device: str = "cuda") -> float:
    """Median microseconds per call of ``fn`` (itself ``calls_per_sample`` calls).

    CUDA events on the GPU (device time, launch gaps included); a host clock on the CPU.
    """
    for _ in range(warmup):
        fn()
    times = []
    if torch.device(device).type == "cpu":
        for _ in range(samples):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1000.0 / calls_per_sample)
        return median_us(times)
    torch.cuda.synchronize()
    for _ in range(samples):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls_per_sample)
    return median_us(times)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written per second): the floor's ceiling."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = time_calls(lambda: dst.copy_(src), calls_per_sample=1, samples=10, warmup=3)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Fixed-width text table; columns are (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([("" if row.get(k) is None else format(row[k], f)) for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
