"""Timers around the models a loop calls, so a run splits into model forwards and everything else.

:class:`Timer` records the wall time of named calls (a target forward, a drafter's round, a prefill), each
with an optional key (the tokens a forward scored). On a GPU every timed call is bracketed by
``torch.cuda.synchronize`` so the time is the device's work, not the launch; those synchronisations would
themselves change a loop's speed, which is why a run that reports a speedup times only its prefills
(``detailed=False``) and a separate instrumented run gives the breakdown. On a CPU there is nothing
asynchronous to wait for, and every run is instrumented.

:class:`TimedProxy` puts a timer around chosen methods of an object (a target runner, a video model) and
passes every other attribute through, so the loop it is handed cannot tell it from the object.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


class Timer:
    """Wall time of named calls, with optional keys.

    Args:
        device: where the timed work runs (CUDA work is synchronised before and after each timed call).
        detailed: False times only the calls marked ``essential`` (prefills): a run whose wall time is
            reported must not pay for a synchronisation per forward.
    """

    def __init__(self, device: torch.device | str, detailed: bool = True) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.detailed = detailed
        self.records: dict[str, list[tuple[Any, float]]] = defaultdict(list)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextmanager
    def time(self, name: str, key: Any = None, essential: bool = False) -> Iterator[None]:
        """Record the wall time of the block under ``name`` (with ``key``), unless this timer times only
        essential calls and this one is not."""
        if not (self.detailed or essential):
            yield
            return
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.records[name].append((key, time.perf_counter() - start))

    def total(self, *names: str) -> float:
        """Seconds recorded under any of ``names``."""
        return sum(seconds for name in names for _, seconds in self.records.get(name, ()))

    def count(self, name: str) -> int:
        return len(self.records.get(name, ()))

    def seconds(self, name: str, key: Any = None) -> list[float]:
        """The recorded times of ``name`` (those with ``key`` when given)."""
        return [s for k, s in self.records.get(name, ()) if key is None or k == key]

    def mean(self, name: str, key: Any = None) -> float | None:
        """The mean recorded time of ``name`` (with ``key``): every call counts once, so means times counts
        add up to the run's model time (a median would drop the calls a busy machine slowed down)."""
        values = self.seconds(name, key)
        return sum(values) / len(values) if values else None


def _token_count(args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """Tokens per row of a runner's ``forward(tokens [B, T], ...)``: the key of a timed forward."""
    tokens = args[0] if args else kwargs.get("tokens")
    return int(tokens.shape[1]) if isinstance(tokens, torch.Tensor) and tokens.ndim == 2 else None


class TimedProxy:
    """``inner`` with the methods named in ``methods`` (method name -> timer record name) timed.

    ``key`` computes a record's key from a call's arguments (default: the tokens per row of a runner's
    forward); ``essential`` names the methods timed even by a timer that is not detailed.
    """

    def __init__(self, inner: Any, timer: Timer, methods: Mapping[str, str],
                 key: Callable[[tuple, Mapping[str, Any]], Any] = _token_count,
                 essential: tuple[str, ...] = ("prefill",)) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_wrapped", {name: self._wrap(getattr(inner, name), timer, record, key,
                                                               name in essential)
                                              for name, record in methods.items()})

    @staticmethod
    def _wrap(method: Callable, timer: Timer, record: str, key: Callable, essential: bool) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with timer.time(record, key(args, kwargs), essential):
                return method(*args, **kwargs)

        return timed

    def __getattr__(self, name: str) -> Any:
        wrapped = self._wrapped.get(name)
        return wrapped if wrapped is not None else getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


def profile_call(run: Callable[[], Any], top: int = 12) -> dict[str, list[dict[str, Any]]]:
    """``run()`` under cProfile: where a loop's time goes. ``"overall"``: the ``top`` functions by own time
    (``tottime``; model kernels lead); ``"core"``: the same for the package's own loop code (``mmspec/``:
    the loop, runners, caches, rules, drafters), as ``{"function", "calls", "own_ms", "cumulative_ms"}``."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    entries = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    ranked = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)
    core = f"{os.sep}mmspec{os.sep}"

    def listed(items: list) -> list[dict[str, Any]]:
        return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls, "own_ms": round(1e3 * own, 3),
                 "cumulative_ms": round(1e3 * cumulative, 3)}
                for (file, line, name), (calls, _, own, cumulative, _) in items[:top]]

    return {"overall": listed(ranked), "core": listed([item for item in ranked if core in item[0][0]])}
