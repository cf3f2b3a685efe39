"""A small decoder-only causal transformer, written from scratch in torch.

Token embedding plus learned absolute positions, pre-LN blocks (multi-head causal
self-attention through ``scaled_dot_product_attention``, GELU MLP), a final LayerNorm and
an output head tied to the token embedding. No dropout: log-probabilities must be a
deterministic function of the weights, as RL recompute and reference passes require.

Padding. Rows may be padded on either side; ``attention_mask`` (``True`` = real token)
hides padded keys, and position ids count real tokens only (``cumsum(mask) - 1``), so a
left-padded prompt gets the same positions as an unpadded one. Padded query positions
attend to themselves only; their outputs are finite but meaningless.

Incremental decoding. :meth:`TinyLM.new_cache` preallocates one K and one V tensor of
shape ``(n_layers, batch, n_heads, max_len, head_dim)``; every forward with ``cache=``
writes the new keys/values in place at ``[cache.length, cache.length + T)`` and attends
over the filled prefix. All rows advance in lockstep; per-row positions live in
``cache.positions`` so rows with different amounts of padding stay correct.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import final

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["KVCache", "TinyLM", "TinyLMConfig"]


@final
@dataclass(frozen=True, kw_only=True)
class TinyLMConfig:
    """Shape of a :class:`TinyLM`; validated at construction."""

    vocab_size: int
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 512
    max_seq_len: int = 64

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"TinyLMConfig.{name} expects a positive int, got {value!r}; "
                    "pass e.g. TinyLMConfig(vocab_size=16)"
                )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"TinyLMConfig.d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); pick n_heads among the divisors of d_model"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads


@final
@dataclass(eq=False)
class KVCache:
    """Preallocated keys/values for incremental decoding of one batch (mutated in place).

    ``keys``/``values``: ``(n_layers, B, n_heads, max_len, head_dim)``;
    ``key_mask``: ``(B, max_len)`` bool, ``True`` where a real token was written;
    ``positions``: ``(B,)`` int64, the position id the next real token of each row gets;
    ``length``: how many slots are filled (the same for every row).
    """

    keys: Tensor
    values: Tensor
    key_mask: Tensor
    positions: Tensor
    length: int = 0

    @property
    def max_len(self) -> int:
        """Number of slots preallocated per row."""
        return self.keys.shape[3]

    def select(self, rows: Tensor) -> KVCache:
        """A cache holding only the given rows (int64 indices), in that order."""
        return KVCache(
            keys=self.keys[:, rows],
            values=self.values[:, rows],
            key_mask=self.key_mask[rows],
            positions=self.positions[rows],
            length=self.length,
        )


def _positions_from_mask(mask: Tensor, offset: Tensor | None = None) -> Tensor:
    """Position id of each token: number of real tokens before it (plus ``offset``)."""
    pos = mask.long().cumsum(dim=1) - 1
    if offset is not None:
        pos = pos + offset[:, None]
    return pos.clamp_(min=0)


class _Attention(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: Tensor, allowed: Tensor, cache: KVCache | None, layer: int) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache is not None:
            start, end = cache.length, cache.length + t
            cache.keys[layer, :, :, start:end] = k
            cache.values[layer, :, :, start:end] = v
            k = cache.keys[layer, :, :, :end]
            v = cache.values[layer, :, :, :end]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = _Attention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff),
            nn.GELU(),
            nn.Linear(config.d_ff, config.d_model),
        )

    def forward(self, x: Tensor, allowed: Tensor, cache: KVCache | None, layer: int) -> Tensor:
        x = x + self.attn(self.ln_attn(x), allowed, cache, layer)
        return x + self.mlp(self.ln_mlp(x))


@final
class TinyLM(nn.Module):
    """Decoder-only causal LM; ``model(input_ids) -> logits (B, T, vocab_size)``."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.apply(self._init_weights)
        # GPT-2 style: shrink the residual-branch output projections with depth.
        for name, param in self.named_parameters():
            if name.endswith(("attn.out.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def new_cache(
        self, batch_size: int, max_len: int | None = None, *, device: torch.device | None = None
    ) -> KVCache:
        """Allocate an empty :class:`KVCache` for ``batch_size`` rows of ``max_len`` slots."""
        cfg = self.config
        max_len = cfg.max_seq_len if max_len is None else max_len
        if max_len < 1:
            raise ValueError(f"new_cache expects max_len >= 1, got {max_len}")
        param = self.tok_emb.weight
        device = param.device if device is None else device
        shape = (cfg.n_layers, batch_size, cfg.n_heads, max_len, cfg.head_dim)
        return KVCache(
            keys=torch.zeros(shape, dtype=param.dtype, device=device),
            values=torch.zeros(shape, dtype=param.dtype, device=device),
            key_mask=torch.zeros(batch_size, max_len, dtype=torch.bool, device=device),
            positions=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """Logits ``(B, T, vocab_size)`` for ``input_ids`` ``(B, T)``.

        ``attention_mask`` ``(B, T)`` marks real tokens (default: all real). With
        ``cache``, the tokens continue the cached prefix and the cache is advanced.
        """
        b, t = input_ids.shape
        device = input_ids.device
        mask = (
            torch.ones(b, t, dtype=torch.bool, device=device)
            if attention_mask is None
            else attention_mask.to(torch.bool)
        )
        if cache is None:
            positions = _positions_from_mask(mask)
        else:
            if cache.length + t > cache.max_len or cache.keys.shape[1] != b:
                raise ValueError(
                    f"KV cache of batch {cache.keys.shape[1]} holding {cache.length} of "
                    f"{cache.max_len} slots cannot take {t} new tokens for batch {b}; "
                    "allocate a matching cache with new_cache(batch_size, max_len)"
                )
            positions = _positions_from_mask(mask, cache.positions)
        if positions.numel() and int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(
                f"position {int(positions.max())} exceeds max_seq_len "
                f"{self.config.max_seq_len}; shorten the sequence or enlarge the config"
            )
        eye_offset = 0
        if cache is None:
            key_mask = mask
        else:  # validated above: only now mutate the cache
            start = cache.length
            cache.key_mask[:, start : start + t] = mask
            cache.positions += mask.sum(dim=1)
            key_mask = cache.key_mask[:, : start + t]
            eye_offset = start
        # allowed[b, 0, i, j]: query i may attend key j (causal, real keys, self always).
        n_keys = key_mask.shape[1]
        q_idx = torch.arange(t, device=device)[:, None] + eye_offset
        k_idx = torch.arange(n_keys, device=device)[None, :]
        causal = k_idx <= q_idx
        allowed = (causal & key_mask[:, None, :]) | (k_idx == q_idx)
        allowed = allowed[:, None]

        x = self.tok_emb(input_ids) + self.pos_emb(positions)
        for layer, block in enumerate(self.blocks):
            x = block(x, allowed, cache, layer)
        if cache is not None:
            cache.length += t
        return self.ln_f(x) @ self.tok_emb.weight.T
