"""Checkpoints users already have, made into ones every stage takes.

    import_gguf(FILE.gguf, OUT)                  a GGUF file → an HF safetensors directory (`mopd import`)
    init_student(TEACHER, OUT, arch=...)         a student sharing a teacher's tokenizer (`mopd init-student`)
"""

from mopd.convert.gguf import GGUFImportError, import_gguf
from mopd.convert.student import StudentInitError, init_student

__all__ = ["GGUFImportError", "StudentInitError", "import_gguf", "init_student"]
