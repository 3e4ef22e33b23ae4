"""Two-stage pipeline-parallel regression on 2 ranks: rank 0 holds the first half of an
MLP and rank 1 the second; every step rank 0 splits its batch into micro-batches and
ships their activations to rank 1 with batched point-to-point sends, rank 1 computes the
loss and ships the activation gradients back, and both stages update their own weights."""
import datetime

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401
import torch.nn as nn

BATCH = 36
MICRO = 8
HIDDEN = 24


def stage0_step(model, opt, x):
    chunks = x.split(MICRO)
    acts = [model(c) for c in chunks]
    sends = dist.batch_isend_irecv([dist.P2POp(dist.isend, a.detach().contiguous(), 1) for a in acts])
    grads = [torch.empty_like(a) for a in acts]
    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, gr, 1) for gr in grads]):
        w.wait()
    opt.zero_grad()
    torch.autograd.backward(acts, grads)
    opt.step()
    for w in sends:
        w.wait()


def stage1_step(model, opt, y):
    sizes = [len(t) for t in y.split(MICRO)]
    n_micro = len(sizes)
    bufs = [torch.empty(s, HIDDEN, requires_grad=False) for s in sizes]
    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, 0) for b in bufs]):
        w.wait()
    ins = [b.requires_grad_() for b in bufs]
    targets = y.split(MICRO)
    loss = sum(nn.functional.mse_loss(model(i), t) for i, t in zip(ins, targets)) / n_micro
    opt.zero_grad()
    loss.backward()
    opt.step()
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, i.grad.contiguous(), 0) for i in ins]):
        w.wait()
    return loss.item()


def train(rank):
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(10, HIDDEN), nn.Tanh())
    second = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
    model = first if rank == 0 else second
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(11)
    for step in range(20):
        x = torch.randn(BATCH, 10, generator=g)
        y = x[:, :3].sum(dim=1, keepdim=True)
        if rank == 0:
            stage0_step(model, opt, x)
        else:
            loss = stage1_step(model, opt, y)
            if step % 5 == 0:
                print(f"step {step} loss {loss:.4f}", flush=True)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
