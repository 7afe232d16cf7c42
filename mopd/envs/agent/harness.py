"""What a scaffold is: the harness an agent works in, as data (`Scaffold`), and how it writes calls,
parses them, and renders observations. The scaffolds themselves and how a task draws one:
`mopd.envs.agent.scaffolds`."""

from __future__ import annotations

import ast
import csv
import io
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mopd.envs.splits import content_hash, split_of

EXAMPLE_SQL = "SELECT price FROM products WHERE name = 'steel bolt'"

class ToolCallError(str):
    """A malformed tool call, reported back to the model as an observation."""


class Scaffold(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    tool: str  # the tool's name; `tags` wrap the SQL in <tool>…</tool>
    argument: str  # the SQL's argument name (json, function)
    syntax: Literal["tags", "json", "function"]
    wrap: str | None = None  # json: the tag name around the call object (None: the object alone)
    system: dict[Literal["full", "short"], str]  # {schema} {max_rows} {max_turns} {example}
    rows: Literal["pipe", "csv", "json"]
    changed: str  # a write's result: {n} rows, {s} the plural's "s"
    error: str  # every error: {message}
    malformed: str  # the message for a call the parser refuses
    empty: str  # the message for a call without SQL
    role: Literal["observation", "user"] = "observation"

    # ---- the split ---------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return scaffold_key(self.name)

    @property
    def split(self) -> str:
        return split_of(self.key)

    # ---- the system prompt -------------------------------------------------------------------
    def system_prompt(self, wording: str, schema: str, max_rows: int, max_turns: int) -> str:
        return fill(self.system[wording], schema=schema, max_rows=max_rows, max_turns=max_turns,
                    example=self.call(EXAMPLE_SQL))

    # ---- calls -------------------------------------------------------------------------------
    def call(self, sql: str) -> str:
        """The tool call that runs `sql`, as the model writes it."""
        if self.syntax == "tags":
            return f"<{self.tool}>{sql}</{self.tool}>"
        if self.syntax == "function":
            return f"{self.tool}({self.argument}={json.dumps(sql, ensure_ascii=False)})"
        body = json.dumps({"name": self.tool, "arguments": {self.argument: sql}}, ensure_ascii=False)
        return f"<{self.wrap}>{body}</{self.wrap}>" if self.wrap else body

    def find_call(self, answer: str) -> str | ToolCallError | None:
        """The SQL of the answer's one tool call; None for a final answer; the scaffold's own
        refusal for a malformed call."""
        if self.syntax == "tags":
            return self._between_tags(answer, self.tool)
        if self.syntax == "function":
            return self._function_call(answer) if f"{self.tool}(" in answer else None
        body = self._between_tags(answer, self.wrap) if self.wrap else (answer if "{" in answer else None)
        return body if body is None or isinstance(body, ToolCallError) else self._json_call(body)

    def _between_tags(self, answer: str, tag: str) -> str | ToolCallError | None:
        open_tag, close_tag = f"<{tag}>", f"</{tag}>"
        opens, closes = answer.count(open_tag), answer.count(close_tag)
        if opens == closes == 0:
            return None
        if opens != 1 or closes != 1 or answer.index(open_tag) > answer.index(close_tag):
            return ToolCallError(self.malformed)
        return answer.split(open_tag, 1)[1].split(close_tag, 1)[0].strip()

    def _json_call(self, body: str) -> str | ToolCallError:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return ToolCallError(self.malformed)
        if not (isinstance(call, dict) and set(call) == {"name", "arguments"} and call["name"] == self.tool
                and isinstance(call["arguments"], dict) and set(call["arguments"]) == {self.argument}
                and isinstance(call["arguments"][self.argument], str)):
            return ToolCallError(self.malformed)
        return call["arguments"][self.argument].strip()

    def _function_call(self, answer: str) -> str | ToolCallError:
        try:
            node = ast.parse(answer.strip(), mode="eval").body
        except SyntaxError:
            return ToolCallError(self.malformed)
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == self.tool and not node.args
                and len(node.keywords) == 1 and node.keywords[0].arg == self.argument
                and isinstance(node.keywords[0].value, ast.Constant) and isinstance(node.keywords[0].value.value, str)):
            return ToolCallError(self.malformed)
        return node.keywords[0].value.value.strip()

    # ---- observations ------------------------------------------------------------------------
    def error_text(self, message: str) -> str:
        return fill(self.error, message=json.dumps(message)[1:-1] if self.rows == "json" else message)

    def changed_text(self, n: int) -> str:
        return fill(self.changed, n=n, s="" if n == 1 else "s")

    def rows_text(self, columns: list[str], rows: list[tuple], max_rows: int) -> str:
        """At most `max_rows` rows (`rows` may hold one more: then the text says more exist)."""
        more, shown = len(rows) > max_rows, rows[:max_rows]
        if self.rows == "json":
            cells = [[json_cell(value) for value in row] for row in shown]
            return json.dumps({"columns": columns, "rows": cells, "more": more}, ensure_ascii=False)
        if self.rows == "csv":
            buffer = io.StringIO()
            csv.writer(buffer, lineterminator="\n").writerows([columns, *([cell(v) for v in row] for row in shown)])
            footer = f"# first {max_rows} rows; more not shown" if more else f"# {len(shown)} row{'' if len(shown) == 1 else 's'}"
            return buffer.getvalue() + footer
        lines = [" | ".join(columns), *(" | ".join(cell(value) for value in row) for row in shown)]
        lines.append(f"(first {max_rows} rows; more not shown)" if more else f"({len(shown)} row{'' if len(shown) == 1 else 's'})")
        return "\n".join(lines)

    def rows_of(self, observation: str | None) -> list[list[str]]:
        """The rows of a result observation, each cell as text (the expert reads them back)."""
        if observation is None or self.is_error(observation) or self.changed_count(observation) is not None:
            raise ValueError(f"scaffold {self.name}: expected rows, got observation {observation!r}")
        if self.rows == "json":
            return [[cell(value) for value in row] for row in json.loads(observation)["rows"]]
        body = observation.splitlines()[1:-1]
        if self.rows == "csv":
            return [list(row) for row in csv.reader(body)]
        return [line.split(" | ") for line in body]

    def is_error(self, observation: str) -> bool:
        return observation.startswith(self.error.split("{message}")[0])

    def changed_count(self, observation: str) -> int | None:
        pattern = re.escape(self.changed).replace(re.escape("{n}"), r"(\d+)").replace(re.escape("{s}"), "s?")
        match = re.fullmatch(pattern, observation)
        return int(match.group(1)) if match else None


def fill(template: str, **values: Any) -> str:
    """`template` with each {name} replaced (JSON examples keep their own braces)."""
    for name, value in values.items():
        template = template.replace(f"{{{name}}}", str(value))
    return template


def cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        return f"<blob of {len(value)} bytes>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "…"


def json_cell(value: Any) -> Any:
    return value if isinstance(value, int | float) or value is None else cell(value)


def scaffold_key(name: str) -> str:
    return content_hash("scaffold", name)


# ----------------------------------------------------------------------------- the scaffolds
