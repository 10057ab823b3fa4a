"""ImageReward scores through the ``image-reward`` package, with local weights.

ImageReward (Xu et al. 2023, https://github.com/THUDM/ImageReward) is a BLIP ViT-L/16 image encoder
and a BERT text encoder with cross-attention, followed by an MLP head; the score of a (prompt, image)
pair is the head's output standardised with the training set's mean/std (0 = average image).

Loading needs three local files, since nothing can be downloaded here:

* ``weights``: the checkpoint ``ImageReward.pt`` (state dict) or a ``.safetensors`` file;
* ``med_config``: ``med_config.json`` (the BERT configuration, from the same hub repo);
* ``tokenizer``: a folder with the ``bert-base-uncased`` tokenizer files (``vocab.txt`` ...).

Command line::

    python -m mmspec.evaluation.imagereward FOLDER [--prompts FILE] --weights ImageReward.pt
        --med-config med_config.json --tokenizer bert-base-uncased/ [--output ir.json]
        [--per-image ir_per_image.jsonl] [--device cpu]

Compatibility with this project's transformers (5.x): image-reward 1.5 was written for transformers
4.2x. Its BERT imports ``apply_chunking_to_forward``, ``find_pruneable_heads_and_indices`` and
``prune_linear_layer`` from ``transformers.modeling_utils`` (gone since 4.56), calls the removed
``PreTrainedModel.invert_attention_mask`` / ``get_head_mask``, never sets the ``all_tied_weights_keys``
that transformers 5's ``init_weights`` reads, and its tokenizer set-up reads the removed
``additional_special_tokens_ids``. :func:`_install_transformers_shims` supplies those few helpers
(reimplemented here with the behaviour of their transformers 4 versions) before the package is imported;
on a transformers that still has them, nothing is replaced. The package also calls
``warnings.filterwarnings("ignore")`` at import, which would silence every warning in the process; the
import below restores the warning filters afterwards. Environment problems (torchvision on a CPU
torch, the timm pin, the undeclared ``openai-clip`` dependency) are handled by
``scripts/setup_extras.sh``, not here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from .files import load_prompt_pairs, open_rgb
from .pair_scores import PerImageResult, add_output_arguments, check_pairs, with_progress, write_outputs

INSTALL_HINT = (
    "ImageReward scoring needs the image-reward package and its undeclared dependencies: "
    "pip install -c requirements/constraints.txt 'image-reward==1.5' openai-clip 'setuptools<81' "
    "(or run bash scripts/setup_extras.sh, which also makes torchvision importable on a CPU-only torch)"
)


# ----------------------------------------------------------------------------------------------
# transformers 5 compatibility (see the module docstring for why each helper is needed)
# ----------------------------------------------------------------------------------------------


def _find_pruneable_heads_and_indices(heads, n_heads: int, head_size: int, already_pruned_heads):
    """Heads still to prune (set) and the flat indices of the dimensions to keep (transformers 4 helper)."""
    mask = torch.ones(n_heads, head_size)
    heads = set(heads) - set(already_pruned_heads)
    for head in heads:
        head = head - sum(1 if h < head else 0 for h in already_pruned_heads)
        mask[head] = 0
    mask = mask.view(-1).contiguous().eq(1)
    index = torch.arange(len(mask))[mask].long()
    return heads, index


def _invert_attention_mask(self, encoder_attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] or [B, S, S] mask of ones/zeros -> additive mask broadcastable over heads (0 / dtype min)."""
    if encoder_attention_mask.dim() == 3:
        extended = encoder_attention_mask[:, None, :, :]
    else:
        extended = encoder_attention_mask[:, None, None, :]
    extended = extended.to(dtype=self.dtype)
    return (1.0 - extended) * torch.finfo(self.dtype).min


