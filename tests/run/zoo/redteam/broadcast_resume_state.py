# nproc: 3
"""Resuming: rank 0 broadcasts 3 state objects, ranks 1 and 2 expect 2.

Mechanism (d), BROKEN, 3 processes. Rank 0 loads the checkpoint and finds an
LR-scheduler entry, so it broadcasts [model, optimizer, scheduler]. The other
ranks build their receive list from the static STATE_KEYS (model, optimizer)
and pass 2 placeholders. broadcast_object_list first broadcasts the sizes
tensor: int64[3] on rank 0 against int64[2] on ranks 1 and 2 -- the same
collective at the same line with different tensors. Gloo delivers 24 bytes
where the receivers posted 16 and aborts.

Drawn from: https://github.com/Ascend/pytorch/issues/58 (broadcast_object_list
"hang with no response"; the reporter notes the list length must be the same
on every process) and https://github.com/pytorch/gloo/pull/456 ("better error
message on collective mismatch": "op.preamble.length <= op.nbytes").
"""
import io
import os

import torch
import torch.distributed as dist

STATE_KEYS = ("model", "optimizer")


def fake_checkpoint():
    net = torch.nn.Linear(6, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def resume_payload(rank):
    if rank == 0:
        ckpt = fake_checkpoint()
        payload = [ckpt[k] for k in STATE_KEYS]
        if "scheduler" in ckpt:
            payload.append(ckpt["scheduler"])
        return payload
    return [None] * len(STATE_KEYS)


def main():
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    dist.barrier()
    payload = resume_payload(rank)
    dist.broadcast_object_list(payload, src=0)  # zoo: bcast-obj
    net = torch.nn.Linear(6, 2)
    net.load_state_dict(payload[0])
    print(f"rank {rank}: resumed, {len(payload)} state objects", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
