"""Compression hooks on real 2-rank Gloo groups: numerics, agreement across ranks, error feedback."""

import io

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradsync.comm import CompressionConfig, make_hook
from gradsync.config import TrainerConfig
from gradsync.ddp import DDPConfig
from gradsync.errors import ConfigError
from tests.harness import launch


class ControlledGradients(torch.nn.Module):
    """forward(g_w, g_b) makes the gradients of `weight` and `bias` exactly g_w and g_b."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(64, 64))
        self.bias = torch.nn.Parameter(torch.zeros(64))

    def forward(self, g_w, g_b):
        return (self.weight * g_w).sum() + (self.bias * g_b).sum()


def _relative(a, b):
    return float((a - b).norm() / b.norm())


def follow_compressor(hook, device, steps=30, plain_steps=0, error_feedback=True):
    """Send known gradients through `hook` on `device` (the group is up); compare what DDP
    applies with the true mean. benchmarks/gpu_check.py runs it on CUDA tensors."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(ControlledGradients().to(device), device_ids=None if device.type == "cpu" else [device.index])
    model.register_comm_hook(None, hook)
    generator = torch.Generator().manual_seed(100 + rank)
    # A low-rank direction shared by every rank (as real gradients have) under per-rank noise.
    shared = torch.Generator().manual_seed(7)
    drift = (torch.randn(64, 2, generator=shared) @ torch.randn(2, 64, generator=shared)).to(device)
    applied_sum, true_sum = torch.zeros(64, 64, device=device), torch.zeros(64, 64, device=device)
    result = {"identical": True, "bias_error": 0.0, "warmup_exact": True}
    for step in range(steps):
        g_w = drift + torch.randn(64, 64, generator=generator).to(device)
        g_b = torch.randn(64, generator=generator).to(device)
        model(g_w, g_b).backward()
        true_w, true_b = g_w / world, g_b / world
        dist.all_reduce(true_w)
        dist.all_reduce(true_b)
        applied = model.module.weight.grad.clone()
        if step == 0:
            result["first_error"] = _relative(applied, true_w)
        if step < plain_steps:
            result["warmup_exact"] &= bool(torch.equal(applied, true_w))
        result["bias_error"] = max(result["bias_error"], float((model.module.bias.grad - true_b).abs().max()))
        everyone = [torch.empty_like(applied) for _ in range(world)]
        dist.all_gather(everyone, applied)
        result["identical"] &= all(torch.equal(everyone[0], other) for other in everyone)
        applied_sum += applied
        true_sum += true_w
        model.zero_grad()
        if not error_feedback:
            hook.residuals.clear()
    result["sum_error"] = _relative(applied_sum, true_sum)
    result["ratio"] = hook.stats.raw_bytes / hook.stats.sent_bytes
    result["codec_s"] = hook.stats.encode_s + hook.stats.decode_s
    return result


def trace_compressor(name, steps=30, error_feedback=True):
    dist.init_process_group("gloo")
    hook = make_hook(CompressionConfig(name=name, topk_ratio=0.1, powersgd_start_step=3))
    result = follow_compressor(hook, torch.device("cpu"), steps, plain_steps=2 if name == "powersgd" else 0,
                               error_feedback=error_feedback)
    assert result.pop("warmup_exact"), "PowerSGD must send plain gradients before its start step"
    buffer = io.BytesIO()
    torch.save(hook.state_dict(), buffer)
    buffer.seek(0)
    restored = make_hook(CompressionConfig(name=name, powersgd_start_step=3))
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    # The group is left to the harness's os._exit: destroyed here, the DDP model would hold its
    # last reference and free it on return, joining Gloo's threads with the GIL held while one
    # of them needs the GIL to free a tensor (a deadlock seen 1 run in 15 under load).
    return result


# name, bound on the first step's relative error, on the relative error of the 30-step sum, and
# the least compression ratio (1-D parameters and PowerSGD's warm-up are sent whole).
CASES = [
    ("fp16", 1e-3, 1e-3, 1.9),
    ("bf16", 1e-2, 1e-2, 1.9),
    ("int8", 0.05, 0.01, 3.0),
    ("topk", 1.0, 0.15, 2.0),
    ("powersgd", 1.0, 0.1, 1.2),
]


