"""Every private torch API pymsda uses, in one place, each with what happens where a torch
release lacks it. No other module of the package reads a private torch attribute.

| private API | what pymsda gets from it | where it is missing |
|---|---|---|
| torch._C._cuda_getCurrentRawStream | a device's current cudaStream_t as an int (no Stream object) | torch.cuda.current_stream(i).cuda_stream |
| torch._C._are_functorch_transforms_active | whether functorch transforms run (vmap, grad) | the autograd Function's public apply |
| torch._C._FunctionBase.apply (the C++ apply under torch.autograd.Function.apply) | the autograd node without the Python wrapper, ~2 us a call | torch.autograd.Function.apply |
| torch._C._len_torch_dispatch_stack | whether a dispatch mode (fake tensors, make_fx) is active (recording) | treated as none active |
| torch._C._get_tracing_state | whether torch.jit.trace records (recording) | torch.jit.is_tracing() |
| torch.jit._builtins._register_builtin | scripted code records the op pymsda::ms_deform_attn | torch.jit.script of such code fails as before |
| the `__script_unsupported` attribute torch.jit.script reads | torch.jit.script says what works instead of failing in the compiler | TorchScript's own error |
| torch._C._storage_Use_Count, UntypedStorage._cdata | the CPU gradient pool sees that a buffer is idle | no pool: plain torch.empty |
| torch.cuda._sleep | the GPU bench holds the GPU while the host queues the timed calls | timed without it (host gaps may count) |

tests/test_torch_private.py fails, naming the attribute, where the running torch lacks one it
should have (a release that removed it: then update this module).
"""
import torch

__all__ = []


def lookup(path):
    """The object at a dotted path from torch ("torch._C._get_tracing_state"), or None."""
    obj = torch
    for part in path.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


# ---------------------------------------------------------------------------------------------
# CUDA streams

def _public_current_stream(device_index):
    return torch.cuda.current_stream(device_index).cuda_stream


# current_raw_stream(device_index) -> the int value of that device's current cudaStream_t
current_raw_stream = lookup("torch._C._cuda_getCurrentRawStream") or _public_current_stream


# ---------------------------------------------------------------------------------------------
# autograd

functorch_active = lookup("torch._C._are_functorch_transforms_active")


def direct_apply(function_class):
    """function_class.apply without torch.autograd.Function's Python wrapper (functorch
    transforms, setup_context's default arguments): the C++ apply of torch._C._FunctionBase,
    bound to the class. Safe only for a Function with no setup_context and only while
    functorch_active() is False. None where this torch is laid out otherwise (or has no
    functorch_active to ask)."""
    if functorch_active is None:
        return None
    try:
        direct = super(torch.autograd.Function, function_class).apply
    except AttributeError:
        return None
    wrapper = getattr(torch.autograd.Function.apply, "__func__", None)
    if (getattr(direct, "__func__", None) is wrapper
            or getattr(direct, "__self__", None) is not function_class):
        return None
    return direct


# ---------------------------------------------------------------------------------------------
# what records the call: the one test of tracing and exporting

is_compiling = (getattr(getattr(torch, "compiler", None), "is_compiling", None)
                or (lambda: False))  # (public: torch 2.3 and later)
is_exporting = (getattr(getattr(torch, "compiler", None), "is_exporting", None)
                or (lambda: False))  # (public: torch 2.5 and later)
# the depth of the stack of active dispatch modes (FakeTensorMode, make_fx, FlopCounterMode)
dispatch_mode_depth = lookup("torch._C._len_torch_dispatch_stack") or (lambda: 0)


def _public_tracing_state():
    return True if torch.jit.is_tracing() else None


# jit_tracing_state() -> None unless torch.jit.trace (or torch.onnx.export(dynamo=False)) records
jit_tracing_state = lookup("torch._C._get_tracing_state") or _public_tracing_state

JIT_TRACE, FAKE, ONNX, EXPORT = 1, 2, 4, 8


