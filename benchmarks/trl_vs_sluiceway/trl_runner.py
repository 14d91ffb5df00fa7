"""TRL's side of the benchmark: GRPOTrainer on CPU, run inside TRL's own virtualenv (see run.py).

Writes OUT/result.json: per-step wall times (from the trainer's step callbacks), per-step mean reward, versions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # task.py: the shared prompts and reward, pure Python

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from task import trl_reward  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402


class StepClock(TrainerCallback):
    """Wall time of every optimizer step (generation, reward and training all happen inside one)."""

    def __init__(self) -> None:
        self.begin: list[float] = []
        self.end: list[float] = []
        self.rewards: list[float] = []

    def on_step_begin(self, args, state, control, **kw):
        self.begin.append(time.time())

    def on_step_end(self, args, state, control, **kw):
        self.end.append(time.time())

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            self.rewards.append(float(logs["reward"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args()
    t0 = time.time()

    rows = [json.loads(line) for line in open(a.prompts)]
    ds = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["input"]}], "label": r["label"]} for r in rows]
    )
    config = trl.GRPOConfig(
        output_dir=a.out,
        use_cpu=True,
        bf16=a.bf16,  # on CPU: bf16 autocast over fp32 weights
        per_device_train_batch_size=a.prompts_per_step * a.samples,  # one optimizer step per generation batch
        gradient_accumulation_steps=1,
        num_generations=a.samples,
        max_completion_length=a.max_new_tokens,
        temperature=a.temperature,
        top_p=1.0,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        adam_beta1=0.9,
        adam_beta2=0.999,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,  # no KL term
        epsilon=0.2,
        loss_type="dapo",  # token-level mean over the batch: sluiceway's token_mean
        scale_rewards="group",  # (r - group mean) / group std: sluiceway's GRPO with std normalisation
        num_iterations=1,
        gradient_checkpointing=False,  # recompute costs time; 135M fits in memory
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=a.seed,
        dataloader_num_workers=0,
    )
    clock = StepClock()
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    trainer = trl.GRPOTrainer(
        model=a.model, reward_funcs=trl_reward, args=config, train_dataset=ds, processing_class=tokenizer,
        callbacks=[clock],
    )  # fmt: skip
    trainer.train()
    out = {
        "framework": "trl",
        "bf16": a.bf16,
        "step_begin": clock.begin,
        "step_end": clock.end,
        "rewards": clock.rewards,
        "started": t0,
        "ended": time.time(),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
                     "datasets": datasets.__version__},
    }  # fmt: skip
    Path(a.out, "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
