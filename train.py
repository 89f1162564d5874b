"""GRPO training: the config and the loop. `python train.py` runs the CPU demo; `--help` lists every flag.

What it does: wires the other files into the data flow of DESIGN.md, one step at a time:
    prompts -> generate (rollout.py) -> score (reward.py) -> advantages (grpo.py) -> old logprobs (model.py)
    -> minibatch updates (grpo.py loss, AdamW, grad clip) -> refit (rollout.py) -> log (+ held-out eval)
Each step writes one JSON line to <out_dir>/metrics.jsonl (logs.py), checkpoints go to <out_dir>/checkpoints and
a run resumes from the newest one, the final weights go to <out_dir>/final as an HF checkpoint. Under torchrun the
trainer is sharded with FSDP2 and each vLLM engine generates for its share of the prompts (distributed.py).
Also here: the DeepScaleR stage presets (STAGES), config validation, and `python train.py export CKPT OUT`.

What it does not do: anything the files it calls own. Tasks, datasets and prompts live in data.py.
"""

import importlib.util
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch

import data
import distributed as dist
import grpo
import model as M
import reward
import rollout
from logs import RunLog, plot


@dataclass
class Config:
    # model and engine
    model: str = "tiny"  # HF path or hub name; "tiny" / "tiny-math": the built-in demo / math-recipe base (built once)
    engine: Literal["vllm", "hf"] = "vllm"  # rollout engine: colocated vLLM, or HF generate (no vLLM needed)
    tensor_parallel_size: int = 1  # vLLM tensor parallelism over this many consecutive ranks (one engine per group)
    trust_remote_code: bool = False  # let transformers/vLLM run code shipped with the model
    # compute and engine dtype (weights and optimizer stay float32); auto: bfloat16 on GPU, float32 on CPU, where
    # bfloat16 pays only on CPUs with bf16 instructions (avx512_bf16, AMX): see README, Engines
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward (long sequences)
    dist_timeout_s: int = 600  # a collective waiting longer than this fails the run instead of hanging
    max_skipped_steps: int = 3  # stop after this many consecutive updates skipped for a non-finite loss or gradient
    # the task
    task: Literal["sum3", "math"] = "sum3"  # sum3: the synthetic demo task; math: problems from --data, boxed answers
    data: str = ""  # math: training problems (.jsonl, .json, .parquet, or an HF dataset name[:split])
    val_data: str = ""  # math: held-out problems; default: --val-fraction of --data
    val_fraction: float = 0.0  # math: fraction of --data held out for validation when --val-data is not given
    problem_field: str = "problem"  # field of the problem text (DeepScaleR-Preview: problem)
    answer_field: str = "answer"  # field of the gold answer (DeepScaleR-Preview: answer)
    prompt_template: str = ""  # a text file with {problem}, used instead of the chat template + instruction
    stage: Literal[0, 1, 2, 3] = 0  # DeepScaleR preset (1: 8K, 2: 16K, 3: 24K); any flag overrides its field
    init_from: str = ""  # start from this HF checkpoint folder (e.g. the previous stage's <out_dir>/final)
    # batch shape
    steps: int = 200  # GRPO steps (one rollout batch each)
    prompts_per_step: int = 32  # P: prompts per step, over all ranks
    group_size: int = 8  # G: samples per prompt
    minibatch_size: int = 0  # sequences per optimizer step; 0 = the whole step's P*G samples (one update per step)
    micro_batch_tokens: int = 8192  # token budget of one forward/backward (padded tokens); bounds activation memory
    max_new_tokens: int = 8  # response length limit
    min_new_tokens: int = 0  # training responses are at least this long (EOS masked before): fixed-length benchmarks
    max_seq_len: int = 64  # prompt + response; prompts longer than max_seq_len - max_new_tokens are rejected
    temperature: float = 1.0  # sampling temperature (the trainer's logprobs use the same one)
    top_p: float = 1.0  # nucleus sampling; keep 1.0 for training (the trainer does not renormalize)
    # optimizer
    lr: float = 2e-4  # AdamW learning rate
    weight_decay: float = 0.01  # AdamW weight decay
    warmup_steps: int = 0  # linear LR warm-up, in optimizer steps
    grad_clip: float = 1.0  # max global gradient norm
    # advantages and loss (grpo.py)
    leave_one_out: bool = False  # leave-one-out baseline (RLOO) instead of the group mean
    normalize_std: bool = True  # divide advantages by the group std (off: Dr. GRPO)
    eps_low: float = 0.2  # ratio clip 1 - eps_low
    eps_high: float = 0.2  # ratio clip 1 + eps_high (> eps_low: DAPO clip-higher)
    dual_clip: float = 0.0  # dual-clip constant c > 1 for negative advantages; 0 = off
    kl_beta: float = 0.0  # KL penalty to the initial model; > 0 loads a frozen reference copy
    kl_kind: Literal["k1", "k2", "k3"] = "k3"  # KL estimator
    token_level: bool = True  # token-level loss aggregation over the global batch (False: per-sequence mean)
    overlong_filter: bool = False  # mask truncated responses out of the loss (they still count in the baseline)
    is_correction: Literal["none", "tis", "icepop"] = "none"  # engine/trainer mismatch correction
    is_cap: float = 2.0  # TIS cap / icepop band [1/cap, cap]
    dynamic_sampling: bool = False  # DAPO: drop groups with all-equal rewards, draw more prompts to refill the batch
    dynamic_sampling_max_tries: int = 4  # generation rounds per step before training on what was kept
    # evaluation, logging, system
    eval_every: int = 25  # held-out evaluation every N steps (and at start and end); 0 = never
    eval_prompts: int = 200  # held-out prompts evaluated
    eval_samples: int = 4  # samples per held-out prompt for pass@1 (temperature = --temperature)
    out_dir: str = ""  # run folder; default runs/<date-time>
    seed: int = 0  # seeds data order, init of sampling, and torch
    threads: int = 0  # torch CPU threads; 0 = all cores
    logprob_chunk_tokens: int = 1024  # positions per LM-head chunk when computing logprobs (memory bound)
    save_final: bool = True  # write the final weights as an HF checkpoint to <out_dir>/final
    checkpoint_every: int = 50  # sharded checkpoint (model, optimizer, RNG, data order) every N steps and at the end; 0 = never
    keep_checkpoints: int = 2  # how many of the newest checkpoints to keep
    resume: bool = True  # continue from the newest complete checkpoint in <out_dir>/checkpoints when there is one
    plot: bool = True  # draw <out_dir>/curves.png at the end
    tensorboard: bool = False  # also log to <out_dir>/tensorboard (needs the tensorboard package)
    wandb_project: str = ""  # also log to this Weights & Biases project (needs the wandb package)
    quiet: bool = False  # no progress bar (the JSON lines are still written)
    detailed_progress: bool = False  # also bars for each step's rollout, training and evaluation (long GPU steps)


