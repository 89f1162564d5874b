"""Memory per rank for GRPO training, estimated on paper from a model's config: `python memory.py
[--config DIR]`.

What it does: prints a markdown table (the one in docs/distributed.md) of the memory one rank needs
at 8K, 16K and 24K tokens, as train.py runs the DeepScaleR stages: FSDP2 over N ranks with float32
weights, gradients and AdamW moments (sharded), bf16 gathers for compute (FSDP2's mixed-precision
policy, train.py's GPU default under torchrun; `--precision autocast`: float32 gathers, and without
checkpointing autocast's bf16 weight copies kept for backward), activations of one micro-batch,
the chunked LM head, the gradients a minibatch
accumulates unsharded (one reduction per minibatch), and vLLM's part: the share of the GPU it takes
while it generates (the stage preset's gpu_memory_utilization) against the KV cache a rank's
sequences need. While the trainer runs, the engine sleeps and holds (almost) nothing. `--device cpu`
estimates a CPU run instead (float32 compute, each rank's engine holding float32 weights and
its KV cache (memory.kv_cache_gib), and the process's own libraries), the case docs/distributed.md
measures. The default config is DeepSeek-R1-Distill-Qwen-1.5B's (Qwen2, untied embeddings: 1.78B
parameters). The frozen reference copy for the KL term is counted where the stage presets turn it on
(16K and 24K). `--lora-rank R` estimates a LoRA run (train.py --lora-rank R, on every linear layer
but the LM head): gradients and AdamW moments of the adapters only, and no reference copy (the base
with adapters off is the reference).

What it does not do: measure. These are estimates; docs/distributed.md puts measurements beside
them. `tokens` (--lengths) is one micro-batch's padded tokens, rows x its longest row (train.py's
--micro-batch-tokens, or one sequence's length where a sequence is longer), not a sequence's length:
64 sequences of 160 tokens under the default budget of 8192 are micro-batches of 51 rows, 8,160
tokens. Activation bytes per token per layer kept for backward (b bytes per compute value: 2 in
bf16, 4 in float32; SDPA attention, transformers' default, so no heads x S^2 scores; SwiGLU MLP), as
counted with torch.autograd.graph.saved_tensors_hooks on SmolLM2 in float32 (48.5 KB;
docs/distributed.md):
  two RMSNorms: each its input and its normalized input; the projections' inputs  -> b * 6H
  SDPA: Q, K and V repeated to every head (transformers' repeat_kv), the output
                                                                     -> b * 4 * heads * head_dim
  MLP: gate, up, SiLU(gate), their product                                        -> b * 4I
  on CPU, SDPA also keeps a float32 copy of the [rows, 1, S, S] padding mask per layer
                                                                     -> 4S (S: the longest row)
  backward of one layer: about as much again (the gradients of those activations)
With checkpointing only each layer's input (4H bytes: the residual stream is float32) is kept, plus
one layer's full activations and their gradients while it is recomputed. The LM head's chunk:
logits, softmax and their gradients, 16 V bytes for each of min(chunk, tokens) positions (only
response positions reach it: an upper bound).
"""

import os
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from transformers import AutoConfig

import data
import distributed
import model
from checks import Checks, UserError

GiB = 2**30
GPU_GIB = 80.0  # an H100 / A100 80 GB
# vLLM's share of each GPU in train.py's stage presets (kept equal by tests/test_math.py)
STAGE_SHARES = {8192: 0.6, 16384: 0.8, 24576: 0.85}


@dataclass
class Shape:
    hidden: int = 1536
    intermediate: int = 8960
    layers: int = 28
    heads: int = 12
    kv_heads: int = 2
    vocab: int = 151936
    tied: bool = False
    head_dim: int = 0  # 0: hidden / heads (Qwen3 and Gemma set their own)

    @classmethod
    def from_config(cls, path: str, trust_remote_code: bool = False) -> "Shape":
        """The shape of an HF model folder, or of one in the cache by name (`tiny`, `smollm2` once
        the demo built them: model.resolve)."""
        c = AutoConfig.from_pretrained(model.resolve(path), trust_remote_code=trust_remote_code)
        return cls(
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.vocab_size,
            bool(getattr(c, "tie_word_embeddings", False)),
            getattr(c, "head_dim", None) or 0,
        )

    def params(self) -> tuple[int, int]:
        """(per decoder layer, everything else: embedding, LM head, final norm)"""
        H, I, kv = self.hidden, self.intermediate, self.kv_dim
        # qkv (+bias), o, mlp, 2 norms
        layer = H * (H + 2 * kv) + (H + 2 * kv) + H * H + 3 * H * I + 2 * H
        rest = self.vocab * H * (1 if self.tied else 2) + H
        return layer, rest

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    def lora_params(self, rank: int) -> int:
        """Adapter parameters on every linear layer but the LM head: r x (in + out) for each of q,
        k, v, o (H -> H, H -> kv, H -> kv, H -> H) and gate, up, down (H -> I, H -> I, I -> H)."""
        H, I, kv = self.hidden, self.intermediate, self.kv_dim
        return rank * (9 * H + 2 * kv + 3 * I) * self.layers


