"""train.py end to end with the real vLLM engine and the tiny base model: a short GRPO run must
learn."""

import json
import math
import random
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from demo import bases
import distributed
import dpo
import model
import rollout
import token_picks
import train
from checks import UserError
from runtime import config
import batch
import data

METRIC_KEYS = {
    "reward_mean",
    "response_len_mean",
    "loss",
    "clip_frac_low",
    "clip_frac_high",
    "kl",
    "entropy",
    "token_mult_prob_error",
    "gen_kl_error",
    "policy_kl_error",
    "js_divergence_error",
    "is_oob_frac",
    "time_generate",
    "time_score",
    "time_logprobs",
    "time_update",
    "time_refit",
    "tokens_per_s",
    "truncated_frac",
    "zero_var_group_frac",
    "trained_frac",
    "trained_tokens",
}


@pytest.mark.cpu_numerics
def test_short_grpo_run_raises_heldout_reward(vllm_engine, tmp_path):
    cfg = config(train.Config, steps=25, eval_every=25, seed=0, out_dir=str(tmp_path), quiet=True)
    result = train.train(cfg, engine=vllm_engine)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 26 and rows == result["history"]
    first, last = rows[0]["heldout_pass1"], rows[-1]["heldout_pass1"]
    assert last >= first + 0.2, (first, last)
    for r in rows[1:]:
        assert METRIC_KEYS <= r.keys()
        # float32 engine and trainer agree after every refit
        assert r["token_mult_prob_error"] < 1.001
        # rewards 0 or 1: a sample's advantage is 0 exactly when its group's rewards are all
        # equal, and the update computed every other sample (--skip-zero-advantage, the default)
        assert r["trained_frac"] == pytest.approx(1 - r["zero_var_group_frac"], abs=1e-9)
    assert rows[-1]["reward_mean"] > rows[1]["reward_mean"]
    # the final weights are a loadable HF checkpoint
    m = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert m.config.model_type == "qwen2"


@pytest.mark.cpu_numerics
def test_hf_engine_runs_the_same_loop(tmp_path):
    cfg = config(
        train.Config,
        engine="hf",
        steps=3,
        eval_every=0,
        prompts_per_step=8,
        group_size=4,
        minibatch_size=16,
        out_dir=str(tmp_path),
        quiet=True,
        save_final=False,
    )
    rows = train.train(cfg)["history"]
    assert len(rows) == 4 and all(0.0 <= r["reward_mean"] <= 1.0 for r in rows[1:])
    # two minibatches: old logprobs come from a pass of their own and must still match the engine
    assert all(r["token_mult_prob_error"] < 1.001 for r in rows[1:])


def test_a_step_with_nothing_to_learn_computes_no_sample(tmp_path):
    # a reward that is always 0: every group is uniform, every advantage 0, so the update runs no
    # sample's forward or backward; AdamW still steps (weight decay) and the run goes on
    (tmp_path / "zero.py").write_text("def reward(response, gold):\n    return 0.0\n")
    cfg = config(
        train.Config,
        engine="hf",
        steps=2,
        eval_every=0,
        prompts_per_step=8,
        group_size=4,
        minibatch_size=16,
        reward=f"{tmp_path / 'zero.py'}:reward",
        out_dir=str(tmp_path / "run"),
        quiet=True,
        save_final=False,
    )
    rows = train.train(cfg)["history"][1:]
    assert [r["trained_frac"] for r in rows] == [0.0, 0.0]
    # nothing measured the trainer's entropy or its agreement with the engine: null, not 0
    assert all(r["trained_tokens"] == 0 for r in rows)
    assert all(r[k] is None for r in rows for k in ("entropy", "token_mult_prob_error"))
    assert all(r["zero_var_group_frac"] == 1.0 and r["grad_norm"] == 0.0 for r in rows)
    assert all(r["skipped_updates"] == 0 for r in rows)  # both minibatches stepped