# ----------------------------------------------------------------------------------------------------------------
# Helpers for the steps of the loop


def model_path(cfg: "Config") -> str:
    """Where the run's starting weights are: --init-from, else --model (the built-in base built on first use)."""
    return cfg.init_from or resolve_model(cfg.model)


def resolve_model(name: str) -> str:
    """A built-in base model's cached folder (built on first use) for "tiny" / "tiny-math"; any other name as is."""
    return {M.TINY: tiny_base, M.TINY_MATH: tiny_math_base}.get(name, lambda: name)()


def tiny_base() -> str:
    """The built-in base model: pretrained on data.py's corpus where 65% of the answers forget the last digit (built once)."""
    return M.ensure_tiny_base(lambda: data.noisy_corpus(data.sum3_split()[0], 200_000, noise=0.65))


def tiny_math_base(cache_dir=M.DEFAULT_CACHE, steps: int = 2000) -> str:
    """The math recipe's base: R1-style chain-sum answers, seldom worked out in full (data.sums_corpus; built once)."""
    return M.ensure_tiny_math_base(data.sums_scaffold_texts(), data.SUMS_ADDED_TOKENS, lambda tok: data.sums_corpus(tok, min(30_000, 100 * steps)),
                                   cache_dir=cache_dir, steps=steps)


@dataclass
class Batch:
    """The step's samples as right-padded tensors for the trainer."""

    input_ids: torch.Tensor  # [N, L] prompt + response
    attention_mask: torch.Tensor  # [N, L]
    resp_start: torch.Tensor  # [N] first response position
    resp_mask: torch.Tensor  # [N, T] 1 on response tokens
    gen_logp: torch.Tensor  # [N, T] the engine's logprobs of the response tokens
    advantages: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N, T] resp_mask, minus overlong-filtered responses
    lengths: list[int]  # prompt + response length of each row


class PromptStream:
    """Endless shuffled epochs over the training prompts; every rank holds the same order (same seed)."""

    def __init__(self, n: int, seed: int):
        self.n, self.rng, self.buf = n, random.Random(seed), []

    def take(self, k: int) -> list[int]:
        while len(self.buf) < k:
            epoch = list(range(self.n))
            self.rng.shuffle(epoch)
            self.buf += epoch
        out, self.buf = self.buf[:k], self.buf[k:]
        return out


def make_batch(prompts: list[list[int]], samples: list[rollout.Sample], advantages: torch.Tensor,
               overlong_filter: bool, pad_id: int) -> Batch:
    N = len(samples)
    seqs = [prompts[s.prompt_idx] + s.token_ids for s in samples]
    L = max(len(s) for s in seqs)
    T = max(1, max(len(s.token_ids) for s in samples))
    ids = torch.full((N, L), pad_id, dtype=torch.long)
    am = torch.zeros(N, L, dtype=torch.long)
    resp_mask = torch.zeros(N, T)
    gen_logp = torch.zeros(N, T)
    for i, (seq, s) in enumerate(zip(seqs, samples)):
        ids[i, : len(seq)] = torch.tensor(seq)
        am[i, : len(seq)] = 1
        resp_mask[i, : len(s.token_ids)] = 1
        gen_logp[i, : len(s.token_ids)] = torch.tensor(s.logprobs)
    start = torch.tensor([len(prompts[s.prompt_idx]) for s in samples])
    truncated = torch.tensor([s.truncated for s in samples])
    loss_mask = resp_mask * (~truncated).float()[:, None] if overlong_filter else resp_mask
    return Batch(ids, am, start, resp_mask, gen_logp, advantages, loss_mask, [len(s) for s in seqs])


