"""The AR image tab: discrete AR image generation (:class:`~mmspec.pipelines.ARImagePipeline`), a
speculative method next to the target-only baseline, with per-token acceptance maps."""

from __future__ import annotations

from typing import Any

from mmspec.demos.common import (
    CPU_NOTE,
    LENGTH_NOTE,
    DemoError,
    ImageResult,
    PipelineCache,
    Report,
    check_float,
    check_int,
    check_request,
    sampling_kwargs,
    tree_config,
    warm_up_and_compare,
)

METHODS = ("eagle", "lantern", "sjd", "gsd", "mulo")
LOSSLESS = ("eagle", "sjd")
DEFAULT_PATH = "mmspec/shapes-t2i"
EXAMPLE_PROMPTS = ("a red circle", "two blue squares", "a green triangle above a yellow diamond")

#: LANTERN's defaults on the page: the measured LANTERN++ rule, ``FAST_LANTERN_RULE`` of
#: ``mmspec.pipelines.ar_image`` (written out here because the pipelines load lazily, with the page; a test
#: keeps the two equal)
DEFAULT_LANTERN_K, DEFAULT_LANTERN_LAM = 512, 10.0

#: the tab's inputs, in the order the page passes them (keyword names of :func:`run_ar_image`)
INPUTS = ("path", "prompt", "method", "num_images", "seed", "greedy", "temperature", "guidance_scale",
          "num_draft_tokens", "use_tree", "tree_depth", "tree_top_k", "tree_total_tokens", "lantern_k",
          "lantern_delta", "lantern_lam", "argmax_drafts", "sjd_window", "gsd_group_size", "mulo_tau", "mulo_radius",
          "mulo_resample", "lookup_tail")


class ARImageResult(ImageResult):
    """What the tab shows: the speculative images with their acceptance maps (one row per image), the
    baseline's images, the statistics panel, and the comparison itself (:class:`ImageResult`'s fields)."""


def method_kwargs(method: str, *, greedy: bool, temperature: float, guidance_scale: float, num_draft_tokens: int,
                  use_tree: bool, tree_depth: int, tree_top_k: int, tree_total_tokens: int, lantern_k: int,
                  lantern_delta: float, sjd_window: int, gsd_group_size: int, mulo_tau: float,
                  mulo_radius: int, mulo_resample: str = "reverify", lantern_lam: float = 0.0,
                  argmax_drafts: bool = False, lookup_tail: int = 0) -> dict[str, Any]:
    """The page's knobs, checked, as :class:`~mmspec.pipelines.ARImagePipeline` keyword arguments of
    ``method`` (knobs of other methods are ignored). SJD and GSD start from ``FAST_METHOD_KWARGS``
    (left-neighbour initialisation, GSD without the probability filter); the page sets window and G.
    MuLo's resampling defaults to that table's "reverify". LANTERN takes the LANTERN++ bound ``lantern_lam``
    when it is >= 1 (0: the TV budget ``lantern_delta``) and, when sampling a chain, ``argmax_drafts``.
    EAGLE and LANTERN chains take ``lookup_tail`` free copies of the row above (0: none; not with a tree)."""
    guidance = check_float("guidance scale", guidance_scale, 0, 20)
    kwargs: dict[str, Any] = {**sampling_kwargs(greedy, temperature), "guidance_scale": guidance}
    if method in ("eagle", "lantern"):
        if use_tree:
            kwargs["tree"] = tree_config(tree_depth, tree_top_k, tree_total_tokens)
        else:
            kwargs["num_draft_tokens"] = check_int("K (draft tokens)", num_draft_tokens, 1, 32)
            tail = check_int("lookup tail (copies of the row above)", lookup_tail, 0, 64)
            if tail:
                kwargs["lookup_tail"] = tail
    if method == "lantern":
        kwargs["lantern_k"] = check_int("LANTERN k", lantern_k, 1, 100_000)
        kwargs["lantern_delta"] = check_float("LANTERN delta", lantern_delta, 0.0, 1.0)
        lam = check_float("LANTERN++ bound lam (0: off)", lantern_lam, 0.0, 100.0)
        if 0 < lam < 1:
            raise DemoError(f"LANTERN++ bound lam (0: off) must be 0 or at least 1, got {lam}")
        if lam:
            kwargs["lantern_lam"] = lam
        if argmax_drafts and not greedy and not use_tree:  # greedy chains and trees draft argmax already
            kwargs["argmax_drafts"] = True
    if method in ("sjd", "gsd"):
        from mmspec.pipelines.ar_image import FAST_METHOD_KWARGS  # the pipelines load lazily, with the page

        kwargs.update(FAST_METHOD_KWARGS[method])
        kwargs["sjd_window"] = check_int("Jacobi window", sjd_window, 1, 64)
    if method == "gsd":
        kwargs["gsd_group_size"] = check_int("GSD group size G", gsd_group_size, 1, 256)
    if method == "mulo":
        kwargs["mulo_tau"] = check_float("MuLo tau", mulo_tau, 0.0, 1.0)
        kwargs["mulo_radius"] = check_int("MuLo radius", mulo_radius, 0, 8)
        from mmspec.local_speculate import RESAMPLE_MODES

        if mulo_resample not in RESAMPLE_MODES:
            raise DemoError(f"MuLo resampling must be one of {', '.join(RESAMPLE_MODES)}, got {mulo_resample!r}")
        kwargs["mulo_resample"] = mulo_resample
    return kwargs


