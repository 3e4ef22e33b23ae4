"""A LightningModule trained with `L.Trainer(accelerator="cpu", devices=2, strategy="ddp")`.

Launched by `torchrun --nproc-per-node 2` (or `gradsync run ...`): Lightning must detect the
launcher (TorchElasticEnvironment) and run one process per rank instead of spawning its own;
the script prints the cluster environment it picked and fails if it is not the elastic one.
Validation every epoch (a metric synced across ranks with sync_dist), a ModelCheckpoint into a
temp dir, and a final test pass.
"""

import argparse
import os
import shutil
import tempfile

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make_data(n: int, seed: int) -> TensorDataset:
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=gen)
    y = (x @ w + 0.3 * torch.randn(n, 4, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


class Classifier(L.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(1)
    L.seed_everything(0, workers=True)
    out = os.path.join(tempfile.gettempdir(), f"compat_lightning_{os.environ.get('TORCHELASTIC_RUN_ID', 'solo')}")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=args.epochs,
        default_root_dir=out, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=out, monitor="val_loss", save_top_k=1)],
        num_sanity_val_steps=2, log_every_n_steps=10,
    )
    cluster = trainer.strategy.cluster_environment
    env = type(cluster).__name__
    if trainer.global_rank == 0:
        print(f"cluster environment: {env} (creates processes externally: "
              f"{cluster.creates_processes_externally}), world size {trainer.world_size}", flush=True)
    if env != "TorchElasticEnvironment":
        raise SystemExit(f"expected TorchElasticEnvironment under a torchrun-style launcher, got {env}")

    model = Classifier()
    train = DataLoader(make_data(2048, 0), batch_size=16, shuffle=True)
    val = DataLoader(make_data(500, 1), batch_size=32)
    trainer.fit(model, train, val)
    m = dict(trainer.callback_metrics)  # trainer.test replaces them
    result = trainer.test(model, DataLoader(make_data(500, 2), batch_size=32), verbose=False)
    if trainer.global_rank == 0:
        print(f"final: train loss {m['train_loss']:.4f}, val loss {m['val_loss']:.4f}, "
              f"test acc {result[0]['test_acc']:.4f}", flush=True)
    trainer.strategy.barrier()
    if trainer.global_rank == 0:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
