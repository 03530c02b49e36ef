"""Loads libpymsda.so with ctypes and declares every C symbol once (mirror of c/msda.h).

Search order: the PYMSDA_LIBRARY environment variable, then the copy installed inside this
package, then the build folder of a source checkout (../build next to this package). A failure
raises ImportError that names every path tried and why it was refused.
"""
import ctypes
import os

ABI_VERSION = 6  # must equal MSDA_ABI_VERSION in c/msda.h
LIBRARY_NAME = "libpymsda.so"

# msda_status (c/msda.h)
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_UNSUPPORTED = 2
ERR_CUDA = 3
ERR_INTERNAL = 4

# msda_dtype and msda_index_dtype codes (c/msda.h)
DTYPE_F32, DTYPE_F64, DTYPE_F16, DTYPE_BF16 = 0, 1, 2, 3
INDEX_I64, INDEX_I32 = 0, 1
# msda_flags (c/msda.h)
FLAG_NEAREST, FLAG_SOFTMAX, FLAG_DETERMINISTIC = 1, 2, 4
# msda_route (c/msda.h): kernel values, then the modifier bits
ROUTE_KERNELS = {0: "none", 1: "generic", 2: "point", 3: "point_sliced", 4: "point_pipelined",
                 5: "aggregated"}
ROUTE_KERNEL_MASK, ROUTE_DETERMINISTIC, ROUTE_F32_WORKSPACE = 0xFF, 0x100, 0x200

_i64, _int, _ptr, _str = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p
_SIZES = [_i64] * 7  # B, S, H, C, L, Q, P

# name: (restype, argtypes), each with its C signature.
_SIGNATURES = {
    # int msda_abi_version(void)
    "msda_abi_version": (_int, []),
    # int msda_has_cuda(void)
    "msda_has_cuda": (_int, []),
    # int msda_cuda_device_count(void)
    "msda_cuda_device_count": (_int, []),
    # const char *msda_cuda_archs(void)
    "msda_cuda_archs": (_str, []),
    # int msda_cuda_version(void)
    "msda_cuda_version": (_int, []),
    # const char *msda_status_string(int status)
    "msda_status_string": (_str, [_int]),
    # const char *msda_last_error(void)
    "msda_last_error": (_str, []),
    # int msda_forward(int64 B, S, H, C, L, Q, P, int dtype, int index_dtype, int device,
    #                  int num_threads, const int64 *level_points, int flags,
    #                  const void *value, const void *spatial_shapes,
    #                  const void *level_start_index, const void *sampling_locations,
    #                  const void *attention_weights, void *output, void *stream)
    "msda_forward": (_int, _SIZES + [_int] * 4 + [_ptr, _int] + [_ptr] * 7),
    # int msda_backward(int64 B, S, H, C, L, Q, P, int dtype, int index_dtype, int device,
    #                   int num_threads, const int64 *level_points, int flags,
    #                   const void *value, const void *spatial_shapes,
    #                   const void *level_start_index, const void *sampling_locations,
    #                   const void *attention_weights, const void *grad_output,
    #                   void *grad_value, void *grad_sampling_locations,
    #                   void *grad_attention_weights, void *workspace, int64 workspace_bytes,
    #                   void *stream)
    "msda_backward": (_int, _SIZES + [_int] * 4 + [_ptr, _int] + [_ptr] * 10 + [_i64, _ptr]),
    # int msda_forward_packed(const int64 *args), int msda_backward_packed(const int64 *args):
    # the arguments above packed as int64s (ops.py packs them with struct, a fresh bytes object
    # per call, so concurrent calls never share a buffer)
    "msda_forward_packed": (_int, [_str]),
    "msda_backward_packed": (_int, [_str]),
    # int64 msda_backward_workspace_size(int64 B, S, H, C, L, Q, P, int dtype, int device,
    #                                    int flags)
    "msda_backward_workspace_size": (_i64, _SIZES + [_int] * 3),
    # int msda_backward_route(int64 B, S, H, C, L, Q, P, int dtype, const int64 *level_points,
    #                         int flags, int grads, int aligned16, int device,
    #                         int multiprocessors, int sm90_code)
    "msda_backward_route": (_int, _SIZES + [_int, _ptr] + [_int] * 6),
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


def error_text(status):
    """The library's message for a failed call on this thread."""
    name = lib.msda_status_string(status).decode()
    text = lib.msda_last_error().decode()
    return f"{text} [{name}]" if text else name
