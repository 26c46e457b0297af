# make demo: set up .venv if missing, then train the char GPT with stock ZeRO-3, dense INT4 and DGC (2 ranks).
# make test: set up .venv if missing, then run the tests.
# make bench: (root) step time on a rate-limited link, compressed vs stock ZeRO-3 and DDP+PowerSGD.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The venv's bin first, as when it is activated: the same ninja builds and finds the JIT caches
# (another ninja version counts the cached DeepSpeed CPU comm op as stale and rebuilds it).
export PATH := $(abspath $(VENV))/bin:$(PATH)
STEPS ?= 300
SEED ?= 1234

.PHONY: install test faults hf-gap soak peer-tests demo bench bench-target bench-nodes bench-memory bench-kernels profile report \
	gpu-check gpu-wheels clean

install: $(VENV)/.installed

# DS_BUILD_DGC=1: prebuild the fused CPU op (and the CUDA op where torch has CUDA) into deepspeed_dgc/_prebuilt. torch
# and deepspeed (what the build needs) come first (about 45 s here); then the op compiles (about 40 s on 2 cores) while
# pip installs the rest (the other core, about 30 s) and then builds DeepSpeed's CPU shared-memory comm op where the
# tests' launches and make demo's load it (build/torch_extensions, tests/conftest.py; about 40 s, which the first launch
# otherwise spends with one core idle; if it fails, the first launch builds it); the editable install then builds nothing.
EXTENSIONS := $(CURDIR)/build/torch_extensions
$(VENV)/.installed: setup.py requirements-test.txt $(wildcard csrc/dgc/*) $(wildcard op_builder/*.py)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $$(grep -E '^(torch|deepspeed)==' requirements-test.txt)
	DS_BUILD_DGC=1 $(PY) setup.py -q build_ext --inplace > $(VENV)/op_build.log 2>&1 & build=$$!; \
	$(PY) -m pip install -q -r requirements-test.txt; deps=$$?; \
	[ $$deps -ne 0 ] || TORCH_EXTENSIONS_DIR=$(EXTENSIONS) $(PY) -c \
		"from deepspeed.comm.torch import build_shm_op; build_shm_op()" > $(VENV)/shm_build.log 2>&1 || \
		echo "make install: DeepSpeed's shm comm op did not build ($(VENV)/shm_build.log); the tests will build it"; \
	wait $$build || { cat $(VENV)/op_build.log; echo "make install: building the fused op failed"; exit 1; }; \
	exit $$deps
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

test: install
	$(PY) -m pytest -q --durations=20 tests

# the whole fault suite (tests/faults), its slow cases included (CI runs one case of each file through `make test`);
# about 75 minutes on 2 cores, half of it the 3000-step soak (results/faults.md has each part's command)
faults: install
	$(PY) -m pytest -q -m "" tests/faults

# the Hugging Face Trainer with the recommended method against stock, 200 steps each at 3 seeds (issue 51 item 3; about
# 3 minutes on 2 cores, so not in make test): an expected failure (XFAIL, with the mean gap) between 1% and 4%, a
# failure above 4%
hf-gap: install
	$(PY) -m pytest -q -rx -m "" tests/distributed/test_hf_trainer.py -k within_1pct_of_stock

# the soak (issue 52 item 6): the main job (zero3_dgc_adam, 2 ranks) for 3000 steps, a checkpoint every 100, SIGKILLed
# and resumed every 500, against an uninterrupted run; loss per step, resident memory and state bytes per rank
# (results/soak.json, results/soak.png; about 27 min on 2 busy cores)
soak: install
	$(PY) -m benchmarks.soak --steps 3000 --checkpoint-every 100 --resume-every 500 --warmup 200

# DeepSpeed's own ZeRO-3 unit tests (issue 51 item 4: the ones of tests/unit/v1/zero and tests/unit/runtime/zero that
# build a ZeRO-3 config, vendored in peer/deepspeed_tests) run stock, with "dgc": {"enabled": true} and with the
# recommended section injected; each test against stock: unchanged, refused (a deepspeed_dgc error naming why) or
# failed (results/peer_tests.md, .json; about 40 min per section on 2 busy cores, so not in make test).
# PEER_ARGS: a subset, e.g. PEER_ARGS="--sections recommended -k test_zero_tensor_fragment"
PEER_ARGS ?=
peer-tests: install
	$(PY) -m benchmarks.peer_tests $(PEER_ARGS)

# DeepSpeed's CPU comm op, which make install built there (else the first launch builds it in ~/.cache, about a minute)
demo: install
	TORCH_EXTENSIONS_DIR=$(EXTENSIONS) $(PY) examples/compare.py --max-steps $(STEPS) --seed $(SEED)

# as root: a private network namespace with a tc-limited loopback (100 Mbit/s, 1 Gbit/s, unlimited), about 80 min
bench: install
	$(PY) -m benchmarks.bench_network --json runs/bench_network/results.json

# as root: time to the same loss (stock fp32's at step 100 of 200, and at step 30, which DDP + PowerSGD reaches) at
# 100 Mbit/s, 1 Gbit/s and unlimited; 3 timing rounds of 6 steps (2 of 4 did not settle 5% on the unlimited link),
# about 110 min
# BENCH_SEEDS=3: every loss run at 3 seeds, the tables comparing the means (the loss runs take BENCH_SEEDS times as long)
BENCH_SEEDS ?= 1
bench-target: install
	$(PY) -m benchmarks.bench_network --rates 100mbit 1gbit --configs stock_fp32 stock_bf16 zeropp_like \
		ddp_powersgd int4_ef_wint4 dgc_adam_flat policy_auto --converge-steps 200 --eval-interval 10 \
		--target-steps 100 30 --repeats 3 --timed-steps 6 --seeds $(BENCH_SEEDS) --out-dir runs/bench_ttt \
		--json runs/bench_ttt/bench_time_to_target.json

# as root: two nodes of two in a namespace, only the path between them limited (100 Mbit/s, 1 Gbit/s, unlimited)
bench-nodes: install
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.bench_network --nodes 2x2 --rates 100mbit 1gbit --micro-batch 4 \
		--converge-steps 120 --eval-interval 20 --out-dir runs/bench_2x2 --json runs/bench_2x2/results.json

# where one step's time goes (cProfile of one step, the network benchmark's model, stock and the recommended settings)
profile: install
	$(PY) -m benchmarks.profile_step

# per-rank memory of the extension's state (every storage and placement) and ZeRO-3's own, between steps and inside
# a step, flat (2 CPU ranks) and hierarchical 2x2 (4), with the projection to 7B and 70B (4 to 7 min on 2 busy cores)
bench-memory: install
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.bench_memory --json results/bench_memory.json --results results

bench-kernels: install
	$(PY) -m benchmarks.bench_kernels --json runs/bench_kernels.json

report: install
	$(PY) -m deepspeed_dgc report

# on a machine with a GPU (a Python with CUDA torch and DeepSpeed: GPU_PYTHON): tests/gpu, the main job of every
# method with the extension under torch.cuda.set_sync_debug_mode("error"), max_memory_allocated against stock,
# launches per bucket, the CUDA op's GB/s; one table, under 8 minutes (benchmarks/gpu_check.py)
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) -m benchmarks.gpu_check

# wheels for a GPU machine that has torch (CUDA), pytest and numpy but not DeepSpeed or pydantic, and no network (the
# device tool's image: Python 3.12): `make gpu-wheels` here fills .whl/ (git-ignored, about 5 MB); there, with .whl
# carried, the command docs/testing.md gives
GPU_WHEEL_PY ?= 3.12
GPU_WHEELS := deepspeed==0.19.8 hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing_extensions==4.16.0
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_WHEEL_PY) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(filter-out deepspeed==%,$(GPU_WHEELS))
	$(PYTHON) -m pip wheel -q --no-deps -w .whl $(filter deepspeed==%,$(GPU_WHEELS))  # an sdist on PyPI: pure Python
	ls .whl

clean:
	rm -rf runs build *.egg-info .pytest_cache deepspeed_dgc/_prebuilt/*.so
