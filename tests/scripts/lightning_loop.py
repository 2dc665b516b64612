"""A Lightning run as its users write one, with PhoenixDDPStrategy in place of "ddp" (docs/porting.md): a small
LightningModule with dropout, a shuffled DataLoader (Lightning puts a DistributedSampler under it), several epochs,
AdamW and an LR schedule stepped every step, everything seeded.

At the end each rank writes OUT/rank<R>.json: the loss of every step this process ran (a replacement: from the step
it joined at), parameter and optimizer hashes, its pid.
"""
import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import phoenixrun

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--out", required=True)
ap.add_argument("--progress-dir", default=None, help="append 'step unix_time' per finished step (benchmarks)")
cli, _ = ap.parse_known_args()

import lightning.pytorch as pl  # noqa: E402 - imported before init(): a warm spare has it loaded when it takes over

from phoenixrun.integrations.lightning import PhoenixDDPStrategy  # noqa: E402

ctx = phoenixrun.init()   # before Trainer(): Lightning takes the process group it finds, phoenixrun's


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                        torch.nn.Linear(32, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.body(x), y)
        self.losses[self.trainer.global_step] = loss.item()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=cli.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Progress(pl.Callback):
    """'step unix_time' per finished step (benchmarks)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(os.path.join(cli.progress_dir, f"rank{trainer.global_rank}.log"), "a") as f:
            f.write(f"{trainer.global_step - 1} {time.time()}\n")


pl.seed_everything(0, verbose=False)
X = torch.randn(64, 16)
Y = X.sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1)
loader = DataLoader(TensorDataset(X, Y), batch_size=4, shuffle=True)   # 8 batches per rank and epoch on 2 ranks
model = Net()
devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
trainer = pl.Trainer(strategy=PhoenixDDPStrategy(), accelerator="cpu", devices=devices,
                     num_nodes=ctx.world_size // devices, max_steps=cli.steps, max_epochs=-1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[Progress()] if cli.progress_dir else None)
# one float summation order on every topology: a matmul's sums follow the thread count, and Lightning's launcher
# sizes the thread pool by the ranks a host runs (2 nodes x 1 rank under phoenixrun, 1 x 2 under torchrun) unless
# OMP_NUM_THREADS is set
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
trainer.fit(model, loader)

params = torch.cat([p.detach().flatten() for p in model.parameters()])
opt = trainer.optimizers[0]
moments = torch.cat([s[k].flatten() for s in opt.state_dict()["state"].values() for k in ("exp_avg", "exp_avg_sq")])
out = Path(cli.out)
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
    "losses": {str(k): v for k, v in sorted(model.losses.items())},
    "param_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
    "optim_sha256": hashlib.sha256(moments.numpy().tobytes()).hexdigest(),
    "global_step": trainer.global_step, "lr": opt.param_groups[0]["lr"], "pid": os.getpid()}))
