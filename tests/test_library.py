"""tests/test_library.py: the shared library keeps the promises that make it torch-independent:
no torch/ATen/c10/pybind11 header in c/ or kernels/, no libtorch/libc10/libcudart among its
dynamic dependencies, the ABI version of c/msda.h, and capability queries that agree with torch.
Also the portability promises: the GPU architectures the build embeds (checked with cuobjdump),
what `python -m pymsda` says about a GPU they do not cover, and the py3-none wheel.
"""
import ast
import ctypes
import glob
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

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


# ---- GPU architectures --------------------------------------------------------------------------

def find_cuobjdump():
    """cuobjdump from the PATH, the CUDA toolkit of nvcc, or pip's nvidia-cuda-cuobjdump."""
    candidates = [shutil.which("cuobjdump")]
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "cuobjdump"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), "cuobjdump"))
    for folder in sys.path:
        candidates += sorted(glob.glob(os.path.join(folder, "nvidia", "cu*", "bin", "cuobjdump")))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def test_library_embeds_the_promised_gpu_architectures():
    promised = pymsda.cuda_archs()
    if not promised:
        pytest.skip("CPU-only build: the library embeds no GPU code")
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (CUDA toolkit, or pip install nvidia-cuda-cuobjdump)")
    path = pymsda.library_path()
    listing = {kind: subprocess.run([cuobjdump, "--list-" + kind, path], check=True,
                                    capture_output=True, text=True).stdout
               for kind in ("elf", "ptx")}
    # One line per (compilation unit, architecture), e.g. "ELF file 2: libpymsda.2.sm_80.cubin"
    # and "PTX file 1: libpymsda.1.sm_121.ptx" (PTX of compute_121).
    sass = re.findall(r"\.(sm_\d+[af]?)\.cubin$", listing["elf"], re.M)
    ptx = ["compute_" + a[3:] for a in re.findall(r"\.(sm_\d+[af]?)\.ptx$", listing["ptx"], re.M)]
    assert sorted(set(sass) | set(ptx)) == sorted(promised)
    # Every CUDA source was compiled for every architecture: no unit lacks one.
    counts = {arch: (sass + ptx).count(arch) for arch in promised}
    assert len(set(counts.values())) == 1, counts


def _makefile_defaults():
    """(DEFAULT_ARCHS, DEFAULT_PTX) as the Makefile states them."""
    text = (REPO / "Makefile").read_text()
    archs = re.search(r"^DEFAULT_ARCHS\s*:=\s*(.+)$", text, re.M).group(1).split()
    ptx = re.search(r"^DEFAULT_PTX\s*:=\s*(\d+)$", text, re.M).group(1)
    return [int(a) for a in archs], int(ptx)


