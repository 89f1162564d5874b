"""Rollouts with tool calls: a response that calls a tool stops at the call's end, the tool runs,
its output is appended, and the engine goes on from there, token for token.

One response, as the engine and the trainer see it (--tool calculator; the tags are toolbox.py's):

    prompt    What is 5 + 8 + 3 + 6 + 9?
    sampled   <calc>5 + 8 + 3 + 6 + 9</calc>          generation stops at the stop string </calc>
    tool      <result>31</result>                     toolbox.Toolbox.call, tokenized on its own
    sampled   The answer is 31.<|im_end|>             the engine goes on from prompt + all above

What it does:
- generate(engine, prompts, ..., tools): Engine.generate's samples, calling tools along the way. A
  round generates every unfinished response until EOS, its limit or a call's end; each call runs
  and its output, `<result>OUTPUT</result>`, is tokenized alone and appended; the next round goes
  on from prompt + every token so far (the engine's prefix cache holds the prompt and the earlier
  rounds). It ends at EOS, at the response's limit (which counts every token, the tools' too: an
  output that would cross it is cut there, so prompt + response never exceeds --max-seq-len), or
  right after the --max-tool-calls-th call's output.
- Exact to the tokens: the sampled tokens are never decoded and re-encoded; the trainer trains on
  exactly the ids the engine saw (batch.make_batch). Sample.tool_mask marks the tools' tokens: they
  have no engine logprob (0.0 in Sample.logprobs), no loss, and no place in the ratio, KL, entropy,
  mismatch metrics or the overlong count, while the model attends to them as to any token.
- model_text(tok, sample): the text the reward scores, the model's own: the sampled tokens with
  every call and its output left out, so an answer the model never wrote (the last number inside a
  tool's output) never scores.

What it does not do: run the tools or guard against them (toolbox.py), or re-render conversations
through a chat template (the response is one assistant turn; a tool's output is plain text in it).
"""

import re
from dataclasses import dataclass, replace

import toolbox

# (rollout.py's Engine and Sample go in and out; not imported: rollout needs data.py, which needs
# this file)


@dataclass
class Tools:
    """A run's tools (--tool) as generate uses them."""

    box: toolbox.Toolbox
    tok: object  # the model's tokenizer: decodes a call's text, encodes the tool's output
    max_calls: int  # --max-tool-calls: a response ends after this many calls' outputs


def generate(
    engine,
    prompts: list[list[int]],
    n: int,
    max_tokens: int | list[int],
    tools: Tools | None,
    seed: int | None = None,
    first_index: int = 0,
    **sampling,
) -> list:
    """engine.generate's n samples per prompt (prompt-major; an Engine's Samples), with tool calls
    when `tools` is set.

    Each round's continuations are seeded by (seed, round) and the sample's index in the whole
    list, (first_index + prompt) * n + j, so a sample's draws do not depend on how the prompts were
    split over engines (rollout.VLLMEngine.generate)."""
    if tools is None:
        return engine.generate(
            prompts, n, max_tokens, seed=seed, first_index=first_index, **sampling
        )
    caps = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    stop = tools.box.stops
    out = engine.generate(
        prompts, n, caps, seed=seed, first_index=first_index, stop=stop, **sampling
    )
    # copies of the engine's lists, which the rounds below extend
    out = [
        replace(
            s,
            token_ids=list(s.token_ids),
            logprobs=list(s.logprobs),
            tool_mask=[0] * len(s.token_ids),
        )
        for s in out
    ]
    segment = [list(s.token_ids) for s in out]  # each response's tokens since its last call
    sampling.pop("min_tokens", None)  # counted from the response's start: round 0 only
    calling, rounds = [k for k, s in enumerate(out) if s.stop], 0
    while calling:
        rounds += 1
        for k in calling:
            append_output(out[k], segment[k], tools, caps[out[k].prompt_idx])
        going = [k for k in calling if not out[k].truncated and out[k].tool_calls < tools.max_calls]
        if not going:
            break
        more = engine.generate(
            [prompts[out[k].prompt_idx] + out[k].token_ids for k in going],
            1,
            [caps[out[k].prompt_idx] - len(out[k].token_ids) for k in going],
            seed=None if seed is None else hash((seed, rounds)) % 2**31,
            first_index=[first_index * n + k for k in going],
            stop=stop,
            **sampling,
        )
        for k, s in zip(going, more):
            out[k].token_ids += s.token_ids
            out[k].logprobs += s.logprobs
            out[k].tool_mask += [0] * len(s.token_ids)
            out[k].truncated, out[k].stop, segment[k] = s.truncated, s.stop, list(s.token_ids)
        calling = [k for k in going if out[k].stop]
    return out


def append_output(s, segment: list[int], tools: Tools, cap: int) -> None:
    """Run the call that ends `segment` (s's tokens since its last call) and append its output to
    s, cut at the response's limit `cap` (a cut output leaves s truncated)."""
    result = tools.box.call(tools.tok.decode(segment, skip_special_tokens=True))
    text = f"<result>{result.text}</result>"
    # plain text: a tool that prints "<|im_end|>" must not end the model's turn
    ids = tools.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    ids = ids[: cap - len(s.token_ids)]
    s.token_ids += ids
    s.logprobs += [0.0] * len(ids)
    s.tool_mask += [1] * len(ids)
    s.tool_calls += 1
    s.tool_errors += int(result.error)
    s.truncated, s.stop = len(s.token_ids) >= cap, None


def sampled_ids(s) -> list[int]:
    """s's tokens the model sampled (a tool's output left out)."""
    if not s.tool_mask:
        return s.token_ids
    return [t for t, tool in zip(s.token_ids, s.tool_mask) if not tool]


def model_text(tok, s, tools: Tools | None = None) -> str:
    """The text a reward scores: s's sampled tokens decoded (special tokens skipped), with each
    call <TAG>...</TAG> of `tools` left out, and with it the tool's output, which is not sampled.

    Example: '<calc>2+3</calc>' '<result>5</result>' ' So 5.' -> ' So 5.'; a response that ends
    right after a result, '<calc>2+3</calc>' '<result>5</result>', -> '' (no answer of its own)."""
    text = tok.decode(sampled_ids(s), skip_special_tokens=True)
    for tag in tools.box.tags if tools else ():  # from the last <TAG> before </TAG>, as toolbox
        t = re.escape(tag)
        text = re.sub(rf"<{t}>(?:(?!<{t}>).)*?</{t}>", "", text, flags=re.S)
    return text


def tool_tokens(s) -> int:
    """How many of s's tokens a tool wrote."""
    return sum(s.tool_mask)