def micro_batches(lengths: list[int], rows: list[int], token_budget: int) -> list[list[int]]:
    """Split `rows` into micro-batches whose padded size (rows x longest) stays within the token budget.

    Longest first, so each micro-batch holds sequences of similar length and padding is small; a sequence longer
    than the budget gets a micro-batch of its own. Every row lands in exactly one micro-batch.
    """
    order = sorted(rows, key=lambda r: -lengths[r])
    out: list[list[int]] = []
    for r in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= token_budget:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def rows_of(b: Batch, rows: list[int]) -> dict:
    """The tensors of a subset of rows, trimmed to their own longest sequence and response."""
    idx = torch.tensor(rows)
    L = max(b.lengths[r] for r in rows)
    T = int(b.resp_mask[idx].sum(1).max().clamp(min=1))
    return dict(input_ids=b.input_ids[idx, :L], attention_mask=b.attention_mask[idx, :L],
                resp_start=b.resp_start[idx], T=T, resp_mask=b.resp_mask[idx, :T], gen_logp=b.gen_logp[idx, :T],
                advantages=b.advantages[idx], loss_mask=b.loss_mask[idx, :T])


def load_task(cfg: Config) -> tuple[list[data.Problem], list[data.Problem]]:
    """(training problems, held-out problems) of the configured task."""
    if cfg.task == "sum3":
        return data.sum3_split()
    problems = data.load_problems(cfg.data, cfg.problem_field, cfg.answer_field)
    if cfg.val_data:
        return problems, data.load_problems(cfg.val_data, cfg.problem_field, cfg.answer_field)
    return data.split_problems(problems, cfg.val_fraction, cfg.seed)


def encode_prompts(cfg: Config, tok, problems: list[data.Problem], template: str | None, what: str):
    """Prompt token ids; prompts longer than max_seq_len - max_new_tokens are dropped, counted and reported."""
    limit = cfg.max_seq_len - cfg.max_new_tokens
    ids = [tok(p.prompt)["input_ids"] if cfg.task == "sum3" else data.math_prompt(tok, p.prompt, template)
           for p in problems]
    keep = [i for i, p in enumerate(ids) if len(p) <= limit]
    if len(keep) < len(ids):
        dist.print0(f"dropped {len(ids) - len(keep)} of {len(ids)} {what} prompts longer than {limit} tokens "
                    f"(--max-seq-len {cfg.max_seq_len} - --max-new-tokens {cfg.max_new_tokens})")
    if not keep and problems:
        raise SystemExit(f"error: every {what} prompt is longer than {limit} tokens; raise --max-seq-len")
    return [problems[i] for i in keep], [ids[i] for i in keep]


def score(task: str, tok, samples: list[rollout.Sample], problems: list[data.Problem]) -> list[float]:
    fn = reward.exact_reward if task == "sum3" else reward.math_reward
    return [fn(tok.decode(s.token_ids, skip_special_tokens=True), problems[s.prompt_idx].answer) for s in samples]


