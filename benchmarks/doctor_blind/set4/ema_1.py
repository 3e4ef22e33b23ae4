import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

EMA_DECAY = 0.9
UPDATE_MODEL_WITH_EMA_EVERY = 10


@torch.no_grad()
def ema_update(ema_model, online_model, decay):
    for e, p in zip(ema_model.parameters(), online_model.parameters()):
        e.mul_(decay).add_(p.detach(), alpha=1 - decay)
    for e, b in zip(ema_model.buffers(), online_model.buffers()):
        e.copy_(b)


def make_data(n=768, seed=14):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y = torch.tanh(x[:, 0] * x[:, 1]) + 0.5 * torch.cos(x[:, 2]) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y.unsqueeze(1))


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)

    net = nn.Sequential(nn.Linear(10, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 1))
    model = DDP(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    ema_model = copy.deepcopy(net).eval() if rank == 0 else None

    step = 0
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                ema_update(ema_model, net, EMA_DECAY)
                if step % UPDATE_MODEL_WITH_EMA_EVERY == 0:
                    net.load_state_dict(ema_model.state_dict())
        if rank == 0:
            with torch.no_grad():
                ema_mse = F.mse_loss(ema_model(data.tensors[0]), data.tensors[1]).item()
            print(f"epoch {epoch} step {step} train mse {loss.item():.4f} ema mse {ema_mse:.4f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
