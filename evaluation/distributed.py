"""Sharding of evaluation work across processes (``accelerate launch``, ``torchrun``, or none).

Generation for evaluation is embarrassingly parallel: each process takes a strided slice of the prompt
list and writes its outputs under their global index, so the shards need no gathering step (the files
are the gather). Which slice a process takes is decided here:

1. if ``accelerate`` is importable, its ``PartialState`` (works under ``accelerate launch`` and also
   reads torchrun's variables);
2. else the ``RANK`` / ``WORLD_SIZE`` environment variables (torchrun, SLURM wrappers);
3. else process 0 of 1.

Example::

    from mmspec.evaluation.distributed import shard
    for index, prompt in shard(list(enumerate(prompts))):   # this process's share, global indices kept
        image = pipe(prompt).images[0]
        image.save(f"out/{index:05d}.png")
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def process_index_and_count() -> tuple[int, int]:
    """(index of this process, number of processes) for sharding evaluation work."""
    try:
        from accelerate import PartialState
    except ImportError:
        PartialState = None
    if PartialState is not None:
        state = PartialState()
        return int(state.process_index), int(state.num_processes)
    rank = os.environ.get("RANK")
    world = os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None:
        index, count = int(rank), int(world)
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"RANK={rank} / WORLD_SIZE={world} are not a valid process index/count")
        return index, count
    return 0, 1


def shard_indices(n: int, index: int | None = None, count: int | None = None) -> list[int]:
    """Indices ``range(n)`` that process ``index`` of ``count`` handles (strided: index, index+count, ...).

    Strided rather than contiguous so that prompt categories, which are stored in blocks, spread evenly
    over the processes. ``index``/``count`` default to :func:`process_index_and_count`.
    """
    if index is None or count is None:
        auto_index, auto_count = process_index_and_count()
        index = auto_index if index is None else index
        count = auto_count if count is None else count
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if not 0 <= index < count:
        raise ValueError(f"index must lie in [0, {count}), got {index}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return list(range(index, n, count))


def shard(items: Sequence[T], index: int | None = None, count: int | None = None) -> list[T]:
    """The share of ``items`` that process ``index`` of ``count`` handles (see :func:`shard_indices`)."""
    return [items[i] for i in shard_indices(len(items), index, count)]


def is_main_process() -> bool:
    """True on the process that should write summaries (process 0)."""
    return process_index_and_count()[0] == 0


def wait_for_everyone() -> None:
    """Barrier across processes when running distributed (no-op in a single process)."""
    if process_index_and_count()[1] == 1:
        return
    try:
        from accelerate import PartialState
    except ImportError:
        PartialState = None
    if PartialState is not None:
        PartialState().wait_for_everyone()
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