def evaluate(engine, tok, cfg: Config, problems: list[data.Problem], prompts: list[list[int]], seed: int) -> dict:
    """Held-out pass@1 (mean correctness over eval_samples samples per prompt) and greedy accuracy; each rank
    evaluates its share of the prompts."""
    tp = cfg.tensor_parallel_size  # the ranks of one tensor-parallel engine evaluate the same prompts, once
    rank, engines = dist.rank() // tp, dist.world_size() // tp
    mine = slice(rank * len(prompts) // engines, (rank + 1) * len(prompts) // engines)
    problems, prompts = problems[mine], prompts[mine]
    sampled = engine.generate(prompts, n=cfg.eval_samples, max_tokens=cfg.max_new_tokens,
                              temperature=cfg.temperature, seed=seed, progress=_bars(cfg))
    greedy = engine.generate(prompts, n=1, max_tokens=cfg.max_new_tokens, temperature=0.0, seed=seed)
    s, g = score(cfg.task, tok, sampled, problems), score(cfg.task, tok, greedy, problems)
    counted = float(dist.rank() % tp == 0)
    tot = dist.all_reduce_sum(counted * torch.tensor([sum(s), len(s), sum(g), len(g)], dtype=torch.float64)).tolist()
    return {"heldout_pass1": tot[0] / tot[1], "heldout_greedy": tot[2] / tot[3]} if tot[1] else {}


def peak_memory_gib(device) -> float:
    """This rank's peak memory: GPU memory allocated by torch, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def load_trainable(path: str, device, bf16: bool, checkpointing: bool, trust_remote_code: bool = False) -> M.LogprobModel:
    """An HF model in float32 (the optimizer's master weights), wrapped to return logprobs, sharded over ranks."""
    lm = M.load_model(path, dtype=torch.float32, trust_remote_code=trust_remote_code).to(device)
    return dist.shard(M.LogprobModel(lm), lm, bf16_compute=bf16, checkpointing=checkpointing)


def _bars(cfg: Config) -> bool:
    """Per-phase progress bars: asked for, on rank 0 only, and not in a quiet run."""
    return cfg.detailed_progress and not cfg.quiet and dist.is_main()


def bf16_compute(cfg, device) -> bool:
    """Whether forward and backward run in bfloat16 (GRPO and DPO): --dtype bfloat16, or auto on a GPU."""
    return cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")


def autocast(cfg, device):
    """bf16 compute for a single process; FSDP2 casts sharded models itself (distributed.shard), on GPU and CPU."""
    on = bf16_compute(cfg, device) and dist.world_size() == 1
    return torch.autocast(device.type, torch.bfloat16, enabled=on)


def _logprobs(m, mb: dict, cfg: Config, device, grad: bool):
    with torch.set_grad_enabled(grad), autocast(cfg, device):
        return M.token_logprobs(m, mb["input_ids"].to(device), mb["attention_mask"].to(device),
                                mb["resp_start"].to(device), mb["T"], cfg.temperature, cfg.logprob_chunk_tokens,
                                with_entropy=grad)


def _equal_micro_batches(b: Batch, rows: list[int], cfg: Config) -> list[list[int]]:
    """Token-budget micro-batches, padded with empty ones so every rank runs the same number of passes.

    Under FSDP each forward all-gathers parameters and each backward reduce-scatters gradients: a rank that ran
    one pass fewer would leave the others waiting forever. An empty micro-batch runs one row with zero weight.
    """
    mbs = micro_batches(b.lengths, rows, cfg.micro_batch_tokens) if rows else []
    n = int(dist.all_reduce_max(torch.tensor([len(mbs)])).item())
    return mbs + [[]] * (n - len(mbs))


def update_policy(policy, ref, opt, sched, b: Batch, cfg: Config, loss_cfg: grpo.LossConfig, device,
                  group_offset: int = 0):
    """Steps 5 and 6 of DESIGN.md on this rank's share of the batch: old/reference logprobs, then one AdamW step
    per minibatch (loss over token-budget micro-batches, gradients summed over ranks by FSDP, clipped). Returns summed
    metrics, the last gradient norm, the old logprobs [N, T], how many updates were skipped for a non-finite
    gradient, and the seconds spent in step 5 (0 when it needs no pass of its own). group_offset: global index of
    this rank's first group (rank * prompts per rank)."""
    N, G = len(b.lengths), cfg.group_size
    # Minibatch k holds the groups whose global index j has j % n_minibatches == k: whole groups, and the same
    # global composition at any world size (a contiguous split per rank would mix different groups). Every rank
    # makes the same number of optimizer steps, even when its share is uneven (dynamic sampling).
    n_minibatches = cfg.prompts_per_step * G // cfg.minibatch_size if cfg.minibatch_size else 1
    minibatches = [[r for r in range(N) if (group_offset + r // G) % n_minibatches == k] for k in range(n_minibatches)]
    single = len(minibatches) == 1
    # 5. old (and reference) logprobs, once per rollout. With one update per step the policy has not moved yet,
    #    so old_logp is the detached logp of the training forward itself and needs no pass of its own.
    old_logp = torch.zeros_like(b.gen_logp)  # [N, T]
    ref_logp = torch.zeros_like(b.gen_logp)  # [N, T]
    t0 = time.time()
    for rows in _equal_micro_batches(b, list(range(N)), cfg) if (not single or ref is not None) else []:
        mb = rows_of(b, rows or [0])
        for m, out in ((policy, old_logp), (ref, ref_logp)):
            if m is not None and (m is ref or not single):
                lp = _logprobs(m, mb, cfg, device, grad=False)[0].cpu()
                if rows:
                    out[rows, : mb["T"]] = lp
    t_logprobs = time.time() - t0
    # 6. minibatch updates: loss -> backward -> grad clip -> AdamW step; micro-batches sized by tokens
    policy.train()
    sums: dict[str, float] = {}
    grad_norm, skipped = torch.tensor(0.0), 0
    from tqdm import tqdm

    bar = tqdm(total=len(minibatches), desc="train", disable=not _bars(cfg), leave=False)
    for rows in minibatches:
        bar.update(1)
        counts = torch.tensor([b.loss_mask[rows].sum().item(), float((b.loss_mask[rows].sum(1) > 0).sum())])
        dist.all_reduce_sum(counts)  # the global normalizer: the gradient does not depend on world size or splits
        norm = max(float(counts[0] if cfg.token_level else counts[1]), 1.0)
        for mrows in _equal_micro_batches(b, rows, cfg):
            mb = rows_of(b, mrows or [rows[0] if rows else 0])
            logp, entropy = _logprobs(policy, mb, cfg, device, grad=True)  # [n, T]
            old = logp.detach().cpu() if single else old_logp[mrows or [0], : mb["T"]]
            if single and mrows:
                old_logp[mrows, : mb["T"]] = old
            loss_mask = mb["loss_mask"].to(device) * (1.0 if mrows else 0.0)  # an empty micro-batch weighs 0
            loss, metrics = grpo.policy_loss(
                logp, old.to(device), mb["advantages"].to(device), loss_mask, loss_cfg, num_tokens=norm,
                ref_logp=ref_logp[mrows or [0], : mb["T"]].to(device) if ref is not None else None,
                gen_logp=mb["gen_logp"].to(device))
            (loss * dist.loss_scale()).backward()
            if mrows:
                metrics["loss"] = loss.detach()
                metrics["entropy"] = (entropy.detach() * mb["resp_mask"].to(device)).sum()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        grad_norm = dist.clip_grad_norm(policy, cfg.grad_clip)  # global over ranks: all ranks agree on skipping
        if torch.isfinite(grad_norm):
            opt.step()
            sched.step()
        else:  # a NaN/inf loss or gradient: this update is skipped, weights and optimizer state stay as they were
            skipped += 1
        opt.zero_grad(set_to_none=True)
    bar.close()
    policy.eval()
    return sums, float(grad_norm), old_logp, skipped, t_logprobs


# ----------------------------------------------------------------------------------------------------------------
# The loop


def save_hf(lm, tok, folder: Path) -> None:
    """An HF checkpoint (config, safetensors, tokenizer) that transformers and vLLM load directly. A collective
    under FSDP (every rank gathers); rank 0 writes it aside and renames it into place, never half-written."""
    state = dist.full_state_dict(lm)
    if dist.is_main():
        folder, tmp = Path(folder), Path(str(folder) + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        lm.save_pretrained(tmp, state_dict=state)
        tok.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)


def export_hf(checkpoint: str, out: str, config_cls=None, path_of=None) -> None:
    """`python train.py export RUN/checkpoints/step_NNNNNN OUT`: the HF checkpoint of any saved step. dpo.py passes
    its own config class and start-weights resolver (default: this file's Config and model_path)."""
    meta = json.loads((Path(checkpoint) / "meta.json").read_text())
    cfg = (config_cls or Config)(**meta["config"])
    path = (path_of or model_path)(cfg)
    policy = load_trainable(path, torch.device("cpu"), False, False, cfg.trust_remote_code)
    dist.load_checkpoint(Path(checkpoint), policy, None)
    save_hf(policy.lm, M.load_tokenizer(path, cfg.trust_remote_code), Path(out))
    print(f"exported step {meta['step']} of {checkpoint} to {out}")


def save_step(out: Path, step: int, policy, opt, sched, stream: PromptStream, meta: dict, keep: int) -> Path:
    """A checkpoint of all a resumed run needs: model and optimizer shards (distributed.py), and on every rank the
    LR schedule, the data order and position, and the torch RNG."""
    rank_state = dict(sched=sched.state_dict(), stream_rng=stream.rng.getstate(), stream_buf=stream.buf,
                      torch_rng=torch.get_rng_state())
    return dist.save_checkpoint(out / "checkpoints", step, policy, opt, meta, rank_state, keep=keep)


def resume_step(ckpt: Path, policy, opt, sched, stream: PromptStream) -> int:
    """Restore what save_step wrote; returns the step the checkpoint was taken after."""
    meta, rank_state = dist.load_checkpoint(ckpt, policy, opt)
    sched.load_state_dict(rank_state["sched"])
    stream.rng.setstate(rank_state["stream_rng"])
    stream.buf = rank_state["stream_buf"]
    torch.set_rng_state(rank_state["torch_rng"])
    return meta["step"]


def _writable(folder: Path) -> bool:
    """Whether `folder` exists as a writable folder, or could be created (its nearest existing parent is)."""
    while not folder.exists():
        if folder.parent == folder:
            return False
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


class CtrlC:
    """The first Ctrl-C (SIGINT) asks the loop to stop after the current step and checkpoint; a second one aborts."""

    def __init__(self, install: bool):
        self._set = False
        if install and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self._set:
            raise KeyboardInterrupt
        self._set = True
        print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to abort now)", file=sys.stderr,
              flush=True)

    def is_set(self) -> bool:
        return self._set


def validate(cfg: Config, world: int) -> None:
    """One clear line for a bad flag, before any model or engine is loaded."""
    checks = [
        (cfg.group_size >= 2, f"--group-size {cfg.group_size}: GRPO needs at least 2 samples per prompt"),
        (cfg.prompts_per_step >= world and cfg.prompts_per_step % world == 0,
         f"--prompts-per-step {cfg.prompts_per_step}: must be a positive multiple of the {world} ranks"),
        (cfg.minibatch_size == 0 or (cfg.minibatch_size > 0 and cfg.minibatch_size % cfg.group_size == 0
                                     and (cfg.prompts_per_step * cfg.group_size) % cfg.minibatch_size == 0),
         f"--minibatch-size {cfg.minibatch_size}: must be a multiple of --group-size {cfg.group_size} (whole "
         f"groups) dividing prompts_per_step * group_size = {cfg.prompts_per_step * cfg.group_size}"),
        (0 <= cfg.min_new_tokens <= cfg.max_new_tokens,
         f"--min-new-tokens {cfg.min_new_tokens}: must be in [0, --max-new-tokens {cfg.max_new_tokens}]"),
        (0 < cfg.max_new_tokens < cfg.max_seq_len,
         f"--max-new-tokens {cfg.max_new_tokens}: must be positive and below --max-seq-len {cfg.max_seq_len}"),
        (cfg.tensor_parallel_size >= 1 and world % cfg.tensor_parallel_size == 0
         and (cfg.engine == "vllm" or cfg.tensor_parallel_size == 1),
         f"--tensor-parallel-size {cfg.tensor_parallel_size}: must divide the {world} ranks (vLLM engine only)"),
        (cfg.temperature > 0, f"--temperature {cfg.temperature}: must be positive for GRPO sampling"),
        (cfg.dual_clip == 0 or cfg.dual_clip > 1, f"--dual-clip {cfg.dual_clip}: must be 0 (off) or > 1"),
        (not cfg.init_from or os.path.isfile(os.path.join(cfg.init_from, "config.json")),
         f"--init-from {cfg.init_from}: not an HF checkpoint folder (no config.json)"),
        (cfg.task != "math" or bool(cfg.data), "--data: the math task needs a problem file or dataset name"),
        (0.0 <= cfg.val_fraction < 1.0, f"--val-fraction {cfg.val_fraction}: must be in [0, 1)"),
        (not cfg.prompt_template or os.path.isfile(cfg.prompt_template),
         f"--prompt-template {cfg.prompt_template}: no such file"),
    ]
    check(checks + run_checks(cfg))


def run_checks(cfg) -> list[tuple[bool, str]]:
    """The checks every training entry point makes (GRPO here, DPO in dpo.py): model, output, optimizer, logging."""
    return [
        (cfg.steps >= 1, f"--steps {cfg.steps}: must be at least 1"),
        (cfg.lr > 0, f"--lr {cfg.lr}: must be positive"),
        (cfg.model in (M.TINY, M.TINY_MATH) or os.path.isdir(cfg.model) or cfg.model.count("/") == 1,
         f"--model {cfg.model}: no such folder, and not a hub name like org/name"),
        (_writable(Path(cfg.out_dir or "runs")), f"--out-dir {cfg.out_dir or 'runs'}: cannot be written"),
        (cfg.max_skipped_steps >= 1, f"--max-skipped-steps {cfg.max_skipped_steps}: must be at least 1"),
        (not cfg.tensorboard or importlib.util.find_spec("tensorboard") is not None,
         "--tensorboard: needs the tensorboard package (pip install tensorboard)"),
        (not cfg.wandb_project or importlib.util.find_spec("wandb") is not None,
         f"--wandb-project {cfg.wandb_project}: needs the wandb package (pip install wandb)"),
    ]


def check(checks: list[tuple[bool, str]]) -> None:
    """The first failed check ends the run with its one-line message."""
    for ok, msg in checks:
        if not ok:
            raise SystemExit(f"error: {msg}")


def setup_process(cfg) -> tuple[torch.device, bool]:
    """(device, bf16) of this rank, after setting its torch threads and seed; on CPU, glibc keeps freed memory for
    the next step (no page faults on every step's activations: distributed.reuse_freed_memory). GRPO and DPO."""
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        dist.reuse_freed_memory()
    return device, bf16_compute(cfg, device)


def train(cfg: Config, engine: rollout.Engine | None = None) -> dict:
    """Run GRPO; `engine` lets a caller (the tests) bring an engine that already holds the base model's weights."""
    rank, world = dist.init(cfg.dist_timeout_s)
    validate(cfg, world)
    device, bf16 = setup_process(cfg)
    engine_dtype = torch.bfloat16 if bf16 else torch.float32
    out = Path(cfg.out_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    if dist.is_main():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1))

    train_set, heldout = load_task(cfg)  # bad data stops the run here, before any model is loaded
    path = model_path(cfg)
    tok = M.load_tokenizer(path, cfg.trust_remote_code)
    template = Path(cfg.prompt_template).read_text() if cfg.prompt_template else None
    train_set, train_prompts = encode_prompts(cfg, tok, train_set, template, "training")
    heldout, heldout_prompts = encode_prompts(cfg, tok, heldout[: cfg.eval_prompts], template, "held-out")
    policy = load_trainable(path, device, bf16, cfg.activation_checkpointing, cfg.trust_remote_code)
    ref = None
    if cfg.kl_beta > 0:  # the frozen initial model, sharded like the policy, only when the KL term is on
        ref = load_trainable(path, device, bf16, False, cfg.trust_remote_code).eval().requires_grad_(False)
    if engine is None and cfg.engine == "vllm":
        engine = rollout.VLLMEngine(path, max_model_len=cfg.max_seq_len, seed=cfg.seed + rank // cfg.tensor_parallel_size,
                                    dtype=str(engine_dtype).removeprefix("torch."), external_launcher=world > 1,
                                    tensor_parallel_size=cfg.tensor_parallel_size,
                                    trust_remote_code=cfg.trust_remote_code)
    elif engine is None:
        engine = rollout.HFEngine(path, dtype=engine_dtype, trust_remote_code=cfg.trust_remote_code, device=device)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    loss_cfg = grpo.LossConfig(cfg.eps_low, cfg.eps_high, cfg.dual_clip, cfg.kl_beta, cfg.kl_kind,
                               cfg.token_level, cfg.is_correction, cfg.is_cap)
    per_rank, G = cfg.prompts_per_step // world, cfg.group_size  # groups each rank trains on
    tp = cfg.tensor_parallel_size
    tp_rank, dp_rank, share = rank % tp, rank // tp, cfg.prompts_per_step // (world // tp)  # share: per engine
    stream = PromptStream(len(train_set), cfg.seed)

    from tqdm import tqdm

    # resume from the newest complete checkpoint of this run folder, if there is one (and --resume is on)
    log = RunLog(out, cfg.tensorboard, cfg.wandb_project, asdict(cfg)) if dist.is_main() else None
    ckpt = dist.latest_checkpoint(out / "checkpoints") if cfg.resume else None
    if ckpt is not None:
        start = resume_step(ckpt, policy, opt, sched, stream)
        engine.load_weights(dist.full_weights(policy.lm, engine_dtype))  # the engine samples from resumed weights
        history = log.start(keep_until=start) if log else []
        dist.print0(f"resumed from {ckpt} at step {start}")
    else:
        start = 0
        first = evaluate(engine, tok, cfg, heldout, heldout_prompts, seed=cfg.seed) if cfg.eval_every else {}
        history = [dict(step=0, **first)]
        if log:
            log.start(keep_until=None)
            log.write(history[0])
    last_eval = next((r for r in reversed(history) if "heldout_pass1" in r), {})
    bar = tqdm(range(start + 1, cfg.steps + 1), disable=cfg.quiet or not dist.is_main(), desc="GRPO",
               dynamic_ncols=True)
    t_start, bad_steps, stop = time.time(), 0, False
    ctrl_c = CtrlC(install=__name__ == "__main__")  # only a command-line run owns the process's SIGINT

    for step in bar:
        t0 = time.time()
        # 1-3. prompts -> generate G responses each -> score. Each engine takes its share of the step's prompts
        #      (the ranks of a tensor-parallel engine send it identical requests, then each keeps its part) and a
        #      prompt's G samples stay on one rank. With dynamic sampling (DAPO), groups whose rewards are all
        #      equal (no signal) are dropped and more prompts are drawn until every engine has its share of
        #      informative groups or the tries run out; all ranks make the same number of tries.
        kept = []  # (prompt index, its G samples, its [G] rewards)
        t_gen = t_score = 0.0
        n_groups = n_zero = tries = 0
        while True:
            ids = stream.take(cfg.prompts_per_step)[dp_rank * share : (dp_rank + 1) * share]
            t = time.time()
            new = engine.generate([train_prompts[i] for i in ids], n=G, max_tokens=cfg.max_new_tokens,
                                  temperature=cfg.temperature, top_p=cfg.top_p, progress=_bars(cfg),
                                  min_tokens=cfg.min_new_tokens, seed=cfg.seed * 100_003 + step * 1009 + tries * 101 + dp_rank)
            t_gen += time.time() - t
            t = time.time()
            r = torch.tensor(score(cfg.task, tok, new, [train_set[i] for i in ids])).view(len(ids), G)  # [P, G]
            t_score += time.time() - t
            tries, n_groups, n_zero = tries + 1, n_groups + len(ids), n_zero + int((r.std(1) == 0).sum())
            for g, i in enumerate(ids):
                if len(kept) < share and (not cfg.dynamic_sampling or r[g].std() > 0):
                    kept.append((i, new[g * G : (g + 1) * G], r[g]))
            if not cfg.dynamic_sampling or tries >= cfg.dynamic_sampling_max_tries:
                break
            if dist.all_reduce_sum(torch.tensor([float(len(kept) < share)])).item() == 0:
                break
        engine.sleep()  # on GPU the trainer gets the KV cache's memory until the refit wakes the engine
        kept = kept[tp_rank * per_rank : (tp_rank + 1) * per_rank]
        if not kept:  # nothing informative: one zero-advantage group keeps every rank's batch non-empty
            kept = [(ids[0], new[:G], r[0])]
        problems, prompts = [train_set[i] for i, _, _ in kept], [train_prompts[i] for i, _, _ in kept]
        samples = [replace(s, prompt_idx=k) for k, (_, group, _) in enumerate(kept) for s in group]
        rewards = torch.stack([r for _, _, r in kept])  # [P, G]; P < per_rank when dynamic sampling ran short
        t1 = t0 + t_gen
        t2 = t1 + t_score
        # 4. advantages
        adv = grpo.group_advantages(rewards, cfg.leave_one_out, cfg.normalize_std)  # [P, G]
        b = make_batch(prompts, samples, adv.flatten(), cfg.overlong_filter, tok.pad_token_id)
        t_batch = time.time()
        # 5-6. old (and reference) logprobs, then minibatch updates
        sums, grad_norm, old_logp, skipped, t_logprobs = update_policy(policy, ref, opt, sched, b, cfg, loss_cfg, device,
                                                           rank * per_rank)
        bad_steps = bad_steps + 1 if skipped else 0
        if bad_steps >= cfg.max_skipped_steps:
            raise SystemExit(f"error: step {step}: non-finite loss or gradient for {bad_steps} steps in a row "
                             f"(--max-skipped-steps {cfg.max_skipped_steps}); last checkpoint in {out / 'checkpoints'}")
        t3 = time.time()
        # 7. refit: the engine samples the next step from the new weights
        engine.load_weights(dist.full_weights(policy.lm, engine_dtype))
        t4 = time.time()
        # 8. metrics (reduced over ranks) and held-out evaluation
        mm = grpo.mismatch_metrics(b.gen_logp, old_logp, b.resp_mask)
        a = adv.flatten().double()
        local = {"reward": rewards.sum(), "seqs": rewards.numel(), "resp_tokens": b.resp_mask.sum(),
                 "truncated": sum(s.truncated for s in samples), "groups": n_groups, "zero_var_groups": n_zero,
                 "adv": a.sum(), "adv_sq": (a * a).sum(), **mm, **sums}
        keys = sorted(local)
        tot = dict(zip(keys, dist.all_reduce_sum(torch.tensor([float(local[k]) for k in keys], dtype=torch.float64)).tolist()))
        n_seq, n_tok, n_loss_tok = tot["seqs"], max(tot["resp_tokens"], 1.0), max(tot.get("tokens", 0.0), 1.0)
        adv_mean = tot["adv"] / n_seq
        row = dict(
            step=step, reward_mean=tot["reward"] / n_seq, response_len_mean=tot["resp_tokens"] / n_seq,
            loss=tot.get("loss", 0.0), grad_norm=float(grad_norm), clip_frac_low=tot.get("clip_low", 0.0) / n_loss_tok,
            clip_frac_high=tot.get("clip_high", 0.0) / n_loss_tok, kl=tot.get("kl", 0.0) / n_loss_tok,
            entropy=tot.get("entropy", 0.0) / n_tok, token_mult_prob_error=tot["token_mult_prob_error"] / n_tok,
            gen_kl_error=tot["gen_kl_error"] / n_tok, truncated_frac=tot["truncated"] / n_seq,
            zero_var_group_frac=tot["zero_var_groups"] / tot["groups"], adv_mean=adv_mean, skipped_updates=skipped,
            adv_std=max(tot["adv_sq"] / n_seq - adv_mean**2, 0.0) ** 0.5, generation_rounds=tries,
            lr=sched.get_last_lr()[0], time_generate=t1 - t0, time_score=t2 - t1, time_logprobs=t_logprobs,
            time_update=t3 - t_batch - t_logprobs, time_refit=t4 - t3,
        )
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            last_eval = evaluate(engine, tok, cfg, heldout, heldout_prompts, seed=cfg.seed + step)
            row.update(last_eval)
        row["peak_mem_gib"] = peak_memory_gib(device)
        row["time_step"] = time.time() - t0
        row["tokens_per_s"] = tot["resp_tokens"] / row["time_step"]
        row["elapsed"] = time.time() - t_start
        history.append(row)
        if log:
            log.write(row)
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", heldout=f"{last_eval.get('heldout_pass1', 0):.2f}",
                            mpe=f"{row['token_mult_prob_error']:.3f}")
        # Ctrl-C (on any rank) ends the run after this step, with a checkpoint to resume from
        stop = dist.all_reduce_max(torch.tensor([float(ctrl_c.is_set())])).item() > 0
        if stop or (cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == cfg.steps)):
            saved = save_step(out, step, policy, opt, sched, stream, {"config": asdict(cfg)}, cfg.keep_checkpoints)
        if stop:
            break
    bar.close()
    if log:
        log.close()
        if cfg.plot:
            plot(out)
    if ctrl_c.is_set() or stop:
        dist.print0(f"interrupted after step {step}: checkpoint {saved}; the same command resumes from it")
        dist.close()
        raise SystemExit(130)

    if cfg.save_final:
        save_hf(policy.lm, tok, out / "final")
    summary = dict(out_dir=str(out), minutes=(time.time() - t_start) / 60,
                   first=history[0], last={k: v for k, v in history[-1].items() if k.startswith("heldout")})
    dist.print0(json.dumps(summary))
    dist.close()
    return dict(history=history, out_dir=str(out))


