"""The one chat template: special tokens, prompts, multi-turn transcripts, and its Jinja twin.

Base SFT, teacher RL, MOPD and the benchmarks all render conversations here, so teacher and
student always see the same text. A conversation reads

    <|bos|>[<|system|>SYSTEM<|end|>]<|user|>PROMPT<|end|><|assistant|><|effort:E|><think>…</think>ANSWER<|end|>
    [<|observation|>TOOL OUTPUT<|end|><|assistant|><|effort:E|><think>…</think>ANSWER<|end|> …]

`render_prompt` stops after the assistant header `<|assistant|><|effort:E|>`: the model writes
the completion `<think>…</think>ANSWER` and stops with `<|end|>`. Every boundary between a
template part and free text is a special token, so tokenizing the segments one by one gives
the same ids as tokenizing the whole text (tests check it), and loss masks are exact.
A task may carry its own system prompt in `task.meta["system"]` (the agent domain does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mopd.envs.base import EFFORTS, THINK_CLOSE, THINK_OPEN, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
SYSTEM, USER, ASSISTANT, OBSERVATION, END = (
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|end|>",
)
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
EFFORT_TOKENS = {effort: f"<|effort:{effort}|>" for effort in EFFORTS}

# Control tokens are "special" (dropped by decode(skip_special_tokens=True)); the think and tool
# tags are ordinary added tokens, so decoded completions keep them. pad/bos/eos come first so
# their ids are 0/1/2, the defaults of K3HybridConfig.
CONTROL_TOKENS: tuple[str, ...] = (
    PAD,
    BOS,
    EOS,
    SYSTEM,
    USER,
    ASSISTANT,
    OBSERVATION,
    END,
    *EFFORT_TOKENS.values(),
)
TAG_TOKENS: tuple[str, ...] = (THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
SPECIAL_TOKENS: tuple[str, ...] = CONTROL_TOKENS + TAG_TOKENS
STOP_TOKENS: tuple[str, ...] = (END, EOS)

ROLE_HEADERS = {"system": SYSTEM, "user": USER, "observation": OBSERVATION}


@dataclass(frozen=True)
class Segment:
    """A piece of rendered text; `train` marks the tokens a loss may learn from (assistant output)."""

    text: str
    train: bool


def assistant_header(effort: str) -> str:
    if effort not in EFFORT_TOKENS:
        raise ValueError(f"effort {effort!r} is not one of {list(EFFORTS)}")
    return ASSISTANT + EFFORT_TOKENS[effort]


def render_prompt(prompt: str, effort: str, system: str | None = None) -> str:
    """The text a model continues with its completion `<think>…</think>answer<|end|>`."""
    head = BOS + (f"{SYSTEM}{system}{END}" if system else "")
    return f"{head}{USER}{prompt}{END}{assistant_header(effort)}"


def render_task_prompt(task: Task) -> str:
    return render_prompt(task.prompt, task.effort, task.meta.get("system"))


def render_turns(
    prompt: str, turns: list[dict[str, str]], effort: str, system: str | None = None
) -> list[Segment]:
    """Segments of a whole transcript: the prompt, then assistant and observation turns.

    Assistant content and its closing `<|end|>` are trainable; headers and observations are not.
    After an observation the next assistant header is rendered, as a rollout would see it.
    """
    segments = [Segment(render_prompt(prompt, effort, system), train=False)]
    for index, turn in enumerate(turns):
        role, content = turn.get("role"), turn.get("content")
        if not isinstance(content, str):
            raise ValueError(f"turn {index}: 'content' must be a string, got {type(content).__name__}")
        if role == "assistant":
            if segments[-1].train:
                segments.append(Segment(assistant_header(effort), train=False))
            segments.append(Segment(content + END, train=True))
        elif role == "observation":
            segments.append(Segment(f"{OBSERVATION}{content}{END}{assistant_header(effort)}", train=False))
        else:
            raise ValueError(f"turn {index}: role must be 'assistant' or 'observation', got {role!r}")
    return segments


def render_completion(completion: str) -> str:
    """A single-turn completion as the model emits it, ending its turn."""
    return completion + END


def strip_turn_end(answer: str) -> str:
    """Drop the stop tokens a decoded completion may still carry."""
    for stop in STOP_TOKENS:
        answer = answer.replace(stop, "")
    return answer.strip()


def tokenize_segments(
    tokenizer: PreTrainedTokenizerBase, segments: list[Segment]
) -> tuple[list[int], list[int]]:
    """Token ids of a transcript and a loss mask (1 = trainable assistant token)."""
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for segment in segments:
        ids = tokenizer.encode(segment.text, add_special_tokens=False)
        input_ids += ids
        loss_mask += [int(segment.train)] * len(ids)
    return input_ids, loss_mask


def messages_for(
    prompt: str, turns: Sequence[dict[str, str]] = (), system: str | None = None
) -> list[dict[str, Any]]:
    """The same conversation as HF chat messages (for `tokenizer.apply_chat_template`)."""
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": prompt}, *turns]


# The Jinja twin of render_prompt/render_turns. `effort` is required wherever an assistant header
# is rendered (a generation prompt or an assistant turn); a conversation without one needs none
# (vLLM's server warms its template up on a lone user message, with no kwargs).
# Tests check `apply_chat_template(messages_for(...), effort=..., add_generation_prompt=...)`
# renders exactly the text above.
CHAT_TEMPLATE = (
    "{%- if effort is not defined or effort is none -%}"
    "{%- if add_generation_prompt or messages | selectattr('role', 'equalto', 'assistant') | list -%}"
    "{{ raise_exception('chat template: effort is missing: pass effort=low|high|max (in an OpenAI request, "
    "\"chat_template_kwargs\": {\"effort\": \"high\"})') }}"
    "{%- endif -%}"
    "{%- elif effort not in ['low', 'high', 'max'] -%}"
    "{{ raise_exception('chat template: effort ' ~ effort | tojson ~ ' is not one of low, high, max: "
    "pass effort=low|high|max') }}"
    "{%- endif -%}"
    "{%- set header = '<|assistant|><|effort:' ~ effort ~ '|>' -%}"
    "<|bos|>"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'user' -%}<|user|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'observation' -%}<|observation|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{ header }}{{ message['content'] }}<|end|>"
    "{%- else -%}{{ raise_exception('unknown role ' ~ message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ header }}{%- endif -%}"
)
