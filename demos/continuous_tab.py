"""The continuous AR image tab: MAR-style generation over continuous tokens
(:class:`~mmspec.pipelines.continuous_ar_image.ContinuousARImagePipeline`), CSpD next to the target-only
baseline, with per-token acceptance maps. CSpD runs with the checkpoint's stored settings
(``pipe.method_config("cspd")``, what a call with only ``method="cspd"`` runs) and the page's knobs over them."""

from __future__ import annotations

from typing import Any

from mmspec.demos.common import (
    CPU_NOTE,
    STORED,
    DemoError,
    ImageResult,
    PipelineCache,
    Report,
    check_choice,
    check_float,
    check_int,
    check_request,
    given,
    warm_up_and_compare,
)
from mmspec.demos.timing import DEFAULT_REPEATS, MAX_REPEATS
from mmspec.methods.cspd import VERIFY_CONTEXTS, VERIFY_ORDERS

METHODS = ("cspd",)
DEFAULT_PATH = "mmspec/shapes-t2i-continuous"

INPUTS = ("path", "prompt", "method", "num_images", "seed", "draft_length", "num_iter", "temperature",
          "guidance_scale", "verify_order", "verify_context", "repeats")


class ContinuousResult(ImageResult):
    """The CSpD images with their acceptance maps (one row per image), the baseline's images, the statistics
    (:class:`ImageResult`'s fields)."""


def _conditions(pipe: Any, prompts: list[str]) -> dict[str, Any]:
    """Prompt lines as the pipeline's condition: text, or class ids for class-conditioned models."""
    if pipe.transformer.config.condition_type == "text":
        if any(p.strip().lstrip("-").isdigit() for p in prompts):
            raise DemoError("this checkpoint is text-conditioned: describe the image in words (e.g. 'a red "
                            "circle'); class ids are for class-conditioned checkpoints")
        return {"prompt": prompts}
    try:
        labels = [int(p) for p in prompts]
    except ValueError:
        raise DemoError("this checkpoint is class-conditioned: type class ids (integers), one per line") from None
    return {"class_labels": labels}


def method_config(pipe: Any, *, batch_size: int, guidance_scale: float, draft_length: Any = None,
                  verify_order: Any = None, verify_context: Any = None) -> Any:
    """The page's CSpD settings: the checkpoint's stored ones for the batch (``pipe.method_config("cspd")``)
    with the knobs the page shows replaced, each checked under its label; an empty knob (None, "" or
    :data:`~mmspec.demos.common.STORED`) keeps the stored value. Knob -> field: gamma -> ``draft_length``,
    verification order -> ``verify_order``, target context -> ``verify_context``."""
    config = pipe.method_config("cspd", batch_size=batch_size, guidance_scale=guidance_scale)
    fields: dict[str, Any] = {}
    if given(draft_length) is not None:
        fields["draft_length"] = check_int("CSpD gamma (draft iterations per target pass)", draft_length, 1, 64)
    if given(verify_order) is not None:
        fields["verify_order"] = check_choice("verification order", verify_order, VERIFY_ORDERS)
    if given(verify_context) is not None:
        fields["verify_context"] = check_choice("target context", verify_context, VERIFY_CONTEXTS)
    return config.replace(**fields) if fields else config


def run_continuous(cache: PipelineCache, *, path: str = DEFAULT_PATH, prompt: str = "a red circle",
                   method: str = "cspd", num_images: int = 2, seed: int = 0, draft_length: Any = None,
                   num_iter: int | None = None, temperature: float = 1.0, guidance_scale: float = 1.0,
                   verify_order: str | None = STORED, verify_context: str | None = STORED,
                   repeats: int = DEFAULT_REPEATS, report: Report | None = None) -> ContinuousResult:
    """Generate with CSpD (draft MAR, gamma draft iterations per target pass) and target-only with the
    same seed; return the images, their acceptance maps and the statistics. CSpD runs with the checkpoint's
    stored settings and the page's knobs over them (:func:`method_config`; empty: the stored value)."""
    method, prompts, batch, seed = check_request(method, METHODS, prompt, num_images, seed,
                                                 per_prompt_name="batch (images per prompt)", max_per_prompt=16,
                                                 what="images")
    temperature = check_float("temperature", temperature, 0.0, 5.0, low_open=True)
    guidance = check_float("guidance scale", guidance_scale, 0.0, 20.0)
    pipe = cache.get("continuous", path)
    config = method_config(pipe, batch_size=len(prompts) * batch, guidance_scale=guidance,
                           draft_length=draft_length, verify_order=verify_order, verify_context=verify_context)
    seq_len = pipe.transformer.config.grid_size ** 2
    # 0 or empty: one token per iteration (MAR's evaluation setting)
    iterations = seq_len if num_iter in (None, "", 0) else check_int("MAR iterations", num_iter, 1, seq_len)
    conditions = _conditions(pipe, prompts)
    rows = len(prompts) * batch
    common = dict(num_iter=iterations, temperature=temperature, guidance_scale=guidance, num_images_per_prompt=batch,
                  **conditions)

    def run(name: str, generator: Any, progress: Any, output_type: str = "pil") -> Any:
        def on_step(_pipe: Any, _step: int, _timestep: int, state: dict) -> dict:
            progress(float(state["num_generated"].sum()) / (rows * seq_len))
            return state

        return pipe(method=config if name != "none" else "none", generator=generator, output_type=output_type,
                    callback_on_step_end=on_step, **common)

    comparison = warm_up_and_compare(cache, pipe, "continuous", run, method, seed, warm_output_type="latent",
                                     repeats=check_int("timed repeats", repeats, 1, MAX_REPEATS), report=report)
    spec = comparison.speculative
    comparison.extra["acceptance rate (alpha)"] = (f"{spec.stats.acceptance_rate:.2f}", "-")
    comparison.extra["drafted / accepted tokens"] = (f"{spec.stats.drafted_tokens} / {spec.stats.accepted_tokens}",
                                                      "-")
    comparison.extra["tokens pre-filled by the target"] = (str(spec.stats.prefill_tokens), "-")
    comparison.notes = [
        f"{len(prompts)} prompt(s) x {batch} image(s), {seq_len} tokens each in {iterations} MAR iterations, "
        f"seed {seed}.", f"CSpD settings (the checkpoint's, with the page's knobs): {config}.",
        "Mean accepted length: tokens a row gains per target forward (the baseline's is tokens per MAR "
        "iteration, since one iteration already yields a set of tokens).",
        "CSpD accepts with the paper's surrogate density ratio, so it is not exactly lossless; both runs share "
        "every token's noise (trajectory alignment), so accepted drafts land close to the baseline's tokens.",
        CPU_NOTE]
    return ContinuousResult.from_comparison(comparison, [p for p in prompts for _ in range(batch)])
