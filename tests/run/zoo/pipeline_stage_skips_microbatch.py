"""A two-stage pipeline on a hand-written fill-drain schedule (a PipelineScheduleSingle subclass,
as torch's docs show for custom schedules). The first stage skips the micro-batches whose
inputs are all padding, forward and backward alike; the last stage does not know. At step 2,
micro-batch 2 is all padding: the first stage sends micro-batches 0, 1 and 3, the last stage reads
the third message as its micro-batch 2 and waits for a fourth that never comes, while the first
waits for micro-batch 0's gradients. Plain torchrun hangs."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, _sorted_batch_p2p, _wait_batch_p2p

MICROBATCHES, MICROBATCH = 4, 2


class FillDrainSkippingPadding(PipelineScheduleSingle):
    """Every forward, then every backward; micro-batches of padding only are left out."""

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                           loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None, loss_kwargs)
        stage = self._stage
        padding = [stage.is_first and bool((args[0] == 0).all()) for args in arg_mbs]
        sends = []
        for i in range(self._n_microbatches):
            if padding[i]:
                continue  # nothing to compute for padding  # zoo: skip
            for work in _sorted_batch_p2p(stage.get_fwd_recv_ops(i), desc="fwd_recv").values():  # zoo: fwd_recv
                _wait_batch_p2p(work)
            output = stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i])
            sends.extend(_sorted_batch_p2p(stage.get_fwd_send_ops(i), desc="fwd_send").values())
            self._maybe_compute_loss(stage, output, target_mbs, i, loss_kwargs)
        for work in sends:
            _wait_batch_p2p(work)
        sends = []
        last = max(i for i in range(self._n_microbatches) if not padding[i])
        for i in range(self._n_microbatches):
            if padding[i]:
                continue
            for work in _sorted_batch_p2p(stage.get_bwd_recv_ops(i), desc="bwd_recv").values():  # zoo: bwd_recv
                _wait_batch_p2p(work)
            stage.backward_one_chunk(i, loss=self._maybe_get_loss(stage, i), last_backward=i == last)
            sends.extend(_sorted_batch_p2p(stage.get_bwd_send_ops(i), desc="bwd_send").values())
        for work in sends:
            _wait_batch_p2p(work)
        stage.perform_reduce_grad(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    parts = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh()), torch.nn.Linear(16, 1)]
    stage = PipelineStage(parts[rank], rank, 2, torch.device("cpu"))
    schedule = FillDrainSkippingPadding(stage, MICROBATCHES, loss_fn=torch.nn.MSELoss(), scale_grads=False)
    optimizer = torch.optim.SGD(parts[rank].parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, args.steps + 1):  # steps counted from 1
        inputs = torch.randn(MICROBATCHES * MICROBATCH, 8, generator=generator)
        targets = torch.randn(MICROBATCHES * MICROBATCH, 1, generator=generator)
        if step == 2:
            inputs[2 * MICROBATCH:3 * MICROBATCH] = 0  # micro-batch 2: padding only
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(inputs)  # zoo: first_stage
        else:
            schedule.step(target=targets)  # zoo: last_stage
        optimizer.step()
    dist.destroy_process_group()
    print(f"rank {rank} done")


if __name__ == "__main__":
    main()