def _get_head_mask(self, head_mask, num_hidden_layers: int, is_attention_chunked: bool = False):
    """None -> [None] * layers; otherwise a [layers, B, heads, S, S]-broadcastable mask (transformers 4)."""
    if head_mask is None:
        return [None] * num_hidden_layers
    if head_mask.dim() == 1:
        head_mask = head_mask[None, None, :, None, None].expand(num_hidden_layers, -1, -1, -1, -1)
    elif head_mask.dim() == 2:
        head_mask = head_mask[:, None, :, None, None]
    head_mask = head_mask.to(dtype=self.dtype)
    if is_attention_chunked:
        head_mask = head_mask.unsqueeze(-1)
    return head_mask


def _install_transformers_shims() -> None:
    """Put back the transformers 4 helpers image-reward 1.5 imports from ``transformers.modeling_utils``."""
    import transformers.modeling_utils as modeling_utils
    import transformers.pytorch_utils as pytorch_utils

    for name in ("apply_chunking_to_forward", "prune_linear_layer"):
        if not hasattr(modeling_utils, name) and hasattr(pytorch_utils, name):
            setattr(modeling_utils, name, getattr(pytorch_utils, name))
    if not hasattr(modeling_utils, "find_pruneable_heads_and_indices"):
        modeling_utils.find_pruneable_heads_and_indices = _find_pruneable_heads_and_indices


def _patch_blip_bert(med_module) -> None:
    """Methods and attributes transformers 5 dropped from PreTrainedModel, on image-reward's own BERT."""
    cls = med_module.BertPreTrainedModel
    if not hasattr(cls, "invert_attention_mask"):
        cls.invert_attention_mask = _invert_attention_mask
    if not hasattr(cls, "get_head_mask"):
        cls.get_head_mask = _get_head_mask
    if "all_tied_weights_keys" not in cls.__dict__:
        # The encoder has no LM head, so nothing is tied; transformers 5's init_weights reads this
        # attribute, which only post_init() sets, and this BERT calls init_weights() directly.
        cls.all_tied_weights_keys = {}


def import_imagereward():
    """Import the ``ImageReward`` package with the shims in place; returns (ImageReward module, med module)."""
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    _install_transformers_shims()
    # catch_warnings restores the process's warning filters afterwards: the package's global
    # filterwarnings("ignore") must not leak, and openai-clip's pkg_resources deprecation is noise here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import importlib

            # The package re-exports the class under the submodule's name, so fetch the module itself.
            ir_module = importlib.import_module("ImageReward.ImageReward")
            from ImageReward.models.BLIP import blip_pretrain, med
        except ImportError as err:
            raise ImportError(f"{INSTALL_HINT}. Import failed with: {err}") from err
        except RuntimeError as err:  # e.g. torchvision's operator registration on a CPU torch
            raise ImportError(f"{INSTALL_HINT}. Import failed with: {err}") from err
    _patch_blip_bert(med)
    return ir_module, blip_pretrain


# ----------------------------------------------------------------------------------------------
# Building the model
# ----------------------------------------------------------------------------------------------


def load_bert_tokenizer(path: str | os.PathLike):
    """BLIP's BERT tokenizer from a local folder, with the [DEC]/[ENC] tokens BLIP adds.

    transformers 5 returns an empty tokenizer instead of failing when the files are missing, so the
    vocabulary is checked explicitly.
    """
    from transformers import BertTokenizer

    path = Path(path)
    if not path.is_dir() or not (path / "vocab.txt").is_file():
        raise FileNotFoundError(
            f"tokenizer: expected a folder with the bert-base-uncased tokenizer (vocab.txt), got {path}"
        )
    tokenizer = BertTokenizer.from_pretrained(str(path))
    # transformers 5 adds [CLS]/[SEP]/... on top of whatever it read, so count the file's own vocabulary.
    if tokenizer.vocab_size < 5 or tokenizer.cls_token_id is None or tokenizer.sep_token_id is None:
        raise ValueError(
            f"tokenizer: {path} gave an empty or incomplete BERT tokenizer ({tokenizer.vocab_size} tokens in vocab.txt)"
        )
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    tokenizer.enc_token_id = tokenizer.convert_tokens_to_ids("[ENC]")
    return tokenizer


