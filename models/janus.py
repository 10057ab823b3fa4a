"""Janus-Pro text-to-image generation (transformers' ``JanusForConditionalGeneration``) as an AR image target.

transformers' ``JanusForConditionalGeneration.generate(..., generation_mode="image")`` runs the image-token
loop inside the model: one token per forward, classifier-free guidance on a doubled batch, the generation
head on the language model's last hidden state, then ``decode_image_tokens``. Speculative methods need to
drive that loop themselves, so this module exposes the same computation through the duck-typed target
contract of :class:`~mmspec.pipelines.ARImagePipeline` (the one :class:`~mmspec.runner.CausalLMRunner` drives):

* :class:`JanusImageGenerator` wraps the HF model. Its prefill (``condition_ids``) runs the templated prompt
  through the language model; ``condition_drop`` rows get Janus's unconditional prompt (every token
  between the first and the last one replaced by the pad token, attention unchanged). Decoding calls
  (``input_ids`` = image tokens) embed with the generation embedding + aligner and return the generation
  head's logits over the image codebook. ``.config`` carries the fields the pipeline reads.
* :class:`JanusPromptTokenizer` wraps the HF tokenizer: the Janus-Pro t2i prompt is
  ``BOS + "<|User|>: {prompt}\\n\\n<|Assistant|>:" + "<begin_of_image>"`` (the single-turn chat template of
  the HF processor, or Janus's own ``sft_format``, followed by the image start tag), left-padded with -1.
* :class:`JanusVQDecoder` wraps the VQ model (decoding, the codebook, its nearest-neighbour table).

The EAGLE head binds to :meth:`JanusImageGenerator.get_input_embeddings` (image token -> generation
embedding -> aligner, width d) and :meth:`JanusImageGenerator.get_output_embeddings` (the generation head,
an MLP ``d -> d -> V``); it drafts in the language model's final-norm feature space, the features the
generation head reads (``hidden_states[-1]`` of every call).

Example::

    >>> from mmspec.models.janus import load_janus_components
    >>> from mmspec.pipelines import ARImagePipeline
    >>> pipe = ARImagePipeline(**load_janus_components("deepseek-community/Janus-Pro-1B", dtype=torch.bfloat16))
    >>> out = pipe("a red apple on a table", method="sjd", guidance_scale=5.0)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers.configuration_utils import ConfigMixin
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from mmspec.files import write_text_atomic
from mmspec.neighbors import nearest_neighbors
from mmspec.validation import check_ndim, checks_enabled

JANUS_PROMPT_TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:"  # HF Janus chat template, one user turn
JANUS_BOI_TOKEN = "<begin_of_image>"  # the image start tag when the tokenizer does not name one (boi_token)
DEFAULT_MAX_PROMPT_LENGTH = 256  # templated prompt tokens (BOS .. BOI) a JanusImageGenerator accepts
CLASS_DROPOUT_PROB = 0.1  # Janus-Pro trains with 10% unconditional prompts; here it only enables guidance
SETTINGS_FILE = "mmspec_janus.json"  # the adapter's own settings next to the HF checkpoint files


@dataclass
class JanusImageOutput:
    """Output of :meth:`JanusImageGenerator.forward`.

    Attributes:
        logits: ``[B, T, V]`` generation-head logits over the image codebook (position t predicts the image
            token after slot t).
        past_key_values: the language model's cache after this call (None when ``use_cache=False``).
        hidden_states: when asked, a one-element tuple: the language model's final-norm features
            ``[B, T, d]`` (what the generation head reads and EAGLE heads draft).
    """

    logits: torch.Tensor
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class JanusImageTokenEmbedding(nn.Module):
    """Image token ids -> language-model inputs: ``generation_aligner(generation_embeddings(ids))`` (width d).

    The same computation as ``JanusForConditionalGeneration.prepare_embeddings_for_image_generation``; a view
    over the wrapped model's modules (it owns no parameters of its own).
    """

    def __init__(self, janus: nn.Module) -> None:
        super().__init__()
        self.embeddings = janus.model.generation_embeddings
        self.aligner = janus.model.generation_aligner
        self.num_embeddings = self.embeddings.num_embeddings
        self.embedding_dim = janus.config.text_config.hidden_size

    def forward(self, image_tokens: torch.Tensor) -> torch.Tensor:
        return self.aligner(self.embeddings(image_tokens))


class JanusImageHead(nn.Module):
    """The generation head (``proj_out -> GELU -> vision_head``): features ``[..., d]`` -> logits ``[..., V]``.

    ``weight`` is the last layer's weight ``[V, d]`` (in a valid Janus config the head's inner width equals
    the language model's width d). Callers read its shape, dtype and device (vocabulary size, feature width);
    the logits are *not* ``h @ weight.T``: always call the module.
    """

    def __init__(self, janus: nn.Module) -> None:
        super().__init__()
        self.head = janus.model.generation_head
        self.in_features = self.head.proj_out.in_features
        self.out_features = self.head.vision_head.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.head.vision_head.weight

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)


def _check_janus_model(model: Any) -> None:
    """The wrapped object must be a Janus model whose generation path fits together (widths)."""
    from transformers import JanusForConditionalGeneration

    if not isinstance(model, JanusForConditionalGeneration):
        raise ValueError(f"model must be a transformers JanusForConditionalGeneration, got {type(model).__name__}")
    config = model.config
    width = config.text_config.hidden_size
    vq = config.vq_config
    if vq.projection_dim != width or vq.image_token_embed_dim != width:
        raise ValueError(f"inconsistent Janus config: the generation aligner/head widths (projection_dim="
                         f"{vq.projection_dim}, image_token_embed_dim={vq.image_token_embed_dim}) must equal the "
                         f"language model's hidden_size={width}")


def _janus_pad_token_id(model: Any) -> int:
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config.text_config, "pad_token_id", None)
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    if pad is None:
        raise ValueError("the Janus checkpoint names no pad token (generation_config.pad_token_id or "
                         "text_config.pad_token_id): Janus's unconditional prompt is made of pad tokens")
    return int(pad)


def _is_local(path: str) -> bool:
    return os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path) or path.count("/") != 1


HUB_KWARGS = ("revision", "cache_dir", "token", "local_files_only", "subfolder", "force_download", "proxies")


def _checkpoint_model_type(path: str, what: str, kwargs: dict[str, Any]) -> str | None:
    """``model_type`` of the checkpoint's ``config.json``; a local path must be a folder that has one.

    Raises:
        FileNotFoundError: a local path that is not a folder with ``config.json``.
        OSError: a hub id whose config cannot be fetched (offline, unknown id).
    """
    from transformers import PretrainedConfig

    if _is_local(path):
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"{what}: no folder {folder} (pass a local Janus checkpoint folder or a hub id "
                                    f"such as 'deepseek-community/Janus-Pro-1B')")
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{what}: {folder} has no config.json, so it is not a transformers checkpoint")
    hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    try:
        config, _ = PretrainedConfig.get_config_dict(path, **hub)
    except (OSError, ValueError) as error:
        raise OSError(f"{what}: could not read a config from {path!r}: {error}") from error
    return config.get("model_type")


class JanusImageGenerator(ModelMixin, ConfigMixin):
    """A Janus-Pro model as the target of :class:`~mmspec.pipelines.ARImagePipeline`.

    Args:
        model: a transformers ``JanusForConditionalGeneration`` (any dtype/device).
        max_prompt_length: templated prompt tokens (``BOS .. <begin_of_image>``) the pipeline reserves per row
            (``config.cls_token_num``): prompts are left-padded to it and longer ones are refused.

    ``config`` (read by the pipeline): ``vocab_size`` (image codebook size), ``block_size`` (image tokens,
    ``num_patches ** 2`` of the VQ model), ``model_type="t2i"``, ``cls_token_num``, ``text_vocab_size``,
    ``class_dropout_prob`` (> 0: guidance allowed), plus ``hidden_size``, ``pad_token_id``, ``image_size``.
    """

    def __init__(self, model: Any, max_prompt_length: int = DEFAULT_MAX_PROMPT_LENGTH) -> None:
        super().__init__()
        _check_janus_model(model)
        if not isinstance(max_prompt_length, int) or isinstance(max_prompt_length, bool) or max_prompt_length < 2:
            raise ValueError(f"max_prompt_length must be an integer >= 2 (BOS and <begin_of_image>), got "
                             f"{max_prompt_length!r}")
        config = model.config
        grid = int(config.vq_config.num_patches)
        limit = getattr(config.text_config, "max_position_embeddings", None)
        if limit is not None and max_prompt_length + grid * grid > limit:
            raise ValueError(f"max_prompt_length={max_prompt_length} plus {grid * grid} image tokens exceeds the "
                             f"language model's max_position_embeddings={limit}")
        self.model = model
        upsample = 2 ** (len(config.vq_config.channel_multiplier) - 1)
        self.register_to_config(
            vocab_size=int(config.vq_config.num_embeddings), block_size=grid * grid, model_type="t2i",
            cls_token_num=max_prompt_length, max_prompt_length=max_prompt_length,
            text_vocab_size=int(config.text_config.vocab_size), class_dropout_prob=CLASS_DROPOUT_PROB,
            hidden_size=int(config.text_config.hidden_size), pad_token_id=_janus_pad_token_id(model),
            image_size=grid * upsample)
        # views over the model's own modules, kept out of the module tree (no duplicate parameters)
        self._views = {"embed": JanusImageTokenEmbedding(model), "head": JanusImageHead(model)}
        self.train(model.training)  # the wrapper's mode is the wrapped model's

    # -- loading and saving ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, max_prompt_length: int | None = None,
                        **kwargs: Any) -> JanusImageGenerator:
        """Load a Janus checkpoint (a local folder or a hub id such as ``deepseek-community/Janus-Pro-1B``).

        Args:
            max_prompt_length: see the class; default: the value saved by :meth:`save_pretrained`, else
                ``DEFAULT_MAX_PROMPT_LENGTH``.
            kwargs: passed to ``JanusForConditionalGeneration.from_pretrained`` (``dtype``, ``revision``,
                ``device_map``, ...). ``torch_dtype`` is accepted as an alias of ``dtype``.
        Raises:
            FileNotFoundError: a local path that is not a folder with ``config.json``.
            ValueError: a checkpoint of another model type.
        """
        from transformers import JanusForConditionalGeneration

        path = os.fspath(pretrained_model_name_or_path)
        if "torch_dtype" in kwargs:
            kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
        model_type = _checkpoint_model_type(path, "JanusImageGenerator.from_pretrained", kwargs)
        if model_type != "janus":
            raise ValueError(f"{path!r} holds a {model_type!r} checkpoint, not Janus (model_type 'janus')")
        if max_prompt_length is None:
            settings = Path(path) / SETTINGS_FILE
            max_prompt_length = json.loads(settings.read_text())["max_prompt_length"] if settings.is_file() \
                else DEFAULT_MAX_PROMPT_LENGTH
        model = JanusForConditionalGeneration.from_pretrained(path, **kwargs)
        return cls(model.eval(), max_prompt_length=max_prompt_length)

    def load_text_tokenizer(self, folder: str | os.PathLike) -> JanusPromptTokenizer:
        """The prompt tokenizer saved beside this model in a pipeline folder (the hook
        :class:`~mmspec.pipelines.ARImagePipeline` calls when loading a saved Janus pipeline)."""
        return JanusPromptTokenizer.from_pretrained(folder, max_length=self.config.cls_token_num)

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write a transformers Janus checkpoint (``config.json`` + weights) and ``mmspec_janus.json``
        (``max_prompt_length``); ``kwargs`` go to the HF ``save_pretrained``."""
        os.makedirs(save_directory, exist_ok=True)
        self.model.save_pretrained(save_directory, **kwargs)
        settings = {"max_prompt_length": self.config.max_prompt_length}
        write_text_atomic(Path(save_directory) / SETTINGS_FILE, json.dumps(settings, indent=1))

    # -- the target contract --------------------------------------------------------------------------
    @property
    def language_model(self) -> nn.Module:
        return self.model.model.language_model

    def get_input_embeddings(self) -> JanusImageTokenEmbedding:
        """Image token ids -> language-model input embeddings ``[..., d]`` (generation embedding + aligner)."""
        return self._views["embed"]

    def get_output_embeddings(self) -> JanusImageHead:
        """The generation head: features ``[..., d]`` -> image logits ``[..., V]``."""
        return self._views["head"]

    def new_cache(self, batch_size: int) -> Any:
        """An empty transformers ``DynamicCache`` for the language model (rolled back by :mod:`mmspec.cache`)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config.text_config)

    def prompt_ids(self, condition_ids: torch.Tensor, condition_drop: torch.Tensor | None = None) -> torch.Tensor:
        """Text token ids ``[B, C]`` fed to the language model: ``-1`` padding becomes the pad token and
        ``condition_drop`` rows become Janus's unconditional prompt (tokens strictly between each row's first
        and last real token replaced by the pad token; for a templated prompt the BOS and the image start tag
        stay, as in transformers' and DeepSeek's Janus generation code)."""
        check_ndim(condition_ids, 2, "condition_ids", "[B, C]")
        if condition_ids.is_floating_point() or condition_ids.dtype == torch.bool:
            raise ValueError(f"condition_ids must be integer token ids, got {condition_ids.dtype}")
        batch, length = condition_ids.shape
        if length > self.config.cls_token_num:
            raise ValueError(f"condition_ids has {length} prompt slots; this JanusImageGenerator takes at most "
                             f"max_prompt_length={self.config.cls_token_num}")
        ids = condition_ids.to(self.device)
        valid = ids >= 0  # [B, C]
        if checks_enabled() and ids.numel():
            if int(ids.max()) >= self.config.text_vocab_size or int(ids.min()) < -1:
                raise ValueError(f"condition_ids has ids outside [-1, {self.config.text_vocab_size}) (min "
                                 f"{int(ids.min())}, max {int(ids.max())})")
            if not bool(valid.any(-1).all()):
                raise ValueError("a row of condition_ids has no token (only -1 padding)")
        ids = ids.masked_fill(~valid, self.config.pad_token_id)
        if condition_drop is not None:
            if not isinstance(condition_drop, torch.Tensor) or tuple(condition_drop.shape) != (batch,) \
                    or condition_drop.dtype != torch.bool:
                raise ValueError(f"condition_drop must be a bool tensor [B] = [{batch}], got "
                                 f"{getattr(condition_drop, 'shape', condition_drop)!r}")
            slots = torch.arange(length, device=ids.device)
            first = valid.long().argmax(-1, keepdim=True)  # [B, 1] first real slot
            last = length - 1 - valid.flip(-1).long().argmax(-1, keepdim=True)  # [B, 1] last real slot
            inner = (slots > first) & (slots < last) & condition_drop.to(ids.device).unsqueeze(-1)  # [B, C]
            ids = ids.masked_fill(inner, self.config.pad_token_id)
        return ids

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None, use_cache: bool = True,
                output_hidden_states: bool = False, condition_ids: torch.Tensor | None = None,
                condition_drop: torch.Tensor | None = None) -> JanusImageOutput:
        """Prefill (a templated text prompt) or decode (image tokens) T new slots after S cached ones.

        Args:
            input_ids: image tokens ``[B, T]`` (decoding); None for the prefill.
            attention_mask: 2-D ``[B, S+T]`` key mask or 4-D bool ``[B, 1, T, S+T]`` visibility (draft trees),
                as the language model takes them.
            position_ids: ``[B, T]`` (the runner counts real slots only, as Janus's generate does).
            past_key_values: a ``DynamicCache`` (:meth:`new_cache`); started when None and ``use_cache``.
            condition_ids: prefill: templated prompt ids ``[B, C]`` left-padded with -1
                (:class:`JanusPromptTokenizer`); condition_drop: bool ``[B]``, rows that get the unconditional
                prompt (classifier-free guidance).
        Returns:
            :class:`JanusImageOutput`; the prefill's last logits predict the first image token.
        """
        if condition_ids is not None:
            if input_ids is not None:
                raise ValueError("pass either input_ids (image tokens) or condition_ids (the prompt), not both")
            embeds = self.model.get_input_embeddings()(self.prompt_ids(condition_ids, condition_drop))  # [B, C, d]
        else:
            if condition_drop is not None:
                raise ValueError("condition_drop selects unconditional prompt rows: it needs condition_ids")
            if input_ids is None:
                raise ValueError("pass input_ids (image tokens [B, T]) or condition_ids (the prompt [B, C])")
            check_ndim(input_ids, 2, "input_ids", "[B, T]")
            if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
                raise ValueError(f"input_ids must be integer image token ids, got {input_ids.dtype}")
            if checks_enabled() and input_ids.numel() and \
                    (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
                raise ValueError(f"input_ids has image token ids outside [0, {self.config.vocab_size}) (min "
                                 f"{int(input_ids.min())}, max {int(input_ids.max())})")
            embeds = self.get_input_embeddings()(input_ids.to(self.device))  # [B, T, d]
        if past_key_values is None and use_cache:
            past_key_values = self.new_cache(embeds.shape[0])
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        if position_ids is not None:
            position_ids = position_ids.to(self.device)
        out = self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_values=past_key_values, use_cache=use_cache)
        features = out.last_hidden_state  # [B, T, d], after the final norm
        logits = self.get_output_embeddings()(features)  # [B, T, V]
        return JanusImageOutput(logits, out.past_key_values if use_cache else None,
                                (features,) if output_hidden_states else None)


class JanusPromptTokenizer:
    """The ``text_tokenizer`` of an :class:`~mmspec.pipelines.ARImagePipeline` over a Janus HF tokenizer.

    ``encode(text)`` gives the ids of Janus-Pro's t2i prompt: BOS (when the tokenizer has one), then
    ``template.format(prompt=text.strip())`` and the image start tag, tokenized without other special tokens.
    Ids are the HF tokenizer's; ``batch`` left-pads with -1 and never truncates (cutting the prompt would drop
    the image start tag).

    Args:
        tokenizer: a transformers tokenizer (Janus-Pro's, or any with the image start tag in its vocabulary).
        max_length: the most templated tokens a prompt may have (the generator's ``max_prompt_length``);
            None: only ``batch``'s ``length`` limits it.
        template: the text around the prompt (``{prompt}`` marks it).
        boi_token: the image start tag; default: ``tokenizer.boi_token`` or ``"<begin_of_image>"``.
    """

    def __init__(self, tokenizer: Any, max_length: int | None = DEFAULT_MAX_PROMPT_LENGTH,
                 template: str = JANUS_PROMPT_TEMPLATE, boi_token: str | None = None) -> None:
        if "{prompt}" not in template:
            raise ValueError(f"template must contain '{{prompt}}', got {template!r}")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
            raise ValueError(f"max_length must be an integer >= 2 or None, got {max_length!r}")
        self.tokenizer, self.max_length, self.template = tokenizer, max_length, template
        self.boi_token = boi_token or getattr(tokenizer, "boi_token", None) or JANUS_BOI_TOKEN
        boi = tokenizer.convert_tokens_to_ids(self.boi_token)
        if boi is None or boi == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no image start token {self.boi_token!r} (is it a Janus tokenizer?)")
        self.boi_token_id = int(boi)
        self.bos_token_id = tokenizer.bos_token_id

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, max_length: int | None = None,
                        **kwargs: Any) -> JanusPromptTokenizer:
        """``AutoTokenizer.from_pretrained(path_or_id)`` wrapped; ``max_length`` defaults to the folder's saved
        ``max_prompt_length`` (``mmspec_janus.json``) or ``DEFAULT_MAX_PROMPT_LENGTH``."""
        from transformers import AutoTokenizer

        path = os.fspath(pretrained_model_name_or_path)
        _check_checkpoint_tokenizer(path)
        if max_length is None:
            settings = Path(path) / SETTINGS_FILE
            max_length = json.loads(settings.read_text())["max_prompt_length"] if settings.is_file() \
                else DEFAULT_MAX_PROMPT_LENGTH
        template = kwargs.pop("template", JANUS_PROMPT_TEMPLATE)
        boi_token = kwargs.pop("boi_token", None)
        return cls(AutoTokenizer.from_pretrained(path, **kwargs), max_length, template, boi_token)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def format(self, text: str) -> str:
        """The templated prompt string (without BOS)."""
        return self.template.format(prompt=text.strip()) + self.boi_token

    def encode(self, text: str) -> list[int]:
        """Templated prompt ids ``[BOS, ..., <begin_of_image>]``.

        Raises:
            ValueError: not a string, an empty prompt, words the tokenizer maps to its unknown token, or more
                than ``max_length`` tokens.
        """
        if not isinstance(text, str):
            raise ValueError(f"a prompt must be a string, got {type(text).__name__}")
        if not text.strip():
            raise ValueError("the prompt is empty")
        ids = self.tokenizer(self.format(text), add_special_tokens=False)["input_ids"]
        if self.bos_token_id is not None:
            ids = [int(self.bos_token_id), *ids]
        unk = self.tokenizer.unk_token_id
        if unk is not None and unk in ids:
            raise ValueError(f"the prompt has text the tokenizer cannot represent (unknown token {unk}): {text!r}")
        if self.max_length is not None and len(ids) > self.max_length:
            raise ValueError(f"the templated prompt has {len(ids)} tokens; at most max_length={self.max_length} fit "
                             f"(load the JanusImageGenerator and this tokenizer with a larger max_prompt_length)")
        return ids

    def batch(self, texts: list[str], length: int) -> torch.Tensor:
        """Templated prompt ids ``[B, length]``, left-padded with -1 (the pipeline's condition layout).

        Raises:
            ValueError: a prompt longer than ``length`` tokens (it is not truncated).
        """
        out = torch.full((len(texts), length), -1, dtype=torch.long)
        for b, text in enumerate(texts):
            ids = self.encode(text)
            if len(ids) > length:
                raise ValueError(f"prompt {b} has {len(ids)} templated tokens, more than the {length} prompt slots")
            out[b, length - len(ids):] = torch.tensor(ids, dtype=torch.long)
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Save the HF tokenizer (``save_pretrained``) and, when ``max_length`` is set, ``mmspec_janus.json``
        (``max_prompt_length``); reload with :meth:`from_pretrained`.

        ``path`` is a folder; a path ending in ``.json`` (what :meth:`ARImagePipeline.save_pretrained` passes:
        ``transformer/text_vocab.json``) saves into the folder that contains it, which makes the pipeline's
        ``transformer/`` folder a complete Janus checkpoint (model and tokenizer).
        """
        folder = Path(path)
        if folder.suffix == ".json":
            folder = folder.parent
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(os.fspath(folder))
        if self.max_length is not None:
            settings = folder / SETTINGS_FILE
            saved = json.loads(settings.read_text()) if settings.is_file() else {}
            write_text_atomic(settings, json.dumps({**saved, "max_prompt_length": self.max_length}, indent=1))


def _check_checkpoint_tokenizer(path: str) -> None:
    if _is_local(path) and not Path(path).expanduser().is_dir():
        raise FileNotFoundError(f"JanusPromptTokenizer.from_pretrained: no folder {path}")


class JanusVQDecoder(ModelMixin, ConfigMixin):
    """Janus's VQ model as the pipeline's ``vqvae``: token grids -> images in [0, 1], and its codebook.

    Args:
        vqmodel: a transformers ``JanusVQVAE`` (``janus.model.vqmodel``; shared, not copied, by
            :meth:`from_generator`).
    """

    def __init__(self, vqmodel: Any) -> None:
        super().__init__()
        from transformers.models.janus.modeling_janus import JanusVQVAE

        if not isinstance(vqmodel, JanusVQVAE):
            raise ValueError(f"vqmodel must be a transformers JanusVQVAE, got {type(vqmodel).__name__}")
        self.vqmodel = vqmodel
        config = vqmodel.config
        grid = int(config.num_patches)
        self.register_to_config(codebook_size=int(config.num_embeddings), grid_size=grid,
                                image_size=grid * 2 ** (len(config.channel_multiplier) - 1))
        self.train(vqmodel.training)

    @classmethod
    def from_generator(cls, generator: JanusImageGenerator) -> JanusVQDecoder:
        """The VQ model of a loaded :class:`JanusImageGenerator` (same modules, no copy)."""
        return cls(generator.model.model.vqmodel)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> JanusVQDecoder:
        """Load a folder written by :meth:`save_pretrained` (a ``JanusVQVAE`` checkpoint) or, from a full Janus
        checkpoint (``model_type`` 'janus'), its VQ model."""
        from transformers.models.janus.modeling_janus import JanusVQVAE

        path = os.fspath(pretrained_model_name_or_path)
        if "torch_dtype" in kwargs:
            kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
        model_type = _checkpoint_model_type(path, "JanusVQDecoder.from_pretrained", kwargs)
        if model_type == "janus":
            return cls.from_generator(JanusImageGenerator.from_pretrained(path, **kwargs))
        if model_type != "janus_vqgan":
            raise ValueError(f"{path!r} holds a {model_type!r} checkpoint, not a Janus VQ model")
        return cls(JanusVQVAE.from_pretrained(path, **kwargs).eval())

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """Write the ``JanusVQVAE`` as a transformers checkpoint."""
        os.makedirs(save_directory, exist_ok=True)
        self.vqmodel.save_pretrained(save_directory, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.config.codebook_size

    def codebook_embeddings(self) -> torch.Tensor:
        """``[V, embed_dim]`` codebook entries as the decoder sees them (L2-normalised, as Janus's
        ``get_codebook_entry`` does)."""
        return nn.functional.normalize(self.vqmodel.quantize.embedding.weight.detach(), p=2, dim=-1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token grid ``[B, h, w]`` -> images ``[B, 3, H, W]`` in [0, 1] (``decode_image_tokens`` rescaled from
        Janus's [-1, 1] as its image processor does, clamped)."""
        grid = self.config.grid_size
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 3 or tokens.is_floating_point() \
                or tuple(tokens.shape[1:]) != (grid, grid):
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be an integer token grid [B, {grid}, {grid}], got {got}")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"tokens has ids outside [0, {self.vocab_size}) (min {int(tokens.min())}, max "
                             f"{int(tokens.max())})")
        device = self.vqmodel.quantize.embedding.weight.device
        pixels = self.vqmodel.decode(tokens.reshape(tokens.shape[0], -1).to(device))  # [B, 3, H, W] in ~[-1, 1]
        return ((pixels.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def codebook_neighbors(self, k: int, chunk: int = 1024) -> torch.Tensor:
        """The k nearest OTHER codebook entries of every entry (L2 between :meth:`codebook_embeddings`),
        nearest first: LongTensor ``[V, k]``; equally distant entries by index
        (:func:`~mmspec.neighbors.nearest_neighbors`, float64, ``chunk`` rows at a time)."""
        return nearest_neighbors(self.codebook_embeddings(), k, chunk)


def load_janus_components(pretrained_model_name_or_path: str | os.PathLike,
                          max_prompt_length: int = DEFAULT_MAX_PROMPT_LENGTH, **kwargs: Any) -> dict[str, Any]:
    """``transformer``, ``vqvae`` and ``text_tokenizer`` of a Janus checkpoint, ready for
    ``ARImagePipeline(**components, eagle_head=...)``; ``kwargs`` go to the model's ``from_pretrained``."""
    generator = JanusImageGenerator.from_pretrained(pretrained_model_name_or_path, max_prompt_length, **kwargs)
    hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    tokenizer = JanusPromptTokenizer.from_pretrained(pretrained_model_name_or_path, max_length=max_prompt_length, **hub)
    return {"transformer": generator, "vqvae": JanusVQDecoder.from_generator(generator), "text_tokenizer": tokenizer}
