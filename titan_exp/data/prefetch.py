"""A loader's next batch cut in a background thread while the step runs."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class Prefetch:
    """The next batch cut by a background thread while the step runs: `cut()` returns a batch
    and the position after it; `next()` hands them out in order; `drain()` drops the one ahead
    (before the position is moved)."""

    def __init__(self, cut: Callable[[], tuple[Any, dict[str, Any]]], enabled: bool):
        self.cut, self.enabled = cut, enabled
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: Future | None = None

    def next(self) -> tuple[Any, dict[str, Any]]:
        out = self._ahead.result() if self._ahead is not None else self.cut()
        self._ahead = None
        if self.enabled:
            self._pool = self._pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="loader-prefetch")
            self._ahead = self._pool.submit(self.cut)
        return out

    def drain(self) -> None:
        if self._ahead is not None:  # a prefetched batch from the old position: finish, then drop it
            self._ahead.result()
            self._ahead = None
