import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Blobs(Dataset):
    """Synthetic 8x8 single-channel images; class = location of a bright blob."""

    def __init__(self, n=256, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        self.images = 0.5 * torch.randn(n, 1, 8, 8, generator=g)
        for i, c in enumerate(self.labels.tolist()):
            r, col = divmod(c, 2)
            self.images[i, 0, r * 4:r * 4 + 4, col * 4:col * 4 + 4] += 1.0

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, idx):
        return self.images[idx], self.labels[idx]


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 2 * 2, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    torch.manual_seed(0)

    train_set = Blobs()
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=11)
    train_loader = DataLoader(train_set, batch_size=16, sampler=train_sampler, drop_last=True)

    model = DDP(SmallCNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    num_epochs = 5
    for epoch in range(num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        total, correct, loss_sum = 0, 0, 0.0
        for images, labels in train_loader:
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * labels.numel()
            correct += (logits.argmax(1) == labels).sum().item()
            total += labels.numel()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss_sum / total:.4f} acc {correct / total:.3f}", flush=True)

    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
