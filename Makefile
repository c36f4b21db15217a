# megatron-r3: the two set-up commands are `make install` and `make test`.
PYTHON ?= python3
VPY := .venv/bin/python
MEGATRON ?=
# CPU=1: `make patch` applies the CPU series (patches/cpu/) on top of the upstream one.
CPU ?=
PYTEST_ARGS ?=

.PHONY: check-megatron-lm megatron-lm-checkout megatron-lm-pristine megatron-rl-deps install test test-cpu test-gpu bench check-patches patch clean help upstream-tests wheelhouse

help:
	@echo "make install        .venv + pinned deps + patched megatron-core 0.19.2+r3 + megatron_r3 (WHEELHOUSE=dir: offline)"
	@echo "make wheelhouse WHEELHOUSE=dir [WHEELHOUSE_ARGS=...]   download what make install needs on an offline CUDA node (tools/wheelhouse.py; --megatron-rl, --parts MIB)"
	@echo "make test           the whole suite: CPU tests always, GPU tests when CUDA is available (TEST_WORKERS=n)"
	@echo "make bench          benchmarks (GPU): packing kernel, the update pass on rollout-shaped and full data (1 GPU, EP=2 on 2 GPUs), tools/dump_rollouts.py on one CPU core, Megatron's training stack vs the old loop's, generation tokens/s of the rollout engines; a bin's replay in one forward of Megatron-LM's RL loop (with build/megatron-lm); the series' cost for users without replay, pristine vs patched core, per upstream-tests bundle present; build/bench/"
	@echo "make check-patches [MEGATRON=checkout]   git am every pull request of patches/ (0.19 form) and patches/cpu/ on the pristine sdist; with MEGATRON, the form of that checkout's base (main) on it"
	@echo "make patch MEGATRON=/path/to/Megatron-LM [CPU=1]   apply the form of your checkout's base (0.19 or main; CPU=1: and patches/cpu/, 0.19 only); on main also patches/megatron-lm/"
	@echo "make megatron-lm-checkout [MEGATRON_GIT=repo]   build/megatron-lm: Megatron-LM main with both series (launch/train_rl_r3.sh)"
	@echo "make megatron-lm-pristine [MEGATRON_GIT=repo]   build/megatron-lm-pristine: the same files without either series (compare-rl-tests)"
	@echo "make megatron-rl-deps [WHEELHOUSE=dir]   train_rl.py's dependencies, pinned (requirements-megatron-rl.txt; make install installs them where torch has no CUDA)"
	@echo "make check-megatron-lm [MEGATRON_GIT=repo] [MEGATRON_PYTHON=py]   git am --3way both series on Megatron-LM main, compile, collect tests/unit_tests/rl (docs/megatron_rl.md)"
	@echo "make upstream-tests [UPSTREAM_BASE=0.19|main] [MEGATRON=checkout]   Megatron-LM's and the series' unit tests on the pristine and the patched core, side by side (build/upstream-tests[-main]; runs where CUDA is; docs/upstream_tests.md)"

install:
	@PYTHON=$(PYTHON) bash tools/install.sh

# Everything `make install` needs on an offline CUDA node (Python 3.12, CUDA 13 unless WHEELHOUSE_ARGS says).
WHEELHOUSE_ARGS ?=
wheelhouse:
	@test -n "$(WHEELHOUSE)" || { echo "usage: make wheelhouse WHEELHOUSE=dir [WHEELHOUSE_ARGS='--python-version 3.12 --cuda-major 13']" >&2; exit 2; }
	$(PYTHON) tools/wheelhouse.py "$(WHEELHOUSE)" $(WHEELHOUSE_ARGS)

$(VPY):
	@echo "no .venv here: run 'make install' first" >&2; exit 1

# pytest-xdist workers: serial on small machines (CI has 2 cores), half the cores (at most 8) on big ones.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; n = os.cpu_count() or 1; print(min(8, n // 2) if n >= 8 else 0)")

test: $(VPY)
	$(VPY) -m pytest tests -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Packing kernel, then the trainer's update pass on rollout-shaped data (the loop benchmark) and on
