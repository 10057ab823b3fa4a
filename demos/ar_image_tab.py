"""The AR image tab: discrete AR image generation (:class:`~mmspec.pipelines.ARImagePipeline`), a
speculative method next to the target-only baseline, with per-token acceptance maps."""

from __future__ import annotations

from typing import Any

from mmspec.demos.common import (
    CPU_NOTE,
    LENGTH_NOTE,
    STORED,
    DemoError,
    ImageResult,
    PipelineCache,
    Report,
    check_float,
    check_int,
    check_request,
    given,
    sampling_kwargs,
    tree_config,
    warm_up_and_compare,
)
from mmspec.demos.timing import DEFAULT_REPEATS, MAX_REPEATS

METHODS = ("eagle", "lantern", "sjd", "gsd", "mulo")
LOSSLESS = ("eagle", "sjd")
DEFAULT_PATH = "mmspec/shapes-t2i"
#: prompts the zoo's shapes model knows (the world's evaluation prompts, so lossy methods get a quality figure)
EXAMPLE_PROMPTS = ("a red circle and a blue square", "a red circle", "two squares", "a triangle above a circle",
                   "a green triangle and a yellow diamond")

#: the tab's inputs, in the order the page passes them (keyword names of :func:`run_ar_image`)
INPUTS = ("path", "prompt", "method", "num_images", "seed", "greedy", "temperature", "guidance_scale",
          "num_draft_tokens", "use_tree", "tree_depth", "tree_top_k", "tree_total_tokens", "lantern_k",
          "lantern_delta", "lantern_lam", "argmax_drafts", "sjd_window", "gsd_group_size", "mulo_tau", "mulo_radius",
          "mulo_resample", "lookup_tail", "repeats")



class ARImageResult(ImageResult):
    """What the tab shows: the speculative images with their acceptance maps (one row per image), the
    baseline's images, the statistics panel, and the comparison itself (:class:`ImageResult`'s fields)."""


def method_config(pipe: Any, method: str, *, greedy: bool, batch_size: int, guidance_scale: float,
                  num_draft_tokens: Any = None, use_tree: bool = False, tree_depth: Any = 5, tree_top_k: Any = 8,
                  tree_total_tokens: Any = 48, lantern_k: Any = None, lantern_delta: Any = None,
                  lantern_lam: Any = None, argmax_drafts: bool | None = None, sjd_window: Any = None,
                  gsd_group_size: Any = None, mulo_tau: Any = None, mulo_radius: Any = None,
                  mulo_resample: str | None = None, lookup_tail: Any = None) -> Any:
    """The page's settings of ``method``: the checkpoint's stored ones for the mode and batch
    (``pipe.method_config``, what a call with only ``method=`` runs) with the knobs the page shows replaced,
    each checked under its label; an empty knob (None) keeps the stored value, knobs of other methods are
    ignored.

    Knob -> config field: K -> ``num_draft_tokens``, the tree fields -> ``tree`` (a tree drafts no lookup
    tail and no argmax chain), lookup tail -> ``lookup_tail`` (0: none, and no lookup-only rounds); LANTERN k,
    delta -> ``k``, ``delta``, the LANTERN++ bound lam -> ``lam`` (0: off, the TV budget decides),
    argmax drafts -> ``argmax_drafts`` (sampled LANTERN chains; greedy chains draft argmax anyway); Jacobi
    window -> ``window``, GSD G -> ``group_size``; MuLo tau, radius, resampling -> ``tau``, ``radius``,
    ``resample`` (:data:`STORED`: the checkpoint's)."""
    config = pipe.method_config(method, do_sample=not greedy, batch_size=batch_size, guidance_scale=guidance_scale)
    num_draft_tokens, lookup_tail, lantern_k, lantern_delta, lantern_lam, sjd_window, gsd_group_size, mulo_tau, \
        mulo_radius = (given(value) for value in (num_draft_tokens, lookup_tail, lantern_k, lantern_delta,
                                                   lantern_lam, sjd_window, gsd_group_size, mulo_tau, mulo_radius))
    fields: dict[str, Any] = {}
    if method in ("eagle", "lantern"):
        if use_tree:
            fields.update(tree=tree_config(tree_depth, tree_top_k, tree_total_tokens), lookup_tail=0,
                          lookup_only_from=None, argmax_drafts=False)
        else:
            if num_draft_tokens is not None:
                fields["num_draft_tokens"] = check_int("K (draft tokens)", num_draft_tokens, 1, 32)
            if lookup_tail is not None:
                fields["lookup_tail"] = check_int("lookup tail (copies of the row above)", lookup_tail, 0, 64)
                if not fields["lookup_tail"]:
                    fields["lookup_only_from"] = None
    if method == "lantern":
        if lantern_k is not None:
            fields["k"] = check_int("LANTERN k", lantern_k, 1, 100_000)
        if lantern_delta is not None:
            fields["delta"] = check_float("LANTERN delta", lantern_delta, 0.0, 1.0)
        if lantern_lam is not None:
            lam = check_float("LANTERN++ bound lam (0: off)", lantern_lam, 0.0, 100.0)
            if 0 < lam < 1:
                raise DemoError(f"LANTERN++ bound lam (0: off) must be 0 or at least 1, got {lam}")
            fields["lam"] = lam or None
        if argmax_drafts is not None and not greedy and not use_tree:
            fields["argmax_drafts"] = bool(argmax_drafts)
    if method in ("sjd", "gsd") and sjd_window is not None:
        fields["window"] = check_int("Jacobi window", sjd_window, 1, 64)
    if method == "gsd" and gsd_group_size is not None:
        fields["group_size"] = check_int("GSD group size G", gsd_group_size, 1, 256)
    if method == "mulo":
        if mulo_tau is not None:
            fields["tau"] = check_float("MuLo tau", mulo_tau, 0.0, 1.0)
        if mulo_radius is not None:
            fields["radius"] = check_int("MuLo radius", mulo_radius, 0, 8)
        if mulo_resample not in (None, "", STORED):
            from mmspec.local_speculate import RESAMPLE_MODES

            if mulo_resample not in RESAMPLE_MODES:
                raise DemoError(f"MuLo resampling must be one of {', '.join(RESAMPLE_MODES)}, got {mulo_resample!r}")
            fields["resample"] = mulo_resample
    return config.replace(**fields) if fields else config


