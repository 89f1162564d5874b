"""Run under torchrun by tests/test_distributed.py: one job per invocation, results written as
files.

updates OUT CASES  the update job below for each case of CASES, a JSON object {name: [MICRO_TOKENS,
                   MINIBATCHES, LR, OPT, PG, LORA_RANK, MODEL, PRECISION, (EXTRA)]}, in one process
                   group: OUT/NAME.pt. EXTRA, {"rewards": REWARDS, "flags": FLAGS}: as skips'
                   cases take them; and each optimizer step's gradient before it is clipped, summed
                   over micro-batches and ranks: OUT/NAME.pt.grads
update OUT MICRO_TOKENS MINIBATCHES LR OPT [PG [LORA_RANK [MODEL [PRECISION]]]]
                   one GRPO update (OPT adamw, sgd, or train's own: runtime.optimizer, fused AdamW
                   and the LR warm-up; PG ppo, gspo or cispo; LoRA adapters of that
                   rank, the KL reference then the base with adapters off) on a fixed global batch,
                   in float64; rank 0 saves the weights. MODEL: a built-in base (default the tiny
                   one); `smollm2` gets a smaller batch and no KL term (no reference copy), which
                   keeps its float64 ranks within a few GiB. PRECISION: float64, or a bf16 policy
                   over float32 weights (--dtype bfloat16 --mixed-precision autocast or fsdp)
skips  OUT CASES   each case of CASES, {name: [MICRO_TOKENS, MINIBATCHES, LR, OPT, PG, LORA_RANK,
                   REWARDS, FLAGS]}, updated with --skip-zero-advantage and without, no KL term:
                   OUT/NAME.skip.pt and OUT/NAME.full.pt, and OUT/NAME.{skip,full}.json with the
                   rows the update computed over all ranks. REWARDS (skip_rewards) makes groups
                   whose rewards are all equal; FLAGS: more train.Config values
collect OUT        collect_groups at tensor-parallel size 2 (one engine's two ranks, here an HF
                   engine each, given the same requests) with dynamic sampling, under a reward that
                   rank 1 scores otherwise (as one with a timeout can): OUT.rank{r} each rank's
                   groups and what rank 0's reward makes informative
refit  OUT TP      shard, change the weights, refit each rank's vLLM engine (TP-sharded when
                   TP > 1), compare its logprobs with the trainer's; record the held-out
                   evaluation's samples of four copies of one prompt, split over the engines
policy OUT         the process set-up and precision policy at --dtype bfloat16: threads per rank,
                   the parameters after a no-grad forward, an HF export's dtypes
die    OUT         rank 1 dies after a barrier; rank 0 waits in a collective
hang   OUT         rank 1 hangs (sleeps) after a barrier; rank 0's collective must time out
saved  OUT         (any world size, also one process without torchrun) two AdamW steps, then a
                   checkpoint in OUT/checkpoints (checkpoint.write) and, from rank 0, the full
                   weights and AdamW state (step, exp_avg, exp_avg_sq) in OUT/saved.pt
loaded OUT         (any world size) a fresh policy and AdamW loaded from OUT's checkpoint
                   (checkpoint.load); rank 0 writes OUT/loaded.json: each full tensor equal to
                   saved.pt's or not
"""

import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from demo import bases  # noqa: E402
import checkpoint  # noqa: E402
import data  # noqa: E402
import distributed  # noqa: E402
import eval_aime  # noqa: E402
import model  # noqa: E402
import rollout  # noqa: E402
import runtime  # noqa: E402
from demo import tasks  # noqa: E402
import train  # noqa: E402
from runtime import config  # noqa: E402
from test_rollout import full_state_dict, perturbed  # noqa: E402
import batch


def truncated(i: int, j: int) -> bool:
    """Whether sample j of prompt i of fixed_global_batch hit its length limit."""
    return (3 * i + j) % 5 == 4


def fixed_global_batch(tok, P=8, G=4, seed=0):
    """The same global batch on every rank and world size: P prompts x G random responses with
    random rewards, some of them truncated."""
    g = torch.Generator().manual_seed(seed)
    train_set, _ = tasks.sum3_split()
    prompts = [tok(p.prompt)["input_ids"] for p in train_set[:P]]
    samples = []
    for i in range(P):
        for j in range(G):
            n = int(torch.randint(1, 6, (1,), generator=g))
            ids = torch.randint(4, 20, (n,), generator=g).tolist()
            logp = (-torch.rand(n, generator=g)).tolist()
            samples.append(rollout.Sample(i, ids, logp, truncated(i, j)))
    rewards = (torch.rand(P, G, generator=g) < 0.5).float()
    return prompts, samples, rewards


