"""CUDA-graph capture shared by the fast path (flashhead_ext.fast) and the benchmarks."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch


@contextmanager
def _no_automatic_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused (as the caller had it after): torch.cuda.graph no
    longer collects before a capture (torch 2.9 and later), and a collection during one that
    destroys a dead CUDA graph, held by a reference cycle in anyone's code, fails the capture
    (cudaErrorStreamCaptureInvalidated: destroying a graph is not permitted while a stream captures)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_graph(fn: Callable[[], object], *, device: Optional[torch.device] = None,
                  prepare: Callable[[], object] = lambda: None, warmups: int = 3) -> torch.cuda.CUDAGraph:
    """``fn`` captured into a CUDA graph on ``device`` (default: the current one), after ``warmups``
    eager runs on a side stream, as torch recommends. ``prepare`` runs before each warm-up and before
    the capture: the warm-ups really execute, so state they move (cache lengths) is put back in bounds.

    The capture stream is made on ``device``: torch.cuda.graph's default one belongs to whichever
    device was current when it was first made, and capturing another device's work through it
    would leave that work on that device's legacy stream, which fails the capture.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                prepare()
                fn()
        torch.cuda.current_stream().wait_stream(side)
        prepare()
        graph = torch.cuda.CUDAGraph()
        with _no_automatic_collection(), torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
            fn()
    return graph
