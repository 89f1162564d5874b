"""GRPO training: the config, DeepScaleR's stage presets, and the loop. `python train.py` runs the CPU demo;
`--help` lists every flag; `python train.py export CKPT OUT` writes a saved step as an HF folder.

One GRPO step, as train() runs it (each a named call below, in this order):
    1. take the step's P prompts; each engine its share                          data.PromptStream
    2. generate G responses per prompt, with the engine's logprobs               collect_groups -> rollout.py
    3. score each response: 1 or 0                                               collect_groups -> reward.py
    4. advantages from each group's rewards                                      grpo.group_advantages
    5. the trainer's old (and reference) logprobs of the sampled tokens          update_policy -> model.py
    6. per minibatch: loss -> backward over token-budget micro-batches -> clip -> AdamW     update_policy -> grpo.py
    7. refit: the engine gets the new weights                                    rollout.Engine.load_weights
    8. metrics reduced over ranks, held-out evaluation, checkpoint               step_metrics, eval_aime, runtime
Each step writes one JSON line to <out_dir>/metrics.jsonl (logs.py); a run resumes from the newest readable
checkpoint in <out_dir>/checkpoints; the final weights go to <out_dir>/final. Under torchrun the trainer is
sharded with FSDP2 and each engine generates for its share of the prompts (distributed.py).

What it does not do: anything the files it calls own. The math is in grpo.py, tasks and prompts in data.py,
checkpoints, process set-up and Ctrl-C in runtime.py.
"""

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch

import data
import distributed as dist
import eval_aime
import grpo
import model as M
import reward
import rollout
import runtime
import user_reward
from logs import plot


