"""Report on a trained shapes t2i target: what it draws and how ambiguous its token choices are.

Samples one image per evaluation prompt with target-only decoding (classifier-free guidance as a
doubled batch, the core's baseline loop), scores the images with the exact evaluator (GenEval-shapes),
and measures the token-selection ambiguity that relaxed acceptance (LANTERN, GSD) exploits: the mean
top-1 probability of the sampled image tokens' distributions and the mean size of their top-p=0.9 set.

    python -m mmspec.models.recipes.report_t2i --model models/zoo/shapes-t2i/transformer --out report.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mmspec import CausalLMRunner, SamplingConfig, speculative_generate
from mmspec.files import write_json_atomic
from mmspec.models.llamagen import LlamaGenTransformer
from mmspec.models.recipes.common import DEFAULT_VQ
from mmspec.models.text import WordTokenizer
from mmspec.models.tokenizers import VQTokenizer
from mmspec.runner import GuidedRunner
from mmspec.sampling import apply_guidance, logits_to_probs
from mmspec.world import evaluate, make_prompt_set


@torch.no_grad()
def generate_tokens(model: LlamaGenTransformer, words: torch.Tensor, guidance_scale: float,
                    sampling: SamplingConfig, generator: torch.Generator) -> torch.Tensor:
    """Target-only image tokens ``[B, N]`` for word-id conditions ``[B, C]`` (left-padded with -1)."""
    batch = words.shape[0]
    condition = torch.cat([words, words])
    drop = GuidedRunner.condition_drop(batch, words.device)
    target = GuidedRunner(CausalLMRunner(model), guidance_scale)
    out = speculative_generate(target, None, None, (condition >= 0).long(), max_new_tokens=model.config.block_size,
                               sampling=sampling, generator=generator, condition_ids=condition, condition_drop=drop)
    return out.sequences


@torch.no_grad()
def ambiguity(model: LlamaGenTransformer, words: torch.Tensor, tokens: torch.Tensor, guidance_scale: float,
              top_p: float = 0.9) -> tuple[float, float]:
    """Mean top-1 probability and mean top-p set size of the guided T=1 distributions along ``tokens``."""
    mask = (words >= 0).long()
    batch = words.shape[0]
    cond = model.forward_train(words, tokens, torch.zeros(batch, dtype=torch.bool), condition_mask=mask)
    uncond = model.forward_train(words, tokens, torch.ones(batch, dtype=torch.bool), condition_mask=mask)
    probs = logits_to_probs(apply_guidance(torch.cat([cond, uncond]).float(), guidance_scale))
    top1 = probs.max(-1).values.mean().item()
    sorted_probs = probs.sort(-1, descending=True).values
    set_size = ((sorted_probs.cumsum(-1) - sorted_probs) < top_p).sum(-1).float().mean().item()
    return top1, set_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--vq", type=Path, default=DEFAULT_VQ)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=600, help="first N prompts of the evaluation set")
    parser.add_argument("--guidance-scale", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = LlamaGenTransformer.from_pretrained(args.model).float().eval()
    vq = VQTokenizer.from_pretrained(args.vq)
    words = WordTokenizer.load(args.model / "text_vocab.json")
    prompts = make_prompt_set()[: args.prompts]
    grid = int(model.config.block_size ** 0.5)
    report: dict = {"command": "python -m mmspec.models.recipes.report_t2i " + " ".join(sys.argv[1:] if argv is None else argv),
                    "model": str(args.model), "guidance_scale": args.guidance_scale, "prompts": len(prompts)}
    for name, sampling in (("greedy", SamplingConfig(do_sample=False)), ("temperature_1", SamplingConfig())):
        generator = torch.Generator().manual_seed(args.seed)
        images, top1s, sizes, start = [], [], [], time.time()
        for lo in range(0, len(prompts), args.batch):
            chunk = prompts[lo:lo + args.batch]
            ids = words.batch([p.text for p in chunk], model.config.cls_token_num)
            tokens = generate_tokens(model, ids, args.guidance_scale, sampling, generator)
            images += list(vq.decode(tokens.view(-1, grid, grid)))
            if name == "temperature_1":
                top1, size = ambiguity(model, ids, tokens, args.guidance_scale)
                top1s.append(top1)
                sizes.append(size)
        result = evaluate([img.permute(1, 2, 0).numpy() for img in images], prompts)
        report[name] = {"geneval_overall": result.overall, "per_category": result.per_category,
                        "seconds": round(time.time() - start, 1)}
        if top1s:
            report[name]["mean_top1_prob"] = sum(top1s) / len(top1s)
            report[name]["mean_top_p90_set_size"] = sum(sizes) / len(sizes)
        print(name, json.dumps(report[name]), flush=True)
    if args.out is not None:
        write_json_atomic(args.out, report, indent=2)


if __name__ == "__main__":
    main()
