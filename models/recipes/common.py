"""What every training recipe shares: the data/run arguments, the cached training set, the optimisation
loop with warm-up + cosine decay, JSON-lines logs, and resumable checkpoints (rerunning the same
command continues where it stopped)."""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmspec.files import atomic_path
from mmspec.validation import positive_int_argument
from mmspec.world import ShapesImageDataset
from mmspec.world.parallel import build_in_parts, concat_parts

DEFAULT_VQ = Path(__file__).resolve().parents[1] / "zoo" / "tokenizers" / "vq"


def add_run_arguments(parser: argparse.ArgumentParser, work: str) -> None:
    """``--work`` (checkpoints, logs, cached data), ``--vq``, the training-set knobs shared by the shapes
    t2i recipes (same defaults, so every part of a zoo entry sees the same images), ``--threads``, ``--seed``,
    ``--data-workers``."""
    parser.add_argument("--work", type=Path, default=Path(work))
    parser.add_argument("--vq", type=Path, default=DEFAULT_VQ)
    parser.add_argument("--train-images", type=int, default=50000)
    parser.add_argument("--difficulty", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    add_data_workers_argument(parser)


def add_data_workers_argument(parser: argparse.ArgumentParser) -> None:
    """``--data-workers``: processes that build the training set (:mod:`mmspec.world.parallel`; the same set
    for any number)."""
    parser.add_argument("--data-workers", type=positive_int_argument, default=1, metavar="N",
                        help="build the training set in N processes (the same set for any N; default 1)")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device`` (cpu, cuda, cuda:1, ...) that :func:`train_loop` trains on, for the recipes whose loss
    moves its batch there (train_t2i, train_eagle, train_vlm, train_mar, train_video; the others train on
    the CPU). Batches are drawn on the CPU (indices and noise from torch's CPU generator) and moved there,
    so a run's random stream is the same on every device (the numbers differ only by the device's
    floating-point arithmetic). ``--time-limit`` counts from :func:`start_run`; what is left of it when
    training starts (:func:`time_left`) is :func:`train_loop`'s ``time_limit``; ``--stop-at`` is its
    ``stop_at`` (a long run in pieces, or the step where a time-limited run stopped early, repeated)."""
    parser.add_argument("--device", default="cpu", help="train on this torch device (e.g. cuda on a GPU machine)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="end the command within about this many seconds, data building included (a GPU "
                             "lease): the schedule is shortened after timing steps 10-60 and logged, so "
                             "--steps N repeats it")
    parser.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                        help="end this run after this step (saved), keeping the --steps schedule: a long run in "
                             "pieces, or a time-limited run that logged stopped_at STEP, repeated")


def start_run(args: argparse.Namespace) -> None:
    """Thread count, seed, device check and the work folder of a recipe run."""
    device = torch.device(getattr(args, "device", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}: torch sees no CUDA GPU on this machine (use --device cpu)")
    time_limit = getattr(args, "time_limit", None)
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"--time-limit must be a positive number of seconds, got {time_limit}")
    args.started = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)


def time_left(args: argparse.Namespace) -> float | None:
    """Seconds left of ``--time-limit`` since :func:`start_run` (``None`` without a limit)."""
    if getattr(args, "time_limit", None) is None:
        return None
    return args.time_limit - (time.time() - args.started)


def save_zoo_folder(pipe: Any, folder: Path) -> None:
    """``pipe.save_pretrained(folder)`` without the ``_name_or_path`` that diffusers records in a component's
    config.json when it was loaded from a folder: in a built zoo entry the build's local training paths,
    which mean nothing in a clone."""
    pipe.save_pretrained(folder)
    for config in Path(folder).glob("*/config.json"):
        data = json.loads(config.read_text())
        if data.pop("_name_or_path", None) is not None:
            config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


ENCODE_BATCH = 500  # images per tokenizer call while building an image training set


def encode_image_set(num: int, seed: int, encode: Callable[[torch.Tensor], torch.Tensor], difficulty: float,
                     split: str = "train", categories: Mapping[str, float] | None = None,
                     workers: int = 1) -> tuple[torch.Tensor, list[str]]:
    """Images ``0 .. num - 1`` of ``ShapesImageDataset(num, seed, split, difficulty=..., categories=...)``
    rendered, passed through ``encode`` (``[B, 3, H, W]`` in [0, 1] -> codes, in batches of
    ``ENCODE_BATCH``) and captioned: ``(codes [num, ...], captions)``. ``workers`` > 1 builds slices in that
    many processes, cut at multiples of the batch so every batch is the one a single process encodes;
    ``encode`` must then pickle (a ``functools.partial`` of a module-level function)."""
    parts = build_in_parts(partial(_encoded_images, num=num, seed=seed, encode=encode, difficulty=difficulty,
                                   split=split, categories=categories), num, workers, align=ENCODE_BATCH)
    merged = concat_parts(parts)
    return merged["codes"], merged["captions"]


def _encoded_images(first: int, count: int, *, num: int, seed: int, encode: Callable[[torch.Tensor], torch.Tensor],
                    difficulty: float, split: str, categories: Mapping[str, float] | None) -> dict[str, Any]:
    """Images ``first .. first + count - 1`` of :func:`encode_image_set`: ``codes`` and ``captions``."""
    data = ShapesImageDataset(num, seed=seed, split=split, difficulty=difficulty, categories=categories, texts=False)
    codes, captions = [], []
    for start in range(first, first + count, ENCODE_BATCH):
        items = [data[i] for i in range(start, min(first + count, start + ENCODE_BATCH))]
        with torch.no_grad():
            codes.append(encode(torch.stack([item["image"] for item in items])))
        captions += [item["caption"] for item in items]
    return {"codes": torch.cat(codes), "captions": captions}


def cached_data(work: Path, build: Callable[[], dict], name: str = "data.pt", key: Mapping[str, Any] | None = None
                ) -> dict:
    """The run's training set: ``work/<name>`` when a previous run saved it, else ``build()`` saved there.

    ``key``: the arguments that determine the data (sizes, seed, tokenizer path, ...), kept beside it in
    ``<name>.key.json``. A cache whose saved key differs is refused with a clear error instead of being
    trained on silently (a rerun in the same ``--work`` with, e.g., another ``--train-images``); a cache
    without a key file (made before keys, or copied without it) is used as it is."""
    path = work / name
    key_path = path.with_name(path.name + ".key.json")
    wanted = None if key is None else json.loads(json.dumps(dict(key), default=str))  # as it reads back
    if path.is_file():
        if wanted is not None and key_path.is_file():
            saved = json.loads(key_path.read_text())
            if saved != wanted:
                differ = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
                changes = ", ".join(f"{k}: {saved.get(k)!r} there, {wanted.get(k)!r} now" for k in differ)
                raise SystemExit(f"{path} was built for other arguments ({changes}); use another --work or delete it")
        return torch.load(path)
    data = build()
    save_atomically(data, path)
    if wanted is not None:
        key_path.write_text(json.dumps(wanted, indent=1, sort_keys=True))
    return data


def args_key(args: argparse.Namespace, *names: str, **extra: Any) -> dict[str, Any]:
    """The run arguments ``names`` (and ``extra`` entries) that determine a data cache: a :func:`cached_data`
    key."""
    return {**{name: getattr(args, name) for name in names}, **extra}


def save_atomically(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` atomically (:func:`mmspec.files.atomic_path`). A run stopped while
    writing (a lease's end, a killed session) leaves the previous file or none, never a truncated one that
    the next run's resume or data cache would fail to load."""
    with atomic_path(path) as temporary:
        torch.save(obj, temporary)


def save_fp16_copy(model: nn.Module, folder: Path) -> None:
    """Save an fp16 copy of a trained model with ``save_pretrained`` (fp16 keeps the zoo small), leaving
    ``model`` itself untouched. The cast is ``nn.Module.to``: diffusers' ``ModelMixin.to`` warns about
    "modules that should be kept in float32" on every dtype cast even when there are none (an empty
    ``_keep_in_fp32_modules``), which filled the training logs at every save."""
    fp16 = copy.deepcopy(model).eval()
    nn.Module.to(fp16, torch.float16)
    fp16.save_pretrained(folder)


def step_generator() -> torch.Generator:
    """A fresh generator seeded from torch's global RNG: extra randomness of a training step (feature
    noise, ...) that :func:`train_loop`'s checkpoints restore with the global RNG state, so a resumed run
    equals an unbroken one (a generator created once at start would restart from its seed)."""
    return torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))