@dataclass
class Config:
    # model and engine
    model: str = "tiny"  # HF path or hub name; "tiny" / "tiny-math": the built-in demo / math-recipe base (built once)
    engine: Literal["vllm", "hf"] = "vllm"  # rollout engine: colocated vLLM, or HF generate (no vLLM needed)
    tensor_parallel_size: int = 1  # vLLM tensor parallelism over this many consecutive ranks (one engine per group)
    gpu_memory_utilization: float = 0.6  # GPU memory share vLLM may take for its weights and KV cache while it
    #   generates (it frees it while the trainer runs); the stage presets size it to the stage's KV cache
    trust_remote_code: bool = False  # let transformers/vLLM run code shipped with the model
    # compute and engine dtype (weights and optimizer stay float32); auto: bfloat16 on GPU, float32 on CPU, where
    # bfloat16 pays only on CPUs with bf16 instructions (avx512_bf16, AMX): see docs/engines.md
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward (long sequences)
    dist_timeout_s: int = 1800  # a collective waiting longer than this fails the run instead of hanging (it must
    #   outlast the slowest rank's rollout: the others wait for it in the next collective)
    max_skipped_steps: int = 3  # stop after this many consecutive updates skipped for a non-finite loss or gradient
    # the task
    task: Literal["sum3", "math"] = "sum3"  # sum3: the synthetic demo task; math: problems from --data, boxed answers
    data: str = ""  # math: training problems (.jsonl, .json, .parquet, or an HF dataset name[:split])
    val_data: str = ""  # math: held-out problems; default: --val-fraction of --data
    val_fraction: float = 0.0  # math: fraction of --data held out for validation when --val-data is not given
    problem_field: str = "problem"  # field of the problem text (DeepScaleR-Preview: problem)
    answer_field: str = "answer"  # field of the gold answer (DeepScaleR-Preview: answer)
    prompt_template: str = ""  # a text file with {problem}, used instead of the chat template + instruction
    reward: str = ""  # your own reward, path/to/file.py:function, a (response, gold) -> float used instead of the
    #   task's for training and held-out figures; a call that raises, hangs or returns a non-number scores 0 and is
    #   counted (reward_errors) and warned about (user_reward.py; my_reward.py is an example)
    reward_timeout_s: float = 1.0  # --reward: a call running longer scores 0 (its worker process is killed)
    stage: Literal[0, 1, 2, 3, 4] = 0  # DeepScaleR preset (1: 8K, 2: 16K, 3: 24K, 4: GSPO 8K); flags override it
    init_from: str = ""  # start from this HF checkpoint folder (e.g. the previous stage's <out_dir>/final)
    # batch shape
    steps: int = 200  # GRPO steps (one rollout batch each)
    prompts_per_step: int = 32  # P: prompts per step, over all ranks
    group_size: int = 8  # G: samples per prompt
    minibatch_size: int = 0  # sequences per optimizer step; 0 = the whole step's P*G samples (one update per step)
    micro_batch_tokens: int = 8192  # token budget of one forward/backward (padded tokens); bounds activation memory
    max_new_tokens: int = 8  # response length limit; a response also stops where prompt + response reach max_seq_len
    min_new_tokens: int = 0  # training responses are at least this long (EOS masked before): fixed-length benchmarks
    max_seq_len: int = 64  # prompt + response: each response gets what its prompt leaves, up to max_new_tokens
    max_prompt_len: int = 0  # longer prompts are dropped; 0 = max_seq_len - max_new_tokens (every response has
    #   its full max_new_tokens)
    temperature: float = 1.0  # sampling temperature (the trainer's logprobs use the same one)
    top_p: float = 1.0  # nucleus sampling; keep 1.0 for training (the trainer does not renormalize)
    # optimizer
    lr: float = 2e-4  # AdamW learning rate
    weight_decay: float = 0.01  # AdamW weight decay
    warmup_steps: int = 0  # linear LR warm-up from 0.1 x lr to lr over this many GRPO steps (NeMo-RL's LinearLR)
    grad_clip: float = 1.0  # max global gradient norm
    # advantages and loss (grpo.py)
    leave_one_out: bool = False  # leave-one-out baseline and std (RLOO, as NeMo-RL) instead of the group's
    adv_scale: Literal["group", "batch", "none"] = "group"  # divide advantages by the group std, the batch std
    #   (TRL's scale_rewards="batch"), or not at all (Dr. GRPO)
    pg: Literal["ppo", "gspo", "cispo", "reinforce"] = "ppo"  # policy loss: clipped PPO ratio per token, GSPO's
    #   ratio per sequence (needs --no-token-level), CISPO's clipped stop-gradient weight, or REINFORCE (no ratio)
    eps_low: float = 0.2  # ratio clip 1 - eps_low
    eps_high: float = 0.2  # ratio clip 1 + eps_high (> eps_low: DAPO clip-higher)
    dual_clip: float = 0.0  # dual-clip constant c > 1 for negative advantages; 0 = off
    kl_beta: float = 0.0  # KL penalty to the initial model; > 0 loads a frozen reference copy
    kl_kind: Literal["k1", "k2", "k3"] = "k3"  # KL estimator
    token_level: bool = True  # token-level loss aggregation over the global batch (False: per-sequence mean)
    overlong_filter: bool = False  # mask truncated responses out of the loss (they still count in the baseline)
    is_correction: Literal["none", "tis", "icepop", "seq-mask-tis", "seq-mask"] = "none"  # engine/trainer mismatch
    #   correction: truncate (tis) or mask (icepop) token weights, or drop whole sequences (seq-mask-tis, seq-mask)
    is_cap: float = 2.0  # upper bound of the importance weight: TIS's cap, the masks' band top
    is_min: float = 0.0  # lower bound of the importance weight (icepop and seq-mask-tis need one > 0)
    kl_score_term: bool = True  # KL gradient includes the score-function term (NeMo-RL since PR #2506)
    dynamic_sampling: bool = False  # DAPO: drop groups with all-equal rewards, draw more prompts to refill the batch
    dynamic_sampling_max_tries: int = 4  # generation rounds per step before training on what was kept
    # evaluation, logging, system
    eval_every: int = 25  # held-out evaluation every N steps (and at start and end); 0 = never
    eval_prompts: int = 200  # held-out prompts evaluated
    eval_samples: int = 4  # samples per held-out prompt for pass@1 (temperature = --temperature)
    out_dir: str = ""  # run folder; default runs/<date-time>
    seed: int = 0  # seeds data order, init of sampling, and torch
    threads: int = 0  # torch CPU threads; 0 = this node's cores shared among its ranks
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


# DeepScaleR's three stages as NeMo-RL ran them on 8 GPUs (README: Math, the DeepScaleR recipe). Each stage starts
# from the previous one's final checkpoint (--init-from). As in NeMo-RL, each response gets all that its prompt
# leaves of max_seq_len (prompts of at most 1024 tokens). vLLM's share of each GPU holds the weights and the KV
# cache of a rank's 128 sequences, 28 KiB per token at 1.5B: 0.6 of 80 GB fits them at 8K; at 16K and 24K the
# shares are as large as the trainer's resident state allows, and long groups preempt (docs/distributed.md).
_DEEPSCALER = dict(task="math", prompts_per_step=128, group_size=8, minibatch_size=64, weight_decay=0.01,
                   warmup_steps=50, grad_clip=1.0, temperature=1.0, eps_low=0.2, activation_checkpointing=True,
                   eval_every=10, eval_samples=16, detailed_progress=True, leave_one_out=True, max_prompt_len=1024,
                   dist_timeout_s=3600)
