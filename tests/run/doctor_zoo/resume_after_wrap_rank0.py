"""Resume from a checkpoint on rank 0 only, *after* wrapping the model in DDP.

Intent: the user resumes fine-tuning from a saved checkpoint. Following advice
seen in public repos ("only the main process needs to load the weights, DDP
broadcasts them"), the checkpoint is read on rank 0 only, so the other ranks
do not hit the disk.

What goes wrong: DDP broadcasts rank 0's parameters only once, inside its
constructor. Here the load happens after `DDP(...)` was built, so rank 0 now
holds the checkpoint weights while rank 1 keeps the freshly initialised
(broadcast) weights. Gradients are still averaged every step, so both ranks
apply identical updates to *different* starting points: the replicas never
reconverge and stay apart for the whole run. Nothing raises.

Public report: https://github.com/facebookresearch/detr/issues/235 (rank-0-only
pretrained load is safe only because DDP's constructor broadcasts; loading
after construction is not covered), see also
https://github.com/pytorch/pytorch/issues/111138 .

Expected verdict (ideal checker): parameters differ across ranks from step 1
(before the first optimizer step already): every parameter of rank 1 differs
from rank 0; cause = the `ddp.module.load_state_dict(...)` line marked with
the zoo cause marker, executed on rank 0 only after DDP construction.

Plain torchrun (measured, `torchrun --standalone --nproc-per-node 2`, CPU,
gloo): exit 0, 32 steps/rank, ~22-33 s. Final parameter checksum rank 0 =
3.20040529, rank 1 = -1.41728946 (differ); a step-hook probe shows the
parameter checksums already differ after step 1 while the averaged gradients
are identical on both ranks.
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def make_data(n=512):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(1)).long()
    return TensorDataset(x, y)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    ckpt = os.path.join(tempfile.gettempdir(), f"redteam42_resume_{os.environ.get('MASTER_PORT', '0')}.pt")

    # a checkpoint "from a previous run"
    if rank == 0:
        torch.manual_seed(99)
        torch.save({"model": Net().state_dict(), "epoch": 3}, ckpt)
    dist.barrier()

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    if rank == 0:
        state = torch.load(ckpt, map_location="cpu")
        ddp.module.load_state_dict(state["model"])  # doctor: cause
        print(f"[rank 0] resumed from epoch {state['epoch']}", flush=True)

    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ds = make_data()
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)

    step = 0
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        print(f"[rank {rank}] epoch {epoch} steps {step} loss {loss.item():.4f}", flush=True)

    cs = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"[rank {rank}] final param checksum {cs:.8f}", flush=True)
    dist.barrier()
    if rank == 0 and os.path.exists(ckpt):
        os.remove(ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