def engine_kv_cache_gib(
    s: Shape, seqs: int, seq_len: int, dtype_bytes: int = 4, tp: int = 1
) -> float:
    """vLLM's CPU KV cache, on each of an engine's `tp` workers, for `seqs` sequences of up to
    `seq_len` tokens held at once (one engine's share of a step: P / engines x G), in vLLM's CPU
    blocks of 128 tokens: room for every sequence of the step, so that none is preempted and
    recomputed (a fixed 1 GiB held 1.04 GiB of SmolLM2's float32 K/V at 16 x 8 x 186 tokens). vLLM
    keeps one block for itself (its null block), and on CPU runs at most 256 sequences a worker at
    once; a worker holds 1 / tp of the KV heads (rounded up: replicated where there are fewer).
    Never room for less than one sequence: an engine with nothing to generate (an evaluation rank
    with no prompts) still has to start."""
    blocks = max(min(seqs, 256 * tp), 1) * -(-seq_len // 128) + 1
    head_dim = s.head_dim or s.hidden // s.heads
    per_token = 2 * s.layers * -(-s.kv_heads // tp) * head_dim * dtype_bytes
    return blocks * 128 * per_token / GiB


def estimate(
    s: Shape,
    tokens: int,
    ranks: int = 8,
    seqs_per_rank: int = 128,
    chunk_tokens: int = 1024,
    checkpointing: bool = True,
    micro_batches: int = 2,
    device: Literal["gpu", "cpu"] = "gpu",
    vllm_fraction: float | None = None,
    gpu_gib: float = GPU_GIB,
    kv_cache_gib: float = 1.0,
    process_gib: float = 0.45,
    lora_rank: int = 0,
    reference: bool | None = None,
    entropy_bonus: bool = False,
    seq_len: int = 0,
    precision: Literal["autocast", "fsdp"] = "fsdp",
    attention_tokens: int = 0,
) -> dict[str, float]:
    """GiB per rank, one micro-batch of `tokens` padded tokens whose longest row is `seq_len` (0:
    one sequence of `tokens`). micro_batches: per minibatch on this rank (more than one: the
    gradients accumulate unsharded until the minibatch's one reduction). lora_rank > 0: LoRA
    adapters train, the base is frozen. reference: whether the KL term is on (default: as the stage
    presets, beyond 8K tokens). precision: how a GPU's bf16 compute is had (train.py
    --mixed-precision): autocast over float32 gathers, or FSDP2's policy (bf16 gathers); on CPU
    compute is float32 and this changes nothing. attention_tokens: the tokens attention keeps its
    tensors for (0: `tokens`); with shared prompts (train.py --share-prompt) each row's prompt and
    response, fastpaths.packed_attention's per-row copies, more than the packed tokens the budget
    counts. entropy_bonus: the LM head's backward also takes the entropy's gradient (train.py
    --entropy-coeff)."""
    layer, rest = s.params()
    P = layer * s.layers + rest
    # what trains: gradients and AdamW moments exist for these
    T = s.lora_params(lora_rank) if lora_rank else P
    reference = tokens > 8192 if reference is None else reference
    b = 2 if device == "gpu" else 4  # compute bytes: autocast's bf16 on GPU, float32 on CPU
    H, I, S = s.hidden, s.intermediate, seq_len or tokens
    head_dim = H // s.heads
    act_layer = b * (6 * H + 4 * s.heads * head_dim + 4 * I)  # bytes / token / layer
    if device == "cpu":
        act_layer += 4 * S  # CPU SDPA's float32 copy of the padding mask, [rows, 1, S, S] per layer
    # attention's part for each token it keeps beyond the micro-batch's own
    act_layer += b * 4 * s.heads * head_dim * max((attention_tokens or tokens) - tokens, 0) / tokens
    autocast = device == "gpu" and precision == "autocast"
    # bytes per gathered weight and per value of the residual stream (the layer inputs checkpointing
    # keeps): float32 under autocast and on CPU, bf16 under FSDP2's policy
    wide = 4 if device == "cpu" or autocast else 2
    if checkpointing:
        acts = (wide * H * s.layers + 2 * act_layer) * tokens
    else:
        acts = (act_layer * s.layers + act_layer) * tokens
    # Autocast casts each float32 weight to bf16 in every op, and a matmul keeps its bf16 operand
    # for backward: without checkpointing, a bf16 copy of every decoder layer's weights lives until
    # the backward reaches it (with checkpointing only the layer being recomputed has them, and
    # FSDP2's bf16 policy computes in the gathered weights themselves). The LM head's operand is
    # not among them: fastpaths.head_grads casts it again in backward.
    copies = 2 * layer * s.layers if autocast and not checkpointing else 0
    # the trainer's memory while it trains, in bytes (totals: their sum is its peak)
    training = {
        "fp32 weights (sharded)": 4 * (P + (T if lora_rank else 0)) / ranks,
        "AdamW moments (sharded)": 8 * T / ranks,
        "fp32 gradients (sharded)": 4 * T / ranks,
        "fp32 gradients accumulating (unsharded)": 4 * T if micro_batches > 1 and ranks > 1 else 0,
        # the frozen start model for the KL term; with LoRA the base with adapters off is that
        # model: no copy
        "reference copy for the KL term (fp32, sharded)": (
            4 * P / ranks if reference and not lora_rank else 0
        ),
        "gathered: root + 2 layers (fp32; bf16 under FSDP2's policy)": (
            wide * (rest + 2 * layer) if ranks > 1 else 0
        ),
        "root's full gradients in backward (embedding, head)": (
            4 * rest if ranks > 1 and micro_batches == 1 and not lora_rank else 0
        ),
        # FSDP2 gathers a group into one flat buffer, then copies it out into the parameters (and
        # reduces from one flat copy of the gradients): for a moment the largest group, the root,
        # exists twice
        "FSDP's flat gather / reduce buffer (the root's group)": wide * rest if ranks > 1 else 0,
        "activations (one micro-batch)": acts,
        "autocast's bf16 weight copies, kept for backward": copies,
        # the hidden states and the gathered rows
        "LM head: final hidden states (fp32)": 2 * 4 * H * tokens,
        # the entropy bonus's gradient holds up to three more (fastpaths.HeadLogprob)
        "LM head: one chunk's logits, softmax and their gradients": (4 + 3 * entropy_bonus)
        * 4
        * min(chunk_tokens, tokens)
        * s.vocab,
    }
    rows = {"parameters (B)": P / 1e9, "trainable parameters (M)": T / 1e6}
    rows |= {k: v / GiB for k, v in training.items()}
    if device == "gpu":
        share = STAGE_SHARES.get(tokens, 0.6) if vllm_fraction is None else vllm_fraction
        rows["vLLM share while generating (gpu_memory_utilization)"] = share * gpu_gib
        rows["vLLM weights (bf16)"] = 2 * P / GiB
        # K and V of every layer in bf16
        rows["vLLM KV cache, a rank's sequences at full length"] = (
            2 * s.layers * s.kv_dim * 2 * tokens * seqs_per_rank / GiB
        )
    else:
        rows["vLLM weights (fp32, a full copy per rank)"] = 4 * P / GiB
        rows["vLLM KV cache (kv_cache_memory_bytes)"] = kv_cache_gib
        # measured on the tiny base (2026-12-05): Python, torch, transformers and this project
        # imported hold 0.43 GiB, with vLLM 0.60; a run's peak 0.82 GiB with vLLM, 0.54 without
        rows["vLLM's own libraries and buffers (CPU)"] = 0.35
        rows["the process itself (Python, torch, transformers)"] = process_gib
        # glibc's heap keeps freed tensors for reuse (distributed.reuse_freed_memory), and a pass's
        # tensors of many sizes do not fit back into each other's holes: what the heap holds beyond
        # the live tensors grows with the micro-batch's tokens, not with what checkpointing keeps.
        # Measured on SmolLM2 (float32, 2.4K-8.2K tokens, with and without checkpointing;
        # docs/results.md, "Memory on CPU"): a third of its 30 layers' activations a token, and
        # about 0.6 GiB beside them, taken here as a step's float32 copy of the weights
        # (the refit's gathered buckets, the optimizer's temporaries: 0.5 GiB at 135M, nothing in
        # the tiny base); then as much again, up to the GiB by which
        # distributed.release_freed_memory lets the heap grow before it trims
        freed = (s.layers / 3 * act_layer * tokens + 4 * P) / GiB
        rows["the process's heap beyond its live tensors (CPU)"] = freed + min(freed, 1.0)
    return rows


# estimate's rows past the trainer's: the engine's and (CPU) the process's own
ENGINE = ("vLLM", "the process")
# what the trainer keeps while vLLM generates
RESIDENT = (
    "fp32 weights (sharded)",
    "AdamW moments (sharded)",
    "reference copy for the KL term (fp32, sharded)",
)


def totals(rows: dict[str, float]) -> dict[str, float]:
    """The sums a reader checks: the trainer's peak, and (GPU) whether vLLM's share fits beside what
    the trainer keeps while it generates, and how much KV cache the share leaves; (CPU) the whole
    process's peak."""
    # the trainer's rows: those past the two parameter counts that are not the engine's
    train = sum(v for k, v in list(rows.items())[2:] if not k.startswith(ENGINE))
    if "vLLM share while generating (gpu_memory_utilization)" not in rows:
        engine = sum(v for k, v in rows.items() if k.startswith(ENGINE))
        return {
            "training peak": train,
            "process peak (trainer + engine + libraries)": train + engine,
        }
    share = rows["vLLM share while generating (gpu_memory_utilization)"]
    return {
        "training peak (vLLM asleep)": train,
        "while generating: trainer's resident state + vLLM's share": sum(rows[k] for k in RESIDENT)
        + share,
        "KV cache the share leaves (share - weights - ~2 GiB of activations)": share
        - rows["vLLM weights (bf16)"]
        - 2.0,
    }


def table(s: Shape, lengths=(8192, 16384, 24576), **kw) -> str:
    rows = {n: estimate(s, n, **kw) for n in lengths}
    tots = {n: totals(rows[n]) for n in lengths}
    out = [
        "| GiB per rank | "
        + " | ".join(f"{n // 1024}K tokens" if n % 1024 == 0 else f"{n:,} tokens" for n in lengths)
        + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for k in rows[lengths[0]]:
        out.append(f"| {k} | " + " | ".join(f"{rows[n][k]:.2f}" for n in lengths) + " |")
    for k in tots[lengths[0]]:
        out.append(f"| **{k}** | " + " | ".join(f"**{tots[n][k]:.1f}**" for n in lengths) + " |")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# The pre-flight of a GRPO run: its memory need against the machine's, before any model loads


def kv_cache_gib(
    cfg, s: Shape, world: int, dtype_bytes: int, seq_len: int = 0, heldout: tuple = ()
) -> float:
    """A GRPO run's (train.Config) --kv-cache-gib, else room for the most sequences one engine
    holds at once, each of its tensor-parallel ranks a 1 / TP part of the heads: a step's (P /
    engines x G of `seq_len` tokens, default --max-seq-len), or with --eval-every a held-out
    pass's (its share of `heldout` = (prompts, their longest sequence), default (--eval-prompts,
    --max-seq-len), x --eval-samples), and at least one sequence of --max-seq-len: vLLM refuses to
    start an engine whose cache cannot hold one sequence of its max_model_len (and points at
    gpu_memory_utilization, which sizes nothing on CPU)."""
    if cfg.kv_cache_gib:
        return cfg.kv_cache_gib
    tp = cfg.tensor_parallel_size
    engines = max(world // tp, 1)
    size = lambda seqs, L: engine_kv_cache_gib(s, seqs, L, dtype_bytes, tp)  # noqa: E731
    need = [
        size(cfg.prompts_per_step // engines * cfg.group_size, seq_len or cfg.max_seq_len),
        size(1, cfg.max_seq_len),
    ]
    if cfg.run.eval_every:
        prompts, L = heldout or (cfg.eval_prompts, cfg.max_seq_len)
        need.append(size(-(-prompts // engines) * cfg.run.eval_samples, L))
    return max(need)


def need_gib(cfg, s: Shape, world: int, checkpointing: bool, micro_batch_tokens: int) -> float:
    """The estimate of one process's peak on CPU for a GRPO run (train.Config), from the shape in
    the model's config.json: the trainer (sharded over `world`), its engine, and one micro-batch
    of the worst case: rows of --max-seq-len (with --share-prompt, packs of a long prompt and full
    responses, whose attention keeps each row's prompt again)."""
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
    width = 2 if cfg.run.dtype == "bfloat16" else 4
    kv_gib = float(env) if env else kv_cache_gib(cfg, s, world, width)
    kv_gib = kv_gib if cfg.engine == "vllm" else 0.0
    rows_gib = estimate(
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
        entropy_bonus=cfg.loss.entropy_coeff != 0,
        seq_len=L,
        attention_tokens=attention,
    )
    if cfg.engine == "hf":  # a float32 copy of the model, and no KV cache reserved
        rows_gib["vLLM's own libraries and buffers (CPU)"] = 0.0
    return totals(rows_gib)["process peak (trainer + engine + libraries)"]


def engine_checks(gpu_memory_utilization: float, kv_cache_gib: float = 0.0) -> Checks:
    """The engine's memory flags (train.py's and eval_aime.py's), each a one-line check: the GPU
    share vLLM may take, the CPU KV cache's size, and VLLM_CPU_KVCACHE_SPACE, which vLLM reads
    with int() in its start-up ("1.5" would stop the run there, after the model loaded)."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    return [
        (
            0 < gpu_memory_utilization < 1,
            f"--gpu-memory-utilization {gpu_memory_utilization}: must be a fraction in (0, 1)",
        ),
        (kv_cache_gib >= 0, f"--kv-cache-gib {kv_cache_gib}: must be 0 (auto) or more"),
        (
            (space or "0").isdigit(),
            f"VLLM_CPU_KVCACHE_SPACE={space}: vLLM takes whole GiB (--kv-cache-gib takes "
            "fractions)",
        ),
    ]


def preflight(cfg, world: int) -> None:
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
    shape = Shape.from_config(data.model_path(cfg), cfg.run.trust_remote_code)
    need = need_gib(cfg, shape, world, ckpt, budget)
    if need <= have:
        return
    # the first that fits of: checkpointing as given, then on; the budget as given, then smaller
    tries = (
        (c, t)
        for c in sorted({ckpt, True})
        for t in sorted({budget, 8192, 4096, 2048, 1024, 512}, reverse=True)
        if t <= budget and need_gib(cfg, shape, world, c, t) <= have
    )
    fits = next(tries, None)
    if fits is None:
        way = (
            "no --micro-batch-tokens or --activation-checkpointing fits: "
            "fewer --prompts-per-step or more ranks"
        )
    else:
        flags = ["--activation-checkpointing"] * (fits[0] and not ckpt) + [
            f"--micro-batch-tokens {fits[1]}"
        ] * (fits[1] != budget)
        way = f"{' '.join(flags)} would fit ({need_gib(cfg, shape, world, *fits):.1f} GiB)"
    raise UserError(
        f"memory: this run needs about {need:.1f} GiB per process (memory.py) "
        f"and {have:.1f} GiB is available "
        f"to each of this machine's {distributed.local_world_size()} processes; {way}; "
        "--no-memory-check runs anyway"
    )


if __name__ == "__main__":

    def main(
        model: str = "",
        ranks: int = 8,
        seqs_per_rank: int = 128,
        chunk_tokens: int = 1024,
        checkpointing: bool = True,
        micro_batches: int = 2,
        device: Literal["gpu", "cpu"] = "gpu",
        vllm_fraction: float | None = None,
        gpu_gib: float = GPU_GIB,
        lengths: tuple[int, ...] = (8192, 16384, 24576),
        seq_len: int = 0,
        kv_cache_gib: float = 1.0,
        process_gib: float = 0.45,
        lora_rank: int = 0,
        precision: Literal["autocast", "fsdp"] = "fsdp",
    ):
        """Memory per rank of a GRPO run, estimated from a model's config.json.

        Args:
            model: an HF model folder or the name of one in the cache, as train.py's --model
                (default: DeepSeek-R1-Distill-Qwen-1.5B's shape).
            ranks: GPUs (or CPU processes) the run is sharded over.
            seqs_per_rank: sequences a rank generates per step (the KV cache's size).
            chunk_tokens: train.py's --logprob-chunk-tokens.
            checkpointing: train.py's --activation-checkpointing.
            micro_batches: micro-batches per minibatch on one rank.
            device: gpu, or cpu for a CPU run's resident memory.
            vllm_fraction: vLLM's GPU share (default: the stage preset's for 8K / 16K / 24K).
            gpu_gib: one GPU's memory.
            lengths: one micro-batch's padded tokens (rows x longest row), one table column each.
            seq_len: the micro-batch's longest row (0: one sequence of `lengths` tokens).
            kv_cache_gib: --device cpu: vLLM's KV cache (train.py --kv-cache-gib).
            process_gib: --device cpu: what a process holds besides the model (torch, vLLM).
            lora_rank: LoRA adapters of this rank on every linear layer but the LM head (0: full
                fine-tuning).
            precision: a GPU's bf16 policy (train.py --mixed-precision; fsdp, its default under
                torchrun).
        """
        kw = dict(locals())  # every flag but these two is an argument of estimate()
        path, lengths = kw.pop("model"), kw.pop("lengths")
        print(table(Shape.from_config(path) if path else Shape(), lengths, **kw))

    tyro.cli(main)
