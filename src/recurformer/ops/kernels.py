"""The compiled CPU kernels (`ops/csrc/`): built once with the system's C++ compiler,
cached, and loaded with ctypes.

The kernels are plain C++ (no PyTorch headers), so a build takes seconds and needs only a
C++ compiler with OpenMP (`g++`, or `$CXX`). Python checks every argument, allocates every
output and passes raw pointers; the C++ code trusts them.

The interface is declared once, in C++. Every source file in `csrc/` is built; each lists its
exported functions and structs (`csrc/abi.h`), and the library describes them (`rf_abi`):
the loader takes each function's ctypes signature from that description, `run` checks a
call's argument count against it, and `require` checks a ctypes struct mirror's size
against the C++ struct's.

Build and cache. The shared library goes to `$RECURFORMER_CACHE/kernels/<key>/` (default
`~/.cache/recurformer`), where `<key>` hashes the sources, the compiler's identity, the
flags and this CPU's feature flags (the build uses `-march=native`, so a build is only
ever loaded on the kind of CPU it was made for). A build runs in a temporary directory
that is moved into place only when complete, under a file lock (`filelock`), so an interrupted build
leaves nothing that a later run would load, and two processes never build at once. A
cached build whose library does not match the checksum recorded next to it, or does not
load, is rebuilt.

Fallback. `library()` returns None, and the scans and steps run their PyTorch code, when
`RECURFORMER_KERNELS=torch` is set, or when the build fails (no compiler, no OpenMP, a
compiler error): the latter prints one line, once per process,
`recurformer: compiled kernels unavailable (<reason>); using the torch path`.
A build failure never raises.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from filelock import FileLock
from torch import Tensor

from ..files import atomic_directory

ENV = "RECURFORMER_KERNELS"
CACHE_ENV = "RECURFORMER_CACHE"
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(sorted(p.name for p in SOURCE_DIR.iterdir() if p.suffix in (".h", ".cpp")))  # all of csrc/
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c++17", "-fno-math-errno")  # compile and link
LINK_FLAGS = ("-shared",)
LIBRARY = "librecurformer_kernels.so"
MANIFEST = "build.json"
BUILD_TIMEOUT_S = 600

# the one-letter type codes of `ops/csrc/abi.h`
CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int, "q": ctypes.c_int64, "f": ctypes.c_float, "d": ctypes.c_double}


class BuildError(RuntimeError):
    """The kernels could not be built or loaded; the message is one line."""


class Library(ctypes.CDLL):
    """The loaded kernels: every exported function with the ctypes signature the library
    describes (`rf_abi`, `ops/csrc/abi.h`), and `struct_sizes`, the bytes of each struct
    it exports, which the ctypes mirrors are checked against (`require`)."""

    struct_sizes: dict[str, int]

    def describe_exports(self) -> None:
        """Read `rf_abi()` and set each function's argtypes and restype from it. Raises
        ValueError for a description it cannot read (an incomplete or foreign build)."""
        self.rf_abi.argtypes, self.rf_abi.restype = [], ctypes.c_char_p
        self.struct_sizes = {}
        for line in self.rf_abi().decode().splitlines():
            what, name, description = line.split(" ")
            if what == "struct":
                self.struct_sizes[name] = int(description)
            elif what == "function":
                result, _, arguments = description.partition(":")
                function = getattr(self, name)
                function.restype, function.argtypes = CTYPES[result], [CTYPES[code] for code in arguments]
            else:
                raise ValueError(f"rf_abi: unknown export {what!r}")


def mode() -> str:
    """`auto` (build and use the kernels when possible) or `torch` (never), from `$RECURFORMER_KERNELS`."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "torch"):
        raise ValueError(f"{ENV}={value!r}: expected 'auto' or 'torch'")
    return value


def library() -> Library | None:
    """The loaded kernels, built first if needed; None (after a one-line notice) when they
    cannot be built, or when `RECURFORMER_KERNELS=torch`. Cached for the process."""
    return _loaded()[0]


def unavailable_reason() -> str:
    """Why `library()` is None, for error messages."""
    return _loaded()[1]


