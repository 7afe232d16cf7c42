"""BFCL's AST checker for Python function calls (`bfcl_eval/eval_checker/ast_eval/ast_checker.py`),
its rules restated: the package cannot be imported here (its checker imports its model registry,
which pins numpy==1.26.4 and many provider SDKs). `tests/test_external_suites.py` runs BFCL's own
ground truth through it.

    parse_calls(text)                              the model's answer `[f(a=1), g.h(b="x")]` → [{name: {arg: value}}]
    check_calls(functions, calls, answer, category)  (valid, why not)

A call matches one expected call when it names the function, gives every required parameter and
no parameter the function or the answer does not know, each value of the documented type (an int
where a float is documented is accepted, as BFCL does) and among the answer's allowed values; a
parameter the answer lists with "" may be left out. Strings compare case-insensitively without
spaces and `,./-_*^`. `parallel` categories take the calls in any order, one expected call each;
`multiple` and `simple` expect exactly one call.
"""

from __future__ import annotations

import ast
import re
from typing import Any

TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list, "dict": dict, "any": str}
NESTED = ("array", "tuple")


class CallError(ValueError):
    """The answer is not a list of Python function calls."""


# ----------------------------------------------------------------------------- parsing the answer
def parse_calls(text: str) -> list[dict[str, dict[str, Any]]]:
    """BFCL's `default_decode_ast_prompting`: the answer as a Python list of keyword-argument calls."""
    text = text.strip("`\n ")
    text = re.sub(r"^(python|py)\s*\n", "", text)
    text = ("" if text.startswith("[") else "[") + text + ("" if text.endswith("]") else "]")
    try:
        tree = ast.parse(text.strip().strip("'"), mode="eval").body
    except SyntaxError as err:
        raise CallError(f"not Python: {err.msg}") from None
    elements = [tree] if isinstance(tree, ast.Call) else getattr(tree, "elts", None)
    if elements is None or not all(isinstance(e, ast.Call) for e in elements):
        raise CallError("not a list of function calls")
    return [call_of(e) for e in elements]


def call_of(node: ast.Call) -> dict[str, dict[str, Any]]:
    if node.args:
        raise CallError(f"{ast.unparse(node.func)}: positional arguments (BFCL takes keyword arguments only)")
    return {ast.unparse(node.func): {kw.arg: value_of(kw.value) for kw in node.keywords if kw.arg}}


def value_of(node: ast.AST) -> Any:
    """A literal argument value; a tuple becomes a list, as BFCL compares them."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return ast.unparse(node)  # a name or an expression: BFCL keeps its text
    return list_of_tuples(value)


def list_of_tuples(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [list_of_tuples(v) for v in value]
    if isinstance(value, dict):
        return {k: list_of_tuples(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------- checking
def check_calls(functions: list[dict], calls: list[dict], answer: list[dict], category: str) -> tuple[bool, str]:
    """BFCL's `ast_checker` for Python: (valid, the first error)."""
    if len(calls) != len(answer):
        return False, f"wrong number of calls: {len(calls)}, expected {len(answer)}"
    if "parallel" not in category:
        name = next(iter(answer[0]))
        return check_call(describe(functions, name), calls[0], answer[0])
    unmatched = list(range(len(calls)))
    for expected in answer:
        description = describe(functions, next(iter(expected)))
        results = [(i, check_call(description, calls[i], expected)) for i in unmatched]
        match = next((i for i, (ok, _) in results if ok), None)
        if match is None:
            return False, f"no call matches {expected}: " + "; ".join(why for _, (_, why) in results)
        unmatched.remove(match)
    return True, ""


def describe(functions: list[dict], name: str) -> dict:
    return next((f for f in functions if f["name"] == name), functions[0])


def check_call(function: dict, call: dict, expected: dict) -> tuple[bool, str]:
    """One call against one expected call (BFCL's `simple_function_checker`)."""
    name, allowed = next(iter(expected.items()))
    if name not in call:
        return False, f"function {name!r} not called (called {list(call)})"
    params, properties = call[name], function["parameters"]["properties"]
    missing = [p for p in function["parameters"].get("required", []) if p not in params]
    if missing:
        return False, f"missing required parameter {missing[0]!r}"
    for param, value in params.items():
        if param not in properties or param not in allowed:
            return False, f"unexpected parameter {param!r}"
        ok, why = check_value(param, value, properties[param], allowed[param])
        if not ok:
            return False, why
    for param, values in allowed.items():
        if param not in params and "" not in values:
            return False, f"parameter {param!r} not given and not optional"
    return True, ""


def check_value(param: str, value: Any, spec: dict, allowed: list) -> tuple[bool, str]:
    kind = spec["type"]
    expected_type = TYPES.get(kind, str)
    if kind == "float" and type(value) is int:
        value = float(value)
    ok, variable = check_type(value, allowed, expected_type, TYPES.get(spec.get("items", {}).get("type")) if kind in NESTED else None)
    if not ok:
        return False, f"parameter {param!r}: {value!r} is not of type {kind}"
    if not variable:
        if expected_type is dict:
            return (True, "") if dict_matches(value, allowed) else (False, f"parameter {param!r}: {value!r} not allowed")
        if expected_type is list and spec.get("items", {}).get("type") == "dict":
            return (True, "") if list_of_dicts_matches(value, allowed) else (False, f"parameter {param!r}: {value!r} not allowed")
        if expected_type in (str, list):
            value, allowed = standardize(value), [standardize(a) for a in allowed]
    if value not in allowed:
        return False, f"parameter {param!r}: {value!r} is not one of {allowed}"
    return True, ""


def check_type(value: Any, allowed: list, expected: type, nested: type | None) -> tuple[bool, bool]:
    """(type ok, "is variable": the answer's values are of another type than documented, so the value
    is compared as it is), as BFCL's `type_checker`."""
    answer_type = next((type(a) for a in allowed if a != ""), None)
    variable = answer_type is not None and answer_type is not expected
    if type(value) is expected:
        if nested is None:
            return True, variable
        for option in allowed:
            if not isinstance(option, list) or all(check_type(item, option, nested, None)[0] for item in value):
                return True, variable
        return False, variable
    return (answer_type is not None and type(value) is answer_type), True


def standardize(value: Any) -> Any:
    """BFCL's `standardize_string`, on a string or on each string of a list."""
    if isinstance(value, str):
        return re.sub(r"[ ,./\-_*^]", "", value).lower().replace("'", '"')
    if isinstance(value, list):
        return [standardize(v) if isinstance(v, str) else v for v in value]
    return value


def plain(value: Any) -> Any:
    """A string standardized, anything else as it is (what BFCL's dict checker compares)."""
    return standardize(value) if isinstance(value, str) else value


def dict_matches(value: dict, options: list) -> bool:
    """BFCL's `dict_checker`: some option holds every key given, with an allowed value, and every
    key it requires (one without "" among its values)."""
    for option in options:
        if option == "":
            continue
        given = all(k in option and plain(v) in [plain(a) for a in option[k]] for k, v in value.items())
        if given and all(k in value or "" in vs for k, vs in option.items()):
            return True
    return False


def list_of_dicts_matches(value: list, options: list) -> bool:
    return any(
        isinstance(option, list) and len(option) == len(value) and all(dict_matches(v, [o]) for v, o in zip(value, option, strict=True))
        for option in options
    )
