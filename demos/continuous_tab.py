"""The continuous AR image tab: MAR-style generation over continuous tokens
(:class:`~mmspec.pipelines.continuous_ar_image.ContinuousARImagePipeline`), CSpD next to the target-only
baseline, with per-token acceptance maps."""

from __future__ import annotations

from typing import Any

from mmspec.demos.common import (
    CPU_NOTE,
    DemoError,
    ImageResult,
    PipelineCache,
    Report,
    check_choice,
    check_float,
    check_int,
    check_request,
    warm_up_and_compare,
)

METHODS = ("cspd",)
DEFAULT_PATH = "mmspec/shapes-t2i-continuous"
VERIFY_ORDERS = ("independent", "chain")
VERIFY_CONTEXTS = ("round", "exact")

INPUTS = ("path", "prompt", "method", "num_images", "seed", "draft_length", "num_iter", "temperature",
          "guidance_scale", "verify_order", "verify_context")


class ContinuousResult(ImageResult):
    """The CSpD images with their acceptance maps (one row per image), the baseline's images, the statistics
    (:class:`ImageResult`'s fields)."""


def _conditions(pipe: Any, prompts: list[str]) -> dict[str, Any]:
    """Prompt lines as the pipeline's condition: text, or class ids for class-conditioned models."""
    if pipe.transformer.config.condition_type == "text":
        return {"prompt": prompts}
    try:
        labels = [int(p) for p in prompts]
    except ValueError:
        raise DemoError("this checkpoint is class-conditioned: type class ids (integers), one per line") from None
    return {"class_labels": labels}


def run_continuous(cache: PipelineCache, *, path: str = DEFAULT_PATH, prompt: str = "a red circle",
                   method: str = "cspd", num_images: int = 2, seed: int = 0, draft_length: int = 4,
                   num_iter: int | None = None, temperature: float = 1.0, guidance_scale: float = 1.0,
                   verify_order: str = "independent", verify_context: str = "round",
                   report: Report | None = None) -> ContinuousResult:
    """Generate with CSpD (draft MAR, gamma draft iterations per target pass) and target-only with the
    same seed; return the images, their acceptance maps and the statistics."""
    method, prompts, batch, seed = check_request(method, METHODS, prompt, num_images, seed,
                                                 per_prompt_name="batch (images per prompt)", max_per_prompt=16,
                                                 what="images")
    gamma = check_int("CSpD gamma (draft iterations per target pass)", draft_length, 1, 64)
    temperature = check_float("temperature", temperature, 0.0, 5.0, low_open=True)
    guidance = check_float("guidance scale", guidance_scale, 0.0, 20.0)
    order = check_choice("verification order", verify_order, VERIFY_ORDERS)
    context = check_choice("target context", verify_context, VERIFY_CONTEXTS)
    pipe = cache.get("continuous", path)
    seq_len = pipe.transformer.config.grid_size ** 2
    # 0 or empty: one token per iteration (MAR's evaluation setting)
    iterations = seq_len if num_iter in (None, "", 0) else check_int("MAR iterations", num_iter, 1, seq_len)
    conditions = _conditions(pipe, prompts)
    rows = len(prompts) * batch
    common = dict(num_iter=iterations, temperature=temperature, guidance_scale=guidance, num_images_per_prompt=batch,
                  **conditions)

    def run(name: str, generator: Any, progress: Any, output_type: str = "pil") -> Any:
        def on_step(_pipe: Any, _step: int, state: dict) -> None:
            progress(float(state["num_generated"].sum()) / (rows * seq_len))

        extra = dict(draft_length=gamma, verify_order=order, verify_context=context) if name != "none" else {}
        return pipe(method=name, generator=generator, output_type=output_type, callback_on_step_end=on_step,
                    **common, **extra)

    comparison = warm_up_and_compare(cache, pipe, "continuous", run, method, seed, warm_output_type="latent",
                                     report=report)
    spec = comparison.speculative
    comparison.extra["acceptance rate (alpha)"] = (f"{spec.stats.acceptance_rate:.2f}", "-")
    comparison.extra["drafted / accepted tokens"] = (f"{spec.stats.drafted_tokens} / {spec.stats.accepted_tokens}",
                                                      "-")
    comparison.extra["tokens pre-filled by the target"] = (str(spec.stats.prefill_tokens), "-")
    comparison.notes = [
        f"{len(prompts)} prompt(s) x {batch} image(s), {seq_len} tokens each in {iterations} MAR iterations, "
        f"gamma {gamma}, {order} verification, {context} target context, seed {seed}.",
        "Mean accepted length: tokens a row gains per target forward (the baseline's is tokens per MAR "
        "iteration, since one iteration already yields a set of tokens).",
        "CSpD accepts with the paper's surrogate density ratio, so it is not exactly lossless; both runs share "
        "every token's noise (trajectory alignment), so accepted drafts land close to the baseline's tokens.",
        CPU_NOTE]
    return ContinuousResult.from_comparison(comparison)
