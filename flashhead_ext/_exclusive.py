"""Objects one thread at a time may use, claimed for the length of a call."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable


class ExclusiveUse:
    """Claims objects (by identity) for one call at a time across threads: a second call that
    wants any of them while they are claimed gets ``busy(objects)``, raised, instead of waiting."""

    def __init__(self, busy: Callable[[], Exception]):
        self._busy = busy
        self._held: set = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, *objects, check: Callable[[], None] = lambda: None):
        """Holds ``objects`` (None ones skipped) inside the block; ``check`` runs first, under the
        claims' lock, so what it tests cannot change before the claim is taken."""
        keys = {id(thing) for thing in objects if thing is not None}
        with self._lock:
            check()
            if keys & self._held:
                raise self._busy()
            self._held |= keys
        try:
            yield
        finally:
            with self._lock:
                self._held -= keys