def build_imagereward(
    med_config: str | os.PathLike,
    tokenizer: str | os.PathLike,
    device: str = "cpu",
    vision: str | dict = "large",
):
    """An ``ImageReward.ImageReward`` model with random weights (load a state dict into it afterwards).

    Args:
        med_config: the BERT configuration file (``med_config.json``). Its ``hidden_size`` must be 768:
            image-reward hard-codes ``MLP(768)`` for the head.
        tokenizer: folder of the bert-base-uncased tokenizer.
        vision: ``"large"`` (ViT-L/16, the released model) or ``"base"``, or a dict of
            ``VisionTransformer`` keyword arguments (``embed_dim``, ``depth``, ``num_heads``,
            ``patch_size``) for a small test model; the image size stays 224.
    """
    import json

    ir_module, blip_pretrain = import_imagereward()
    med_config = Path(med_config)
    if not med_config.is_file():
        raise FileNotFoundError(f"med_config: no such file: {med_config}")
    hidden = json.loads(med_config.read_text()).get("hidden_size")
    if hidden != 768:
        raise ValueError(f"med_config: hidden_size must be 768 (image-reward hard-codes MLP(768)), got {hidden}")
    bert_tokenizer = load_bert_tokenizer(tokenizer)
    vocab = json.loads(med_config.read_text()).get("vocab_size", 0)
    if len(bert_tokenizer) > vocab:
        raise ValueError(
            f"tokenizer: {len(bert_tokenizer)} tokens (with [DEC]/[ENC]) do not fit the vocab_size {vocab} "
            f"of {med_config}"
        )

    def make_vit(vit, image_size, use_grad_checkpointing=False, ckpt_layer=0, drop_path_rate=0):
        from ImageReward.models.BLIP.vit import VisionTransformer

        kwargs = dict(vision)
        width = kwargs.setdefault("embed_dim", 32)
        kwargs.setdefault("depth", 1)
        kwargs.setdefault("num_heads", 2)
        kwargs.setdefault("patch_size", 32)
        return VisionTransformer(img_size=image_size, **kwargs), width

    patches = [contextlib.nullcontext()]
    if isinstance(vision, dict):
        patches.append(_patched(blip_pretrain, "create_vit", make_vit))
    elif vision not in ("large", "base"):
        raise ValueError(f"vision must be 'large', 'base' or a dict of VisionTransformer arguments, got {vision!r}")
    patches.append(_patched(blip_pretrain, "init_tokenizer", lambda: bert_tokenizer))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        if vision == "base":
            # ImageReward.__init__ asks for vit='large'; route it to 'base' for this one call.
            original = blip_pretrain.create_vit
            stack.enter_context(_patched(blip_pretrain, "create_vit", lambda vit, *a, **k: original("base", *a, **k)))
        model = ir_module.ImageReward(med_config=str(med_config), device=device)
    return model.to(device).eval()


@contextlib.contextmanager
def _patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def load_state_dict_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or a torch checkpoint (``{"state_dict": ...}`` unwrapped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights: ImageReward weights file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"weights: {path} does not hold a state dict")
    return state


