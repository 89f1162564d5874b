"""GRPO training: the config, DeepScaleR's stage presets, and the loop. `python train.py` runs the
CPU demo; `--help` lists every flag; `python train.py export CKPT OUT` writes a saved step as an HF
folder.

One GRPO step, as train() runs it (each a line of its loop, in this order):
    1. take the step's P prompts; each engine its share      collect_groups -> data.PromptStream
    2. generate G responses per prompt, with their logprobs  collect_groups -> rollout.py
       (with --tool, calling tools inside them: tool_calls.py)
    3. score each response: 1 or 0                           collect_groups -> score -> reward.py
       (1-3 once, or more rounds with --dynamic-sampling)
    4. advantages from each group's rewards, the batch       grpo.group_advantages, batch.make_batch
    5. the trainer's old (and reference) logprobs            old_logprobs
    6. per minibatch: its normalizer, then per micro-batch logprobs -> loss -> backward; clip, AdamW
                                                             update_policy -> grpo.policy_loss
    7. refit: the engine gets the new weights (LoRA: merged) rollout.Engine.load_weights
    8. metrics reduced over ranks                            logs.step_metrics
    and around them: held-out evaluation, metrics.jsonl, checkpoints and resume (runtime.Run).
Each step writes one JSON line to <out_dir>/metrics.jsonl; a run resumes from the newest readable
checkpoint in <out_dir>/checkpoints; the final weights go to <out_dir>/final. Under torchrun the
trainer is sharded with FSDP2 and each engine generates for its share of the prompts
(distributed.py).

What it does not do: anything the files it calls own. The math and the loss's options are in
grpo.py; problems, prompts and the task in data.py; which rows each pass runs, and how they are
packed and padded (the update's plan), in batch.py; the logprobs and their fast paths in model.py
and fastpaths.py; the one-line errors and the memory pre-flight in checks.py and memory.py (the
flags' checks are here, flag_checks, each concern's from its file); the engine in rollout.py; LoRA
in lora.py; the bookkeeping around the loop (flags every run has, resume, evaluation cadence,
checkpoints, Ctrl-C) in runtime.py, which dpo.py's loop shares.
"""

import os
import sys
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

import batch
import checks
import data
import distributed
import eval_aime
import grpo
import lora
import logs
import memory
import model
import reward
import rollout
import runtime
import token_picks
import tool_calls
import toolbox
import user_reward
from batch import Batch
from checkpoint import export_hf

# (the field `lora` of Config would hide the module's name in the class body)
from lora import Adapters


