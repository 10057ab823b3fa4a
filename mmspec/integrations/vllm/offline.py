"""Generation with vLLM's offline API, with or without an exported head, as JSON (tests and benchmarks).

Runs in the vLLM environment (``.venv-vllm/bin/python -m mmspec.integrations.vllm.offline REQUEST.json``);
the main environment drives it through a subprocess, since the two environments pin different transformers.

The request (JSON object): ``target`` (folder), ``head`` (exported folder or null), ``prompts`` (each a list
of token ids, ``{"prompt": text, "image": png_path}`` or ``{"messages": [...]}``: OpenAI-style chat messages,
rendered with the chat template ``python -m mmspec.integrations.vllm serve`` serves the target with: BOS written
when the tokenizer needs it, :mod:`.chat`), ``max_tokens``, ``num_speculative_tokens``,
``ignore_eos`` (default true: every prompt decodes ``max_tokens`` tokens) and optionally ``dtype``
(default float32), ``max_model_len``, ``temperature`` (default 0: greedy) and ``seeds`` (one sampling seed per
prompt, so repeated prompts are independent draws). The reply (a stdout line after :data:`REPLY_PREFIX`, read by
:func:`parse_reply`): ``tokens`` per prompt, ``prompt_tokens`` (the prompt's token ids as vLLM built them) and
``text`` per prompt, ``load_s`` / ``generate_s``, ``spec`` (:func:`spec_metrics`) and ``accepted_per_step`` (per prompt,
the accepted drafts of each verify step); both null without a head.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

REPLY_PREFIX = "mmspec-vllm-reply: "
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def spec_metrics(metrics: list[Any]) -> dict[str, Any] | None:
    """vLLM's speculative-decoding counters -> ``drafts``, ``draft_tokens``, ``accepted_tokens``,
    ``accepted_per_position`` and ``mean_acceptance_length`` (1 + accepted / drafts: tokens per target
    forward, the figure vLLM logs as "Mean acceptance length"). None when vLLM reported no drafts."""
    out: dict[str, Any] = {}
    for metric in metrics:
        if metric.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_position"] = [int(v) for v in metric.values]
    if not out.get("drafts"):
        return None
    out["mean_acceptance_length"] = 1.0 + out.get("accepted_tokens", 0) / out["drafts"]
    return out


def chat_messages(text: str, png: bytes | None = None) -> list[dict[str, Any]]:
    """One user turn as an OpenAI client sends it: the image (PNG bytes, as a data URL) first, then the text."""
    import base64

    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if png is not None:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": content}]


def _is_chat(item: Any) -> bool:
    return isinstance(item, dict) and "messages" in item


def _prompt(item: Any) -> Any:
    if _is_chat(item):
        return item["messages"]
    if isinstance(item, list):
        return {"prompt_token_ids": [int(t) for t in item]}
    if isinstance(item, dict) and "prompt" in item:
        prompt: dict[str, Any] = {"prompt": item["prompt"]}
        if item.get("image"):
            from PIL import Image

            prompt["multi_modal_data"] = {"image": Image.open(item["image"]).convert("RGB")}
        return prompt
    raise ValueError("prompts: each prompt is a list of token ids, {'prompt': text, 'image': path} or "
                     f"{{'messages': [...]}}, got {item!r}")


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Load vLLM for ``request`` (see the module docstring), generate, return the reply."""
    from vllm import LLM, SamplingParams

    from .launch import serving_chat_template, speculative_config, target_overrides

    target, head = request["target"], request.get("head")
    k = request.get("num_speculative_tokens")
    kwargs: dict[str, Any] = {}
    if head:
        kwargs["speculative_config"] = speculative_config(target, head, k)  # checked before vLLM starts
        kwargs["per_request_spec_decode_metrics"] = "detailed"  # accepted drafts of every verify step
        kwargs["hf_overrides"] = target_overrides(target) or None
    if request.get("max_model_len"):
        kwargs["max_model_len"] = int(request["max_model_len"])
    prompts = [_prompt(item) for item in request["prompts"]]
    start = time.perf_counter()
    llm = LLM(model=str(target), dtype=request.get("dtype", "float32"), enforce_eager=True, seed=0,
              disable_log_stats=False, **kwargs)
    load_s = time.perf_counter() - start
    seeds = request.get("seeds") or [None] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"seeds: one per prompt, got {len(seeds)} for {len(prompts)} prompts")

    def sampling(seed: int | None) -> Any:
        return SamplingParams(temperature=float(request.get("temperature", 0.0)), max_tokens=int(request["max_tokens"]),
                              ignore_eos=bool(request.get("ignore_eos", True)), seed=seed)

    params = [sampling(None if seed is None else int(seed)) for seed in seeds]
    chats = [_is_chat(item) for item in request["prompts"]]
    template = serving_chat_template(target, []) if any(chats) else None

    def chat(batch: list[Any], batch_params: list[Any]) -> list[Any]:
        return llm.chat(batch, batch_params, use_tqdm=False, chat_template=template)

    def generate(batch: list[Any], batch_params: list[Any]) -> list[Any]:
        return llm.generate(batch, batch_params, use_tqdm=False)

    outputs: list[Any] = [None] * len(prompts)
    start = time.perf_counter()
    for is_chat, call in ((False, generate), (True, chat)):  # plain prompts in one call, chat prompts in one
        picked = [i for i, c in enumerate(chats) if c == is_chat]
        if picked:
            done = call([prompts[i] for i in picked], [params[i] for i in picked])
            for i, output in zip(picked, done, strict=True):
                outputs[i] = output
    generate_s = time.perf_counter() - start
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "text": [o.outputs[0].text for o in outputs],
            "prompt_tokens": [list(o.prompt_token_ids) for o in outputs],
            "load_s": load_s, "generate_s": generate_s, "spec": spec_metrics(llm.get_metrics()) if head else None,
            "accepted_per_step": [_accepted_per_step(o.outputs[0]) for o in outputs] if head else None}


def _accepted_per_step(completion: Any) -> list[int] | None:
    metrics = getattr(completion, "spec_decode_metrics", None)
    return None if metrics is None else list(metrics.per_step_accepted)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m mmspec.integrations.vllm.offline REQUEST.json", file=sys.stderr)
        return 2
    reply = run(json.loads(Path(argv[0]).read_text()))
    print(REPLY_PREFIX + json.dumps(reply), flush=True)
    return 0


def parse_reply(stdout: str) -> Any:
    """The reply in the runner's stdout (vLLM logs to stdout too, also after the reply)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(REPLY_PREFIX):
            return json.loads(line[len(REPLY_PREFIX):])
    raise ValueError("the vLLM runner printed no reply (see its stderr)")


if __name__ == "__main__":  # vLLM starts worker processes: only the main process may run this
    sys.exit(main())
