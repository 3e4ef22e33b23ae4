"""Train a 1D ConvNet, prune low-activity channels after a warm-up phase, then keep training the pruned net."""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_dataset(n=2048, channels=4, length=48, classes=3, seed=29):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, channels, length, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    t = torch.linspace(0, 6.28, length)
    x[:, 0] += torch.sin(t[None, :] * (y[:, None] + 1).float())
    return TensorDataset(x, y)


class ConvNet(nn.Module):
    def __init__(self, channels=4, width=64, classes=3):
        super().__init__()
        self.conv1 = nn.Conv1d(channels, width, 5, padding=2)
        self.conv2 = nn.Conv1d(width, width, 5, padding=2)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.mean(dim=-1))


@torch.no_grad()
def channel_importance(model, loader, layer, batches=4):
    """Mean absolute activation of each output channel of `layer`."""
    acts = []
    hook = layer.register_forward_hook(lambda m, i, o: acts.append(o.abs().mean(dim=(0, 2))))
    for i, (x, _) in enumerate(loader):
        if i == batches:
            break
        model(x)
    hook.remove()
    return torch.stack(acts).mean(dim=0)


@torch.no_grad()
def apply_masks(masks):
    for layer, mask in masks.items():
        layer.weight.mul_(mask.view(-1, 1, 1))
        layer.bias.mul_(mask)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--prune-after", type=int, default=12)
    parser.add_argument("--keep-ratio", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)

    model = DDP(ConvNet())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    masks = {}
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            apply_masks(masks)
            step += 1
            if step == args.prune_after:
                for layer in (model.module.conv1, model.module.conv2):
                    score = channel_importance(model, loader, layer)
                    k = int(args.keep_ratio * score.numel())
                    mask = torch.zeros_like(score)
                    mask[score.topk(k).indices] = 1.0
                    masks[layer] = mask
                apply_masks(masks)
                if rank == 0:
                    print(f"pruned to {args.keep_ratio:.0%} of channels at step {step}", flush=True)
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)

    del model, optimizer
    dist.destroy_process_group()
    time.sleep(0.5)  # let gloo's background threads wind down before the interpreter exits


if __name__ == "__main__":
    main()
