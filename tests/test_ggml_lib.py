"""deimos.runtime.ggml_lib: ggml-python's functions come from its own files even when another
ggml's libraries are first on LD_LIBRARY_PATH (a llama.cpp build there aborted the engine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ggml = pytest.importorskip("ggml")

# run in a fresh interpreter: the loader reads LD_LIBRARY_PATH when the process starts
PROBE = r"""
import json
import ggml
from deimos.runtime.ggml_lib import defining_file, module_function
from deimos.runtime.cpu_experts import _ggml_module
names = ["ggml_init", "ggml_mul_mat_id", "ggml_swiglu_split", "ggml_graph_plan", "ggml_graph_compute",
         "ggml_threadpool_new", "ggml_get_type_traits_cpu"]
theirs = {n: defining_file(module_function(ggml, n)) for n in names}
lib = _ggml_module()
ours = {n: defining_file(getattr(lib, n)) for n in names}
print(json.dumps({"theirs": theirs, "ours": ours, "files": lib.files}))
"""


def _probe(env_path: str | None) -> dict:
    import json

    env = dict(os.environ)
    if env_path:
        env["LD_LIBRARY_PATH"] = env_path
    else:
        env.pop("LD_LIBRARY_PATH", None)
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_functions_come_from_the_packages_files_despite_ld_library_path(tmp_path):
    own = Path(ggml.__file__).resolve().parent / "lib"
    other = tmp_path / "other-ggml"
    other.mkdir()
    for f in own.glob("libggml*.so"):
        shutil.copy(f, other / f.name)  # another ggml's files (here a copy: a distinct file)
    got = _probe(str(other))
    if not any(str(other) in (v or "") for v in got["theirs"].values()):
        pytest.skip("this ggml-python resolves its libraries itself: nothing to guard")
    for name, where in got["ours"].items():
        assert where is not None and Path(where).parent == own, f"{name} from {where}"


def test_without_another_ggml_the_binding_is_the_modules():
    got = _probe(None)
    own = Path(ggml.__file__).resolve().parent / "lib"
    assert [Path(f).name for f in got["files"]] == ["libggml-base.so", "libggml-cpu.so"]
    for name, where in got["ours"].items():
        assert Path(where).parent == own, f"{name} from {where}"
        assert got["theirs"][name] == where, name
