"""Healthy: walks over a model wrapped in DDP, as scripts do to freeze, count, re-initialise or hook
layers: `named_modules()` and `named_parameters()` of the wrapper, each module's attributes and
hooks (a feature hook of the script's own included), `apply`, and `state_dict()` keys. Under plain
torchrun they list only what torch and the script put there: a launcher's bookkeeping left on the
user's objects (an attribute, a hook) shows in what is printed."""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

STEPS = 12


def describe(ddp: nn.Module) -> list[str]:
    lines = []
    for name, module in ddp.named_modules():  # doctor: lookalike
        hooks = (len(module._forward_pre_hooks), len(module._forward_hooks), len(module._backward_hooks),
                 len(module._backward_pre_hooks), len(module._state_dict_hooks), len(module._load_state_dict_pre_hooks))
        attributes = sorted(vars(module))
        lines.append(f"{name or '(root)'} {type(module).__name__} hooks {hooks} attributes {attributes}")
    for name, parameter in ddp.named_parameters():
        lines.append(f"{name} {tuple(parameter.shape)} requires_grad={parameter.requires_grad} "
                     f"attributes {sorted(vars(parameter))}")
    return lines


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(512, 16, generator=gen), torch.randn(512, 1, generator=gen))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    features = []
    model[2].register_forward_hook(lambda _module, _args, output: features.append(output.detach().norm().item()))
    ddp = DDP(model)
    counted = []
    ddp.apply(lambda module: counted.append(type(module).__name__))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    step = 0
    for x, y in loader:
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        print(f"rank {rank} step {step}: loss {loss.item():.6f} feature norm {features[-1]:.6f}")
        if step in (1, 10):
            for line in describe(ddp):
                print(f"rank {rank} step {step}: {line}")
            print(f"rank {rank} step {step}: applied to {counted}, state_dict {sorted(ddp.state_dict())}")
        if step == STEPS:
            break
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
