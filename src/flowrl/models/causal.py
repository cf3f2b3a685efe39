"""What the sampler, log-prob recompute and the torch engines call a policy model through.

:class:`CausalLM` is the calling convention of :class:`~flowrl.models.TinyLM`:
``model(input_ids, attention_mask=..., cache=...) -> logits (B, T, vocab)``, a left- or
right-padded batch with ``attention_mask`` marking real tokens (position ids count real
tokens only), and ``new_cache(batch_size, max_len)`` for incremental decoding, the cache
advancing in place with every forward and :meth:`DecodeCache.select` keeping some rows.
:func:`as_causal_lm` adapts a module to it: a TinyLM is one already; a Hugging Face
``transformers`` causal LM is wrapped in :class:`~flowrl.models.hf.HFCausalLM`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from flowrl.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = ["CausalLM", "DecodeCache", "as_causal_lm", "max_positions"]


class DecodeCache(Protocol):
    """Keys and values of a decoding batch; rows can be dropped as requests end."""

    def select(self, rows: Tensor) -> DecodeCache:
        """The cache of the given rows (int64 indices), in that order."""
        ...


class CausalLM(Protocol):
    """A causal LM called as :class:`~flowrl.models.TinyLM` is (module docstring)."""

    def __call__(
        self, input_ids: Tensor, *, attention_mask: Tensor | None = None, cache: Any = None
    ) -> Tensor: ...

    def new_cache(
        self, batch_size: int, max_len: int | None = None, *, device: torch.device | None = None
    ) -> Any: ...


def as_causal_lm(module: torch.nn.Module) -> CausalLM:
    """``module`` under the :class:`CausalLM` convention: a TinyLM as it is, a
    ``transformers`` causal LM (``PreTrainedModel``) through
    :class:`~flowrl.models.hf.HFCausalLM`."""
    from flowrl.models.transformer import TinyLM

    if isinstance(module, TinyLM):
        return module
    if _is_hf(module):
        from flowrl.models.hf import HFCausalLM

        return HFCausalLM(module)
    raise ConfigError(
        f"engines take a flowrl.models.TinyLM or a transformers causal LM, got "
        f"{type(module).__name__}; wrap other models to the flowrl.models.CausalLM convention"
    )


def max_positions(module: torch.nn.Module) -> int:
    """The longest sequence (prompt + response) ``module`` takes."""
    config = getattr(module, "config", None)
    for name in ("max_seq_len", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ConfigError(
        f"{type(module).__name__} has no config.max_seq_len or config.max_position_embeddings; "
        "engines need the longest sequence the model takes"
    )


def _is_hf(module: object) -> bool:
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    )
