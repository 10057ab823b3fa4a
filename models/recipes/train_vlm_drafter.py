"""Recipe: a VLM draft head (EagleVLM, FLASH, ViSpec or SpecVLM) by online-logit distillation.

Every step runs the frozen target over a batch of prompt + answer sequences with their images
(:func:`~mmspec.models.recipes.vlm_drafter_loss.teacher_forward`) and trains the head on the teacher's
logits and features there (:func:`~mmspec.models.recipes.vlm_drafter_loss.training_loss`: 0.1 soft
cross-entropy on the teacher logits + 1.0 SmoothL1 on the teacher features, plus the method's own terms: FLASH's K future features,
ViSpec's self-rollout pass, SpecVLM's Gumbel-softmax gate). No teacher output is ever stored. The log
(``--work/log.jsonl``) holds the loss every 20 steps and, every ``--eval-every`` steps, the held-out
top-1 agreement and the *real* acceptance: greedy speculative decoding of held-out prompts with the head,
mean accepted length (bonus token included) and target calls per token. Deterministic; resumable (rerun
the same command).

The shapes zoo (the default data: the captioner's own tasks rendered from the world, a held-out split
from another seed stream)::

    python -m mmspec.models.recipes.train_vlm_drafter --method eagle \\
        --target models/zoo/shapes-vlm/target --out models/zoo/shapes-vlm/eagle_head

``--init`` starts from trained heads instead (their own architecture; a fresh optimiser and schedule):
a later stage on new data, or the previous target's heads when the target is retrained, which keeps what
they learnt about the shared vocabulary and images instead of relearning it from scratch.

Several methods in one run share each step's teacher forward (the frozen target is most of a step's
cost); every head still trains on its own loss with its own gradient clipping, so each is what its own
run would give up to the random streams. ``--out`` is then the pipeline folder and head ``m`` goes to its
component folder (``eagle_head``, ``flash_head``, ...)::

    python -m mmspec.models.recipes.train_vlm_drafter --method eagle flash vispec specvlm \\
        --target models/zoo/shapes-vlm/target --out models/zoo/shapes-vlm --work runs/train_vlm_heads

A real checkpoint (local path or hub id) with image-text pairs in a JSON-lines file, one object per line
``{"images": ["a.jpg", ...], "prompt": "Describe the image.", "answer": "..."}`` (image paths relative to
the file; an answer, ideally the target's own, is required), on a GPU::

    python -m mmspec.models.recipes.train_vlm_drafter --method vispec --target llava-hf/llava-1.5-7b-hf \\
        --data pairs.jsonl --out heads/vispec --device cuda --dtype bfloat16 --batch 8
"""

from __future__ import annotations

import argparse
import copy
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from mmspec.models.recipes.common import cached_data, step_generator, train_loop
from mmspec.models.recipes.vlm_drafter_loss import teacher_forward, training_loss
from mmspec.models.vlm_drafters import (
    EagleVLMHead,
    FlashHead,
    SpecVLMHead,
    ViSpecHead,
    VLMDraftHead,
    drafter_for,
)
from mmspec.models.vlm_prompts import format_vlm_prompt
from mmspec.models.vlm_targets import VLMRunner
from mmspec.sampling import SamplingConfig
from mmspec.speculate import speculative_generate
from mmspec.stats import SpecStats

HEADS: dict[str, type[VLMDraftHead]] = {"eagle": EagleVLMHead, "flash": FlashHead, "vispec": ViSpecHead,
                                        "specvlm": SpecVLMHead}
#: each method's component name in a VLMPipeline folder
COMPONENTS = {"eagle": "eagle_head", "flash": "flash_head", "vispec": "vispec_head", "specvlm": "specvlm_head"}
Batch = dict[str, torch.Tensor]