@dataclass
class Config:
    """GRPO on the built-in demo (no flags), or on your problems and model. `python train.py export
    CKPT OUT` writes a saved step (<out_dir>/checkpoints/step_NNNNNN) as an HF folder. The flags are
    in four groups: GRPO's own, the loss's (grpo.LossConfig), LoRA's (lora.Adapters) and the run's,
    which dpo.py shares (runtime.RunConfig); on the command line all are flat, as in --eps-high or
    --lr."""

    # the rollout engine

    # rollout engine: colocated vLLM, or HF generate (no vLLM needed)
    engine: Literal["vllm", "hf"] = "vllm"
    # vLLM tensor parallelism over this many consecutive ranks (one engine per group)
    tensor_parallel_size: int = 1
    # GPU memory share vLLM may take for its weights and KV cache while it generates (it frees it
    # while the trainer runs); the stage presets size it to the stage's KV cache
    gpu_memory_utilization: float = 0.6
    # CPU: vLLM's KV cache in GiB; 0 = room for this rank's engine's share of a step (its P x G
    # sequences, each its longest prompt and --max-new-tokens) or of a held-out pass, whichever is
    # more, and at least one --max-seq-len sequence (memory.kv_cache_gib), so none is preempted
    kv_cache_gib: float = 0.0
    # the task

    # sum3: the demo's task (raw prompts, exact-match reward; its problems: --data, else the demo's,
    # which `python demo/tasks.py sum3` writes); math: problems from --data, boxed answers
    task: Literal["sum3", "math"] = "sum3"
    problem_field: str = "problem"  # math: field of the problem text (DeepScaleR-Preview: problem)
    answer_field: str = "answer"  # math: field of the gold answer (DeepScaleR-Preview: answer)
    # a text file with {problem}, used instead of the chat template + instruction
    prompt_template: str = ""
    # math: the response's final answer is its last \boxed{} (boxed: DeepScaleR's), or that when it
    # is there and not empty, else its last number (last-number: for models too small to box their
    # answers, reward.py)
    answer: Literal["boxed", "last-number"] = "boxed"
    # your own reward, path/to/file.py:function, a (response, gold) -> float used instead of the
    # task's for training and held-out figures; a call that raises, hangs or returns a non-number
    # scores 0 and is counted (reward_errors) and warned about (user_reward.py; demo/my_reward.py is
    # an example)
    reward: str = ""
    # --reward: a call running longer scores 0 (its worker process is killed)
    reward_timeout_s: float = 1.0
    # tools the model may call inside a response, <TAG>input</TAG>, its output appended as
    # <result>output</result> (tool_calls.py, toolbox.py): calculator (<calc>), python (<python>,
    # in a child process with time, memory and file limits: against accidents, not a hostile
    # model), or path/to/file.py:function, your own f(text) -> str (tag: its name)
    tool: list[str] = field(default_factory=list)
    max_tool_calls: int = 4  # --tool: a response ends after this many calls' outputs
    # --tool: a call running longer gives an error text as its output (its process is killed)
    tool_timeout_s: float = 5.0
    # DeepScaleR preset (1: 8K, 2: 16K, 3: 24K, 4: GSPO 8K); flags override it
    stage: Literal[0, 1, 2, 3, 4] = 0
    # start from this HF checkpoint folder (e.g. the previous stage's <out_dir>/final)
    init_from: str = ""
    # the batch
    prompts_per_step: int = 32  # P: prompts per step, over all ranks
    group_size: int = 8  # G: samples per prompt
    # sequences per optimizer step; 0 = the whole step's P*G samples (one update per step)
    minibatch_size: int = 0
    # response length limit; a response also stops where prompt + response reach max_seq_len
    max_new_tokens: int = 8
    # training responses are at least this long (EOS masked before): fixed-length benchmarks
    min_new_tokens: int = 0
    # prompt + response: each response gets what its prompt leaves, up to max_new_tokens
    max_seq_len: int = 64
    # longer prompts are dropped; 0 = max_seq_len - max_new_tokens (every response has its full
    # max_new_tokens)
    max_prompt_len: int = 0
    temperature: float = 1.0  # sampling temperature (the trainer's logprobs use the same one)
    top_p: float = 1.0  # nucleus sampling; keep 1.0 for training (the trainer does not renormalize)
    # DAPO: mask truncated responses out of the loss (they still count in the baseline)
    overlong_filter: bool = False
    # DAPO's soft overlong punishment: a response longer than its limit (--max-new-tokens, or
    # what its prompt leaves of --max-seq-len when less) minus this many tokens loses
    # --overlong-buffer-penalty x its excess / this from its reward (overlong_shaping); 0 = off
    overlong_buffer_length: int = 0
    overlong_buffer_penalty: float = 1.0  # what a response cut off at its limit loses
    # DAPO: drop groups with all-equal rewards, draw more prompts to refill the batch
    dynamic_sampling: bool = False
    # generation rounds per step before training on what was kept
    dynamic_sampling_max_tries: int = 4
    # samples whose advantage is exactly 0 (a group whose rewards are all equal) run no forward or
    # backward in the update: their loss and gradient are exactly 0, so the weights after the step
    # are the same, in less time (the loss's normalizers still count them); off: computed anyway.
    # Not with --kl-beta, --entropy-coeff or --pg kl_cov, whose terms do not vanish with the
    # advantage
    skip_zero_advantage: bool = True
    # a group's samples share their prompt's tokens: the trainer's forward and backward compute
    # them once per pack of samples (one row: the prompt, then each response seeing only the
    # prompt and itself; fastpaths.pack_rows), not once per sample; the same logprobs and gradient
    # in fewer tokens. Packs stay within --micro-batch-tokens. Off: one row per sample
    share_prompt: bool = True
    # evaluation and progress
    eval_prompts: int = 200  # held-out prompts evaluated
    # also bars for each step's rollout, training and evaluation (long GPU steps)
    detailed_progress: bool = False
    # CPU: before any model loads, stop if memory.py's estimate of a process's peak exceeds its
    # share of the machine's available memory (the line names the flags that would fit); off: run
    # anyway
    memory_check: bool = True
    loss: grpo.LossConfig = field(default_factory=grpo.LossConfig)
    """the objective: advantages and the policy loss (grpo.py)"""
    lora: Adapters = field(default_factory=Adapters)
    """LoRA (lora.py): --lora-rank R > 0 trains adapters, not weights"""
    run: runtime.RunConfig = field(default_factory=runtime.RunConfig)
    """what every training run has, GRPO's and DPO's (runtime.py): model, data, compute, optimizer,
    evaluation, checkpoints, logging"""


# DeepScaleR's three stages as NeMo-RL ran them on 8 GPUs (README: Math, the DeepScaleR recipe), as
# flags. Each stage starts from the previous one's final checkpoint (--init-from). As in NeMo-RL,
# each response gets all that its prompt leaves of max_seq_len (prompts of at most 1024 tokens).
# vLLM's share of each GPU holds the weights and the KV cache of a rank's 128 sequences, 28 KiB per
# token at 1.5B: 0.6 of 80 GB fits them at 8K; at 16K and 24K the shares are as large as the
# trainer's resident state allows, and long groups preempt (docs/distributed.md).
# fmt: off
_DEEPSCALER = dict(
    task="math", prompts_per_step=128, group_size=8, minibatch_size=64, weight_decay=0.01,
    warmup_steps=50, grad_clip=1.0, temperature=1.0, eps_low=0.2, activation_checkpointing=True,
    eval_every=10, eval_samples=16, detailed_progress=True, leave_one_out=True,
    max_prompt_len=1024, dist_timeout_s=3600,
)
STAGES = {
    1: dict(_DEEPSCALER, max_seq_len=8192, max_new_tokens=8192, lr=2e-6, kl_beta=0.0,
            eps_high=0.2, steps=240, gpu_memory_utilization=0.6),
    2: dict(_DEEPSCALER, max_seq_len=16384, max_new_tokens=16384, lr=2e-6, kl_beta=1e-3,
            eps_high=0.28, steps=290, gpu_memory_utilization=0.8),
    3: dict(_DEEPSCALER, max_seq_len=24576, max_new_tokens=24576, lr=5e-7, kl_beta=1e-4,
            eps_high=0.28, steps=50, gpu_memory_utilization=0.85),
}
# fmt: on
# NeMo-RL's grpo-gspo-deepscaler-1.5b-8K: stage 1 + GSPO
STAGES[4] = dict(STAGES[1], pg="gspo", token_level=False)