@pytest.mark.launches
@pytest.mark.parametrize("name, max_first_error, max_sum_error, min_ratio", CASES)
def test_compressor_is_close_to_the_mean_identical_on_every_rank_and_tracks_the_true_sum(
    name, max_first_error, max_sum_error, min_ratio
):
    for result in launch(trace_compressor, 2, name=name):
        assert result["identical"], "every rank must apply the bitwise identical update"
        # 1-D parameters travel uncompressed: the exact mean (PowerSGD's own hook adds its zero
        # error to them, which may round).
        assert result["bias_error"] <= (1e-6 if name == "powersgd" else 0.0), result
        assert result["first_error"] < max_first_error, result
        # Error feedback: what was held back is sent later, so the sums agree closely.
        assert result["sum_error"] < max_sum_error, result
        assert result["ratio"] > min_ratio, result


@pytest.mark.launches
@pytest.mark.parametrize("name", ["int8", "topk"])
def test_without_error_feedback_the_gradient_sum_drifts_away(name):
    # The control for the test above: the same gradients with the residuals dropped every step.
    with_feedback = launch(trace_compressor, 2, name=name)[0]["sum_error"]
    without = launch(trace_compressor, 2, name=name, error_feedback=False)[0]["sum_error"]
    assert without > 3 * with_feedback, (without, with_feedback)


def _baseline_against_ddp():
    from gradsync.comm.auto import PlainHook

    dist.init_process_group("gloo")
    generator = torch.Generator().manual_seed(dist.get_rank())
    plain, timed = DistributedDataParallel(ControlledGradients()), DistributedDataParallel(ControlledGradients())
    hook = PlainHook(CompressionConfig(name="none"))
    timed.register_comm_hook(None, hook)
    for _ in range(3):
        g_w, g_b = torch.randn(64, 64, generator=generator), torch.randn(64, generator=generator)
        plain(g_w, g_b).backward()
        timed(g_w, g_b).backward()
        for mine, ddps in zip(timed.module.parameters(), plain.module.parameters()):
            assert torch.equal(mine.grad, ddps.grad)
            mine.grad = ddps.grad = None
    return hook.stats.sent_bytes == hook.stats.raw_bytes == 3 * (64 * 64 + 64) * 4


@pytest.mark.launches
def test_auto_baseline_is_ddps_own_all_reduce_bitwise():
    assert launch(_baseline_against_ddp, 2) == [True, True]


def test_compression_config_is_checked():
    assert DDPConfig(compression="int8").compression == CompressionConfig(name="int8")
    assert DDPConfig(compression={"name": "topk", "topk_ratio": 0.05}).compression.topk_ratio == 0.05
    with pytest.raises(ConfigError, match="unknown; use one of none, fp16"):
        DDPConfig(compression="zip")
    with pytest.raises(ConfigError, match="both set"):
        DDPConfig(compression="fp16", comm_hook=lambda state, bucket: None)
    with pytest.raises(ConfigError, match="plain steps before PowerSGD starts"):
        CompressionConfig(name="powersgd", powersgd_start_step=-1)
    with pytest.raises(ConfigError, match="fraction"):
        CompressionConfig(name="topk", topk_ratio=0)


def train_with_compression(name, run_dir, epochs=2):
    import gradsync

    # Small buckets, so that several are in flight at once (PyTorch's own PowerSGD hook deadlocks Gloo then).
    trainer = gradsync.setup(ddp={"compression": name, "bucket_cap_mb": 0.1}, run_dir=run_dir, metrics={"log_every": 2})
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1),
    )
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 1))
    model, optimizer, loader = trainer.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05), dataset, batch_size=8)
    for _ in trainer.epochs(epochs):
        for x, y in loader:
            with trainer.step() as step:
                loss = torch.nn.functional.mse_loss(model(x), y)
                step.backward(loss)
            trainer.log(loss=loss)
    row = trainer._metrics.last_row
    parameters = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(parameters) for _ in range(trainer.world_size)]
    dist.all_gather(everyone, parameters)
    chosen = trainer.summary()["compression"] if name == "auto" else None
    buckets = trainer._strategy.comm_timer.buckets / trainer._strategy.comm_timer.reductions
    trainer.close()
    return {"row": row, "same_parameters": all(torch.equal(everyone[0], p) for p in everyone), "chosen": chosen, "buckets": buckets}