def build_head(method: str, target: Any, args: argparse.Namespace) -> VLMDraftHead:
    """An untrained head of ``method`` at the target's width and vocabulary, bound to the target."""
    text = target.config.get_text_config()
    common = dict(hidden_size=text.hidden_size, vocab_size=target.get_output_embeddings().weight.shape[0],
                  num_attention_heads=args.heads, max_position_embeddings=text.max_position_embeddings)
    extra: dict[str, Any] = {"flash": {"num_latents": args.num_latents, "num_future": args.num_future},
                             "vispec": {"num_queries": args.num_queries},
                             "specvlm": {"stride": args.stride}}.get(method, {})
    torch.manual_seed(args.seed)
    return HEADS[method](**common, **extra).bind_target(target)


def load_head(method: str, folder: Path, target: Any) -> VLMDraftHead:
    """A trained head of ``method`` from ``folder`` (its own config: the architecture options are ignored),
    in float32 and bound to ``target``: the start of a later stage (``--init``), e.g. the heads of the
    previous target when the target is retrained. Raises ``FileNotFoundError`` without a saved head there
    and ``ValueError`` for a head of another class or of another target's width or vocabulary."""
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--init: no trained {method} head at {folder} (no config.json)")
    saved_class = json.loads((folder / "config.json").read_text()).get("_class_name")
    if saved_class != HEADS[method].__name__:
        raise ValueError(f"--init: {folder} holds a head of class {saved_class}, not {HEADS[method].__name__} ({method})")
    return HEADS[method].from_pretrained(folder).to(torch.float32).bind_target(target)


class HeadSet(nn.Module):
    """Several draft heads trained side by side on one teacher forward per step (``--method`` with more
    than one name). The heads share no parameters; :meth:`clip_gradients` clips each head's gradient
    norm on its own, so one head's large gradient never shrinks another's step."""

    def __init__(self, heads: dict[str, VLMDraftHead]) -> None:
        super().__init__()
        self.heads = nn.ModuleDict(heads)

    def clip_gradients(self, max_norm: float) -> None:
        for head in self.heads.values():
            torch.nn.utils.clip_grad_norm_(head.parameters(), max_norm)


