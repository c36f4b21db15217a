# megatron-r3: the two set-up commands are `make install` and `make test`.
PYTHON ?= python3
VPY := .venv/bin/python
MEGATRON ?=
PYTEST_ARGS ?=

.PHONY: install test test-cpu test-gpu bench check-patches patch clean help

help:
	@echo "make install        .venv + pinned deps + patched megatron-core 0.19.2+r3 + megatron_r3 (WHEELHOUSE=dir: offline)"
	@echo "make test           the whole suite: CPU tests always, GPU tests when CUDA is available (TEST_WORKERS=n)"
	@echo "make bench          benchmarks (GPU): packing kernel, the update pass on rollout-shaped and full data (1 GPU, EP=2 on 2 GPUs), Megatron's training stack vs the old loop's; build/bench/"
	@echo "make check-patches  apply patches/ to a pristine sdist; fail on fuzz, offsets or a missing header"
	@echo "make patch MEGATRON=/path/to/Megatron-LM   apply patches/ to your checkout"

install:
	@PYTHON=$(PYTHON) bash tools/install.sh

$(VPY):
	@echo "no .venv here: run 'make install' first" >&2; exit 1

# pytest-xdist workers: serial on small machines (CI has 2 cores), half the cores (at most 8) on big ones.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; n = os.cpu_count() or 1; print(min(8, n // 2) if n >= 8 else 0)")

test: $(VPY)
	$(VPY) -m pytest tests -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Packing kernel, then the trainer's update pass on rollout-shaped data (the loop benchmark) and on
# full rows, on one GPU and, with two or more, at EP=2 under torchrun; then the update pass and optimizer
# step on Megatron's training stack against the loop's old one.
bench: $(VPY)
	$(VPY) -m bench $(BENCH_ARGS)
	$(VPY) -m bench.step --data rollout --out build/bench/loop-ep1.md
	$(VPY) -m bench.step --data full --out build/bench/step-ep1.md
	$(VPY) -m bench.training_stack --out build/bench/training-stack.md
	$(VPY) -m bench.launch_cost
	@if [ "$$($(VPY) -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then \
	  $(VPY) -m torch.distributed.run --nproc-per-node 2 -m bench.step --ep 2 --data rollout --out build/bench/loop-ep2.md && \
	  $(VPY) -m torch.distributed.run --nproc-per-node 2 -m bench.step --ep 2 --data full --out build/bench/step-ep2.md; fi

# The base version and sdist come from tools/patch_series.py (one place to change them).
BASE := $(word 1,$(shell $(PYTHON) tools/patch_series.py base))
SDIST := build/$(word 2,$(shell $(PYTHON) tools/patch_series.py base))

check-patches:
	@mkdir -p build
	@test -f $(SDIST) || $(PYTHON) -m pip download -q --no-deps --no-binary :all: --ignore-requires-python megatron-core==$(BASE) -d build
	$(PYTHON) tools/patch_series.py check $(SDIST)

patch:
	@test -n "$(MEGATRON)" || { echo "usage: make patch MEGATRON=/path/to/Megatron-LM" >&2; exit 2; }
	$(PYTHON) tools/patch_series.py apply "$(MEGATRON)"

clean:
	rm -rf build .venv megatron_r3/_C*.so *.egg-info