# DeepScaleR's three stages as NeMo-RL ran them on 8 GPUs (DESIGN.md). Each stage starts from the previous
# one's final checkpoint (--init-from). Responses get what the prompt (at most 1024 tokens) leaves.
_DEEPSCALER = dict(task="math", prompts_per_step=128, group_size=8, minibatch_size=64, weight_decay=0.01,
                   warmup_steps=50, grad_clip=1.0, temperature=1.0, eps_low=0.2, activation_checkpointing=True,
                   eval_every=10, eval_samples=16, detailed_progress=True)
STAGES = {
    1: dict(_DEEPSCALER, max_seq_len=8192, max_new_tokens=8192 - 1024, lr=2e-6, kl_beta=0.0, eps_high=0.2, steps=240),
    2: dict(_DEEPSCALER, max_seq_len=16384, max_new_tokens=16384 - 1024, lr=2e-6, kl_beta=1e-3, eps_high=0.28, steps=290),
    3: dict(_DEEPSCALER, max_seq_len=24576, max_new_tokens=24576 - 1024, lr=5e-7, kl_beta=1e-4, eps_high=0.28, steps=50),
}


def parse_args(argv: list[str]) -> Config:
    """The command line: `--stage N` sets the preset's values as defaults, and every other flag overrides them."""
    import tyro

    stage = 0
    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--stage=") else argv[i + 1] if a == "--stage" and i + 1 < len(argv) else None
        if value is not None:
            if value not in ("0", "1", "2", "3"):
                raise SystemExit(f"error: --stage {value}: unknown stage (use 1, 2 or 3)")
            stage = int(value)
    default = Config(stage=stage, **STAGES[stage]) if stage else Config()
    return tyro.cli(Config, default=default, args=argv)


def main(argv: list[str]) -> None:
    one_line_errors(lambda: export_hf(*export_args(argv, "train.py")) if argv[:1] == ["export"]
                    else train(parse_args(argv)))


def export_args(argv: list[str], script: str) -> tuple[str, str]:
    """CKPT and OUT of `python SCRIPT export CKPT OUT`."""
    if len(argv) != 3:
        raise SystemExit(f"error: usage: python {script} export RUN/checkpoints/step_NNNNNN OUT_FOLDER")
    return argv[1], argv[2]


def one_line_errors(run) -> None:
    """Bad flags and bad data end the run with their one-line message on stderr and exit status 2."""
    try:
        run()
    except SystemExit as e:
        if isinstance(e.code, str) and e.code.startswith("error:"):
            print(e.code, file=sys.stderr)
            sys.exit(2)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
