"""`mopd run recipes/smoke.yaml`: every stage end to end, then a re-run that skips them all."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["base", "teachers", "distill", "bench"]


def run_smoke(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    mopd = Path(sys.executable).parent / "mopd"
    return subprocess.run([mopd, "run", "recipes/smoke.yaml", "--out", str(out), *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_smoke_recipe_runs_every_stage_then_skips_them(tmp_path):
    first = run_smoke(tmp_path / "run")
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert {name: s["status"] for name, s in manifest["stages"].items()} == dict.fromkeys(STAGES, "done")
    for cell in ("general-low", "agent-high", "code-max"):
        assert (tmp_path / "run" / "teachers" / cell / "config.json").is_file()
        assert (tmp_path / "run" / "teachers" / cell / "metrics.jsonl").is_file()
    report = json.loads((tmp_path / "run" / "bench" / "report.json").read_text())
    assert report["results"] and (tmp_path / "run" / "bench" / "report.md").is_file()

    again = run_smoke(tmp_path / "run")
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(f"{stage}: complete for these inputs" in again.stderr for stage in STAGES)
