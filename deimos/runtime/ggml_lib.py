"""ggml-python's C functions bound to ggml-python's own library files.

ggml-python loads ``lib/libggml.so`` by path, and that file names its dependencies
(``libggml-cpu.so``, ``libggml-base.so``) without a path or a soname: the dynamic loader looks
for them on ``LD_LIBRARY_PATH`` before the package's folder. A user with a llama.cpp build on
that path (common) gets llama.cpp's ``libggml-cpu.so`` behind ggml-python's declarations,
another ggml version: its graph planner asserted on ggml-python's operation numbers and the
whole process aborted (seen on the GPU machines, where llama.cpp's folder was on the path).

``GgmlLib`` looks each function up in the package's own ``libggml-base.so``, then its own
``libggml-cpu.so`` (opened by absolute path: the same handles ggml-python preloads), with
ggml-python's argument and result types; anything else (structures, constants) is the
module's. A function in neither file is the module's own binding.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from types import ModuleType

_FUNC = ctypes._CFuncPtr  # the class of every ctypes foreign function
PARTS = ("base", "cpu")  # the files looked in, in order


class GgmlLib:
    """``module``'s attributes, its C functions taken from the package's own files."""

    def __init__(self, module: ModuleType):
        self._module = module
        folder = Path(module.__file__).resolve().parent / "lib"
        mode = getattr(ctypes, "RTLD_GLOBAL", 0)
        self._files = []
        for part in PARTS:
            for name in (f"libggml-{part}.so", f"libggml-{part}.dylib"):
                if (folder / name).exists():
                    self._files.append(ctypes.CDLL(str(folder / name), mode=mode))
                    break
        self.files = [f._name for f in self._files]

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        typed = module_function(self._module, name)
        if typed is None:
            return value  # a structure, a constant, or a Python helper
        own = self._own(name, typed)
        if own is None:
            return value
        self.__dict__[name] = own  # looked up once
        return own

    def _own(self, name: str, typed):
        for lib in self._files:
            try:
                fn = lib[name]  # a new function object: its types set here leave the module's alone
            except AttributeError:
                continue
            fn.argtypes, fn.restype = typed.argtypes, typed.restype
            return fn
        return None


def module_function(module: ModuleType, name: str):
    """The ctypes function ggml-python binds ``name`` to (where a Python wrapper calls it,
    the wrapper module's ``_name``), None where ``name`` is no C function."""
    fn = getattr(module, name, None)
    if fn is not None and not isinstance(fn, _FUNC):
        fn = getattr(fn, "__globals__", {}).get("_" + name)
    return fn if isinstance(fn, _FUNC) else None


def defining_file(fn) -> str | None:
    """The shared object a C function's code is in (``dladdr``), None where unknown."""

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        libc = ctypes.CDLL(None)
        dladdr = libc.dladdr
    except (OSError, AttributeError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    info = DlInfo()
    if not dladdr(ctypes.cast(fn, ctypes.c_void_p).value, ctypes.byref(info)) or not info.dli_fname:
        return None
    return str(Path(info.dli_fname.decode()).resolve())
