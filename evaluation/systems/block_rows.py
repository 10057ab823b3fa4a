"""Block-level rows (continuous MAR images with CSpD, block-causal video with SDVG): a call of the pipeline itself.

These loops verify sets of tokens or whole blocks, not chains, so there is no closed-form tau. A row calls the
pipeline (``pipe(..., method=config)``, ``output_type="latent"``) with the method's config as a plain call
resolves it (``pipe.method_config(name, ...)``) and reads the loop's phase timings
(:attr:`~mmspec.stats.SpecStats.phase_seconds`: "target", "draft", "prefill", "cache", "decode", "reward"
are model work; "verify" and anything outside a phase are the loop's own):

* ``bound`` = target-only model time / speculative model time: the speedup if the loop's own work cost
  nothing (the block analogue of the token rows' bound);
* ``loop_ms``: per target pass, the call's time outside the model phases.

The phases are host wall times: exact on a CPU; on a GPU, work still queued when a phase ends is counted in
a later one, so there the split between model and loop time (``bound``, ``loop_ms``) is approximate, while
``speedup`` (whole calls, synchronised) is exact.

Acceptance: CSpD's default verification (``verify_order="independent"``) commits every drafted token whatever
the verdict, so its speed does not depend on acceptance; its rows report the acceptance random weights give
(``alpha`` is None). SDVG keeps a drafted block when its reward reaches ``tau``: the controlled reward
(:class:`ControlledReward`) scores a block above ``tau`` with probability ``alpha``, so the accepted fraction
of routed blocks is ``alpha`` in expectation. Its cost is nil, where a real reward model (ImageReward, CLIP)
has one: the rows measure the loop, drafter, VAE decode and target, not the scorer.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from ..speed import MemoryProbe, seed_everything
from .builders import System
from .timing import profile_call
from .token_rows import needs_profile

#: phases of a block loop's statistics that are model work
MODEL_PHASES = ("target", "draft", "prefill", "cache", "decode", "reward")


class ControlledReward:
    """A per-frame reward that passes a block with probability ``alpha``: every frame scores ``tau + 1``
    (pass) or ``tau - 1`` (fail), one draw per scored block, from its own seeded generator."""

    def __init__(self, alpha: float, tau: float, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha, self.tau = alpha, float(tau)
        self.generator = torch.Generator().manual_seed(seed)
        self.__name__ = f"controlled(alpha={alpha})"

    def __call__(self, frames: torch.Tensor, prompt: Any) -> torch.Tensor:
        passed = bool(torch.rand((), generator=self.generator) < self.alpha)
        return torch.full((frames.shape[0],), self.tau + (1.0 if passed else -1.0), dtype=torch.float64)


def _call(system: System, method: Any, batch: int, seed: int) -> tuple[float, Any, int | None, int | None]:
    """One pipeline call: ``(wall seconds, stats, peak bytes, start bytes)``."""
    spec, pipe = system.spec, system.pipe
    # the video loop draws its block noise on the CPU; MAR's state draws on its generator's device
    generator = torch.Generator("cpu" if spec.family == "video" else system.device).manual_seed(seed)
    if spec.family == "continuous":
        kwargs = {"class_labels": list(range(batch)), "num_iter": spec.config["num_iter"],
                  "num_diffusion_steps": spec.config["diffusion_steps"]}
    else:
        kwargs = {"prompt": system.prompts(batch, seed), "num_blocks": spec.new_tokens}
    probe = MemoryProbe(system.device.type)
    seed_everything(seed)
    start_bytes = probe.start()
    start = time.perf_counter()
    out = pipe(method=method, guidance_scale=spec.guidance_scale, generator=generator, output_type="latent", **kwargs)
    if system.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out.stats, probe.stop(), start_bytes


def block_method(system: System, method: str, batch: int, alpha: float | None, seed: int) -> Any:
    """The config a plain ``method=name`` call of this batch resolves to, with SDVG's reward controlled."""
    config = system.pipe.method_config(method, batch_size=batch, guidance_scale=system.spec.guidance_scale)
    if system.spec.family == "video":
        if alpha is None:
            raise ValueError("video rows need an alpha (the controlled reward's pass rate)")
        config = config.replace(reward=ControlledReward(alpha, config.tau, seed), reward_kwargs=None)
    return config


