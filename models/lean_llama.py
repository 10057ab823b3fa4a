"""A lean Llama decoder for draft heads: the math and parameter names of transformers' ``LlamaModel``
(so the same state dict loads into either), without its per-call machinery.

Why: a draft head runs K times per verification round on a handful of tokens, where the per-call cost of
transformers' generic model (mask factories, output capturing, cache classes, rotary-embedding module)
is comparable to the head's arithmetic. On the shapes zoo's d=192 head this decoder costs about half of
``LlamaModel``'s time per call, which directly raises every EAGLE-style method's speedup.

It accepts what :class:`~mmspec.runner.CausalLMRunner` passes: ``inputs_embeds [B, T, d]``, a 2-D key
mask ``[B, S+T]`` (1 = valid; causal over cache slots) or an explicit boolean visibility
``[B, 1, T, S+T]`` (draft trees), ``position_ids [B, T]``, and a :class:`~mmspec.cache.KVCache` (its own,
from :meth:`new_cache`; rollback is the core's ``select_cache_slots``). Query rows that may see no key at
all (padding) attend to every key instead, as transformers does, so their outputs stay finite.

**Inference fast path.** Without autograd (``torch.no_grad`` or ``torch.inference_mode``: drafting) each layer runs fewer, larger ops,
because a draft step on one token is bound by per-op overhead, not arithmetic: one matmul computes
``q, k, rotate_half(q), rotate_half(k), v`` (rotate_half is a signed permutation of rows, folded into a
copy of the projection weights) and one ``addcmul`` applies RoPE to q and k together, one matmul computes
gate and up, RoPE angles come from a cached table, and a single query reads the key mask as it is. The
derived weights are rebuilt whenever a parameter changes (its version counter or storage), so training and
loading need no care. Same math; outputs agree with the autograd path to float rounding (tested). On both
paths a float32 RMSNorm is torch's fused ``rms_norm`` (the same float32 arithmetic as transformers').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig

from mmspec.cache import KVCache
from mmspec.cpu_gemm import LinearRoute


@dataclass
class LeanDecoderOutput:
    last_hidden_state: torch.Tensor
    past_key_values: Any = None


class LlamaRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused op, the same float32 arithmetic (bit-identical, tested)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class LeanAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self._fused = _DerivedWeights()
        self._route = LinearRoute()  # packed CPU GEMMs for the fused matmul when the projections are packed

    def _build_rope_projection(self, q: nn.Linear, k: nn.Linear, v: nn.Linear
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weights (and bias) of ``[q; k; rotate_half(q); rotate_half(k); v]`` in one matrix."""
        def rotated(tensor: torch.Tensor, heads: int) -> torch.Tensor:
            rows = tensor.reshape(heads, self.head_dim, -1)  # rotate_half acts on each head's rows
            return _rotate_half(rows.transpose(1, 2)).transpose(1, 2).reshape(tensor.shape)

        def stack(q_part: torch.Tensor, k_part: torch.Tensor, v_part: torch.Tensor) -> torch.Tensor:
            return torch.cat([q_part, k_part, rotated(q_part, self.num_heads), rotated(k_part, self.num_kv_heads),
                              v_part])

        bias = None if q.bias is None else stack(q.bias, k.bias, v.bias)
        return stack(q.weight, k.weight, v.weight), bias

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        b, t, _ = x.shape
        if torch.is_grad_enabled():
            q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
            k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        else:  # inference fast path: one matmul for q, k, v and their rotate_half, RoPE on q and k at once
            weight, bias = self._fused.get(self._build_rope_projection, self.q_proj, self.k_proj, self.v_proj)
            projected = self._route(x, weight, bias, like=self.q_proj).view(b, t, -1, self.head_dim).transpose(1, 2)
            heads = self.num_heads + self.num_kv_heads
            qk, qk_rot, v = projected.split([heads, heads, self.num_kv_heads], dim=1)
            q, k = torch.addcmul(qk * cos, qk_rot, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and t > 1,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LeanMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self._fused = _DerivedWeights()
        self._route = LinearRoute()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        weight, bias = self._fused.get(_stack_linears, self.gate_proj, self.up_proj)  # inference: one matmul
        gate, up = self._route(x, weight, bias, like=self.gate_proj).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LeanLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LeanAttention(config)
        self.mlp = LeanMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class LeanLlamaDecoder(nn.Module):
    """``LlamaModel(config)`` without token embeddings (inputs arrive as embeddings); same parameter names
    (``layers.N.self_attn.q_proj``, ..., ``norm``) and the same outputs up to float rounding."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"hidden_size {config.hidden_size} must be divisible by num_attention_heads "
                             f"{config.num_attention_heads}")
        self.config = config
        self.layers = nn.ModuleList(LeanLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = config.hidden_size // config.num_attention_heads
        theta = _rope_theta(config)
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # no-grad path: cos, sin per position

    def new_cache(self, batch_size: int, max_length: int = 256) -> KVCache:
        """A growable preallocated cache for this decoder (rolled back by the core per row)."""
        weight = self.layers[0].self_attn.k_proj.weight
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        return KVCache(self.config.num_hidden_layers, batch_size, self.config.num_key_value_heads, head_dim,
                       max_length, dtype=weight.dtype, device=weight.device)

    def forward(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: KVCache | None = None,
                use_cache: bool = True, **_: Any) -> LeanDecoderOutput:
        b, t, _ = inputs_embeds.shape
        cache = past_key_values if use_cache else None
        if cache is not None and not isinstance(cache, KVCache):
            raise ValueError(f"LeanLlamaDecoder caches are mmspec.cache.KVCache (new_cache()), got {type(cache).__name__}")
        past = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=inputs_embeds.device).expand(b, t)
        cos, sin = self._rope(position_ids, inputs_embeds.dtype)
        mask = _visibility(attention_mask, b, t, past, inputs_embeds.device)
        x = inputs_embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, index)
        return LeanDecoderOutput(self.norm(x), cache)

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, 1, T, head_dim]`` (transformers' default rotary embedding, computed in float32;
        without autograd looked up in a table of the same values, grown as positions need)."""
        if torch.is_grad_enabled():
            cos, sin = _rope_angles(position_ids, self.inv_freq)
        else:
            needed = int(position_ids.max()) + 1 if position_ids.numel() else 1
            table = self._rope_table
            if table is None or table[0].shape[0] < needed or table[0].device != position_ids.device \
                    or table[0].dtype != dtype:  # sized for max_position_embeddings, doubled past it
                size = max(self.config.max_position_embeddings, 2 * needed)
                table = self._rope_table = _rope_table(size, self.inv_freq, dtype, position_ids.device)
            return table[0][position_ids].unsqueeze(1), table[1][position_ids].unsqueeze(1)
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def _stack_linears(*layers: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One linear map computing all ``layers`` (their weights and biases concatenated)."""
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    return torch.cat([layer.weight for layer in layers]), bias


def _rope_table(size: int, inv_freq: torch.Tensor, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[size, head_dim]`` of positions 0..size-1 (float32 angles, cast to ``dtype``)."""
    cos, sin = _rope_angles(torch.arange(size, device=device), inv_freq.to(device))
    return cos.to(dtype), sin.to(dtype)


def _rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float().unsqueeze(-1) * inv_freq.float()  # [..., hd/2]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


class _DerivedWeights:
    """A cache of tensors derived from some linear layers' parameters (e.g. their concatenation), rebuilt
    when any parameter's storage or version counter changes (an optimiser step, load_state_dict, .to())."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: Any = None

    def get(self, build: Any, *layers: nn.Linear) -> Any:
        key = tuple((p.data_ptr(), p._version, p.dtype) for layer in layers for p in (layer.weight, layer.bias)
                    if p is not None)
        if key != self._key:
            self._value, self._key = build(*layers), key
        return self._value


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope_theta(config: LlamaConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _visibility(attention_mask: torch.Tensor | None, b: int, t: int, past: int, device: torch.device
                ) -> torch.Tensor | None:
    """Boolean key visibility ``[B, 1, T, S+T]`` (None: plain causal without padding)."""
    if attention_mask is None:
        if past == 0:
            return None
        attention_mask = torch.ones(b, past + t, dtype=torch.bool, device=device)
    if attention_mask.ndim == 2:
        if attention_mask.shape[1] != past + t:
            raise ValueError(f"attention_mask must cover the {past} cached and {t} new slots, got "
                             f"{tuple(attention_mask.shape)}")
        if bool(attention_mask.all()):  # no padding, no holes (one host read): causal over the cache, built in
            # two operations instead of a dozen (a draft head's step is bound by its operation count)
            return None if t == 1 else torch.ones(t, past + t, dtype=torch.bool, device=device).tril(past)[None, None]
        if t == 1:  # a single query is the last slot: causality hides nothing, the key mask is all
            visible = attention_mask.bool()[:, None, None, :]
            return visible | ~visible.any(-1, keepdim=True)
        keys = torch.arange(past + t, device=device)
        causal = keys.unsqueeze(0) <= (past + torch.arange(t, device=device)).unsqueeze(1)  # [T, S+T]
        visible = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)  # [B, T, S+T]
        visible = visible.unsqueeze(1)
    elif attention_mask.ndim == 4:
        if attention_mask.is_floating_point():
            raise ValueError("LeanLlamaDecoder takes boolean (or 0/1) 4-D masks, not additive float masks")
        visible = attention_mask.bool()
    else:
        raise ValueError(f"attention_mask must be [B, S+T] or [B, 1, T, S+T], got {tuple(attention_mask.shape)}")
    blind = ~visible.any(-1, keepdim=True)  # rows that see nothing (padding): let them see everything
    return visible | blind