STAGES = {
    1: dict(_DEEPSCALER, max_seq_len=8192, max_new_tokens=8192, lr=2e-6, kl_beta=0.0, eps_high=0.2, steps=240,
            gpu_memory_utilization=0.6),
    2: dict(_DEEPSCALER, max_seq_len=16384, max_new_tokens=16384, lr=2e-6, kl_beta=1e-3, eps_high=0.28, steps=290,
            gpu_memory_utilization=0.8),
    3: dict(_DEEPSCALER, max_seq_len=24576, max_new_tokens=24576, lr=5e-7, kl_beta=1e-4, eps_high=0.28, steps=50,
            gpu_memory_utilization=0.85),
}
STAGES[4] = dict(STAGES[1], pg="gspo", token_level=False)  # NeMo-RL's grpo-gspo-deepscaler-1.5b-8K: stage 1 + GSPO


def parse_args(argv: list[str]) -> Config:
    """The command line: `--stage N` sets the preset's values as defaults, and every other flag overrides them."""
    import tyro

    stage = 0
    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--stage=") else argv[i + 1] if a == "--stage" and i + 1 < len(argv) else None
        if value is not None:
            if value not in ("0", "1", "2", "3", "4"):
                raise SystemExit(f"error: --stage {value}: unknown stage (use 1, 2, 3, or 4 for GSPO)")
            stage = int(value)
    default = Config(stage=stage, **STAGES[stage]) if stage else Config()
    return tyro.cli(Config, default=default, args=argv)


# ----------------------------------------------------------------------------------------------------------------
# The loop


