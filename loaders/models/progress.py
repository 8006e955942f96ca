"""Load progress. A loader walks what it reads through `tracked`; whoever called it may listen (the host
adapter turns the steps into ComfyUI's progress bar). Without a listener a step costs one lookup."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")
Listener = Callable[[int, int], None]  # (steps done, steps in all)

_listener: ContextVar[Listener | None] = ContextVar("flux2dev_load_progress", default=None)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Send the progress of every load inside the block to `listener`."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)


def tracked(items: Collection[T]) -> Iterator[T]:
    """The items, reporting each one done; at most one report per hundredth, so a UI is not flooded."""
    listener, total = _listener.get(), len(items)
    shown = -1
    for done, item in enumerate(items, 1):
        yield item
        if listener is not None and done * 100 // total != shown:
            shown = done * 100 // total
            listener(done, total)