# -- data -------------------------------------------------------------------------------------------------
class ShapesData:
    """The shapes captioner's tasks (``mmspec.models.shapes_vlm``): training rows from the train split,
    held-out prompts (image descriptions and video narrations) from the test split."""

    def __init__(self, work: Path, num_images: int, num_videos: int, seed: int) -> None:
        from mmspec.models import shapes_vlm as sv
        from mmspec.models.recipes.vlm_answer_loss import training_batch

        self.sv, self.training_batch = sv, training_batch
        self.data = cached_data(work, lambda: sv.build_training_set(num_images, num_videos, seed, "train"),
                                key={"train_images": num_images, "train_videos": num_videos, "seed": seed})
        self.seed = seed

    def __len__(self) -> int:
        return len(self.data["examples"])

    def batch(self, rows: list[int]) -> Batch:
        batch = self.training_batch(self.data, rows)
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                "answer_mask": batch["loss_mask"], "pixel_values": batch["pixel_values"]}

    def held_out(self, processor: Any, count: int) -> tuple[Batch, list[Batch]]:
        """A held-out teacher-forcing batch (top-1) and generation batches (acceptance): ``count`` image
        descriptions and ``count // 2`` video narrations."""
        sv = self.sv
        images = [sv.image_example("test", self.seed, i, "describe") for i in range(count)]
        videos = [sv.video_example("test", self.seed, i, "narrate") for i in range(max(1, count // 2))]
        held = sv.build_training_set(count, 0, self.seed, "test", tokenizer=processor.tokenizer)
        describe_rows = [i for i, e in enumerate(held["examples"]) if e["task"] == "describe"]
        teacher = {k: v for k, v in self.training_batch(held, describe_rows).items()}
        teacher["answer_mask"] = teacher.pop("loss_mask")
        generate = [sv.vlm_inputs(processor, [e["frames"][0] for e in images], ["describe"] * len(images)),
                    sv.vlm_inputs(processor, [e["frames"] for e in videos], ["narrate"] * len(videos))]
        return teacher, generate


class JsonlData:
    """Image-text pairs from a JSON-lines file (real checkpoints): ``{"images": [...], "prompt": ...,
    "answer": ...}`` per line; the last ``held_out`` lines are the held-out split."""

    def __init__(self, path: Path, processor: Any, held_out: int) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"--data {path} does not exist")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for i, row in enumerate(rows):
            missing = {"images", "prompt", "answer"} - set(row)
            if missing:
                raise ValueError(f"{path} line {i + 1} lacks {sorted(missing)}")
        if len(rows) <= held_out:
            raise ValueError(f"{path} has {len(rows)} pairs; need more than the {held_out} held-out ones")
        self.root, self.processor = path.parent, processor
        self.train, self.test = rows[:-held_out], rows[-held_out:]

    def __len__(self) -> int:
        return len(self.train)

    def _images(self, row: dict) -> list[Image.Image]:
        paths = row["images"] if isinstance(row["images"], list) else [row["images"]]
        return [Image.open(self.root / p).convert("RGB") for p in paths]

    def _encode(self, rows: list[dict], with_answer: bool) -> Batch:
        tokenizer = self.processor.tokenizer
        prompts, images = [], []
        for row in rows:
            frames = self._images(row)
            prompts.append(format_vlm_prompt(self.processor, row["prompt"], len(frames)))
            images += frames
        if not with_answer:
            tokenizer.padding_side = "left"
            return dict(self.processor(text=prompts, images=images, padding=True, return_tensors="pt"))
        tokenizer.padding_side = "right"
        eos = tokenizer.eos_token or ""
        full = dict(self.processor(text=[p + " " + r["answer"] + eos for p, r in zip(prompts, rows)],
                                   images=images, padding=True, return_tensors="pt"))
        prompt_only = self.processor(text=prompts, images=images, padding=True, return_tensors="pt")
        starts = prompt_only["attention_mask"].sum(1)  # right padding: the answer starts here
        steps = torch.arange(full["input_ids"].shape[1])
        full["answer_mask"] = (steps >= starts.unsqueeze(1)) & full["attention_mask"].bool()
        return full

    def batch(self, rows: list[int]) -> Batch:
        return self._encode([self.train[r] for r in rows], with_answer=True)

    def held_out(self, processor: Any, count: int) -> tuple[Batch, list[Batch]]:
        rows = self.test[:count]
        return self._encode(rows, with_answer=True), [self._encode(rows, with_answer=False)]


# -- evaluation -------------------------------------------------------------------------------------------
def make_evaluator(target: Any, teacher_batch: Batch, generate_batches: list[Batch], max_new_tokens: int,
                   num_draft_tokens: int, eos_token_id: int | None, device: torch.device
                   ) -> Callable[[VLMDraftHead, int], dict]:
    """``evaluate(model, step)``: held-out top-1 agreement (teacher forcing) and greedy acceptance."""
    teacher_inputs = _to(teacher_batch, device)
    answer_mask = teacher_inputs.pop("answer_mask")
    teacher = teacher_forward(target, answer_mask=answer_mask, **teacher_inputs)

    def evaluate(model: VLMDraftHead, step: int) -> dict:
        top1 = float(training_loss(model, teacher)["top1"])
        stats = SpecStats()
        for batch in generate_batches:
            inputs = _to(batch, device)
            drafter = drafter_for(model, sampling=SamplingConfig(do_sample=False), num_draft_tokens=num_draft_tokens)
            runner = VLMRunner(target, return_hidden=True, return_penultimate=isinstance(model, SpecVLMHead))
            speculative_generate(runner, drafter, inputs.pop("input_ids"), inputs.pop("attention_mask"),
                                 max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, stats=stats, **inputs)
        return {"top1": round(top1, 4), "mean_accepted_length": round(stats.mean_accepted_length, 3),
                "target_calls_per_token": round(stats.target_calls / max(1, stats.tokens), 4)}

    return evaluate


def _to(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# -- main -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=tuple(HEADS), nargs="+", required=True,
                        help="one method, or several trained together on shared teacher forwards")
    parser.add_argument("--target", required=True, help="the target VLM: a local folder or a hub id")
    parser.add_argument("--out", type=Path, required=True,
                        help="where the trained head is saved (several methods: the pipeline folder; head m "
                             "goes to its component folder, e.g. eagle_head)")
    parser.add_argument("--init", type=Path, default=None,
                        help="start from trained heads (a later stage): the head's folder, or with several "
                             "methods a pipeline folder with one component folder per head")
    parser.add_argument("--data", default="shapes", help="'shapes' (the zoo's world) or a JSON-lines file")
    parser.add_argument("--work", type=Path, default=None, help="checkpoints and logs (default runs/train_vlm_<method>[_<method>...])")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--heads", type=int, default=4, help="attention heads of the draft decoder layer")
    parser.add_argument("--feature-noise", type=float, default=0.1)
    parser.add_argument("--num-latents", type=int, default=16, help="FLASH: compressed image tokens C")
    parser.add_argument("--num-future", type=int, default=5, help="FLASH: tokens per draft forward K")
    parser.add_argument("--num-queries", type=int, default=2, help="ViSpec: adaptor queries")
    parser.add_argument("--stride", type=int, default=4, help="SpecVLM: pooling / convolution stride")
    parser.add_argument("--train-images", type=int, default=6000, help="shapes data: scenes")
    parser.add_argument("--train-videos", type=int, default=1500, help="shapes data: clips")
    parser.add_argument("--held-out", type=int, default=8, help="held-out prompts for the acceptance log")
    parser.add_argument("--eval-every", type=int, default=300)
    parser.add_argument("--eval-tokens", type=int, default=96, help="max new tokens per held-out generation")
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the frozen target's dtype (the head trains in float32)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from transformers import AutoModelForImageTextToText, AutoProcessor

    methods = list(dict.fromkeys(args.method))  # unique, in the order given
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    work = args.work or Path("runs/train_vlm_" + "_".join(methods))
    work.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)

    target = AutoModelForImageTextToText.from_pretrained(args.target, dtype=getattr(torch, args.dtype))
    target = target.to(device).eval().requires_grad_(False)
    processor = AutoProcessor.from_pretrained(args.target)
    data: ShapesData | JsonlData = ShapesData(work, args.train_images, args.train_videos, args.seed) \
        if args.data == "shapes" else JsonlData(Path(args.data), processor, args.held_out)
    def initial_head(method: str) -> VLMDraftHead:
        if args.init is None:
            return build_head(method, target, args)
        return load_head(method, args.init if len(methods) == 1 else args.init / COMPONENTS[method], target)

    heads = {method: initial_head(method).to(device) for method in methods}
    trainee: nn.Module = heads[methods[0]] if len(methods) == 1 else HeadSet(heads)

    def loss_fn(index: torch.Tensor) -> torch.Tensor:
        inputs = _to(data.batch(index.tolist()), device)
        answer_mask = inputs.pop("answer_mask")
        teacher = teacher_forward(target, answer_mask=answer_mask, **inputs)
        generator = step_generator()
        return sum(training_loss(head, teacher, feature_noise=args.feature_noise, generator=generator)["loss"]
                   for head in heads.values())

    def save(_: nn.Module) -> None:
        for method, head in heads.items():
            folder = args.out if len(methods) == 1 else args.out / COMPONENTS[method]
            copy.deepcopy(head).eval().to(torch.float16).save_pretrained(folder)  # fp16 keeps the zoo small

    teacher_batch, generate_batches = data.held_out(processor, args.held_out)
    eos = processor.tokenizer.eos_token_id
    evaluate_head = make_evaluator(target, teacher_batch, generate_batches, args.eval_tokens, args.num_future, eos,
                                   device)

    def evaluate(_: nn.Module, step: int) -> dict:
        if len(methods) == 1:
            return evaluate_head(heads[methods[0]], step)
        return {method: evaluate_head(head, step) for method, head in heads.items()}

    train_loop(trainee, loss_fn, len(data), steps=args.steps, batch=args.batch, lr=args.lr, work=work, save=save,
               save_every=args.save_every, weight_decay=0.0, evaluate=evaluate, eval_every=args.eval_every)


if __name__ == "__main__":
    main()