@pytest.mark.parametrize("token_level", [True, False])
def test_one_update_is_minus_the_gradient_of_the_whole_batchs_objective(
    tiny_path, tok, token_level
):
    """Step 6 against the objective written out here in float64 from the model's own logits: one
    unclipped SGD step at lr 1 over one minibatch of several micro-batches (shared prompts, some
    rows skipped: A = 0 or overlong-filtered) moves each weight by minus the gradient of

        token level:    L = -sum_i A_i sum_t log pi(y_it) / sum_i |y_i|
        sequence level: L = -(1 / N) sum_i A_i / |y_i| sum_t log pi(y_it)

    over the N rows that have loss tokens (at ratio 1 PPO's clipped term has the gradient of
    A * log pi). A swapped normalizer, a lost row or a wrong temperature moves the step by far
    more than the 1e-7 that HF's float32 RoPE tables leave in the packed rows' float64 gradient."""
    g = torch.Generator().manual_seed(3)
    P, G, temperature = 3, 4, 0.7
    prompts = [tok(f"{a}+{a + 1}+7=")["input_ids"] for a in range(P)]
    samples = [
        rollout.Sample(i, torch.randint(4, 30, (n,), generator=g).tolist(), [-1.0] * n, n == 5)
        for i in range(P)
        for n in torch.randint(1, 6, (G,), generator=g).tolist()
    ]
    adv = torch.randn(P * G, generator=g, dtype=torch.float64)
    adv[[1, 6]] = 0.0  # skipped rows
    cfg = config(
        train.Config,
        prompts_per_step=P,
        group_size=G,
        micro_batch_tokens=24,
        lr=1.0,
        grad_clip=1e9,
        weight_decay=0.0,
        token_level=token_level,
        temperature=temperature,
        overlong_filter=True,
    )
    b = batch.make_batch(prompts, samples, adv, True, tok.pad_token_id)
    b = replace(b, gen_logp=b.gen_logp.double())
    cpu = torch.device("cpu")
    policy = model.load_trainable(tiny_path, cpu, False, dtype=torch.float64)
    before = {n: p.detach().clone() for n, p in policy.lm.named_parameters()}
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    upd = train.update_policy(policy, opt, sched, b, cfg, cpu)

    # the same objective, independently: the HF model's own float64 forward, one row at a time
    hf = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float64)
    kept = [i for i, s in enumerate(samples) if not s.truncated]  # --overlong-filter
    # the update computed only the rows with a loss term: A != 0 and not filtered out
    assert upd.seqs == sum(int(adv[i] != 0) for i in kept) < len(kept) < P * G
    n_tok = sum(len(samples[i].token_ids) for i in kept)
    loss = torch.zeros((), dtype=torch.float64)
    for i in kept:
        s = samples[i]
        ids = torch.tensor([prompts[s.prompt_idx] + s.token_ids])
        logits = hf(ids).logits[0, len(prompts[s.prompt_idx]) - 1 : -1] / temperature
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None]).sum()
        loss = loss - adv[i] * (lp / n_tok if token_level else lp / len(s.token_ids) / len(kept))
    loss.backward()
    for name, p in hf.named_parameters():
        step = policy.lm.get_parameter(name).detach() - before[name]
        assert ((step + p.grad).norm() / p.grad.norm()).item() < 1e-6, name
    # the logged loss (ratio 1: the advantages' weighted sum) against the same normalizers
    lens = torch.tensor([len(samples[i].token_ids) for i in kept], dtype=torch.float64)
    want = -(adv[kept] * lens).sum() / n_tok if token_level else -adv[kept].sum() / len(kept)
    assert upd.loss.loss == pytest.approx(float(want), rel=1e-9, abs=1e-12)


def test_logs_draws_a_runs_curves_and_prints_its_heldout_table(tmp_path, capsys):
    import logs

    rows = [dict(step=s, heldout_pass1=0.1 * s, elapsed=60.0 * s) for s in (0, 4, 8)]
    rows[1] |= dict(reward_mean=0.5, response_len_mean=7.0)
    rows[2] |= dict(heldout_response_len_mean=12.25, heldout_truncated_frac=0.125)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logs.main([str(tmp_path)])
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "| 4 | 0.400 | - | - | - | 4.0 |" in out  # a figure the log lacks is "-"
    assert "| 8 | 0.800 | - | 12.2 | 0.125 | 8.0 |" in out
    assert "tool calls" not in out
    # a run with tools: calls per held-out response get a column
    rows[2] |= dict(heldout_tool_calls_mean=1.5, heldout_greedy=0.5)
    assert "| 8 | 0.800 | 0.500 | 12.2 | 0.125 | 1.50 | 8.0 |" in logs.heldout_table(rows)


