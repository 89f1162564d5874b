"""DPO beside GRPO: offline preference training. `python dpo.py` runs the CPU demo; `--help` lists every flag.

What it does: trains a policy on (prompt, chosen, rejected) pairs with the DPO loss (Rafailov et al. 2023), its
label-smoothed "conservative" variant, or IPO (Azar et al. 2023), against a frozen reference model (the start
weights). Everything else is GRPO's machinery, reused: model.py's chunked per-token logprobs, distributed.py's
FSDP2 sharding, token-budget micro-batches, global-normalizer reductions and checkpoint I/O, runtime.py's
set-up, resume and checkpoints, eval_aime.py's held-out accuracy, logs.py's metrics.jsonl. Compared with
train.py, what is *gone* is the whole online half (generation, rewards, advantages, refit): the data are fixed
pairs, and the "reward" is implicit in the log-ratio between policy and reference. What is *new* is one loss and one data loader.

    h_i    = [log pi(y_c|x) - log pi_ref(y_c|x)] - [log pi(y_r|x) - log pi_ref(y_r|x)]   (log-ratio margin)
    DPO    : l_i = -(1 - eps) log sigmoid(beta h_i) - eps log sigmoid(-beta h_i)          (eps = label smoothing)
    IPO    : l_i = (h_i - 1 / (2 beta))^2, with log pi = the *mean* over response tokens (IPO paper, TRL)
    loss   = sum over the global batch of l_i / number of pairs in the global batch

The demo (no --data): the built-in tiny base model (pretrained with 65% careless "a+b" answers to "a+b+c=") on a
synthetic preference set: chosen = the right sum, rejected = the careless a+b or another wrong number (two pairs
per prompt). It reports held-out preference accuracy (pairs of the 200 held-out prompts) and held-out task
accuracy (greedy and pass@1 over 4 samples at T = 1, the same figures as GRPO's demo, via rollout.HFEngine).

What it does not do: generate during training (DPO is offline), reward models, or multi-turn losses (only the
last assistant message of a conversation is the response). `python dpo.py export CKPT OUT` exports a saved step.
"""

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import data
import distributed as dist
import eval_aime
import model as M
import reward
import runtime


@dataclass
class DPOConfig:
    # model
    model: str = "tiny"  # HF path or hub name; "tiny" builds (once) and uses the built-in demo base model
    trust_remote_code: bool = False  # let transformers run code shipped with the model
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # compute dtype (weights stay float32); auto: bfloat16 on GPU
    activation_checkpointing: bool = False  # recompute each decoder layer's activations in backward (long sequences)
    dist_timeout_s: int = 600  # a collective waiting longer than this fails the run instead of hanging
    max_skipped_steps: int = 3  # stop after this many consecutive updates skipped for a non-finite loss or gradient
    # preference data
    data: str = ""  # pairs (.jsonl, .json, .parquet, or an HF dataset name[:split]); "" = the synthetic sum3 set
    val_data: str = ""  # held-out pairs; default: --val-fraction of --data
    val_fraction: float = 0.0  # fraction of --data held out when --val-data is not given
    prompt_field: str = "prompt"  # field of the prompt (a string, or a list of chat messages)
    chosen_field: str = "chosen"  # field of the preferred response (a string, or messages ending in the assistant's)
    rejected_field: str = "rejected"  # field of the dispreferred response (same forms)
    # loss
    loss: Literal["dpo", "ipo"] = "dpo"  # DPO (sigmoid) or IPO (squared, per-token-averaged logprobs)
    beta: float = 0.1  # strength of the tie to the reference model (DPO's KL coefficient; IPO's target 1/(2 beta))
    label_smoothing: float = 0.0  # DPO only: probability eps that a label is flipped (conservative DPO), in [0, 0.5)
    # batch shape and optimizer
    steps: int = 200  # optimizer steps
    batch_size: int = 64  # pairs per optimizer step, over all ranks
    micro_batch_tokens: int = 8192  # token budget of one forward/backward (padded tokens of both rows of each pair)
    max_seq_len: int = 64  # prompt + the longer response; longer pairs are dropped, counted and reported
    lr: float = 1e-4  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 0  # linear LR warm-up, in optimizer steps
    grad_clip: float = 1.0  # max global gradient norm
    # evaluation, logging, system
    eval_every: int = 25  # held-out evaluation every N steps (and at start and end); 0 = never
    eval_samples: int = 4  # sum3 demo: samples per held-out prompt for pass@1 (temperature 1)
    max_new_tokens: int = 8  # sum3 demo: response length limit of the held-out generations
    out_dir: str = ""  # run folder; default runs/dpo-<date-time>
    seed: int = 0  # seeds the synthetic set, the data order and torch
    threads: int = 0  # torch CPU threads; 0 = all cores
    logprob_chunk_tokens: int = 1024  # positions per LM-head chunk when computing logprobs (memory bound)
    save_final: bool = True  # write the final weights as an HF checkpoint to <out_dir>/final
    checkpoint_every: int = 50  # sharded checkpoint (model, optimizer, RNG, data order) every N steps and at the end; 0 = never
    keep_checkpoints: int = 2  # how many of the newest checkpoints to keep
    resume: bool = True  # continue from the newest complete checkpoint in <out_dir>/checkpoints when there is one
    tensorboard: bool = False  # also log to <out_dir>/tensorboard (needs the tensorboard package)
    wandb_project: str = ""  # also log to this Weights & Biases project (needs the wandb package)
    quiet: bool = False  # no progress bar (the JSON lines are still written)


