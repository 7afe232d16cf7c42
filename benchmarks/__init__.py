"""Our own speed and memory measurements of mopd (not shipped with the package; see README.md here).

Run each from the repository root: `python -m benchmarks.NAME --out FILE.json`.
"""
