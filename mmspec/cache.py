"""KV-cache rollback and per-row slot bookkeeping for batched speculative decoding.

Speculation appends drafted tokens to a model's KV cache and then keeps only what was accepted. Rows of
a batch accept different numbers of tokens, while a cache tensor has one length for all rows. We use
the pad-and-mask scheme: every row appends the same number of *slots*; after verification the cache
keeps ``max_b(kept_b)`` new slots, rows that kept fewer mark the rest invalid (a hole that the attention
mask hides), and each row keeps its own position counter. :class:`SlotState` is that bookkeeping;
:func:`crop_cache` and :func:`select_cache_slots` operate on transformers caches (``DynamicCache`` and
legacy tuples) and on the project's own :class:`KVCache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmspec.validation import check_ndim


class KVCache:
    """Preallocated key/value buffers ``[B, H, S_max, D]`` per layer with a fill pointer.

    ``update(layer, k, v)`` writes ``T`` new slots at the pointer and returns the filled views; the
    pointer advances after the last layer. Rolling back is moving the pointer (``crop``), so it is free.
    When more slots are needed than preallocated, the buffers double (``growable=True``, the default)
    or a ``ValueError`` is raised.
    """

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, head_dim: int, max_length: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 growable: bool = True) -> None:
        shape = (num_layers, batch_size, num_heads, max_length, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers, self.max_length, self.length, self.growable = num_layers, max_length, 0, growable

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = keys.shape[2]
        end = self.length + new
        if end > self.max_length:
            if not self.growable:
                raise ValueError(f"KVCache overflow: {end} slots needed, max_length is {self.max_length}")
            self._grow(max(end, 2 * self.max_length))
        self.keys[layer, :, :, self.length:end] = keys
        self.values[layer, :, :, self.length:end] = values
        if layer == self.num_layers - 1:
            self.length = end
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def _grow(self, capacity: int) -> None:
        pad = capacity - self.max_length
        self.keys = torch.nn.functional.pad(self.keys, (0, 0, 0, pad))
        self.values = torch.nn.functional.pad(self.values, (0, 0, 0, pad))
        self.max_length = capacity

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length

    def select_slots(self, start: int, index: torch.Tensor) -> None:
        """Keep slots ``start + index[b]`` (``[B, M]``, ``-1`` = hole) at ``start..start+M``; crop after."""
        slots = (start + index.clamp_min(0)).to(self.keys.device)
        end = start + index.shape[1]
        self.keys[:, :, :, start:end] = _gather_slots(self.keys, slots, dim=3)
        self.values[:, :, :, start:end] = _gather_slots(self.values, slots, dim=3)
        self.length = end


def _gather_slots(tensor: torch.Tensor, slots: torch.Tensor, dim: int) -> torch.Tensor:
    """Gather per-row slot indices ``slots [B, M]`` along ``dim`` of ``tensor [..., B, H, S, D]``.

    A contiguous tensor is read as rows of ``D`` values with one ``index_select`` (whole rows copied);
    ``torch.gather`` with an index expanded over every dimension reads element by element, several
    times slower on the CPU for a model's cache (LlamaGen-L's, batch 4 with guidance: ~17 ms a round).
    """
    batch_dim = dim - 2
    if tensor.is_contiguous() and dim == tensor.ndim - 2:
        lead, (batch, heads, length, width) = tensor.shape[:batch_dim], tensor.shape[batch_dim:]
        # the row of every kept slot in the tensor flattened to [everything but D, D]
        starts = torch.arange(tensor.numel() // (length * width), device=tensor.device) * length
        rows = starts.view(-1, batch, heads, 1) + slots.unsqueeze(1)  # [lead, B, H, M]
        taken = tensor.view(-1, width).index_select(0, rows.reshape(-1))
        return taken.view(*lead, batch, heads, slots.shape[1], width)
    shape = [1] * tensor.ndim
    shape[batch_dim], shape[dim] = slots.shape[0], slots.shape[1]
    index = slots.reshape(shape)
    expand = list(tensor.shape)
    expand[dim] = slots.shape[1]
    return tensor.gather(dim, index.expand(expand))


def cache_length(cache: Any) -> int:
    """Number of slots in a transformers cache, a legacy tuple cache or a :class:`KVCache`."""
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    if isinstance(cache, (tuple, list)):
        return 0 if not cache else int(cache[0][0].shape[2])
    raise ValueError(f"unsupported cache type {type(cache).__name__}")


def crop_cache(cache: Any, length: int) -> Any:
    """Drop every slot at or after ``length``. Returns the cache (a new tuple for legacy caches)."""
    if isinstance(cache, (tuple, list)):
        return tuple((k[:, :, :length], v[:, :, :length], *rest) for k, v, *rest in cache)
    if isinstance(cache, KVCache):
        cache.crop(length)
        return cache
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"cannot roll back a cache of type {type(cache).__name__}")
    # transformers caches: slice each layer (the meaning of Cache.crop's argument changed in v5)
    for layer in layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]
    return cache


def keeps_prefix(index: torch.Tensor) -> bool:
    """True when every row of ``index [B, M]`` is ``0, 1, ..., M-1``: the selection is a crop (read on the
    host at once, as :func:`drop_trailing_holes` does)."""
    return rows_keep_prefix(index.tolist(), index.shape[1])


def rows_keep_prefix(rows: list[list[int]], width: int) -> bool:
    """:func:`keeps_prefix` of the first ``width`` columns of indices already read on the host."""
    prefix = list(range(width))
    return all(row[:width] == prefix for row in rows)


def select_cache_slots(cache: Any, start: int, index: torch.Tensor) -> Any:
    """Keep, per row, the slots ``start + index[b, :]`` (``-1`` entries become holes), packed at ``start``.

    This is how an accepted tree path (scattered slots) becomes a contiguous prefix of the cache. A
    selection that keeps each row's first M slots in order (a target-only step, a fully accepted chain)
    is a crop and moves nothing.
    """
    check_ndim(index, 2, "index", "[B, M]")
    if keeps_prefix(index):  # every row keeps its first M slots in order (target-only steps, full acceptance)
        return crop_cache(cache, start + index.shape[1])
    return move_cache_slots(cache, start, index)


def move_cache_slots(cache: Any, start: int, index: torch.Tensor) -> Any:
    """:func:`select_cache_slots` for a selection known not to be a prefix: always gathers."""
    if isinstance(cache, KVCache):
        cache.select_slots(start, index)
        return cache
    if isinstance(cache, (tuple, list)):
        slots = (start + index.clamp_min(0))
        return tuple((torch.cat([k[:, :, :start], _gather_slots(k, slots.to(k.device), 2)], 2),
                      torch.cat([v[:, :, :start], _gather_slots(v, slots.to(v.device), 2)], 2)) for k, v, *_ in cache)
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"cannot select slots of a cache of type {type(cache).__name__}")
    end = start + index.shape[1]
    for layer in layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        slots = (start + index.clamp_min(0)).to(layer.keys.device)
        # in place: the kept slots move down to start..end and the layer becomes a view of its first `end`
        # slots, so a commit copies M slots instead of the whole cache (torch.cat of the prefix did)
        for name in ("keys", "values"):
            tensor = getattr(layer, name)
            tensor[:, :, start:end] = _gather_slots(tensor, slots, 2)
            setattr(layer, name, tensor[:, :, :end])
    return cache


def drop_trailing_holes(keep: torch.Tensor) -> torch.Tensor:
    """``keep [B, M]`` (slot indices, ``-1`` = hole) without its last columns that are holes in every row.

    A round appends M slots per row, and rows keep different numbers of them; the commit must keep
    ``max_b(kept_b)`` slots, not M: the slots after every row's last kept one would stay in the cache as
    holes, which every later forward attends over (masked) and which make the cache grow. For a
    single row with a chain this turns the commit into a crop (nothing is gathered). The few indices are
    read on the host at once: this runs on every commit, where each small tensor operation is costly.
    """
    check_ndim(keep, 2, "keep", "[B, M]")
    return keep[:, :kept_width(keep.tolist())]


def kept_width(keep: list[list[int]]) -> int:
    """The columns of ``keep`` (read on the host) up to the last one some row keeps (:func:`drop_trailing_holes`)."""
    return max((max((j + 1 for j, slot in enumerate(row) if slot >= 0), default=0) for row in keep), default=0)


def keep_valid_slots(valid: torch.Tensor) -> torch.Tensor:
    """Keep indices ``[B, T]`` for a commit that keeps a round's valid slots (``-1`` for the others)."""
    return torch.where(valid, torch.arange(valid.shape[1], device=valid.device), -1)


