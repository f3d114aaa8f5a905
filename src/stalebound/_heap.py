"""Keep the garbage collector's full collections off the objects a process built before its busy part.

A training process holds a few hundred thousand objects that live as long as it does: the modules
of torch and transformers, the model, the tokenizer, the task's prompts. CPython's full collection
(of its oldest generation) visits every one of them. While a run makes and drops hundreds of
trajectories a second, enough of them outlive the young generations that a full collection comes
every few seconds, and each holds the interpreter — the trainer's step and the executor's event
loop with it — for a quarter of a second on a CPU. :func:`gc.freeze` moves every object alive at
that moment into a permanent generation the collector skips; the objects made afterwards are
collected as before, and reference counting frees any object, frozen or not, as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["frozen_heap"]


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect what is garbage now, freeze everything left for the ``with`` block, and unfreeze it
    after, so the objects of a run that ended can be collected when the process goes on (a
    benchmark running one policy after another, a test suite). Within a block already frozen, the
    objects made since are frozen too and the outermost block unfreezes them all."""
    outermost = gc.get_freeze_count() == 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if outermost:
            gc.unfreeze()
