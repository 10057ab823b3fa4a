"""The chat template vLLM should serve a target with, so that served prompts are the tokens the model expects.

vLLM's chat path (``vllm serve``'s chat completions, ``LLM.chat``) renders the chat template and tokenizes the
result *without* adding special tokens (the OpenAI request's ``add_special_tokens`` defaults to false),
trusting the template to write BOS. mmspec's pipelines, transformers' ``processor(text=...)`` and the
offline ``LLM.generate`` path tokenize the rendered text *with* special tokens. For a tokenizer that
prepends BOS (Llama-family, the shapes zoo) and a template that does not write it (the zoo's, llava-hf's),
served prompts therefore lose their BOS: a different prompt, and a head trained on the other one accepts
less. :func:`vllm_chat_template` prepends ``{{ bos_token }}`` exactly in that case, and leaves every other
template unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"
BOS_EXPRESSION = "{{ bos_token }}"


def find_chat_template(folder: str | Path) -> str | None:
    """The chat template stored in a checkpoint ``folder`` (``chat_template.jinja``, ``chat_template.json``,
    or the ``chat_template`` of ``tokenizer_config.json`` / ``processor_config.json``), or None."""
    folder = Path(folder)
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text()
    for name in ("chat_template.json", "tokenizer_config.json", "processor_config.json"):
        path = folder / name
        if path.is_file():
            template = json.loads(path.read_text()).get("chat_template")
            if isinstance(template, str):
                return template
    return None


def tokenizer_bos(folder: str | Path) -> str | None:
    """The BOS token that ``folder``'s ``tokenizer.json`` prepends when it encodes text with special tokens;
    None when it prepends nothing or the folder has no ``tokenizer.json`` (then nothing can be told)."""
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizer = Tokenizer.from_file(str(path))
    with_special = tokenizer.encode("a", add_special_tokens=True).ids
    without = tokenizer.encode("a", add_special_tokens=False).ids
    if len(with_special) > len(without) and with_special[1:1 + len(without)] == without:
        return tokenizer.id_to_token(with_special[0])
    return None


def vllm_chat_template(template: str, folder: str | Path) -> str:
    """``template`` as vLLM should render it for the tokenizer in ``folder``: with ``{{ bos_token }}`` first
    when the tokenizer prepends BOS and the template does not write it, else unchanged."""
    if tokenizer_bos(folder) is None or "bos_token" in template:
        return template
    return BOS_EXPRESSION + template


def write_vllm_chat_template(folder: str | Path, template: str | None = None) -> Path | None:
    """Write :func:`vllm_chat_template` of ``template`` (default: the one ``folder`` stores) to
    ``folder/chat_template.jinja``, where vLLM finds it; returns the file, or None when there is no template."""
    template = find_chat_template(folder) if template is None else template
    if template is None:
        return None
    path = Path(folder) / TEMPLATE_FILE
    path.write_text(vllm_chat_template(template, folder))
    return path
