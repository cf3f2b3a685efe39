"""Plain synchronous GRPO on CPU: a tiny transformer learns 1-2 digit addition by RL.

What it measures: whether the RL pieces (``flowrl.models``, ``flowrl.tasks``,
``flowrl.rl``) raise the reward of a weak policy, with no hub involved.

How it runs:

1. Warm-up (supervised, :func:`flowrl.tasks.pretrain`): ``--clean-steps`` on correct
   answers, then ``--noisy-steps`` on answers of which a share ``--noise`` has one wrong
   digit. The second phase leaves a policy that still ranks the right answer highly but
   *samples* it only ~20 % of the time: a low but non-zero reward for RL to raise.
2. GRPO: each step samples ``--samples`` responses (temperature 1) for each of
   ``--prompts`` fresh problems, scores them with the rule-based ``verify`` (1 for the
   exact sum followed by EOS, else 0), computes group-normalised advantages, recomputes
   the response log-probs with the training weights (the sampler's own log-probs serve
   as the old policy; the script prints their max gap) and with a frozen reference copy,
   and takes ``--epochs`` AdamW steps on the clipped objective plus a k3 KL penalty.

How to read it: one line per step with the mean sampled reward of that step's batch.
The summary gives the mean training reward over the first and last ``--window`` steps,
and a held-out evaluation (``--eval-size`` problems, sampled at temperature 1 and
greedy) before and after RL, with wall and process-CPU seconds per phase. ``--json``
prints only the summary, as one JSON object. Threads: the script calls
``torch.set_num_threads(--threads)``; on a machine shared with other jobs, 1 thread is
often faster for a model this small.

Needs: the base install. Takes: the warm-up about 1-2 min (it prints its progress), then
roughly 1 s a GRPO step on 2 cores: ``--steps 800`` (the default) is a 10-20 min run,
``--steps 50`` a quick look.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from flowrl.models import TinyLM, TinyLMConfig, generate
from flowrl.rl import build_batch, group_advantages, grpo_loss, token_logprobs
from flowrl.tasks import EOS_ID, VOCAB_SIZE, ArithProblem, ArithTask, pretrain, verify


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-digits", type=int, default=2, help="operands have 1..N digits")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--clean-steps", type=int, default=1000)
    p.add_argument("--clean-lr", type=float, default=3e-3)
    p.add_argument("--noisy-steps", type=int, default=200)
    p.add_argument("--noisy-lr", type=float, default=3e-4)
    p.add_argument("--noise", type=float, default=0.6)
    p.add_argument("--steps", type=int, default=800, help="GRPO steps")
    p.add_argument("--prompts", type=int, default=16, help="problems per GRPO step")
    p.add_argument("--samples", type=int, default=8, help="responses per problem (group)")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--epochs", type=int, default=1, help="optimizer steps per rollout batch")
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--kl-coef", type=float, default=0.01)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--eval-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print only the summary, as JSON")
    return p.parse_args()


def rewards_of(problems: list[ArithProblem], responses: list[torch.Tensor]) -> torch.Tensor:
    """Rule-based reward of each response."""
    pairs = zip(problems, responses, strict=True)
    return torch.tensor([verify(p.prompt_ids, r) for p, r in pairs])


def evaluate(model: TinyLM, problems: list[ArithProblem], max_new: int) -> dict[str, float]:
    """Mean reward on ``problems``, sampled at temperature 1 and greedy."""
    out = {}
    for name, temperature in (("sampled", 1.0), ("greedy", 0.0)):
        gen = generate(
            model,
            [p.prompt_ids for p in problems],
            max_new,
            eos_id=EOS_ID,
            temperature=temperature,
            generator=torch.Generator().manual_seed(12345),
        )
        out[name] = rewards_of(problems, gen.responses()).mean().item()
    return out


class _Clock:
    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        return (round(time.perf_counter() - self.wall, 1), round(time.process_time() - self.cpu, 1))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    log = (lambda *_, **__: None) if args.json else print
    total = _Clock()

    digits = (1, args.max_digits)
    task = ArithTask(digits=digits, seed=args.seed)
    eval_set = ArithTask(digits=digits, seed=10_000 + args.seed).sample(args.eval_size)
    max_new = task.max_response_len + 1  # room for one wrong extra token
    config = TinyLMConfig(
        vocab_size=VOCAB_SIZE,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=4,
        d_ff=4 * args.d_model,
        max_seq_len=24,
    )
    model = TinyLM(config)

    clock = _Clock()
    total_warm = args.clean_steps + args.noisy_steps
    log(f"warm-up: {args.clean_steps} + {args.noisy_steps} supervised steps")
    done = 0

    def warm_progress() -> None:  # a line at each quarter: the warm-up takes a while
        nonlocal done
        done += 1
        if done % max(1, total_warm // 4) == 0:
            log(f"warm-up: {done}/{total_warm}", flush=True)

    pretrain(
        model,
        task,
        args.clean_steps,
        lr=args.clean_lr,
        noise=0.0,
        seed=args.seed,
        on_step=warm_progress,
    )
    model.eval()
    clean = evaluate(model, eval_set, max_new)
    model.train()
    pretrain(
        model,
        task,
        args.noisy_steps,
        lr=args.noisy_lr,
        noise=args.noise,
        seed=args.seed + 1,
        on_step=warm_progress,
    )
    model.eval()
    pretrain_s = clock.lap()
    before = evaluate(model, eval_set, max_new)
    log(
        f"warm-up {pretrain_s[0]}s: after clean phase sampled {clean['sampled']:.3f} greedy "
        f"{clean['greedy']:.3f}; after noisy phase sampled {before['sampled']:.3f} greedy "
        f"{before['greedy']:.3f}"
    )

    reference = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen_rng = torch.Generator().manual_seed(args.seed)
    group_ids = torch.arange(args.prompts).repeat_interleave(args.samples)
    step_rewards: list[float] = []
    max_lp_gap = 0.0
    clock = _Clock()
    for step in range(args.steps):
        problems = [p for p in task.sample(args.prompts) for _ in range(args.samples)]
        out = generate(
            model, [p.prompt_ids for p in problems], max_new, eos_id=EOS_ID, generator=gen_rng
        )
        rewards = rewards_of(problems, out.responses())
        advantages = group_advantages(rewards, group_ids)
        batch = build_batch([torch.tensor(p.prompt_ids) for p in problems], out.responses())
        with torch.no_grad():
            ref_logprobs = token_logprobs(reference, *batch)
        for epoch in range(args.epochs):
            logprobs = token_logprobs(model, *batch)
            loss, metrics = grpo_loss(
                logprobs,
                out.logprobs,
                advantages,
                batch[3],
                ref_logprobs=ref_logprobs,
                clip_eps=args.clip_eps,
                kl_coef=args.kl_coef,
            )
            if epoch == 0:
                gap = (logprobs.detach() - out.logprobs).abs().max().item()
                max_lp_gap = max(max_lp_gap, gap)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        step_rewards.append(rewards.mean().item())
        log(
            f"step {step:4d} reward {step_rewards[-1]:.3f} kl_ref {metrics['kl_ref']:.4f} "
            f"clip {metrics['clip_fraction']:.3f} t {clock.lap()[0]}s"
        )
    rl_s = clock.lap()
    after = evaluate(model, eval_set, max_new)

    w = min(args.window, max(len(step_rewards), 1))
    summary = {
        "seed": args.seed,
        "train_reward_first": round(sum(step_rewards[:w]) / w, 3),
        "train_reward_last": round(sum(step_rewards[-w:]) / w, 3),
        "eval_sampled_before_rl": before["sampled"],
        "eval_sampled_after_rl": after["sampled"],
        "eval_greedy_before_rl": before["greedy"],
        "eval_greedy_after_rl": after["greedy"],
        "eval_after_clean_warmup": clean,
        "max_sampler_vs_recompute_logprob_gap": max_lp_gap,
        "warmup_wall_s": pretrain_s[0],
        "rl_wall_s": rl_s[0],
        "total_wall_s": total.lap()[0],
        "total_cpu_s": total.lap()[1],
        "args": vars(args),
    }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