def train(cfg: Config, engine: rollout.Engine | None = None) -> dict:
    """Run GRPO; `engine` lets a caller (the tests, bench.py) bring an engine that already holds the base model."""
    rank, world = dist.init(cfg.dist_timeout_s)
    validate(cfg, world)  # bad flags and bad data stop the run here, before any model or engine loads
    device, bf16 = runtime.setup_process(cfg)
    out = runtime.run_folder(cfg)
    task = load_task(cfg)
    policy = runtime.load_trainable(task.path, device, cfg.activation_checkpointing, cfg.trust_remote_code)
    ref = None
    if cfg.kl_beta > 0:  # the frozen initial model, sharded like the policy, only when the KL term is on
        ref = runtime.load_trainable(task.path, device, False, cfg.trust_remote_code).eval().requires_grad_(False)
    engine_dtype = torch.bfloat16 if bf16 else torch.float32
    own_engine = engine is None  # an engine the caller brought is the caller's to close
    engine = engine or make_engine(cfg, task.path, engine_dtype, device)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_factor(s, cfg.warmup_steps))
    stream = data.PromptStream(len(task.train), cfg.seed)
    evaluate = lambda step: eval_aime.heldout_accuracy(  # noqa: E731
        engine, task.tok, task.heldout_prompts, [p.answer for p in task.heldout], task.reward_fn, cfg.eval_samples,
        [budget(cfg, p) for p in task.heldout_prompts], cfg.temperature, cfg.seed + step, cfg.tensor_parallel_size,
        _bars(cfg))
    start, history, log = runtime.resume_or_start(out, cfg, policy, opt, sched, stream, first_row=lambda: evaluate(0))
    if start:
        engine.load_weights(dist.full_weights(policy.lm, engine_dtype))  # the engine samples from resumed weights
    last_eval = next((r for r in reversed(history) if "heldout_pass1" in r), {})
    from tqdm import tqdm

    bar = tqdm(range(start + 1, cfg.steps + 1), disable=cfg.quiet or not dist.is_main(), desc="GRPO",
               dynamic_ncols=True)
    t_start, bad_steps, stop = time.time(), 0, False
    ctrl_c = runtime.CtrlC(install=__name__ == "__main__")  # only a command-line run owns the process's SIGINT
    for step in bar:
        t0, times = time.time(), {}
        # 1-3. this rank's share of the step's prompts, G responses each, scored
        groups = collect_groups(engine, task, stream, cfg, step, times)
        engine.sleep()  # on GPU the trainer gets the engine's memory until the refit wakes the engine
        runtime.reset_peak_memory(device)  # peak_mem_gib: the trainer's peak, steps 4-6
        # 4. advantages: each response's reward against its group's
        adv = grpo.group_advantages(groups.rewards, cfg.leave_one_out, cfg.adv_scale,
                                    batch_std=batch_std(groups.rewards, cfg))  # [P, G]
        batch = make_batch(groups.prompts, groups.samples, adv.flatten(), cfg.overlong_filter, task.tok.pad_token_id)
        # 5-6. old (and reference) logprobs, then one AdamW step per minibatch
        upd = update_policy(policy, ref, opt, sched, batch, cfg, device, rank * (cfg.prompts_per_step // world), times)
        peak_gib = runtime.peak_memory_gib(device, engine.device_bytes)
        bad_steps = runtime.skipped_in_a_row(bad_steps, upd.skipped, step, cfg, out)
        # 7. refit: the engine samples the next step from the new weights
        with runtime.timed(times, "refit"):
            engine.load_weights(dist.full_weights(policy.lm, engine_dtype))
        # 8. metrics over all ranks, held-out evaluation, checkpoint
        row = step_metrics(step, groups, batch, adv, upd, sched, times, peak_gib)
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            last_eval = evaluate(step)
            row.update(last_eval)
        if cfg.reward:  # samples (training and held-out) whose --reward raised, hung or returned a non-number
            row.update(reward_errors=int(dist.all_reduce_sum(torch.tensor([float(task.reward_fn.take_failures())]))[0]))
        row.update(time_step=time.time() - t0)
        row.update(tokens_per_s=row["response_len_mean"] * row["seqs"] / row["time_step"], elapsed=time.time() - t_start)
        history.append(row)
        if log:
            log.write(row)
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", heldout=f"{last_eval.get('heldout_pass1', 0):.2f}",
                            mpe=f"{row['token_mult_prob_error']:.3f}")
        stop = runtime.end_of_step(step, cfg, out, policy, opt, sched, stream, {"config": asdict(cfg)}, ctrl_c)
        if stop:
            break
    bar.close()
    if log:
        log.close()
        if cfg.plot:
            plot(out)
    if stop:
        dist.close(engine if own_engine else None)
        raise SystemExit(130)
    if cfg.save_final:
        runtime.save_hf(policy.lm, task.tok, out / "final")
    summary = dict(out_dir=str(out), minutes=(time.time() - t_start) / 60,
                   first=history[0], last={k: v for k, v in history[-1].items() if k.startswith("heldout")})
    dist.print0(json.dumps(summary))
    dist.close(engine if own_engine else None)
    return dict(history=history, out_dir=str(out))


# ----------------------------------------------------------------------------------------------------------------
# Steps 1-3: the step's groups


@dataclass
class Groups:
    """This rank's groups of one step: G samples of each of P prompts, scored."""

    prompts: list[list[int]]  # [P] prompt token ids
    samples: list[rollout.Sample]  # [P * G], prompt-major; sample.prompt_idx indexes `prompts`
    rewards: torch.Tensor  # [P, G]
    drawn: int  # groups generated, over every dynamic-sampling round (this rank's engine)
    zero_variance: int  # of those, groups whose rewards were all equal (no learning signal)
    rounds: int  # generation rounds (1 unless dynamic sampling drew more)


def collect_groups(engine, task: "Task", stream: data.PromptStream, cfg: Config, step: int, times: dict) -> Groups:
    """Steps 1-3: the step's prompts -> G responses each -> rewards.

    Each engine takes its share of the step's prompts (the ranks of a tensor-parallel engine send it identical
    requests, then each keeps its part) and a prompt's G samples stay on one rank. With dynamic sampling (DAPO),
    groups whose rewards are all equal are dropped and more prompts are drawn until every engine has its share of
    informative groups or the tries run out; all ranks make the same number of tries.
    """
    world, tp, G = dist.world_size(), cfg.tensor_parallel_size, cfg.group_size
    tp_rank, dp_rank = dist.rank() % tp, dist.rank() // tp
    share, per_rank = cfg.prompts_per_step // (world // tp), cfg.prompts_per_step // world
    kept = []  # (prompt index, its G samples, its [G] rewards)
    drawn = zero = rounds = 0
    while True:
        ids = stream.take(cfg.prompts_per_step)[dp_rank * share : (dp_rank + 1) * share]
        prompts = [task.train_prompts[i] for i in ids]
        with runtime.timed(times, "generate"):
            new = engine.generate(prompts, n=G, max_tokens=[budget(cfg, p) for p in prompts],
                                  temperature=cfg.temperature, top_p=cfg.top_p, progress=_bars(cfg),
                                  min_tokens=cfg.min_new_tokens, seed=hash((cfg.seed, step, rounds)) % 2**31,
                                  first_index=dp_rank * share)  # the prompts' place in the step: streams of their own
        with runtime.timed(times, "score"):
            r = torch.tensor([task.reward_fn(task.tok.decode(s.token_ids, skip_special_tokens=True),
                                             task.train[ids[s.prompt_idx]].answer) for s in new]).view(len(ids), G)
        rounds, drawn, zero = rounds + 1, drawn + len(ids), zero + int((r.std(1) == 0).sum())
        for g, i in enumerate(ids):
            if len(kept) < share and (not cfg.dynamic_sampling or r[g].std() > 0):
                kept.append((i, new[g * G : (g + 1) * G], r[g]))
        if not cfg.dynamic_sampling or rounds >= cfg.dynamic_sampling_max_tries:
            break
        if dist.all_reduce_sum(torch.tensor([float(len(kept) < share)])).item() == 0:
            break
    kept = kept[tp_rank * per_rank : (tp_rank + 1) * per_rank]
    if not kept:  # nothing informative: one zero-advantage group keeps every rank's batch non-empty
        kept = [(ids[0], new[:G], r[0])]
    return Groups(prompts=[task.train_prompts[i] for i, _, _ in kept],
                  samples=[replace(s, prompt_idx=k) for k, (_, group, _) in enumerate(kept) for s in group],
                  rewards=torch.stack([r for _, _, r in kept]),  # P < per_rank when dynamic sampling ran short
                  drawn=drawn, zero_variance=zero, rounds=rounds)


def budget(cfg: Config, prompt: list[int]) -> int:
    """A response's length limit: what its prompt leaves of --max-seq-len, at most --max-new-tokens (NeMo-RL caps
    each request at the engine's max_model_len minus its prompt's length)."""
    return min(cfg.max_new_tokens, cfg.max_seq_len - len(prompt))


def batch_std(rewards: torch.Tensor, cfg: Config) -> float | None:
    """The sample std of every reward of the step over all ranks, for --adv-scale batch (else None)."""
    if cfg.adv_scale != "batch":
        return None
    r = rewards.double().flatten()
    n, s1, s2 = dist.all_reduce_sum(torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(),
                                                 (r * r).sum()])).tolist()
    return max((s2 - s1 * s1 / n) / max(n - 1, 1), 0.0) ** 0.5