def parse_args(argv: list[str]) -> Config:
    """The command line: `--stage N` sets the preset's values as defaults, and every other flag
    overrides them (runtime.cli)."""
    return runtime.cli(Config, STAGES, argv)


def flag_checks(cfg: Config, world: int) -> None:
    """train.py's flags (Config) on `world` ranks: one clear line for a bad one, before any
    model or engine is loaded: GRPO's own flags, the loss's (grpo.config_error), LoRA's, --reward's,
    and those every run has (runtime.run_checks)."""
    loss_error = grpo.config_error(cfg.loss)
    checks.check(
        [
            (
                cfg.group_size >= 2,
                f"--group-size {cfg.group_size}: GRPO needs at least 2 samples per prompt",
            ),
            (
                cfg.prompts_per_step >= world and cfg.prompts_per_step % world == 0,
                f"--prompts-per-step {cfg.prompts_per_step}: must be a positive multiple of the "
                f"{world} ranks",
            ),
            (
                cfg.minibatch_size >= 0
                and cfg.minibatch_size % cfg.group_size == 0
                and cfg.prompts_per_step * cfg.group_size % (cfg.minibatch_size or 1) == 0,
                f"--minibatch-size {cfg.minibatch_size}: must be a multiple of "
                f"--group-size {cfg.group_size} (whole groups) dividing "
                f"prompts_per_step * group_size = {cfg.prompts_per_step * cfg.group_size}",
            ),
            (
                0 <= cfg.min_new_tokens <= cfg.max_new_tokens,
                f"--min-new-tokens {cfg.min_new_tokens}: must be in [0, --max-new-tokens "
                f"{cfg.max_new_tokens}]",
            ),
            (
                not (cfg.min_new_tokens and cfg.tool),
                f"--min-new-tokens {cfg.min_new_tokens} with --tool: vLLM does not stop at a call "
                "before that many tokens (the model would write the output itself); use 0",
            ),
            (
                0 < cfg.max_new_tokens <= cfg.max_seq_len,
                f"--max-new-tokens {cfg.max_new_tokens}: must be positive and at most "
                f"--max-seq-len {cfg.max_seq_len}",
            ),
            (
                0 < data.prompt_limit(cfg) < cfg.max_seq_len,
                f"--max-prompt-len {cfg.max_prompt_len}: must be positive and below --max-seq-len "
                f"{cfg.max_seq_len}"
                if cfg.max_prompt_len
                else f"--max-new-tokens {cfg.max_new_tokens}: leaves no room for a prompt in "
                f"--max-seq-len {cfg.max_seq_len} (lower it, or set --max-prompt-len: responses "
                "then get what it leaves)",
            ),
            *memory.engine_checks(cfg.gpu_memory_utilization, cfg.kv_cache_gib),
            (
                cfg.tensor_parallel_size >= 1
                and world % cfg.tensor_parallel_size == 0
                and (cfg.engine == "vllm" or cfg.tensor_parallel_size == 1),
                f"--tensor-parallel-size {cfg.tensor_parallel_size}: must divide the {world} ranks "
                "(vLLM engine only)",
            ),
            (
                0 <= cfg.overlong_buffer_length <= cfg.max_new_tokens
                and cfg.overlong_buffer_penalty >= 0,
                f"--overlong-buffer-length {cfg.overlong_buffer_length} --overlong-buffer-penalty "
                f"{cfg.overlong_buffer_penalty}: the buffer must be in [0, --max-new-tokens "
                f"{cfg.max_new_tokens}] and the penalty 0 or more",
            ),
            (
                cfg.temperature > 0,
                f"--temperature {cfg.temperature}: must be positive for GRPO sampling",
            ),
            (not loss_error, loss_error),
            (  # the penalty |logp - old_logp| has gradient 0 at ratio 1, the only update's
                cfg.loss.pg != "kl_cov"
                or 0 < cfg.minibatch_size < cfg.prompts_per_step * cfg.group_size,
                "--pg kl_cov: with one minibatch a step's only update runs at ratio 1, where "
                "KL-Cov's penalty has no gradient (plain policy gradient): set --minibatch-size "
                f"below prompts_per_step * group_size = {cfg.prompts_per_step * cfg.group_size}",
            ),
            (
                not cfg.init_from or os.path.isfile(os.path.join(cfg.init_from, "config.json")),
                f"--init-from {cfg.init_from}: not an HF checkpoint folder (no config.json)",
            ),
            (
                cfg.task != "math" or bool(cfg.run.data),
                "--data: the math task needs a problem file or dataset name",
            ),
            (
                cfg.answer == "boxed" or (cfg.task == "math" and not cfg.reward),
                f"--answer {cfg.answer}: chooses how the math task's reward reads an answer "
                "(--task math, no --reward)",
            ),
            *user_reward.checks(cfg.reward, cfg.reward_timeout_s),
            *toolbox.checks(
                cfg.tool, cfg.tool_timeout_s, cfg.max_tool_calls, cfg.tensor_parallel_size
            ),
            *lora.flag_checks(cfg.lora),
            *runtime.run_checks(cfg.run),
        ]
    )
    # peft must be able to put the adapters on the model: read from its config, no weights load
    if cfg.lora.on:
        lora.target_checks(
            cfg.lora,
            data.model_path(cfg),
            cfg.run.trust_remote_code,
            f"--init-from {cfg.init_from}" if cfg.init_from else f"--model {cfg.run.model}",
        )


