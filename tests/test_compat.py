"""tests/test_compat.py: the package pymsda.compat: each drop-in is imported when it is named
(importing the package imports none and registers nothing), every drop-in's entry points keep
value's dtype and are exported under the originals' names. (Each drop-in:
tests/test_compat_<name>.py; the switches: tests/test_compat_switches.py.) CPU always; CUDA where
a GPU is present.
"""
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import pymsda
import pymsda.compat
from pymsda.compat import deformable_detr, mmcv, paddle, rtdetr, transformers
from compat_cases import SHAPES, parameter_names, plain_inputs
from conftest import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compat_outputs_keep_value_dtype(generator, device, dtype):
    inputs = plain_inputs(generator, device, dtype=dtype)
    args = (inputs["value"], inputs["spatial_shapes"], inputs["level_start_index"],
            inputs["sampling_locations"], inputs["attention_weights"])
    expected = pymsda.ms_deform_attn(*args)
    for out in (deformable_detr.MSDeformAttnFunction.apply(*args, 64),
                mmcv.MultiScaleDeformableAttnFunction.apply(*args, 64),
                transformers.MultiScaleDeformableAttention()(args[0], args[1], SHAPES, *args[2:],
                                                             64),
                paddle.ms_deformable_attn(*args),
                paddle.deformable_attention_core_func(*args),
                rtdetr.deformable_attention_core_func(args[0], SHAPES, *args[3:])):
        assert out.dtype == dtype and torch.equal(out, expected)


def test_compat_entry_points_are_exported():
    """Each module's __all__ names what it defines, and the originals' names are all there."""
    expected = {
        deformable_detr: {"MSDeformAttnFunction", "ms_deform_attn_core_pytorch", "MSDeformAttn"},
        mmcv: {"MultiScaleDeformableAttnFunction", "multi_scale_deformable_attn_pytorch",
               "MultiScaleDeformableAttention", "install", "uninstall"},
        transformers: {"MultiScaleDeformableAttention", "MultiScaleDeformableAttentionFunction",
                       "replace_kernel_layers", "restore_kernel_layers", "install", "uninstall"},
        rtdetr: {"deformable_attention_core_func", "deformable_attention_core_func_v2",
                 "MSDeformableAttention"},
        paddle: {"ms_deformable_attn", "deformable_attention_core_func"},
    }
    for module, names in expected.items():
        assert set(module.__all__) == names, module.__name__
        assert all(callable(getattr(module, name)) for name in names), module.__name__
    extension = importlib.import_module("pymsda.compat.extension")
    assert set(extension.__all__) == {"ms_deform_attn_forward", "ms_deform_attn_backward"}
    assert parameter_names(extension.ms_deform_attn_forward) == [
        "value", "value_spatial_shapes", "value_level_start_index", "sampling_locations",
        "attention_weights", "im2col_step"]
    assert parameter_names(extension.ms_deform_attn_backward) == [
        "value", "value_spatial_shapes", "value_level_start_index", "sampling_locations",
        "attention_weights", "grad_output", "im2col_step"]


# In a fresh interpreter: after each step, the drop-ins imported and whether another library's
# state was touched (mmengine, mmcv or transformers imported; pymsda's module in mmengine's
# MODELS).
_STEPS = """
import json, sys
def seen():
    modules = sorted(m for m in sys.modules if m.startswith("pymsda.compat."))
    others = sorted(m for m in ("mmengine", "mmcv", "transformers") if m in sys.modules)
    registry = getattr(sys.modules.get("mmengine.registry"), "MODELS", None)
    names = getattr(registry, "module_dict", {})
    return [modules, others, "MultiScaleDeformableAttention" in names]
steps = []
import pymsda.compat
steps.append(seen())
pymsda.compat.paddle.ms_deformable_attn
steps.append(seen())
from pymsda.compat import transformers
steps.append(seen())
import pymsda.compat.mmcv
steps.append(seen())
pymsda.compat.install()
pymsda.compat.uninstall()
steps.append(seen())
print(json.dumps(steps))
"""


def test_drop_ins_are_imported_when_named_and_the_package_touches_nothing():
    """`import pymsda.compat` imports no drop-in and no other library, so no registry changes;
    pymsda.compat.paddle, `from pymsda.compat import transformers` and `import
    pymsda.compat.mmcv` import that drop-in (and what it imports: transformers' imports rtdetr's
    function), and only importing mmcv's registers its module in mmengine's MODELS (where
    mmengine is installed and mmcv's compiled ops are not); pymsda.compat.install() imports
    the extension's drop-in."""
    environment = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pymsda.__file__)))
    done = subprocess.run([sys.executable, "-c", _STEPS], env=environment, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = json.loads(done.stdout.splitlines()[-1])
    switch = "pymsda.compat._switch"  # (install()'s helpers, no drop-in)
    assert steps[0] == [[switch], [], False]
    assert steps[1] == [sorted(["pymsda.compat.paddle", switch]), [], False]
    drop_ins = ["pymsda.compat.paddle", "pymsda.compat.rtdetr", "pymsda.compat.transformers"]
    assert steps[2] == [sorted(drop_ins + [switch]), [], False]
    registers = (importlib.util.find_spec("mmengine") is not None
                 and not pymsda.compat.mmcv._mmcv_has_compiled_ops())
    assert steps[3][0] == sorted(drop_ins + [switch, "pymsda.compat.mmcv"])
    assert steps[3][2] == registers and ("mmengine" in steps[3][1]) == registers
    assert "transformers" not in steps[3][1]  # (its install() imports it, not its import)
    assert steps[4][0] == sorted(steps[3][0] + ["pymsda.compat.extension"])


def test_the_package_names_its_drop_ins_and_no_other_attribute():
    for name in pymsda.compat.__all__ + ["extension"]:
        assert name in dir(pymsda.compat)
        assert getattr(pymsda.compat, name) is not None
    assert pymsda.compat.mmcv is importlib.import_module("pymsda.compat.mmcv")
    with pytest.raises(AttributeError, match="has no attribute 'no_such_drop_in'"):
        pymsda.compat.no_such_drop_in
