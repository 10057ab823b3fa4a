"""EAGLE draft head (Li et al., arXiv 2401.15077 / 2406.16858) for any target that exposes features.

The head predicts the target's next *feature* (top hidden state) from the current token and the
previous feature, and reads tokens off predicted features with the target's frozen LM head:

    input at position i:  [ embed(x_i) ; h_{i-1} ]  --fc (2d -> d)-->  one decoder layer  -->  h^_i
    q(x_{i+1}) = softmax(lm_head(h^_i))

During drafting the head feeds its own predictions back (h^_i in place of h_i); after verification the
accepted tokens are re-fed with the target's true features. The same head serves image targets
(LlamaGen, Janus) and VLMs (the base of FLASH, ViSpec and SpecVLM); EagleVLM's extra input norm is the
``input_norm`` option. The decoder layer is one Llama layer (1-D RoPE over the head's own slot positions):
by default :class:`~mmspec.models.lean_llama.LeanLlamaDecoder`, which has transformers' ``LlamaModel``
math and parameter names at about half its per-call cost (``decoder_impl="transformers"`` uses ``LlamaModel``
itself; the same weights load into either). The core's :class:`~mmspec.runner.CausalLMRunner` drives it,
trees included.

The embedding and LM head are the target's, frozen, and not saved with the head (:meth:`bind_target`).
The training objective lives with the recipes: :func:`mmspec.models.recipes.eagle_loss.eagle_loss`.

``num_future = K > 1`` adds FLASH's semi-autoregressive readout (:class:`FutureReadout`, arXiv 2505.12728):
each pair predicts the K next features ``h^_i .. h^_{i+K-1}``, so one draft forward proposes K tokens and
a chain of n tokens costs about n / K head forwards instead of n. The first future starts as the plain
head's prediction; the later ones are read without the drafted tokens between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaModel

from mmspec.cache import keep_valid_slots
from mmspec.drafters import TreeConfig, check_chain_confidence, draft_chain
from mmspec.models.lean_llama import LeanLlamaDecoder
from mmspec.runner import CausalLMRunner, GuidedRunner
from mmspec.sampling import SamplingConfig
from mmspec.speculate import DraftChain, Drafter, PrefillContext, RoundResult
from mmspec.tree import DraftTree, TreeAttentionBuilder
from mmspec.validation import check_positive_int


@dataclass
class EagleOutput:
    logits: torch.Tensor
    past_key_values: Any
    hidden_states: tuple[torch.Tensor, ...]


class FutureReadout(nn.Sequential):
    """FLASH's semi-autoregressive readout: ``Linear(d, 4d) - SiLU - Linear(4d, K d)`` predicts K future
    features as offsets from the decoder output ``[B, T, d]`` -> ``[B, T, K, d]``. Shared by the image EAGLE
    head (``num_future``) and the VLM :class:`~mmspec.models.vlm_drafters.flash.FlashHead`."""

    def __init__(self, hidden_size: int, num_future: int) -> None:
        check_positive_int(num_future, "num_future")
        super().__init__(nn.Linear(hidden_size, 4 * hidden_size), nn.SiLU(),
                         nn.Linear(4 * hidden_size, num_future * hidden_size))
        self.num_future = num_future

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        steps = super().forward(features).unflatten(-1, (self.num_future, features.shape[-1]))
        return features.unsqueeze(-2) + steps

    def first(self, features: torch.Tensor) -> torch.Tensor:
        """Future 1 alone, ``[B, T, d]``: what drafting token by token reads (only its rows of the last layer)."""
        width = features.shape[-1]
        hidden = self[1](self[0](features))
        return features + nn.functional.linear(hidden, self[-1].weight[:width], self[-1].bias[:width])

    def start_as_identity(self) -> FutureReadout:
        """Zero the last layer: every future equals the decoder output (a plain head's prediction), the
        start when a trained one-token head grows a readout."""
        with torch.no_grad():
            self[-1].weight.zero_()
            self[-1].bias.zero_()
        return self


class EagleHead(ModelMixin, ConfigMixin):
    """One-layer feature-level draft head.

    Args:
        hidden_size: the target's feature width d.
        vocab_size: the target's vocabulary (checked against the bound LM head).
        num_attention_heads / num_key_value_heads / intermediate_size: the decoder layer's shape.
        rope_theta: RoPE base of the decoder layer.
        input_norm: RMS-normalise the fused input (EagleVLM of SpecVLM).
        norm_eps: RMSNorm epsilon.
        decoder_impl: "lean" (:class:`~mmspec.models.lean_llama.LeanLlamaDecoder`, the default) or "transformers"
            (``LlamaModel``); identical outputs and parameter names.
        feature_guidance: None for a head trained on the target's conditional (or unconditional) features;
            s for a head trained on its *guided* features ``h_u + s (h_c - h_u)`` at guidance scale s, whose
            LM-head logits are the guided logits: it drafts the guided target from one row
            (:class:`EagleDrafter` ``guided_features=True``).
        num_future: K features (tokens) predicted per pair by a :class:`FutureReadout` (1: the plain head).
            Logits and features then carry a K axis (``[B, T, K, V]``, ``[B, T, K, d]``), and
            :class:`EagleDrafter` drafts K tokens per head forward.
    """

    @register_to_config
    def __init__(self, hidden_size: int, vocab_size: int, num_attention_heads: int = 4,
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None,
                 rope_theta: float = 10000.0, input_norm: bool = False, norm_eps: float = 1e-6,
                 max_position_embeddings: int = 4096, decoder_impl: str = "lean",
                 feature_guidance: float | None = None, num_future: int = 1) -> None:
        super().__init__()
        check_positive_int(num_future, "num_future")
        if decoder_impl not in ("lean", "transformers"):  # (not "decoder": config keys shadow submodules)
            raise ValueError(f"decoder_impl must be 'lean' or 'transformers', got {decoder_impl!r}")
        self.llama_config = LlamaConfig(
            vocab_size=1, hidden_size=hidden_size, intermediate_size=intermediate_size or 4 * hidden_size,
            num_hidden_layers=1, num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads or num_attention_heads, rope_theta=rope_theta,
            rms_norm_eps=norm_eps, max_position_embeddings=max_position_embeddings,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
        self.fc = nn.Linear(2 * hidden_size, hidden_size)
        self.fused_norm = nn.RMSNorm(2 * hidden_size, eps=norm_eps) if input_norm else None
        if decoder_impl == "lean":
            self.decoder: nn.Module = LeanLlamaDecoder(self.llama_config)
        else:
            self.decoder = LlamaModel(self.llama_config)
            self.decoder.embed_tokens = None  # inputs arrive as embeddings
        self.future = FutureReadout(hidden_size, num_future) if num_future > 1 else None
        self._target: dict[str, nn.Module] = {}

    # -- target binding -------------------------------------------------------------------------------
    def bind_target(self, input_embeddings: nn.Module, output_embeddings: nn.Module) -> EagleHead:
        """Use the target's (frozen) token embedding and LM head. They are not parameters of the head."""
        vocab = output_embeddings.weight.shape[0]
        if vocab != self.config.vocab_size:
            raise ValueError(f"vocab mismatch: the EAGLE head was built for {self.config.vocab_size} tokens, the "
                             f"target's LM head has {vocab}")
        width = output_embeddings.weight.shape[1]
        if width != self.config.hidden_size:
            raise ValueError(f"hidden size mismatch: the EAGLE head expects features of width "
                             f"{self.config.hidden_size}, the target's LM head reads {width}")
        self._target = {"embed": input_embeddings, "head": output_embeddings}
        return self

    def _bound(self) -> dict[str, nn.Module]:
        if not self._target:
            raise RuntimeError("call bind_target(target.get_input_embeddings(), target.get_output_embeddings()) first")
        return self._target

    def new_cache(self, batch_size: int) -> Any:
        if isinstance(self.decoder, LeanLlamaDecoder):
            return self.decoder.new_cache(batch_size)
        return DynamicCache(config=self.llama_config)

    def get_output_embeddings(self) -> nn.Module:
        return self._bound()["head"]

    def readout(self, features: torch.Tensor) -> torch.Tensor:
        """Decoder output ``[B, T, d]`` -> predicted features: the same (plain head) or ``[B, T, K, d]``."""
        return features if self.future is None else self.future(features)

    # -- forward --------------------------------------------------------------------------------------
    def fuse(self, input_ids: torch.Tensor | None, target_hidden: torch.Tensor,
             token_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``fc([embed(x) ; h])``; a missing token id (None or -1) embeds as zeros (condition prefixes), or as
        ``token_embeds [B, T, d]`` at those slots when given (e.g. compressed image tokens of a VLM drafter)."""
        if input_ids is None:
            embeds = torch.zeros_like(target_hidden) if token_embeds is None else token_embeds.to(target_hidden.dtype)
        else:
            embeds = self._bound()["embed"](input_ids.clamp_min(0)).to(target_hidden.dtype)
            missing = (input_ids < 0).unsqueeze(-1)
            embeds = embeds.masked_fill(missing, 0.0) if token_embeds is None else \
                torch.where(missing, token_embeds.to(target_hidden.dtype), embeds)
        fused = torch.cat([embeds, target_hidden], dim=-1)
        if self.fused_norm is not None:
            fused = self.fused_norm(fused)
        return self.fc(fused)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: Any = None, use_cache: bool = True,
                output_hidden_states: bool = False, target_hidden: torch.Tensor | None = None,
                token_embeds: torch.Tensor | None = None, logits_to_keep: int = 0,
                first_future_only: bool = False) -> EagleOutput:
        """Predict features ``[B, T, d]`` and their logits ``[B, T, V]`` (``num_future`` K > 1: ``[B, T, K, d]``
        and ``[B, T, K, V]``).

        Args:
            input_ids: ``[B, T]`` tokens x_i (-1 = no token: condition positions).
            target_hidden: ``[B, T, d]`` the feature preceding each token (h_{i-1}, true or predicted).
            token_embeds: optional ``[B, T, d]`` input embeddings used where ``input_ids`` is -1 (zeros otherwise).
            logits_to_keep: as in transformers' causal LMs: logits (and predicted features) of the last
                ``logits_to_keep`` slots only (``[B, logits_to_keep, V]``; 0 = every slot). The LM head is the
                head's largest matmul (with a readout, K times over), and a round's first forward and every
                block step read one slot's.
            first_future_only: a ``num_future`` head returns its first future only (``[B, T, d]`` features,
                ``[B, T, V]`` logits, as a plain head): token-by-token drafting with a K-future head.
        """
        if target_hidden is None:
            raise ValueError("EagleHead needs target_hidden [B, T, d], the feature preceding each token")
        embeds = self.fuse(input_ids, target_hidden, token_embeds)
        out = self.decoder(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=past_key_values, use_cache=use_cache)
        kept = out.last_hidden_state[:, -logits_to_keep:] if logits_to_keep else out.last_hidden_state
        features = self.future.first(kept) if first_future_only and self.future is not None else self.readout(kept)
        lm_head = self._bound()["head"]
        logits = lm_head(features.to(lm_head.weight.dtype))
        return EagleOutput(logits, out.past_key_values, (features,))


class EagleDrafter(Drafter):
    """Drafts chains or EAGLE-2 dynamic trees with an :class:`EagleHead`.

    Needs the target's top hidden states (run the target with ``CausalLMRunner(..., return_hidden=True)``).
    Each round feeds the committed tokens of the previous round with their *true* target features (the
    head's own predictions are dropped after verification, as in EAGLE), then drafts from its own
    predicted features.

    Args:
        head: a trained (or untrained: correctness never depends on it) :class:`EagleHead`, bound to
            the target's embedding and LM head.
        num_draft_tokens: chain length; tree: an EAGLE-2 :class:`~mmspec.drafters.TreeConfig` (both capped
            where less is left to generate: :attr:`~mmspec.speculate.Drafter.draft_limit`). A head with
            ``num_future`` K > 1 drafts the chain in blocks of K tokens, one head forward each (chains only).
        blocks: for a head with ``num_future`` > 1: True / None draft blocks of K tokens, False drafts token by
            token from the head's first future alone (chains or trees).
        sampling: the target's sampling config (sampled chains return their distributions).
        guidance_scale: 1.0 drafts from the conditional features only. Any other value drafts *under
            classifier-free guidance*: the head runs on both halves ``[cond; uncond]`` (a doubled batch,
            like the target) and its logits are combined as ``uncond + s (cond - uncond)``, so the draft
            distribution matches the guided target's. The target must then return the features of both
            halves: ``GuidedRunner(CausalLMRunner(model, return_hidden=True), s, hidden="both")``.
        confidence_threshold: dynamic chain length (:func:`~mmspec.drafters.draft_chain`): a chain stops
            once every row's drafted token had less than this probability under the head; 0 drafts K.
        guided_features: the head was trained on the target's *guided* features (``feature_guidance`` in
            its config): it drafts one row per token row from ``h_u + s (h_c - h_u)``, which the target
            returns with ``GuidedRunner(..., hidden="guided")``; ``guidance_scale`` must then be 1.0 (the
            guidance is in the features). :attr:`target_hidden` names the features the target must return.
        argmax_drafts: under sampling, a chain drafts the head's most likely token at every step instead of
            drawing it: the proposal is a point mass (``DraftChain.probs`` None), which exact verification
            accepts with probability p(x) and still keeps lossless, and a relaxed rule with its relaxed mass
            p~(x) rather than p~(x) / q(x) (LANTERN: the neighbours' mass counts in full). Chains only (a
            tree's nodes are the head's top-k already); greedy decoding drafts argmax anyway.
    """

    needs_target_hidden = True
    can_skip_rounds = True  # commit_undrafted: a lookup tail may draft a round without the head

    def __init__(self, head: EagleHead, num_draft_tokens: int = 4,
                 sampling: SamplingConfig = SamplingConfig(do_sample=False), tree: TreeConfig | None = None,
                 generator: torch.Generator | None = None, guidance_scale: float = 1.0,
                 confidence_threshold: float = 0.0, guided_features: bool = False, blocks: bool | None = None,
                 argmax_drafts: bool = False) -> None:
        check_positive_int(num_draft_tokens, "num_draft_tokens")
        check_chain_confidence(confidence_threshold, tree)
        if not isinstance(argmax_drafts, bool):
            raise ValueError(f"argmax_drafts must be True or False, got {argmax_drafts!r}")
        if argmax_drafts and tree is not None:
            raise ValueError("argmax_drafts applies to chains: an EAGLE-2 tree's nodes are the head's top-k "
                             "tokens already (pass tree=None)")
        if blocks is not None and not isinstance(blocks, bool):
            raise ValueError(f"blocks must be None, True or False, got {blocks!r}")
        use_blocks = head.config.num_future > 1 and blocks is not False
        #: tokens the head proposes per forward (its ``num_future`` when drafting blocks; FLASH's VLM head sets its own)
        self.num_future = head.config.num_future if use_blocks else 1
        #: extra inputs of every head call: a K-future head drafting token by token reads its first future
        self.head_inputs: dict[str, Any] = {} if use_blocks or head.config.num_future == 1 else \
            {"first_future_only": True}
        if tree is not None and self.num_future > 1:
            raise NotImplementedError("EAGLE-2 trees are not implemented for heads that draft K tokens per forward "
                                      f"(num_future={self.num_future}): pass tree=None for chains of K-token blocks, "
                                      "or blocks=False to draft the tree token by token")
        if guided_features and guidance_scale != 1.0:
            raise ValueError("guided_features drafts from features that are already guided: leave guidance_scale "
                             f"at 1.0 (got {guidance_scale})")
        self.confidence_threshold = confidence_threshold
        head._bound()
        self.head = head
        self.halves = 1 if guidance_scale == 1.0 else 2  # feature rows per token row
        #: the target features this drafter reads (``GuidedRunner``'s ``hidden`` under guidance)
        self.target_hidden = "guided" if guided_features else ("both" if self.halves == 2 else "cond")
        runner = CausalLMRunner(head, return_hidden=True)
        self.runner: Any = runner if self.halves == 1 else GuidedRunner(runner, guidance_scale, hidden="both")
        self.num_draft_tokens, self.sampling, self.tree, self.generator = num_draft_tokens, sampling, tree, generator
        self.argmax_drafts = argmax_drafts
        #: the next round's pairs: tokens [B, L] (-1 pad), features [B, L, d], each row's last valid slot
        self._pending_pairs: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None

    @property
    def calls(self) -> int:
        return self.runner.calls

    def prefill(self, context: PrefillContext) -> None:
        hidden = context.target.hidden
        if hidden is None:
            raise ValueError("EagleDrafter needs the target's hidden states: use CausalLMRunner(target, return_hidden=True)")
        if hidden.shape[-1] != self.head.config.hidden_size:
            raise ValueError(f"hidden size mismatch: the target's features have width {hidden.shape[-1]}, the EAGLE "
                             f"head expects {self.head.config.hidden_size} (a head trained for another target?)")
        if context.target.logits.shape[-1] != self.head.config.vocab_size:
            raise ValueError(f"vocab mismatch: the target has {context.target.logits.shape[-1]} tokens, the EAGLE "
                             f"head {self.head.config.vocab_size}")
        # Pairs (x_i, h_{i-1}) for the prompt, then (pending, h_{T-1}); condition prompts have no ids (-1).
        # A guided target runs 2B prompt rows [cond; uncond] and returns the B conditional features, or
        # all 2B rows for guided drafting.
        rows, length = hidden.shape[:2]
        batch = context.first_tokens.shape[0]
        if rows != batch * self.halves:
            raise ValueError(f"the target returned features for {rows} rows; guided drafting needs both halves "
                             f"({2 * batch}), plain drafting the conditional rows ({batch}): build the target "
                             "with GuidedRunner(..., hidden='both') exactly when guidance_scale != 1")
        ids = context.input_ids[:rows] if context.input_ids is not None else \
            torch.full((rows, length), -1, dtype=torch.long, device=hidden.device)
        prompt_mask = context.attention_mask[:rows]
        tokens = torch.cat([ids[:, 1:], context.first_tokens.repeat(self.halves).unsqueeze(1)], 1)
        valid = torch.cat([prompt_mask[:, 1:].bool(), torch.ones_like(tokens[:, :1], dtype=torch.bool)], 1)
        out = self.runner.prefill(tokens, valid.long(), target_hidden=hidden,  # a guided runner takes 2B rows
                                  **self.head_inputs)
        self._root = (out.logits[:, -1], out.hidden[:, -1])
        self._pending_pairs = None

    def _start_round(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the previous round's committed pairs; returns the root (logits [B, V], feature [B, d])."""
        self.runner.begin_round()
        if self._pending_pairs is None:  # right after prefill: the root is already computed
            self._prefix_keep = torch.zeros(self._root[0].shape[0], 0, dtype=torch.long, device=self._root[0].device)
            return self._root
        tokens, features, lasts = self._pending_pairs
        if min(lasts) == max(lasts):  # every row feeds as many pairs (batch 1): no padding, the root is the last slot
            self._prefix_keep = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
            out = self.runner.forward(tokens, target_hidden=features, logits_to_keep=1, **self.head_inputs)
            return out.logits[:, -1], out.hidden[:, -1]
        valid = tokens >= 0
        self._prefix_keep = keep_valid_slots(valid)
        first = min(lasts)  # logits only from the earliest row's last slot on
        out = self.runner.forward(tokens.clamp_min(0), valid=valid, target_hidden=features,
                                  logits_to_keep=tokens.shape[1] - first, **self.head_inputs)
        at = torch.tensor(lasts, device=tokens.device) - first  # each row's last valid slot among the kept
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        feature_rows = torch.arange(features.shape[0], device=tokens.device)
        return out.logits[rows, at], out.hidden[feature_rows, at.repeat(self.halves)]

    def propose(self, pending: torch.Tensor) -> DraftChain | DraftTree:
        logits, feature = self._start_round()
        if self.tree is not None:
            return self._propose_tree(logits, feature)
        state = {"feature": feature}
        single = self.num_future == 1  # else blocks: K drafts [B, K] with their features [B, K, d]

        def step(drawn: torch.Tensor) -> torch.Tensor:  # feed the head what it drafted, with its own features
            out = self.runner.forward(drawn.unsqueeze(1) if single else drawn,
                                      target_hidden=state["feature"].unsqueeze(1) if single else state["feature"],
                                      logits_to_keep=1, **self.head_inputs)
            state["feature"] = out.hidden[:, -1]  # the last pair's prediction(s)
            return out.logits[:, -1]

        return draft_chain(logits, step, self.capped(self.num_draft_tokens), self.sampling, self.generator,
                           self.confidence_threshold, argmax=self.argmax_drafts)

    def _propose_tree(self, root_logits: torch.Tensor, root_feature: torch.Tensor) -> DraftTree:
        batch = root_logits.shape[0]
        builder = TreeAttentionBuilder(batch, root_logits.device)
        tree_start = self.runner.num_slots
        features: dict[str, torch.Tensor] = {"ids": torch.empty(batch, 0, dtype=torch.long, device=root_logits.device),
                                             "values": root_feature.new_zeros(root_feature.shape[0], 0,
                                                                              root_feature.shape[-1])}

        def step(tokens, node_ids, parent_ids, depth):
            match = (features["ids"].unsqueeze(1) == parent_ids.unsqueeze(-1)).repeat(self.halves, 1, 1)  # [R, F, fed]
            parent_feature = (match.to(root_feature.dtype) @ features["values"]) if features["ids"].shape[1] else \
                torch.zeros(root_feature.shape[0], tokens.shape[1], root_feature.shape[-1], dtype=root_feature.dtype,
                            device=tokens.device)
            is_root = (parent_ids < 0).repeat(self.halves, 1).unsqueeze(-1)
            parent_feature = torch.where(is_root, root_feature.unsqueeze(1), parent_feature)
            offsets, attention = builder.frontier_inputs(node_ids, parent_ids, depth, tree_start)
            out = self.runner.forward(tokens, offsets=offsets, attention=attention, target_hidden=parent_feature,
                                      **self.head_inputs)
            features["ids"] = torch.cat([features["ids"], node_ids], 1)
            features["values"] = torch.cat([features["values"], out.hidden], 1)
            return out.logits.log_softmax(-1)

        root = root_logits.log_softmax(-1)
        return self.tree.expand(root, step, self.draft_limit)

    def commit(self, result: RoundResult) -> None:
        self.runner.commit(self._prefix_keep)
        self._pending_pairs = self._round_pairs(result)

    def commit_undrafted(self, result: RoundResult) -> None:
        """Learn a round this drafter proposed nothing for (a wrapper drafted it, e.g. a lookup-only round of
        :class:`~mmspec.lookup_tail.LookupTailDrafter`): the head's cache is untouched, and the round's pairs
        are fed after any still pending ones, together with the next round's. Rows must have committed
        equally many tokens in both (one image per call); otherwise pairs would need padding in between."""
        pairs = self._round_pairs(result)
        if self._pending_pairs is None:  # right after prefill: the root computed there is stale, these pairs go next
            self._pending_pairs = pairs
            return
        tokens, features, lasts = self._pending_pairs
        new_tokens, new_features, new_lasts = pairs
        if min(lasts) != max(lasts) or min(new_lasts) != max(new_lasts):
            raise NotImplementedError("an undrafted round after another needs rows that committed equally many "
                                      "tokens (one image per call); draft every round with several rows")
        # no padding in either: the new pairs follow the pending ones, whose last slot is lasts[0]
        self._pending_pairs = (torch.cat([tokens, new_tokens], 1), torch.cat([features, new_features], 1),
                               [last + 1 + new_lasts[0] for last in lasts])

    def _round_pairs(self, result: RoundResult) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The round's pairs for the head (``_pending_pairs``' layout: each row's last valid slot is its
        number of accepted drafts)."""
        if result.target_hidden is None:
            raise ValueError("EagleDrafter needs the target's hidden states of the committed tokens")
        # Next round's pairs: (accepted draft j, h of the token before it), then (new pending, h of the last);
        # row b has num_accepted[b] + 1 of them, and columns past the longest row's would be padding in every
        # row, so they are not fed at all.
        committed, counts = result.committed, result.num_accepted_list()
        width = max(counts) + 1
        if min(counts) == max(counts):  # no padding: slices
            tokens = torch.cat([committed[:, 1:width], result.next_tokens.unsqueeze(1)], 1)
        else:
            steps = torch.arange(width, device=committed.device)
            n = result.num_accepted.unsqueeze(1)
            shifted = torch.cat([committed[:, 1:], committed.new_full((committed.shape[0], 1), -1)], 1)[:, :width]
            tokens = torch.where(steps < n, shifted, torch.where(steps == n, result.next_tokens.unsqueeze(1), -1))
        return tokens, result.target_hidden[:, :width], counts
