"""GRPO training: the config, DeepScaleR's stage presets, and the loop. `python train.py` runs the
CPU demo; `--help` lists every flag; `python train.py export CKPT OUT` writes a saved step as an HF
folder.

One GRPO step, as train() runs it (each a line of its loop, in this order):
    1. take the step's P prompts; each engine its share      collect_groups -> data.PromptStream
    2. generate G responses per prompt, with their logprobs  collect_groups -> rollout.py
    3. score each response: 1 or 0                           collect_groups -> score -> reward.py
       (1-3 once, or more rounds with --dynamic-sampling)
    4. advantages from each group's rewards                  grpo.group_advantages, make_batch
    5. the trainer's old (and reference) logprobs            old_logprobs
    6. per minibatch: loss -> backward over token-budget micro-batches -> clip -> AdamW
                                                             update_policy -> grpo.policy_loss
    7. refit: the engine gets the new weights (LoRA: merged) rollout.Engine.load_weights
    8. metrics reduced over ranks                            step_metrics
    and around them: held-out evaluation, metrics.jsonl, checkpoints and resume (runtime.Run).
Each step writes one JSON line to <out_dir>/metrics.jsonl (logs.py); a run resumes from the newest
readable checkpoint in <out_dir>/checkpoints; the final weights go to <out_dir>/final. Under
torchrun the trainer is sharded with FSDP2 and each engine generates for its share of the prompts
(distributed.py).

What it does not do: anything the files it calls own. The math and the loss's options are in
grpo.py, problems and prompts in data.py (the demo's task in demo/tasks.py), LoRA's adapters in
lora.py, the bookkeeping around the loop (flags every run has, resume, evaluation cadence,
checkpoints, Ctrl-C) in runtime.py, which dpo.py's loop shares.
"""

import functools
import os
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import torch
import tyro

import data
import distributed
import eval_aime
import grpo
import lora
import memory
import model
import reward
import rollout
import runtime
import user_reward
from checkpoint import export_hf
from checks import UserError, check, one_line_errors

