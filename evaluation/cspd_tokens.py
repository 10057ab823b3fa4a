"""Where CSpD's tokens land: the draft token, the target's own last step and the residual sample.

A diagnostic for docs/pipeline_continuous.md. It runs one CSpD call and records, for every verified token,
the draft's token (the draft chain's x_0), the mean of the target's last denoising step (the target's own
chain, driven by the same noise) and the committed token, and reports the 50th and 90th percentiles of
the distances between them (L2 over the token's channels) next to the target's last-step standard
deviation (per channel, times sqrt(C) to compare with the distances) and the tokens' norms. It answers
whether a rejected token's residual sample is the target's own token or stays near the draft's, and how
far apart the two chains' tokens are when the surrogate ratio rejects. It also splits the surrogate log
ratio into its two terms, the log-determinants of the earlier steps (``0.5 * sum(log S^q - log S^p)``,
a draft with wider Gaussians than the target's gains on every step) and the last step's densities at the
draft token, and gives the mean acceptance probability ``min(1, r)`` with and without the first term.

    python -m mmspec.evaluation.cspd_tokens [--pipeline mmspec/shapes-t2i-continuous] [--prompts 24] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .bench_cli import load_quiet_pipeline

PROMPTS = ["a red circle", "two blue squares", "a circle above a square", "a cyan triangle and a blue circle",
           "three diamonds", "a white diamond", "a triangle to the left of a square", "four circles"]


@contextmanager
def recording_verifications() -> Iterator[list[dict[str, torch.Tensor]]]:
    """Record the inputs and outcome of every ``cspd_verify`` call CSpD's loop makes inside the block."""
    from mmspec.methods import cspd as module

    original = module.cspd_verify
    records: list[dict[str, torch.Tensor]] = []

    def recorded(draft_x0, draft_means, draft_vars, target_means, target_vars, *args, **kwargs):
        result = original(draft_x0, draft_means, draft_vars, target_means, target_vars, *args, **kwargs)
        records.append({"draft": draft_x0, "target_mean": target_means[-1], "target_std": target_vars[-1].sqrt(),
                        "accepted": result.accepted, "committed": result.samples, "log_det": result.log_det,
                        "last_step": result.last_step})
        return result

    module.cspd_verify = recorded
    try:
        yield records
    finally:
        module.cspd_verify = original


def token_distances(pipe: Any, seed: int = 0, method: Any = "cspd", **call_kwargs: Any) -> dict[str, float]:
    """One ``pipe(method=method, **call_kwargs)`` call (``prompt=`` or ``class_labels=`` among them; ``method``:
    "cspd", the checkpoint's stored settings, or a ``CSpDConfig``): counts of its verified and rejected
    tokens and the 50th/90th percentiles of the distances over the rejected (and accepted) ones (``nan``
    where there are none)."""
    with recording_verifications() as records:
        pipe(method=method, generator=torch.Generator().manual_seed(seed), output_type="latent", **call_kwargs)
    if not records:
        raise RuntimeError("the call verified no token: is prefill_ratio leaving nothing to draft?")
    cat = {key: torch.cat([r[key] for r in records]) for key in records[0]}
    rejected = ~cat["accepted"]
    out: dict[str, float] = {"verified_tokens": int(rejected.numel()), "rejected_tokens": int(rejected.sum())}

    def quantiles(name: str, values: torch.Tensor) -> None:
        for q in (50, 90):  # shapes images are mostly background: the 90th percentile shows the objects
            out[f"{name}_p{q}"] = float(values.float().quantile(q / 100)) if values.numel() else float("nan")

    def distance(a: str, b: str, mask: torch.Tensor) -> torch.Tensor:
        return (cat[a][mask] - cat[b][mask]).norm(dim=-1)

    quantiles("rejected_draft_to_target_mean", distance("draft", "target_mean", rejected))
    quantiles("rejected_residual_to_target_mean", distance("committed", "target_mean", rejected))
    quantiles("rejected_residual_to_draft", distance("committed", "draft", rejected))
    quantiles("accepted_draft_to_target_mean", distance("draft", "target_mean", ~rejected))
    quantiles("target_last_step_std_x_sqrt_channels", cat["target_std"].mean(-1) * cat["draft"].shape[-1] ** 0.5)
    quantiles("token_norm", cat["committed"].norm(dim=-1))
    quantiles("ratio_log_det", cat["log_det"])
    quantiles("ratio_last_step", cat["last_step"])
    out["ratio_log_det_mean"] = float(cat["log_det"].mean())
    out["acceptance_probability"] = float((cat["log_det"] + cat["last_step"]).clamp(max=0).exp().mean())
    out["acceptance_probability_last_step_only"] = float(cat["last_step"].clamp(max=0).exp().mean())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="mmspec/shapes-t2i-continuous", help="zoo id or pipeline folder")
    parser.add_argument("--prompts", type=int, default=24, help="prompts (cycling through a fixed list)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.prompts <= 0:
        raise ValueError("--prompts must be positive")
    from mmspec.pipelines import ContinuousARImagePipeline

    torch.set_num_threads(args.threads)
    pipe = load_quiet_pipeline(ContinuousARImagePipeline, args.pipeline)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    print(json.dumps(token_distances(pipe, args.seed, prompt=prompts), indent=1))


if __name__ == "__main__":
    main()