# ----------------------------------------------------------------------------------------------
# The loop


def train(cfg: Config, engine: rollout.Engine | None = None) -> dict:
    """Run GRPO; `engine` lets a caller (the tests, tools/bench.py) bring an engine that already
    holds the base model."""
    rank, world = distributed.init(cfg.run.dist_timeout_s)
    flag_checks(cfg, world)  # bad flags stop the run here, before any model or engine loads
    memory.preflight(cfg, world)  # so does a run that cannot fit in this machine's memory
    device, bf16 = runtime.setup_process(cfg.run)
    task = data.load_task(cfg)  # and bad data here
    policy, ref = load_policy_and_ref(cfg, task.path, device)
    dtype = torch.bfloat16 if bf16 else torch.float32  # the engine's weights
    own_engine = engine is None  # an engine the caller brought is the caller's to close
    engine = engine or rollout.make_engine(cfg, task, dtype, device)
    opt, sched = runtime.optimizer(policy, cfg.run)
    stream = data.PromptStream(len(task.train), cfg.run.seed)
    # the run folder, metrics.jsonl, Ctrl-C (only a command-line run owns the process's Ctrl-C)
    run = runtime.Run(cfg, "GRPO", PROGRESS_BAR_FIGURES, sigint=__name__ == "__main__")
    pad = task.tok.pad_token_id

    # the newest readable checkpoint's step, or 0; one saved over other problems is refused
    start = run.resume(policy, opt, sched, stream, task.fingerprint)
    if start:  # the engine samples from the resumed weights
        engine.load_weights(model.hf_weights(policy.lm, dtype))
    else:  # step 0's row: the start weights' held-out figures
        run.log(0, evaluate(engine, task, cfg, 0) if run.eval_due(0) else {})
    for step in run.steps(start):
        times = {}
        # 1-3. the step's prompts -> G responses to each -> their rewards
        groups = collect_groups(engine, task, stream, cfg, step, times)
        engine.sleep()  # on GPU the trainer takes the engine's memory; load_weights wakes it
        runtime.reset_peak_memory(device)  # peak_mem_gib: the trainer's peak, steps 4-6
        # 4. advantages [P, G] from each group's rewards, and the trainer's padded batch
        adv = advantages(
            groups.rewards, cfg, groups.samples, groups.prompts, shape=not groups.fallback
        )
        b = batch.make_batch(
            groups.prompts, groups.samples, adv.flatten(), cfg.overlong_filter, pad
        )
        with runtime.timed(times, "logprobs"):  # 5. old (and reference) logprobs
            b = old_logprobs(policy, ref, b, cfg, device, groups.first_group, step)
        with runtime.timed(times, "update"):  # 6. loss -> backward -> clip -> AdamW, per minibatch
            upd = update_policy(policy, opt, sched, b, cfg, device, groups.first_group)
        peak_gib = runtime.peak_memory_gib(device, engine.device_bytes)
        with runtime.timed(times, "refit"):  # 7. the engine samples the next step from these
            engine.load_weights(model.hf_weights(policy.lm, dtype))
        row = logs.step_metrics(step, groups, b, adv, upd, sched, times, peak_gib)  # 8. metrics
        if run.eval_due(step):  # held-out pass@1 every --eval-every steps and at the last
            row |= evaluate(engine, task, cfg, step)
        run.log(step, row)  # metrics.jsonl and the progress bar
        stop = run.interrupted()  # Ctrl-C on any rank: a checkpoint, then the loop ends
        if stop or run.checkpoint_due(step):  # every --checkpoint-every steps and at the last
            run.save(step, policy, opt, sched, stream)
    return run.finish(policy, task.tok, engine if own_engine else None)


# the progress bar's figures
PROGRESS_BAR_FIGURES = dict(
    reward="reward_mean", heldout="heldout_pass1", mpe="token_mult_prob_error"
)


def load_policy_and_ref(cfg: Config, path: str, device):
    """The trainable policy (sharded under torchrun; with LoRA, adapters on the frozen base) and
    the frozen start model for the KL term: None when the term is off, and with LoRA the policy
    itself (its adapters switched off)."""
    ckpt, remote = cfg.run.activation_checkpointing, cfg.run.trust_remote_code
    bf16_params = runtime.fsdp_bf16(cfg.run, device)  # else autocast's bf16, or float32
    policy = model.load_trainable(
        path, device, ckpt, remote, adapters=cfg.lora, bf16_params=bf16_params
    )
    if cfg.skip_zero_advantage and has_advantage_free_term(cfg):  # batch.trained_rows
        distributed.print0(
            "--kl-beta / --entropy-coeff / --pg kl_cov: every sample with loss tokens "
            "runs forward and backward in the update (their terms do not vanish with the advantage)"
        )
    if cfg.loss.kl_beta == 0:
        return policy, None
    if cfg.lora.on:
        return policy, policy
    ref = model.load_trainable(path, device, False, remote, bf16_params=bf16_params)
    return policy, ref.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------------
