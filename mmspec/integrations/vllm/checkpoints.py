"""Reading the folders the vLLM integration is handed, with clear errors before any engine starts.

Three kinds of folder take part: an mmspec draft head (``save_pretrained`` of an
:class:`~mmspec.models.vlm_drafters.base.VLMDraftHead`: ``config.json`` + safetensors), a target model
(a transformers checkpoint: ``config.json``, optionally ``tokenizer.json``) and an exported head (what
:func:`mmspec.integrations.vllm.export.export_head` writes). This module reads their JSON only, so checks
run in any environment, without torch or vLLM. Each may also be given as a Hugging Face hub id
(:func:`local_folder`), as vLLM accepts them.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: ``architectures`` entry of an exported head; vLLM keeps names that start with "Eagle" as they are.
EXPORTED_ARCHITECTURE = "EagleMmspecHeadForCausalLM"
#: version of the exported folder's ``mmspec`` config section
EXPORT_FORMAT = 1
HEAD_WEIGHTS = "diffusion_pytorch_model.safetensors"


class CheckpointError(ValueError):
    """A folder is missing, incomplete, or does not fit the other folder it is used with."""


#: ``owner/name``: how a Hugging Face hub id is spelled (a path that is no folder and looks like this is one)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def local_folder(path: str | Path, what: str = "model", argument: str = "path") -> Path:
    """The folder behind ``path``: the folder itself, or for a hub id (``owner/name``, as vLLM also accepts) its
    snapshot in the Hugging Face cache, downloaded first unless ``HF_HUB_OFFLINE`` is set.

    Raises:
        CheckpointError: neither an existing folder nor a hub id the hub (or, offline, the cache) has.
    """
    folder = Path(path)
    if folder.is_dir():
        return folder
    text = str(path)
    if not _HUB_ID.fullmatch(text):
        raise CheckpointError(f"{argument}: {what} folder {text!r} does not exist")
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(text, local_files_only=constants.HF_HUB_OFFLINE))
    except Exception as error:  # huggingface_hub raises several error types for a missing or unreachable id
        where = "the Hugging Face cache (offline)" if constants.HF_HUB_OFFLINE else "the Hugging Face hub"
        raise CheckpointError(f"{argument}: {what} {text!r} is no folder, and {where} has no model with that id "
                              f"({type(error).__name__})") from error


def _json(path: Path, argument: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{argument}: {path} is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{argument}: {path} is not valid JSON ({error})") from error
    if not isinstance(data, dict):
        raise CheckpointError(f"{argument}: {path} must hold a JSON object")
    return data


def tokenizer_fingerprint(folder: Path) -> str | None:
    """sha256 of the token -> id map of ``tokenizer.json`` (added tokens included), or None without one.

    Two tokenizers with the same fingerprint map every token to the same id, which is what a draft head needs
    of the target it drafts for (it reads token ids through the target's embedding and LM head).
    """
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = dict((data.get("model") or {}).get("vocab") or {})
    if isinstance(vocab, list):  # unigram models list [token, score] pairs
        vocab = {token: index for index, (token, _score) in enumerate(vocab)}
    for added in data.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    text = json.dumps(sorted(vocab.items(), key=lambda item: (item[1], item[0])), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TargetInfo:
    """What a draft head must agree with in a target checkpoint.

    Attributes:
        folder: the checkpoint folder.
        architecture: its first ``architectures`` entry.
        hidden_size / vocab_size: of its language model (``text_config`` for VLMs).
        tokenizer: :func:`tokenizer_fingerprint` of its ``tokenizer.json`` (None without one).
        multimodal: the config has a vision part (``vision_config``).
    """

    folder: Path
    architecture: str
    hidden_size: int
    vocab_size: int
    tokenizer: str | None
    multimodal: bool


def read_target(path: str | Path, argument: str = "target") -> TargetInfo:
    """Read a target checkpoint's config (and tokenizer fingerprint)."""
    folder = local_folder(path, "target model", argument)
    config = _json(folder / "config.json", argument)
    text = config.get("text_config") or config
    missing = [key for key in ("hidden_size", "vocab_size") if not isinstance(text.get(key), int)]
    if missing:
        raise CheckpointError(f"{argument}: {folder / 'config.json'} gives no {' / '.join(missing)} of the "
                              "language model")
    architecture = (config.get("architectures") or ["?"])[0]
    return TargetInfo(folder, architecture, text["hidden_size"], text["vocab_size"], tokenizer_fingerprint(folder),
                      "vision_config" in config)


@dataclass(frozen=True)
class HeadInfo:
    """An mmspec draft head as saved by ``save_pretrained``.

    Attributes:
        folder: the head folder.
        class_name: its ``_class_name`` (``EagleVLMHead``, ``ViSpecHead``, ...).
        config: the constructor arguments (``config.json`` without the ``_`` keys).
        weights: the safetensors file.
    """

    folder: Path
    class_name: str
    config: dict[str, Any]
    weights: Path


def read_head(path: str | Path, argument: str = "head") -> HeadInfo:
    """Read an mmspec head folder; clear errors for a missing folder, config or weights file."""
    folder = local_folder(path, "draft head", argument)
    config = _json(folder / "config.json", argument)
    if "_class_name" not in config:
        if EXPORTED_ARCHITECTURE in (config.get("architectures") or []):
            raise CheckpointError(f"{argument}: {folder} is already an exported vLLM head; pass the mmspec head "
                                  "folder it was exported from")
        raise CheckpointError(f"{argument}: {folder} is not an mmspec draft head (config.json has no _class_name)")
    weights = folder / HEAD_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{argument}: {weights} is missing (save the head with save_pretrained)")
    values = {key: value for key, value in config.items() if not key.startswith("_")}
    return HeadInfo(folder, config["_class_name"], values, weights)


def read_exported(path: str | Path, argument: str = "head") -> dict[str, Any]:
    """The ``config.json`` of an exported head folder (checked to be one, with its weights present)."""
    folder = local_folder(path, "exported head", argument)
    config = _json(folder / "config.json", argument)
    if EXPORTED_ARCHITECTURE not in (config.get("architectures") or []) or "mmspec" not in config:
        hint = " (an mmspec head folder: export it first)" if "_class_name" in config else ""
        raise CheckpointError(f"{argument}: {folder} is not an exported mmspec head for vLLM{hint}")
    if config["mmspec"].get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{argument}: {folder} was exported in format {config['mmspec'].get('format')}, "
                              f"this mmspec reads format {EXPORT_FORMAT}: export it again")
    if not (folder / "model.safetensors").is_file():
        raise CheckpointError(f"{argument}: {folder / 'model.safetensors'} is missing")
    return config


def check_head_fits_target(hidden_size: int, vocab_size: int, tokenizer: str | None, target: TargetInfo,
                           who: str = "the head") -> None:
    """Raise :class:`CheckpointError` unless a head of this width / vocabulary / tokenizer fits ``target``.

    ``tokenizer`` is the fingerprint of the tokenizer the head was exported with (None: not checked).
    """
    if hidden_size != target.hidden_size:
        raise CheckpointError(f"{who} was trained for another target: its hidden size is {hidden_size}, the language "
                              f"model of {target.folder} ({target.architecture}) has {target.hidden_size}")
    if vocab_size != target.vocab_size:
        raise CheckpointError(f"{who} was trained for another target: its vocabulary has {vocab_size} tokens, the "
                              f"language model of {target.folder} ({target.architecture}) has {target.vocab_size}")
    if tokenizer is not None and target.tokenizer is not None and tokenizer != target.tokenizer:
        raise CheckpointError(f"vocabulary mismatch: {who} was exported for a tokenizer that maps tokens to other ids "
                              f"than {target.folder / 'tokenizer.json'} (same size, different tokens)")