def run_ar_image(cache: PipelineCache, *, path: str = DEFAULT_PATH, prompt: str = EXAMPLE_PROMPTS[0],
                 method: str = "eagle", num_images: int = 1, seed: int = 0, greedy: bool = False,
                 temperature: float = 1.0, guidance_scale: float = 3.0, num_draft_tokens: int | None = None,
                 use_tree: bool = False, tree_depth: int = 5, tree_top_k: int = 8, tree_total_tokens: int = 48,
                 lantern_k: int | None = None, lantern_delta: float | None = None, lantern_lam: float | None = None,
                 argmax_drafts: bool | None = None, sjd_window: int | None = None, gsd_group_size: int | None = None,
                 mulo_tau: float | None = None, mulo_radius: int | None = None, mulo_resample: str | None = None,
                 lookup_tail: int | None = None, repeats: int = DEFAULT_REPEATS,
                 report: Report | None = None) -> ARImageResult:
    """Generate the prompts (one per line) with ``method`` and target-only with the same seed; return
    the images, their acceptance maps and the statistics. The method runs with the checkpoint's stored
    settings and the page's knobs over them (:func:`method_config`; None: the stored value); the baseline
    gets the sampling settings only. Timing: :func:`~mmspec.demos.timing.compare` with ``repeats`` timed
    calls per side. Bad input raises :class:`DemoError` (or the pipeline's ``ValueError``)
    with a message for the page."""
    method, prompts, images, seed = check_request(method, METHODS, prompt, num_images, seed,
                                                  per_prompt_name="images per prompt", max_per_prompt=8,
                                                  what="images")
    guidance = check_float("guidance scale", guidance_scale, 0, 20)
    sampling: dict[str, Any] = {**sampling_kwargs(bool(greedy), temperature), "guidance_scale": guidance}
    pipe = cache.get("ar_image", path)
    if pipe.transformer.config.model_type != "t2i":
        raise DemoError("this checkpoint is class-conditioned (c2i); the demo's AR image tab takes text prompts")
    config = method_config(pipe, method, greedy=bool(greedy), batch_size=len(prompts) * images,
                           guidance_scale=guidance, num_draft_tokens=num_draft_tokens, use_tree=bool(use_tree),
                           tree_depth=tree_depth, tree_top_k=tree_top_k, tree_total_tokens=tree_total_tokens,
                           lantern_k=lantern_k, lantern_delta=lantern_delta, lantern_lam=lantern_lam,
                           argmax_drafts=argmax_drafts, sjd_window=sjd_window, gsd_group_size=gsd_group_size,
                           mulo_tau=mulo_tau, mulo_radius=mulo_radius, mulo_resample=mulo_resample,
                           lookup_tail=lookup_tail)
    total = len(prompts) * images * pipe.transformer.config.block_size

    def run(name: str, generator: Any, progress: Any, output_type: str = "pil") -> Any:
        def on_step(_pipe: Any, _round: int, _timestep: int, state: dict) -> dict:
            progress(float(state["num_generated"].sum()) / total)
            return state

        return pipe(prompts, method=config if name != "none" else "none", num_images_per_prompt=images,
                    generator=generator, output_type=output_type, callback_on_step_end=on_step, **sampling)

    comparison = warm_up_and_compare(cache, pipe, "ar_image", run, method, seed, warm_output_type="tokens",
                                     repeats=check_int("timed repeats", repeats, 1, MAX_REPEATS), report=report)
    comparison.lossless = method in LOSSLESS
    spec, base = comparison.speculative, comparison.baseline
    drafted = float(spec.drafted.float().mean())
    same = bool((spec.tokens == base.tokens).all())
    comparison.extra["drafted-and-accepted tokens"] = (f"{drafted:.0%}", "0%")
    comparison.extra["same tokens as the baseline"] = ("yes" if same else "no", "-")
    mode = "greedy" if greedy else f"sampling at temperature {sampling.get('temperature', 1.0):g}"
    comparison.notes = [f"{len(prompts)} prompt(s) x {images} image(s), {mode}, seed {seed}, guidance "
                        f"{guidance:g}.", f"{method} settings (the checkpoint's, with the page's knobs): {config}.",
                        LENGTH_NOTE, CPU_NOTE]
    if method in LOSSLESS:
        comparison.notes.append(f"{method} is lossless: greedy runs give the baseline's tokens exactly; sampled "
                                "runs follow the same distribution but use the random numbers differently.")
    else:
        comparison.notes.append(f"{method} is lossy by design (a relaxed acceptance rule): compare the images.")
    labels = [prompt for prompt in prompts for _ in range(images)]
    return ARImageResult.from_comparison(comparison, labels, identical=same)