# Steps 1-3: the step's groups


@dataclass
class Groups:
    """This rank's groups of one step: G samples of each of P prompts, scored."""

    prompts: list[list[int]]  # [P] prompt token ids
    # [P * G], prompt-major; each sample's prompt_idx indexes `prompts` above (this rank's groups),
    # not the engine's request it came from (collect_groups re-indexes it)
    samples: list[rollout.Sample]
    rewards: torch.Tensor  # [P, G]
    generated: int  # groups generated, over every dynamic-sampling round (this rank's engine)
    zero_variance: int  # of those, groups whose rewards were all equal (no learning signal)
    rounds: int  # generation rounds (1 unless dynamic sampling drew more)
    # the step-wide index of this rank's first group (minibatches are made of whole groups)
    first_group: int
    reward_errors: int  # this step's samples a --reward FILE:FUNCTION failed on (scored 0)
    # the one group of an engine whose dynamic sampling kept none: measured, not trained (its
    # rewards, all equal, are not shaped: advantage 0)
    fallback: bool = False


def collect_groups(
    engine, task: data.Task, stream: data.PromptStream, cfg: Config, step: int, times: dict
) -> Groups:
    """Steps 1-3: the step's prompts -> G responses to each -> a reward for each, this rank's share.

    Example, the demo (P = 32, G = 8, one rank): the stream gives 32 indices into the training set;
    the engine answers each prompt 8 times ("3+9+4=" -> "16", "12", "16", ...) and each answer is
    scored against the gold one:
      Groups(prompts=[32 prompts' token ids], samples=[256 samples, prompt-major],
             rewards=[[1., 0., 1., ...], ...] (a [32, 8] tensor), generated=32, zero_variance=5,
             rounds=1, first_group=0)

    Each engine takes its share of the step's prompts (rollout_round) and a prompt's G samples stay
    on one rank; the ranks of a tensor-parallel engine send it identical requests, take the
    rewards its first rank computed, then each keeps its part of the groups. With dynamic sampling
    (DAPO), groups whose rewards are all equal are dropped and more rounds drawn until every engine
    has its share of informative groups or the tries run out; all ranks make the same number of
    rounds. A rank whose part is empty trains nothing this step (FSDP placeholders keep it in step),
    except that an engine that kept nothing gives its first rank one uniform group (advantage 0,
    Groups.fallback: the overlong punishment would make its rewards differ, and a group dynamic
    sampling rejected would train), so that every step has rows to measure.
    """
    world, tp, G = distributed.world_size(), cfg.tensor_parallel_size, cfg.group_size
    prompts_per_engine = cfg.prompts_per_step // (world // tp)
    prompts_per_rank = cfg.prompts_per_step // world
    # this engine's groups for training (with dynamic sampling, only those whose rewards differ),
    # and the count of groups generated
    accepted, generated, zero_variance, rounds = [], 0, 0, 0
    while True:
        # a seed per step and round: fresh samples, the same at any world size (rollout_round gives
        # each prompt its own stream, seeded by its place in the step)
        groups = rollout_round(
            engine, task, stream, cfg, hash((cfg.run.seed, step, rounds)) % 2**31, times
        )
        rounds, generated = rounds + 1, generated + len(groups)
        zero_variance += sum(int(rewards.std() == 0) for _, _, rewards in groups)
        accepted += [g for g in groups if not cfg.dynamic_sampling or g[2].std() > 0][
            : prompts_per_engine - len(accepted)
        ]
        if not cfg.dynamic_sampling or rounds >= cfg.dynamic_sampling_max_tries:
            break
        # every engine is full
        short = float(len(accepted) < prompts_per_engine)
        if distributed.all_reduce_sum(torch.tensor([short])).item() == 0:
            break
    tp_rank = distributed.rank() % tp
    # this rank's part of its engine's groups; fewer than prompts_per_rank, or none, when dynamic
    # sampling ran short: no group trains twice
    rank_groups = accepted[tp_rank * prompts_per_rank : (tp_rank + 1) * prompts_per_rank]
    if not accepted and tp_rank == 0:  # nothing informative: the last round's groups are uniform
        rank_groups = groups[:1]
    errors = task.reward_failures()
    return Groups(
        prompts=[task.train_prompts[i] for i, _, _ in rank_groups],
        # prompt_idx: from the place in the engine's request to the place in `prompts` above
        samples=[
            replace(s, prompt_idx=k)
            for k, (_, samples, _) in enumerate(rank_groups)
            for s in samples
        ],
        rewards=(
            torch.stack([rewards for _, _, rewards in rank_groups])
            if rank_groups
            else torch.zeros(0, G)
        ),
        # an engine's figures once, not once per tensor-parallel rank
        generated=generated if tp_rank == 0 else 0,
        zero_variance=zero_variance if tp_rank == 0 else 0,
        rounds=rounds,
        first_group=distributed.rank() * prompts_per_rank,
        reward_errors=errors if tp_rank == 0 else 0,
        fallback=not accepted and bool(rank_groups),
    )


