# The two commands a newcomer types: `make demo` and `make test`.
# Both create (once) and reuse a local virtual environment in .venv.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench-overhead bench-run-overhead clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gradsync demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

# Not part of `make test`: timings belong in benchmarks, reported as side-by-side ratios.
bench-overhead: $(STAMP)
	$(BIN)/python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/trainer_overhead.py

bench-run-overhead: $(STAMP)
	$(BIN)/python benchmarks/run_overhead.py

clean:
	rm -rf $(VENV) gradsync_runs .pytest_cache
