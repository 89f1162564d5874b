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

`python tools/bench.py shape` runs tools/bench_shape.py (the 1.5B shape end to end, each rank's peak
memory beside memory.py's estimate), `python tools/bench.py lora` tools/bench_lora.py (LoRA's two
ways into vLLM). It checks nothing; TRL is optional (`pip install
trl==1.16.0`, or `make bench`): without it the TRL rows say so.
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


import torch
import tyro
from transformers import AutoConfig
from transformers import Qwen2ForCausalLM, TrainerCallback

ROOT = Path(__file__).resolve().parents[1]  # the repository: train.py, eval_aime.py
sys.path.insert(0, str(ROOT))  # run as a script: the core is one folder up

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
    """The folder of a --models name: the demo's base of that name (built the first time), or the
    bench's larger model."""
    return bases.ensure(name) if name in (bases.TINY, bases.SMOLLM2) else large_model()


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
    from tools.bench_shape import ShapeConfig, matmul_peak

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
    from tools.bench_shape import attention_flops, forward_flops

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


# The update's FLOPs and this CPU's matmul peak


if __name__ == "__main__":
    if sys.argv[1:2] == ["shape"] or sys.argv[1:2] == [
        "lora"
    ]:  # tools/bench_shape.py, bench_lora.py
        from tools import bench_lora, bench_shape

        cls, run = {
            "shape": (bench_shape.ShapeConfig, bench_shape.shape_main),
            "lora": (bench_lora.LoraBenchConfig, bench_lora.lora_main),
        }[sys.argv[1]]
        prog = f"tools/bench.py {sys.argv[1]}"
        one_line_errors(lambda: run(tyro.cli(cls, args=sys.argv[2:], prog=prog)))
    else:
        one_line_errors(lambda: main(tyro.cli(BenchConfig)))
