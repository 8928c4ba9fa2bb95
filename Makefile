# ioattn — the two commands of the README:
#   make run    builds and runs the main job (the CLI on its default workload + the explain arithmetic)
#   make test   builds and runs every test (C++ via CTest, Python via pytest in a venv)
# Other targets: build, test-cpp, test-python, test-sanitize (ASan + UBSan CPU tests), bench, clean.
BUILD ?= build
JOBS ?= $(shell nproc)
CUDA ?= AUTO
CMAKE_FLAGS ?=
PYTHON ?= python3
# OpenMP threads sleep between parallel regions instead of spinning (2-core machines).
export OMP_WAIT_POLICY ?= passive
VENV ?= $(BUILD)/venv
# The Python extension is built with CUDA only where a GPU is visible (saves a second CUDA build).
PY_CUDA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo AUTO || echo OFF)

.PHONY: all deps build run test test-cpp test-python test-sanitize bench clean

all: build

deps:
	@tools/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DIOATTN_CUDA=$(CUDA) $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/ioattn info
	$(BUILD)/ioattn run
	$(BUILD)/ioattn explain

test: test-cpp test-python

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r python/requirements-test.txt

test-python: deps $(VENV)/bin/python
	$(VENV)/bin/pip install -q . -Ccmake.define.IOATTN_CUDA=$(PY_CUDA) -Cbuild-dir=$(BUILD)/python-build
	cd python/tests && ../../$(VENV)/bin/python -m pytest -q .

test-sanitize: deps
	cmake -S . -B $(BUILD)-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DIOATTN_CUDA=OFF -DIOATTN_SANITIZE=ON \
	  -DIOATTN_BUILD_BENCH=OFF $(CMAKE_FLAGS)
	cmake --build $(BUILD)-asan -j $(JOBS)
	cd $(BUILD)-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)

bench: build
	$(BUILD)/bench/ioattn_bench_cpu --benchmark_min_time=0.2

clean:
	rm -rf $(BUILD) $(BUILD)-asan
