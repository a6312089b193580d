"""The one exception type of the GGUF layer.

A GGUF file is untrusted input: every problem the reader finds (bad magic, truncation, an
absurd count, overlapping tensors, ...) is raised as a ``GGUFError`` whose message starts
with the file's path and says what is wrong and, where it helps, at which byte offset.
"""

from __future__ import annotations

import os


class GGUFError(ValueError):
    """A GGUF file that cannot be read, or a metadata key that is missing or has the wrong type.

    ``path`` is the file, ``offset`` the byte offset of the problem when there is one.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str, offset: int | None = None):
        self.path = os.fspath(path)
        self.problem = problem
        self.offset = offset
        where = f" (at byte {offset})" if offset is not None else ""
        super().__init__(f"{self.path}: {problem}{where}")