# full rows, on one GPU and, with two or more, at EP=2 under torchrun; then the update pass and optimizer
# step on Megatron's training stack against the loop's old one; the rollout engines' generation tokens/s;
# the host's preparation of a batch before and after the batch plan (CPU); the series' cost for users
# who do not enable replay, pristine vs patched core, where an upstream-tests bundle is (docs/upstream_tests.md).
bench: $(VPY)
	$(VPY) -m bench $(BENCH_ARGS)
	$(VPY) -m bench.host_prepare --out build/bench/host-prepare.md
	taskset -c 0 $(VPY) -m bench.dump_rollouts --out build/bench/dump-rollouts.md
	$(VPY) -m bench.step --data rollout --out build/bench/loop-ep1.md
	$(VPY) -m bench.step --data full --out build/bench/step-ep1.md
	$(VPY) -m bench.training_stack --out build/bench/training-stack.md
	$(VPY) -m bench.launch_cost
	$(VPY) -m bench.generation --out build/bench/generation.md
	@if [ -f build/megatron-lm/megatron/rl/routing_replay.py ]; then \
	  MEGATRON=build/megatron-lm $(VPY) -m bench.rl_forward_cost --out build/bench/rl-forward-cost.md; \
	else echo "bench.rl_forward_cost: skipped, no build/megatron-lm (make megatron-lm-checkout)"; fi
	@for base in 0.19 main; do dir=build/upstream-tests$$([ $$base = main ] && echo -main); \
	  if [ -f $$dir/manifest.json ]; then $(VPY) -m bench.series_cost --base $$base || exit 1; \
	  else echo "bench.series_cost --base $$base: skipped, no $$dir (make upstream-tests)"; fi; done
	@if [ "$$($(VPY) -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then \
	  $(VPY) -m torch.distributed.run --nproc-per-node 2 -m bench.step --ep 2 --data rollout --out build/bench/loop-ep2.md && \
	  $(VPY) -m torch.distributed.run --nproc-per-node 2 -m bench.step --ep 2 --data full --out build/bench/step-ep2.md; fi

# The base version and sdist come from tools/patch_series.py (one place to change them).
BASE := $(word 1,$(shell $(PYTHON) tools/patch_series.py base))
SDIST := build/$(word 2,$(shell $(PYTHON) tools/patch_series.py base))

check-patches:
	@mkdir -p build
	@test -f $(SDIST) || $(PYTHON) -m pip download -q --no-deps --no-binary :all: --ignore-requires-python megatron-core==$(BASE) -d build
	$(PYTHON) tools/patch_series.py check $(SDIST) $(if $(MEGATRON),--megatron "$(MEGATRON)")

patch:
	@test -n "$(MEGATRON)" || { echo "usage: make patch MEGATRON=/path/to/Megatron-LM [CPU=1]" >&2; exit 2; }
	$(PYTHON) tools/patch_series.py apply $(if $(CPU),--cpu) "$(MEGATRON)"
	$(PYTHON) tools/megatron_lm_series.py apply --only-main "$(MEGATRON)"

# The Megatron-LM series on a scratch clone of main with the core series (docs/megatron_rl.md);
# MEGATRON_GIT: a Megatron-LM git repository; MEGATRON_PYTHON: collect tests/unit_tests/rl with it.
MEGATRON_GIT ?= /work/.mirror/NVIDIA+Megatron-LM/repo
MEGATRON_PYTHON ?=
check-megatron-lm:
	$(PYTHON) tools/megatron_lm_series.py check --megatron "$(MEGATRON_GIT)" $(if $(MEGATRON_PYTHON),--python "$(MEGATRON_PYTHON)")

# build/megatron-lm: Megatron-LM main (the core series' main base) with both series, no .git
# (what the example, the GPU test and bench.megatron_rl run; small enough to carry to a GPU node).
megatron-lm-checkout:
	$(PYTHON) tools/megatron_lm_series.py checkout --megatron "$(MEGATRON_GIT)" build/megatron-lm

# The same files without either series: what Megatron-LM's RL unit tests are compared with
# (tools/megatron_lm_series.py compare-rl-tests, docs/megatron_rl.md).
megatron-lm-pristine:
	$(PYTHON) tools/megatron_lm_series.py checkout --pristine --megatron "$(MEGATRON_GIT)" build/megatron-lm-pristine

# What Megatron-LM's train_rl.py imports beyond megatron-core, pinned; make install installs them
# where torch has no CUDA (the example's CPU tests), this on a CUDA node. WHEELHOUSE=dir: offline
# (make wheelhouse WHEELHOUSE_ARGS=--megatron-rl downloads them).
megatron-rl-deps: $(VPY)
	$(VPY) -m pip install -q $(if $(WHEELHOUSE),--no-index --find-links "$(WHEELHOUSE)") -r requirements-megatron-rl.txt

clean:
	rm -rf build .venv megatron_r3/_C*.so *.egg-info

# Megatron-LM's own unit tests and the series' own tests on the pristine and on the patched core,
# side by side, for one base of the series (UPSTREAM_BASE: 0.19, the sdist with tests at tag
# core_v0.19.0; main, Megatron-LM main at the pinned commit): `prepare` builds
# build/upstream-tests/ (main: build/upstream-tests-main/) here (no GPU); `run` runs both sides
# under torchrun on a GPU machine (carry the bundle there). UPSTREAM_ARGS: more arguments for `run`.
UPSTREAM_ARGS ?=
UPSTREAM_BASE ?= 0.19
upstream-tests:
	@test -f $(SDIST) || $(PYTHON) -m pip download -q --no-deps --no-binary :all: --ignore-requires-python megatron-core==$(BASE) -d build
	$(PYTHON) tools/upstream_tests.py prepare --force --base $(UPSTREAM_BASE) $(if $(MEGATRON),--megatron "$(MEGATRON)")
	@if $(PYTHON) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then \
	  $(PYTHON) tools/upstream_tests.py run --force --base $(UPSTREAM_BASE) $(UPSTREAM_ARGS); \
	else echo "no CUDA here: the bundle is ready; on a GPU machine run: tools/upstream_tests.py run --base $(UPSTREAM_BASE) (docs/upstream_tests.md)"; fi