# ----------------------------------------------------------------------------------------------------------------
# The loss


def dpo_loss(
    pol_chosen: torch.Tensor,  # [B] log pi(y_c | x), summed (DPO) or averaged (IPO) over response tokens
    pol_rejected: torch.Tensor,  # [B] log pi(y_r | x)
    ref_chosen: torch.Tensor,  # [B] log pi_ref(y_c | x), no grad
    ref_rejected: torch.Tensor,  # [B] log pi_ref(y_r | x), no grad
    beta: float,
    label_smoothing: float = 0.0,
    kind: str = "dpo",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-pair loss [B] and per-pair diagnostics (each [B], to be summed and divided by the pair count).

    With the log-ratio margin h = (log pi(y_c) - log pi_ref(y_c)) - (log pi(y_r) - log pi_ref(y_r)):

      dpo: l = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
           eps = 0 is DPO (Rafailov et al. 2023): the Bradley-Terry likelihood of the preference under the
           implicit reward r(x, y) = beta log(pi(y|x) / pi_ref(y|x)). eps > 0 is conservative DPO (Mitchell
           2023): the label is flipped with probability eps, so l is minimized at a finite margin
           beta h = log((1 - eps) / eps) instead of pushing h to infinity.
      ipo: l = (h - 1 / (2 beta))^2  (Azar et al. 2023): regresses the margin to a fixed target rather than
           maximizing it, so it cannot overfit deterministic preferences. The caller passes logprobs *averaged*
           over each response's tokens, as the IPO paper's implementation and TRL do (a sum would make the
           target 1/(2 beta) mean different things for long and short responses).

    Diagnostics (the implicit rewards of the DPO paper, also for IPO): reward_chosen = beta (log pi - log pi_ref)(y_c),
    reward_rejected likewise, margin = their difference = beta h, accuracy = 1 where reward_chosen > reward_rejected
    (0 at a tie, so 0 everywhere at step 0, when policy = reference).
    """
    h = (pol_chosen - ref_chosen) - (pol_rejected - ref_rejected)  # [B]
    if kind == "dpo":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif kind == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}: use dpo or ipo")
    r_c = beta * (pol_chosen - ref_chosen).detach()  # [B]
    r_r = beta * (pol_rejected - ref_rejected).detach()  # [B]
    metrics = {"reward_chosen": r_c, "reward_rejected": r_r, "reward_margin": r_c - r_r,
               "reward_acc": (r_c > r_r).float(), "logp_chosen": pol_chosen.detach(),
               "logp_rejected": pol_rejected.detach()}
    return loss, metrics


def sequence_logps(token_logp: torch.Tensor, resp_len: torch.Tensor, average: bool) -> torch.Tensor:
    """log pi(y|x) [B] from per-token logprobs [B, T] (zero past each response's end): the sum, or the mean (IPO)."""
    s = token_logp.sum(-1)  # [B]
    return s / resp_len.clamp(min=1).to(s.dtype) if average else s


# ----------------------------------------------------------------------------------------------------------------
# Preference data


@dataclass(frozen=True)
class PrefRow:
    """One preference as text: the prompt (a string, or chat messages) and two responses (strings)."""

    prompt: str | tuple
    chosen: str
    rejected: str


@dataclass(frozen=True)
class Pair:
    """One preference as token ids; the rows the model sees are prompt + chosen and prompt + rejected."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]  # response tokens, ending with EOS
    rejected: tuple[int, ...]

    @property
    def length(self) -> int:  # the padded width of the pair's two rows
        return len(self.prompt) + max(len(self.chosen), len(self.rejected))


def _messages(value, where: str, field: str) -> tuple:
    if not all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in value):
        raise data.DataError(f"{where}: {field!r} is a list, but not of chat messages with 'role' and 'content'")
    return tuple((m["role"], m["content"]) for m in value)


def load_pairs(path: str, prompt_field: str = "prompt", chosen_field: str = "chosen",
               rejected_field: str = "rejected") -> list[PrefRow]:
    """Preference rows from a file or HF dataset (data.py's readers). Each field is a string or a list of chat
    messages ({"role", "content"}); a response given as messages is the content of its last message, which must be
    the assistant's (so UltraFeedback-style rows, whose "chosen" repeats the user turn, work too). A bad row stops
    the run here, before any model loads, with one line naming the file and the row."""
    rows = []
    for i, row in data.read_rows(path):
        where = f"{path}: row {i}"
        if not isinstance(row, dict):
            raise data.DataError(f"{where}: expected an object with fields {prompt_field!r}, {chosen_field!r} and "
                                 f"{rejected_field!r}")
        vals = {}
        for field in (prompt_field, chosen_field, rejected_field):
            if field not in row:
                raise data.DataError(f"{where}: missing field {field!r} (fields: {', '.join(map(str, row))})")
            v = row[field]
            if isinstance(v, (list, tuple)) and v:
                msgs = _messages(v, where, field)
                if field != prompt_field:
                    if msgs[-1][0] != "assistant":
                        raise data.DataError(f"{where}: the last message of {field!r} is not the assistant's")
                    v = msgs[-1][1]
                else:
                    v = msgs
            elif not isinstance(v, str):
                raise data.DataError(f"{where}: {field!r} must be a string or a list of chat messages, "
                                     f"not {type(v).__name__}")
            if isinstance(v, str) and not v.strip():
                raise data.DataError(f"{where}: empty {field!r}")
            vals[field] = v
        rows.append(PrefRow(vals[prompt_field], vals[chosen_field], vals[rejected_field]))
    if not rows:
        raise data.DataError(f"{path}: no preference pairs")
    return rows


def sum3_pairs(problems: list[data.Problem], seed: int) -> list[PrefRow]:
    """The demo's synthetic preferences: two pairs per prompt "a+b+c=", both with chosen = the right sum. The first
    rejects the careless a+b that the base model prefers (when c != 0; when c = 0 it *is* the right sum, so another
    wrong number in 0..27 instead), the second another wrong number: rejecting only a+b would teach "not a+b",
    and the probability it loses could go to any other wrong answer as well as to the right one."""
    rng = random.Random(seed)
    rows = []
    for p in problems:
        a, b, c = (int(x) for x in p.prompt.rstrip("=").split("+"))
        others = rng.sample([n for n in range(28) if n not in (a + b + c, a + b)], 2)
        for wrong in ([a + b] if c else others[1:]) + others[:1]:
            rows.append(PrefRow(p.prompt, p.answer, str(wrong)))
    return rows


def encode_pairs(tok, rows: list[PrefRow], max_seq_len: int, what: str) -> list[Pair]:
    """Token ids: the prompt through the chat template when the tokenizer has one (else plain text, as for the tiny
    model), each response as plain tokens + EOS (the end of an assistant turn). Pairs longer than max_seq_len are
    dropped, counted and reported: truncating one would compare a cut response with a whole one."""
    pairs = []
    for i, r in enumerate(rows, 1):
        msgs = [{"role": "user", "content": r.prompt}] if isinstance(r.prompt, str) else \
            [{"role": role, "content": c} for role, c in r.prompt]
        if tok.chat_template:
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        elif isinstance(r.prompt, str):
            prompt = tok(r.prompt)["input_ids"]
        else:
            raise data.DataError(f"{what} pair {i}: the prompt is a list of chat messages, but the tokenizer has no "
                                 f"chat template")
        resp = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in (r.chosen, r.rejected)]
        pairs.append(Pair(tuple(prompt), tuple(resp[0]), tuple(resp[1])))
    keep = [p for p in pairs if p.length <= max_seq_len]
    if len(keep) < len(pairs):
        dist.print0(f"dropped {len(pairs) - len(keep)} of {len(pairs)} {what} pairs longer than {max_seq_len} tokens "
                    f"(--max-seq-len)")
    if pairs and not keep:
        raise SystemExit(f"error: every {what} pair is longer than {max_seq_len} tokens; raise --max-seq-len")
    return keep


def load_preferences(cfg: DPOConfig) -> tuple[list[PrefRow], list[PrefRow], list[data.Problem]]:
    """(training rows, held-out rows, held-out sum3 problems for task accuracy: only for the synthetic set)."""
    if not cfg.data:
        train_set, heldout = data.sum3_split()
        return sum3_pairs(train_set, cfg.seed), sum3_pairs(heldout, cfg.seed + 1), heldout
    rows = load_pairs(cfg.data, cfg.prompt_field, cfg.chosen_field, cfg.rejected_field)
    if cfg.val_data:
        return rows, load_pairs(cfg.val_data, cfg.prompt_field, cfg.chosen_field, cfg.rejected_field), []
    train_rows, heldout_rows = data.split(rows, cfg.val_fraction, cfg.seed)
    return train_rows, heldout_rows, []


# ----------------------------------------------------------------------------------------------------------------
# One update


def pack(pairs: list[Pair], pad_id: int) -> dict:
    """Rows [2n, L]: the n chosen rows, then the n rejected ones, right-padded (one forward pass for both)."""
    seqs = [p.prompt + p.chosen for p in pairs] + [p.prompt + p.rejected for p in pairs]
    resp = [len(p.chosen) for p in pairs] + [len(p.rejected) for p in pairs]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)  # [2n, L]
    am = torch.zeros(len(seqs), L, dtype=torch.long)  # [2n, L]
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        am[i, : len(s)] = 1
    start = torch.tensor([len(p.prompt) for p in pairs] * 2)  # [2n]
    return dict(input_ids=ids, attention_mask=am, resp_start=start, resp_len=torch.tensor(resp), T=max(resp))


def pair_logps(m, pairs: list[Pair], cfg: DPOConfig, device, pad_id: int, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_c|x), log pi(y_r|x): each [n], summed over response tokens (averaged for IPO)."""
    b = pack(pairs, pad_id)
    with torch.set_grad_enabled(grad), runtime.autocast(cfg, device):
        lp, _ = M.token_logprobs(m, b["input_ids"].to(device), b["attention_mask"].to(device),
                                 b["resp_start"].to(device), b["T"], 1.0, cfg.logprob_chunk_tokens)  # [2n, T]
    s = sequence_logps(lp, b["resp_len"].to(device), average=cfg.loss == "ipo")  # [2n]
    return s[: len(pairs)], s[len(pairs) :]


# a rank with fewer micro-batches than another runs this pair with zero weight (FSDP needs equal passes): one token
# of prompt and one of each response, whatever the length of the real pairs
STAND_IN = Pair((1,), (2,), (2,))


def equal_micro_batches(pairs: list[Pair], token_budget: int) -> list[list[int]]:
    """Whole pairs per micro-batch (the loss needs both rows), within the token budget counted over both padded
    rows; the same number on every rank (distributed.micro_batches)."""
    return dist.micro_batches([2 * p.length for p in pairs], list(range(len(pairs))), token_budget)


def update(policy, ref, opt, sched, pairs: list[Pair], n_global: int, cfg: DPOConfig, device, pad_id: int):
    """One optimizer step on this rank's share `pairs` of a global batch of `n_global` pairs.

    Each micro-batch: reference logprobs (no grad), policy logprobs (grad), the loss summed over its pairs and
    divided by n_global, times dist.loss_scale() (FSDP averages over ranks; we want the sum), backward. So the
    gradient is that of the global batch's mean loss at any world size and any micro-batching. An empty
    micro-batch (a rank with fewer passes) runs STAND_IN with weight 0. Returns (summed metrics, grad norm, skipped).
    """
    policy.train()
    sums: dict[str, float] = {}
    micro = equal_micro_batches(pairs, cfg.micro_batch_tokens)
    for k, rows in enumerate(micro):
        mb = [pairs[r] for r in rows] or [STAND_IN]
        with torch.no_grad():
            ref_c, ref_r = pair_logps(ref, mb, cfg, device, pad_id, grad=False)  # [n], [n]
        pol_c, pol_r = pair_logps(policy, mb, cfg, device, pad_id, grad=True)  # [n], [n]
        loss, metrics = dpo_loss(pol_c, pol_r, ref_c, ref_r, cfg.beta, cfg.label_smoothing, cfg.loss)
        weight = 1.0 if rows else 0.0
        with dist.gradient_sync(policy, k == len(micro) - 1):  # one gradient reduction per step
            (loss.sum() * (weight / n_global) * dist.loss_scale()).backward()
        if rows:
            metrics["loss"] = loss.detach()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v.sum())
    grad_norm = dist.clip_grad_norm(policy, cfg.grad_clip)  # global over ranks: all ranks agree on skipping
    skipped = 0
    if torch.isfinite(grad_norm):
        opt.step()
        sched.step()
    else:  # a NaN/inf loss or gradient: the update is skipped, weights and optimizer state stay as they were
        skipped = 1
    opt.zero_grad(set_to_none=True)
    policy.eval()
    return sums, float(grad_norm), skipped


# ----------------------------------------------------------------------------------------------------------------
# Evaluation


def eval_logps(m, pairs: list[Pair], cfg: DPOConfig, device, pad_id: int) -> torch.Tensor:
    """[n, 2] log pi of (chosen, rejected) for this rank's share of `pairs` (no grad; every rank the same passes)."""
    out = torch.zeros(len(pairs), 2, dtype=torch.float64)
    for rows in equal_micro_batches(pairs, cfg.micro_batch_tokens):
        c, r = pair_logps(m, [pairs[i] for i in rows] or [STAND_IN], cfg, device, pad_id, grad=False)
        if rows:
            out[rows] = torch.stack([c, r], 1).double().cpu()
    return out


def evaluate_pairs(policy, ref_lp: torch.Tensor, pairs: list[Pair], cfg: DPOConfig, device, pad_id: int) -> dict:
    """Held-out preference figures, reduced over ranks:
    heldout_pref_acc   = fraction of pairs where the policy itself gives y_c the higher log pi (meaningful at
                         step 0: the base model's own preference),
    heldout_reward_acc = fraction where the implicit reward beta log(pi/pi_ref) of y_c is higher (DPO's
                         "accuracy"; 0 at step 0, when every margin is 0),
    heldout_margin     = mean implicit reward margin."""
    lp = eval_logps(policy, pairs, cfg, device, pad_id)  # [n, 2]
    margin = cfg.beta * ((lp[:, 0] - ref_lp[:, 0]) - (lp[:, 1] - ref_lp[:, 1]))  # [n]
    tot = dist.all_reduce_sum(torch.tensor([float((lp[:, 0] > lp[:, 1]).sum()), float((margin > 0).sum()),
                                            float(margin.sum()), float(len(pairs))], dtype=torch.float64)).tolist()
    if not tot[3]:
        return {}
    return {"heldout_pref_acc": tot[0] / tot[3], "heldout_reward_acc": tot[1] / tot[3], "heldout_margin": tot[2] / tot[3]}


def evaluate_task(engine, policy, tok, cfg: DPOConfig, problems: list[data.Problem], seed: int) -> dict:
    """The sum3 demo only: held-out greedy accuracy and pass@1, exactly as GRPO's demo measures them, with the
    policy's current weights loaded into an HF-generate engine."""
    engine.load_weights(dist.full_weights(policy.lm))
    prompts = [tok(p.prompt)["input_ids"] for p in problems]
    return eval_aime.heldout_accuracy(engine, tok, prompts, [p.answer for p in problems], reward.exact_reward,
                                      cfg.eval_samples, cfg.max_new_tokens, 1.0, seed)


# ----------------------------------------------------------------------------------------------------------------
# The loop


def model_path(cfg: DPOConfig) -> str:
    return M.resolve(cfg.model)


def validate(cfg: DPOConfig, world: int) -> None:
    """One clear line for a bad flag, before any data or model is loaded."""
    checks = [
        (cfg.beta > 0, f"--beta {cfg.beta}: must be positive"),
        (0.0 <= cfg.label_smoothing < 0.5, f"--label-smoothing {cfg.label_smoothing}: must be in [0, 0.5)"),
        (cfg.loss == "dpo" or cfg.label_smoothing == 0.0,
         f"--label-smoothing {cfg.label_smoothing}: only for --loss dpo (IPO has no labels to smooth)"),
        (cfg.batch_size >= world and cfg.batch_size % world == 0,
         f"--batch-size {cfg.batch_size}: must be a positive multiple of the {world} ranks"),
        (cfg.max_seq_len >= 2, f"--max-seq-len {cfg.max_seq_len}: must be at least 2"),
        (0 < cfg.max_new_tokens < cfg.max_seq_len,
         f"--max-new-tokens {cfg.max_new_tokens}: must be positive and below --max-seq-len {cfg.max_seq_len}"),
        (0.0 <= cfg.val_fraction < 1.0, f"--val-fraction {cfg.val_fraction}: must be in [0, 1)"),
    ]
    runtime.check(checks + runtime.run_checks(cfg))


def train_dpo(cfg: DPOConfig) -> dict:
    rank, world = dist.init(cfg.dist_timeout_s)
    validate(cfg, world)
    device, bf16 = runtime.setup_process(cfg)
    out = runtime.run_folder(cfg, "dpo-")

    train_rows, heldout_rows, heldout_problems = load_preferences(cfg)  # bad data stops here, before any model
    path = model_path(cfg)
    tok = M.load_tokenizer(path, cfg.trust_remote_code)
    train_pairs = encode_pairs(tok, train_rows, cfg.max_seq_len, "training")
    heldout_pairs = encode_pairs(tok, heldout_rows, cfg.max_seq_len, "held-out") if heldout_rows else []
    if len(train_pairs) < cfg.batch_size:
        raise SystemExit(f"error: --batch-size {cfg.batch_size}: only {len(train_pairs)} training pairs")
    policy = runtime.load_trainable(path, device, cfg.activation_checkpointing, cfg.trust_remote_code)
    ref = runtime.load_trainable(path, device, False, cfg.trust_remote_code).eval().requires_grad_(False)
    engine = None
    if heldout_problems and cfg.eval_every:  # task accuracy of the synthetic demo: generate with HF
        from rollout import HFEngine

        engine = HFEngine(path, dtype=torch.bfloat16 if bf16 else torch.float32, device=device)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.warmup_steps)))
    stream = data.PromptStream(len(train_pairs), cfg.seed)  # same shuffled order on every rank
    my_heldout = heldout_pairs[slice(*dist.share(heldout_pairs))]
    ref_heldout = eval_logps(ref, my_heldout, cfg, device, tok.pad_token_id) if cfg.eval_every else None

    def evaluate(step: int) -> dict:
        row = evaluate_pairs(policy, ref_heldout, my_heldout, cfg, device, tok.pad_token_id)
        if engine is not None:
            row.update(evaluate_task(engine, policy, tok, cfg, heldout_problems, seed=cfg.seed + step))
        return row

    from tqdm import tqdm

    start, history, log = runtime.resume_or_start(out, cfg, policy, opt, sched, stream, first_row=lambda: evaluate(0))
    last_eval = next((r for r in reversed(history) if "heldout_pref_acc" in r), {})
    bar = tqdm(range(start + 1, cfg.steps + 1), disable=cfg.quiet or not dist.is_main(), desc=cfg.loss.upper(),
               dynamic_ncols=True)
    share = cfg.batch_size // world
    t_start, bad_steps, stop = time.time(), 0, False
    ctrl_c = runtime.CtrlC(install=__name__ == "__main__")
    for step in bar:
        t0 = time.time()
        runtime.reset_peak_memory(device)
        ids = stream.take(cfg.batch_size)[rank * share : (rank + 1) * share]  # this rank's share of the global batch
        sums, grad_norm, skipped = update(policy, ref, opt, sched, [train_pairs[i] for i in ids], cfg.batch_size,
                                          cfg, device, tok.pad_token_id)
        bad_steps = runtime.skipped_in_a_row(bad_steps, skipped, step, cfg, out)
        keys = sorted(sums)
        tot = dict(zip(keys, dist.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64)).tolist()))
        row = dict(step=step, epoch=step * cfg.batch_size / len(train_pairs),
                   **{k: v / cfg.batch_size for k, v in tot.items()}, grad_norm=grad_norm, skipped_updates=skipped,
                   lr=sched.get_last_lr()[0], time_train=time.time() - t0)
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
            last_eval = evaluate(step)
            row.update(last_eval)
        row["peak_mem_gib"] = runtime.peak_memory_gib(device)
        row["time_step"] = time.time() - t0
        row["elapsed"] = time.time() - t_start
        history.append(row)
        if log:
            log.write(row)
            bar.set_postfix(loss=f"{row.get('loss', 0):.3f}", acc=f"{row.get('reward_acc', 0):.2f}",
                            heldout=f"{last_eval.get('heldout_pref_acc', 0):.2f}")
        stop = runtime.end_of_step(step, cfg, out, policy, opt, sched, stream, {"config": asdict(cfg), "algo": "dpo"},
                                   ctrl_c)
        if stop:
            break
    bar.close()
    if log:
        log.close()
    if stop:
        dist.close()
        raise SystemExit(130)
    if cfg.save_final:
        runtime.save_hf(policy.lm, tok, out / "final")
    summary = dict(out_dir=str(out), minutes=(time.time() - t_start) / 60, pairs=len(train_pairs),
                   first={k: v for k, v in history[0].items() if k.startswith("heldout")},
                   last={k: v for k, v in last_eval.items() if k.startswith("heldout")})
    dist.print0(json.dumps(summary))
    dist.close()
    return dict(history=history, out_dir=str(out))


def main(argv: list[str]) -> None:
    import tyro

    runtime.one_line_errors(lambda: runtime.export_hf(argv, "dpo.py") if argv[:1] == ["export"]
                            else train_dpo(tyro.cli(DPOConfig, args=argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