@pytest.mark.launches
@pytest.mark.parametrize(
    "name, min_ratio",
    [("none", 1.0), ("fp16", 1.9), ("bf16", 1.9), ("int8", 3.0), ("topk", 5.0), ("powersgd", 1.5)],
)
def test_trainer_compresses_and_reports_what_it_sent(name, min_ratio, tmp_path):
    for result in launch(train_with_compression, 2, name=name, run_dir=str(tmp_path)):
        row = result["row"]
        assert result["same_parameters"]
        assert result["buckets"] >= 2.5, result["buckets"]
        assert row["compression_ratio"] >= min_ratio and row["comm_bytes"] > 0 and row["busbw_gbps"] > 0
        assert ("encode_s" in row) == (name != "none")


@pytest.mark.launches
def test_trainer_with_auto_compression_settles_on_one_choice_that_every_rank_shares(tmp_path):
    results = launch(train_with_compression, 2, name="auto", run_dir=str(tmp_path), epochs=9)
    assert results[0]["chosen"] in ("none", "bf16", "powersgd", "int8")
    for result in results:
        assert result["chosen"] == results[0]["chosen"]
        assert result["same_parameters"]
        assert result["row"]["comm_bytes"] > 0


def test_auto_accumulation_needs_permission_and_room_above_the_users_count():
    with pytest.raises(ConfigError, match="only lets name='auto'"):
        CompressionConfig(name="bf16", max_accumulation_steps=4)
    with pytest.raises(ConfigError, match="integer >= 1"):
        CompressionConfig(name="auto", max_accumulation_steps=0)
    with pytest.raises(ConfigError, match="allow at least 6"):
        TrainerConfig(accumulation_steps=3, ddp={"compression": {"name": "auto", "max_accumulation_steps": 4}})


@pytest.mark.launches
@pytest.mark.parametrize("name", ["int8", "topk", "powersgd"])
def test_what_is_sent_does_not_depend_on_how_ddp_buckets_the_parameters(tmp_path, name):
    # int8's chunks and top-k's selection are per parameter, and residuals and scales follow
    # their parameters when DDP rebuilds its buckets after the first backward (same sizes, other
    # order: before, the residuals were added to other parameters' gradients from step 2 on).
    # PowerSGD works per matrix and its sums are exact, so how it groups buckets changes nothing sent.
    from tests.checkpoint.test_resume import train_deep

    runs = [
        launch(train_deep, 2, run_dir=str(tmp_path / str(cap)), checkpoint_dir=None, epochs=1, compression=name, bucket_cap_mb=cap)[0]
        for cap in (0.05, 25.0)
    ]
    assert runs[0] == runs[1]


def powersgd_groups_on_the_backward_thread():
    """The groups PowerSGD reduced, in order, whether each ran on the thread running backward,
    and, at each later bucket's hook, whether an earlier group was still under way."""
    import threading

    from gradsync.comm.compression import PowerSGDHook

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.Linear(1024, 1024, bias=False))
    groups, threads, returned, under_way = [], set(), [], []

    class Watched(PowerSGDHook):
        GROUP_BYTES = 1  # every bucket is a group of its own

        def __call__(self, state, bucket):
            if bucket.index() > 0:
                under_way.append(not all(future.done() for future in returned))
            else:
                returned.clear()
            returned.append(super().__call__(state, bucket))
            return returned[-1]

        def _reduce_group(self, buckets):
            groups.append([bucket.index() for bucket in buckets])
            stages = super()._reduce_group(buckets)
            for stage in stages:
                threads.add(threading.get_ident())
                yield stage
            threads.add(threading.get_ident())

    # DDP's first backward puts every parameter in one bucket; from the second on, 4 MB weights
    # in 1 MB buckets are a bucket each, the last layer's first.
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)
    ddp.register_comm_hook(None, Watched(CompressionConfig(name="powersgd", powersgd_start_step=0)))
    for _ in range(2):
        ddp(torch.randn(8, 1024)).sum().backward()
    return {"groups": groups, "on_backward_thread": threads == {threading.get_ident()}, "under_way": under_way,
            "all_done": all(future.done() for future in returned), "finite": bool(torch.isfinite(model[0].weight.grad).all())}


