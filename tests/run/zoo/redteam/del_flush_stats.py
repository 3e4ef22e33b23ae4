"""A stats object whose __del__ all-reduces; only rank 0 owns one.

Mechanism (f): collective after the peer left, from a destructor. Rank 0 keeps a
`RunningStats` accumulator for logging; its __del__ "flushes" the partial sums
with an all_reduce so no sample is lost. Rank 1 never had one: it leaves the
final barrier, destroys its process group and exits. Rank 0 then drops its
stats object (`del stats`) and __del__ runs a collective nobody else will
join. Gloo reports the closed connection; Python prints "Exception ignored in:
<function RunningStats.__del__ ...>" and rank 0 carries on and exits 0.

Expected: "warning: collective after peer left, rank 0, line del-collective".

Drawn from: https://github.com/pytorch/pytorch/issues/195500 (a deleter that
issues a collective from Python garbage collection: "Rank 0 drops the tensor;
rank 1 does not. Rank 0 enters the collective ... alone").
"""
import os

import torch
import torch.distributed as dist


class RunningStats:
    def __init__(self, dim):
        self.sum = torch.zeros(dim)
        self.count = torch.zeros(1)

    def update(self, x):
        self.sum += x.sum(0)
        self.count += x.shape[0]

    def __del__(self):
        buf = torch.cat([self.sum, self.count])
        dist.all_reduce(buf)  # zoo: del-collective
        print(f"flushed stats: mean={(buf[:-1] / buf[-1]).tolist()}", flush=True)


rank = None


def main():
    global rank
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stats = RunningStats(4) if rank == 0 else None
    w = torch.zeros(4, 1, requires_grad=True)
    for step in range(8):
        x = torch.randn(12, 4)
        if stats is not None:
            stats.update(x)
        loss = (x @ w - 1.0).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            dist.all_reduce(w.grad)
            w -= 0.1 * w.grad / 2
            w.grad.zero_()
    dist.barrier()  # zoo: last-matched
    if rank != 0:
        dist.destroy_process_group()
        return
    print("rank 0: writing summary", flush=True)
    del stats
    print("rank 0: done", flush=True)


if __name__ == "__main__":
    main()
