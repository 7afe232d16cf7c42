"""The agent domain: multi-turn tool use against a real embedded SQLite database.

Protocol (the system prompt each task carries in `task.meta["system"]` says the same):
- Every assistant turn is `<think>…</think>` then an answer.
- A tool call is one SQL statement inside the answer, exactly one per turn:
  `<tool_call>SELECT price FROM products WHERE name = 'steel bolt'</tool_call>`.
  The environment runs it on the episode's own database and replies with an observation turn
  (role "observation"; its tokens are masked out of training losses):
  column names then rows, cells separated by " | ", at most `max_rows` rows, then "(N rows)";
  or "OK, N rows changed" after a write; or "error: <SQLite's message>".
- An assistant turn without a tool call is the final answer and ends the episode; so does the
  turn limit (`task.meta["max_turns"]` assistant turns). A turn without a closed think block
  ends the episode with reward 0.
- For a question the final answer is the number alone.

That is today's harness, the `mopd` scaffold. A scaffold (`scaffolds`) is the harness as data: the
tool's name and argument, the call syntax (tags, a JSON call object, a function-call line), the system
prompt, the rows' format (pipe, CSV, JSON), the error wording and the role observations take. The
env option `scaffolds` is `fixed` (today's, tasks unchanged), `rotate` (a train scaffold drawn per
task, recorded in `task.meta["scaffold"]` and `["observation_role"]`), `heldout` (the held-out
scaffolds of a dev or test sample) or a list of names; the scaffolds split train/dev/test by the
hash of their names, and train tasks take train scaffolds only.

Reward (`verify`) comes from the database alone: the verifier rebuilds the task's initial
database, applies the intended change itself, and compares every table with the episode's end
state. Any difference (a missed change, or a write to any other row) gives 0. Questions are
answered against the database, and they must leave it untouched. What the model says it did
never counts.

Every episode runs on a private in-memory database (see `database` for the guard on the tool).
`snapshot` serializes the episode, database included, and `restore` gives back an identical,
independent episode, so every member of a GRPO group starts from the same state (`group`).
The same actions always lead to the same end state, byte for byte.

Train, dev and test never share a database (`mopd.envs.splits`): a task's key is the hash of its
database's rows (`database_key`), and the key puts it, with every question asked of that database,
in exactly one split, whatever the seeds. The key is `task.meta["content_hash"]`. (The same question
text may come back in another split, asked of another database: its answer differs.)

Layout: `env` (the environment: episodes, snapshots, verification), `database` (schema, generator,
guarded connections), `scaffolds` (the harnesses: calls, observations, prompts, the split), `tools`
(today's harness's calls and rows, the number of an answer), `verify` (task checks, split
keys, the database diff), `expert` (the expert's session), `families` (one module per task family,
and the builder table `FAMILIES`).
"""

from mopd.envs.agent.database import (
    ID_TABLES,
    ITEMS_BY_CATEGORY,
    SCHEMA,
    TABLES,
    WAREHOUSES,
    StatementBudget,
    build_database,
    database_rows,
    db_spec,
    open_guarded,
    open_plain,
)
from mopd.envs.agent.env import (
    SHORT_SYSTEM_PROMPT,
    SNAPSHOT_MAGIC,
    SYSTEM_PROMPT,
    SYSTEM_PROMPTS,
    AgentEnv,
    Episode,
)
from mopd.envs.agent.families import FAMILIES
from mopd.envs.agent.families.base import Family, spoken_list, sql_list
from mopd.envs.agent.tools import ToolCallError, find_tool_call, parse_number, parse_rows
from mopd.envs.agent.verify import check_task, contents, database_key, diff_databases, task_identity

__all__ = [
    "FAMILIES", "ID_TABLES", "ITEMS_BY_CATEGORY", "SCHEMA", "SHORT_SYSTEM_PROMPT", "SNAPSHOT_MAGIC",
    "SYSTEM_PROMPT", "SYSTEM_PROMPTS", "TABLES", "WAREHOUSES", "AgentEnv", "Episode", "Family",
    "StatementBudget", "ToolCallError", "build_database", "check_task", "contents", "database_key",
    "database_rows", "db_spec", "diff_databases", "find_tool_call", "open_guarded", "open_plain",
    "parse_number", "parse_rows", "spoken_list", "sql_list", "task_identity",
]