def test_micro_batches_cover_every_row_once_within_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(200)]
    rows = list(range(0, 200, 2))
    for budget in (1, 64, 500, 4096, 10**6):
        mbs = distributed.micro_batches(lengths, rows, budget)
        flat = [r for mb in mbs for r in mb]
        assert sorted(flat) == rows
        for mb in mbs:
            assert len(mb) == 1 or len(mb) * max(lengths[r] for r in mb) <= budget


def test_shared_prompt_micro_batches_hold_whole_packs_within_budget(tok):
    """--share-prompt: every row lands in one pack of one micro-batch, a pack's rows share their
    prompt, and each micro-batch's packs, padded to its longest (prompt + responses), stay within
    the token budget unless one row alone is over it."""
    rng = random.Random(1)
    prompts = [tok(p)["input_ids"] for p in ("1+2+3=", "9+9+9=", "12+0+7=", "1+1+1=")]
    samples = [
        rollout.Sample(i, [5] * n, [-1.0] * n, False)
        for i in range(4)
        for n in [rng.randint(0, 40) for _ in range(8)]
    ]
    b = batch.make_batch(prompts, samples, torch.zeros(32), False, tok.pad_token_id)
    rows = list(range(0, 32, 3))
    for budget in (1, 30, 100, 10**6):
        mbs = batch.plan_micro_batches(b, rows, budget, True)
        assert sorted(r for mb in mbs for r in mb.rows) == rows
        for mb in mbs:
            assert sorted(i for p in mb.packs for i in p) == list(range(len(mb.rows)))
            sizes = []
            for p in mb.packs:
                assert len({samples[mb.rows[i]].prompt_idx for i in p}) == 1
                resp = [mb.lengths[i] - int(mb.resp_start[i]) for i in p]
                sizes.append(int(mb.resp_start[p[0]]) + sum(resp))
            assert len(sizes) * max(sizes) <= budget or len(mb.rows) == 1
        if budget == 10**6:  # everything fits: one micro-batch, one pack per prompt
            assert len(mbs) == 1 and len(mbs[0].packs) == 4


@pytest.mark.parametrize("estimator", ["grpo", "grpo_passk"])
def test_overlong_punishment_gives_a_signal_where_the_reward_has_none(tmp_path, estimator):
    # a reward that is always 0, and DAPO's punishment over the whole budget (8 tokens): a group's
    # responses of different lengths now differ in reward, so its samples train; with pass@k only
    # the shortest of each group (when no other is as short)
    (tmp_path / "zero.py").write_text("def reward(response, gold):\n    return 0.0\n")
    cfg = config(
        train.Config,
        engine="hf",
        steps=1,
        eval_every=0,
        prompts_per_step=8,
        group_size=4,
        reward=f"{tmp_path / 'zero.py'}:reward",
        overlong_buffer_length=8,
        adv_estimator=estimator,
        out_dir=str(tmp_path / "run"),
        quiet=True,
        save_final=False,
        plot=False,
    )
    row = train.train(cfg)["history"][1]
    assert row["reward_mean"] == 0.0 and row["zero_var_group_frac"] == 1.0  # raw rewards: uniform
    assert 0 < row["trained_frac"] <= (1.0 if estimator == "grpo" else 1 / 4)


