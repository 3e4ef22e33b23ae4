"""The script of ddp_before.py moved to gradsync (the "after" of the migration guide in the README).

    torchrun --standalone --nproc-per-node 2 docs/examples/ddp_after.py     # or: gradsync run ...
    python docs/examples/ddp_after.py                                       # also runs alone
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gradsync

EPOCHS, BATCH_SIZE, ACCUMULATION = 3, 64, 4


def synthetic(n: int, seed: int) -> TensorDataset:
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main() -> None:
    trainer = gradsync.setup(                                     # process group, device, seeds
        accumulation_steps=ACCUMULATION,
        precision="fp16" if torch.cuda.is_available() else "fp32",  # fp16: autocast + GradScaler
        max_grad_norm=1.0,                                        # unscale, then clip
        seed=0,
    )
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4)).to(trainer.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train_set = synthetic(4096, seed=1)
    model, optimizer, loader = trainer.prepare(model, optimizer, train_set, batch_size=BATCH_SIZE, remainder="drop")

    for epoch in trainer.epochs(EPOCHS):                           # sets the sampler's epoch
        for x, y in loader:                                       # on trainer.device already
            with trainer.step() as step:                          # no_sync + autocast when needed
                loss = F.cross_entropy(model(x), y)               # the micro-batch's mean loss
                step.backward(loss)                               # weighting, scaling, optimizer step
            trainer.log(loss=loss)                                # averaged over ranks; rank 0 writes

    trainer.close()


if __name__ == "__main__":
    main()