def config_values(config: Any) -> dict[str, Any]:
    """A config's fields as plain values; a callable (the controlled reward) by its name."""
    return {f.name: getattr(getattr(config, f.name), "__name__", None) or getattr(config, f.name)
            if callable(getattr(config, f.name)) else getattr(config, f.name) for f in dataclasses.fields(config)}


def _model_seconds(stats: Any) -> float:
    return sum(stats.phase_seconds.get(phase, 0.0) for phase in MODEL_PHASES)


def block_row(method: str, alpha: float | None, batch: int, base: Sequence[tuple], spec: Sequence[tuple],
              config: Any) -> dict[str, Any]:
    """The reported quantities of one row from the target-only and speculative calls (:func:`_call` tuples)."""
    base_wall = statistics.median(run[0] for run in base)
    spec_wall = statistics.median(run[0] for run in spec)
    base_model = statistics.median(_model_seconds(run[1]) for run in base)
    spec_model = statistics.median(_model_seconds(run[1]) for run in spec)
    stats = spec[0][1]
    passes = stats.target_calls or 1
    loop = statistics.median((run[0] - _model_seconds(run[1])) / (run[1].target_calls or 1) for run in spec)
    bound = base_model / spec_model if spec_model else None
    speedup = base_wall / spec_wall
    peaks = [run[2] for run in spec if run[2] is not None]
    starts = [run[3] for run in spec if run[3] is not None]
    acceptance = getattr(stats, "acceptance_rate", None)
    return {
        "method": method, "alpha": alpha, "batch": batch, "config": config_values(config),
        "acceptance": None if acceptance is None or acceptance != acceptance else acceptance,
        "target_passes": stats.target_calls, "base_target_passes": base[0][1].target_calls,
        "draft_passes": stats.draft_calls,
        "speedup": speedup,
        "speedup_range": [min(base_wall / run[0] for run in spec), max(base_wall / run[0] for run in spec)],
        "bound": bound, "efficiency": speedup / bound if bound else None,
        "loop_ms": 1e3 * loop, "loop_pct": 100 * loop / (spec_model / passes) if spec_model else None,
        "phases_s": {k: round(v, 4) for k, v in stats.phase_seconds.items()},
        "base_s": base_wall, "spec_s": spec_wall,
        "peak_mb": max(peaks) / 2**20 if peaks else None, "start_mb": min(starts) / 2**20 if starts else None,
    }


def block_rows(system: System, methods: Sequence[str], alphas: Sequence[float], batches: Sequence[int],
               repeats: int, seed: int, progress: Any = None, profile: bool = False) -> list[dict[str, Any]]:
    """Every (method, alpha, batch) row of a block-family system (CSpD rows have one, alpha-free, row per
    batch): per batch a warm-up call, the target-only calls, then each method's; with ``profile``, rows that
    :func:`~.token_rows.needs_profile` get one more call under cProfile."""
    rows = []
    with torch.inference_mode(False):
        for batch in batches:
            _call(system, "none", batch, seed)  # warm-up
            base = [_call(system, "none", batch, seed) for _ in range(repeats)]
            if progress is not None:
                progress.update(1)
            for method in methods:
                for alpha in (alphas if system.spec.family == "video" else (None,)):
                    configs = [block_method(system, method, batch, alpha, seed) for _ in range(repeats)]
                    spec = [_call(system, config, batch, seed) for config in configs]  # each a fresh reward
                    row = block_row(method, alpha, batch, base, spec, configs[0])
                    if profile and needs_profile(row):
                        config = block_method(system, method, batch, alpha, seed)
                        row["profile"] = profile_call(partial(_call, system, config, batch, seed))
                    rows.append(row)
                    if progress is not None:
                        progress.update(1)
    return rows