def _nvcc_archs_of_this_build():
    """The architectures from sm_75 that the nvcc on the PATH knows, when it is the CUDA
    version the library was built with; else None."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    library = ctypes.CDLL(pymsda.library_path())
    built = library.msda_cuda_version()
    release = re.search(r"release (\d+)\.(\d+)", subprocess.run(
        [nvcc, "--version"], capture_output=True, text=True).stdout)
    if not release or built != int(release.group(1)) * 1000 + int(release.group(2)) * 10:
        return None
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    return sorted(int(n) for n in re.findall(r"^compute_(\d+)$", listed, re.M) if int(n) >= 75)


def test_embedded_architectures_follow_the_makefiles_rules():
    # The default list (CUDA_ARCHS=default, MSDA_CUDA=1 or a CUDA torch without a GPU) embeds
    # machine code for the Makefile's DEFAULT_ARCHS that this nvcc knows and PTX of DEFAULT_PTX,
    # which every newer GPU compiles at first use. Any other list (the GPUs a plain `make` saw,
    # CUDA_ARCHS=90, CUDA_ARCHS=all) embeds PTX of its newest architecture.
    archs = pymsda.cuda_archs()
    if not archs:
        pytest.skip("CPU-only build")
    default, ptx = _makefile_defaults()
    sm = sorted(int(a[3:]) for a in archs if re.fullmatch(r"sm_\d+", a))
    known = _nvcc_archs_of_this_build()
    embedded_ptx = [int(a[8:]) for a in archs if a.startswith("compute_")]
    if sm == [a for a in default if known is None or a in known]:
        assert embedded_ptx == [ptx], archs
    else:
        assert embedded_ptx == [max(sm)], archs
    # A make build folder's choice.mk names what its library embeds (`make info` reads it).
    folder = pathlib.Path(pymsda.library_path()).resolve().parent
    choice = next((f / "choice.mk" for f in (folder, folder.parent)
                   if (f / "choice.mk").is_file() and (f / "config").is_file()), None)
    if choice is not None:
        remembered = dict(re.findall(r"^REMEMBERED_(\w+) := *(.*?) *$", choice.read_text(), re.M))
        assert [int(a) for a in remembered["CUDA_ARCHS"].split()] == sm, (choice, remembered)
        assert [int(remembered["CUDA_PTX"])] == embedded_ptx


def test_default_list_covers_every_gpu_from_sm_75():
    # Machine code of X.Y runs on X.Z, Z >= Y; PTX on any newer GPU: the default list leaves no
    # GPU of compute capability 7.5 or newer uncovered (sm_110, Jetson Thor, through the PTX).
    from pymsda.__main__ import arch_coverage
    default, ptx = _makefile_defaults()
    archs = [f"sm_{a}" for a in default] + [f"compute_{ptx}"]
    for cc in [(7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0),
               (12, 0), (12, 1), (13, 0)]:
        covered, how = arch_coverage(cc, archs)
        assert covered, (cc, how)
    assert not arch_coverage((7, 0), archs)[0]


ARCHS = "sm_75 sm_80 sm_86 sm_87 sm_88 sm_89 sm_90 sm_100 sm_103 sm_110 sm_120 sm_121 compute_121"


@pytest.mark.parametrize("capability,archs,covered,how", [
    ((9, 0), ARCHS, True, "machine code sm_90"),
    ((8, 9), "sm_75 sm_80 sm_86 compute_86", True, "machine code sm_86 (runs on sm_89"),
    ((12, 1), ARCHS, True, "machine code sm_121"),
    ((13, 0), ARCHS, True, "PTX compute_121, JIT"),
    ((10, 0), "sm_80 sm_90 compute_90", True, "PTX compute_90"),
    ((7, 0), ARCHS, False, "NOT COVERED"),
    ((6, 1), "sm_75 compute_75", False, "make CUDA_ARCHS=61"),
    ((9, 0), "sm_90a", True, "machine code sm_90a"),
    ((10, 0), "sm_90a", False, "NOT COVERED"),       # arch-specific code runs on sm_90 only
    ((8, 6), "sm_80 sm_90", True, "machine code sm_80 (runs on sm_86"),
    ((9, 0), "sm_80 sm_86", False, "NOT COVERED"),     # no SASS across majors, no PTX
    ((8, 0), "sm_86 compute_86", False, "NOT COVERED"),  # neither runs on an older minor
])
def test_arch_coverage_rules(capability, archs, covered, how):
    from pymsda.__main__ import arch_coverage
    got_covered, got_how = arch_coverage(capability, archs.split())
    assert got_covered is covered and how in got_how, got_how


def test_python_m_pymsda_names_a_gpu_it_cannot_serve(monkeypatch, capsys):
    import pymsda.__main__ as cli
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: [(9, 0), (6, 1)][i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Test GPU {i}")
    monkeypatch.setattr(cli, "cuda_archs", lambda: ARCHS.split())
    monkeypatch.setattr(cli._clib.lib, "msda_has_cuda", lambda: 1)
    monkeypatch.setattr(cli._clib.lib, "msda_cuda_version", lambda: 13000)
    coverage = cli.info()
    out = capsys.readouterr().out
    assert [covered for _, covered, _ in coverage] == [True, False]
    assert "embedded: " + ARCHS in out
    assert "cuda:0:" in out and "sm_90: machine code sm_90" in out
    assert "cuda:1:" in out and "sm_61: NOT COVERED" in out


def test_python_m_pymsda_info_lists_the_embedded_architectures():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(pymsda.__file__))
    if os.environ.get("PYMSDA_LIBRARY"):
        env["PYMSDA_LIBRARY"] = os.environ["PYMSDA_LIBRARY"]
    done = subprocess.run([sys.executable, "-m", "pymsda", "info"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"pymsda library: {pymsda.library_path()}" in done.stdout
    if pymsda.cuda_archs():
        assert "embedded: " + " ".join(pymsda.cuda_archs()) in done.stdout
    else:
        assert "CUDA kernels:   no (CPU-only build)" in done.stdout


def test_python_m_pymsda_help_explains_each_command_and_imports_no_torch_for_it(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pymsda.__file__)))
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "pymsda", "--help"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=env)  # the pymsda tested here
    assert done.returncode == 0, done.stderr
    for command in ("[check]", "info", "bench"):
        assert f"python -m pymsda {command} " in done.stdout
    assert "float64" in done.stdout and "exit" in done.stdout  # what the self-check compares
    # torch is imported by the commands that use it: pymsda/__init__.py defers it while
    # `python -m pymsda` starts (sys.orig_argv, Python 3.10 and later, says that it does)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "pymsda" in imported
    if sys.version_info >= (3, 10):
        assert "torch" not in imported
    tree = ast.parse(pathlib.Path(pymsda.__file__).with_name("__main__.py").read_text())
    top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [a.name for node in top for a in node.names] + [node.module or "" for node in top
                                                              if isinstance(node, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] in ("torch", "ops", "reference")], names


def test_python_m_pymsda_says_which_package_and_library_and_why(monkeypatch):
    import pymsda.__main__ as cli
    lines = "\n".join(cli.where())
    assert f"pymsda package: {os.path.dirname(pymsda.__file__)}" in lines
    reason = {"installed package": "the copy inside the package",
              "source checkout": "the checkout's build/ folder",
              "PYMSDA_LIBRARY": "the environment variable PYMSDA_LIBRARY"}
    loaded = os.path.realpath(pymsda.library_path())
    origin = next(o for o, p in cli._clib.candidate_paths() if os.path.realpath(p) == loaded)
    assert reason[origin] in lines
    # a source checkout says that it shadows an installed copy
    in_checkout = os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(pymsda.__file__)),
                                              "c", "msda.h"))
    assert ("a source checkout" in lines) == in_checkout
    monkeypatch.setenv("PYMSDA_LIBRARY", pymsda.library_path())
    assert reason["PYMSDA_LIBRARY"] in "\n".join(cli.where())


# ---- the wheel ----------------------------------------------------------------------------------

def test_wheel_is_py3_none_platform_and_carries_the_loaded_library(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "pymsda"))
    try:
        import _build_backend
    finally:
        sys.path.pop(0)
    # The backend packs <PYMSDA_BUILD_DIR>/libpymsda.so: point it at the library these tests run.
    monkeypatch.setenv("PYMSDA_BUILD_DIR", os.path.dirname(pymsda.library_path()))
    if os.path.basename(pymsda.library_path()) != "libpymsda.so":
        pytest.skip(f"the loaded library is not named libpymsda.so: {pymsda.library_path()}")
    name = _build_backend.build_wheel(str(tmp_path))
    assert re.fullmatch(r"pymsda-[\w.]+-py3-none-(linux|manylinux)\w+\.whl", name), name
    with zipfile.ZipFile(tmp_path / name) as wheel:
        names = set(wheel.namelist())
        with open(pymsda.library_path(), "rb") as f:
            assert wheel.read("pymsda/libpymsda.so") == f.read()
        sources = {f"pymsda/{p.relative_to(REPO / 'pymsda').as_posix()}"
                   for p in (REPO / "pymsda").rglob("*.py")
                   if "__pycache__" not in p.parts and p.name != "_build_backend.py"}
        assert sources <= names
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        tags = wheel.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Requires-Python: >=" in metadata
    # torch only behind an extra: installing the wheel never makes pip fetch a torch.
    assert not re.search(r"^Requires-Dist: torch\b[^;]*$", metadata, re.M), metadata[:2000]
    assert "Root-Is-Purelib: false" in tags and "Tag: py3-none-" in tags


def _letters(comment):
    """The calls a field's comment in c/msda.h names: "F B W R. B batch, ..." -> "FBWR"."""
    found = re.match(r"\s*((?:[FBWR]\s+)*[FBWR])\s*[.:,]", comment)
    return "".join(found.group(1).split()) if found else None


