"""GRPO math as pure functions on torch tensors.

Ragged data is packed: a flat ``values`` tensor plus ``cu_seqlens``, int64 offsets of
length ``B + 1`` with ``cu_seqlens[0] == 0``; row ``i`` is ``values[cu[i]:cu[i+1]]``.

- :func:`build_batch` right-pads prompt+response rows for a forward pass.
- :func:`token_logprobs` recomputes response-token log-probabilities with given weights
  (policy recompute and reference pass alike).
- :func:`group_advantages`: ``(r - mean_group) / (std_group + eps)``, vectorised.
- :func:`grpo_loss`: PPO-clipped surrogate with per-sample advantages broadcast to
  tokens, plus an optional k3 KL penalty to a reference policy, and an optional
  behaviour-policy correction: truncated importance sampling (TIS, decoupled PPO) weights
  each token by ``min(pi_old / pi_behav, C)``, where ``pi_behav`` is the sampler's
  probability (stored with the rollout) and ``pi_old`` the proximal policy's (recomputed
  by the trainer), which differ when the rollout engine lags or computes differently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from flowrl.models.sampler import nucleus_logprobs

__all__ = ["build_batch", "group_advantages", "grpo_loss", "token_logprobs"]

Aggregation = Literal["token-mean", "seq-mean"]


def _lengths(cu_seqlens: Tensor) -> Tensor:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype != torch.long:
        raise ValueError(
            f"cu_seqlens expects a 1-D int64 tensor of B + 1 offsets, got dtype "
            f"{cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}"
        )
    return cu_seqlens.diff()


def build_batch(
    prompts: Sequence[Tensor], responses: Sequence[Tensor], *, pad_id: int = 0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Right-pad ``prompt + response`` rows.

    Returns ``(input_ids (B, T), attention_mask (B, T) bool, response_starts (B,),
    response_cu_seqlens (B + 1,))`` as :func:`token_logprobs` takes them.
    """
    if len(prompts) != len(responses):
        raise ValueError(
            f"build_batch got {len(prompts)} prompts but {len(responses)} responses; "
            "pass one response per prompt (repeat prompts for groups)"
        )
    p_len = torch.tensor([p.numel() for p in prompts], dtype=torch.long)
    r_len = torch.tensor([r.numel() for r in responses], dtype=torch.long)
    total = p_len + r_len
    width = int(total.max()) if len(prompts) else 0
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[i, : p.numel()] = p
        ids[i, p.numel() : p.numel() + r.numel()] = r
    mask = torch.arange(width)[None, :] < total[:, None]
    cu = torch.zeros(len(prompts) + 1, dtype=torch.long)
    torch.cumsum(r_len, dim=0, out=cu[1:])
    return ids, mask, p_len, cu


