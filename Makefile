# Two commands from a fresh clone (only python3 and pip needed):
#   make demo   - create .venv, install, run the main job
#   make test   - create .venv, install, run the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned and installed first: 2.13.0 resolves to a local CPU wheel here, whereas an
# unpinned torch would pull several GB of CUDA packages.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/routereplay inspect src/routereplay/examples/qwen3_30b_a3b_sglang.json \
		--num-layers 48 --top-k 8 --num-experts 128 --num-tokens 301
	$(BIN)/routereplay inspect src/routereplay/examples/moonlight_vllm.json \
		--num-experts 64 --moe-layers 1-26 --layers-shown 8

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/routereplay bench codec

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
