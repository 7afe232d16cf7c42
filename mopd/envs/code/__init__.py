"""The code domain: write a Python function `f` from a spec and examples; hidden unit tests decide.

Task families are templated pipelines: a function body is a few one-line steps, each rewriting
one variable, then `return` of the last one. A tiny model can learn them, and the difficulty knob
is the number of steps. The families and their one builder table are in `families`.

The prompt shows the signature, the steps in words and `n_examples` examples. `meta` holds the
hidden tests (inputs AND expected outputs, computed by running the reference solution here, in
the trusted parent) plus the family and the reference code for the solver.

Attempts grow with effort (`attempts`, default low 1, high 2, max 3). An attempt is one
assistant turn: `<think>…</think>` then the code. Above low effort the environment runs an
attempt on the prompt's examples in the sandbox, as a programmer runs the examples they were
given: if they all pass, or the attempts are used up, the episode ends; otherwise an observation
says what the code returned for the failing examples (`f(2) returned 5, expected 4`) and the
model writes the function again. The hidden tests judge the last attempt. This is where effort
pays in code: a tiny model's second and third tries, told what went wrong, pass where its first
did not. The expert's transcripts show it: with `retry_demos` = p, that fraction of the
high/max transcripts starts with a failed attempt (a constant of the solution changed, or
another train function of the family), the observation the environment gives for it, and then the
right function. A failed attempt never shows a dev or test function (`mopd.envs.splits.trainable`;
`contents` lists the functions a text states, for the audit).

The expert's completion (`expert`) is `<think>…</think>` then the code in a ```python fence; its
scratchpad grows with effort.

Train, dev and test never share a function (`mopd.envs.splits`): a task's key is the hash of its
reference code, which fixes the function and so its examples and tests; the key puts it in exactly
one split. Each split draws from an RNG derived from (split, seed, index) and keeps only functions of
its own split. A small space splits coarsely: the tiny recipe's difficulty 1 has a few dozen
functions per family, so a split may hold one or two of a family (or none: then sampling that split
fails with an error naming the family). The key is `task.meta["content_hash"]`.

Verification never trusts the program (`harness`, `verify`): the sandboxed child never sees the
expected outputs, and the parent compares the plain values it wrote, type-strictly.

Layout: `env` (the environment), `function` (a generated function and its tasks), `families`
(one module per family or related group, and the builder table), `expert` (traces and failed
attempts), `harness` (the sandboxed program), `verify` (code extraction, scoring, `contents`).
"""

from mopd.envs.code.env import ATTEMPTS, MAX_DRAWS, Attempts, CodeEnv
from mopd.envs.code.expert import completion_of, slip, trace
from mopd.envs.code.families import FAMILIES, family_builders
from mopd.envs.code.families.arith import arith_function, arithmetic_sequence
from mopd.envs.code.families.lists import list_reducer, list_step
from mopd.envs.code.families.poly import polynomial
from mopd.envs.code.families.sequence import sequence_start
from mopd.envs.code.families.strings import string_counter, string_step
from mopd.envs.code.function import (
    ALPHABET,
    Function,
    Step,
    compile_reference,
    edge_input,
    function_from_meta,
    linear,
    offset,
    prompt_for,
    random_input,
)
from mopd.envs.code.harness import HARNESS, harness_program, read_cases
from mopd.envs.code.verify import (
    DEFINITION,
    FENCED,
    check_code_meta,
    contents,
    extract_code,
    failures,
    same_value,
    score,
)

__all__ = [
    "ALPHABET", "ATTEMPTS", "DEFINITION", "FAMILIES", "FENCED", "HARNESS", "MAX_DRAWS", "Attempts", "CodeEnv",
    "Function", "Step", "arith_function", "arithmetic_sequence", "check_code_meta", "compile_reference",
    "completion_of", "contents", "edge_input", "extract_code", "failures", "family_builders",
    "function_from_meta", "harness_program", "linear", "list_reducer", "list_step", "offset", "polynomial",
    "prompt_for", "random_input", "read_cases", "same_value", "score", "sequence_start", "slip",
    "string_counter", "string_step", "trace",
]
