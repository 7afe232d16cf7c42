"""Every number the README publishes as a result comes from a committed results file.

README.md marks each passage of results with the files behind it:

    <!-- results: docs/results/tiny-sweep/summary.md docs/results/tiny-sweep/summary.json -->
    ... text and tables quoting those files ...
    <!-- /results -->

Inside a block, every number (outside `code`, links and comments) must be one of the numbers its
files hold: a .md's numbers as printed, a .json's numeric values. The files are written by committed
commands (each .md names its command) and committed themselves. A README section that reads as
results (RESULT_SECTIONS) may hold numbers only inside such blocks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- results: (?P<files>.+?) -->(?P<text>.*?)<!-- /results -->", re.DOTALL)
NUMBER = re.compile(r"(?<![\w.])[+\-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\w]|\.\d)")
NOT_PROSE = re.compile(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->", re.DOTALL)  # code, link targets, comments
RESULT_SECTIONS = ("## Results on tasks no stage saw",)


def numbers_in(text: str) -> list[str]:
    return NUMBER.findall(text)


def value(token: str) -> float:
    """The signed value: "+0.05" and "0.05" are one number, "−0.05" (the typographic minus) another."""
    return float(token.replace(",", "").replace("−", "-"))


def numbers_of_file(path: Path) -> set[float]:
    """A .md's numbers as printed (code included: a command's flags are its facts), a .json's numeric leaves."""
    if path.suffix == ".json":
        return set(json_numbers(json.loads(path.read_text())))
    return {value(token) for token in numbers_in(path.read_text())}


def json_numbers(node):
    if isinstance(node, bool):
        return
    if isinstance(node, int | float):
        yield float(node)
    elif isinstance(node, dict):
        for item in node.values():
            yield from json_numbers(item)
    elif isinstance(node, list):
        for item in node:
            yield from json_numbers(item)


def prose(text: str) -> str:
    return NOT_PROSE.sub(" ", text)


def unbacked_numbers(readme: str, root: Path = ROOT) -> list[str]:
    """"<files>: <number>" for each number in a results block that none of its files holds."""
    missing = []
    for block in BLOCK.finditer(readme):
        files = [root / name for name in block["files"].split()]
        absent = [str(f.relative_to(root)) for f in files if not f.is_file()]
        if absent:
            missing.append(f"{block['files']}: file(s) {absent} not found")
            continue
        known = set().union(*(numbers_of_file(f) for f in files))
        missing += [f"{block['files']}: {token}" for token in numbers_in(prose(block["text"])) if value(token) not in known]
    return missing


def numbers_outside_blocks(readme: str) -> list[str]:
    """Numbers in a results section of the README that no results block holds."""
    found = []
    for heading in RESULT_SECTIONS:
        start = readme.index(heading) + len(heading)
        end = readme.find("\n## ", start)
        section = readme[start : end if end >= 0 else None]
        found += [f"{heading}: {token}" for token in numbers_in(prose(BLOCK.sub(" ", section)))]
    return found


def test_every_number_in_a_results_block_is_in_its_results_files():
    readme = README.read_text()
    assert BLOCK.search(readme), "README.md has no <!-- results: ... --> block"
    assert unbacked_numbers(readme) == []


def test_a_results_section_holds_numbers_only_inside_results_blocks():
    assert numbers_outside_blocks(README.read_text()) == []


def test_a_planted_number_is_caught_in_a_block_and_outside_one():
    readme = README.read_text()
    block = BLOCK.search(readme)
    planted = readme[: block.start("text")] + " the student scores 0.987654 here " + readme[block.start("text") :]
    assert any(m.endswith(": 0.987654") for m in unbacked_numbers(planted))
    heading = RESULT_SECTIONS[0]
    outside = readme.replace(heading + "\n", heading + "\n\nIt keeps 97% of the gain.\n", 1)
    assert numbers_outside_blocks(outside) == [f"{heading}: 97"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.44 [0.38, 0.50] on 5,454 answers, 31% of 1,152", ["0.44", "0.38", "0.50", "5,454", "31", "1,152"]),
        ("K3 and SmolLM2-135M, seeds 0-17, 1.20× as fast", ["0", "17", "1.20"]),
        ("+0.060 [+0.027, +0.093], −0.001 and -2", ["+0.060", "+0.027", "+0.093", "−0.001", "-2"]),
        ("v1.2.3 and e.g. 3.", ["3"]),
    ],
)
def test_numbers_are_read_as_a_reader_reads_them(text, expected):
    assert numbers_in(text) == expected


def test_numbers_in_code_links_and_comments_are_not_results(tmp_path):
    results = tmp_path / "r.md"
    results.write_text("accuracy 0.44\n")
    readme = ("<!-- results: r.md -->\nThe base scores 0.44 (`mopd sweep --seeds 0-2`, [plot](docs/p2.png)) "
              "<!-- 0.99 -->\n<!-- /results -->\n")  # fmt: skip
    assert unbacked_numbers(readme, tmp_path) == []
    assert unbacked_numbers(readme.replace("0.44 (", "0.45 ("), tmp_path) == ["r.md: 0.45"]
    assert unbacked_numbers(readme.replace("0.44 (", "−0.44 ("), tmp_path) == ["r.md: −0.44"]  # a sign is the number's