def warmup_cosine(step: int, total: int, peak: float, warmup: int = 100, floor: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to ``floor * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def load_trained_weights(model: nn.Module, trained: dict[str, torch.Tensor], source: str) -> None:
    """Copy a trained model's ``state_dict`` (any dtype) into ``model`` of the same architecture: the start
    of a later training stage (``--init``). Raises ``ValueError`` naming the differing weights otherwise."""
    own = model.state_dict()
    mismatched = sorted(k for k in own.keys() | trained.keys()
                        if k not in own or k not in trained or own[k].shape != trained[k].shape)
    if mismatched:
        raise ValueError(f"--init: {source} has another architecture; differing weights: {mismatched[:5]}")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in trained.items()})


def grown_layer_sources(old_layers: int, new_layers: int) -> list[int | None]:
    """Where each layer of a deeper stack comes from when a trained stack of ``old_layers`` grows to
    ``new_layers``: the old layer's index, or None for an inserted layer. The inserted layers are spread
    evenly, each after a block of old layers (8 -> 12: old 0, 1, new, 2, 3, new, ...), so every part of
    the trained stack keeps its neighbours."""
    if not 0 < old_layers <= new_layers:
        raise ValueError(f"can only grow a stack of layers: {old_layers} -> {new_layers}")
    extra = new_layers - old_layers
    sources: list[int | None] = []
    for old in range(old_layers):  # old layer i is followed by its share of the insertions
        sources += [old] + [None] * ((old + 1) * extra // old_layers - old * extra // old_layers)
    return sources


def grow_layer_stack(own: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], prefix: str,
                     old_layers: int, new_layers: int, residual_outputs: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A state dict for ``own``'s deeper model from a ``trained`` one with fewer layers under ``prefix``
    (e.g. ``"model.language_model.layers."``), computing the same function (depth growth, as in progressive
    stacking): trained layers are renumbered by :func:`grown_layer_sources`; an inserted layer keeps its fresh
    initialisation except the weights named by ``residual_outputs`` (the projections that write into the
    residual stream, e.g. ``("self_attn.o_proj", "mlp.down_proj")``), which start at zero, so the inserted
    layer is the identity until training moves it. Every other weight is copied as it is (a weight missing
    from ``trained`` is left out, for :func:`load_trained_weights` to report)."""
    sources = grown_layer_sources(old_layers, new_layers)
    grown = {}
    for key, value in own.items():
        if not key.startswith(prefix):
            if key in trained:
                grown[key] = trained[key]
            continue
        index, _, rest = key[len(prefix):].partition(".")
        source = sources[int(index)]
        if source is not None:
            grown[key] = trained[f"{prefix}{source}.{rest}"]
        elif rest.rsplit(".", 1)[0] in residual_outputs:
            grown[key] = torch.zeros_like(value)
        else:
            grown[key] = value
    return grown


def widen_state_dict(own: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], old_width: int,
                     new_width: int, residual_writers: tuple[str, ...], unit_readers: tuple[str, ...],
                     residual_columns: tuple[str, ...], rms_norms: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A state dict for ``own``'s wider model from a ``trained`` narrower one, computing the same function
    (width growth in the spirit of Net2WiderNet, for a pre-norm residual stack with RMSNorm).

    The residual stream grows from ``old_width`` to ``new_width`` channels that start at zero and stay zero
    until training moves them; attention heads (same head width) and MLP units are appended. Every weight
    keeps its trained values in its leading block and its fresh initialisation elsewhere, except (weights
    are named by key suffix):

    - ``residual_writers`` (projections into the stream, and their biases): rows past the trained ones at
      zero, so the new channels start at zero;
    - ``residual_columns`` (the token embedding ``[V, d]``): columns past the trained ones at zero, likewise;
    - ``unit_readers`` (the projections that read a layer's own heads or units: attention output, MLP down
      projection): columns of the new heads / units at zero, so these add nothing yet;
    - ``rms_norms``: RMSNorm divides by the root mean square over all channels, which the zero channels
      lower by ``sqrt(old / new)``; the trained gains are scaled by that factor so the normalised old
      channels are unchanged (up to the norm's epsilon), and the new channels' gains start at the scaled
      mean gain so they pass signal once they carry some.

    Readers of the stream (queries, keys, values, MLP inputs, the LM head) keep fresh columns for the new
    channels: they see zeros now and carry the gradient that teaches the writers to use them. A weight of
    the same shape in both (the vision tower) is copied as it is; a missing one is left out for
    :func:`load_trained_weights` to report."""
    if not 0 < old_width <= new_width:
        raise ValueError(f"can only widen a residual stream: {old_width} -> {new_width}")
    scale = math.sqrt(old_width / new_width)
    widened = {}
    for key, fresh in own.items():
        if key not in trained:
            continue
        old = trained[key].to(fresh.dtype)
        if old.shape == fresh.shape:
            widened[key] = old
            continue
        if old.dim() != fresh.dim() or any(o > n for o, n in zip(old.shape, fresh.shape)):
            raise ValueError(f"cannot widen {key}: trained shape {tuple(old.shape)}, new {tuple(fresh.shape)}")
        grown = fresh.detach().clone()
        grown[tuple(slice(0, n) for n in old.shape)] = old
        if key.endswith(rms_norms):
            grown[:old_width] = old * scale
            grown[old_width:] = old.mean() * scale
        if key.endswith(residual_writers):
            grown[old.shape[0]:] = 0
        if key.endswith(unit_readers + residual_columns):
            grown[:, old.shape[1]:] = 0
        widened[key] = grown
    return widened


def init_from_folder(model: nn.Module, model_class: Any, folder: Path, what: str = "model") -> None:
    """``--init FOLDER``: load the trained ``model_class`` saved there into ``model`` (same architecture).
    Raises ``FileNotFoundError`` if the folder holds no saved model, ``ValueError`` on another architecture."""
    if not (Path(folder) / "config.json").is_file():
        raise FileNotFoundError(f"--init: no trained {what} at {folder}")
    load_trained_weights(model, model_class.from_pretrained(folder).state_dict(), str(folder))


PROBE_FROM, PROBE_TO = 10, 60  # the steps a time-limited run times (inside the 100-step warm-up)


def fit_schedule(steps: int, done: int, seconds_per_step: float, seconds_left: float, floor: int = 100) -> int:
    """The schedule total for a time-limited run: ``steps`` if the ``steps - done`` steps left fit in
    ``seconds_left`` at ``seconds_per_step``, else the total that does (kept at 95 % of the time, for
    the saves and a slower step now and then), never below ``floor`` (the warm-up length) or ``done``."""
    if seconds_per_step <= 0 or (steps - done) * seconds_per_step <= seconds_left:
        return steps
    fits = done + int(0.95 * seconds_left / seconds_per_step)
    return max(floor, done, min(steps, fits))


def train_loop(model: nn.Module, loss_fn: Callable[[torch.Tensor], torch.Tensor], num_items: int, *, steps: int,
               batch: int, lr: float, work: Path, save: Callable[[nn.Module], None], save_every: int = 200,
               weight_decay: float = 0.05, log_every: int = 20,
               evaluate: Callable[[nn.Module, int], dict] | None = None, eval_every: int = 0,
               stop_at: int | None = None, device: str | torch.device = "cpu",
               time_limit: float | None = None) -> None:
    """Minimise ``loss_fn(indices)`` over random mini-batches of ``num_items`` training items.

    AdamW (betas 0.9/0.95), gradient clipping at 1 (per part where the model has ``clip_gradients``).
    Every ``save_every`` steps (and at the end) the optimiser state goes to ``work/checkpoint.pt`` and
    ``save(model)`` writes the deliverable; a
    checkpoint found at start is resumed, RNG state included, so a resumed run equals an unbroken one.
    ``evaluate(model, step)`` (in eval mode, no grad; e.g. held-out acceptance) runs every ``eval_every``
    steps and at the end, its dict logged as ``{"step": ..., "eval": {...}}``; it must not draw from
    torch's global RNG (use its own generator) so that resumed runs stay identical. ``stop_at`` ends this
    run after that step (saved) without changing the schedule of ``steps``: a long schedule run in pieces.
    The model is moved to ``device``; ``loss_fn`` moves its batch there.

    ``time_limit`` (seconds of this run; for a lease of fixed length) sizes the schedule to the machine:
    a run that starts at step 0 times steps 10 to 60 (after the device has warmed up, before the
    100-step warm-up ends, so the learning rate so far is the same for any total) and, if ``steps`` would
    not fit, lowers the total to what fits (at least 100), logging ``{"steps": N, "reason": "time
    limit"}``: rerunning with ``steps=N`` repeats the run exactly. Any run also ends (saved) once the
    limit has passed (a step slower than timed), logging ``{"stopped_at": S, ...}``: ``stop_at=S`` with
    the same ``steps`` repeats that.
    """
    work.mkdir(parents=True, exist_ok=True)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    step = 0
    ckpt = work / "checkpoint.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        torch.set_rng_state(state["rng"].cpu())
    model.train()
    start = time.time()
    last = steps if stop_at is None else min(steps, stop_at)
    first = step
    probe_start = None
    with (work / "log.jsonl").open("a") as log:
        while step < last:
            if time_limit is not None and first == 0 and step in (PROBE_FROM, PROBE_TO):
                if step == PROBE_FROM:
                    probe_start = time.time()
                else:
                    fitted = fit_schedule(steps, step, (time.time() - probe_start) / (PROBE_TO - PROBE_FROM),
                                          time_limit - (time.time() - start))
                    if fitted != steps:
                        steps = fitted
                        last = steps if stop_at is None else min(steps, stop_at)
                        log.write(json.dumps({"steps": steps, "reason": "time limit"}) + "\n")
                        log.flush()
            index = torch.randint(0, num_items, (batch,))
            loss = loss_fn(index)
            for group in optimizer.param_groups:
                group["lr"] = warmup_cosine(step, steps, lr)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if hasattr(model, "clip_gradients"):  # a model of independent parts clips each part on its own
                model.clip_gradients(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if step % log_every == 0:
                log.write(json.dumps({"step": step, "loss": round(loss.item(), 4), "lr": warmup_cosine(step, steps, lr),
                                      "seconds": round(time.time() - start, 1)}) + "\n")
                log.flush()
            if evaluate is not None and ((eval_every and step % eval_every == 0) or step == steps):
                model.eval()
                with torch.no_grad():
                    result = evaluate(model, step)
                model.train()
                log.write(json.dumps({"step": step, "eval": result}) + "\n")
                log.flush()
            if time_limit is not None and step < last and time.time() - start > time_limit:
                last = step  # out of time: save now and end (--stop-at N repeats it)
                log.write(json.dumps({"stopped_at": step, "reason": "time limit"}) + "\n")
                log.flush()
            if step % save_every == 0 or step == last:
                save_atomically({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                                 "rng": torch.get_rng_state()}, ckpt)
                save(model)
    model.eval()
