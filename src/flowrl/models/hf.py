"""A Hugging Face ``transformers`` causal LM as a flowrl policy.

:func:`tiny_llama` builds a small ``LlamaForCausalLM`` from a config written in code
(random init, nothing downloaded); ``model.save_pretrained(path)`` writes the Hugging Face
directory (``config.json`` + ``model.safetensors``) that vLLM and ``from_pretrained`` load.

:class:`HFCausalLM` calls such a model the way flowrl calls :class:`~flowrl.models.TinyLM`
(:class:`~flowrl.models.causal.CausalLM`): a padded batch with ``attention_mask`` and
explicit ``position_ids`` counting real tokens only (so a left-padded prompt gets the
positions of an unpadded one), and incremental decoding through ``past_key_values`` with
a 2-D key mask over the whole cached prefix. ``transformers`` is imported only here.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, final

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

__all__ = ["HFCache", "HFCausalLM", "tiny_llama"]


@final
@dataclass(eq=False)
class HFCache:
    """``past_key_values`` of a decoding batch, with the mask of its cached keys and the
    position id the next real token of each row gets."""

    past: Any
    key_mask: Tensor
    positions: Tensor

    def select(self, rows: Tensor) -> HFCache:
        """The cache of the given rows (int64 indices), in that order."""
        self.past.batch_select_indices(rows)
        return HFCache(self.past, self.key_mask[rows], self.positions[rows])


@final
class HFCausalLM:
    """``transformers`` causal LM under flowrl's calling convention (module docstring).

    ``module`` is the model (or a wrapper forwarding its keyword arguments, such as a
    DeepSpeed engine); parameters, names and training mode stay on it.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        # transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns)
        forward = getattr(module, "module", module).forward
        named = inspect.signature(forward).parameters
        self._cache_kwarg = "cache" if "cache" in named else "past_key_values"

    def new_cache(
        self, batch_size: int, max_len: int | None = None, *, device: torch.device | None = None
    ) -> HFCache:
        """An empty cache for ``batch_size`` rows (``max_len`` is unused: it grows)."""
        from transformers import DynamicCache

        return HFCache(
            DynamicCache(),
            torch.zeros(batch_size, 0, dtype=torch.bool, device=device),
            torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    def __call__(
        self, input_ids: Tensor, *, attention_mask: Tensor | None = None, cache: Any = None
    ) -> Tensor:
        """Logits ``(B, T, vocab)``; with ``cache`` the tokens continue it and it advances."""
        mask = (
            torch.ones_like(input_ids, dtype=torch.bool)
            if attention_mask is None
            else attention_mask.to(torch.bool)
        )
        offset = 0 if cache is None else cache.positions[:, None]
        positions = (mask.long().cumsum(dim=1) - 1 + offset).clamp_(min=0)
        if cache is None:
            out = self.module(
                input_ids=input_ids, attention_mask=mask.long(), position_ids=positions
            )
            return out.logits
        keys = torch.cat([cache.key_mask, mask], dim=1)
        out = self.module(
            input_ids=input_ids,
            attention_mask=keys.long(),
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: cache.past},
        )
        cache.key_mask = keys
        cache.positions = cache.positions + mask.sum(dim=1)
        return out.logits


def tiny_llama(
    *,
    vocab_size: int,
    hidden_size: int = 128,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_positions: int = 256,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` of the given shape, float32, in eval
    mode, with tied input/output embeddings and SDPA attention (``transformers`` needed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads or n_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",  # type: ignore[call-arg]
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()