def test_a_group_dynamic_sampling_rejected_does_not_train_when_shaping_makes_it_informative(
    tmp_path,
):
    # a reward that is always 0: dynamic sampling keeps no group, and the step measures on one of
    # the uniform groups it rejected; the overlong punishment makes its shaped rewards differ, but
    # a group dynamic sampling rejected has advantage 0: nothing trains
    (tmp_path / "zero.py").write_text("def reward(response, gold):\n    return 0.0\n")
    cfg = config(
        train.Config,
        engine="hf",
        steps=1,
        eval_every=0,
        prompts_per_step=4,
        group_size=4,
        reward=f"{tmp_path / 'zero.py'}:reward",
        overlong_buffer_length=8,
        temperature=2.5,  # responses of many lengths
        dynamic_sampling=True,
        dynamic_sampling_max_tries=1,
        out_dir=str(tmp_path / "run"),
        quiet=True,
        save_final=False,
        plot=False,
    )
    row = train.train(cfg)["history"][1]
    assert row["zero_var_group_frac"] == 1.0 and row["seqs"] == 4  # one uniform group measured
    assert 0 < row["truncated_frac"] < 1  # lengths differ: so do their shaped rewards
    assert row["trained_frac"] == 0.0 and row["adv_std"] == 0.0


def test_bad_flags_fail_with_one_line_before_any_model_loads(monkeypatch, tmp_path):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(model, "load_model", no_load)
    monkeypatch.setattr(bases, "ensure_tiny_base", no_load)
    for flags, needle in [
        (dict(group_size=1), "--group-size 1"),
        (dict(prompts_per_step=0), "--prompts-per-step 0"),
        (dict(lr=0.0), "--lr 0.0"),
        (dict(max_new_tokens=64), "--max-new-tokens 64"),
        (dict(minibatch_size=10_000), "--minibatch-size 10000"),
        (dict(model=str(tmp_path / "nope")), "--model"),
        (dict(answer="last-number"), "--answer last-number: chooses how the math task's reward"),
        (dict(overlong_buffer_length=9), "--overlong-buffer-length 9"),
        (dict(adv_estimator="grpo_passk", leave_one_out=True), "--adv-estimator grpo_passk"),
        (dict(pg="kl_cov"), "--pg kl_cov: with one minibatch"),
        (dict(pg="kl_cov", minibatch_size=256), "set --minibatch-size below"),
    ]:
        with pytest.raises(UserError) as e:
            train.train(config(train.Config, out_dir=str(tmp_path), **flags))
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_answer_flag_chooses_how_the_math_reward_reads_answers(tmp_path, base):
    # --answer reaches the run's reward: a response in prose scores only under last-number, a boxed
    # one under both
    base("smollm2")  # --model smollm2 is read from the cache
    problems = tmp_path / "add.jsonl"
    problems.write_text('{"problem": "What is 84 + 50?", "answer": "134"}\n')
    for answer, prose in (("boxed", 0.0), ("last-number", 1.0)):
        cfg = config(
            train.Config,
            task="math",
            data=str(problems),
            val_data=str(problems),
            model="smollm2",
            answer=answer,
            max_seq_len=160,
            max_new_tokens=96,
            out_dir=str(tmp_path),
        )
        task = data.load_task(cfg)
        assert task.reward_fn("84 + 50 = 134.", "134") == prose, answer
        assert task.reward_fn("So \\boxed{134}, from 84 + 50", "134") == 1.0, answer


def test_a_run_that_cannot_fit_in_memory_stops_with_one_line_naming_flags_before_any_model_loads(
    monkeypatch, tmp_path
):
    # 64 x 64 sequences of 4,096 tokens in one micro-batch: about 28 TB of activations even for the
    # tiny model
    if torch.cuda.is_available():
        pytest.skip("the memory check is CPU's (GPU runs are sized by --gpu-memory-utilization)")

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the memory check")

    monkeypatch.setattr(model, "load_model", no_load)
    flags = dict(
        out_dir=str(tmp_path),
        prompts_per_step=64,
        group_size=64,
        max_seq_len=4096,
        max_new_tokens=8,
        micro_batch_tokens=10**8,
    )
    with pytest.raises(UserError) as e:
        train.train(config(train.Config, **flags))
    msg = str(e.value)
    assert msg.startswith("memory: this run needs about") and "\n" not in msg, msg
    # a budget of one sequence fits
    assert "--micro-batch-tokens" in msg and "--no-memory-check" in msg, msg
    need = float(msg.split("needs about ")[1].split(" GiB")[0])
    assert need > 1000, msg


