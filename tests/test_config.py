import pytest

import gradsync
from gradsync import ConfigError, TrainerConfig


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"accumulation_steps": 0}, "accumulation_steps=0"),
        ({"accumulation_steps": -2}, "integer >= 1"),
        ({"accumulation_steps": 1.5}, "integer >= 1"),
        ({"precision": "fp8"}, "use one of fp32, bf16, fp16"),
        ({"max_grad_norm": 0}, "positive number, or None"),
        ({"device": "tpu"}, "use 'cuda', 'cpu'"),
        ({"backend": "mpi"}, "use 'nccl' (CUDA), 'gloo' (CPU)"),
        ({"timeout_s": -1}, "positive number of seconds"),
        ({"seed": -1}, "non-negative integer"),
        ({"ddp": {"bucket_cap_mb": 0}}, "positive number of megabytes"),
        ({"ddp": {"bucket_size": 5}}, "unknown option(s) bucket_size"),
        ({"metrics": {"log_every": 0}}, "integer >= 1"),
        ({"accumulate": 4}, "unknown option(s) accumulate"),
    ],
)
def test_bad_options_raise_config_error_saying_what_to_change(options, says):
    with pytest.raises(ConfigError) as error:
        TrainerConfig.from_kwargs(**options)
    assert says in str(error.value)


def test_nested_sections_accept_dicts_and_dataclasses():
    from_dict = TrainerConfig(ddp={"bucket_cap_mb": 50}, metrics={"log_every": 5})
    from_class = TrainerConfig(ddp=gradsync.DDPConfig(bucket_cap_mb=50), metrics=gradsync.MetricsConfig(log_every=5))
    assert from_dict == from_class
    assert from_dict.ddp.bucket_cap_mb == 50 and from_dict.metrics.log_every == 5


def test_describe_is_plain_and_names_callables():
    def my_hook(state, bucket):
        raise AssertionError("never called")

    description = TrainerConfig(ddp={"comm_hook": my_hook}).describe()
    assert description["ddp"]["comm_hook"].endswith("my_hook")
    assert description["accumulation_steps"] == 1


def test_setup_takes_a_config_or_options_not_both():
    with pytest.raises(ConfigError, match="not both"):
        gradsync.setup(TrainerConfig(), seed=1)
