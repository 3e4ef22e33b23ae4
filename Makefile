# The two commands a newcomer types: `make demo` and `make test`.
# Both create (once) and reuse a local virtual environment in .venv.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Test-only, installed without its declared dependencies (see requirements-dev.txt).
HTA := HolisticTraceAnalysis==0.5.0

.PHONY: demo test test-fast test-zoo zoo-record test-under-load chaos compat bench-parallel bench-lora bench-tp-meter bench-overhead bench-run-overhead bench-analysis-scale bench-system-sampler bench-checkpoint-overhead bench-compression-accuracy bench-hook-cost bench-hook-cost-300mbit bench-doctor-overhead bench-doctor-blind bench-run-blind bench-resnet-300mbit bench-resnet-300mbit-release bench-resnet-slow-links bench-side-by-side gpu-check slurm-check clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	$(BIN)/pip install --quiet --no-deps $(HTA)
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/gradsync demo

# Three pytest workers, one test file each at a time, on 2 cores: many tests spend their time
# waiting (stall timeouts, a rank that hangs on purpose, a shaped link), so with two the cores
# were 42% idle (1039-1090 s; 996-1043 s with three). tests/conftest.py starts the longest files first.
# No test needs the machine to itself: none judges a duration or a decision made from timings
# measured here (those are tested on injected measurements), so nothing runs apart.
# --no-loadscope-reorder: xdist would otherwise hand out files by their number of tests, which
# left the longest few-test files (chaos, the bench, the demos) to run alone at the end.
test: $(STAMP)
	$(BIN)/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder tests

# The zoos of scripts run under `gradsync run` (tests/run/zoo, tests/run/doctor_zoo). `make test`
# launches only those whose tests need a launch (exit codes, the terminal, timing, processes) and
# makes the other diagnoses again from their recordings in tests/run/zoo_recorded.
ZOO_TESTS := tests/run/test_zoo.py tests/run/test_doctor_script.py tests/run/test_doctor_consistency.py tests/run/test_doctor_invariants.py \
	tests/run/test_doctor_harmless.py

# Not part of `make test`: every zoo script launched (~15 min on 2 cores).
test-zoo: $(STAMP)
	$(BIN)/python -m pytest -n 3 --dist loadfile --zoo=live $(ZOO_TESTS)

# Every zoo script launched and recorded again: after a zoo script, or what the ranks record
# (gradsync.run.worker, rundir.records, the doctor's facts), changed. `git diff tests/run/zoo_recorded`
# then shows what did. Plain torchrun's runs of the zoo (the differential test's other side) are
# recorded where missing or stale (another version of the script, or of torch): ~20 min more for all 82,
# and as much again for the doctor's scripts, stopped after their K steps (tests/run/stop_after_steps.py).
zoo-record: $(STAMP)
	$(BIN)/python -m pytest -n 3 --dist loadfile --zoo=record $(ZOO_TESTS)

# The inner loop (~40 s on 2 cores): the tests that stay inside pytest's own process, unit tests
# and single-process tests of real objects. Tests that start processes (ranks, launchers, CLIs)
# are marked `launches` and left to `make test`; --in-process fails one that is not marked.
test-fast: $(STAMP)
	$(BIN)/python -m pytest --in-process -m "not launches" tests

# The whole suite beside one spinning process per core (normal priority): CI runs on the
# developer's own machine, which is not always idle, and no test may depend on a quiet one.
test-under-load: $(STAMP)
	$(BIN)/python tests/under_load.py -- $(MAKE) --no-print-directory test

# Not part of `make test`: a checkpointed job broken every way benchmarks/chaos.py knows (SIGKILL at
# 2-4 ranks and during sync/async saves, SIGSTOP, a simulated host cut off or killed, a full disk,
# damaged checkpoints), 3 trials each, every one compared bitwise with an uninterrupted run
# (~15 min; the host and disk faults need root and are skipped without it).
chaos: $(STAMP)
	$(BIN)/python benchmarks/chaos.py --trials-per-kind 3 --output gradsync_runs/chaos/table.md

# Not part of `make test`: Accelerate, Lightning and HF Trainer scripts under torchrun and under
# `gradsync run`, side by side (builds its own environment, .venv-compat, once; ~10 min).
compat:
	benchmarks/compat/run_all.sh

# Not part of `make test`: timings belong in benchmarks, reported as side-by-side ratios.
bench-overhead: $(STAMP)
	$(BIN)/python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/trainer_overhead.py

bench-run-overhead: $(STAMP)
	$(BIN)/python benchmarks/run_overhead.py

# How long `gradsync run`'s diagnosis takes on 1,024 ranks' synthetic records; fails over 5 s or on a wrong diagnosis.
bench-analysis-scale: $(STAMP)
	$(BIN)/python benchmarks/analysis_scale.py

