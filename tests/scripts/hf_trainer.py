"""An HF Trainer run as its users write one, with PhoenixTrainer in place of Trainer (docs/porting.md): a tiny GPT-2
built from a config (dropout on), a synthetic dataset of 64 sequences, several epochs, a linear LR schedule with
warmup, gradient clipping.

At the end each rank writes OUT/rank<R>.json: the loss of every step this process ran (a replacement: from the step
it joined at), parameter and optimizer hashes, its pid.
"""
import argparse
import hashlib
import json
import time
import os
from pathlib import Path

import torch
# imported before phoenixrun.init(): a warm spare waits in init() with its libraries already loaded
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import phoenixrun
from phoenixrun.integrations.transformers import PhoenixTrainer

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--out", required=True)
ap.add_argument("--progress-dir", default=None, help="append 'step unix_time' per finished step (benchmarks)")
cli, _ = ap.parse_known_args()

phoenixrun.init()   # before TrainingArguments, which sets up torch.distributed when it is built


class Progress(TrainerCallback):
    """'step unix_time' per finished step (benchmarks)."""

    def on_step_end(self, args, state, control, **kwargs):
        with open(os.path.join(cli.progress_dir, f"rank{args.process_index}.log"), "a") as f:
            f.write(f"{state.global_step - 1} {time.time()}\n")


class Recording(PhoenixTrainer):
    losses: dict = {}

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses[self.state.global_step] = loss.item()
        return loss


torch.manual_seed(0)
data = torch.randint(0, 64, (64, 17))
dataset = [{"input_ids": row, "labels": row} for row in data]
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2))
out = Path(cli.out)
targs = TrainingArguments(output_dir=str(out / "hf"), per_device_train_batch_size=4, max_steps=cli.steps,
                          learning_rate=3e-3, warmup_steps=5, lr_scheduler_type="linear", max_grad_norm=1.0,
                          logging_steps=10_000, save_strategy="no", report_to=[], seed=0, use_cpu=True,
                          disable_tqdm=True, dataloader_num_workers=0)
# one float summation order on every topology: accelerate sizes the CPU thread pool by the ranks a host runs
# (2 nodes x 1 rank here, 1 x 2 under the torchrun reference), and a matmul's sums follow the thread count
torch.set_num_threads(1)
trainer = Recording(model=model, args=targs, train_dataset=dataset,
                    callbacks=[Progress()] if cli.progress_dir else None)
trainer.train()

rank = targs.process_index
params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
inner = trainer.optimizer.optimizer.state_dict()["state"]
moments = torch.cat([s[k].flatten() for s in inner.values() for k in ("exp_avg", "exp_avg_sq")])
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{rank}.json").write_text(json.dumps({
    "losses": {str(k): v for k, v in sorted(Recording.losses.items())},
    "param_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
    "optim_sha256": hashlib.sha256(moments.numpy().tobytes()).hexdigest(),
    "global_step": trainer.state.global_step, "pid": os.getpid()}))