def _header_args_fields(header):
    """(name, struct code, letters) of each msda_args field in c/msda.h, in order. A field's
    letters are those of the comment on its line, else of the nearest comment above it."""
    from pymsda import _clib
    body = re.search(r"typedef struct \{(.*?)\} msda_args;", header, re.S).group(1)
    items = list(re.finditer(r"/\*(.*?)\*/|([^;/]+);", body, re.S))

    def same_line(first, second):
        return "\n" not in body[first.end():second.start()]

    codes = {"int64_t": "q", "int32_t": "i"}
    fields, above = [], None
    for i, item in enumerate(items):
        if item.group(1) is not None:  # a comment: on a field's line, or above the next ones
            if not (i and items[i - 1].group(2) is not None and same_line(items[i - 1], item)):
                above = _letters(item.group(1))
            continue
        after = items[i + 1] if i + 1 < len(items) else None
        on_line = after is not None and after.group(1) is not None and same_line(item, after)
        letters = _letters(after.group(1)) if on_line else above
        kind, names = re.match(r"\s*(?:const\s+)?(\w+)\s*(.*)", item.group(2), re.S).groups()
        for name in names.split(","):
            pointer = name.strip().startswith("*")
            fields.append((name.strip(" *\n"), _clib.PTR if pointer else codes[kind], letters))
    return tuple(fields)