def token_logprobs(
    model: Callable[..., Tensor],
    input_ids: Tensor,
    attention_mask: Tensor,
    response_starts: Tensor,
    response_cu_seqlens: Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> Tensor:
    """Packed float32 log-probabilities of the response tokens under ``model``.

    Row ``i`` of ``input_ids`` holds its response at positions
    ``[response_starts[i], response_starts[i] + len_i)`` where ``len_i`` comes from
    ``response_cu_seqlens``; every response must follow at least one prompt token.
    ``top_p`` < 1: under the distribution a top-p sampler draws from, renormalised over
    the nucleus (:func:`flowrl.models.nucleus_logprobs`; ``-inf`` for a token outside it),
    which is what the rollout engines record as sampler log-probs.
    Gradients flow unless called under ``torch.no_grad()``.
    """
    lengths = _lengths(response_cu_seqlens)
    if temperature <= 0:
        raise ValueError(f"token_logprobs expects temperature > 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"token_logprobs expects top_p in (0, 1], got {top_p}")
    if bool((response_starts < 1).any()):
        raise ValueError("token_logprobs expects every response_starts >= 1 (a prompt first)")
    logits = model(input_ids, attention_mask=attention_mask)
    n_tokens = int(response_cu_seqlens[-1])
    row = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=n_tokens
    )
    offset = torch.arange(n_tokens, device=lengths.device) - response_cu_seqlens[row]
    pos = response_starts[row] + offset
    picked = logits[row, pos - 1].float() / temperature
    targets = input_ids[row, pos]
    return nucleus_logprobs(picked, top_p).gather(1, targets[:, None]).squeeze(1)


def group_advantages(
    rewards: Tensor, group_ids: Tensor, eps: float = 1e-6, *, unbiased: bool = True
) -> Tensor:
    """GRPO advantages ``(r - mean_g) / (std_g + eps)`` over groups sharing a ``group_id``.

    ``group_ids`` may be any integers. ``std`` is the Bessel-corrected sample std when
    ``unbiased`` (as ``torch.std``); a one-sample group gets advantage 0. Statistics are
    accumulated in float64; the result has ``rewards``' dtype.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"group_advantages expects 1-D rewards and group_ids of one shape, got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    r = rewards.double()
    n_groups = counts.numel()
    sums = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
    mean = sums / counts
    centered = r - mean[inverse]
    sq = torch.zeros_like(sums).index_add_(0, inverse, centered.square())
    denom = (counts - 1).clamp(min=1) if unbiased else counts
    std = (sq / denom).sqrt()
    return (centered / (std[inverse] + eps)).to(rewards.dtype)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    cu_seqlens: Tensor,
    *,
    ref_logprobs: Tensor | None = None,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    aggregation: Aggregation = "token-mean",
    sample_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO objective (to minimise) and float metrics.

    Per token ``t`` of sample ``i``: ``ratio = exp(logprobs - old_logprobs)``,
    ``pg = max(-A_i * ratio, -A_i * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))``
    (``clip_eps_high`` defaults to ``clip_eps``), plus ``kl_coef * k3`` with
    ``k3 = exp(ref - logprobs) - (ref - logprobs) - 1`` when ``ref_logprobs`` is given.
    ``aggregation``: ``"token-mean"`` averages over all tokens of the batch;
    ``"seq-mean"`` averages each sequence's tokens, then the non-empty sequences.

    Behaviour-policy correction: with ``tis_cap`` ``C`` and the sampler's
    ``sample_logprobs``, each token's policy-gradient term is multiplied by the constant
    ``w = min(exp(old_logprobs - sample_logprobs), C)`` (no gradient flows through it).

    Metrics: ``pg_loss``, ``kl_ref`` (mean k3), ``approx_kl`` (k3 estimate of KL(old || new)),
    ``clip_fraction`` (tokens where the clipped branch is active), ``ratio_mean``,
    ``ratio_max``, ``n_tokens``; with TIS also ``is_ratio_mean`` and ``is_ratio_max``
    (``pi_old / pi_behav`` before truncation) and ``is_truncated_fraction`` (tokens whose
    ratio exceeded ``C``).
    """
    lengths = _lengths(cu_seqlens)
    n_tokens = logprobs.numel()
    if old_logprobs.shape != logprobs.shape or logprobs.dim() != 1:
        raise ValueError(
            f"grpo_loss expects 1-D logprobs and old_logprobs of one shape, got "
            f"{tuple(logprobs.shape)} and {tuple(old_logprobs.shape)}"
        )
    if int(cu_seqlens[-1]) != n_tokens or advantages.shape != lengths.shape:
        raise ValueError(
            f"grpo_loss: cu_seqlens covers {int(cu_seqlens[-1])} tokens of "
            f"{lengths.numel()} samples, but got {n_tokens} logprobs and advantages of "
            f"shape {tuple(advantages.shape)}; advantages are per sample, logprobs per token"
        )
    if ref_logprobs is not None and ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"grpo_loss expects ref_logprobs shaped like logprobs {tuple(logprobs.shape)}, "
            f"got {tuple(ref_logprobs.shape)}"
        )
    if tis_cap is not None and (sample_logprobs is None or not tis_cap > 0):
        got = "None" if sample_logprobs is None else "a tensor"
        raise ValueError(
            f"grpo_loss: tis_cap expects a cap C > 0 and the sampler's sample_logprobs, got "
            f"tis_cap={tis_cap!r} and sample_logprobs={got}; pass both (e.g. tis_cap=2.0)"
        )
    if sample_logprobs is not None and sample_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"grpo_loss expects sample_logprobs shaped like logprobs {tuple(logprobs.shape)}, "
            f"got {tuple(sample_logprobs.shape)}"
        )
    if aggregation not in ("token-mean", "seq-mean"):
        raise ValueError(
            f"grpo_loss aggregation expects 'token-mean' or 'seq-mean', got {aggregation!r}"
        )
    high = clip_eps if clip_eps_high is None else clip_eps_high

    adv = torch.repeat_interleave(advantages.to(logprobs.dtype), lengths, output_size=n_tokens)
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    per_token = torch.maximum(pg_unclipped, pg_clipped)
    is_ratio = None
    if tis_cap is not None and sample_logprobs is not None:
        is_ratio = (old_logprobs - sample_logprobs).detach().exp()
        per_token = per_token * is_ratio.clamp(max=tis_cap)
    pg_per_token = per_token
    kl_ref = None
    if ref_logprobs is not None:
        d = ref_logprobs - logprobs
        kl_ref = d.exp() - d - 1.0
        if kl_coef:
            per_token = per_token + kl_coef * kl_ref

    def aggregate(x: Tensor) -> Tensor:
        if aggregation == "token-mean":
            return x.sum() / max(n_tokens, 1)
        row = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=x.device), lengths, output_size=n_tokens
        )
        per_seq = torch.zeros(lengths.numel(), dtype=x.dtype, device=x.device).index_add(0, row, x)
        nonempty = lengths > 0
        return (per_seq[nonempty] / lengths[nonempty]).sum() / max(int(nonempty.sum()), 1)

    loss = aggregate(per_token)
    with torch.no_grad():
        metrics = {
            "pg_loss": aggregate(pg_per_token).item(),
            "kl_ref": aggregate(kl_ref).item() if kl_ref is not None else 0.0,
            "approx_kl": aggregate(ratio - 1.0 - log_ratio).item(),
            "clip_fraction": aggregate((pg_clipped > pg_unclipped).to(logprobs.dtype)).item(),
            "ratio_mean": aggregate(ratio).item(),
            "ratio_max": ratio.max().item() if n_tokens else 1.0,
            "n_tokens": float(n_tokens),
        }
        if is_ratio is not None and tis_cap is not None:
            metrics["is_ratio_mean"] = aggregate(is_ratio).item()
            metrics["is_ratio_max"] = is_ratio.max().item() if n_tokens else 1.0
            truncated = (is_ratio > tis_cap).to(logprobs.dtype)
            metrics["is_truncated_fraction"] = aggregate(truncated).item()
    return loss, metrics
