"""RF-DETR (the rfdetr package) and LW-DETR: their MSDeformAttn on pymsda.

    import pymsda.compat.rfdetr
    pymsda.compat.rfdetr.install()          # once, before or after the model is built

rfdetr.models.ops.modules.ms_deform_attn.MSDeformAttn calls ms_deform_attn_core_pytorch, which
that module imports by name from rfdetr.models.ops.functions; install() switches the name in
the modules that hold it (looked up when the call runs, so models built before install() switch
too) and returns the names switched; uninstall() restores them.

LW-DETR (Atten4Vis/LW-DETR, a source checkout, not a package) trains through Deformable DETR's
compiled extension: `pymsda.compat.install()` before its models are imported switches that (the
extension's import line stays). Its export mode and half-precision path call the same
ms_deform_attn_core_pytorch as RF-DETR; to switch that too, pass the module that holds the
name: `pymsda.compat.rfdetr.install(models.ops.modules.ms_deform_attn)`.

    ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations,
                                attention_weights, value_spatial_shapes_hw=None)
        value (batch, n_heads, head_dim, S), the layout RF-DETR and LW-DETR pass;
        value_spatial_shapes (L, 2) tensor, value_spatial_shapes_hw the same (H, W) pairs as a
        list (read instead of the tensor when given); sampling_locations (batch, len_q, n_heads,
        L, P, 2); attention_weights (batch, len_q, n_heads, L * P)
        -> (batch, len_q, n_heads * head_dim) in value's dtype

pymsda's kernels read value as (batch, S, n_heads, head_dim): the (batch, n_heads, head_dim, S)
tensor is permuted (a view) and copied into that layout, and grad_value is copied back in the
backward. At RF-DETR's decoder sizes the copy kernel is a small part of a call, which is
host-bound, and the host's part is what the two extra autograd nodes cost (measured in
kernels/TUNING.md, "RF-DETR's value layout"), so kernels reading the (batch, heads, head_dim, S)
layout (a pixel's channels S elements apart: no vector loads) were not built.

RF-DETR's export mode (MSDeformAttn.export(): sampling locations folded to rank 5 for CoreML),
and any call while a tracer or exporter runs, go to RF-DETR's own function, so exported models
hold the same graph as without pymsda.
"""
from typing import List, Optional, Tuple

from ..ops import ms_deform_attn
from . import _switch

__all__ = ["ms_deform_attn_core_pytorch", "install", "uninstall"]

_NAME = "ms_deform_attn_core_pytorch"
_MODULES = ["rfdetr.models.ops.modules.ms_deform_attn", "rfdetr.models.ops.functions",
            "rfdetr.models.ops.functions.ms_deform_attn_func"]
_installed_extra = []  # modules passed to install(), for uninstall()


def ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations,
                                attention_weights,
                                value_spatial_shapes_hw: Optional[List[Tuple[int, int]]] = None):
    # annotated as RF-DETR's, for torch.jit.script (which records the op pymsda::ms_deform_attn)
    value = value.permute(0, 3, 1, 2)
    # (batch, len_q, n_heads, L * P) -> (.., L, P); reshape, not unflatten, which torch 1.13's
    # ONNX exporter does not take
    attention_weights = attention_weights.reshape(sampling_locations.shape[:5])
    if value_spatial_shapes_hw is None:
        return ms_deform_attn(value, value_spatial_shapes, None, sampling_locations,
                              attention_weights)
    return ms_deform_attn(value, value_spatial_shapes_hw, None, sampling_locations,
                          attention_weights)


def _make(original, module):
    def replacement(value, value_spatial_shapes, sampling_locations, attention_weights,
                    value_spatial_shapes_hw=None):
        if sampling_locations.dim() == 5:  # RF-DETR's export mode: its own code
            return original(value, value_spatial_shapes, sampling_locations, attention_weights,
                            value_spatial_shapes_hw)
        return ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations,
                                           attention_weights, value_spatial_shapes_hw)
    return _switch.routed(original, replacement)


def _make_lwdetr(original, module):
    # LW-DETR's function has no value_spatial_shapes_hw
    def replacement(value, value_spatial_shapes, sampling_locations, attention_weights):
        return ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations,
                                           attention_weights)
    return _switch.routed(original, replacement)


def install(*modules):
    """Switches RF-DETR's MSDA to pymsda, or, given modules (e.g. LW-DETR's
    models.ops.modules.ms_deform_attn), the ms_deform_attn_core_pytorch of those; returns the
    names switched (a warning when there is none)."""
    targets = [(name, _NAME) for name in _MODULES if not modules]
    for module in modules:
        if module not in _installed_extra:
            _installed_extra.append(module)
        targets.append((module, _NAME))
    if not modules:
        return _switch.switch(targets, _make, "rfdetr")
    return _switch.switch(targets, _make_lwdetr, "the modules given")


def uninstall():
    """Restores RF-DETR's own MSDA (and that of the modules given to install()); returns the
    names restored."""
    restored = _switch.restore([(name, _NAME) for name in _MODULES])
    restored += _switch.restore([(module, _NAME) for module in _installed_extra])
    _installed_extra.clear()
    return restored