# ----------------------------------------------------------------------------------------------------------------
# Steps 5-6: the update


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
    truncated: int  # responses that hit --max-new-tokens


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
    return Batch(ids, am, start, resp_mask, gen_logp, advantages, loss_mask, [len(s) for s in seqs],
                 int(truncated.sum()))


def rows_of(b: Batch, rows: list[int]) -> dict:
    """The tensors of a subset of rows, trimmed to their own longest sequence and response.

    No rows: FSDP's stand-in for a rank with fewer micro-batches than another (distributed.micro_batches), one row
    of two tokens (a prompt token and a response token, so every parameter takes part, as FSDP's gradient
    reduction needs) with zero weight: it costs what two tokens cost, whatever the length of the batch's rows."""
    if not rows:
        zeros = lambda *shape, t=b.gen_logp: torch.zeros(*shape, dtype=t.dtype)  # noqa: E731
        return dict(input_ids=torch.zeros(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 2, dtype=torch.long),
                    resp_start=torch.tensor([1]), T=1, resp_mask=zeros(1, 1), gen_logp=zeros(1, 1),
                    advantages=zeros(1, t=b.advantages), loss_mask=zeros(1, 1, t=b.loss_mask))
    idx = torch.tensor(rows)
    L = max(b.lengths[r] for r in rows)
    T = int(b.resp_mask[idx].sum(1).max().clamp(min=1))
    return dict(input_ids=b.input_ids[idx, :L], attention_mask=b.attention_mask[idx, :L],
                resp_start=b.resp_start[idx], T=T, resp_mask=b.resp_mask[idx, :T], gen_logp=b.gen_logp[idx, :T],
                advantages=b.advantages[idx], loss_mask=b.loss_mask[idx, :T])


@dataclass
class Update:
    """What steps 5-6 report."""

    sums: dict[str, float]  # grpo.policy_loss's metric sums (and loss, entropy) over this rank's micro-batches
    grad_norm: float  # of the last minibatch, before clipping
    old_logp: torch.Tensor  # [N, T] the trainer's logprobs of the sampled tokens before the update
    skipped: int  # minibatch updates skipped for a non-finite loss or gradient


