"""One-line errors: how a command says that a flag, an input file or a run is wrong, and how it ends
then.

What it does: UserError is the exception for what the user has to fix (a flag, a file and its row, a
run that cannot go on); its message is one line that names it. Library functions raise it, so a
notebook that calls data.load_problems gets an exception it can catch, never an exit; only the entry
points (train.py, dpo.py, eval_aime.py, logs.py, tools/recipe.py, demo/tasks.py, tools/bench.py) end
the command with it: one_line_errors prints `error: <message>` on stderr and exits with status 2, or
with 130 when a Ctrl-C stopped the run. check() raises the first failed (condition, message) of a
list; writable() is the condition every output flag checks. grpo_flags checks train.py's flags,
each concern's checks together (the loss's, LoRA's, --reward's, the run's), before anything loads.
demo_function loads a function of demo/ by path, where a built-in name is resolved.

What it does not do: check DPO's or eval_aime.py's flags (each entry point's validate does), files
(data.py does), or whether a run fits in memory (memory.preflight).
"""

import os
import runpy
import sys
from pathlib import Path


class UserError(Exception):
    """Something the user has to fix, named in one line: a flag and its value, a file and its row, a
    step."""


# (condition, the one line said when it is false): what each concern's checks return
Checks = list[tuple[bool, str]]


def check(checks: Checks) -> None:
    """Raises UserError with the message of the first failed check."""
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)


def one_line_errors(run) -> None:
    """An entry point's end: a UserError becomes one line on stderr and exit status 2; a run stopped
    by Ctrl-C (which has said where its checkpoint is) exits with status 130, the shell's code for
    SIGINT, no traceback."""
    try:
        run()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def writable(folder: Path) -> bool:
    """Whether `folder` exists as a writable folder, or could be created (its nearest existing
    parent is)."""
    folder = Path(folder).absolute()
    while not folder.exists():
        if folder.parent == folder:
            return False
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def grpo_flags(cfg, world: int) -> None:
    """train.py's flags (train.Config) on `world` ranks: one clear line for a bad one, before any
    model or engine is loaded: GRPO's own flags, the loss's (grpo.config_error), LoRA's, --reward's,
    and those every run has (runtime.run_checks)."""
    # imported here: each of these imports this file for its errors
    import data
    import grpo
    import lora
    import runtime
    import user_reward

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


def demo_function(spec: str):
    """The function `file.py:name` of demo/, loaded by its path where a built-in name is resolved
    (--model tiny, the sum3 task): the core imports nothing from demo/, which builds on the core."""
    path, _, name = spec.rpartition(":")
    return runpy.run_path(str(Path(__file__).resolve().parent / "demo" / path))[name]