def test_args_struct_mirrors_the_header():
    """pymsda/_clib.py's one list of msda_args (ARGS_FIELDS) has the header's fields, in its
    order, of its types, each read by the calls the header's comments name (F B W R), and the
    header's size; the packers derived from it for the calls (the fields each call reads, zeros
    elsewhere) write the bytes ARGS writes."""
    from pymsda import _clib
    header = (REPO / "c" / "msda.h").read_text()
    assert _header_args_fields(header) == _clib.ARGS_FIELDS
    size = int(re.search(r"no padding .*?: (\d+)\s*\*?\s*bytes", header, re.S).group(1))
    assert _clib.ARGS.size == size == 192

    values = {name: 1000 + i for i, name in enumerate(_clib.ARGS_NAMES)}
    values["reserved"] = 0
    for call, packer in (("F", _clib.pack_forward), ("B", _clib.pack_backward),
                         ("W", _clib.pack_workspace)):
        names = _clib.read_by(call)
        assert packer(*(values[n] for n in names)) == _clib.pack_args(
            **{n: values[n] for n in names})
    assert _clib.read_by("W") == ("B", "S", "H", "C", "L", "Q", "P", "dtype", "device", "flags")
    with pytest.raises(ValueError, match="order"):
        _clib.args_packer("S", "B")


def test_args_fields_are_checked_against_the_header_with_their_letters():
    """The header parse above sees a field's letters change (so the check is not vacuous)."""
    header = (REPO / "c" / "msda.h").read_text()
    changed = header.replace("int32_t index_dtype; /* F B:", "int32_t index_dtype; /* F:")
    assert changed != header
    fields = dict((name, letters) for name, _, letters in _header_args_fields(changed))
    assert fields["index_dtype"] == "F" and fields["num_threads"] == "FB"


def test_dtypes_mirror_the_dtype_table():
    """pymsda/_clib.py's DTYPES has c/dtypes.h's rows in their order: each row's msda_dtype code
    (c/msda.h) and whether it is a half type; every torch dtype it names exists."""
    from pymsda import _clib
    codes = dict((name, int(code)) for name, code in re.findall(
        r"(MSDA_\w+) = (\d+)", re.search(r"typedef enum \{(.*?)\} msda_dtype;",
                                         (REPO / "c" / "msda.h").read_text(), re.S).group(1)))
    rows = re.findall(r"#define MSDA_DTYPE_\d+\(X\) X\((MSDA_\w+),[^)]*, ([01])\)",
                      (REPO / "c" / "dtypes.h").read_text())
    assert [(codes[name], half == "1") for name, half in rows] == [
        (code, half) for code, _, half in _clib.DTYPES]
    assert all(isinstance(getattr(torch, name, None), torch.dtype) for _, name, _ in _clib.DTYPES)