def rollout_round(
    engine, task: data.Task, stream: data.PromptStream, cfg: Config, seed: int, times: dict
) -> list[tuple[int, list[rollout.Sample], torch.Tensor]]:
    """Steps 1-3 once: this engine's share of P new prompts, G responses to each, their rewards, as
    [(the prompt's index in the training set, its G samples, their rewards [G]), ...]."""
    tp, G = cfg.tensor_parallel_size, cfg.group_size
    engine_rank = distributed.rank() // tp
    prompts_per_engine = cfg.prompts_per_step // (distributed.world_size() // tp)
    # 1. every rank draws the whole step's prompts, so that all streams stay in step, and keeps its
    # engine's share
    first_prompt = engine_rank * prompts_per_engine
    ids = stream.take(cfg.prompts_per_step)[first_prompt : first_prompt + prompts_per_engine]
    prompts = [task.train_prompts[i] for i in ids]
    with runtime.timed(times, "generate"):  # 2. (with --tool, calling tools along the way)
        samples = tool_calls.generate(
            engine,
            prompts,
            n=G,
            max_tokens=[response_limit(cfg, p) for p in prompts],
            tools=task.tools,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            progress=runtime.bars(cfg),
            min_tokens=cfg.min_new_tokens,
            seed=seed,
            first_index=first_prompt,  # the prompts' place in the step: their streams
        )
    with runtime.timed(times, "score"):  # 3. one engine's ranks: its first rank's rewards
        rewards = distributed.from_engine_leader(score(task, ids, samples, G), tp)  # [len(ids), G]
    return [(i, samples[g * G : (g + 1) * G], rewards[g]) for g, i in enumerate(ids)]


def score(task: data.Task, ids: list[int], samples: list[rollout.Sample], G: int) -> torch.Tensor:
    """Step 3: each response's reward against its problem's gold answer, [P, G] for G samples of P
    prompts.

    Example (sum3, G = 2): problems 3+9+4= and 1+2+3=, responses "16", "12" and "6", "6" -> [[1.,
    0.], [1., 1.]]. With --tool the reward reads what the model wrote, not the tools' outputs
    (tool_calls.model_text)."""
    return torch.tensor(
        [task.reward_fn(task.text(s), task.train[ids[s.prompt_idx]].answer) for s in samples]
    ).view(len(ids), G)


def response_limit(cfg: Config, prompt: list[int]) -> int:
    """A response's length limit: what its prompt leaves of --max-seq-len, at most --max-new-tokens
    (NeMo-RL caps each request at the engine's max_model_len minus its prompt's length)."""
    return min(cfg.max_new_tokens, cfg.max_seq_len - len(prompt))


# ----------------------------------------------------------------------------------------------
# Step 4: advantages


def advantages(
    rewards: torch.Tensor, cfg: Config, samples=(), prompts=(), shape: bool = True
) -> torch.Tensor:
    """Step 4: each sample's advantage [P, G] from its group's rewards [P, G] (grpo.py); with
    --adv-scale batch, scaled by the sample std of every reward of the step over all ranks. With
    --overlong-buffer-length each reward first gets DAPO's overlong punishment for its sample's
    length (overlong_shaping; samples: [P * G], prompt-major, of `prompts`), unless `shape` is off
    (a group dynamic sampling rejected: Groups.fallback); dynamic sampling judged the rewards
    before it, as NeMo-RL's does. --adv-estimator grpo_passk: verl's pass@k advantages."""
    if cfg.overlong_buffer_length and shape:
        rewards = rewards + overlong_shaping(cfg, prompts, samples).view_as(rewards)
    if cfg.loss.adv_estimator == "grpo_passk":
        return grpo.passk_advantages(rewards, cfg.loss.adv_scale)
    std = None
    if cfg.loss.adv_scale == "batch":
        r = rewards.double().flatten()
        n_rewards, s1, s2 = distributed.all_reduce_sum(
            torch.stack(
                [torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), (r * r).sum()]
            )
        ).tolist()
        std = max((s2 - s1 * s1 / n_rewards) / max(n_rewards - 1, 1), 0.0) ** 0.5
    return grpo.group_advantages(rewards, cfg.loss.leave_one_out, cfg.loss.adv_scale, batch_std=std)


