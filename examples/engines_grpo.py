"""Streaming GRPO on the engines: a rollout process, a trainer, weights through shared memory.

What it shows: the engine layer end to end on CPU. A rollout process runs a
``TorchRolloutEngine`` and streams each finished response to the trainer the moment it is
done (a ``multiprocessing`` queue stands in for the hub here), checking for new weights
between decoding steps (``flowrl.WeightSubscriber``) and resuming interrupted requests
under them. The trainer (``--trainer torch``; ``deepspeed``: ZeRO-``--zero-stage`` on one
gloo rank; ``megatron``: a Megatron-core GPT rebuilt from ``--model hf``) groups
``--samples`` responses per problem, scores them with the arithmetic
task's ``verify``, recomputes log-probs, takes one step of the clipped GRPO objective with
the truncated importance-sampling correction (``--tis-cap``) and publishes the new version
(``flowrl.WeightPublisher``). ``--model tinylm`` (flowrl's model) or ``hf`` (a small
Hugging Face Llama); either is warmed up on noisy answers first, so rewards start low but
non-zero.

How to read it: one line per step with the mean reward, the loss, the TIS metrics and how
many policy versions the trained tokens lagged on average (1: the next step's rollouts
run while a step trains). The short warm-up leaves rewards near 0.05-0.1; this example
shows the plumbing, ``flowrl run grpo`` is the tuned job.

    python examples/engines_grpo.py --steps 30

Needs: the base install (``--model hf``: ``flowrl[hf]``; ``--trainer deepspeed`` /
``megatron``: ``flowrl[deepspeed]`` / ``flowrl[megatron]``). Takes: about 2.5 min for
``--steps 3`` on a busy 2-core machine (most of it the warm-up), a few seconds a step after.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import secrets
from typing import Any

import numpy as np
import torch

import flowrl
from flowrl.engines import (
    GenerationRequest,
    OptimConfig,
    SamplingParams,
    TorchRolloutEngine,
    TorchUpdateEngine,
    TrainBatch,
    UpdateEngine,
)
from flowrl.models import TinyLM, TinyLMConfig
from flowrl.rl import group_advantages, grpo_loss
from flowrl.tasks import EOS_ID, VOCAB_SIZE, ArithTask, pretrain, verify


def build_policy(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "hf":
        from flowrl.models.hf import tiny_llama

        model = tiny_llama(vocab_size=VOCAB_SIZE, hidden_size=64, n_layers=2, max_positions=32)
    else:
        model = TinyLM(TinyLMConfig(vocab_size=VOCAB_SIZE, d_model=64, max_seq_len=32))
    task = ArithTask(digits=(1, 2), seed=seed)
    pretrain(model, task, 300, lr=3e-3, noise=0.0, seed=seed)
    pretrain(model, task, 100, lr=3e-4, noise=0.8, seed=seed + 1)
    return model.eval()


def rollout(args: argparse.Namespace, channel: str, policy: Any, jobs: Any, out: Any) -> None:
    torch.set_num_threads(1)
    engine = TorchRolloutEngine(policy)
    weights = flowrl.WeightSubscriber(channel)
    params = SamplingParams(
        max_new_tokens=ArithTask(digits=(1, 2)).max_response_len + 1, eos_id=EOS_ID, seed=args.seed
    )
    prompts: dict[int, np.ndarray] = {}
    while True:
        while not jobs.empty() or not engine.pending:
            job = jobs.get()
            if job is None:
                return
            requests = [GenerationRequest(i, np.asarray(p)) for i, p in job]
            prompts.update((r.id, r.prompt) for r in requests)
            engine.add(requests, params)
        snapshot = weights.poll(engine.version)
        if snapshot is not None:  # between two decoding steps; running requests resume
            engine.update_weights(snapshot.tensors(), snapshot.version)
        for c in engine.step():
            out.put((c.id, prompts.pop(c.id), c.tokens, c.logprobs, c.versions))


def make_trainer(args: argparse.Namespace, policy: torch.nn.Module) -> UpdateEngine:
    optim = OptimConfig(lr=args.lr)
    if args.trainer == "deepspeed":
        from flowrl.engines import DeepSpeedUpdateEngine

        return DeepSpeedUpdateEngine(policy, optim, zero_stage=args.zero_stage)
    if args.trainer == "megatron":
        from flowrl.engines import MegatronUpdateEngine

        return MegatronUpdateEngine(policy, optim)
    return TorchUpdateEngine(policy, optim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tinylm", "hf"], default="tinylm")
    parser.add_argument("--trainer", choices=["torch", "deepspeed", "megatron"], default="torch")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--tis-cap", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = build_policy(args.model, args.seed)
    channel = f"example-{secrets.token_hex(4)}"
    publisher = flowrl.WeightPublisher(channel)
    ctx = mp.get_context("spawn")
    jobs, out = ctx.Queue(), ctx.Queue()
    worker = ctx.Process(target=rollout, args=(args, channel, policy, jobs, out))
    worker.start()
    trainer = make_trainer(args, policy)
    task = ArithTask(digits=(1, 2), seed=args.seed)
    g, next_id = args.samples, 0

    def submit() -> None:  # one step's problems, each prompt `samples` times
        nonlocal next_id
        job = []
        for problem in task.sample(args.prompts):
            job += [(next_id + k, problem.prompt_ids) for k in range(g)]
            next_id += g
        jobs.put(job)

    try:
        submit()
        for step in range(args.steps):
            submit()  # the next step's rollouts run while this one trains
            rows = sorted(
                (out.get(timeout=300) for _ in range(args.prompts * g)), key=lambda r: r[0]
            )
            rewards = torch.tensor([verify(p.tolist(), t.tolist()) for _, p, t, _, _ in rows])
            groups = torch.tensor([i // g for i, *_ in rows])
            batch = TrainBatch.pack(
                [r[1] for r in rows],
                [r[2] for r in rows],
                advantages=group_advantages(rewards, groups),
                sample_logprobs=[r[3] for r in rows],
            )
            old = trainer.logprobs(batch)
            batch = TrainBatch.pack(
                [r[1] for r in rows],
                [r[2] for r in rows],
                advantages=batch.advantages,
                sample_logprobs=[r[3] for r in rows],
                old_logprobs=list(old.split(batch.response_cu.diff().tolist())),
            )

            def loss_fn(lp: torch.Tensor, mb: TrainBatch) -> Any:
                return grpo_loss(
                    lp,
                    mb.old_logprobs,
                    mb.advantages,
                    mb.response_cu,
                    sample_logprobs=mb.sample_logprobs,
                    tis_cap=args.tis_cap,
                )

            lag = trainer.version - np.concatenate([r[4] for r in rows])
            m = trainer.train_step(batch.split(2), loss_fn)
            publisher.publish(trainer.named_weights(), trainer.version)
            print(
                f"step {step:3d}  reward {rewards.float().mean():.3f}  loss {m['loss']:+.4f}  "
                f"is_ratio {m['is_ratio_mean']:.3f} (max {m['is_ratio_max']:.2f}, truncated "
                f"{m['is_truncated_fraction']:.3f})  token lag {lag.mean():.2f}",
                flush=True,
            )
    finally:
        jobs.put(None)
        worker.join(60)
        if worker.is_alive():
            worker.kill()
        publisher.close()
        trainer.close()


if __name__ == "__main__":
    main()
