"""identical_batches on hand-made facts: only forwards every rank fingerprinted are compared."""

from __future__ import annotations

from tests.doctor.script.facts import categories, findings, script_facts


def _forward(fingerprint: int | None) -> dict:
    return {"fingerprint": fingerprint, "site": "train.py:28", "loader": None}


def test_identical_inputs_count_only_when_every_compared_forward_agrees():
    same = [_forward(1), _forward(2)]
    assert categories({0: script_facts(forwards=same), 1: script_facts(forwards=same)}) == ["no_distributed_sampler"]
    assert categories({0: script_facts(forwards=same), 1: script_facts(forwards=[_forward(1), _forward(3)])}) == []
    # Forwards without comparable tensors are left out; with none left there is nothing to say.
    assert categories({0: script_facts(forwards=[_forward(None)]), 1: script_facts(forwards=[_forward(None)])}) == []
    assert categories({0: script_facts(forwards=same)}) == []  # one rank: nothing to compare with


def _loader(**fields) -> dict:
    return {"key": "train.py:27#0", "site": "train.py:27", "batches": 4, "samples": None, "sampler": None,
            "feeds_training": True, "under_join": False, "built_at": None, "dataset_loop": None, **fields}


def _findings(loader: dict) -> list:
    fed = [{"fingerprint": 1, "site": "train.py:28", "loader": "train.py:27"}]
    return findings({rank: script_facts(forwards=fed, loaders=[loader]) for rank in (0, 1)})


def test_the_finding_is_named_where_the_samples_were_chosen():
    (built,) = _findings(_loader(built_at="train.py:20"))
    assert built.locations == {"0": "train.py:20", "1": "train.py:20"}
    assert "built at train.py:20 without a DistributedSampler" in built.message
    (streamed,) = _findings(_loader(built_at="train.py:20", dataset_loop="data.py:14"))
    assert streamed.locations == {"0": "data.py:14", "1": "data.py:14"}
    assert "the IterableDataset's loop at data.py:14 yields every sample on every rank" in streamed.message
    (unknown,) = _findings(_loader())  # facts of a loader whose construction was not seen: at the forward
    assert unknown.locations == {"0": "train.py:28", "1": "train.py:28"}
