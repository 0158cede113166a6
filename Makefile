# Bootstrap an isolated environment and run the project's jobs.
# The CPU build of torch is pinned so a fresh machine never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test generate serve bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The suite in TEST_WORKERS processes (pytest-xdist), each test file in one of them.
TEST_WORKERS ?= 2

test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

generate: venv
	$(VENV)/bin/pagedllm generate "def fibonacci(n):"

# The OpenAI-compatible server with the bundled demo model on port 8000 (Ctrl-C stops it);
# its log prints the playground's URL, http://localhost:8000/.
serve: venv
	$(VENV)/bin/pagedllm serve --port 8000

# Offline throughput of the bundled demo model on the CPU: the workload docs/benchmarks.md records.
bench: venv
	$(VENV)/bin/pagedllm bench throughput --num-prompts 64 --input-len 32:256 --output-len 32:256

clean:
	rm -rf $(VENV) build *.egg-info
