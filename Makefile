# sglang-spex: the two commands README names. Both run scripts/setup.sh first (idempotent).
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test test-fast lint format

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m sglang_spex.demo

test: setup
	$(PY) -m pytest test

test-fast: setup
	$(PY) -m pytest test -m "not server"

lint: setup
	$(PY) -m black --check python sgl-kernel-ext test benchmark examples scripts
	$(PY) -m isort --check-only python sgl-kernel-ext test benchmark examples scripts
	$(PY) -m ruff check python sgl-kernel-ext test benchmark examples scripts

format: setup
	$(PY) -m isort python sgl-kernel-ext test benchmark examples scripts
	$(PY) -m black python sgl-kernel-ext test benchmark examples scripts
