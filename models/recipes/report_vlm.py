"""Report on trained shapes VLMs: exact accuracy of greedy outputs on held-out scenes and clips.

For each model (the target, and the draft with ``--draft``) and each task, greedy ``model.generate``
outputs are compared with the world's exact reference text (string equality), on examples of the
``test`` split (never a training stream; ``--split train --seed S`` scores the first scenes and clips of a
training stage's stream instead, to tell a model that cannot fit its data from one that does not generalise):

* ``describe``: detailed descriptions of scenes drawn with the default clearance (the training
  distribution: every centre at least one pixel from a decision boundary, see
  :func:`mmspec.models.shapes_vlm.scene_clearance`), with a breakdown by object count and by sentence
  kind (:func:`sentence_errors`: which parts of a description are wrong) and of how the relations name
  the objects (:func:`name_errors`: qualifiers added where none is needed, or dropped where one is;
  :func:`name_errors_by_look_alikes`: the wrong names by what the named object shares with the others);
* ``describe_any``: detailed descriptions of unrestricted world scenes (``clearance=0``), where some
  centres lie a fraction of a pixel from a region edge, so that no model can be exact on all of them;
* ``caption``, ``qa``, ``narrate``, ``video_caption`` (clear scenes / clips); the video tasks also by
  object count and "exact up to object order" (:func:`object_parts`), which separates what a caption says
  about each object from the order it names them in.

It also gives the mean output length in tokens (generated tokens, ``</s>`` excluded), the mean
reference length, and the CPU generation time (shared machine: indicative only).

    python -m mmspec.models.recipes.report_vlm --model models/zoo/shapes-vlm/target \\
        --draft models/zoo/shapes-vlm/draft --out models/zoo/shapes-vlm/report.json
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from mmspec.files import write_json_atomic
from mmspec.models import shapes_vlm as sv
from mmspec.world import qa_kind
from mmspec.world.prompts import RELATION_PHRASES
from mmspec.world.scene import SIZES

MAX_NEW_TOKENS = 256


def held_out_examples(task: str, num: int, seed: int = 0, split: str = "test") -> list[dict]:
    """The first ``num`` examples of a report task (``test`` split: held out; ``describe_any`` uses seed
    ``seed + 1`` and no clearance, so its scenes are not those of ``describe``). With ``split="train"`` they
    are the first scenes / clips of the training stream ``seed`` (:func:`~mmspec.models.shapes_vlm.build_training_set`
    draws the same ones, except the share it replaces with ``duplicate_fraction``)."""
    if split not in ("test", "train"):
        raise ValueError(f"split must be 'test' or 'train', got {split!r}")
    if task == "describe_any":
        return [sv.image_example(split, seed + 1, i, "describe", clearance=0.0) for i in range(num)]
    if task in sv.VIDEO_TASKS:
        return [sv.video_example(split, seed, i, task) for i in range(num)]
    return [sv.image_example(split, seed, i, task) for i in range(num)]


@torch.no_grad()
def generate_answers(model, processor, examples: list[dict], batch: int = 25,
                     max_new_tokens: int = MAX_NEW_TOKENS) -> list[tuple[str, int]]:
    """Greedy answers of ``examples`` (dicts of :func:`held_out_examples`): ``(text, tokens)`` each, where
    ``tokens`` counts the generated tokens before ``</s>``."""
    eos = processor.tokenizer.eos_token_id
    out = []
    for lo in range(0, len(examples), batch):
        chunk = examples[lo: lo + batch]
        visuals = [e["frames"] if e["task"] in sv.VIDEO_TASKS else e["frames"][0] for e in chunk]
        inputs = sv.vlm_inputs(processor, visuals, [e["task"] for e in chunk], [e["question"] for e in chunk])
        sequences = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
        new = sequences[:, inputs["input_ids"].shape[1]:]
        texts = processor.tokenizer.batch_decode(new, skip_special_tokens=True)
        for row, text in zip(new.tolist(), texts):
            out.append((text, row.index(eos) if eos in row else len(row)))
    return out


#: the sentence kinds of :func:`mmspec.world.captions.describe_scene`, recognised by how they start
SENTENCE_KINDS = (("the image shows", "count"), ("there is", "object"), ("next, there is", "object"),
                  ("in total", "shape totals"), ("the ", "relation"))


def sentence_kind(sentence: str) -> str:
    """The kind of one description sentence (``describe_scene``'s order: count, objects, shape totals,
    shared colours, pairwise relations; a one-object scene ends with a summary instead of relations)."""
    if " of the shapes are " in sentence:
        return "shared colour"
    if sentence.endswith("nothing else is in the image"):
        return "single-object summary"
    for start, kind in SENTENCE_KINDS:
        if sentence.startswith(start):
            return kind
    return "other"


_RELATION_RE = re.compile(
    r"^the (.+) is (" + "|".join(map(re.escape, RELATION_PHRASES.values())) + r") the (.+)$")


def sentences_of(text: str) -> list[str]:
    """The sentences of a description, stripped, without their full stops."""
    return [s.strip() for s in text.split(".") if s.strip()]


def relation_parts(sentence: str) -> tuple[str, str, str] | None:
    """``(first name, relation phrase, second name)`` of a relation sentence ("the red circle is above the
    small blue square"), or None for any other sentence."""
    match = _RELATION_RE.match(sentence)
    return match.groups() if match else None


def sentence_errors(pairs: list[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """Per sentence kind, what the outputs miss and add: ``{kind: {"n", "missed", "extra"}}`` over
    ``(reference, output)`` pairs. A reference sentence counts as missed when the output does not contain
    it anywhere (order-free, so one omission does not mark every later sentence wrong); an output sentence
    the reference does not contain counts as extra (e.g. a shared-colour sentence for a colour seen once).

    A missed relation is further split by what went wrong: ``"relation"`` keeps every missed relation,
    ``"relation direction"`` counts those whose two names the output relates with another direction (a
    geometry error), ``"relation names"`` the rest, where the output names an object otherwise (e.g. "the
    small red circle" where no other red circle asks for the size) or leaves the pair out."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"n": 0, "missed": 0, "extra": 0})
    for reference, output in pairs:
        expected, said = sentences_of(reference), sentences_of(output)
        expected_set, said_set = set(expected), set(said)
        said_pairs = {(p[0], p[2]) for p in map(relation_parts, said) if p is not None}
        for sentence in expected:
            kind = sentence_kind(sentence)
            row = out[kind]
            row["n"] += 1
            if sentence in said_set:
                continue
            row["missed"] += 1
            parts = relation_parts(sentence) if kind == "relation" else None
            if parts is not None:
                split = "relation direction" if (parts[0], parts[2]) in said_pairs else "relation names"
                out[split]["missed"] += 1
        for sentence in said:
            if sentence not in expected_set:
                out[sentence_kind(sentence)]["extra"] += 1
    for split in ("relation direction", "relation names"):
        if split in out:
            out[split]["n"] = out["relation"]["n"]
    return dict(out)


def relation_names(text: str) -> set[str]:
    """The object names a description uses in its relation sentences ("small red circle on the left")."""
    return {name for parts in map(relation_parts, sentences_of(text)) if parts is not None
            for name in (parts[0], parts[2])}


def _qualifies(longer: str, shorter: str) -> bool:
    """Whether ``longer`` is ``shorter`` with qualifiers added: a size in front, a region behind, or both."""
    return longer != shorter and f" {shorter} " in f" {longer} "


def name_errors(pairs: list[tuple[str, str]]) -> dict[str, int]:
    """How the outputs name the objects of the references' relation sentences, over ``(reference,
    output)`` pairs: ``names`` (distinct names per reference, summed), and of those the ones the output's
    relations never use, split into ``over_qualified`` (the output uses the name with a size or region
    added, e.g. "small white circle" where no other white circle asks for it), ``under_qualified`` (the
    output drops a needed qualifier: "green diamond" for one of two green diamonds) and ``other``."""
    out = {"names": 0, "over_qualified": 0, "under_qualified": 0, "other": 0}
    for reference, output in pairs:
        said = relation_names(output)
        for name in relation_names(reference):
            out["names"] += 1
            if name in said:
                continue
            if any(_qualifies(other, name) for other in said):
                out["over_qualified"] += 1
            elif any(_qualifies(name, other) for other in said):
                out["under_qualified"] += 1
            else:
                out["other"] += 1
    return out


_CAPTION_PARTS_RE = re.compile(r", | and (?=an? )")  # between the objects of a video caption ("... and a blue ...")


#: :func:`name_errors_by_look_alikes`' groups: what the named object shares with the scene's other objects
LOOK_ALIKE_GROUPS = ("nothing shared", "shape shared", "colour shared", "colour and shape, by different objects",
                     "look-alike (same colour and shape)")


def look_alike_group(scene, colour: str, shape: str) -> str:
    """Which of :data:`LOOK_ALIKE_GROUPS` an object of ``colour`` and ``shape`` in ``scene`` falls in: whether
    another object has its colour, its shape, or both (a look-alike, whose presence asks for a size)."""
    same_colour = sum(o.color == colour for o in scene.objects) > 1
    same_shape = sum(o.shape == shape for o in scene.objects) > 1
    if sum(o.color == colour and o.shape == shape for o in scene.objects) > 1:
        return LOOK_ALIKE_GROUPS[4]
    return LOOK_ALIKE_GROUPS[2 * same_colour + same_shape]


def name_errors_by_look_alikes(items) -> dict[str, dict[str, int]]:
    """Relation names of the references over ``(scene, reference, output)`` triples, grouped by what the
    named object shares with the others (:func:`look_alike_group`): ``{group: {"names", "wrong"}}``, a name
    wrong when the output's relations never use it. A name needs its size exactly when a look-alike exists,
    so a captioner that only knew whether the colour is shared and whether the shape is would err in the
    groups "colour and shape, by different objects" (adding a size) and "look-alike" (leaving it out)."""
    out = {group: {"names": 0, "wrong": 0} for group in LOOK_ALIKE_GROUPS}
    sizes = set(SIZES)
    for scene, reference, output in items:
        said = relation_names(output)
        for name in relation_names(reference):
            colour, shape = [word for word in name.split() if word not in sizes][:2]
            row = out[look_alike_group(scene, colour, shape)]
            row["names"] += 1
            row["wrong"] += name not in said
    return out


def object_parts(task: str, text: str) -> list[str]:
    """The parts of a video text that name one object each, sorted: the sentences of a narration (per
    object, plus the layout sentences), the ``a COLOUR SHAPE moving DIRECTION`` phrases of a video caption.
    Two texts with equal parts say the same things about the same objects, possibly in another order."""
    if task == "narrate":
        return sorted(sentences_of(text))
    if task == "video_caption":
        return sorted(_CAPTION_PARTS_RE.split(text))
    raise ValueError(f"object_parts reads video tasks {list(sv.VIDEO_TASKS)}, got {task!r}")


def _exact_by_objects(correct: list[bool], counts: list[int]) -> dict[str, dict[str, float]]:
    by_count = defaultdict(list)
    for ok, k in zip(correct, counts):
        by_count[k].append(ok)
    return {"exact_by_objects": {str(k): round(sum(v) / len(v), 4) for k, v in sorted(by_count.items())},
            "n_by_objects": {str(k): len(v) for k, v in sorted(by_count.items())}}


def exact_by_question_kind(correct: list[bool], questions: list[str]) -> dict[str, dict]:
    """Exact accuracy and count per question template (:func:`mmspec.world.qa_kind`), most frequent first."""
    kinds = [qa_kind(q) for q in questions]
    counts = Counter(kinds)
    return {"exact_by_kind": {k: round(sum(c for c, kk in zip(correct, kinds) if kk == k) / n, 4)
                              for k, n in counts.most_common()},
            "n_by_kind": dict(counts.most_common())}


def wrong_color_answers(examples: list[dict], answers: list[str]) -> dict[str, int]:
    """How the wrong answers to colour questions ("what color is the circle?") are wrong: ``n`` wrong
    answers, of which ``another_objects_color`` name the colour of another object of the scene. A model
    that perceives colours but binds the question to the wrong object gives the latter; one that misreads
    colours gives colours that are not in the scene."""
    wrong = other = 0
    for example, answer in zip(examples, answers):
        if example["question"] is None or qa_kind(example["question"]) != "color" or answer == example["answer"]:
            continue
        wrong += 1
        other += answer in {o.color for o in example["scene"].objects if o.color != example["answer"]}
    return {"n": wrong, "another_objects_color": other}


def score_task(model, processor, task: str, num: int, seed: int, batch: int, split: str = "test") -> dict:
    """Exact accuracy, lengths and time of one report task, plus up to three mismatches."""
    examples = held_out_examples(task, num, seed, split)
    start = time.time()
    answers = generate_answers(model, processor, examples, batch)
    seconds = time.time() - start
    correct = [text == e["answer"] for (text, _), e in zip(answers, examples)]
    ref_tokens = [len(processor.tokenizer(e["answer"], add_special_tokens=False)["input_ids"]) for e in examples]
    result = {"n": len(examples), "exact": sum(correct) / len(examples),
              "mean_output_tokens": sum(n for _, n in answers) / len(answers),
              "mean_reference_tokens": sum(ref_tokens) / len(ref_tokens),
              "generate_seconds": round(seconds, 1)}
    if task.startswith("describe"):
        result.update(_exact_by_objects(correct, [len(e["scene"].objects) for e in examples]))
        pairs = [(e["answer"], text) for (text, _), e in zip(answers, examples)]
        result["sentence_errors"] = sentence_errors(pairs)
        result["name_errors"] = name_errors(pairs)
        result["name_errors_by_look_alikes"] = name_errors_by_look_alikes(
            (e["scene"], reference, output) for e, (reference, output) in zip(examples, pairs))
    if task == "qa":
        result.update(exact_by_question_kind(correct, [e["question"] for e in examples]))
        result["wrong_color_answers"] = wrong_color_answers(examples, [text for text, _ in answers])
    if task in sv.VIDEO_TASKS:
        result.update(_exact_by_objects(correct, [len(e["clip"].objects) for e in examples]))
        result["exact_up_to_object_order"] = sum(
            object_parts(task, text) == object_parts(task, e["answer"]) for (text, _), e in zip(answers, examples)
        ) / len(examples)
    result["mismatches"] = [{"prompt": e["prompt"].replace(sv.IMAGE, ""), "reference": e["answer"], "output": text}
                            for (text, _), e, ok in zip(answers, examples, correct) if not ok][:3]
    return result


def report_model(folder: Path, counts: dict[str, int], seed: int, batch: int, split: str = "test") -> dict:
    model = sv.load_model(folder)
    processor = sv.load_processor(folder)
    text = model.config.text_config
    vision = model.config.vision_config
    out = {"model": str(folder), "parameters": sum(p.numel() for p in model.parameters()),
           "text_layers": text.num_hidden_layers, "text_dim": text.hidden_size,
           "vision_layers": vision.num_hidden_layers, "vision_dim": vision.hidden_size, "tasks": {}}
    for task, num in counts.items():
        if num > 0:
            out["tasks"][task] = score_task(model, processor, task, num, seed, batch, split)
            r = out["tasks"][task]
            print(f"{folder} {task}: exact {r['exact']:.3f} ({r['n']}), {r['mean_output_tokens']:.1f} tokens, "
                  f"{r['generate_seconds']} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--draft", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--describe", type=int, default=400, help="held-out scenes per description task")
    parser.add_argument("--caption", type=int, default=200)
    parser.add_argument("--qa", type=int, default=400)
    parser.add_argument("--videos", type=int, default=200, help="held-out clips per video task")
    parser.add_argument("--batch", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=("test", "train"), default="test",
                        help="test: held-out scenes (the report); train: the training stream --seed")
    parser.add_argument("--threads", type=int, default=2)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = {"describe": args.describe, "describe_any": args.describe, "caption": args.caption, "qa": args.qa,
              "narrate": args.videos, "video_caption": args.videos}
    report = {"command": "python -m mmspec.models.recipes.report_vlm " + " ".join(argv),
              "split": args.split, "seed": args.seed, "greedy": True, "clearance": sv.CLEARANCE,
              "target": report_model(args.model, counts, args.seed, args.batch, args.split)}
    if args.draft is not None:
        report["draft"] = report_model(args.draft, counts, args.seed, args.batch, args.split)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.out, report, indent=1)


if __name__ == "__main__":
    main()
