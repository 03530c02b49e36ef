"""Loads libpymsda.so with ctypes and declares every C symbol once (mirror of c/msda.h); the
facts of the devices it serves; a failed status as the exception Python raises.

Search order: the PYMSDA_LIBRARY environment variable, then the copy installed inside this
package, then the build folder of a source checkout (../build next to this package). A failure
raises ImportError that names every path tried and why it was refused.

OpenMP: the library names no OpenMP library; at its first parallel call it binds its OpenMP
calls to the runtime already in the process (torch's, whatever torch calls its copy), else to the
system's libgomp.so.1, else runs on one thread (c/omp_runtime.c; msda_openmp_runtime() says which).
So the process keeps one OpenMP runtime, and the library loads without torch.

No torch needed: ONNX Runtime users load this module (through pymsda.library_path()) on machines
without torch, and `python -m pymsda --help` waits for no torch import. The lowest layer of the
package: it imports nothing of pymsda (the current CUDA stream is _torch_private's).
"""
import ctypes
import os
import struct

ABI_VERSION = 9  # must equal MSDA_ABI_VERSION in c/msda.h
LIBRARY_NAME = "libpymsda.so"

# msda_status (c/msda.h)
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_UNSUPPORTED = 2
ERR_CUDA = 3
ERR_INTERNAL = 4

# msda_dtype (c/msda.h; one row of c/dtypes.h each): the code, the name of torch's dtype, and
# whether it is a half type (2-byte storage computed in float32). The Python side reads its
# dtypes from here alone (pymsda/_checks.py: DTYPE_CODE, and the message naming them).
DTYPE_F32, DTYPE_F64, DTYPE_F16, DTYPE_BF16 = 0, 1, 2, 3
DTYPES = ((DTYPE_F32, "float32", False), (DTYPE_F64, "float64", False),
          (DTYPE_F16, "float16", True), (DTYPE_BF16, "bfloat16", True))
# msda_index_dtype (c/msda.h)
INDEX_I64, INDEX_I32 = 0, 1
# msda_flags (c/msda.h)
FLAG_NEAREST, FLAG_DETERMINISTIC, FLAG_POINTS_F32 = 1, 4, 8  # (2, the fused softmax, is gone)
# msda_route (c/msda.h): kernel values, then the modifier bits
ROUTE_KERNELS = {0: "none", 1: "generic", 2: "point", 3: "point_sliced", 4: "point_pipelined",
                 5: "aggregated", 6: "direct"}
ROUTE_KERNEL_MASK, ROUTE_DETERMINISTIC, ROUTE_F32_WORKSPACE = 0xFF, 0x100, 0x200
# msda_fwd_route (c/msda.h)
FWD_ROUTE_KERNELS = {0: "none", 1: "generic", 2: "fast", 3: "wide", 4: "direct"}

# msda_args (c/msda.h), the one argument of the compute entry points, kept here once: its fields
# in order, each with its struct code and the calls that read it, in the letters of the
# header's comments (F msda_forward, B msda_backward, W msda_backward_workspace_size, R the two
# route queries). tests/test_library.py reads the struct in c/msda.h and checks names, order,
# types and letters against this list. ARGS is its layout (fixed-width fields, no padding,
# 64-bit pointers: 192 bytes); the calls pass it packed into a bytes object, a fresh one per
# call, so concurrent calls never share a buffer. A pointer is packed as a signed int64 ("q":
# user-space addresses are below 2^63, and struct packs "q" faster than "Q").
PTR = "q"
ARGS_FIELDS = (
    ("B", "q", "FBWR"), ("S", "q", "FBWR"), ("H", "q", "FBWR"), ("C", "q", "FBWR"),
    ("L", "q", "FBWR"), ("Q", "q", "FBWR"), ("P", "q", "FBWR"),
    ("dtype", "i", "FBWR"), ("index_dtype", "i", "FB"), ("device", "i", "FBWR"),
    ("num_threads", "i", "FB"), ("flags", "i", "FBWR"), ("reserved", "i", "FBWR"),
    ("level_points", PTR, "FBR"), ("value", PTR, "FB"), ("spatial_shapes", PTR, "FB"),
    ("level_start_index", PTR, "FB"), ("sampling_locations", PTR, "FB"),
    ("attention_weights", PTR, "FB"), ("grad_output", PTR, "B"), ("output", PTR, "F"),
    ("grad_value", PTR, "B"), ("grad_sampling_locations", PTR, "B"),
    ("grad_attention_weights", PTR, "B"), ("workspace", PTR, "B"), ("workspace_bytes", "q", "B"),
    ("stream", PTR, "FB"),
)
ARGS_NAMES = tuple(name for name, _, _ in ARGS_FIELDS)