def run_ar_image(cache: PipelineCache, *, path: str = DEFAULT_PATH, prompt: str = EXAMPLE_PROMPTS[0],
                 method: str = "eagle", num_images: int = 1, seed: int = 0, greedy: bool = False,
                 temperature: float = 1.0, guidance_scale: float = 3.0, num_draft_tokens: int = 8,
                 use_tree: bool = False, tree_depth: int = 5, tree_top_k: int = 8, tree_total_tokens: int = 48,
                 lantern_k: int = DEFAULT_LANTERN_K, lantern_delta: float = 0.2, lantern_lam: float = DEFAULT_LANTERN_LAM, argmax_drafts: bool = True,
                 sjd_window: int = 8, gsd_group_size: int = 6, mulo_tau: float = 0.3, mulo_radius: int = 1,
                 mulo_resample: str = "reverify", lookup_tail: int = 0, report: Report | None = None) -> ARImageResult:
    """Generate the prompts (one per line) with ``method`` and target-only with the same seed; return
    the images, their acceptance maps and the statistics. Bad input raises :class:`DemoError` (or the
    pipeline's ``ValueError``) with a message for the page."""
    method, prompts, images, seed = check_request(method, METHODS, prompt, num_images, seed,
                                                  per_prompt_name="images per prompt", max_per_prompt=8,
                                                  what="images")
    kwargs = method_kwargs(method, greedy=bool(greedy), temperature=temperature, guidance_scale=guidance_scale,
                           num_draft_tokens=num_draft_tokens, use_tree=bool(use_tree), tree_depth=tree_depth,
                           tree_top_k=tree_top_k, tree_total_tokens=tree_total_tokens, lantern_k=lantern_k,
                           lantern_delta=lantern_delta, sjd_window=sjd_window, gsd_group_size=gsd_group_size,
                           mulo_tau=mulo_tau, mulo_radius=mulo_radius, mulo_resample=mulo_resample,
                           lantern_lam=lantern_lam, argmax_drafts=bool(argmax_drafts), lookup_tail=lookup_tail)
    pipe = cache.get("ar_image", path)
    if pipe.transformer.config.model_type != "t2i":
        raise DemoError("this checkpoint is class-conditioned (c2i); the demo's AR image tab takes text prompts")
    total = len(prompts) * images * pipe.transformer.config.block_size

    def run(name: str, generator: Any, progress: Any, output_type: str = "pil") -> Any:
        def on_step(_pipe: Any, _round: int, state: dict) -> None:
            progress(float(state["num_generated"].sum()) / total)

        extra = kwargs if name != "none" else {k: v for k, v in kwargs.items()
                                               if k in ("do_sample", "temperature", "guidance_scale")}
        return pipe(prompts, method=name, num_images_per_prompt=images, generator=generator, output_type=output_type,
                    callback_on_step_end=on_step, **extra)

    comparison = warm_up_and_compare(cache, pipe, "ar_image", run, method, seed, warm_output_type="tokens",
                                     report=report)
    spec, base = comparison.speculative, comparison.baseline
    drafted = float(spec.drafted.float().mean())
    same = bool((spec.tokens == base.tokens).all())
    comparison.extra["drafted-and-accepted tokens"] = (f"{drafted:.0%}", "0%")
    comparison.extra["same tokens as the baseline"] = ("yes" if same else "no", "-")
    mode = "greedy" if greedy else f"sampling at temperature {kwargs.get('temperature', 1.0):g}"
    comparison.notes = [f"{len(prompts)} prompt(s) x {images} image(s), {mode}, seed {seed}, guidance "
                        f"{kwargs['guidance_scale']:g}.", LENGTH_NOTE, CPU_NOTE]
    if method in LOSSLESS:
        comparison.notes.append(f"{method} is lossless: greedy runs give the baseline's tokens exactly; sampled "
                                "runs follow the same distribution but use the random numbers differently.")
    else:
        comparison.notes.append(f"{method} is lossy by design (a relaxed acceptance rule): compare the images.")
    return ARImageResult.from_comparison(comparison)
