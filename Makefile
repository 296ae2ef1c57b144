# Two commands on a fresh machine: `make run` (the default model on a local CPU mesh) and `make test`.
# Both create .venv when it is missing: torch==2.13.0 first (the machine's CPU wheel; a looser pin
# would pull the CUDA build), then shardmesh with its dev extras.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: run test lint format protos venv clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(STAMP)

# The whole mesh on this machine: coordinator, 2 pipeline-stage workers and the gateway, each its own
# process; the answer streams from the gateway, then everything stops.
run: $(STAMP)
	$(VENV)/bin/shardmesh up --model smollm2-135m-instruct --pp 2 --max-new-tokens 96 --demo "$(PROMPT)"

# Two pytest workers (pytest-xdist), each module on one of them so that a module's mesh starts once: a test spends
# much of its time waiting on the processes it starts, and two at once finish the suite in 0.66-0.72x the time of
# one on 2 cores (README, Development). `TEST_WORKERS=0 make test` runs it in one process.
TEST_WORKERS ?= 2

test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

protos: $(STAMP)  # regenerate shardmesh/proto/ from protos/ (tests check they match)
	$(PY) protos/generate.py

clean-venv:
	rm -rf $(VENV)