def update_policy(policy, ref, opt, sched, b: Batch, cfg: Config, device, group_offset: int = 0,
                  times: dict | None = None) -> Update:
    """Steps 5 and 6 on this rank's share of the batch: old/reference logprobs, then one AdamW step per minibatch
    (the loss over token-budget micro-batches, gradients summed over ranks by FSDP, clipped), then one step of the
    LR schedule. group_offset: the global index of this rank's first group (rank * prompts per rank)."""
    times = {} if times is None else times
    loss_cfg = loss_config(cfg)
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
    with runtime.timed(times, "logprobs"):
        for rows in dist.micro_batches(b.lengths, list(range(N)), cfg.micro_batch_tokens) \
                if (not single or ref is not None) else []:
            mb = rows_of(b, rows)
            for m, out in ((policy, old_logp), (ref, ref_logp)):
                if m is not None and (m is ref or not single):
                    lp = _logprobs(m, mb, cfg, device, grad=False)[0].cpu()
                    if rows:
                        out[rows, : mb["T"]] = lp
    # 6. minibatch updates: loss -> backward -> grad clip -> AdamW step; micro-batches sized by tokens
    t0 = time.time()
    policy.train()
    sums: dict[str, float] = {}
    grad_norm, skipped = torch.tensor(0.0), 0
    from tqdm import tqdm

    for rows in tqdm(minibatches, desc="train", disable=not _bars(cfg), leave=False):
        counts = torch.tensor([b.loss_mask[rows].sum().item(), float((b.loss_mask[rows].sum(1) > 0).sum())])
        dist.all_reduce_sum(counts)  # the global normalizer: the gradient does not depend on world size or splits
        norm = max(float(counts[0] if cfg.token_level else counts[1]), 1.0)
        micro = dist.micro_batches(b.lengths, rows, cfg.micro_batch_tokens)
        for k, mrows in enumerate(micro):
            mb = rows_of(b, mrows)
            logp, entropy = _logprobs(policy, mb, cfg, device, grad=True)  # [n, T]
            old = logp.detach().cpu() if single or not mrows else old_logp[mrows, : mb["T"]]
            if single and mrows:
                old_logp[mrows, : mb["T"]] = old
            loss, metrics = grpo.policy_loss(
                logp, old.to(device), mb["advantages"].to(device), mb["loss_mask"].to(device), loss_cfg,
                num_tokens=norm, ref_logp=(ref_logp[mrows, : mb["T"]] if mrows else torch.zeros_like(old)).to(device)
                if ref is not None else None, gen_logp=mb["gen_logp"].to(device))
            with dist.gradient_sync(policy, k == len(micro) - 1):  # one gradient reduction per minibatch
                (loss * dist.loss_scale()).backward()
            if mrows:
                metrics["loss"] = loss.detach()
                metrics["entropy"] = (entropy.detach() * mb["resp_mask"].to(device)).sum()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        grad_norm = dist.clip_grad_norm(policy, cfg.grad_clip)  # global over ranks: all ranks agree on skipping
        if torch.isfinite(grad_norm):
            opt.step()
        else:  # a NaN/inf loss or gradient: this update is skipped, weights and optimizer state stay as they were
            skipped += 1
        opt.zero_grad(set_to_none=True)
    if skipped < len(minibatches):
        sched.step()  # the LR schedule counts GRPO steps, as NeMo-RL's (not when every update was skipped)
    policy.eval()
    times["update"] = times.get("update", 0.0) + time.time() - t0
    return Update(sums, float(grad_norm), old_logp, skipped)


def _logprobs(m, mb: dict, cfg: Config, device, grad: bool):
    with torch.set_grad_enabled(grad), runtime.autocast(cfg, device):
        return M.token_logprobs(m, mb["input_ids"].to(device), mb["attention_mask"].to(device),
                                mb["resp_start"].to(device), mb["T"], cfg.temperature, cfg.logprob_chunk_tokens,
                                with_entropy=grad)


def loss_config(cfg: Config) -> grpo.LossConfig:
    return grpo.LossConfig(eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip, kl_beta=cfg.kl_beta,
                           kl_kind=cfg.kl_kind, token_level=cfg.token_level, is_correction=cfg.is_correction,
                           is_cap=cfg.is_cap, is_min=cfg.is_min, pg=cfg.pg, kl_score_term=cfg.kl_score_term)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """LR factor after `step` GRPO steps: NeMo-RL's LinearLR(start_factor=0.1, end_factor=1.0,
    total_iters=warmup_steps), then constant."""
    if warmup_steps <= 0:
        return 1.0
    return 0.1 + 0.9 * min(step, warmup_steps) / warmup_steps


# ----------------------------------------------------------------------------------------------------------------
# Step 8: metrics


