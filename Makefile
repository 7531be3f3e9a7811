# make build [TARGET=cpu-avx2] [MODEL=/path/to/hf-checkpoint] [NAME=artifact-name] [CALIBRATION=path]
# make test | make lint | make bench (builds first if needed)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TARGET ?= cpu-avx2
MODEL ?=
NAME ?=
CALIBRATION ?=
PYTEST_ARGS ?=

.PHONY: build test lint format bench bench-calibration clean

build: $(STAMP)
	$(BIN)/python -m pipeline build --target $(TARGET) $(if $(MODEL),--model $(MODEL)) $(if $(NAME),--name $(NAME)) $(if $(CALIBRATION),--calibration $(CALIBRATION))

bench: build
	$(BIN)/python -m pipeline bench artifacts/$(or $(NAME),all-minilm-l6-v2)/latest/$(TARGET)

# Peak memory of static calibration as the example count grows (several minutes).
bench-calibration: build
	$(BIN)/python -m pipeline bench artifacts/$(or $(NAME),all-minilm-l6-v2)/latest/$(TARGET) --calibration-memory 1000,10000

test: $(STAMP)
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
	$(BIN)/python -m pip install -q -e '.[build,dev]'
	touch $@

clean:
	rm -rf .cache/stages