bench-system-sampler: $(STAMP)
	$(BIN)/python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/system_sampler_overhead.py

# What sync and async checkpoints cost a ResNet-18 run, as a share of its step time.
bench-checkpoint-overhead: $(STAMP)
	$(BIN)/python benchmarks/checkpoint_overhead.py

# What gradsync's fp32 (metered), fp16 and PowerSGD hooks cost backward beside PyTorch's, in turns on 2 loopback ranks.
bench-hook-cost: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/hook_cost.py --configs fp32,fp16,powersgd

# The same in turns across 2 simulated hosts at 300 Mbit/s (root): launches swing by more than the
# gap between the two PowerSGDs, turns inside one pair of processes do not.
bench-hook-cost-300mbit: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m gradsync.bench.cluster --hosts 2 --link 300mbit -- $(BIN)/python -m torch.distributed.run \
		--nnodes {nnodes} --node-rank {node_rank} --master-addr {master_addr} --master-port {master_port} --nproc-per-node 1 \
		benchmarks/hook_cost.py --configs fp32,fp16,powersgd --batch-size 32

# The training loop under `gradsync doctor --steps K` against a plain `gradsync run`, alternating launches.
bench-doctor-overhead: $(STAMP)
	$(BIN)/python benchmarks/doctor_overhead.py

# `gradsync doctor --steps 20` on the blind sets (scripts written from public reports by someone who had
# not read the doctor, benchmarks/doctor_blind/setN): how many mistakes it names at their cause line, how
# many healthy look-alikes it leaves alone (~10 min per set).
bench-doctor-blind: $(STAMP)
	$(BIN)/python benchmarks/doctor_blind.py benchmarks/doctor_blind/set1
	$(BIN)/python benchmarks/doctor_blind.py benchmarks/doctor_blind/set2
	$(BIN)/python benchmarks/doctor_blind.py benchmarks/doctor_blind/set3
	$(BIN)/python benchmarks/doctor_blind.py benchmarks/doctor_blind/set4

# `gradsync run` on the blind sets of failing and healthy scripts (benchmarks/run_blind/setN, written
# from public reports by someone who had not read it): how many verdicts name the rank and the line at
# fault, how many healthy look-alikes run untouched (~15 min per set).
bench-run-blind: $(STAMP)
	$(BIN)/python benchmarks/run_blind.py benchmarks/run_blind/set1
	$(BIN)/python benchmarks/run_blind.py benchmarks/run_blind/set2

# Test accuracy and loss curve of the digits demo under each gradient compressor.
bench-compression-accuracy: $(STAMP)
	$(BIN)/python benchmarks/compression_accuracy.py

# ResNet-18 on two simulated hosts joined by a 300 Mbit/s link (needs root): gradsync's configurations
# beside the peers (a hand-written DDP loop, PyTorch's own hooks) and the ceilings (no-comm, lockstep), in two
# interleaved rounds (~35 min); the table in docs/performance.md is rewritten from this one run. Every
# job, the peers too, keeps freed host memory (host_memory's default); the -release target runs them
# all with the C library's defaults instead, into a table of its own.
RESNET_300MBIT = gradsync bench train --workload resnet18 --hosts 2 --nproc-per-node 1 --link 300mbit \
	--configs no-comm,lockstep,plain,torch-fp16,torch-powersgd,fp32,fp16,powersgd,int8,auto --steps 16 --warmup 3 --rounds 2
bench-resnet-300mbit: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/$(RESNET_300MBIT) --output-dir gradsync_runs/bench-resnet18-300mbit
	$(BIN)/python -m gradsync.bench.tables gradsync_runs/bench-resnet18-300mbit/report.json docs/performance.md \
		--marker bench-resnet-300mbit --command "OMP_NUM_THREADS=1 $(RESNET_300MBIT)"
bench-resnet-300mbit-release: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/$(RESNET_300MBIT) --host-memory release --output-dir gradsync_runs/bench-resnet18-300mbit-release
	$(BIN)/python -m gradsync.bench.tables gradsync_runs/bench-resnet18-300mbit-release/report.json docs/performance.md \
		--marker bench-resnet-300mbit-release --command "OMP_NUM_THREADS=1 $(RESNET_300MBIT) --host-memory release"

# The same ResNet-18 where no compressor is enough (~40 min, root): every config at 100 Mbit/s; at 20 Mbit/s,
# where one fp32 step takes ~20 s, without auto (whose 36 trial steps every job would run too) and the peers
# whose twins show the same bytes. Periodic synchronisation every 4 steps; both tables rewritten from these runs.
RESNET_100MBIT = gradsync bench train --workload resnet18 --hosts 2 --nproc-per-node 1 --link 100mbit \
	--configs no-comm,lockstep,plain,torch-fp16,torch-powersgd,fp32,fp16,powersgd,int8,auto,local-sgd,diloco --steps 12 --warmup 2 \
	--periodic-every 4 --rounds 1
