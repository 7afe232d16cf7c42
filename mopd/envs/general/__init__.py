"""The general domain: questions with exact answers, scored by parsing what follows `</think>`.

Our own families come with step-by-step traces, where thinking truly helps a tiny model:
  add    a + b, column by column with carries
  mul    a × b, digit by digit with carries for each digit of b, then the rows summed
  chain  a + b − c + …, with a running total
Each has difficulty knobs (digits, multiplier digits, chain length). Effort decides how much
work the expert writes out, one line per step, the same lines at every effort: at low only sums of
at most `low_chain_terms` one-digit terms (other answers come straight away), at high also longer
sums and products of terms with at most `high_term_digits` digits (any, by default) but chains of at
most `high_chain_terms` terms, at max everything. So what high leaves out is answered from the head
below max effort, and max effort pays where the work does not fit high's scratchpad. (A model
of ~1M parameters answers even 1 + 7 straight away only by chance, the tiny base did so 5% of the
time, so RL at low effort saw no reward to sharpen. Max once wrote the same steps as high with
labels and running results added, `step 1: 4+7=11 so far 1`; the tiny student did worse with them,
0.77 against 0.85 at high, and the labels' digits leaked into the sums.)

Reasoning-gym families are named `rg/<name>` (e.g. `rg/gcd`) and are scored by reasoning-gym's
own scorer; they have no trace, so the expert writes a short think block and the gold answer.

Train, dev and test never share a question (`mopd.envs.splits`): a task's key is the hash of its
normalised question and answer, whichever family drew it ("Compute 3 + 5." is one task for `add`
and `chain`), and the key puts it in exactly one split. Each split draws candidates from an RNG
derived from (split, seed, index) and keeps only those of its own split, so no seed, family or
sample size can put one question into two splits. The key is `task.meta["content_hash"]`.
A train question is drawn only where its worked steps state no dev or test question (`contents`):
the sums of a chain's trace and the columns of an addition are questions of their own.

Layout: `env` (the environment and the expert's effort policy), `questions` (question text, the
true answer, answer normalisation, the split key and `contents`), `families` (one module per own
family: its generator and its trace, and the builder table), `rg` (reasoning-gym families).
"""

from mopd.envs.general.env import MAX_DRAWS, GeneralEnv, max_digits
from mopd.envs.general.families import BUILDERS, DEFAULT_FAMILIES, OWN_FAMILIES, OWN_GENERATORS, TRACES
from mopd.envs.general.families.add import add_trace
from mopd.envs.general.families.chain import chain_trace
from mopd.envs.general.families.mul import mul_trace
from mopd.envs.general.questions import (
    EQUATION,
    NUMBER,
    OPERATION,
    QUESTION,
    contents,
    evaluate,
    normalize_answer,
    parse_expression,
    question_for,
    task_key,
)
from mopd.envs.general.rg import RG_CHUNK, RG_PREFIX

__all__ = [
    "BUILDERS", "DEFAULT_FAMILIES", "EQUATION", "MAX_DRAWS", "NUMBER", "OPERATION", "OWN_FAMILIES",
    "OWN_GENERATORS", "QUESTION", "RG_CHUNK", "RG_PREFIX", "TRACES", "GeneralEnv", "add_trace", "chain_trace",
    "contents", "evaluate", "max_digits", "mul_trace", "normalize_answer", "parse_expression", "question_for",
    "task_key",
]