def step_metrics(step: int, groups: Groups, b: Batch, adv: torch.Tensor, upd: Update, sched, times: dict,
                 peak_mem_gib: float) -> dict:
    """One metrics.jsonl row: sums over every rank, then the means NeMo-RL logs under the same names.
    peak_mem_gib: the trainer's peak in steps 4-6, the largest over ranks (runtime.peak_memory_gib)."""
    mm = grpo.mismatch_metrics(b.gen_logp, upd.old_logp, b.resp_mask)
    a = adv.flatten().double()
    local = {"reward": groups.rewards.sum(), "seqs": groups.rewards.numel(), "resp_tokens": b.resp_mask.sum(),
             "truncated": b.truncated, "groups": groups.drawn, "zero_var_groups": groups.zero_variance,
             "adv": a.sum(), "adv_sq": (a * a).sum(), **mm, **upd.sums}
    keys = sorted(local)
    tot = dict(zip(keys, dist.all_reduce_sum(torch.tensor([float(local[k]) for k in keys], dtype=torch.float64)).tolist()))
    n_seq, n_tok, n_loss_tok = tot["seqs"], max(tot["resp_tokens"], 1.0), max(tot.get("tokens", 0.0), 1.0)
    adv_mean = tot["adv"] / n_seq
    return dict(
        step=step, reward_mean=tot["reward"] / n_seq, response_len_mean=tot["resp_tokens"] / n_seq, seqs=int(n_seq),
        loss=tot.get("loss", 0.0), grad_norm=upd.grad_norm, clip_frac_low=tot.get("clip_low", 0.0) / n_loss_tok,
        clip_frac_high=tot.get("clip_high", 0.0) / n_loss_tok, kl=tot.get("kl", 0.0) / n_loss_tok,
        entropy=tot.get("entropy", 0.0) / n_tok, token_mult_prob_error=tot["token_mult_prob_error"] / n_tok,
        gen_kl_error=tot["gen_kl_error"] / n_tok, policy_kl_error=tot["policy_kl_error"] / n_tok,
        js_divergence_error=tot["js_divergence_error"] / n_tok, truncated_frac=tot["truncated"] / n_seq,
        is_oob_frac=tot.get("is_oob", 0.0) / max(tot.get("is_units", 0.0), 1.0),
        zero_var_group_frac=tot["zero_var_groups"] / tot["groups"], adv_mean=adv_mean, skipped_updates=upd.skipped,
        adv_std=max(tot["adv_sq"] / n_seq - adv_mean**2, 0.0) ** 0.5, generation_rounds=groups.rounds,
        lr=sched.get_last_lr()[0], peak_mem_gib=peak_mem_gib, **{f"time_{k}": v for k, v in times.items()},
    )


# ----------------------------------------------------------------------------------------------------------------
# Set-up: flags, task, engine


@dataclass
class Task:
    """The run's problems as the loop uses them."""

    path: str  # the start weights (--init-from, or --model resolved)
    tok: object  # the model's tokenizer
    reward_fn: object  # reward.exact_reward (sum3), reward.math_reward, or --reward's user_reward.Guarded
    train: list[data.Problem]
    train_prompts: list[list[int]]  # token ids of each training prompt
    heldout: list[data.Problem]  # the first --eval-prompts held-out problems that fit
    heldout_prompts: list[list[int]]


def load_task(cfg: Config) -> Task:
    """Problems (bad rows stop the run before any model loads), the tokenizer, and every prompt's token ids."""
    if cfg.task == "sum3":
        train_set, heldout = data.sum3_split()
    else:
        train_set = data.load_problems(cfg.data, cfg.problem_field, cfg.answer_field)
        if cfg.val_data:
            heldout = data.load_problems(cfg.val_data, cfg.problem_field, cfg.answer_field)
        else:
            train_set, heldout = data.split(train_set, cfg.val_fraction, cfg.seed)
    template = data.read_template(cfg.prompt_template)
    path = model_path(cfg)
    tok = M.load_tokenizer(path, cfg.trust_remote_code)
    train_set, train_prompts = encode_prompts(cfg, tok, train_set, template, "training")
    heldout, heldout_prompts = encode_prompts(cfg, tok, heldout[: cfg.eval_prompts], template, "held-out")
    reward_fn = reward.exact_reward if cfg.task == "sum3" else reward.math_reward
    if cfg.reward:
        reward_fn = user_reward.load(cfg.reward, cfg.reward_timeout_s)
    return Task(path, tok, reward_fn, train_set, train_prompts, heldout, heldout_prompts)


def model_path(cfg: Config) -> str:
    """Where the run's starting weights are: --init-from, else --model (a built-in base is built on first use)."""
    return cfg.init_from or M.resolve(cfg.model)


def encode_prompts(cfg: Config, tok, problems: list[data.Problem], template: str | None, what: str):
    """Prompt token ids; prompts longer than prompt_limit(cfg) are dropped, counted and reported."""
    limit = prompt_limit(cfg)
    ids = [tok(p.prompt)["input_ids"] if cfg.task == "sum3" else data.math_prompt(tok, p.prompt, template)
           for p in problems]
    keep = [i for i, p in enumerate(ids) if len(p) <= limit]
    if len(keep) < len(ids):
        why = f"--max-prompt-len {limit}" if cfg.max_prompt_len else \
            f"--max-seq-len {cfg.max_seq_len} - --max-new-tokens {cfg.max_new_tokens}"
        dist.print0(f"dropped {len(ids) - len(keep)} of {len(ids)} {what} prompts longer than {limit} tokens ({why})")
    if not keep and problems:
        raise SystemExit(f"error: every {what} prompt is longer than {limit} tokens; raise --max-seq-len")
    return [problems[i] for i in keep], [ids[i] for i in keep]