def _args_struct(names):
    """struct.Struct of msda_args packing the fields `names`, the others as zero bytes (pad
    bytes "x"); runs of one code merged ("7q", not "qqqqqqq": struct packs it faster)."""
    runs = []
    for name, code, _ in ARGS_FIELDS:
        count, code = (1, code) if name in names else (struct.calcsize(code), "x")
        if runs and runs[-1][1] == code:
            count += runs.pop()[0]
        runs.append((count, code))
    return struct.Struct("=" + "".join(f"{count}{code}" for count, code in runs))


ARGS = _args_struct(ARGS_NAMES)


def args_packer(*names):
    """The pack function of a msda_args that takes only the fields `names`, in the struct's
    order: the others are written as zero bytes. A hot path precompiles one, so a call packs
    no constant zeros (seven more arguments cost a struct.pack about 0.1 us)."""
    if list(names) != [n for n in ARGS_NAMES if n in names]:
        raise ValueError(f"{names} are not fields of msda_args in its order {ARGS_NAMES}")
    return _args_struct(names).pack


def read_by(call):
    """The fields that `call` (a letter of ARGS_FIELDS) reads, but `reserved` (always 0)."""
    return tuple(name for name, _, calls in ARGS_FIELDS if call in calls and name != "reserved")


# The packers of the calls: each takes the fields its call reads, in the struct's order.
pack_forward = args_packer(*read_by("F"))
pack_backward = args_packer(*read_by("B"))
pack_workspace = args_packer(*read_by("W"))


def pack_args(**fields):
    """A msda_args as bytes from fields by name (unnamed ones 0; a pointer as its address, None
    for NULL, a ctypes array as its address: keep it alive over the call)."""
    unknown = set(fields) - set(ARGS_NAMES)
    if unknown:
        raise TypeError(f"msda_args has no field {sorted(unknown)}")
    values = []
    for name in ARGS_NAMES:
        v = fields.get(name)
        values.append(0 if v is None else ctypes.addressof(v) if isinstance(v, ctypes.Array)
                      else v)
    return ARGS.pack(*values)


def unpack_args(packed):
    """The fields of a packed msda_args, by name."""
    return dict(zip(ARGS_NAMES, ARGS.unpack(packed)))


_i64, _int, _ptr, _str = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p
_args = _str  # const msda_args *: the packed bytes (None for NULL)

# name: (restype, argtypes), each with its C signature.
_SIGNATURES = {
    # int msda_abi_version(void)
    "msda_abi_version": (_int, []),
    # int msda_has_cuda(void)
    "msda_has_cuda": (_int, []),
    # int msda_cuda_device_count(void)
    "msda_cuda_device_count": (_int, []),
    # int msda_cuda_runs_on(int device)
    "msda_cuda_runs_on": (_int, [_int]),
    # const char *msda_cuda_archs(void)
    "msda_cuda_archs": (_str, []),
    # const char *msda_openmp_runtime(void)
    "msda_openmp_runtime": (_str, []),
    # int msda_cuda_version(void)
    "msda_cuda_version": (_int, []),
    # const char *msda_status_string(int status)
    "msda_status_string": (_str, [_int]),
    # const char *msda_last_error(void)
    "msda_last_error": (_str, []),
    # int msda_forward(const msda_args *args)
    "msda_forward": (_int, [_args]),
    # int msda_backward(const msda_args *args)
    "msda_backward": (_int, [_args]),
    # int64 msda_backward_workspace_size(const msda_args *args)
    "msda_backward_workspace_size": (_i64, [_args]),
    # int msda_forward_route(const msda_args *args, int aligned16)
    "msda_forward_route": (_int, [_args, _int]),
    # int msda_backward_route(const msda_args *args, int grads, int aligned16,
    #                         int multiprocessors, int sm90_code)
    "msda_backward_route": (_int, [_args] + [_int] * 4),
    # int msda_level_starts(int64 L, int64 S, int index_dtype, int device,
    #                       const void *spatial_shapes, void *level_start_index, void *stream)
    "msda_level_starts": (_int, [_i64, _i64, _int, _int, _ptr, _ptr, _ptr]),
}


