"""The kernels' interface, declared once in C++ (`ops/csrc/abi.h`): every exported function
described with its types, every ctypes struct mirror the size of its C++ struct, a call with
the wrong number of arguments refused; and the one set of backend names with its one rule."""

import ctypes
import importlib
import importlib.util
import pkgutil
import re

import pytest
import torch

import recurformer.ops.window_step.compiled as window_step
from recurformer import ops
from recurformer.mixers import MixerConfig
from recurformer.ops import kernels
from recurformer.ops.backends import BACKENDS, pick_backend


def ctypes_mirrors() -> tuple[type[ctypes.Structure], ...]:
    """Every ctypes struct defined in an op's `compiled.py` (found, not listed: a new
    kernel's mirror is checked without an edit here)."""
    found = []
    for op in pkgutil.iter_modules(ops.__path__):
        name = f"{ops.__name__}.{op.name}.compiled"
        if op.ispkg and importlib.util.find_spec(name) is not None:
            module = importlib.import_module(name)
            found += [v for v in vars(module).values()
                      if isinstance(v, type) and issubclass(v, ctypes.Structure) and v.__module__ == name]
    return tuple(sorted(found, key=lambda mirror: mirror.__name__))


MIRRORS = ctypes_mirrors()


def defined_exports() -> set[str]:
    """The `rf_` functions the C++ sources define (at the start of a line, C linkage)."""
    names = set()
    for name in kernels.SOURCES:
        text = (kernels.SOURCE_DIR / name).read_text()
        names |= set(re.findall(r"^(?:int|int64_t|float|double|void\*|const char\*) (rf_\w+)\(", text, re.M))
    return names


def test_every_source_is_built():
    on_disk = {p.name for p in kernels.SOURCE_DIR.iterdir() if p.suffix in (".h", ".cpp")}
    assert set(kernels.SOURCES) == on_disk and "abi.h" in on_disk


def test_the_library_describes_every_export(compiled):
    described = {line.split(" ")[1] for line in compiled.rf_abi().decode().splitlines() if line.startswith("function")}
    assert described | {"rf_abi"} == defined_exports()
    for name in described:
        function = getattr(compiled, name)
        assert function.argtypes and function.restype in (ctypes.c_int, ctypes.c_int64)
    # what the signatures say, for two of them: the window forward's scale is a float, the scans' sizes int64
    assert compiled.rf_window_forward.argtypes[-2] is ctypes.c_float
    assert compiled.rf_ssd_checkpoint_floats.argtypes == [ctypes.c_int64] * 3


def test_every_exported_struct_has_a_mirror(compiled):
    assert {mirror.__name__ for mirror in MIRRORS} == set(compiled.struct_sizes)
    assert {"WindowStepWeights", "AttentionStepWeights"} <= {mirror.__name__ for mirror in MIRRORS}


@pytest.mark.parametrize("mirror", MIRRORS, ids=lambda m: m.__name__)
def test_struct_mirrors_have_the_cpp_size(compiled, mirror):
    assert compiled.struct_sizes[mirror.__name__] == ctypes.sizeof(mirror)
    assert kernels.require("op", mirror) is compiled


def test_a_mirror_that_differs_is_refused_in_one_line(compiled):
    class WindowStepWeights(ctypes.Structure):  # one field short of the C++ struct
        _fields_ = window_step.WindowStepWeights._fields_[:-1]

    with pytest.raises(RuntimeError, match=r"window_step: the ctypes struct WindowStepWeights has 296 bytes, the "
                                           r"compiled kernels' has 304") as raised:
        kernels.require("window_step", WindowStepWeights)
    assert "\n" not in str(raised.value)

    class Unknown(ctypes.Structure):
        _fields_ = [("x", ctypes.c_int64)]

    with pytest.raises(RuntimeError, match="Unknown has 8 bytes, the compiled kernels' is not exported"):
        kernels.require("op", Unknown)


def test_a_call_with_the_wrong_argument_count_is_refused(compiled):
    with pytest.raises(TypeError, match="op: rf_ssd_checkpoint_floats takes 3 arguments, got 2"):
        kernels.run("op", compiled.rf_ssd_checkpoint_floats, 1, 2)


def test_a_function_the_library_does_not_describe_is_refused_in_one_line():
    undescribed = ctypes.CDLL(None).abs  # any C function without ctypes argtypes
    with pytest.raises(TypeError, match=r"op: abs is not described by the library; list it with "
                                        r"RF_EXPORT_FUNCTION\(abs\) after its extern \"C\" block"):
        kernels.run("op", undescribed, 1)


def test_pick_backend_names_and_rule(monkeypatch):
    x = torch.zeros(2, 3)
    for name in BACKENDS[1:]:
        assert pick_backend("op", name, x) == name
    assert pick_backend("op", "chunked", x) == "torch"  # the scans' earlier name
    assert pick_backend("op", "auto", x, cuda=True) == "cuda"
    assert pick_backend("op", "auto", x, fits=False) == "torch"
    assert pick_backend("op", "auto", x.double()) == "torch"  # not a kernel dtype
    monkeypatch.setattr(kernels, "usable", lambda *tensors: True)
    assert pick_backend("op", "auto", x) == "compiled"
    with pytest.raises(ValueError, match="unknown op backend 'triton'; choose one of auto, naive, torch, compiled, cuda"):
        pick_backend("op", "triton", x)


def test_configs_read_the_earlier_name():
    assert MixerConfig(kind="mamba", scan_backend="chunked").scan_backend == "torch"
    with pytest.raises(Exception, match="scan_backend: unknown 'fast'"):
        MixerConfig(kind="mamba", scan_backend="fast")