@functools.cache
def _loaded() -> tuple[Library | None, str]:
    """(the library, "") or (None, why not); the notice is printed here, so once."""
    if mode() == "torch":
        return None, f"{ENV}=torch"
    try:
        return load(cache_dir()), ""
    except Exception as error:  # noqa: BLE001 - whatever goes wrong, the torch path still runs
        reason = str(error) if isinstance(error, BuildError) else f"{type(error).__name__}: {error}"
        reason = (reason.strip().splitlines() or ["no message"])[0]
        notice = f"recurformer: compiled kernels unavailable ({reason}); using the torch path"
        print(notice, file=sys.stderr, flush=True)
        return None, reason


def reset() -> None:
    """Forget the loaded library and the reason it is missing (tests change the environment)."""
    _loaded.cache_clear()


def cache_dir() -> Path:
    """`$RECURFORMER_CACHE/kernels`, else `~/.cache/recurformer/kernels`."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "recurformer") / "kernels"


def compiler() -> str:
    """The C++ compiler: `$CXX`, else `g++`, else `c++`; BuildError when none is found."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise BuildError("no C++ compiler found (set CXX or install g++)")


def build_key(cxx: str) -> str:
    """Hash of everything a build depends on: sources, compiler, flags, CPU features."""
    digest = hashlib.sha256()
    for name in SOURCES:
        try:
            digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
        except OSError as error:
            raise BuildError(f"cannot read the kernel source {name}: {error.strerror}") from None
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"{cxx} --version failed: {error}") from None
    for part in (cxx, version, " ".join(FLAGS + LINK_FLAGS), platform.machine(), _cpu_flags()):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:20]


def _cpu_flags() -> str:
    """The CPU's feature flags (what `-march=native` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def load(root: Path) -> Library:
    """Load the build for this machine from `root`, building it first when it is missing
    or broken. Raises BuildError (one line) when that fails."""
    cxx = compiler()
    key = build_key(cxx)
    final = root / key
    lib = _load_checked(final)
    if lib is not None:
        return lib
    try:
        root.mkdir(parents=True, exist_ok=True)
        with FileLock(root / f"{key}.lock"):
            lib = _load_checked(final)  # another process may have built it meanwhile
            if lib is None:
                _build(cxx, root, key)
                lib = _load_checked(final)
    except OSError as error:
        raise BuildError(f"cannot write the build cache {root}: {error}") from None
    if lib is None:
        raise BuildError(f"the fresh build in {final} does not load")
    return lib


def _load_checked(folder: Path) -> Library | None:
    """The library in `folder` if it matches its manifest's checksum, loads and describes
    its exports, else None."""
    path = folder / LIBRARY
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("sha256") != _sha256(path):
            return None
        lib = Library(str(path))
        lib.describe_exports()
    except (OSError, ValueError, KeyError, AttributeError):  # missing, unreadable, corrupt, or incomplete
        return None
    return lib


def _build(cxx: str, root: Path, key: str) -> None:
    """Compile the sources side by side into a staging directory, link them, and move the
    directory into place as `root / key` (replacing a broken build there). Called with the
    build lock held."""
    for stale in root.glob(f".{key}.*"):  # left by an interrupted build
        shutil.rmtree(stale, ignore_errors=True)
    with atomic_directory(root / key, replace=True) as work:
        objects = []
        compiles = []
        for name in SOURCES:
            if name.endswith(".cpp"):
                objects.append(str(work / name.replace(".cpp", ".o")))
                compiles.append([cxx, *FLAGS, "-c", str(SOURCE_DIR / name), "-o", objects[-1]])
        link = [cxx, *FLAGS, *LINK_FLAGS, *objects, "-o", str(work / LIBRARY)]
        _run_all(cxx, compiles)
        _run_all(cxx, [link])
        for path in objects:
            os.remove(path)
        manifest = {"key": key, "sha256": _sha256(work / LIBRARY), "commands": [*compiles, link]}
        (work / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _run_all(cxx: str, commands: list[list[str]]) -> None:
    """Run the commands at the same time; BuildError (the first error line) if one fails."""
    name = Path(cxx).name
    try:
        running = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in commands]
    except OSError as error:
        raise BuildError(f"{name} failed to run: {error}") from None
    failure = None
    for process in running:
        try:
            _, stderr = process.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            _, stderr = process.communicate()
            failure = failure or f"{name} timed out after {BUILD_TIMEOUT_S} s"
        if process.returncode != 0:
            failure = failure or f"{name} failed: {_first_error(stderr)}"
    if failure:
        raise BuildError(failure)


def _first_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[0][:300]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- calling the kernels

def usable(*tensors: Tensor | None) -> bool:
    """Whether the kernels are loaded and take these tensors (on the CPU, fp32 or bf16):
    the test `auto` backends make before choosing them."""
    for t in tensors:
        if t is not None and not (t.is_cpu and (t.dtype is torch.float32 or t.dtype is torch.bfloat16)):
            return False
    return library() is not None


def require(op: str, *mirrors: type[ctypes.Structure]) -> Library:
    """The loaded kernels, or a one-line RuntimeError saying why `op` cannot run them: they
    are not built, or a ctypes struct of `mirrors` does not have the size of the C++
    struct of its name."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"{op}: backend='compiled' is unavailable ({unavailable_reason()}); use the torch backends")
    for mirror in mirrors:
        size = lib.struct_sizes.get(mirror.__name__)
        if size != ctypes.sizeof(mirror):
            raise RuntimeError(f"{op}: the ctypes struct {mirror.__name__} has {ctypes.sizeof(mirror)} bytes, the "
                               f"compiled kernels' {'has ' + str(size) if size else 'is not exported'}; its fields "
                               "must mirror the C++ struct's")
    return lib