# (the field `lora` of Config would hide the module's name in the class body)
from lora import (
    Adapters,
)
from demo import tasks


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
    # sequences, each its longest prompt and --max-new-tokens: kv_cache_gib), so none is preempted
    kv_cache_gib: float = 0.0
    # the task

    # sum3: the synthetic demo task; math: problems from --data, boxed answers
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
    # DAPO: drop groups with all-equal rewards, draw more prompts to refill the batch
    dynamic_sampling: bool = False
    # generation rounds per step before training on what was kept
    dynamic_sampling_max_tries: int = 4
    # samples whose advantage is exactly 0 (a group whose rewards are all equal) run no forward or
    # backward in the update: their loss and gradient are exactly 0, so the weights after the step
    # are the same, in less time (the loss's normalizers still count them); off: computed anyway.
    # Only while --kl-beta is 0: the KL term does not vanish with the advantage
    skip_zero_advantage: bool = True
    # a group's samples share their prompt's tokens: the trainer's forward and backward compute
    # them once per pack of samples (one row: the prompt, then each response seeing only the
    # prompt and itself; model.pack_rows), not once per sample; the same logprobs and gradient in
    # fewer tokens. Packs stay within --micro-batch-tokens. Off: one row per sample
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
    overrides them."""
    stage = 0
    for i, a in enumerate(argv):
        value = (
            a.split("=", 1)[1]
            if a.startswith("--stage=")
            else argv[i + 1]
            if a == "--stage" and i + 1 < len(argv)
            else None
        )
        if value is not None:
            check(
                [
                    (
                        value in ("0", "1", "2", "3", "4"),
                        f"--stage {value}: unknown stage (use 1, 2, 3, or 4 for GSPO)",
                    )
                ]
            )
            stage = int(value)
    default = runtime.config(Config, stage=stage, **STAGES[stage]) if stage else Config()
    return tyro.cli(Config, default=default, args=argv, config=(tyro.conf.OmitArgPrefixes,))


# ----------------------------------------------------------------------------------------------
# The loop


def train(cfg: Config, engine: rollout.Engine | None = None) -> dict:
    """Run GRPO; `engine` lets a caller (the tests, tools/bench.py) bring an engine that already
    holds the base model."""
    rank, world = distributed.init(cfg.run.dist_timeout_s)
    validate(cfg, world)  # bad flags stop the run here, before any model or engine loads
    check_memory(cfg, world)  # so does a run that cannot fit in this machine's memory
    device, bf16 = runtime.setup_process(cfg.run)
    task = load_task(cfg)  # and bad data here
    policy, ref = load_policy_and_ref(cfg, task.path, device)
    dtype = torch.bfloat16 if bf16 else torch.float32  # the engine's weights
    own_engine = engine is None  # an engine the caller brought is the caller's to close
    engine = engine or make_engine(cfg, task, dtype, device)
    opt, sched = runtime.optimizer(policy, cfg.run)
    stream = data.PromptStream(len(task.train), cfg.run.seed)
    # the run folder, metrics.jsonl, Ctrl-C (only a command-line run owns the process's Ctrl-C)
    run = runtime.Run(cfg, "GRPO", SHOW, sigint=__name__ == "__main__")
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
        std = batch_std(groups.rewards, cfg)  # --adv-scale batch: the std over every rank's rewards
        adv = grpo.group_advantages(
            groups.rewards, cfg.loss.leave_one_out, cfg.loss.adv_scale, batch_std=std
        )
        batch = make_batch(groups.prompts, groups.samples, adv.flatten(), cfg.overlong_filter, pad)
        with runtime.timed(times, "logprobs"):  # 5. old (and reference) logprobs
            batch = old_logprobs(policy, ref, batch, cfg, device)
        with runtime.timed(times, "update"):  # 6. loss -> backward -> clip -> AdamW, per minibatch
            upd = update_policy(policy, opt, sched, batch, cfg, device, groups.first_group)
        peak_gib = runtime.peak_memory_gib(device, engine.device_bytes)
        with runtime.timed(times, "refit"):  # 7. the engine samples the next step from these
            engine.load_weights(model.hf_weights(policy.lm, dtype))
        row = step_metrics(step, groups, batch, adv, upd, sched, times, peak_gib)  # 8. metrics
        if run.eval_due(step):  # held-out pass@1 every --eval-every steps and at the last
            row |= evaluate(engine, task, cfg, step)
        run.log(step, row)  # metrics.jsonl and the progress bar
        stop = run.interrupted()  # Ctrl-C on any rank: a checkpoint, then the loop ends
        if stop or run.checkpoint_due(step):  # every --checkpoint-every steps and at the last
            run.save(step, policy, opt, sched, stream)
    return run.finish(policy, task.tok, engine if own_engine else None)


# the progress bar's figures
SHOW = dict(reward="reward_mean", heldout="heldout_pass1", mpe="token_mult_prob_error")


def load_policy_and_ref(cfg: Config, path: str, device):
    """The trainable policy (sharded under torchrun; with LoRA, adapters on the frozen base) and
    the frozen start model for the KL term: None when the term is off, and with LoRA the policy
    itself (its adapters switched off)."""
    ckpt, remote = cfg.run.activation_checkpointing, cfg.run.trust_remote_code
    bf16_params = runtime.fsdp_bf16(cfg.run, device)  # else autocast's bf16, or float32
    policy = model.load_trainable(
        path, device, ckpt, remote, adapters=cfg.lora, bf16_params=bf16_params
    )
    if cfg.loss.kl_beta == 0:
        return policy, None
    if cfg.skip_zero_advantage:  # trained_rows
        distributed.print0(
            f"--kl-beta {cfg.loss.kl_beta}: every sample with loss tokens runs forward and "
            "backward in the update (the KL term does not vanish with the advantage)"
        )
    if cfg.lora.on:
        return policy, policy
    ref = model.load_trainable(path, device, False, remote, bf16_params=bf16_params)
    return policy, ref.eval().requires_grad_(False)


def evaluate(engine: rollout.Engine, task: "Task", cfg: Config, step: int) -> dict:
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
        [budget(cfg, p) for p in task.heldout_prompts],
        cfg.temperature,
        cfg.run.seed + step,  # fresh samples at every evaluation, the same ones at any world size
        cfg.tensor_parallel_size,
        _bars(cfg),
    )
    if isinstance(task.reward_fn, user_reward.Guarded):
        failed = torch.tensor([float(task.reward_fn.take_failures())])
        figures["heldout_reward_errors"] = int(distributed.all_reduce_sum(failed).item())
    return figures


# ----------------------------------------------------------------------------------------------
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
    first_group: (
        int  # the step-wide index of this rank's first group (minibatches are made of whole groups)
    )
    reward_errors: int  # this step's samples a --reward FILE:FUNCTION failed on (scored 0)


def collect_groups(
    engine, task: "Task", stream: data.PromptStream, cfg: Config, step: int, times: dict
) -> Groups:
    """Steps 1-3: the step's prompts -> G responses to each -> a reward for each, this rank's share.

    Example, the demo (P = 32, G = 8, one rank): the stream gives 32 indices into the training set;
    the engine answers each prompt 8 times ("3+9+4=" -> "16", "12", "16", ...) and each answer is
    scored against the gold one:
      Groups(prompts=[32 prompts' token ids], samples=[256 samples, prompt-major],
             rewards=[[1., 0., 1., ...], ...] (a [32, 8] tensor), drawn=32, zero_variance=5,
             rounds=1, first_group=0)

    Each engine takes its share of the step's prompts (rollout_round) and a prompt's G samples stay
    on one rank; the ranks of a tensor-parallel engine send it identical requests, take the
    rewards its first rank computed, then each keeps its part of the groups. With dynamic sampling
    (DAPO), groups whose rewards are all equal are dropped and more rounds drawn until every engine
    has its share of informative groups or the tries run out; all ranks make the same number of
    rounds. A rank whose part is empty trains nothing this step (FSDP's stand-ins keep it in step),
    except that an engine that kept nothing gives its first rank one uniform group (advantage 0),
    so that every step has rows to measure.
    """
    world, tp, G = distributed.world_size(), cfg.tensor_parallel_size, cfg.group_size
    share, per_rank = cfg.prompts_per_step // (world // tp), cfg.prompts_per_step // world
    kept, drawn, zero_variance, rounds = [], 0, 0, 0
    while True:
        # a seed per step and round: fresh samples, the same at any world size (rollout_round gives
        # each prompt its own stream, seeded by its place in the step)
        groups = rollout_round(
            engine, task, stream, cfg, hash((cfg.run.seed, step, rounds)) % 2**31, times
        )
        rounds, drawn = rounds + 1, drawn + len(groups)
        zero_variance += sum(int(rewards.std() == 0) for _, _, rewards in groups)
        kept += [g for g in groups if not cfg.dynamic_sampling or g[2].std() > 0][
            : share - len(kept)
        ]
        if not cfg.dynamic_sampling or rounds >= cfg.dynamic_sampling_max_tries:
            break
        # every engine is full
        if distributed.all_reduce_sum(torch.tensor([float(len(kept) < share)])).item() == 0:
            break
    tp_rank = distributed.rank() % tp
    # fewer than per_rank, or none, when dynamic sampling ran short: no group trains twice
    mine = kept[tp_rank * per_rank : (tp_rank + 1) * per_rank]
    if not kept and tp_rank == 0:  # nothing informative: the last round's groups are all uniform
        mine = groups[:1]
    errors = (
        task.reward_fn.take_failures() if isinstance(task.reward_fn, user_reward.Guarded) else 0
    )
    return Groups(
        prompts=[task.train_prompts[i] for i, _, _ in mine],
        samples=[
            replace(s, prompt_idx=k) for k, (_, samples, _) in enumerate(mine) for s in samples
        ],
        rewards=torch.stack([rewards for _, _, rewards in mine]) if mine else torch.zeros(0, G),
        # an engine's figures once, not once per tensor-parallel rank
        drawn=drawn if tp_rank == 0 else 0,
        zero_variance=zero_variance if tp_rank == 0 else 0,
        rounds=rounds,
        first_group=distributed.rank() * per_rank,
        reward_errors=errors if tp_rank == 0 else 0,
    )


def rollout_round(
    engine, task: "Task", stream: data.PromptStream, cfg: Config, seed: int, times: dict
) -> list[tuple[int, list[rollout.Sample], torch.Tensor]]:
    """Steps 1-3 once: this engine's share of P new prompts, G responses to each, their rewards, as
    [(the prompt's index in the training set, its G samples, their rewards [G]), ...]."""
    tp, G = cfg.tensor_parallel_size, cfg.group_size
    engine_rank, share = (
        distributed.rank() // tp,
        cfg.prompts_per_step // (distributed.world_size() // tp),
    )
    # 1. every rank draws the whole step's prompts, so that all streams stay in step, and keeps its
    # engine's share
    ids = stream.take(cfg.prompts_per_step)[engine_rank * share : (engine_rank + 1) * share]
    prompts = [task.train_prompts[i] for i in ids]
    with runtime.timed(times, "generate"):  # 2.
        samples = engine.generate(
            prompts,
            n=G,
            max_tokens=[budget(cfg, p) for p in prompts],
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            progress=_bars(cfg),
            min_tokens=cfg.min_new_tokens,
            seed=seed,
            first_index=engine_rank * share,  # the prompts' place in the step: their streams
        )
    with runtime.timed(times, "score"):  # 3. one engine's ranks: its first rank's rewards
        rewards = distributed.from_block_head(score(task, ids, samples, G), tp)  # [len(ids), G]
    return [(i, samples[g * G : (g + 1) * G], rewards[g]) for g, i in enumerate(ids)]


def score(task: "Task", ids: list[int], samples: list[rollout.Sample], G: int) -> torch.Tensor:
    """Step 3: each response's reward against its problem's gold answer, [P, G] for G samples of P
    prompts.

    Example (sum3, G = 2): problems 3+9+4= and 1+2+3=, responses "16", "12" and "6", "6" -> [[1.,
    0.], [1., 1.]]."""
    return torch.tensor(
        [
            task.reward_fn(
                task.tok.decode(s.token_ids, skip_special_tokens=True),
                task.train[ids[s.prompt_idx]].answer,
            )
            for s in samples
        ]
    ).view(len(ids), G)


def budget(cfg: Config, prompt: list[int]) -> int:
    """A response's length limit: what its prompt leaves of --max-seq-len, at most --max-new-tokens
    (NeMo-RL caps each request at the engine's max_model_len minus its prompt's length)."""
    return min(cfg.max_new_tokens, cfg.max_seq_len - len(prompt))


def batch_std(rewards: torch.Tensor, cfg: Config) -> float | None:
    """The sample std of every reward of the step over all ranks, for --adv-scale batch (else
    None)."""
    if cfg.loss.adv_scale != "batch":
        return None
    r = rewards.double().flatten()
    n, s1, s2 = distributed.all_reduce_sum(
        torch.stack([torch.tensor(float(r.numel()), dtype=torch.float64), r.sum(), (r * r).sum()])
    ).tolist()
    return max((s2 - s1 * s1 / n) / max(n - 1, 1), 0.0) ** 0.5


# ----------------------------------------------------------------------------------------------
# The batch the trainer sees


@dataclass
class Batch:
    """Rows of samples as right-padded tensors: the step's batch (make_batch), or some of its rows
    (select), on their way to the device (to). Step 5 adds the trainer's logprobs before the update
    (old_logprobs)."""

    input_ids: torch.Tensor  # [N, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [N, L]
    resp_start: torch.Tensor  # [N] first response position
    resp_mask: torch.Tensor  # [N, T] 1 on response tokens
    gen_logp: torch.Tensor  # [N, T] the engine's logprobs of the response tokens
    advantages: torch.Tensor  # [N]
    loss_mask: torch.Tensor  # [N, T] resp_mask, minus overlong-filtered responses
    truncated: torch.Tensor  # [N] bool: the response hit its length limit
    lengths: list[int]  # prompt + response length of each row
    rows: list[int]  # these rows' indices in the step's batch
    # [N, T] the trainer's, before the update (None: the update's own forward)
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  # [N, T] the frozen start model's (--kl-beta > 0)
    # rows (by place) that share a prompt, each pack one row of the forward (micro_batches)
    packs: list[list[int]] | None = None

    @property
    def T(self) -> int:  # the longest response of these rows
        return self.resp_mask.shape[1]

    def select(self, rows: list[int]) -> "Batch":
        """These rows, trimmed to their own longest sequence and response."""
        idx = torch.tensor(rows)
        L = max(self.lengths[r] for r in rows)
        T = int(self.resp_mask[idx].sum(1).max().clamp(min=1))
        cut = lambda t: None if t is None else t[idx, :T]  # noqa: E731
        return Batch(
            self.input_ids[idx, :L],
            self.attention_mask[idx, :L],
            self.resp_start[idx],
            cut(self.resp_mask),
            cut(self.gen_logp),
            self.advantages[idx],
            cut(self.loss_mask),
            self.truncated[idx],
            [self.lengths[r] for r in rows],
            list(rows),
            cut(self.old_logp),
            cut(self.ref_logp),
        )

    def stand_in(self) -> "Batch":
        """FSDP's stand-in for a micro-batch this rank lacks (micro_batches): one row of two tokens,
        a prompt token and a response token (so every parameter takes part, as FSDP's gradient
        reduction needs), whose masks and advantage are 0, so its loss, gradient and metrics are 0;
        it costs two tokens, whatever the batch's rows."""

        def zeros(t, *shape):
            return None if t is None else torch.zeros(*shape, dtype=t.dtype)

        return Batch(
            torch.zeros(1, 2, dtype=torch.long),
            torch.ones(1, 2, dtype=torch.long),
            torch.tensor([1]),
            zeros(self.resp_mask, 1, 1),
            zeros(self.gen_logp, 1, 1),
            zeros(self.advantages, 1),
            zeros(self.loss_mask, 1, 1),
            torch.zeros(1, dtype=torch.bool),
            [2],
            [],
            zeros(self.old_logp, 1, 1),
            zeros(self.ref_logp, 1, 1),
        )

    def to(self, device) -> "Batch":
        """The same rows with every tensor on `device`."""
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


def make_batch(
    prompts: list[list[int]],
    samples: list[rollout.Sample],
    advantages: torch.Tensor,
    overlong_filter: bool,
    pad_id: int,
) -> Batch:
    """The step's samples as the trainer's tensors: each sample's prompt + response one right-padded
    row.

    Example (pad_id 0): prompts [[1, 7]], two samples of prompt 0, [5, 2] (ending in EOS 2) and [6]
    (cut at its limit), advantages [1., -1.] ->
      input_ids  [[1, 7, 5, 2], [1, 7, 6, 0]]      attention_mask [[1, 1, 1, 1], [1, 1, 1, 0]]
      resp_start [2, 2]                            resp_mask      [[1., 1.], [1., 0.]]
      gen_logp   each sample's logprobs, 0 past its end
      loss_mask  resp_mask; with overlong_filter [[1., 1.], [0., 0.]]: the cut response leaves
                 the loss
      truncated  [False, True], lengths [4, 3], rows [0, 1]
    """
    N = len(samples)  # 0 on a rank with no group this step (collect_groups)
    seqs = [prompts[s.prompt_idx] + s.token_ids for s in samples]
    L = max((len(s) for s in seqs), default=1)
    T = max((len(s.token_ids) for s in samples), default=1) or 1
    ids = torch.full((N, L), pad_id, dtype=torch.long)
    am = torch.zeros(N, L, dtype=torch.long)
    resp_mask = torch.zeros(N, T)
    gen_logp = torch.zeros(N, T)
    for i, (seq, s) in enumerate(zip(seqs, samples)):
        ids[i, : len(seq)] = torch.tensor(seq)
        am[i, : len(seq)] = 1
        resp_mask[i, : len(s.token_ids)] = 1
        gen_logp[i, : len(s.token_ids)] = torch.tensor(s.logprobs)
    start = torch.tensor([len(prompts[s.prompt_idx]) for s in samples], dtype=torch.long)
    truncated = torch.tensor([s.truncated for s in samples], dtype=torch.bool)
    loss_mask = resp_mask * (~truncated).float()[:, None] if overlong_filter else resp_mask
    return Batch(
        ids,
        am,
        start,
        resp_mask,
        gen_logp,
        advantages,
        loss_mask,
        truncated,
        [len(s) for s in seqs],
        list(range(N)),
    )


def micro_batches(b: Batch, rows: list[int], token_budget: int, share: bool) -> list[Batch]:
    """`rows` of b in micro-batches whose padded tokens stay within the budget
    (distributed.micro_batches: longest first), each trimmed to its own rows, and as many on every
    rank: a rank with fewer runs b.stand_in() in place of each it lacks (FSDP's collectives need the
    same passes on every rank). A collective. `share`: rows that share a prompt go in packs of at
    most the budget's tokens (model.prompt_packs), each a row of the forward counted as its prompt
    plus its responses; a micro-batch holds whole packs (Batch.packs)."""
    units, cost = [[r] for r in rows], [b.lengths[r] for r in rows]
    if share:
        prompts = [tuple(b.input_ids[r, : b.resp_start[r]].tolist()) for r in rows]
        resp = [b.lengths[r] - int(b.resp_start[r]) for r in rows]
        packs = model.prompt_packs(prompts, resp, token_budget)
        units = [[rows[i] for i in p] for p in packs]
        cost = [len(prompts[p[0]]) + sum(resp[i] for i in p) for p in packs]
    out = []
    for us in distributed.micro_batches(cost, list(range(len(units))), token_budget):
        mb = b.select([r for u in us for r in units[u]]) if us else b.stand_in()
        if share and us:  # each pack's rows by their place in mb
            at = iter(range(len(mb.rows)))
            mb = replace(mb, packs=[[next(at) for _ in units[u]] for u in us])
        out.append(mb)
    return out


def shares(m, cfg: Config) -> bool:
    """Whether a group's samples share their prompt in the forward (--share-prompt, where the
    model's attention allows it: model.can_pack): micro_batches' `share`."""
    return cfg.share_prompt and m.packable


def logprobs(m, mb: Batch, cfg: Config, device, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi of mb's response tokens at the sampling temperature, [n, T], and with grad the
    policy's entropy there (else zeros), under the run's precision policy (runtime.autocast)."""
    with torch.set_grad_enabled(grad), runtime.autocast(cfg.run, device):
        return model.token_logprobs(
            m,
            mb.input_ids,
            mb.attention_mask,
            mb.resp_start,
            mb.T,
            cfg.temperature,
            cfg.run.logprob_chunk_tokens,
            with_entropy=grad,
            packs=mb.packs,
        )


# ----------------------------------------------------------------------------------------------
# Steps 5-6: the update


def n_minibatches(cfg: Config) -> int:
    """Optimizer steps per GRPO step: the step's P * G samples over --minibatch-size (0: one)."""
    return cfg.prompts_per_step * cfg.group_size // cfg.minibatch_size if cfg.minibatch_size else 1


def old_logprobs(policy, ref, b: Batch, cfg: Config, device) -> Batch:
    """Step 5: b with the trainer's logprobs of the sampled tokens before the update (old_logp, [N,
    T]) and the frozen start model's (ref_logp, [N, T], for the KL term), each a no-grad pass over
    token-budget micro-batches. With LoRA `ref` is the policy itself with its adapters switched off:
    the base, which is the start model.

    With one minibatch old_logp stays None and costs no pass: the policy has not moved before its
    only update, so the update's own forward, detached, gives the old logprobs (update_policy); the
    logged loss is then near 0 (ratio 1, advantages centred) while its gradient is not. ref_logp is
    None without a reference model. Rows the update skips (trained_rows) get no old logprobs (0).
    """

    def pass_over(m, rows) -> torch.Tensor:  # [N, T], 0 in rows not passed over
        out = torch.zeros_like(b.gen_logp)
        for mb in micro_batches(b, rows, cfg.run.micro_batch_tokens, shares(m, cfg)):
            out[mb.rows, : mb.T] = logprobs(m, mb.to(device), cfg, device, grad=False)[0].cpu()
        return out

    # only the rows the update will compute (trained_rows)
    old_logp = pass_over(policy, trained_rows(b, b.rows, cfg)) if n_minibatches(cfg) > 1 else None
    if ref is None:
        return replace(b, old_logp=old_logp)
    with lora.adapters_off(ref.lm):  # a no-op for a frozen copy, which has no adapters
        return replace(b, old_logp=old_logp, ref_logp=pass_over(ref, b.rows))


@dataclass
class Update:
    """What step 6 reports: this rank's sums over its micro-batches (step_metrics sums them over
    ranks)."""

    loss: grpo.LossMetrics = field(default_factory=grpo.LossMetrics)  # the loss and its diagnostics
    # engine vs trainer before the update
    mismatch: grpo.Mismatch = field(default_factory=grpo.Mismatch)
    # the policy's entropy, summed over the response tokens of the rows the update computed
    entropy: float = 0.0
    seqs: int = 0  # rows the update computed (the others had advantage 0: trained_rows)
    resp_tokens: float = 0.0  # their response tokens (entropy and mismatch cover these)
    grad_norm: float = 0.0  # of the last minibatch, before clipping
    skipped: int = 0  # minibatch updates skipped for a non-finite loss or gradient


def update_policy(
    policy, opt, sched, b: Batch, cfg: Config, device, first_group: int = 0
) -> Update:
    """Step 6: one AdamW step per minibatch, each over token-budget micro-batches (forward -> loss
    -> backward), then clip and step; then one step of the LR schedule. Every loss is divided by the
    minibatch's global normalizer, so FSDP's gradient reduction sums to the global batch's gradient
    at any world size. first_group: the step-wide index of b's first group (Groups.first_group)."""
    policy.train()
    upd = Update()
    for rows in minibatches(len(b.rows), cfg, first_group):
        norm = normalizer(b, rows, cfg.loss.token_level)  # over all the minibatch's rows
        work = trained_rows(b, rows, cfg)  # those whose loss term can be non-zero
        # a minibatch with nothing to train on anywhere still steps AdamW (its moments and weight
        # decay move the weights on a zero gradient): one stand-in pass gives every rank that zero
        budget, share = cfg.run.micro_batch_tokens, shares(policy, cfg)
        micro = micro_batches(b, work, budget, share) or [b.stand_in()]
        # the skipped rows' loss tokens count where they would have (clip fractions: A = 0 clips
        # nothing)
        upd.loss.tokens += float(b.loss_mask[sorted(set(rows) - set(work))].sum())
        for k, mb in enumerate(micro):
            mb = mb.to(device)
            logp, entropy = logprobs(policy, mb, cfg, device, grad=True)  # [n, T] each
            # None: one minibatch (old_logprobs)
            old = logp.detach() if mb.old_logp is None else mb.old_logp
            loss, metrics = grpo.policy_loss(
                logp, old, mb.advantages, mb.loss_mask, cfg.loss, norm, mb.ref_logp, mb.gen_logp
            )
            # one gradient reduction per minibatch
            with distributed.gradient_sync(policy, k == len(micro) - 1):
                (loss * distributed.loss_scale()).backward()
            runtime.accumulate(upd.loss, metrics)
            runtime.accumulate(upd.mismatch, grpo.mismatch_metrics(mb.gen_logp, old, mb.resp_mask))
            upd.entropy += float((entropy.detach() * mb.resp_mask).sum())
            upd.seqs += len(mb.rows)
            upd.resp_tokens += float(mb.resp_mask.sum())
        upd.grad_norm, skipped = runtime.optimizer_step(policy, opt, cfg.run.grad_clip)
        upd.skipped += skipped
    if upd.skipped < n_minibatches(cfg):
        # the LR schedule counts GRPO steps, as NeMo-RL's (not one whose every update was skipped)
        sched.step()
    policy.eval()
    return upd


def trained_rows(b: Batch, rows: list[int], cfg: Config) -> list[int]:
    """The rows of `rows` whose forward and backward the update runs: all, or with
    --skip-zero-advantage (the default) those whose loss term can be non-zero: the advantage is
    not exactly 0 and some token counts in the loss (--overlong-filter masks out a truncated row).

    Every term of the policy loss (PPO's clipped ratio, GSPO, CISPO, REINFORCE, dual clip, the
    importance weights, which are finite) is A times something finite, and every term, KL's too,
    is multiplied by the loss mask, so such a row adds exactly 0 to the loss and to every gradient;
    the normalizers still count it (normalizer). Left out, it changes when its zeros would have been
    added, nothing else: the weights after the step are those of computing everything, up to float
    rounding from the other rows' new grouping into micro-batches. The KL term does not vanish with
    A, so with --kl-beta > 0 every row with loss tokens runs.
    Example: groups [1, 1, 1, 1] and [1, 0, 0, 1]: only the second group's 4 rows run."""
    if not cfg.skip_zero_advantage:
        return list(rows)
    kl = cfg.loss.kl_beta > 0
    return [r for r in rows if b.loss_mask[r].any() and (kl or b.advantages[r] != 0)]


def minibatches(n_rows: int, cfg: Config, first_group: int) -> list[list[int]]:
    """This rank's rows of each minibatch. Minibatch k holds the groups whose step-wide index j has
    j % n == k: whole groups, and the same minibatches at any world size (a contiguous split per
    rank would mix different groups). Every rank makes the same number of optimizer steps, even with
    an uneven share (dynamic sampling). Example (G = 2, 2 minibatches, 6 rows, first group 0): [[0,
    1, 4, 5], [2, 3]]."""
    n, G = n_minibatches(cfg), cfg.group_size
    return [[r for r in range(n_rows) if (first_group + r // G) % n == k] for k in range(n)]


def normalizer(b: Batch, rows: list[int], token_level: bool) -> float:
    """The minibatch's loss normalizer over every rank: its loss tokens (token level) or its
    sequences that have any (sequence level), so that the gradient does not depend on world size or
    micro-batching. A collective."""
    counts = torch.tensor(
        [b.loss_mask[rows].sum().item(), float((b.loss_mask[rows].sum(1) > 0).sum())]
    )
    distributed.all_reduce_sum(counts)
    return max(float(counts[0] if token_level else counts[1]), 1.0)


# ----------------------------------------------------------------------------------------------
# Step 8: metrics


@dataclass
class StepSums:
    """This rank's sums over one step's groups and update, besides the loss's (step_metrics sums
    them over ranks)."""

    reward: float
    seqs: float
    resp_tokens: float
    truncated: float
    groups: float  # drawn, over every dynamic-sampling round
    zero_var_groups: float
    adv: float
    adv_sq: float
    entropy: float  # the policy's, over the response tokens the update computed
    trained_seqs: float  # rows the update computed (Update.seqs)
    trained_tokens: float  # their response tokens
    reward_errors: float  # samples whose --reward failed (Groups.reward_errors)


def step_metrics(
    step: int,
    groups: Groups,
    b: Batch,
    adv: torch.Tensor,
    upd: Update,
    sched,
    times: dict,
    peak_mem_gib: float,
) -> dict:
    """One metrics.jsonl row: sums over every rank, then the means NeMo-RL logs under the same
    names. peak_mem_gib: the trainer's peak in steps 4-6, the largest over ranks
    (runtime.peak_memory_gib)."""
    a = adv.flatten().double()
    here = StepSums(
        float(groups.rewards.sum()),
        groups.rewards.numel(),
        float(b.resp_mask.sum()),
        float(b.truncated.sum()),
        groups.drawn,
        groups.zero_variance,
        float(a.sum()),
        float((a * a).sum()),
        upd.entropy,
        upd.seqs,
        upd.resp_tokens,
        groups.reward_errors,
    )
    r, m, mm = distributed.sum_over_ranks(here, upd.loss, upd.mismatch)
    n_seq, n_loss_tok = r.seqs, max(m.tokens, 1.0)
    # the entropy and the engine/trainer mismatch come from the update's forward, so they cover the
    # rows it ran (trained_tokens); on a step that ran none nothing measured them: null, not 0
    per_tok = lambda x: x / r.trained_tokens if r.trained_tokens else None  # noqa: E731
    adv_mean = r.adv / n_seq
    return dict(
        step=step,
        reward_mean=r.reward / n_seq,
        response_len_mean=r.resp_tokens / n_seq,
        seqs=int(n_seq),
        loss=m.loss,
        grad_norm=upd.grad_norm,
        clip_frac_low=m.clip_low / n_loss_tok,
        clip_frac_high=m.clip_high / n_loss_tok,
        kl=m.kl / n_loss_tok,
        entropy=per_tok(r.entropy),
        token_mult_prob_error=per_tok(mm.token_mult_prob_error),
        gen_kl_error=per_tok(mm.gen_kl_error),
        policy_kl_error=per_tok(mm.policy_kl_error),
        js_divergence_error=per_tok(mm.js_divergence_error),
        truncated_frac=r.truncated / n_seq,
        is_oob_frac=m.is_oob / m.is_units if m.is_units else None,
        zero_var_group_frac=r.zero_var_groups / r.groups,
        # the step's rows the update computed: all of them, or those with a loss term
        # (trained_rows); entropy, the mismatch metrics and is_oob_frac cover these
        trained_frac=r.trained_seqs / n_seq,
        trained_tokens=int(r.trained_tokens),
        adv_mean=adv_mean,
        skipped_updates=upd.skipped,
        adv_std=max(r.adv_sq / n_seq - adv_mean**2, 0.0) ** 0.5,
        generation_rounds=groups.rounds,
        lr=sched.get_last_lr()[0],
        peak_mem_gib=peak_mem_gib,
        reward_errors=int(r.reward_errors),
        tokens_per_s=r.resp_tokens
        / max(sum(times.values()), 1e-9),  # generated tokens per second of steps 1-7
        **{f"time_{k}": v for k, v in times.items()},
    )


# ----------------------------------------------------------------------------------------------
# Set-up: flags, task, engine


@dataclass
class Task:
    """The run's problems as the loop uses them."""

    path: str  # the start weights (--init-from, or --model resolved)
    tok: object  # the model's tokenizer
    # reward.exact_reward (sum3), reward.math_reward (--answer), or --reward's user_reward.Guarded
    reward_fn: object
    train: list[data.Problem]
    train_prompts: list[list[int]]  # token ids of each training prompt
    heldout: list[data.Problem]  # the first --eval-prompts held-out problems that fit
    heldout_prompts: list[list[int]]

    @property
    def fingerprint(self) -> str:  # what the prompt stream indexes (runtime.Run.resume)
        return data.fingerprint(self.train_prompts, [p.answer for p in self.train])


def load_task(cfg: Config) -> Task:
    """Problems (a bad row raises data.DataError before any model loads), the tokenizer, every
    prompt's token ids."""
    if cfg.task == "sum3":
        train_set, heldout = tasks.sum3_split()
    else:
        train_set = data.load_problems(cfg.run.data, cfg.problem_field, cfg.answer_field)
        if cfg.run.val_data:
            heldout = data.load_problems(cfg.run.val_data, cfg.problem_field, cfg.answer_field)
        else:
            train_set, heldout = data.split(train_set, cfg.run.val_fraction, cfg.run.seed)
    template = data.read_template(cfg.prompt_template)
    path = model_path(cfg)
    tok = model.load_tokenizer(path, cfg.run.trust_remote_code)
    train_set, train_prompts = encode_prompts(cfg, tok, train_set, template, "training")
    heldout, heldout_prompts = encode_prompts(
        cfg, tok, heldout[: cfg.eval_prompts], template, "held-out"
    )
    reward_fn = (
        reward.exact_reward
        if cfg.task == "sum3"
        else functools.partial(reward.math_reward, answer=cfg.answer)
    )
    if cfg.reward:
        reward_fn = user_reward.load(cfg.reward, cfg.reward_timeout_s)
    return Task(path, tok, reward_fn, train_set, train_prompts, heldout, heldout_prompts)


def model_path(cfg: Config) -> str:
    """Where the run's starting weights are: --init-from, else --model (a built-in base is built on
    first use)."""
    return cfg.init_from or model.resolve(cfg.run.model)


def encode_prompts(cfg: Config, tok, problems: list[data.Problem], template: str | None, what: str):
    """Prompt token ids; prompts longer than prompt_limit(cfg) are dropped, counted and reported."""
    limit = prompt_limit(cfg)
    ids = [
        tok(p.prompt)["input_ids"]
        if cfg.task == "sum3"
        else data.math_prompt(tok, p.prompt, template)
        for p in problems
    ]
    keep = [i for i, p in enumerate(ids) if len(p) <= limit]
    if len(keep) < len(ids):
        why = (
            f"--max-prompt-len {limit}"
            if cfg.max_prompt_len
            else f"--max-seq-len {cfg.max_seq_len} - --max-new-tokens {cfg.max_new_tokens}"
        )
        distributed.print0(
            f"dropped {len(ids) - len(keep)} of {len(ids)} {what} prompts "
            f"longer than {limit} tokens ({why})"
        )
    if not keep and problems:
        raise UserError(f"every {what} prompt is longer than {limit} tokens; raise --max-seq-len")
    return [problems[i] for i in keep], [ids[i] for i in keep]


def prompt_limit(cfg: Config) -> int:
    """The longest prompt a run keeps: --max-prompt-len, else what leaves every response its
    --max-new-tokens."""
    return cfg.max_prompt_len or cfg.max_seq_len - cfg.max_new_tokens


def kv_cache_gib(
    cfg: Config, s: memory.Shape, world: int, dtype_bytes: int, seq_len: int = 0
) -> float:
    """--kv-cache-gib, else room for the sequences one engine holds in a step (P / engines x G of
    `seq_len` tokens, default --max-seq-len), each of its tensor-parallel ranks a 1 / TP part of
    the heads."""
    tp = cfg.tensor_parallel_size
    seqs = cfg.prompts_per_step // max(world // tp, 1) * cfg.group_size
    L = seq_len or cfg.max_seq_len
    return cfg.kv_cache_gib or memory.engine_kv_cache_gib(s, seqs, L, dtype_bytes, tp)


def make_engine(cfg: Config, task: Task, dtype: torch.dtype, device) -> rollout.Engine:
    path = task.path
    if cfg.engine == "hf":
        return rollout.HFEngine(
            path, dtype=dtype, trust_remote_code=cfg.run.trust_remote_code, device=device
        )
    tp = cfg.tensor_parallel_size
    kv = {}  # on GPU the KV cache is what --gpu-memory-utilization leaves: no config read for it
    if device.type == "cpu":  # the longest sequence a step can make: its longest prompt, in full
        longest = min(max(map(len, task.train_prompts)) + cfg.max_new_tokens, cfg.max_seq_len)
        shape = memory.Shape.from_config(path, cfg.run.trust_remote_code)
        world = distributed.world_size()
        kv["kv_cache_gib"] = kv_cache_gib(cfg, shape, world, dtype.itemsize, longest)
    return rollout.VLLMEngine(
        path,
        max_model_len=cfg.max_seq_len,
        seed=cfg.run.seed + distributed.rank() // tp,  # each engine its own stream
        dtype=str(dtype).removeprefix("torch."),
        external_launcher=distributed.in_group(),
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=tp,
        trust_remote_code=cfg.run.trust_remote_code,
        **kv,
    )


def _bars(cfg: Config) -> bool:
    """Per-phase progress bars: asked for, on rank 0 only, and not in a quiet run."""
    return cfg.detailed_progress and not cfg.run.quiet and distributed.is_main()


def validate(cfg: Config, world: int) -> None:
    """One clear line for a bad flag, before any model or engine is loaded: GRPO's own flags, the
    loss's (grpo.config_error), and those every run has (runtime.run_checks)."""
    loss_error = grpo.config_error(cfg.loss)
    check(
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
                cfg.minibatch_size == 0
                or (
                    cfg.minibatch_size > 0
                    and cfg.minibatch_size % cfg.group_size == 0
                    and (cfg.prompts_per_step * cfg.group_size) % cfg.minibatch_size == 0
                ),
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
                0 < cfg.max_new_tokens <= cfg.max_seq_len,
                f"--max-new-tokens {cfg.max_new_tokens}: must be positive and at most "
                f"--max-seq-len {cfg.max_seq_len}",
            ),
            (
                0 < prompt_limit(cfg) < cfg.max_seq_len,
                f"--max-prompt-len {cfg.max_prompt_len}: must be positive and below --max-seq-len "
                f"{cfg.max_seq_len}"
                if cfg.max_prompt_len
                else f"--max-new-tokens {cfg.max_new_tokens}: leaves no room for a prompt in "
                f"--max-seq-len {cfg.max_seq_len} (lower it, or set --max-prompt-len: responses "
                "then get what it leaves)",
            ),
            (
                0 < cfg.gpu_memory_utilization < 1,
                f"--gpu-memory-utilization {cfg.gpu_memory_utilization}: "
                "must be a fraction in (0, 1)",
            ),
            (cfg.kv_cache_gib >= 0, f"--kv-cache-gib {cfg.kv_cache_gib}: must be 0 (auto) or more"),
            (  # vLLM reads it with int(): "1.5" would stop the run in vLLM's start-up
                (os.environ.get("VLLM_CPU_KVCACHE_SPACE") or "0").isdigit(),
                f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE')}: vLLM takes "
                "whole GiB (--kv-cache-gib takes fractions)",
            ),
            (
                cfg.tensor_parallel_size >= 1
                and world % cfg.tensor_parallel_size == 0
                and (cfg.engine == "vllm" or cfg.tensor_parallel_size == 1),
                f"--tensor-parallel-size {cfg.tensor_parallel_size}: must divide the {world} ranks "
                "(vLLM engine only)",
            ),
            (
                cfg.temperature > 0,
                f"--temperature {cfg.temperature}: must be positive for GRPO sampling",
            ),
            (not loss_error, loss_error),
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
            *lora.flag_checks(cfg.lora),
            *runtime.run_checks(cfg.run),
        ]
    )
    # peft must be able to put the adapters on the model: read from its config, no weights load
    if cfg.lora.on:
        lora.model_checks(
            cfg.lora,
            model_path(cfg),
            cfg.run.trust_remote_code,
            f"--init-from {cfg.init_from}" if cfg.init_from else f"--model {cfg.run.model}",
        )


def memory_need_gib(
    cfg: Config, s: memory.Shape, world: int, checkpointing: bool, micro_batch_tokens: int
) -> float:
    """memory.py's estimate of one process's peak on CPU for this run, from the shape in the model's
    config.json: the trainer (sharded over `world`), its engine, and one micro-batch of the worst
    case: rows of --max-seq-len (with --share-prompt, packs of a long prompt and full responses,
    whose attention keeps each row's prompt again)."""
    L = cfg.max_seq_len
    seqs = cfg.prompts_per_step // world * cfg.group_size  # this rank's sequences per step
    mb_seqs = cfg.minibatch_size // world if cfg.minibatch_size else seqs
    rows = max(1, min(micro_batch_tokens // L, mb_seqs))
    attention = rows * L
    if cfg.share_prompt:  # a pack of k rows costs P + k R budget tokens; attention keeps k (P + R)
        R = min(cfg.max_new_tokens, L)
        k = min(cfg.group_size, max((micro_batch_tokens - L + R) // max(R, 1), 1))
        attention = rows * L * k * L // (L - R + k * R)
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE")  # vLLM's own setting wins over ours
    kv_gib = (
        float(env) if env else kv_cache_gib(cfg, s, world, 2 if cfg.run.dtype == "bfloat16" else 4)
    )
    kv_gib = kv_gib if cfg.engine == "vllm" else 0.0
    rows_gib = memory.estimate(
        s,
        rows * L,
        ranks=world,
        chunk_tokens=cfg.run.logprob_chunk_tokens,
        checkpointing=checkpointing,
        micro_batches=-(-mb_seqs // rows),
        device="cpu",
        kv_cache_gib=kv_gib,
        lora_rank=cfg.lora.lora_rank,
        reference=cfg.loss.kl_beta > 0,
        seq_len=L,
        attention_tokens=attention,
    )
    if cfg.engine == "hf":  # a float32 copy of the model, and no KV cache reserved
        rows_gib["vLLM's own libraries and buffers (CPU)"] = 0.0
    return memory.totals(rows_gib)["process peak (trainer + engine + libraries)"]


def check_memory(cfg: Config, world: int) -> None:
    """CPU only (and unless --no-memory-check): one line, before any model loads, when memory.py's
    estimate of a process's peak exceeds its share of /proc/meminfo's MemAvailable (the node's ranks
    share it), naming flags that would fit. On GPU the engine's share and the trainer's are set by
    --gpu-memory-utilization and the stage presets (docs/distributed.md)."""
    if not cfg.memory_check or torch.cuda.is_available() or not os.path.exists("/proc/meminfo"):
        return
    with open("/proc/meminfo") as f:
        meminfo = dict(line.split(":", 1) for line in f)
    have = int(meminfo["MemAvailable"].split()[0]) / 2**20 / distributed.local_world_size()
    ckpt, budget = cfg.run.activation_checkpointing, cfg.run.micro_batch_tokens
    # config.json, read once for every try below
    shape = memory.Shape.from_config(model_path(cfg), cfg.run.trust_remote_code)
    need = memory_need_gib(cfg, shape, world, ckpt, budget)
    if need <= have:
        return
    tries = [
        (c, t)
        for c in sorted({ckpt, True})
        for t in sorted({budget, 8192, 4096, 2048, 1024, 512}, reverse=True)
        if t <= budget
    ]
    fits = next(
        ((c, t) for c, t in tries if memory_need_gib(cfg, shape, world, c, t) <= have), None
    )
    if fits is None:
        way = (
            "no --micro-batch-tokens or --activation-checkpointing fits: "
            "fewer --prompts-per-step or more ranks"
        )
    else:
        flags = ["--activation-checkpointing"] * (fits[0] and not ckpt) + [
            f"--micro-batch-tokens {fits[1]}"
        ] * (fits[1] != budget)
        way = f"{' '.join(flags)} would fit ({memory_need_gib(cfg, shape, world, *fits):.1f} GiB)"
    raise UserError(
        f"memory: this run needs about {need:.1f} GiB per process (memory.py) "
        f"and {have:.1f} GiB is available "
        f"to each of this machine's {distributed.local_world_size()} processes; {way}; "
        "--no-memory-check runs anyway"
    )


def main(argv: list[str]) -> None:
    one_line_errors(
        lambda: export_hf(argv, "train.py") if argv[:1] == ["export"] else train(parse_args(argv))
    )


if __name__ == "__main__":
    main(sys.argv[1:])
