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
from functools import cached_property
from typing import TYPE_CHECKING, Any

from mopd.envs.base import EFFORTS, THINK_CLOSE, THINK_OPEN, Task, split_thinking

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
# The roles an environment's reply may take after an assistant turn: an observation, or (as some
# agent harnesses do, `mopd.envs.agent.scaffolds`) the user's turn. Neither is trained on.
OBSERVATION_ROLES = ("observation", "user")


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
    """Segments of a whole transcript: the prompt, then assistant and observation (or user) turns.

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
        elif role in OBSERVATION_ROLES and segments[-1].train:  # what answers the model's turn
            segments.append(Segment(f"{ROLE_HEADERS[role]}{content}{END}{assistant_header(effort)}", train=False))
        else:
            raise ValueError(
                f"turn {index}: role must be 'assistant', or after an assistant turn one of {list(OBSERVATION_ROLES)}, got {role!r}"
            )
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


# ----------------------------------------------------------------------------- the format a model reads
class ChatFormat:
    """How one model's conversations are written, in token ids: what the rollout loop needs.

        prompt_ids(task, budget)          the prompt, up to the assistant's first token
        observation_ids(text, effort, role)  an environment observation (role "observation" or
                                          "user") and the next assistant header
        stop_ids                          the tokens that end an assistant turn
        count_tokens(ids)                 (thinking, answer) tokens of one sampled turn
        forced_close                      what the engine appends to a turn whose thinking hits its budget
                                          unclosed (budget forcing, `mopd.rollout.forcing`)

    `chat_format(tokenizer)` picks one: `NativeChat` for a tokenizer with our effort tokens (the models
    the pipeline grows), `TemplateChat` for any other model, through its own chat template.
    """

    tokenizer: PreTrainedTokenizerBase
    stop_ids: list[int]
    forced_close: str

    def prompt_ids(self, task: Task, budget: int | None = None) -> list[int]: ...

    def observation_ids(self, observation: str, effort: str, role: str = "observation") -> list[int]: ...

    def count_tokens(self, ids: list[int]) -> tuple[int, int]: ...

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def transcript_ids(self, task: Task, turns: Sequence[dict[str, str]], budget: int | None = None) -> tuple[list[int], list[int]]:
        """A whole episode as a rollout writes it (the prompt, each assistant turn ended by the first stop
        token, each observation with the next assistant header) and its loss mask: 1 on assistant tokens."""
        ids = self.prompt_ids(task, budget)
        mask = [0] * len(ids)
        for index, turn in enumerate(turns):
            role, content = turn.get("role"), turn.get("content")
            if role == "assistant" and not (mask and mask[-1]):
                part, trained = [*self.encode(content), self.stop_ids[0]], 1
            elif role in OBSERVATION_ROLES and mask and mask[-1]:
                part, trained = self.observation_ids(content, task.effort, role), 0
            else:
                raise ValueError(f"turn {index}: role {role!r} cannot follow the {'assistant' if mask[-1] else 'prompt'}")
            ids += part
            mask += [trained] * len(part)
        return ids, mask


def chat_format(tokenizer: PreTrainedTokenizerBase) -> ChatFormat:
    """Our markup where the tokenizer has our effort tokens, else the model's own chat template."""
    vocab = tokenizer.get_vocab()
    if all(token in vocab for token in EFFORT_TOKENS.values()):
        return NativeChat(tokenizer)
    return TemplateChat(tokenizer)


class NativeChat(ChatFormat):
    """Our markup (`render_prompt`): the effort is a token of the assistant header."""

    forced_close = THINK_CLOSE  # the models trained here answer right after it; a worded cue would be new to them

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.stop_ids = tokenizer.convert_tokens_to_ids(list(STOP_TOKENS))

    def prompt_ids(self, task: Task, budget: int | None = None) -> list[int]:
        return self.encode(render_task_prompt(task))

    def observation_ids(self, observation: str, effort: str, role: str = "observation") -> list[int]:
        return self.encode(f"{ROLE_HEADERS[role]}{observation}{END}{assistant_header(effort)}")

    def count_tokens(self, ids: list[int]) -> tuple[int, int]:
        """Counted on the ids themselves: every tag and stop token is one id. A turn that never closes
        its think block is all thinking: it ran out of budget first."""
        think_open, think_close = self.tokenizer.convert_tokens_to_ids([THINK_OPEN, THINK_CLOSE])
        ids = [token for token in ids if token not in self.stop_ids]
        start = 1 if ids[:1] == [think_open] else 0
        if think_close not in ids:
            return len(ids) - start, 0
        close = ids.index(think_close)
        return close - start, len(ids) - close - 1