def test_null_args_and_a_nonzero_reserved_field_are_refused():
    """Every entry point that takes a msda_args refuses NULL (a status, or -1 from the
    queries) and a nonzero reserved field, naming itself and the cause."""
    from pymsda import _clib
    lib = _clib.lib
    calls = {"msda_forward": lib.msda_forward, "msda_backward": lib.msda_backward,
             "msda_backward_workspace_size": lib.msda_backward_workspace_size,
             "msda_forward_route": lambda args: lib.msda_forward_route(args, 1),
             "msda_backward_route": lambda args: lib.msda_backward_route(args, 7, 1, 132, 1)}
    refused = {"msda_forward": _clib.ERR_INVALID_ARGUMENT,
               "msda_backward": _clib.ERR_INVALID_ARGUMENT,
               "msda_backward_workspace_size": -1, "msda_forward_route": -1,
               "msda_backward_route": -1}
    sizes = dict(B=1, S=4, H=1, C=4, L=1, Q=1, P=1, dtype=_clib.DTYPE_F32, device=-1)
    for name, call in calls.items():
        assert call(None) == refused[name]
        assert lib.msda_last_error().decode() == f"{name}: args is NULL"
        assert call(_clib.pack_args(**sizes, reserved=3)) == refused[name]
        assert lib.msda_last_error().decode() == f"{name}: reserved = 3 must be 0"
    assert lib.msda_backward_workspace_size(_clib.pack_args(**sizes)) == 0
    assert lib.msda_last_error() == b""


# ---- the C library's own checks, reached directly through ctypes -----------------------------
# Sizes whose element or byte counts pass 64 bits, negative or zero sizes, thread counts OpenMP
# would abort on and misaligned pointers: refused by msda_forward itself, naming the cause.

def _call_forward(sizes, num_threads=1, pointers=None):
    from pymsda import _clib
    buffer = torch.zeros(64, dtype=torch.float64)
    p = buffer.data_ptr()
    ptrs = pointers or [p] * 6
    names = ("value", "spatial_shapes", "level_start_index", "sampling_locations",
             "attention_weights", "output")
    status = _clib.lib.msda_forward(_clib.pack_args(
        **dict(zip("BSHCLQP", sizes)), dtype=_clib.DTYPE_F32, index_dtype=_clib.INDEX_I64,
        device=-1, num_threads=num_threads, **dict(zip(names, ptrs))))
    return status, _clib.lib.msda_last_error().decode()


@pytest.mark.parametrize("sizes,needle", [
    ((2 ** 40, 2 ** 40, 1, 1, 1, 1, 1), "overflow"),                   # B*S past int64
    ((2 ** 21, 2 ** 20, 2 ** 10, 2 ** 10, 1, 1, 1), "overflow"),       # elements fit, bytes do not
    ((1, 1, 1, 2 ** 40, 1, 2 ** 30, 1), "overflow"),                   # only the output overflows
    ((1, 1, 1, 1, 2 ** 40, 2 ** 30, 2 ** 4), "overflow"),              # only the locations
    ((1, 1, 1, 1, 2 ** 62, 0, 1), "level tables"),                     # Q = 0 leaves L unbounded
    ((-1, 1, 1, 1, 1, 1, 1), "size B"),
    ((1, 1, 1, 1, 1, -5, 1), "size Q"),
    ((1, 1, 0, 1, 1, 1, 1), "size H"),
], ids=["B_S", "value_bytes", "output", "locations", "levels", "negative_B", "negative_Q",
        "zero_H"])
def test_c_library_refuses_sizes_it_cannot_index(sizes, needle):
    from pymsda import _clib
    status, text = _call_forward(sizes)
    assert status == _clib.ERR_INVALID_ARGUMENT and needle in text, text


def test_c_library_refuses_a_thread_count_openmp_would_abort_on():
    from pymsda import _clib
    status, text = _call_forward((1, 4, 1, 1, 1, 1, 1), num_threads=2 ** 31 - 1)
    assert status == _clib.ERR_INVALID_ARGUMENT and "num_threads" in text, text
    status, text = _call_forward((1, 4, 1, 1, 1, 1, 1), num_threads=0)  # the OpenMP default
    assert status == _clib.OK and text == ""


@pytest.mark.parametrize("which,name", [(0, "value"), (1, "spatial_shapes"),
                                        (3, "sampling_locations"), (5, "output")])
def test_c_library_refuses_misaligned_pointers(which, name):
    from pymsda import _clib
    buffer = torch.zeros(64, dtype=torch.float64)
    pointers = [buffer.data_ptr()] * 6
    pointers[which] += 2  # element-aligned for nothing but 2-byte types
    status, text = _call_forward((1, 4, 1, 1, 1, 1, 1), pointers=pointers)
    assert status == _clib.ERR_INVALID_ARGUMENT and name in text and "aligned" in text, text
