"""tests/test_library.py: the shared library keeps the promises that make it torch-independent:
no torch/ATen/c10/pybind11 header in c/ or kernels/, no libtorch/libc10/libcudart among its
dynamic dependencies, the ABI version of c/msda.h, and capability queries that agree with torch.
"""
import ctypes
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

import pymsda

REPO = pathlib.Path(__file__).resolve().parent.parent
FORBIDDEN_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]\s*(torch/|ATen/|c10/|pybind11/|'
                               r'torch/extension\.h|Python\.h)', re.MULTILINE)
SOURCE_SUFFIXES = {".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".cu", ".cuh", ".inc"}


def c_sources():
    files = []
    for folder in ("c", "kernels"):
        root = REPO / folder
        if root.is_dir():
            files += [p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES]
    return files


def test_no_torch_headers_in_c_or_kernels():
    files = c_sources()
    assert REPO / "c" / "msda.h" in files  # the scan sees the sources at all
    offenders = [f"{path.relative_to(REPO)}: {match.group(0).strip()}"
                 for path in files
                 for match in FORBIDDEN_INCLUDE.finditer(path.read_text(errors="replace"))]
    assert offenders == []


def test_forbidden_include_pattern_catches_offenders():
    # Guard the guard: the pattern must see the includes it exists to reject.
    for line in ("#include <torch/extension.h>", "#include <ATen/ATen.h>",
                 "  #  include <c10/cuda/CUDAStream.h>", '#include "pybind11/pybind11.h"'):
        assert FORBIDDEN_INCLUDE.search(line), line
    assert not FORBIDDEN_INCLUDE.search("#include <cuda_runtime.h>")


def test_library_path_is_the_loaded_library():
    path = pymsda.library_path()
    assert isinstance(path, str) and os.path.isfile(path)
    assert os.path.basename(path).startswith("libpymsda")


def needed_entries(path):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf is not installed")
    text = subprocess.run([readelf, "-d", path], check=True, capture_output=True,
                          text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", text)


def test_library_does_not_link_torch_or_cudart():
    needed = needed_entries(pymsda.library_path())
    assert needed, "readelf found no NEEDED entries (not even libc): the parse is broken"
    assert any(name.startswith("libc.so") for name in needed)
    bad = [n for n in needed if re.match(r"lib(torch|c10|cudart|python)", n)]
    assert bad == [], f"libpymsda needs {bad}"


def test_library_abi_version_matches_header():
    header = (REPO / "c" / "msda.h").read_text()
    version = int(re.search(r"#define\s+MSDA_ABI_VERSION\s+(\d+)", header).group(1))
    library = ctypes.CDLL(pymsda.library_path())
    library.msda_abi_version.restype = ctypes.c_int
    assert library.msda_abi_version() == version


def test_library_exports_the_c_contract():
    library = ctypes.CDLL(pymsda.library_path())
    header = (REPO / "c" / "msda.h").read_text()
    functions = re.findall(r"MSDA_API\s+[\w\s\*]+?\b(msda_\w+)\s*\(", header)
    assert "msda_forward" in functions and "msda_backward" in functions
    for name in functions:
        assert hasattr(library, name), name


def test_status_strings_and_empty_last_error():
    library = ctypes.CDLL(pymsda.library_path())
    library.msda_status_string.restype = ctypes.c_char_p
    library.msda_status_string.argtypes = [ctypes.c_int]
    texts = [library.msda_status_string(code) for code in range(5)]
    assert all(texts) and len(set(texts)) == 5  # a distinct text for each status
    library.msda_last_error.restype = ctypes.c_char_p
    assert isinstance(library.msda_last_error(), bytes)


def test_has_cuda_agrees_with_torch_and_library():
    library = ctypes.CDLL(pymsda.library_path())
    library.msda_has_cuda.restype = ctypes.c_int
    library.msda_cuda_device_count.restype = ctypes.c_int
    library.msda_cuda_archs.restype = ctypes.c_char_p
    built_with_cuda = bool(library.msda_has_cuda())
    has_cuda = pymsda.has_cuda()
    assert isinstance(has_cuda, bool)
    if not torch.cuda.is_available() or not built_with_cuda:
        assert has_cuda is False
    if has_cuda:
        assert library.msda_cuda_device_count() >= 1
    if torch.cuda.is_available() and built_with_cuda and library.msda_cuda_device_count() >= 1:
        assert has_cuda is True
    if not built_with_cuda:
        assert library.msda_cuda_device_count() == 0
        assert library.msda_cuda_archs() == b""
    else:
        assert re.fullmatch(rb"(sm|compute)_\d+a?( (sm|compute)_\d+a?)*",
                            library.msda_cuda_archs())
