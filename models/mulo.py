"""MuLo-SD drafting modules (arXiv 2601.05149): a low-resolution drafter, a learned token up-sampler
and a down-sampler, assembled into a :class:`~mmspec.local_speculate.RowBlockDrafter`.

* The low-resolution drafter is an ordinary AR image model over the token grid of the image at
  1/r resolution (here a small :class:`~mmspec.models.llamagen.LlamaGenTransformer` with the target's
  conditioning, so it reads the same prompt inputs and runs under the same classifier-free guidance).
* :class:`TokenUpsampler` maps low-res token rows to the target's grid (x r^2 tokens): token
  embeddings, a *row-causal* convolution (a low-res row sees itself and the rows above it, never the
  rows below, which are not drafted yet), a pixel shuffle by r and a linear head over the codebook;
  with ``high_res_context`` it also reads the final high-res rows of the blocks above.
* :func:`downsample_tokens` turns the final high-res rows back into a low-res row, the drafter's next
  prefix: decode with the tokenizer, average-pool by r, re-encode. It is exact for the project's pixel
  VQ tokenizer and needs no training, so it is not a learned module here (documented design choice).

One MuLo-SD block is ``r`` high-res rows = one low-res row: the drafter samples the row token by token
(``w`` forwards), the up-sampler turns it into ``r * W`` high-res drafts, and after verification the
final block is down-sampled and written into the drafter's cache in place of its own draft.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from mmspec.drafters import draft_chain
from mmspec.local_speculate import RowBlockDrafter
from mmspec.runner import CausalLMRunner, GuidedRunner
from mmspec.sampling import SamplingConfig, first_argmax, logits_to_probs, sample


def check_mulo_pair(transformer: Any, mulo_drafter: Any, mulo_upsampler: Any) -> None:
    """Raise ValueError unless the MuLo-SD low-res drafter and up-sampler come as a pair that fits ``transformer``
    (grid ratio, vocabulary, model type, condition tokens); both None passes (no MuLo-SD components)."""
    if (mulo_drafter is None) != (mulo_upsampler is None):
        raise ValueError("mulo_drafter and mulo_upsampler come together (pass both or neither)")
    if mulo_drafter is None:
        return
    target, low = transformer.config, mulo_drafter.config
    ratio = mulo_upsampler.config.ratio
    grid, low_grid = round(target.block_size ** 0.5), round(low.block_size ** 0.5)
    if low_grid * ratio != grid:
        raise ValueError(f"the MuLo drafter's {low_grid}x{low_grid} grid times the up-sampler's ratio {ratio} must "
                         f"equal the target's {grid}x{grid} grid")
    for name, a, b in (("vocab_size", mulo_upsampler.config.vocab_size, target.vocab_size),
                       ("vocab_size", low.vocab_size, target.vocab_size),
                       ("model_type", low.model_type, target.model_type),
                       ("cls_token_num", low.cls_token_num, target.cls_token_num)):
        if a != b:
            raise ValueError(f"the MuLo drafter/up-sampler {name}={a} does not match the target's {b}")


class RowCausalConv(nn.Module):
    """2-D convolution over a token grid in which output row i sees input rows i - (rows - 1) .. i only."""

    def __init__(self, channels: int, rows: int, cols: int) -> None:
        super().__init__()
        if cols % 2 == 0:
            raise ValueError(f"the column kernel must be odd (centred), got {cols}")
        self.rows, self.cols = rows, cols
        self.conv = nn.Conv2d(channels, channels, (rows, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, h, w]
        pad = self.cols // 2
        return self.conv(F.pad(x, (pad, pad, self.rows - 1, 0)))  # pad left/right, top only


class TokenUpsampler(ModelMixin, ConfigMixin):
    """Low-res token grid ``[B, h, w]`` -> logits over the high-res grid ``[B, h*r, w*r, V]``.

    Args:
        vocab_size: codebook size (shared by both resolutions).
        ratio: resolution ratio r (each low-res token becomes an r x r block of high-res tokens).
        dim: channel width; context_rows: low-res rows each output row sees (itself included);
        layers: row-causal conv blocks (residual, GELU).
        high_res_context: also read the final high-res tokens of the blocks above (``forward``'s
            ``high_tokens``): each r x r block of them is folded into one low-res cell and the result
            moved down one low-res row, so block i sees the high-res rows of blocks < i and never its
            own. The low-res grid says what is roughly where; the rows above say exactly how the shapes
            they cut through continue (edges, colours, the target's own texture).
    """

    @register_to_config
    def __init__(self, vocab_size: int = 2048, ratio: int = 2, dim: int = 128, context_rows: int = 2,
                 layers: int = 2, high_res_context: bool = False) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("ratio", ratio), ("dim", dim),
                            ("context_rows", context_rows), ("layers", layers)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.embed = nn.Embedding(vocab_size, dim)
        if high_res_context:
            self.high_embed = nn.Embedding(vocab_size, dim)
            self.high_fold = nn.Linear(dim * ratio * ratio, dim)
        self.blocks = nn.ModuleList(RowCausalConv(dim, context_rows, 3) for _ in range(layers))
        self.expand = nn.Linear(dim, dim * ratio * ratio)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, low_tokens: torch.Tensor, high_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, h r, w r, V]`` for ``low_tokens`` ``[B, h, w]``; with ``high_res_context``,
        ``high_tokens`` ``[B, h r, w r]`` are the high-res tokens of the same grid (only the rows above
        each block are read: the last block's rows may hold anything, e.g. zeros)."""
        if not isinstance(low_tokens, torch.Tensor) or low_tokens.ndim != 3 or low_tokens.is_floating_point():
            raise ValueError("low_tokens must be a LongTensor [B, h, w]")
        vocab, r = self.config.vocab_size, self.config.ratio
        if low_tokens.numel() and (int(low_tokens.min()) < 0 or int(low_tokens.max()) >= vocab):
            raise ValueError(f"low_tokens must lie in [0, {vocab})")
        x = self.embed(low_tokens).permute(0, 3, 1, 2)  # [B, C, h, w]
        if self.config.high_res_context:
            x = x + self._rows_above(low_tokens, high_tokens)
        elif high_tokens is not None:
            raise ValueError("this up-sampler reads no high-res context (high_res_context=False): pass low_tokens only")
        for block in self.blocks:
            x = x + F.gelu(block(x))
        x = self.expand(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # [B, C r^2, h, w]
        x = F.pixel_shuffle(x, r).permute(0, 2, 3, 1)  # [B, h r, w r, C]
        return self.head(self.norm(x))

    def _rows_above(self, low_tokens: torch.Tensor, high_tokens: torch.Tensor | None) -> torch.Tensor:
        """``[B, C, h, w]``: cell (i, j) holds the folded high-res block of cell (i - 1, j); row 0 zeros."""
        batch, h, w = low_tokens.shape
        r, vocab = self.config.ratio, self.config.vocab_size
        if not isinstance(high_tokens, torch.Tensor) or high_tokens.is_floating_point() or \
                tuple(high_tokens.shape) != (batch, h * r, w * r):
            raise ValueError(f"this up-sampler reads the high-res rows above each block: high_tokens must be a "
                             f"LongTensor [{batch}, {h * r}, {w * r}], got "
                             f"{tuple(high_tokens.shape) if isinstance(high_tokens, torch.Tensor) else high_tokens!r}")
        if high_tokens.numel() and (int(high_tokens.min()) < 0 or int(high_tokens.max()) >= vocab):
            raise ValueError(f"high_tokens must lie in [0, {vocab})")
        folded = F.pixel_unshuffle(self.high_embed(high_tokens).permute(0, 3, 1, 2), r)  # [B, C r^2, h, w]
        folded = self.high_fold(folded.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)  # [B, C, h, w]
        return F.pad(folded[:, :, :-1], (0, 0, 1, 0))  # down one low-res row


@torch.no_grad()
def downsample_tokens(tokenizer: Any, tokens: torch.Tensor, ratio: int) -> torch.Tensor:
    """High-res tokens ``[B, H, W]`` -> low-res tokens ``[B, H/r, W/r]`` through pixels (decode,
    average-pool by ``ratio``, encode with the same tokenizer)."""
    pixels = tokenizer.decode(tokens)  # [B, 3, H p, W p]
    return tokenizer.encode(F.avg_pool2d(pixels, ratio).clamp(0.0, 1.0))


class MuLoDrafter(RowBlockDrafter):
    """MuLo-SD's multi-scale drafter: one low-res row per block, up-sampled to ``ratio`` target rows.

    Args:
        low_res_model: AR model over the low-res grid with the target's condition interface (a
            :class:`~mmspec.models.llamagen.LlamaGenTransformer` whose ``block_size`` is the target's / r^2).
        upsampler: :class:`TokenUpsampler` with the same ratio and vocabulary.
        tokenizer: the image tokenizer (for :func:`downsample_tokens`).
        sampling: how the low-res drafter and the up-sampler draw (greedy: argmax, deterministic drafts).
        guidance_scale: classifier-free guidance of the low-res drafter (1.0: none; otherwise its prefill
            takes the doubled ``[cond; uncond]`` condition rows, as the target's).
        generator: random draws of the drafts.
        guided_prompt: the prefill gets a guided target's doubled ``[cond; uncond]`` rows (default: when
            ``guidance_scale`` != 1). With ``guidance_scale`` 1 the drafter then reads the conditional half
            alone and drafts unguided beside the guided target (e.g. a drafter trained on the target's
            guided samples, whose own rows already carry the guidance).
    """

    def __init__(self, low_res_model: Any, upsampler: TokenUpsampler, tokenizer: Any,
                 sampling: SamplingConfig = SamplingConfig(do_sample=False), guidance_scale: float = 1.0,
                 generator: torch.Generator | None = None, guided_prompt: bool | None = None) -> None:
        ratio = upsampler.config.ratio
        if upsampler.config.vocab_size != low_res_model.config.vocab_size:
            raise ValueError(f"the up-sampler predicts {upsampler.config.vocab_size} tokens but the low-res drafter "
                             f"{low_res_model.config.vocab_size}")
        self.low_grid = int(round(low_res_model.config.block_size ** 0.5))
        runner = CausalLMRunner(low_res_model)
        self.runner: Any = runner if guidance_scale == 1.0 else GuidedRunner(runner, guidance_scale)
        guided_prompt = guidance_scale != 1.0 if guided_prompt is None else guided_prompt
        if guidance_scale != 1.0 and not guided_prompt:
            raise ValueError(f"guidance_scale={guidance_scale} needs the guided prompt rows [cond; uncond] "
                             "(guided_prompt=True)")
        self.reads_conditional_half = guided_prompt and guidance_scale == 1.0
        self.upsampler, self.tokenizer, self.ratio = upsampler, tokenizer, ratio
        self.sampling, self.generator = sampling, generator
        self.low_rows: list[torch.Tensor] = []  # final low-res rows [B, w]
        self.high_blocks: list[torch.Tensor] = []  # final high-res blocks [B, r, W] (for high_res_context)
        self._next_logits: torch.Tensor | None = None

    @property
    def calls(self) -> int:
        return self.runner.calls

    def prefill(self, attention_mask: torch.Tensor | None, **model_inputs: Any) -> None:
        self.low_rows, self.high_blocks = [], []
        if self.reads_conditional_half:
            attention_mask, model_inputs = GuidedRunner.conditional_half(attention_mask, model_inputs)
        out = self.runner.prefill(None, attention_mask, **model_inputs)
        self._next_logits = out.logits[:, -1]

    def propose(self, block_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._next_logits is None or block_index != len(self.low_rows):
            raise RuntimeError(f"MuLoDrafter.propose({block_index}) out of order (prefill first, one block at a time)")
        if block_index >= self.low_grid:
            raise ValueError(f"the low-res drafter has {self.low_grid} rows; block {block_index} is past its grid")
        self.runner.begin_round()
        row = draft_chain(self._next_logits, lambda token: self.runner.forward(token[:, None]).logits[:, -1],
                          self.low_grid, self.sampling, self.generator).tokens  # [B, w]
        low = torch.stack(self.low_rows + [row], 1).to(self.upsampler.device)  # [B, b+1, w]
        high = None
        if self.upsampler.config.high_res_context:  # the final blocks above, any tokens in the drafted block's rows
            blank = torch.zeros(row.shape[0], self.ratio, row.shape[1] * self.ratio, dtype=torch.long, device=low.device)
            high = torch.cat([block.to(low.device) for block in self.high_blocks] + [blank], 1)
        logits = self.upsampler(low, high)[:, -self.ratio:]  # [B, r, W, V]
        logits = logits.flatten(1, 2).float()
        if not self.sampling.do_sample:
            return first_argmax(logits), None
        probs = logits_to_probs(logits, self.sampling)
        return sample(probs, self.generator, name="draft distribution"), probs

    def commit(self, block_index: int, tokens: torch.Tensor) -> None:
        batch = tokens.shape[0]
        width = tokens.shape[1] // self.ratio
        high = tokens.view(batch, self.ratio, width)
        low_row = downsample_tokens(self.tokenizer, high, self.ratio)[:, 0]  # [B, w]
        self.low_rows.append(low_row)
        self.high_blocks.append(high)
        # drop the drafted low-res row from the drafter's cache and write the final one in its place
        self.runner.commit(torch.full((batch, 1), -1, dtype=torch.long, device=tokens.device))
        self.runner.begin_round()
        out = self.runner.forward(low_row.to(tokens.device))
        self.runner.commit(torch.arange(low_row.shape[1], device=tokens.device).expand(batch, -1))
        self._next_logits = out.logits[:, -1]