@pytest.mark.launches
def test_powersgd_reduces_groups_in_order_on_the_thread_running_backward_while_it_goes_on():
    # CPU backward runs on the caller's thread. A thread of PowerSGD's own let backward go on
    # during a group's collectives, but on a worker with one core it cost more than it hid
    # (the heap released and faulted in again every step: see PowerSGDHook). Instead a group's
    # stages advance at the next buckets' hooks: the first group is still under way when the
    # second bucket arrives, and every group is done when backward ends.
    for result in launch(powersgd_groups_on_the_backward_thread, 2):
        assert result == {"groups": [[0], [0], [1]], "on_backward_thread": True, "under_way": [True], "all_done": True,
                          "finite": True}


def powersgd_with_a_group_of_vectors_only():
    """A group holding only 1-D parameters (sent exact, no factors) between groups of matrices."""
    import copy

    from gradsync.comm.compression import PowerSGDHook

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False), torch.nn.LayerNorm(512),
                                torch.nn.Linear(512, 512, bias=False))

    shapes = []

    class EveryBucketAGroup(PowerSGDHook):
        GROUP_BYTES = 1

        def _reduce_group(self, buckets):
            shapes.append([tuple(g.shape) for bucket in buckets for g in bucket.gradients()])
            return super()._reduce_group(buckets)

    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)  # a bucket (and group) per parameter
    ddp.register_comm_hook(None, EveryBucketAGroup(CompressionConfig(name="powersgd", powersgd_start_step=0)))
    for _ in range(3):
        model.zero_grad()
        torch.manual_seed(dist.get_rank())
        ddp(torch.randn(8, 512)).pow(2).mean().backward()
    norm = model[1]
    local = [p.grad.clone() for p in norm.parameters()]
    # The exact mean of the ranks' own LayerNorm gradients, computed the same way without the hook.
    plain = copy.deepcopy(model)
    plain.zero_grad()
    torch.manual_seed(dist.get_rank())
    plain(torch.randn(8, 512)).pow(2).mean().backward()
    expected = [p.grad for p in plain[1].parameters()]
    for grad in expected:
        dist.all_reduce(grad)
        grad.div_(dist.get_world_size())
    return {"last_step": shapes[-4:], "exact": all(torch.allclose(a, b, atol=1e-6) for a, b in zip(local, expected))}


@pytest.mark.launches
def test_powersgd_stages_a_group_without_matrices_like_any_other():
    for result in launch(powersgd_with_a_group_of_vectors_only, 2):
        assert result == {"last_step": [[[512, 512]], [[512]], [[512]], [[512, 512]]], "exact": True}


def test_powersgd_groups_are_an_eighth_of_the_backward_between_one_and_twenty_five_megabytes():
    from gradsync.comm.compression import PowerSGDHook

    megabyte = 2**20
    assert PowerSGDHook.group_bytes_for(45 * megabyte) == 45 * megabyte // 8  # ResNet-18: 5.6 MB
    assert PowerSGDHook.group_bytes_for(2 * megabyte) == megabyte  # a small model: few groups, not tiny ones
    assert PowerSGDHook.group_bytes_for(500 * megabyte) == 25 * megabyte  # GPT-2 small: DDP's bucket size


def powersgd_groups_of_a_model_in_small_buckets():
    """The groups (bucket indices) of each of three backward passes over 16 buckets of 256 KB."""
    from gradsync.comm.compression import PowerSGDHook

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(16)])
    groups: list[list[list[int]]] = []

    class Watched(PowerSGDHook):
        def _reduce_group(self, buckets):
            if buckets[0].index() == 0:
                groups.append([])
            groups[-1].append([bucket.index() for bucket in buckets])
            return super()._reduce_group(buckets)

    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25)
    ddp.register_comm_hook(None, Watched(CompressionConfig(name="powersgd", powersgd_start_step=0)))
    for _ in range(3):
        ddp(torch.randn(8, 256)).sum().backward()
    return groups


@pytest.mark.launches
def test_powersgd_learns_its_group_size_from_the_first_backward():
    # 4 MB of gradients: until a backward has shown that, a group is 25 MB (here, the whole
    # backward); then an eighth of 4 MB is under the 1 MB floor, so groups of four 256 KB buckets.
    for groups in launch(powersgd_groups_of_a_model_in_small_buckets, 2):
        later = [list(range(at, at + 4)) for at in range(0, 16, 4)]
        assert groups[1:] == [later, later]
        assert len(groups[0]) == 1