def check(op: str, name: str, tensor, shape: tuple[int, ...] | None, layout: str = "") -> None:
    """One-line errors for a tensor argument that is not a CPU fp32 / bf16 tensor of `shape`
    (any shape if None; `layout` names the dimensions, e.g. "[B, T, D]"). Cheap (~1 us):
    the decode steps check every argument at every token."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(tensor).__name__}")
    if not tensor.is_cpu:
        raise ValueError(f"{op}: {name} must be on the CPU for the compiled kernels, got {tensor.device}")
    if tensor.dtype is not torch.float32 and tensor.dtype is not torch.bfloat16:
        raise TypeError(f"{op}: {name} must be float32 or bfloat16, got {tensor.dtype}")
    if shape is not None and tensor.shape != shape:
        raise ValueError(f"{op}: {name} must have shape {list(shape)} {layout}, got {list(tensor.shape)}")


def io_dtype(*tensors: Tensor | None) -> torch.dtype:
    """bf16 when every given streamed input is bf16 (the kernels read it as is), else fp32."""
    given = [t for t in tensors if t is not None]
    return torch.bfloat16 if all(t.dtype == torch.bfloat16 for t in given) else torch.float32


def prepare(tensor: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """`tensor` as a contiguous `dtype` tensor (itself when it already is one), or None."""
    if tensor is None:
        return None
    if tensor.dtype is not dtype:
        tensor = tensor.to(dtype)
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def run(op: str, function, *args) -> None:
    """Call a kernel with exactly the arguments its C++ signature has; its only failure
    (status 1) is running out of memory."""
    if function.argtypes is None:  # exported, but not listed with RF_EXPORT_FUNCTION (abi.h)
        raise TypeError(f"{op}: {function.__name__} is not described by the library; list it with "
                        f"RF_EXPORT_FUNCTION({function.__name__}) after its extern \"C\" block")
    if len(args) != len(function.argtypes):
        raise TypeError(f"{op}: {function.__name__} takes {len(function.argtypes)} arguments, got {len(args)}")
    if function(*args) != 0:
        raise MemoryError(f"{op}: out of memory in the compiled kernel")


def pointer(tensor: Tensor | None) -> int | None:
    """The tensor's data address for ctypes (None is the null pointer)."""
    return None if tensor is None else tensor.data_ptr()