# The effort of a model without effort tokens: this system line, and the thinking budget its turn is cut at.
EFFORT_SYSTEM_LINE = (
    "Reasoning effort: {effort}. Think inside <think></think> in at most {budget} tokens, "
    "then write only the answer after </think>."
)
# Budget forcing for a model without effort tokens: a cue before the tag, as Qwen3 does, because a model never
# taught to think does not know that the answer comes next; one short sentence, to stay little of the turn.
FORCED_CLOSE_CUE = "\n\nTime is up, so I write only the final answer now.\n" + THINK_CLOSE + "\n\n"
ASSISTANT_SENTINEL, OBSERVATION_SENTINEL = "ASSISTANT-TURN-0c5e", "OBSERVATION-TURN-9a1d"


class TemplateChat(ChatFormat):
    """Any model's own chat template (`tokenizer.apply_chat_template`). The effort is a system line
    (`EFFORT_SYSTEM_LINE`, before the task's own system prompt); the turn ends with the tokenizer's
    EOS token (`<|im_end|>`, `<|eot_id|>` …); an observation is a `tool` message."""

    forced_close = FORCED_CLOSE_CUE

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        if not tokenizer.chat_template:
            raise ValueError(
                f"tokenizer {tokenizer.name_or_path!r} has neither mopd's effort tokens nor a chat template: "
                "give the checkpoint a chat template (tokenizer_config.json or chat_template.jinja)"
            )
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token to end an assistant turn")
        self.tokenizer = tokenizer
        self.turn_end = tokenizer.eos_token
        self.stop_ids = [tokenizer.eos_token_id]

    def system_line(self, effort: str, budget: int | None) -> str:
        return EFFORT_SYSTEM_LINE.format(effort=effort, budget=budget if budget is not None else "a few")

    def prompt_ids(self, task: Task, budget: int | None = None) -> list[int]:
        system = self.system_line(task.effort, budget)
        if task.meta.get("system"):
            system = f"{system}\n\n{task.meta['system']}"
        text = self.tokenizer.apply_chat_template(messages_for(task.prompt, system=system), add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def observation_ids(self, observation: str, effort: str, role: str = "observation") -> list[int]:
        template = self.observation_template if role == "observation" else self.user_reply_template
        return self.encode(template.replace(OBSERVATION_SENTINEL, observation))

    @cached_property
    def observation_template(self) -> str:
        return self.reply_template("tool")

    @cached_property
    def user_reply_template(self) -> str:
        return self.reply_template("user")

    def reply_template(self, message_role: str) -> str:
        """What the template writes after an assistant turn's end token: the observation's message and
        the next assistant header, found by rendering a conversation with marked contents."""
        turns = [{"role": "assistant", "content": ASSISTANT_SENTINEL}, {"role": message_role, "content": OBSERVATION_SENTINEL}]
        text = self.tokenizer.apply_chat_template(messages_for("question", turns), add_generation_prompt=True, tokenize=False)
        end = ASSISTANT_SENTINEL + self.turn_end
        if end not in text or OBSERVATION_SENTINEL not in text:
            raise ValueError(
                f"tokenizer {self.tokenizer.name_or_path!r}: its chat template does not end an assistant turn with "
                f"its EOS token {self.turn_end!r} or drops tool messages; multi-turn episodes cannot be written"
            )
        return text[text.index(end) + len(end) :]

    def count_tokens(self, ids: list[int]) -> tuple[int, int]:
        """Counted on the decoded text (the think tags may be several ids in this vocabulary)."""
        text = self.tokenizer.decode([token for token in ids if token not in self.stop_ids], skip_special_tokens=True)
        parts = split_thinking(text)
        if parts is None:
            return len(self.encode(text)), 0
        thinking, answer = parts
        return len(self.encode(thinking)), len(self.encode(answer))
