"""Model-ready VLM prompts from plain text and a number of images, shared by the VLM pipeline and the
drafter training recipe (so training and inference format prompts the same way)."""

from __future__ import annotations

from typing import Any


def image_token(processor: Any) -> str:
    """The processor's image placeholder string (``"<image>"`` for LLaVA)."""
    token = getattr(processor, "image_token", None)
    if token is None:
        raise ValueError(f"{type(processor).__name__} has no image_token: not a VLM processor")
    return str(token)


def format_vlm_prompt(processor: Any, text: str, num_images: int) -> str:
    """The prompt for ``text`` with ``num_images`` images (video frames count one each).

    A ``text`` that already holds placeholder tokens is used as is (their number must match the images:
    a mismatch raises ``ValueError``). Otherwise the processor's chat template is applied when it has one
    (real LLaVA / Qwen checkpoints and the shapes zoo), else the placeholders are put before the text.
    """
    token = image_token(processor)
    if token in text:
        found = text.count(token)
        if found != num_images:
            raise ValueError(f"the prompt holds {found} image token(s) {token!r} but {num_images} image(s) were given")
        return text
    if getattr(processor, "chat_template", None):
        content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": text}]
        messages = [{"role": "user", "content": content}]
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return token * num_images + text
