# Two commands do everything: `make run` (set-up + the main job on the embedded default)
# and `make test` (set-up + the test suite). Set-up is a project virtualenv in .venv,
# refreshed whenever pyproject.toml changes; torch is installed first, pinned, so pip
# takes the local CPU build instead of pulling CUDA wheels.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup bench-setup run test clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

# The TRL baseline of benchmarks/throughput.py lives in its own virtualenv (.venv-bench, rebuilt
# only when benchmarks/requirements-trl.txt changes). It is set-up, so `make test` builds it
# before the suite starts rather than inside the benchmark's --quick test.
bench-setup: setup
	$(BIN)/python benchmarks/throughput.py --setup-only

run: setup
	$(BIN)/distflow train examples/arith_grpo.yaml $(ARGS)

# Tests marked `slow` do not fit the default suite's ~15-minute budget on 2 cores: `make test`
# skips them, CI (CI=true, 90 minutes) runs them too; `make test PYTEST_MARKS=` runs everything.
PYTEST_MARKS ?= $(if $(CI),,-m "not slow")

test: setup bench-setup
	$(BIN)/python -m pytest -q src tests $(PYTEST_MARKS) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-bench runs
