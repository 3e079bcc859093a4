# tunefleet — the two commands a newcomer needs are `make run` and `make test`.
#
#   make run    install into .venv, start the service with embedded defaults
#               (SQLite, server-less Celery broker, local executor, local artifacts)
#               and submit a demo job that really trains
#   make test   install into .venv (+ Chromium for the browser tests) and run the whole suite
#
# torch is installed FIRST from its own requirement file: any other torch resolution
# pulls a multi-GB CUDA build.

PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install run serve test test-fast lint services browser-deps bench-deps bench image-deps images images-check clean

$(STAMP): pyproject.toml requirements/torch.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements/torch.txt
	$(PIP) install -q --only-binary idna -e ".[all]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/tunefleet serve --demo

serve: install
	$(VENV)/bin/tunefleet serve

# Debian's Chromium for the dashboard's browser tests (never `playwright install`).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# PostgreSQL and Redis on 127.0.0.1; started if they are down.
services:
	@bash scripts/ensure-services.sh

# `make test` runs the suite on 3 pytest-xdist processes (most of its time is spent
# waiting on real subprocesses: services, trainers, Celery workers), each with one OpenMP
# thread so torch processes do not fight over the two cores; tests that share an expensive
# fixture stay on one worker (--dist loadgroup, groups in tests/conftest.py). On a 2-core
# machine the whole suite took 17 minutes; serially, with 350 fewer tests, it took 32. On
# 2-core machines (2026-12-04, 1,620 tests): 17.6 minutes on one with AVX-512 (bf16 too),
# 37 on one without, where it is bound by the CPU (69 CPU-minutes of user time), so more
# workers do not shorten it.
# `make test TEST_WORKERS=0` runs it serially in one process with two threads.
TEST_WORKERS ?= 3
TEST_XDIST   := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)
TEST_THREADS := $(if $(filter 0,$(TEST_WORKERS)),2,1)

# JAX's persistent compilation cache, kept on the machine between runs (outside the checkout,
# so a fresh clone finds it too): the JAX tests and the JAX trainers they start compile the
# same small programs on every run, and a warm cache takes the JAX tests' CPU time down to
# about a third (tests/trainers/jax_lora/test_attention.py: 54 -> 20 CPU-seconds). Entries
# are keyed by the program, the jax/jaxlib versions and the flags, so a stale one is never
# used; `make test JAX_CACHE=` runs without it.
JAX_CACHE ?= $(HOME)/.cache/tunefleet/jax-compilation
# The real pretrained model the end-to-end test fine-tunes (tests/e2e/test_real_model.py),
# prepared once per machine: its download and conversion take 1.5 minutes of CPU.
# `make test MODELS_CACHE=` prepares it afresh in the test's temporary directory.
MODELS_CACHE ?= $(HOME)/.cache/tunefleet/models
# `make test TEST_CPU_LOG=/tmp/cpu` also logs each test's wall and CPU seconds (its
# subprocesses' included); `python scripts/suite_cpu.py /tmp/cpu` says where the time went.
TEST_CPU_LOG ?=
TEST_ENV := OMP_NUM_THREADS=$(TEST_THREADS) $(if $(JAX_CACHE),JAX_COMPILATION_CACHE_DIR=$(JAX_CACHE) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0) \
	$(if $(MODELS_CACHE),TUNEFLEET_TEST_MODELS_DIR=$(MODELS_CACHE)) $(if $(TEST_CPU_LOG),TUNEFLEET_TEST_CPU_LOG=$(TEST_CPU_LOG))

test: install browser-deps services
	$(TEST_ENV) $(PY) -m pytest $(TEST_XDIST) $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; exit $$rc

test-fast: install
	OMP_NUM_THREADS=2 $(if $(JAX_CACHE),JAX_COMPILATION_CACHE_DIR=$(JAX_CACHE) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0) $(PY) -m pytest -m "not slow and not browser" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check api worker control scheduling kube trainers tunefleet inference tests bench

# wrk for the API benchmark (bench/api_bench.py).
bench-deps:
	@command -v wrk >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; }

bench: install bench-deps services
	$(PY) bench/run_all.py

# The container images (deploy/docker/), built with Debian's podman against a Debian base
# made here by debootstrap (no registry is needed), then checked and smoke-run from their
# filesystems (tests/deploy/images/). See DEVELOPERS.md, "Container images".
image-deps:
	@{ command -v podman && command -v debootstrap; } >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman debootstrap >/dev/null; }

images: install image-deps
	$(PY) scripts/build_images.py

images-check: images services
	TUNEFLEET_IMAGE_CHECKS=1 OMP_NUM_THREADS=1 $(PY) -m pytest tests/deploy/images -p no:cacheprovider $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; exit $$rc

clean:
	rm -rf $(VENV) .tunefleet test-output .pytest_cache
