"""One lock per shared object, for the few pieces of state that concurrent pipeline calls share.

Why: a pipeline call keeps its decoding state to itself (a fresh runner, KV cache and drafter per call;
hooks on the shared models fire only for their own thread, :func:`mmspec.hidden_capture.thread_scoped`),
so two threads may call one pipeline at once. What remains shared is state *outside* the decoding loop:

* a Hugging Face fast tokenizer keeps its padding and truncation settings inside the Rust tokenizer and
  changes them on every call that asks for other ones; a call in another thread meanwhile encodes with the
  wrong settings or fails ("Already borrowed");
* tables and scorer models that a pipeline builds on first use and keeps (they should be built once, and a
  reader must never see another thread's smaller table).

:func:`shared_lock` gives each such object its own re-entrant lock, without storing anything on the object
(so pipelines, tokenizers and models still copy, pickle and save as before); the lock lives as long as the
object does.

Example::

    with shared_lock(pipe.tokenizer):
        inputs = pipe.processor(text=texts, images=images, padding=True, return_tensors="pt")
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_REGISTRY = threading.Lock()  # guards _LOCKS itself: two threads asking first must get the same lock


def shared_lock(owner: Any) -> threading.RLock:
    """The re-entrant lock of ``owner`` (created on first use; one per object, by identity for objects with
    the default hash). Use it as a context manager around every use of the state it guards."""
    with _REGISTRY:
        lock = _LOCKS.get(owner)
        if lock is None:
            lock = _LOCKS[owner] = threading.RLock()
        return lock
