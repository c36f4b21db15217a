# megatron-r3: the two set-up commands are `make install` and `make test`.
PYTHON ?= python3
VPY := .venv/bin/python
MEGATRON ?=
PYTEST_ARGS ?=

.PHONY: install test test-cpu test-gpu bench check-patches patch clean help

help:
	@echo "make install        .venv + pinned deps + patched megatron-core 0.16.1+r3 + megatron_r3 (WHEELHOUSE=dir: offline)"
	@echo "make test           the whole suite: CPU tests always, GPU tests when CUDA is available (TEST_WORKERS=n)"
	@echo "make bench          benchmarks (GPU), results printed and written to build/bench/"
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

bench: $(VPY)
	$(VPY) -m bench $(BENCH_ARGS)

check-patches:
	@mkdir -p build
	@test -f build/megatron_core-0.16.1.tar.gz || $(PYTHON) -m pip download -q --no-deps --no-binary :all: megatron-core==0.16.1 -d build
	$(PYTHON) tools/patch_series.py check build/megatron_core-0.16.1.tar.gz

patch:
	@test -n "$(MEGATRON)" || { echo "usage: make patch MEGATRON=/path/to/Megatron-LM" >&2; exit 2; }
	$(PYTHON) tools/patch_series.py apply "$(MEGATRON)"

clean:
	rm -rf build .venv megatron_r3/_C*.so *.egg-info
