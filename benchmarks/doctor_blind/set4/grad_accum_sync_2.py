import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

block_size = 16
vocab_size = 32
n_embd = 32
batch_size = 8
grad_accum_steps = 4
max_iters = 40
learning_rate = 3e-3
warmup_iters = 5


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        t = idx.size(1)
        h = self.tok(idx) + self.pos(torch.arange(t))
        h = h + self.mlp(self.ln(h))
        logits = self.head(h)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))
        return logits, loss


def make_corpus(n_tokens=20000, seed=7):
    g = torch.Generator().manual_seed(seed)
    # simple Markov-ish stream: next token depends on the previous one
    trans = torch.softmax(3.0 * torch.randn(vocab_size, vocab_size, generator=g), dim=1)
    data = torch.empty(n_tokens, dtype=torch.long)
    data[0] = 0
    for i in range(1, n_tokens):
        data[i] = torch.multinomial(trans[data[i - 1]], 1, generator=g)
    return data


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    return 0.1 * learning_rate + 0.45 * learning_rate * (1 + math.cos(math.pi * ratio))


def main():
    dist.init_process_group("gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    torch.set_num_threads(1)
    torch.manual_seed(1337 + ddp_rank)

    data = make_corpus()

    def get_batch():
        ix = torch.randint(len(data) - block_size - 1, (batch_size,))
        x = torch.stack([data[i:i + block_size] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    model = TinyLM()
    model = DDP(model)
    raw_model = model.module
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=learning_rate, weight_decay=0.1)

    for it in range(max_iters):
        lr = get_lr(it)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_accum = 0.0
        for micro_step in range(grad_accum_steps):
            x, y = get_batch()
            _, loss = model(x, y)
            loss = loss / grad_accum_steps
            loss_accum += loss.detach()
            model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
            loss.backward()
        dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)
        loss_accum /= ddp_world_size
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if master_process and it % 10 == 0:
            print(f"iter {it} loss {loss_accum.item():.4f} lr {lr:.2e}", flush=True)

    if master_process:
        print("training finished", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(1)


if __name__ == "__main__":
    main()