def recording():
    """What records the ops that run now, pymsda's one test of tracing and exporting: 0 in eager
    code, else a bitwise OR of
      JIT_TRACE  torch.jit.trace records (real tensors); torch.onnx.export(dynamo=False) runs it
      FAKE       torch.compile, torch.export or a dispatch mode (fake tensors, make_fx,
                 FlopCounterMode) traces: tensors made now may not be real, so nothing is kept
      ONNX       torch.onnx.export, either exporter (it runs one of the two above)
      EXPORT     torch.export (what torch.onnx.export(dynamo=True) runs)
    Eager code gets its 0 from three cheap questions; the costly ONNX one (about 2 us) is asked
    only while something records."""
    state = ((JIT_TRACE if jit_tracing_state() is not None else 0)
             | (FAKE if is_compiling() or dispatch_mode_depth() else 0))
    if state:
        if torch.onnx.is_in_onnx_export():
            state |= ONNX
        if is_exporting():
            state |= EXPORT
    return state


# ---------------------------------------------------------------------------------------------
# TorchScript

_register_builtin = lookup("torch.jit._builtins._register_builtin")


def register_script_builtin(function, op_name):
    """Makes torch.jit.script record calls of `function` as the operator op_name (which must be
    registered with torch.library). False where this torch cannot."""
    if _register_builtin is None:
        return False
    _register_builtin(function, op_name)
    return True


def script_unsupported(function, text):
    """Marks function (returned) so that torch.jit.script, of it or of code calling it, raises
    `text` instead of TorchScript's own error about the function's Python."""
    function.__script_unsupported = text
    return function


def not_scriptable(module):
    """__prepare_scriptable__ of the drop-in modules whose forward TorchScript cannot compile
    (that of the project they mirror cannot be scripted either): say what works instead of
    failing deep inside the compiler."""
    raise RuntimeError(
        f"pymsda: {type(module).__module__}.{type(module).__qualname__} cannot be compiled by "
        "torch.jit.script (its forward is Python that TorchScript does not take, as is the "
        "original's). Use torch.jit.trace (it records pymsda's op), torch.export or "
        "torch.onnx.export; or script code that calls pymsda.ms_deform_attn or holds "
        "pymsda.MSDeformAttn, which TorchScript compiles (see docs/export.md)")


def script_unsupported_because(function, why):
    """script_unsupported with pymsda's message: why, and what works instead."""
    return script_unsupported(function, (
        f"pymsda: {function.__module__}.{function.__qualname__} cannot be compiled by "
        f"torch.jit.script ({why}). Use torch.jit.trace (it records pymsda's op), torch.export "
        "or torch.onnx.export; or script code that calls pymsda.ms_deform_attn, which "
        "TorchScript records as the operator pymsda::ms_deform_attn (see docs/export.md)"))


# ---------------------------------------------------------------------------------------------
# storages (the CPU gradient pool, pymsda/_buffers.py)

_storage_use_count = lookup("torch._C._storage_Use_Count")


def storage_use_count(storage):
    """How many tensors use an UntypedStorage (views, saved tensors, a .grad), or None where
    this torch cannot say."""
    if _storage_use_count is None:
        return None
    return _storage_use_count(storage._cdata)


# ---------------------------------------------------------------------------------------------
# the GPU bench

# gpu_sleep(cycles): a kernel that spins for that many clock cycles on the current stream
gpu_sleep = lookup("torch.cuda._sleep")


# Each private API above by its attribute path, with the first torch release it is checked
# from (tests/test_torch_private.py) and whether only CUDA builds of torch have it.
CHECKED = {
    "torch._C._cuda_getCurrentRawStream": ((1, 13), "cuda"),
    "torch._C._are_functorch_transforms_active": ((1, 13), None),
    "torch._C._FunctionBase.apply": ((1, 13), None),
    "torch._C._len_torch_dispatch_stack": ((1, 13), None),
    "torch._C._get_tracing_state": ((1, 13), None),
    "torch.jit._builtins._register_builtin": ((1, 13), None),
    "torch._C._storage_Use_Count": ((2, 1), None),
    "torch.cuda._sleep": ((1, 13), None),
}
