"""Do no harm under `gradsync run --doctor-steps K` (what `gradsync doctor --steps K` runs): what
users do with a model once DDP wrapped it sees nothing of gradsync's bookkeeping.

A snapshot (`copy.deepcopy(ddp)`), an EMA teacher copied from `ddp.module`, `pickle.dumps(ddp)`,
`torch.save(ddp)` of a model with the script's own comm hook, `torch.compile(ddp)`, and walks over
`named_modules()` that list each module's attributes and hooks: each script of tests/run/doctor_zoo
prints what it sees, and the differential test (as in the other doctor test files) compares each
rank's end and what it printed with plain torchrun's run of the same K steps. The checks' patches
found before keeping their records beside the user's objects (gradsync.run.harmless.IdentityMap):
a watch attribute and a process group in DDP's list of comm hooks (the deepcopy failed with "cannot
pickle ProcessGroup"), a forward pre-hook on the inner module (the pickle failed on the closure,
the walk counted it), dynamo tracing the forward's fingerprint (a UserWarning per rank).
"""

from __future__ import annotations

import pytest

from tests.conftest import ZOO_OPTION
from tests.run.doctor_harness import assert_as_under_plain_torchrun, guard_of, plain_views, run_all
from tests.run.recordings import Runs, assert_every_field_recorded

K = 10  # each script runs 10 to 14 steps, and copies or saves the model within the first 10

# name -> (script under tests/run, K)
SCRIPTS = {name: (f"doctor_zoo/{name}.py", K) for name in [
    "healthy_ema_teacher_deepcopy", "healthy_wrapped_model_pickled", "healthy_compiled_wrapped_model",
    "healthy_module_walk",
]}

pytestmark = [pytest.mark.launches, guard_of(SCRIPTS)]

# Launched under `make test`: the two whose failure users met (a deepcopy and a pickle of the
# wrapped model) and the compiled one (what dynamo warns of shows on stderr, which a recording keeps
# only as its warnings); the other is made again from its recording (tests/run/recordings.py).
LIVE = ["healthy_ema_teacher_deepcopy", "healthy_wrapped_model_pickled", "healthy_compiled_wrapped_model"]


@pytest.fixture(scope="session")
def doctor(request, tmp_path_factory) -> Runs:
    return run_all(SCRIPTS, LIVE, "doctor_harmless", request.config.getoption(ZOO_OPTION), tmp_path_factory.mktemp("harmless"))


@pytest.fixture(scope="session")
def plain(request, tmp_path_factory) -> Runs:
    return plain_views(SCRIPTS, request.config.getoption(ZOO_OPTION), tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_rank_ends_and_prints_as_under_plain_torchrun_for_the_same_steps(doctor, plain, name):
    assert_as_under_plain_torchrun(doctor[name], plain[name])


@pytest.mark.parametrize("name", SCRIPTS)
def test_copies_pickles_compiles_and_walks_of_a_wrapped_model_are_healthy(doctor, name):
    run = doctor[name]
    assert not run.live or run.returncode == 0, run.explain()
    assert run.diagnosis["status"] == "ok" and run.findings() == [], run.explain()
    assert "gradsync run: warning" not in run.output and "Warning: " not in run.output, run.explain()


def test_the_recordings_have_every_field_the_ranks_record_now(doctor):
    assert_every_field_recorded(doctor, "doctor_harmless")