def overlong_shaping(cfg: Config, prompts: list[list[int]], samples) -> torch.Tensor:
    """[len(samples)] DAPO's overlong punishment of each sample (reward.overlong_penalty), measured
    from the response's own limit, response_limit(): what its prompt leaves of --max-seq-len, at
    most --max-new-tokens. A response cut off at its limit loses --overlong-buffer-penalty whatever
    its prompt's length, as in DAPO, verl and NeMo-RL (measured from --max-new-tokens, a response of
    a long prompt would stop before the buffer and escape the penalty). A limit shorter than the
    buffer is all buffer. With --tool it counts the sampled tokens, against the limit less the
    tools' tokens (a response cut off at its limit still loses the whole penalty).

    Example (--max-seq-len 12, --max-new-tokens 8, buffer 4): prompts of 2 and 6 tokens, responses
    of 8 and 6 tokens, each at its limit -> [-1., -1.]."""
    out = []
    for s in samples:
        tool = tool_calls.tool_tokens(s)
        cap = response_limit(cfg, prompts[s.prompt_idx]) - tool
        buffer = min(cfg.overlong_buffer_length, cap)
        out.append(
            reward.overlong_penalty(
                len(s.token_ids) - tool, cap, buffer, cfg.overlong_buffer_penalty
            )
        )
    return torch.tensor(out, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Steps 5-6: the update


def logprobs(
    m, mb: Batch, cfg: Config, device, grad: bool, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi of mb's response tokens at the sampling temperature, [B, T] for its B rows, and with
    grad or `entropy` the policy's entropy there (else zeros), under the run's precision policy
    (runtime.autocast)."""
    with torch.set_grad_enabled(grad), runtime.autocast(cfg.run, device):
        return m(
            mb.input_ids, mb.attention_mask, mb.resp_start, mb.T, cfg.temperature,
            cfg.run.logprob_chunk_tokens, with_entropy=grad or entropy, packs=mb.packs,
        )  # fmt: skip


def micro_batches_of(m, b: Batch, rows: list[int], cfg: Config, skip: bool) -> list[Batch]:
    """The micro-batches of a pass of `m` over `rows` (batch.plan_micro_batches): with `skip` and
    --skip-zero-advantage, only the rows whose loss term can be non-zero (all that have loss tokens
    while a term that does not vanish with the advantage is on: has_advantage_free_term); packed by
    prompt with --share-prompt where the model allows it."""
    pack = cfg.share_prompt and m.packable
    skip = skip and cfg.skip_zero_advantage
    return batch.plan_micro_batches(
        b, rows, cfg.run.micro_batch_tokens, pack, skip, has_advantage_free_term(cfg)
    )


def has_advantage_free_term(cfg: Config) -> bool:
    """Whether the loss has a term that does not vanish with the advantage: the KL term, the entropy
    bonus, KL-Cov's penalty. Clip-Cov's loss is PPO's with some tokens' terms zeroed, A times
    something finite: a row of A = 0 adds 0 and is skipped in the update (its tokens still count
    in the covariance: old_logprobs' pass runs every row)."""
    return cfg.loss.kl_beta > 0 or cfg.loss.entropy_coeff != 0 or cfg.loss.pg == "kl_cov"


def n_minibatches(cfg: Config) -> int:
    """Optimizer steps per GRPO step: the step's P * G samples over --minibatch-size (0: one)."""
    return cfg.prompts_per_step * cfg.group_size // cfg.minibatch_size if cfg.minibatch_size else 1


def old_logprobs(
    policy, ref, b: Batch, cfg: Config, device, first_group: int = 0, step: int = 0
) -> Batch:
    """Step 5: b with the trainer's logprobs of the sampled tokens before the update (old_logp, [N,
    T]) and the frozen start model's (ref_logp, [N, T], for the KL term), each a no-grad pass over
    token-budget micro-batches. With LoRA `ref` is the policy itself with its adapters switched off:
    the base, which is the start model. With --top-entropy-quantile < 1 the policy's pass also
    gives the old entropy, and b.high_entropy_mask marks each minibatch's high-entropy tokens
    (token_picks.high_entropy; first_group: Groups.first_group). With --pg clip_cov or kl_cov it
    gives the logprobs b.covariance_mask is chosen by (token_picks.covariance_picks: the tokens
    Clip-Cov clips or KL-Cov penalizes; Clip-Cov draws from a stream of the step's own). Both
    choose among every loss token, A = 0 or not, so this pass runs every row with loss tokens.

    With one minibatch old_logp stays None and costs no pass: the policy has not moved before its
    only update, so the update's own forward, detached, gives the old logprobs (update_policy); the
    logged loss is then near 0 (ratio 1, advantages centred) while its gradient is not. ref_logp is
    None without a reference model. Rows the update skips get no old logprobs (0).
    """

    def pass_over(m, skip: bool, entropy=False) -> torch.Tensor:  # [2, N, T]: logp, entropy
        out = b.gen_logp.new_zeros(2, *b.gen_logp.shape)  # 0 in rows not passed over
        for mb in micro_batches_of(m, b, b.rows, cfg, skip):
            lp, en = logprobs(m, mb.to(device), cfg, device, grad=False, entropy=entropy)
            out[:, mb.rows, : mb.T] = torch.stack([lp, en]).cpu()
        return out

    minibatch_count = n_minibatches(cfg)
    entropy_on = cfg.loss.top_entropy_quantile < 1  # b.high_entropy_mask
    cov_on = cfg.loss.pg in grpo.COVARIANCE  # b.covariance_mask
    # skipped rows get no old logprobs (0), unless the quantile or the covariance counts them
    need_pass = minibatch_count > 1 or entropy_on or cov_on
    old = (
        pass_over(policy, skip=not (entropy_on or cov_on), entropy=entropy_on)
        if need_pass
        else None
    )
    # the knobs pick their tokens over each whole minibatch, on every rank (token_picks.py)
    mbs = batch.minibatches(len(b.rows), minibatch_count, cfg.group_size, first_group)
    seed = hash((cfg.run.seed, step)) % 2**31  # Clip-Cov's draw: one stream per step
    q = cfg.loss.top_entropy_quantile
    b = replace(
        b,
        old_logp=old[0] if minibatch_count > 1 else None,
        high_entropy_mask=token_picks.high_entropy(b, old[1], q, mbs) if entropy_on else None,
        covariance_mask=(
            token_picks.covariance_picks(b, old[0], cfg.loss, mbs, seed) if cov_on else None
        ),
    )
    if ref is None:
        return b
    with lora.adapters_off(ref.lm):  # a no-op for a frozen copy, which has no adapters
        return replace(b, ref_logp=pass_over(ref, skip=False)[0])


@dataclass
class Update:
    """What step 6 reports: this rank's sums over its micro-batches (logs.step_metrics sums them
    over ranks)."""

    loss: grpo.LossMetrics = field(default_factory=grpo.LossMetrics)  # the loss and its diagnostics
    # engine vs trainer before the update
    mismatch: grpo.Mismatch = field(default_factory=grpo.Mismatch)
    # the policy's entropy, summed over the response tokens of the rows the update computed
    entropy: float = 0.0
    seqs: int = 0  # rows the update computed (the others had advantage 0: batch.trained_rows)
    resp_tokens: float = 0.0  # their response tokens (entropy and mismatch cover these)
    grad_norm: float = 0.0  # of the last minibatch, before clipping
    skipped: int = 0  # minibatch updates skipped for a non-finite loss or gradient


def update_policy(
    policy, opt, sched, b: Batch, cfg: Config, device, first_group: int = 0
) -> Update:
    """Step 6: per minibatch, its normalizer, then per micro-batch logprobs -> loss -> backward;
    then clip and one AdamW step; then one step of the LR schedule. Every loss is divided by the
    minibatch's global normalizer, so FSDP's gradient reduction sums to the global batch's gradient
    at any world size. first_group: the step-wide index of b's first group (Groups.first_group)."""
    policy.train()
    upd = Update()
    minibatch_count = n_minibatches(cfg)
    for rows in batch.minibatches(len(b.rows), minibatch_count, cfg.group_size, first_group):
        norm = normalizer(b, rows, cfg.loss.token_level)  # over all the minibatch's rows
        # a minibatch with nothing to train on anywhere still steps AdamW (its moments and weight
        # decay move the weights on a zero gradient): one FSDP placeholder pass gives every rank
        # that zero
        micro = micro_batches_of(policy, b, rows, cfg, skip=True) or [b.fsdp_placeholder()]
        for k, mb in enumerate(micro):
            mb = mb.to(device)
            logp, entropy = logprobs(policy, mb, cfg, device, grad=True)  # [B, T] each
            old = logp.detach() if mb.old_logp is None else mb.old_logp  # None: one minibatch
            loss, metrics = grpo.policy_loss(
                logp, old, mb.advantages, mb.loss_mask, cfg.loss, norm, mb.ref_logp, mb.gen_logp,
                entropy, mb.high_entropy_mask, mb.covariance_mask,
            )  # fmt: skip
            with distributed.gradient_sync(policy, k == len(micro) - 1):  # once per minibatch
                (loss * distributed.loss_scale()).backward()
            record(upd, mb, metrics, old, entropy)
        upd.grad_norm, skipped = runtime.optimizer_step(policy, opt, cfg.run.grad_clip)
        upd.skipped += skipped
    if (
        upd.skipped < minibatch_count
    ):  # the LR schedule counts GRPO steps, as NeMo-RL's (not all-skipped ones)
        sched.step()
    policy.eval()
    # the clip fractions' denominator: every loss token, the skipped rows' too (A = 0 clips nothing)
    upd.loss.tokens = float(b.loss_mask.sum())
    return upd


def normalizer(b: Batch, rows: list[int], token_level: bool) -> float:
    """The minibatch's loss normalizer over every rank: its loss tokens (token level) or its
    sequences that have any (sequence level), so that the gradient does not depend on world size or
    micro-batching. A collective."""
    counts = torch.tensor(
        [b.loss_mask[rows].sum().item(), float((b.loss_mask[rows].sum(1) > 0).sum())]
    )
    distributed.all_reduce_sum(counts)
    return max(float(counts[0] if token_level else counts[1]), 1.0)


def record(upd: Update, mb: Batch, metrics: grpo.LossMetrics, old, entropy) -> None:
    """Adds one micro-batch's loss metrics, engine/trainer mismatch and entropy to upd."""
    runtime.accumulate(upd.loss, metrics)
    runtime.accumulate(upd.mismatch, grpo.mismatch_metrics(mb.gen_logp, old, mb.resp_mask))
    upd.entropy += float((entropy.detach() * mb.resp_mask).sum())
    upd.seqs += len(mb.rows)
    upd.resp_tokens += float(mb.resp_mask.sum())


# ----------------------------------------------------------------------------------------------
# Around the steps: held-out evaluation, the command line


def evaluate(engine: rollout.Engine, task: data.Task, cfg: Config, step: int) -> dict:
    """Held-out pass@1 and greedy accuracy (eval_aime.heldout_accuracy) of the engine's current
    weights; with --reward FILE:FUNCTION also heldout_reward_errors, the held-out samples it failed
    on (scored 0)."""
    figures = eval_aime.heldout_accuracy(
        engine,
        task.tok,
        task.heldout_prompts,
        [p.answer for p in task.heldout],
        task.reward_fn,
        cfg.run.eval_samples,
        [response_limit(cfg, p) for p in task.heldout_prompts],
        cfg.temperature,
        cfg.run.seed + step,  # fresh samples at every evaluation, the same ones at any world size
        cfg.tensor_parallel_size,
        runtime.bars(cfg),
        task.tools,
    )
    if cfg.reward:
        failed = torch.tensor([float(task.reward_failures())])
        figures["heldout_reward_errors"] = int(distributed.all_reduce_sum(failed).item())
    return figures


def main(argv: list[str]) -> None:
    checks.one_line_errors(
        lambda: export_hf(argv, "train.py") if argv[:1] == ["export"] else train(parse_args(argv))
    )


if __name__ == "__main__":
    main(sys.argv[1:])