def skip_rewards(kind: str, P: int = 8, G: int = 4) -> torch.Tensor:
    """[P, G] rewards for the skipping cases. rank1-uniform: the first half of the groups (rank 0's
    at two ranks) mixed, the second half all 1 or all 0; uniform: every group all 1 or all 0 (a
    step with nothing to learn); graded: rewards 0, 0.5 and 1, so that a sample of 0.5 in a group
    whose mean is 0.5 has A = 0 inside a group that still trains."""
    mixed = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]])
    same = torch.tensor([[1.0] * G, [0.0] * G])
    if kind == "rank1-uniform":
        return torch.cat([mixed, mixed[:1], same, same])[:P]
    if kind == "uniform":
        return same.repeat(P // 2, 1)
    if kind == "six-groups":
        return torch.cat([mixed, same, mixed[:1]])
    if kind == "graded":
        return torch.tensor([[0.0, 0.5, 1.0, 0.5], [1.0, 0.5, 0.0, 0.5]]).repeat(P // 2, 1)
    raise ValueError(kind)


def update(
    out: Path,
    micro_tokens: int,
    minibatches: int,
    lr: float,
    opt_name: str,
    pg: str = "ppo",
    lora_rank: int = 0,
    base: str = bases.TINY,
    rewards_kind: str = "",
    flags: dict | None = None,
    precision: str = "float64",
    record: bool = False,
) -> train.Update:
    rank, world = distributed.rank(), distributed.world_size()
    path = model.resolve(base)
    tok = model.load_tokenizer(path)
    small = base == bases.SMOLLM2
    prompts, samples, rewards = fixed_global_batch(tok, *((4, 2) if small else ()))
    if rewards_kind:
        rewards = skip_rewards(rewards_kind)
        prompts, samples, _ = fixed_global_batch(tok, *rewards.shape)
    P, G = rewards.shape
    # GSPO is sequence-level
    cfg = config(
        train.Config,
        prompts_per_step=P,
        group_size=G,
        minibatch_size=P * G // minibatches,
        micro_batch_tokens=micro_tokens,
        lr=lr,
        eps_high=0.28,
        kl_beta=0.0 if small or rewards_kind else 0.01,
        # SGD unclipped: dw = -lr * the gradient itself
        grad_clip=1e9 if opt_name == "sgd" else 1.0,
        pg=pg,
        **{"token_level": pg != "gspo", "lora_rank": lora_rank, **(flags or {})},
        **({} if precision == "float64" else dict(dtype="bfloat16", mixed_precision=precision)),
    )
    # a prompt's G samples stay on one rank
    share = range(rank * P // world, (rank + 1) * P // world)
    my_samples = [
        rollout.Sample(i - share.start, s.token_ids, s.logprobs, s.truncated)
        for s in samples
        for i in [s.prompt_idx]
        if i in share
    ]
    adv = train.advantages(rewards[list(share)], cfg, my_samples, [prompts[i] for i in share])
    b = batch.make_batch(
        [prompts[i] for i in share],
        my_samples,
        adv.flatten(),
        cfg.overlong_filter,
        tok.pad_token_id,
    )
    if cfg.dynamic_sampling:  # as collect_groups keeps: the informative groups, else the first one
        keep = [g for g in range(len(share)) if rewards[share.start + g].std() > 0] or [0]
        b = b.select([g * G + j for g in keep for j in range(G)])
        b = replace(b, rows=list(range(len(b.rows))))
    cpu = torch.device("cpu")
    # float64 end to end, or float32 master weights under a bf16 policy
    if precision == "float64":
        b = replace(b, gen_logp=b.gen_logp.double(), advantages=b.advantages.double())
    f64 = torch.float64 if precision == "float64" else torch.float32
    bf16_params = runtime.fsdp_bf16(cfg.run, cpu)
    torch.manual_seed(0)  # LoRA's A matrices: the same on every rank and at every world size
    policy = model.load_trainable(
        path, cpu, micro_tokens < 100, dtype=f64, adapters=cfg.lora, bf16_params=bf16_params
    )
    # B = 0 would make the first step's gradient of A zero: start from adapters that do something
    if lora_rank:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if ".lora_B." in n:
                    # p.shape: the full shape
                    full = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05
                    (p.to_local() if isinstance(p, DTensor) else p).copy_(distribute_like(p, full))
        start = full_state_dict(policy.lm)  # a collective; {} but on rank 0
        if distributed.is_main():
            torch.save({k: v.clone() for k, v in start.items() if ".lora_" in k}, f"{out}.start")
    ref = (
        None
        if not cfg.loss.kl_beta
        else policy
        if lora_rank
        else model.load_trainable(path, cpu, False, dtype=f64, bf16_params=bf16_params)
        .eval()
        .requires_grad_(False)
    )
    trainable = [p for p in policy.parameters() if p.requires_grad]
    if opt_name == "train":
        opt, sched = runtime.optimizer(policy, cfg.run)
    else:
        opt = (
            torch.optim.AdamW(trainable, lr=cfg.run.lr, weight_decay=cfg.run.weight_decay)
            if opt_name == "adamw"
            else torch.optim.SGD(trainable, lr=cfg.run.lr)
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    grads, weights, clip = [], [], distributed.clip_grad_norm
    if record:  # each optimizer step's gradient, summed over micro-batches and ranks, unclipped

        def recording(m, max_norm):  # and the weights the gradient was taken at
            full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
            named = list(m.lm.named_parameters())
            grads.append({n: full(p.grad).detach().clone() for n, p in named})
            weights.append({n: full(p).detach().clone() for n, p in named})
            return clip(m, max_norm)

        distributed.clip_grad_norm = recording
    try:
        with float64_norms() if record else nullcontext():
            b = train.old_logprobs(policy, ref, b, cfg, cpu, share.start)  # step 5
            upd = train.update_policy(policy, opt, sched, b, cfg, cpu, share.start)  # step 6
    finally:
        distributed.clip_grad_norm = clip
    if record and distributed.is_main():
        torch.save(dict(grads=grads, weights=weights), f"{out}.grads")
    state = full_state_dict(policy.lm)
    if distributed.is_main():
        torch.save({k: v.clone() for k, v in state.items()}, out)
    # the refit's merged weights, merged on the shards and cast before the gather (a collective)
    if lora_rank:
        merged = {n: t.cpu() for n, t in model.hf_weights(policy.lm, torch.float32)}
        if distributed.is_main():
            torch.save(merged, f"{out}.merged")
    return upd


@contextmanager
def float64_norms():
    """Qwen2's RMSNorm (the tiny base's) in its input's dtype. HF's casts to float32 and back in
    every norm, whatever the model's dtype: in a float64 comparison that rounds each layer's values
    and gradients to float32, and two computations of the same sums in another order (packed or
    not, micro-batched or not) then differ by float32's roundoff (~1e-7), not float64's (~1e-16).
    The comparisons with plain_grpo.py run both sides under it."""
    from transformers.models.qwen2 import modeling_qwen2

    norm = modeling_qwen2.Qwen2RMSNorm
    own = norm.forward

    def forward(self, h):  # HF's, less the casts
        return self.weight * (
            h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )

    norm.forward = forward
    try:
        yield
    finally:
        norm.forward = own


def updates(out: Path, cases: dict[str, list]) -> None:
    """Each case's update in one process (one start-up of torch, transformers and the group for
    all of them); each starts from the model files, with its own seeds."""
    distributed.init(120)
    out.mkdir(parents=True, exist_ok=True)
    for name, case in cases.items():
        micro_tokens, minibatches, lr, opt, pg, lora_rank, base, prec, *extra = case
        more = extra[0] if extra else {}  # EXTRA: this case's gradients are recorded too
        update(out / f"{name}.pt", micro_tokens, minibatches, lr, opt, pg, lora_rank, base,
               more.get("rewards", ""), more.get("flags"), prec, record=bool(extra))  # fmt: skip
    distributed.close()


def skips(out: Path, cases: dict[str, list]) -> None:
    """Each case updated with --skip-zero-advantage and without (skip_rewards, no KL term), with
    the rows and the loss tokens each update computed, summed over ranks."""
    distributed.init(120)
    out.mkdir(parents=True, exist_ok=True)
    for name, (micro_tokens, minibatches, lr, opt, pg, lora_rank, kind, flags) in cases.items():
        for skip in (True, False):
            f = dict(flags, skip_zero_advantage=skip)
            upd = update(out / f"{name}.{'skip' if skip else 'full'}.pt", micro_tokens,
                         minibatches, lr, opt, pg, lora_rank, bases.TINY, kind, f)  # fmt: skip
            counts = torch.tensor([float(upd.seqs), float(upd.loss.tokens)], dtype=torch.float64)
            seqs, tokens = distributed.all_reduce_sum(counts).tolist()
            if distributed.is_main():
                Path(out / f"{name}.{'skip' if skip else 'full'}.json").write_text(
                    json.dumps(dict(seqs=seqs, loss_tokens=tokens, grad_norm=upd.grad_norm))
                )
    distributed.close()


def collect(out: Path):
    rank, _ = distributed.init(120)
    cfg = config(
        train.Config,
        engine="hf",
        tensor_parallel_size=2,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=4,
        dynamic_sampling=True,
        dynamic_sampling_max_tries=1,
    )
    task = data.load_task(cfg)
    # the round's prompts, as collect_groups' stream will give them: the first one's group is
    # informative under rank 0's reward (rewards 0, 1, 0, 1), every group under rank 1's
    ids = data.PromptStream(len(task.train), cfg.run.seed).take(cfg.prompts_per_step)
    golds = [task.train[i].answer for i in ids]
    mixed = {golds[0]} if rank == 0 else set(golds)
    calls = iter(range(10**6))
    reward_fn = lambda text, gold: float(next(calls) % 2) if gold in mixed else 0.0  # noqa: E731
    task = replace(task, reward_fn=reward_fn)
    engine = rollout.HFEngine(task.path)
    stream = data.PromptStream(len(task.train), cfg.run.seed)
    groups = train.collect_groups(engine, task, stream, cfg, 1, {})
    prompts = [task.train_prompts.index(p) for p in groups.prompts]
    Path(f"{out}.rank{rank}").write_text(
        json.dumps(
            dict(
                groups=prompts,
                rewards=groups.rewards.tolist(),
                informative=[i for i, gold in zip(ids, golds) if gold == golds[0]],
                generated=groups.generated,
            )
        )
    )
    distributed.close()


def distribute_like(p, full: torch.Tensor) -> torch.Tensor:
    """`full` as this rank's shard of p (a DTensor under FSDP), or itself."""
    if not isinstance(p, DTensor):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements).to_local()


def refit(out: Path, tp: int):
    rank, world = distributed.init(120)
    path = model.resolve(bases.TINY)
    tok = model.load_tokenizer(path)
    engine = rollout.VLLMEngine(
        path,
        max_model_len=64,
        seed=rank // tp,
        dtype="float32",
        external_launcher=True,
        tensor_parallel_size=tp,
    )
    lm = perturbed(path, seed=0)
    policy = distributed.shard(model.LogprobModel(lm), lm, checkpointing=False)
    t = time.time()
    engine.load_weights(distributed.full_weights(lm.named_parameters()))
    refit_s = time.time() - t
    _, heldout = tasks.sum3_split()
    group = rank // tp  # the ranks of one tensor-parallel engine send it identical requests
    prompts = [tok(p.prompt)["input_ids"] for p in heldout[group * 32 : (group + 1) * 32]]
    samples = engine.generate(prompts, n=4, max_tokens=8, seed=group)
    b = batch.make_batch(prompts, samples, torch.zeros(len(samples)), False, tok.pad_token_id)
    with torch.no_grad():
        lp, _ = policy(b.input_ids, b.attention_mask, b.resp_start, b.resp_mask.shape[1])
    diff = float(((lp - b.gen_logp).abs() * b.resp_mask).sum() / b.resp_mask.sum())
    # (gold, response) in the order the evaluation scores them: k samples of each prompt, then
    # greedy
    seen = []
    eval_aime.heldout_accuracy(
        engine,
        tok,
        [prompts[0]] * 4,
        ["0", "1", "2", "3"],
        lambda text, gold: seen.append((gold, text)) or 0.0,
        k=2,
        max_tokens=16,
        temperature=2.0,
        seed=5,
        tp=tp,
    )
    Path(f"{out}.rank{rank}").write_text(
        json.dumps(
            {
                "rank": rank,
                "world": world,
                "diff": diff,
                "refit_s": refit_s,
                "heldout_samples": seen[: 2 * (len(seen) // 3)],
            }
        )
    )
    distributed.close(engine)


def policy(out: Path):
    rank, world = distributed.init(120)
    # threads 0: the node's cores shared among its ranks
    cfg = config(train.Config, dtype="bfloat16")
    device, bf16 = runtime.setup_process(cfg.run)
    path = model.resolve(bases.TINY)
    tok = model.load_tokenizer(path)
    pol = model.load_trainable(path, device, checkpointing=False)
    ids = torch.tensor([tok("1+2+3=6")["input_ids"]])
    with torch.no_grad(), runtime.autocast(cfg.run, device):
        pol(ids, torch.ones_like(ids), torch.tensor([6]), 2)
    params = {n: (isinstance(p, DTensor), str(p.dtype)) for n, p in pol.named_parameters()}
    state = full_state_dict(pol.lm)
    checkpoint.save_hf(pol.lm, tok, out / "export")
    Path(f"{out}.rank{rank}").write_text(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "bf16": bf16,
                "params": params,
                "full_state_dict": len(state),
            }
        )
    )
    distributed.close()


def die(out: Path):
    # a long timeout: the test shows torchrun, not the timeout, ends the survivor
    rank, _ = distributed.init(600)
    torch.distributed.barrier()
    if rank == 1:
        os._exit(3)
    t = torch.ones(1)
    while True:
        torch.distributed.all_reduce(t)


def hang(out: Path):
    rank, _ = distributed.init(timeout_s=3)
    torch.distributed.barrier()
    if rank == 1:
        time.sleep(600)
    torch.distributed.all_reduce(torch.ones(1))


def full_training_state(policy, opt) -> dict[str, torch.Tensor]:
    """Every weight and AdamW state tensor as a full tensor, by parameter name (a collective under
    FSDP): "NAME", "NAME:step", "NAME:exp_avg", "NAME:exp_avg_sq"."""
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    out = {}
    for name, p in policy.named_parameters():
        out[name] = full(p.detach()).clone()
        for key, t in opt.state[p].items():
            out[f"{name}:{key}"] = full(t).clone()
    return out


def fresh_policy_and_adamw():
    distributed.init(120)
    torch.manual_seed(0)
    path = model.resolve(bases.TINY)
    policy = model.load_trainable(path, torch.device("cpu"), checkpointing=False)
    return policy, torch.optim.AdamW(policy.parameters(), lr=1e-2, weight_decay=0.01), path


def saved(out: Path):
    """Two AdamW steps on one fixed batch (every rank the same), so that exp_avg and exp_avg_sq are
    neither zero nor each other, then a checkpoint written at this world size."""
    policy, opt, path = fresh_policy_and_adamw()
    tok = model.load_tokenizer(path)
    ids = torch.tensor([tok("1+2+3=6")["input_ids"], tok("4+5+6=9")["input_ids"]])
    for _ in range(2):
        lp, _ = policy(ids, torch.ones_like(ids), torch.tensor([6, 6]), 2)
        (-lp.sum()).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.write(out / "checkpoints", 2, policy, opt, {}, {}, keep=2)
    state = full_training_state(policy, opt)
    if distributed.is_main():
        torch.save(state, out / "saved.pt")
    distributed.close()


def loaded(out: Path, into: Path | None = None):
    """OUT's checkpoint (saved's) loaded at this world size and compared with saved.pt there; with
    INTO, what it loaded is saved again at this world size, as saved does, for the next load."""
    policy, opt, _ = fresh_policy_and_adamw()
    checkpoint.load(out / "checkpoints" / "step_000002", policy, opt)
    state = full_training_state(policy, opt)
    if into:
        checkpoint.write(into / "checkpoints", 2, policy, opt, {}, {}, keep=2)
        if distributed.is_main():
            torch.save(state, into / "saved.pt")
    if distributed.is_main():
        want = torch.load(out / "saved.pt")
        result = {
            "world": distributed.world_size(),
            "missing": sorted(set(want) - set(state)),
            "extra": sorted(set(state) - set(want)),
            "differ": sorted(k for k in want if k in state and not torch.equal(want[k], state[k])),
            "n": len(want),
        }
        (out / "loaded.json").write_text(json.dumps(result))
    distributed.close()


if __name__ == "__main__":
    job, out = sys.argv[1], Path(sys.argv[2])
    {
        "updates": lambda: updates(out, json.loads(sys.argv[3])),
        "skips": lambda: skips(out, json.loads(sys.argv[3])),
        "refit": lambda: refit(out, int(sys.argv[3])),
        "collect": lambda: collect(out),
        "die": lambda: die(out),
        "policy": lambda: policy(out),
        "hang": lambda: hang(out),
        "saved": lambda: saved(out),
        "loaded": lambda: loaded(out, Path(sys.argv[3]) if len(sys.argv) > 3 else None),
    }[job]()