RESNET_20MBIT = gradsync bench train --workload resnet18 --hosts 2 --nproc-per-node 1 --link 20mbit \
	--configs no-comm,torch-powersgd,fp32,fp16,powersgd,int8,local-sgd,diloco --steps 10 --warmup 2 --periodic-every 4 --rounds 1
bench-resnet-slow-links: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/$(RESNET_100MBIT) --output-dir gradsync_runs/bench-resnet18-100mbit
	$(BIN)/python -m gradsync.bench.tables gradsync_runs/bench-resnet18-100mbit/report.json docs/performance.md \
		--marker bench-resnet-100mbit --command "OMP_NUM_THREADS=1 $(RESNET_100MBIT)"
	OMP_NUM_THREADS=1 $(BIN)/$(RESNET_20MBIT) --output-dir gradsync_runs/bench-resnet18-20mbit
	$(BIN)/python -m gradsync.bench.tables gradsync_runs/bench-resnet18-20mbit/report.json docs/performance.md \
		--marker bench-resnet-20mbit --command "OMP_NUM_THREADS=1 $(RESNET_20MBIT)"

# The parallelism strategies side by side on the GPT: 4 workers on 2 simulated hosts joined by
# 300 Mbit/s, then on this host's loopback (the 300 Mbit/s run needs root; ~20 min in all). Both
# tables in docs/parallel.md are rewritten from these runs.
PARALLEL_BENCH = gradsync bench train --workload gpt --configs ddp,fsdp,hsdp,tp,fsdp+tp,pp,pp+ddp --steps 12 --warmup 3 \
	--batch-size 8
bench-parallel: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/$(PARALLEL_BENCH) --hosts 2 --nproc-per-node 2 --link 300mbit --output-dir gradsync_runs/bench-parallel-300mbit
	$(BIN)/python -m gradsync.bench.tables gradsync_runs/bench-parallel-300mbit/report.json docs/parallel.md --kind strategies \
		--marker bench-parallel-300mbit --command "OMP_NUM_THREADS=1 $(PARALLEL_BENCH) --hosts 2 --nproc-per-node 2 --link 300mbit"
	OMP_NUM_THREADS=1 $(BIN)/$(PARALLEL_BENCH) --nproc-per-node 4 --output-dir gradsync_runs/bench-parallel-loopback
	$(BIN)/python -m gradsync.bench.tables gradsync_runs/bench-parallel-loopback/report.json docs/parallel.md --kind strategies \
		--marker bench-parallel-loopback --command "OMP_NUM_THREADS=1 $(PARALLEL_BENCH) --nproc-per-node 4"

# What metering tensor parallelism's exchanges (a dispatch mode) costs a TP step, side by side.
bench-tp-meter: $(STAMP)
	$(BIN)/python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp_meter_overhead.py

# Full fine-tuning vs LoRA under DDP on 2 simulated hosts at 300 Mbit/s: how much of the step is
# exposed communication (needs root; ~5 min).
bench-lora: $(STAMP)
	for workload in gpt gpt-lora; do OMP_NUM_THREADS=1 $(BIN)/gradsync bench train --workload $$workload --hosts 2 \
		--nproc-per-node 1 --link 300mbit --configs ddp --steps 12 --warmup 3 --batch-size 8 --json \
		> gradsync_runs/bench-lora-$$workload.json || exit 1; done

# The zoo's stall cases under gradsync run, fr_trace on the same run's Flight Recorder dumps and
# TORCH_DISTRIBUTED_DEBUG=DETAIL, side by side (one case at a time; ~20 min on 2 cores).
bench-side-by-side: $(STAMP)
	$(BIN)/python benchmarks/side_by_side.py --output gradsync_runs/side-by-side/table.md

# Not part of `make test`: deploy/slurm/train.sbatch on a real Slurm cluster (slurmctld, one slurmd per simulated
# host, a private munged; Debian's packages installed when missing), edited only where it tells users to: a healthy
# job, a broken one, scancel --signal=TERM + requeue, the time limit's notice + resubmission, a node's workers killed
# (each compared bitwise with the healthy job) (~5 min, root).
slurm-check: $(STAMP)
	$(BIN)/python benchmarks/slurm_check.py --output gradsync_runs/slurm-check

# Every CUDA path once on one GPU (demo at fp16/bf16, accumulation, compression hooks, gradsync run and
# Flight Recorder on NCCL, the profiler's CUDA rules, NVML, doctor, bench allreduce, FSDP2 and TP, exposed
# communication vs the trace), each check in its own subprocess, <8 min; without CUDA it says so and exits 0.
gpu-check: $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) .venv-compat gradsync_runs .pytest_cache
