"""Where the time of EAGLE decoding goes: target calls and head steps by their position in a round.

A diagnostic for docs/pipeline_ar_image.md (the greedy speed goal). It runs ``ARImagePipeline`` with
``method="eagle"`` (greedy, the checkpoint's stored settings by default) and times every model call the
speculation loop makes through :class:`~mmspec.runner.CausalLMRunner` (``_run``: the model's forward and
its cache bookkeeping), grouped by model and, for the EAGLE head, by its position in the round: step 0
feeds the previous round's accepted tokens and returns the first draft (in an image's first round, the
head's prefill), steps 1, 2, ... extend the chain.
Then the same prompts with ``method="none"`` give the target's cost per single-token call. Per-call
means show whether a head step costs what its arithmetic suggests, and how much more the first steps
after a target call cost (on a CPU whose caches the target's weights have just filled).
``phases`` adds the wall time per image of each phase of the speculation loop (``SpecStats.phase_seconds``:
prefill, draft, target, verify, commit) and ``outside_phases`` the rest of the pipeline call (inputs,
set-up, the loop's own bookkeeping): with the call times they show what a round costs besides its model
forwards (the draft phase holds the head's calls, its prefill included; the target phase the target's
calls after its prefill).

    python -m mmspec.evaluation.profile_eagle_rounds [--pipeline mmspec/shapes-t2i] [--prompts 3] [--threads 1]
        [--cpu-gemm packed|plain]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mmspec.cpu_gemm import add_cpu_gemm_argument
from mmspec.devices import add_device_arguments, resolved_device

from .bench_cli import load_quiet_pipeline

MAX_POSITION = 8  # head steps at this position or later are pooled


@contextmanager
def timing_model_calls(head_type: type) -> Iterator[dict[str, list[float]]]:
    """Seconds of every ``CausalLMRunner`` model call inside the block, keyed ``"target"`` or ``"head <i>"``
    (i: the head step's position in its round; a target call starts a new round)."""
    from mmspec.runner import CausalLMRunner

    original = CausalLMRunner._run
    times: dict[str, list[float]] = defaultdict(list)
    position = [0]

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        out = original(self, *args, **kwargs)
        seconds = time.perf_counter() - start
        if isinstance(self.model, head_type):
            times[f"head {min(position[0], MAX_POSITION)}"].append(seconds)
            position[0] += 1
        else:
            times["target"].append(seconds)
            position[0] = 0
        return out

    CausalLMRunner._run = timed
    try:
        yield times
    finally:
        CausalLMRunner._run = original


def profile(pipe: Any, prompts: list[str], repeats: int = 2, method: Any = "eagle") -> dict[str, Any]:
    """Per-call milliseconds (mean over the last of ``repeats`` passes; the first warms up) of target and head
    calls under ``method`` (``"eagle"``: the checkpoint's stored settings, or an ``EagleConfig``) and of target
    calls under ``method="none"``, plus call counts per image; the result's keys are ``"eagle"`` and ``"none"``."""
    from mmspec.models.eagle import EagleHead

    if repeats < 1 or not prompts:
        raise ValueError("need at least one prompt and one repeat")
    result: dict[str, Any] = {}
    for name, run_method in (("eagle", method), ("none", "none")):
        for _ in range(repeats):
            phases: dict[str, float] = defaultdict(float)
            with timing_model_calls(EagleHead) as times:
                start = time.perf_counter()
                for text in prompts:
                    out = pipe(text, method=run_method, do_sample=False, output_type="tokens",
                               generator=torch.Generator().manual_seed(0))
                    for phase, phase_seconds in out.stats.phase_seconds.items():
                        phases[phase] += phase_seconds
                seconds = time.perf_counter() - start
        calls = {key: {"calls_per_image": len(v) / len(prompts), "ms_per_call": 1e3 * sum(v) / len(v)}
                 for key, v in sorted(times.items())}
        per_image = {phase: 1e3 * value / len(prompts) for phase, value in phases.items()}
        result[name] = {"ms_per_image": 1e3 * seconds / len(prompts), "calls": calls, "phases": per_image,
                          "outside_phases": 1e3 * (seconds - sum(phases.values())) / len(prompts)}
    result["speedup"] = result["none"]["ms_per_image"] / result["eagle"]["ms_per_image"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="mmspec/shapes-t2i", help="zoo id or pipeline folder")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category (6 categories)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts; the last is reported")
    parser.add_argument("--threads", type=int, default=1)
    add_device_arguments(parser)
    add_cpu_gemm_argument(parser)
    parser.add_argument("--method-kwargs", default=None,
                        help="JSON of EagleConfig fields over the checkpoint's stored greedy settings, e.g. "
                             "'{\"num_draft_tokens\": 8}' (default: the stored settings as they are)")
    args = parser.parse_args(argv)
    if args.prompts <= 0:
        raise ValueError("--prompts must be positive")
    from mmspec.pipelines import ARImagePipeline
    from mmspec.world import make_prompt_set

    torch.set_num_threads(args.threads)
    pipe = load_quiet_pipeline(ARImagePipeline, args.pipeline, args.dtype, args.cpu_gemm, resolved_device(args))
    prompts = [p.text for p in make_prompt_set(n_per_category=args.prompts, seed=7)]
    method: Any = "eagle"
    if args.method_kwargs:
        method = pipe.method_config("eagle", do_sample=False).replace(**json.loads(args.method_kwargs))
    print(json.dumps(profile(pipe, prompts, args.repeats, method), indent=1))


if __name__ == "__main__":
    main()