def candidate_paths():
    """(origin, path) pairs in the order the loader tries them."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = []
    env = os.environ.get("PYMSDA_LIBRARY")
    if env:
        paths.append(("PYMSDA_LIBRARY", env))
    paths.append(("installed package", os.path.join(here, LIBRARY_NAME)))
    paths.append(("source checkout", os.path.join(os.path.dirname(here), "build", LIBRARY_NAME)))
    return paths


def _open(path):
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        raise OSError("msda_args is laid out for 64-bit pointers; this Python's are "
                      f"{8 * ctypes.sizeof(ctypes.c_void_p)}-bit")
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)  # AttributeError names a missing symbol
        fn.restype = restype
        fn.argtypes = argtypes
    abi = lib.msda_abi_version()
    if abi != ABI_VERSION:
        raise OSError(f"ABI version {abi}, this pymsda needs {ABI_VERSION} (rebuild with make)")
    return lib


def load():
    """Returns (ctypes library, path) or raises ImportError naming every path tried."""
    tried = []
    for origin, path in candidate_paths():
        if not os.path.exists(path):
            tried.append(f"  {path} ({origin}): not found")
            if origin == "PYMSDA_LIBRARY":
                break  # an explicit choice that fails is not silently replaced
            continue
        try:
            return _open(path), path
        except (OSError, AttributeError) as e:
            tried.append(f"  {path} ({origin}): {e}")
            if origin == "PYMSDA_LIBRARY":
                break
    raise ImportError(
        "pymsda could not load its C library " + LIBRARY_NAME + ". Tried:\n" + "\n".join(tried)
        + "\nBuild it with `make` in the source checkout and install with `pip install .`, "
        "or point PYMSDA_LIBRARY at a built " + LIBRARY_NAME + "."
    )


lib, path = load()

# getenv(b"NAME") -> the variable's bytes or None, read from the process environment (which
# os.environ writes through), in a fraction of os.environ.get's time: for variables read on
# every call (PYMSDA_VALIDATE)
getenv = ctypes.CDLL(None).getenv
getenv.restype, getenv.argtypes = ctypes.c_char_p, [ctypes.c_char_p]


def error_text(status):
    """The library's message for a failed call on this thread."""
    name = lib.msda_status_string(status).decode()
    text = lib.msda_last_error().decode()
    return f"{text} [{name}]" if text else name


def check(status):
    """Raises for a failed status: ValueError for an argument the library refused, RuntimeError
    otherwise, with the library's message."""
    if status != OK:
        exc = ValueError if status == ERR_INVALID_ARGUMENT else RuntimeError
        raise exc("pymsda: " + error_text(status))


# ---------------------------------------------------------------------------------------------
# the devices the library serves

has_cuda_kernels = bool(lib.msda_has_cuda())
# CUDA devices the library's kernels run on, and the library's reason for each one they do not
# (msda_cuda_runs_on, asked once per device, on its first call)
served_cuda = set()
unserved_cuda = {}


def serves_cuda(index):
    """Whether the library's kernels run on CUDA device `index` (asked once)."""
    if index in served_cuda:
        return True
    if index not in unserved_cuda:
        if lib.msda_cuda_runs_on(index):
            served_cuda.add(index)
            return True
        unserved_cuda[index] = lib.msda_last_error().decode()
    return False


def serves(device):
    """Whether the library serves tensors on `device` (the CPU, or a CUDA device it runs on)."""
    return device.type == "cpu" or (device.type == "cuda" and serves_cuda(device.index))