def test_kl_to_reference_starts_at_zero_and_grows(vllm_engine, tmp_path, monkeypatch):
    loads = []
    real_load = model.load_model
    monkeypatch.setattr(model, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    cfg = config(
        train.Config,
        steps=12,
        eval_every=0,
        kl_beta=0.05,
        lr=1e-3,
        out_dir=str(tmp_path),
        quiet=True,
        save_final=False,
    )
    rows = train.train(cfg, engine=vllm_engine)["history"][1:]
    assert len(loads) == 2  # the policy and the frozen reference
    assert rows[0]["kl"] == 0.0  # the first step's policy is the reference
    assert rows[-1]["kl"] > 1e-3 and rows[-1]["kl"] > rows[1]["kl"]


def test_beta_zero_loads_no_reference_model(vllm_engine, tmp_path, monkeypatch):
    loads = []
    real_load = model.load_model
    monkeypatch.setattr(model, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    rows = train.train(
        config(
            train.Config, steps=1, eval_every=0, out_dir=str(tmp_path), quiet=True, save_final=False
        ),
        engine=vllm_engine,
    )["history"]
    assert len(loads) == 1 and rows[1]["kl"] == 0.0


def test_dynamic_sampling_trains_only_on_informative_groups(vllm_engine, tmp_path):
    cfg = config(
        train.Config,
        steps=3,
        eval_every=0,
        dynamic_sampling=True,
        dynamic_sampling_max_tries=6,
        out_dir=str(tmp_path),
        quiet=True,
        save_final=False,
    )
    rows = train.train(cfg, engine=vllm_engine)["history"][1:]
    for r in rows:
        assert r["zero_var_group_frac"] > 0  # some groups were generated without signal...
        assert r["generation_rounds"] >= 2  # ...so more prompts were drawn...
        # ...and every kept group has signal: each has advantages of sample std 1, so their
        # population std over all sequences is sqrt((G-1)/G); a single zero-variance group among the
        # 32 would give 0.920
        assert r["adv_std"] == pytest.approx(math.sqrt(7 / 8), abs=2e-3)


def test_logged_means_count_every_sequence_even_when_overlong_filtering_masks_them(
    vllm_engine, tmp_path
):
    # max_new_tokens=1: every response is truncated, so overlong filtering leaves no sequence in the
    # loss; the step's logged means must still be over all its sequences (the loss's own counts once
    # overwrote them)
    cfg = config(
        train.Config,
        steps=1,
        eval_every=0,
        max_new_tokens=1,
        overlong_filter=True,
        out_dir=str(tmp_path),
        quiet=True,
        save_final=False,
        checkpoint_every=0,
    )
    row = train.train(cfg, engine=vllm_engine)["history"][1]
    assert row["truncated_frac"] == 1.0 and row["response_len_mean"] == 1.0
    assert 0.0 <= row["reward_mean"] <= 1.0 and row["loss"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dtype_flag_sets_the_training_compute_on_cpu(tiny_path, dtype):
    """--dtype bfloat16 on CPU computes the trainer's forward in bf16 (autocast over float32
    weights) in GRPO and DPO alike; float32 stays float32. Both against an independent float64
    forward of the same model."""
    lm = model.load_model(tiny_path)  # float32 master weights in either case
    seen = []
    lm.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda mod, inp, out: seen.append(out.dtype)
    )
    g = torch.Generator().manual_seed(0)
    prompt, resp = (
        torch.randint(3, 90, (4, 6), generator=g),
        torch.randint(3, 90, (4, 20), generator=g),
    )
    samples = [rollout.Sample(0, resp[i].tolist(), [0.0] * 20, False) for i in range(4)]
    # [4, 26], responses from position 6
    mb = batch.make_batch(
        [prompt[i].tolist() for i in range(4)],
        [replace(s, prompt_idx=i) for i, s in enumerate(samples)],
        torch.zeros(4),
        False,
        0,
    )
    cpu = torch.device("cpu")
    # [4, 20]
    logp = train.logprobs(
        model.LogprobModel(lm), mb, config(train.Config, dtype=dtype), cpu, grad=True
    )[0]
    # [4, 20] float64
    ref = model.plain_logprobs(
        model.load_model(tiny_path, dtype=torch.float64),
        mb.input_ids,
        mb.attention_mask,
        mb.resp_start,
        20,
    )[0]
    want = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert seen == [want], seen
    err = (logp.double() - ref).abs().max().item()
    assert (err < 0.1) if dtype == "bfloat16" else (err < 1e-4), err
    pairs = [
        dpo.Pair(tuple(prompt[i].tolist()), tuple(resp[i].tolist()), tuple(resp[i, :10].tolist()))
        for i in range(2)
    ]
    dpo.pair_logps(
        model.LogprobModel(lm), pairs, config(dpo.DPOConfig, dtype=dtype), cpu, pad_id=0, grad=False
    )
    assert seen == [want, want], seen


def test_an_fsdp_placeholder_micro_batch_is_two_tokens_whatever_the_batch(tok):
    # a rank with fewer micro-batches runs placeholders so FSDP's collectives line up; each must
    # cost two tokens, not the batch's longest row (which at 24K would be a second 24K-token pass)
    prompts = [[1] + [5] * 300, [1, 5]]
    samples = [
        rollout.Sample(0, [6] * 700, [-1.0] * 700, True),
        rollout.Sample(1, [6, 2], [-1.0, -1.0], False),
    ]
    b = batch.make_batch(prompts, samples, torch.tensor([1.0, -1.0]), False, 0)
    one, placeholder = batch.plan_micro_batches(b, [1], 10**6, False)[0], b.fsdp_placeholder()
    # trimmed to its own row
    assert one.rows == [1] and one.input_ids.shape == (1, 4) and one.T == 2
    assert placeholder.input_ids.shape == (1, 2) and placeholder.T == 1 and placeholder.rows == []
    assert (
        float(placeholder.loss_mask.sum()) == 0.0
        and float(placeholder.advantages.abs().sum()) == 0.0
    )
    m = model.load_model(model.resolve(bases.TINY))
    lp, _ = model.LogprobModel(m)(
        placeholder.input_ids, placeholder.attention_mask, placeholder.resp_start, placeholder.T
    )
    # its one response token goes through the LM head: every parameter takes part
    assert lp.shape == (
        1,
        1,
    )


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_batch_scaled_advantages_divide_by_the_std_of_every_reward(leave_one_out):
    """--adv-scale batch (train.advantages): each reward less its group's baseline (the mean, or
    the mean of the others), divided by the sample std of every reward of the step, against a
    float64 computation written out; an all-equal group keeps advantage 0."""
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    cfg = config(train.Config, adv_scale="batch", leave_one_out=leave_one_out)
    got = train.advantages(r, cfg)
    x = [[float(v) for v in row] for row in r.tolist()]
    flat = [v for row in x for v in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / (len(flat) - 1))
    G = len(x[0])
    want = [
        [
            (v - (sum(row) - v) / (G - 1) if leave_one_out else v - sum(row) / G) / (std + 1e-6)
            for v in row
        ]
        for row in x
    ]
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert got[2].abs().sum() == 0


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
@pytest.mark.parametrize("skip", [True, False])
def test_the_update_plan_runs_the_rows_whose_loss_term_can_be_nonzero(tiny_path, kl_beta, skip):
    """train.micro_batches_of: with --skip-zero-advantage, a row runs when some token counts in
    the loss and, unless the KL term is on (it does not vanish with A), its advantage is not 0;
    without it every row runs. Rows: A = 1 with loss tokens, A = 0 with loss tokens, A = 1
    overlong-filtered."""
    samples = [rollout.Sample(0, [5, 6], [0.0, 0.0], t) for t in (False, False, True)]
    b = batch.make_batch([[1, 2, 3]], samples, torch.tensor([1.0, 0.0, 1.0]), True, 0)
    cfg = config(train.Config, kl_beta=kl_beta, skip_zero_advantage=skip)
    m = model.LogprobModel(model.load_model(tiny_path))
    ran = sorted(r for mb in train.micro_batches_of(m, b, b.rows, cfg, skip=True) for r in mb.rows)
    assert ran == ([0, 1] if kl_beta else [0]) if skip else [0, 1, 2]
    # the reference model's pass (skip=False) runs every row
    assert sorted(
        r for mb in train.micro_batches_of(m, b, b.rows, cfg, skip=False) for r in mb.rows
    ) == [
        0,
        1,
        2,
    ]


# TRL 1.16.0 trl/trainer/grpo_trainer.py GRPOTrainer.get_high_entropy_mask(entropies, mask,
# threshold=1 - q) on these entropies and mask, one process: {q: mask}
TRL_ENT = [[0.452, 1.1165, 1.1751, 1.3639], [1.4908, 0.4553, 1.6198, 1.2612],
           [0.3918, 0.3055, 0.963, 1.835]]  # fmt: skip
TRL_TOP = {
    0.2: [[0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]],
    0.5: [[0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 1, 0]],
}


def entropy_batch(advantages):
    """One group of responses of 4, 2 and 3 tokens to a one-token prompt (and a fourth of 4 tokens
    when four advantages are given)."""
    lens = [4, 2, 3, 4][: len(advantages)]
    samples = [rollout.Sample(0, [5] * n, [-1.0] * n, False) for n in lens]
    return batch.make_batch([[1]], samples, torch.tensor(advantages), False, 0)


def ref_quantile(values, q):
    """torch.quantile's linear interpolation, in plain Python."""
    v, at = sorted(values), q * (len(values) - 1)
    lo = int(at)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (at - lo)


@pytest.mark.parametrize("q", list(TRL_TOP))
def test_high_entropy_tokens_are_trls_the_top_q_of_every_loss_token(q):
    b = entropy_batch([1.0, -1.0, 0.5])
    ent = torch.tensor(TRL_ENT)
    got = token_picks.high_entropy(b, ent, q, [b.rows])  # one minibatch: every row
    assert got.int().tolist() == TRL_TOP[q]
    # a row of A = 0 counts too (TRL's population); against the quantile in plain Python
    b = entropy_batch([1.0, -1.0, 0.5, 0.0])
    ent4 = torch.cat([ent, torch.tensor([[9.0, 9.0, 9.0, 9.0]])])
    got = token_picks.high_entropy(b, ent4, q, [b.rows])
    mask = b.loss_mask.tolist()
    counted = [e for row, m in zip(ent4.tolist(), mask) for e, k in zip(row, m) if k]
    at = ref_quantile(counted, 1 - q)
    assert got.tolist() == ((ent4 >= at).float() * b.loss_mask).tolist()


def test_the_quantile_is_torchs_below_its_limit_and_exact_above_it():
    # below 2^24 values: torch.quantile's value, bit for bit (sizes, ties, q at the ends)
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 10, 1001, 65536):
        for x in (torch.rand(n, generator=g), torch.randint(0, 5, (n,), generator=g).float()):
            for q in (0.0, 0.2, 0.5, 0.8, 0.999, 1.0):
                assert token_picks.quantile(x, q) == torch.quantile(x.double(), q), (n, q)


def test_high_entropy_tokens_past_torch_quantiles_limit_of_2_to_the_24():
    # 2^24 + 2 loss tokens in one minibatch (torch.quantile: "input tensor is too large"): the
    # entropies a permutation of 0 .. M - 1, whose (1 - q) quantile is (1 - q)(M - 1) itself
    M, q = 2**24 + 2, 0.2
    ent = torch.randperm(M, generator=torch.Generator().manual_seed(0)).double().view(2, M // 2)
    ones = torch.ones(2, M // 2)
    b = batch.Batch(
        input_ids=torch.zeros(2, 1, dtype=torch.long), attention_mask=torch.ones(2, 1),
        resp_start=torch.zeros(2, dtype=torch.long), resp_mask=ones, gen_logp=ones,
        advantages=torch.ones(2), loss_mask=ones, truncated=torch.zeros(2, dtype=torch.bool),
        lengths=[M // 2] * 2, rows=[0, 1],
    )  # fmt: skip
    got = token_picks.high_entropy(b, ent, q, [b.rows])
    at = (1 - q) * (M - 1)  # in float64, as exact as the quantile
    assert int(got.sum()) == M - math.ceil(at)
    assert torch.equal(got.bool(), ent >= at)


def test_clip_cov_skips_zero_advantage_rows_in_the_update_not_in_the_old_pass(tiny_path, tok):
    # Clip-Cov's loss is PPO's with the covariance mask's tokens' terms zeroed: a row of A = 0 adds
    # exactly 0,
    # so the update skips it, while the covariance the picks come from counts every loss token:
    # the old pass runs every row. Two minibatches (the second's ratio is not 1), float64: the
    # weights equal those of computing every row
    g = torch.Generator().manual_seed(5)
    P, G = 4, 3
    prompts = [tok(f"{a}+{a + 2}=")["input_ids"] for a in range(P)]
    samples = [
        rollout.Sample(i, torch.randint(4, 30, (n,), generator=g).tolist(), [-1.0] * n, False)
        for i in range(P)
        for n in torch.randint(2, 6, (G,), generator=g).tolist()
    ]
    adv = torch.randn(P * G, generator=g, dtype=torch.float64)
    adv[[3, 4, 5, 7]] = 0.0  # a uniform group, and a sample at its group's mean
    b = batch.make_batch(prompts, samples, adv, False, tok.pad_token_id)
    b = replace(b, gen_logp=b.gen_logp.double())
    flags = dict(clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0, micro_batch_tokens=24)
    cpu, weights = torch.device("cpu"), {}
    for skip in (True, False):
        cfg = config(
            train.Config, prompts_per_step=P, group_size=G, minibatch_size=6, pg="clip_cov",
            lr=1e-2, weight_decay=0.0, skip_zero_advantage=skip, **flags,
        )  # fmt: skip
        policy = model.load_trainable(tiny_path, cpu, False, dtype=torch.float64)
        old = train.old_logprobs(policy, None, b, cfg, cpu)
        # the old pass covered every row; the picks include tokens of A = 0 rows
        assert (old.old_logp * old.loss_mask != 0).sum(1).tolist() == old.loss_mask.sum(1).tolist()
        assert old.covariance_mask[adv == 0].any() and old.covariance_mask[adv != 0].any()
        ran = sorted(
            r
            for mb in train.micro_batches_of(policy, old, old.rows, cfg, skip=True)
            for r in mb.rows
        )
        assert ran == ([i for i in range(P * G) if adv[i] != 0] if skip else list(range(P * G)))
        opt = torch.optim.SGD(policy.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        upd = train.update_policy(policy, opt, sched, old, cfg, cpu)
        assert upd.seqs == len(ran)
        weights[skip] = {n: p.detach().clone() for n, p in policy.lm.named_parameters()}
    start = model.load_trainable(tiny_path, cpu, False, dtype=torch.float64)
    moved = max((weights[False][n] - p).abs().max() for n, p in start.lm.named_parameters())
    assert moved > 1e-5  # the update did something
    for name in weights[False]:
        assert torch.allclose(weights[True][name], weights[False][name], rtol=0, atol=1e-13), name


def test_heldout_rows_carry_the_mean_length_and_truncated_fraction_of_the_samples(tiny_path, tok):
    # the held-out pass's k samples, as the training rows count theirs: mean tokens, fraction cut
    # off at the limit (per-prompt limits 1 and 40: some cut, some not); against the same seeded
    # samples drawn again and counted here
    import eval_aime

    engine = rollout.HFEngine(tiny_path)
    prompts = [tok(f"{a}+{a + 1}+2=")["input_ids"] for a in range(4)]
    caps, k = [1, 40, 1, 40], 3
    row = eval_aime.heldout_accuracy(
        engine, tok, prompts, ["0"] * 4, lambda text, gold: 0.0, k, caps, 1.0, seed=7
    )
    again = engine.generate(prompts, n=k, max_tokens=caps, temperature=1.0, seed=7)
    lengths = [len(x.token_ids) for x in again]
    cut = [x.truncated for x in again]
    assert 0 < sum(cut) < len(cut)
    assert row["heldout_response_len_mean"] == pytest.approx(sum(lengths) / len(lengths), 1e-12)
    assert row["heldout_truncated_frac"] == pytest.approx(sum(cut) / len(cut), abs=1e-12)