class ImageRewardScorer:
    """Scores (prompt, image) pairs with ImageReward.

    Args:
        weights: checkpoint file (``ImageReward.pt`` or ``.safetensors``).
        med_config: ``med_config.json``.
        tokenizer: bert-base-uncased tokenizer folder.
        device: torch device.
        vision: see :func:`build_imagereward` (``"large"`` for the released model).
    """

    def __init__(self, weights: str | os.PathLike, med_config: str | os.PathLike, tokenizer: str | os.PathLike,
                 device: str = "cpu", vision: str | dict = "large"):
        state = load_state_dict_file(weights)  # check the file before the (slow) model build
        self.model = build_imagereward(med_config, tokenizer, device=device, vision=vision)
        result = self.model.load_state_dict(state, strict=False)
        expected = set(self.model.state_dict())
        missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
        if len(missing) > 0.05 * len(expected) or not (expected & set(state)):
            raise ValueError(
                f"weights: {weights} does not match the ImageReward architecture "
                f"({len(missing)} of {len(expected)} parameters missing, e.g. {missing[:3]})"
            )
        self.missing_keys = missing
        self.weights = str(weights)
        self.device = device

    @torch.no_grad()
    def score(self, images: Sequence[Image.Image], prompts: Sequence[str], progress: bool = False) -> list[float]:
        """One standardised reward per (image, prompt) pair."""
        images, prompts = check_pairs(images, prompts)
        pairs = with_progress(list(zip(images, prompts)), progress, "ImageReward", "img")
        return [float(self.model.score(prompt, image.convert("RGB"))) for image, prompt in pairs]


@dataclass
class ImageRewardResult(PerImageResult):
    image_reward: float  # mean over pairs
    std: float
    num_pairs: int
    weights: str
    per_image: list[dict[str, Any]] = field(default_factory=list, repr=False)


def compute_imagereward(folder: str | os.PathLike, prompts: str | os.PathLike | None = None, *,
                        scorer: ImageRewardScorer | None = None, weights=None, med_config=None, tokenizer=None,
                        device: str = "cpu", progress: bool = False) -> ImageRewardResult:
    """Mean ImageReward of the images in ``folder`` against their prompts (layouts: see clip_score)."""
    pairs = load_prompt_pairs(folder, prompts)
    if scorer is None:
        missing = [n for n, v in (("weights", weights), ("med_config", med_config), ("tokenizer", tokenizer)) if v is None]
        if missing:
            raise ValueError(f"give a scorer or all of weights, med_config and tokenizer (missing: {', '.join(missing)})")
        scorer = ImageRewardScorer(weights, med_config, tokenizer, device=device)
    images = [open_rgb(path) for path, _ in pairs]
    scores = scorer.score(images, [p for _, p in pairs], progress=progress)
    per_image = [{"file": str(path), "prompt": p, "image_reward": s} for (path, p), s in zip(pairs, scores)]
    return ImageRewardResult(float(statistics.fmean(scores)), float(statistics.pstdev(scores)), len(scores),
                             scorer.weights, per_image)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mmspec.evaluation.imagereward",
                                     description="ImageReward of images against their prompts (local weights).")
    parser.add_argument("folder", help="folder of images (prompt matching as in clip_score)")
    parser.add_argument("--prompts", default=None, help="prompts file (JSON lines {file, prompt} or text)")
    parser.add_argument("--weights", required=True, help="ImageReward.pt (or .safetensors)")
    parser.add_argument("--med-config", required=True, help="med_config.json of the checkpoint")
    parser.add_argument("--tokenizer", required=True, help="folder with the bert-base-uncased tokenizer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vision", default="large",
                        help="vision tower: large (the released model), base, or a JSON dict of VisionTransformer "
                             "arguments for small test models")
    add_output_arguments(parser, "write per-image rewards as JSON lines here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    vision = args.vision
    if vision.lstrip().startswith("{"):
        import json

        try:
            vision = json.loads(vision)
        except json.JSONDecodeError as err:
            parser.error(f"--vision is not valid JSON: {err}")
    load_prompt_pairs(args.folder, args.prompts)  # check the input before the (slow) model build
    scorer = ImageRewardScorer(args.weights, args.med_config, args.tokenizer, device=args.device, vision=vision)
    result = compute_imagereward(args.folder, args.prompts, scorer=scorer, progress=not args.no_progress)
    print(f"ImageReward: {result.image_reward:.4f} +- {result.std:.4f} over {result.num_pairs} pairs ({result.weights})")
    write_outputs(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
