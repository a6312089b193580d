"""Deimos: an LLM inference engine for GGUF files.

    import deimos
    llm = deimos.LLM("smollm2")
    print(llm.generate("Write a haiku about the sea.", max_tokens=64, temperature=0))
"""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import deimos` stays cheap (no torch) for the CLI's light subcommands.
    if name in ("LLM", "Completion"):
        from deimos import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'deimos' has no attribute {name!r}")
