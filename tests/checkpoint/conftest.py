import pytest

from tests.checkpoint.train_script import train
from tests.harness import launch


@pytest.fixture(scope="session")
def uninterrupted() -> dict:
    """The reference: train_script's training on 2 ranks, never stopped, never checkpointed."""
    return launch(train, 2, checkpoint_dir=None)[0]