def prompt_limit(cfg: Config) -> int:
    """The longest prompt a run keeps: --max-prompt-len, else what leaves every response its --max-new-tokens."""
    return cfg.max_prompt_len or cfg.max_seq_len - cfg.max_new_tokens


def make_engine(cfg: Config, path: str, dtype: torch.dtype, device) -> rollout.Engine:
    if cfg.engine == "hf":
        return rollout.HFEngine(path, dtype=dtype, trust_remote_code=cfg.trust_remote_code, device=device)
    tp = cfg.tensor_parallel_size
    return rollout.VLLMEngine(path, max_model_len=cfg.max_seq_len, seed=cfg.seed + dist.rank() // tp,
                              dtype=str(dtype).removeprefix("torch."), external_launcher=dist.world_size() > 1,
                              gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=tp,
                              trust_remote_code=cfg.trust_remote_code)


def _bars(cfg: Config) -> bool:
    """Per-phase progress bars: asked for, on rank 0 only, and not in a quiet run."""
    return cfg.detailed_progress and not cfg.quiet and dist.is_main()


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
        (0 < cfg.max_new_tokens <= cfg.max_seq_len,
         f"--max-new-tokens {cfg.max_new_tokens}: must be positive and at most --max-seq-len {cfg.max_seq_len}"),
        (0 < prompt_limit(cfg) < cfg.max_seq_len,
         f"--max-prompt-len {cfg.max_prompt_len}: must be positive and below --max-seq-len {cfg.max_seq_len}"
         if cfg.max_prompt_len else f"--max-new-tokens {cfg.max_new_tokens}: leaves no room for a prompt in "
         f"--max-seq-len {cfg.max_seq_len} (lower it, or set --max-prompt-len: responses then get what it leaves)"),
        (0 < cfg.gpu_memory_utilization < 1,
         f"--gpu-memory-utilization {cfg.gpu_memory_utilization}: must be a fraction in (0, 1)"),
        (cfg.dist_timeout_s > 0, f"--dist-timeout-s {cfg.dist_timeout_s}: must be positive"),
        (cfg.tensor_parallel_size >= 1 and world % cfg.tensor_parallel_size == 0
         and (cfg.engine == "vllm" or cfg.tensor_parallel_size == 1),
         f"--tensor-parallel-size {cfg.tensor_parallel_size}: must divide the {world} ranks (vLLM engine only)"),
        (cfg.temperature > 0, f"--temperature {cfg.temperature}: must be positive for GRPO sampling"),
        (cfg.dual_clip == 0 or cfg.dual_clip > 1, f"--dual-clip {cfg.dual_clip}: must be 0 (off) or > 1"),
        (cfg.warmup_steps >= 0, f"--warmup-steps {cfg.warmup_steps}: must be 0 (off) or positive"),
        (not (cfg.pg == "gspo" and cfg.token_level),
         "--pg gspo: GSPO's ratio is per sequence, so its loss is sequence-level: add --no-token-level (or --stage 4)"),
        (not (cfg.pg == "gspo" and cfg.is_correction == "seq-mask-tis"),
         "--pg gspo: seq-mask-tis weighs tokens, GSPO weighs sequences; use tis, icepop or seq-mask"),
        (not (cfg.pg == "cispo" and (cfg.dual_clip or not cfg.token_level)),
         "--pg cispo: CISPO is token-level and has no dual clip (drop --dual-clip / --no-token-level)"),
        (cfg.is_correction == "none" or 0 <= cfg.is_min <= cfg.is_cap,
         f"--is-min {cfg.is_min} --is-cap {cfg.is_cap}: the band needs 0 <= is-min <= is-cap"),
        (cfg.is_correction not in ("icepop", "seq-mask-tis") or cfg.is_min > 0,
         f"--is-correction {cfg.is_correction}: needs --is-min > 0 (NeMo-RL's reference bands: icepop 0.5-5, "
         "seq-mask-tis 0.999-1.002)"),
        (not cfg.init_from or os.path.isfile(os.path.join(cfg.init_from, "config.json")),
         f"--init-from {cfg.init_from}: not an HF checkpoint folder (no config.json)"),
        (cfg.task != "math" or bool(cfg.data), "--data: the math task needs a problem file or dataset name"),
        (0.0 <= cfg.val_fraction < 1.0, f"--val-fraction {cfg.val_fraction}: must be in [0, 1)"),
        *user_reward.checks(cfg.reward, cfg.reward_timeout_s),
    ]
    runtime.check(checks + runtime.run_checks(cfg))


def main(argv: list[str]) -> None:
    runtime.one_line_errors(lambda: runtime.export_hf(argv, "train.py") if argv[:1] == ["export"]
                            else train(parse_args(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