@dataclass
class SlotState:
    """Which cache slots hold real tokens, per row, and where each row's positions stand.

    A *round* is one speculation step: it starts at :meth:`begin_round`, appends slots (drafts, tree
    nodes), and ends with :meth:`commit`, which packs the kept slots right after the round's start.

    Attributes:
        valid: bool ``[B, S]``, False for padding and for holes left by rows that kept fewer tokens.
        last_position: LongTensor ``[B]``, position id of the row's latest chain token.
    """

    valid: torch.Tensor
    last_position: torch.Tensor
    round_start: int = 0
    round_base: torch.Tensor | None = None
    #: whether every slot this round appended is a valid chain slot (appended by count, no tree offsets):
    #: a commit that keeps a prefix of them then needs no mask arithmetic (:meth:`keep_first`)
    round_all_valid: bool = False

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor) -> SlotState:
        """State after a (left- or right-padded) prompt: positions count valid tokens only."""
        mask = attention_mask.bool()
        return cls(mask, mask.long().sum(-1) - 1)

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def prompt_positions(self) -> torch.Tensor:
        """Position ids ``[B, S]`` for the prompt slots: 0, 1, ... over valid slots."""
        return (self.valid.long().cumsum(-1) - 1).clamp_min(0)

    def begin_round(self) -> None:
        self.round_start = self.num_slots
        self.round_base = self.last_position  # (tensors are replaced, never changed in place)
        self.round_all_valid = True

    def append(self, new_valid: torch.Tensor | int, offsets: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``T`` slots; returns ``(positions [B, T], key_mask [B, S + T])``.

        ``new_valid``: bool ``[B, T]``, or the number ``T`` of slots when all of them are valid (a chain's
        drafts, a head step: the common case, built here in fewer operations). Without ``offsets`` the
        slots continue each row's chain (invalid slots do not advance it). With ``offsets [B, T]`` (tree
        nodes) slot t gets position ``last_position + 1 + offsets[:, t]`` and the chain position is left
        unchanged (each row keeps its own positions, e.g. padded prompts).
        """
        if isinstance(new_valid, int):
            new_valid = self.valid.new_ones(self.valid.shape[0], new_valid)
            if offsets is None:  # every slot advances the chain by one
                positions = self.last_position.unsqueeze(-1) + torch.arange(
                    1, new_valid.shape[1] + 1, device=new_valid.device)
                self.last_position = self.last_position + new_valid.shape[1]
                self.valid = torch.cat([self.valid, new_valid], dim=1)
                return positions, self.valid
        self.round_all_valid = False
        new_valid = new_valid.bool()
        key_mask = torch.cat([self.valid, new_valid], dim=1)
        if offsets is not None:
            positions = self.last_position.unsqueeze(-1) + 1 + offsets
        else:
            steps = new_valid.long().cumsum(-1)
            positions = self.last_position.unsqueeze(-1) + steps.clamp_min(1)
            self.last_position = self.last_position + steps[:, -1]
        self.valid = key_mask
        return positions, key_mask

    def keep_first(self, count: int) -> None:
        """Keep this round's first ``count`` slots as they are (every row, in order) and drop the rest: the
        commit of a prefix when the round appended valid chain slots only (:attr:`round_all_valid`)."""
        if self.round_base is None or not self.round_all_valid:
            raise RuntimeError("keep_first() needs a round that appended valid chain slots only")
        self.valid = self.valid[:, : self.round_start + count]
        self.last_position = self.round_base + count

    def commit(self, keep: torch.Tensor) -> None:
        """Replace this round's slots by the packed ``keep`` set (``[B, M]`` indices relative to the
        round start, ``-1`` = hole); kept slots must be consecutive chain tokens of each row."""
        if self.round_base is None:
            raise RuntimeError("commit() without begin_round()")
        kept = keep >= 0
        self.valid = torch.cat([self.valid[:, : self.round_start], kept], dim=1)
        self.last_position = self.round_base + kept.long().sum(-1)
