"""HF transformers' MSDA kernel layer (the `MultiScaleDeformableAttention` module that Deformable
DETR, RT-DETR, Grounding DINO, OmDet-Turbo and others call, and the hub kernel replaces), on
pymsda.

    MultiScaleDeformableAttention()(value, value_spatial_shapes, value_spatial_shapes_list,
                                    level_start_index, sampling_locations, attention_weights,
                                    im2col_step) -> (batch, num_queries, num_heads * hidden_dim)

value (batch, S, num_heads, hidden_dim); value_spatial_shapes (L, 2) tensor and
value_spatial_shapes_list the same (H, W) pairs as a Python list (pymsda reads the list, so a
GPU shape tensor is never synchronised on); level_start_index (L,); sampling_locations
(batch, num_queries, num_heads, L, P, 2); attention_weights (batch, num_queries, num_heads, L, P).
The module has no parameters, like the original. MultiScaleDeformableAttentionFunction is the
autograd function of older transformers releases, same call shape as Deformable DETR's.

transformers builds the layer inside its models (`self.attn = MultiScaleDeformableAttention()`),
so user code does not import it: replace_kernel_layers(model) swaps every such layer of a built
(or loaded) model for this one; the layer holds no weights, so nothing else changes.
restore_kernel_layers(model) puts transformers' layers back.

install() switches, in the transformers modules that hold them:
  - the kernel layer class (Deformable DETR, RT-DETR, Grounding DINO, MM Grounding DINO,
    OmDet-Turbo, LW-DETR, RF-DETR, PP-DocLayout v2-v4), so models built afterwards build
    pymsda's layer (replace_kernel_layers(model) for one built before);
  - RT-DETRv2's, D-FINE's and DEIMv2's module-level multi_scale_deformable_attention_v2 (value
    (batch, S, heads, dim), per-level point counts, method "default" or "discrete", as
    pymsda.compat.rtdetr.deformable_attention_core_func_v2), looked up when RT-DETRv2 runs (D-FINE
    and DEIMv2 bind it when a layer is built);
  - Mask2Former's and OneFormer's module-level multi_scale_deformable_attention(value,
    value_spatial_shapes, sampling_locations, attention_weights), looked up when they run.
It returns the names switched; uninstall() restores them and turns the layers built while
installed back into transformers' own: the kernel layers become transformers' class again, and
D-FINE's and DEIMv2's attention layers (and copies of them) get transformers' function back
(models built before install() and changed by replace_kernel_layers keep pymsda's until
restore_kernel_layers). While a tracer or exporter runs
(torch.jit.trace, the ONNX exporters, torch.export), every switched name and layer runs
transformers' own code.
"""
import gc
import inspect
import warnings
import weakref
from typing import Any

from torch import nn

from .._torch_private import not_scriptable as _not_scriptable
from ..ops import MSDeformAttnFunction, ms_deform_attn
from . import _switch
from .rtdetr import deformable_attention_core_func_v2

__all__ = ["MultiScaleDeformableAttention", "MultiScaleDeformableAttentionFunction",
           "replace_kernel_layers", "restore_kernel_layers", "install", "uninstall"]

MultiScaleDeformableAttentionFunction = MSDeformAttnFunction

_FORWARD_ARGUMENTS = ["value", "value_spatial_shapes", "value_spatial_shapes_list",
                      "level_start_index", "sampling_locations", "attention_weights",
                      "im2col_step"]


class MultiScaleDeformableAttention(nn.Module):
    __prepare_scriptable__ = _not_scriptable  # say what works instead
    # transformers' own forward (of the class this one replaced), run while exporting
    _client_forward = None
    # install()'s layer classes: transformers' class they replace, and the layers built while
    # installed, which uninstall() turns back into that class
    _client_class = None
    _built = None

    def __init__(self):
        super().__init__()
        if self._built is not None:
            self._built.add(self)

    def __setstate__(self, state):  # a copy (copy.deepcopy) of such a layer is one too
        super().__setstate__(state)
        if self._built is not None:
            self._built.add(self)

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
                sampling_locations, attention_weights, im2col_step=None):
        if self._client_forward is not None and _switch.exporting():
            return self._client_forward(value, value_spatial_shapes, value_spatial_shapes_list,
                                        level_start_index, sampling_locations,
                                        attention_weights, im2col_step)
        shapes = value_spatial_shapes_list
        if shapes is None:
            shapes = value_spatial_shapes
        return ms_deform_attn(value, shapes, level_start_index, sampling_locations,
                              attention_weights, im2col_step)


def _is_kernel_layer(module):
    """A transformers kernel layer: named MultiScaleDeformableAttention, no parameters or
    buffers, and a forward with the kernel layer's arguments (or, for a class defined in
    transformers, a forward wrapped as (*args, **kwargs)). mmcv's module of the same name, which
    has weights and another forward, is never taken for one."""
    if (type(module).__name__ != "MultiScaleDeformableAttention"
            or isinstance(module, MultiScaleDeformableAttention)):
        return False
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return False
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    if list(parameters) == _FORWARD_ARGUMENTS:
        return True
    wrapped = all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters.values())
    return wrapped and type(module).__module__.split(".")[0] == "transformers"


def replace_kernel_layers(model):
    """Replaces every transformers MultiScaleDeformableAttention kernel layer inside model (an
    nn.Module, e.g. DeformableDetrForObjectDetection.from_pretrained(...)) with pymsda's, in
    place. Returns the number of layers replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _is_kernel_layer(child):
                layer = MultiScaleDeformableAttention()
                layer.train(child.training)
                layer._client_forward = child.forward  # bound to the replaced layer
                setattr(parent, name, layer)
                replaced += 1
    if not replaced:
        warnings.warn("replace_kernel_layers: the model has no transformers "
                      "MultiScaleDeformableAttention kernel layer; nothing was replaced (RT-DETRv2, "
                      "D-FINE, Mask2Former and OneFormer call a module-level function instead: "
                      "pymsda.compat.transformers.install() switches those)", stacklevel=2)
    return replaced


def restore_kernel_layers(model):
    """Undoes replace_kernel_layers(model): puts transformers' own layers back into model, in
    place (the very layers replaced; a layer built while install() was on becomes transformers'
    class again). Returns the number of layers restored."""
    restored = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MultiScaleDeformableAttention):
                original = _switch_back(child)
                if original is not None:
                    setattr(parent, name, original)
                    restored += 1
    return restored


# ---- install() ------------------------------------------------------------------------------

_KERNEL_LAYER_MODELS = ["deformable_detr", "rt_detr", "grounding_dino", "mm_grounding_dino",
                        "omdet_turbo", "lw_detr", "rf_detr", "pp_doclayout_v2",
                        "pp_doclayout_v3", "pp_doclayout_v4"]
_V2_FUNCTION_MODELS = ["rt_detr_v2", "d_fine", "deimv2"]
_FUNCTION_MODELS = ["mask2former", "oneformer"]


def _modeling(model):
    return "transformers.models.%s.modeling_%s" % (model, model)


_TARGETS = ([(_modeling(m), "MultiScaleDeformableAttention") for m in _KERNEL_LAYER_MODELS]
            + [(_modeling(m), "multi_scale_deformable_attention_v2") for m in _V2_FUNCTION_MODELS]
            + [(_modeling(m), "multi_scale_deformable_attention") for m in _FUNCTION_MODELS])


def multi_scale_deformable_attention(value, value_spatial_shapes: Any, sampling_locations,
                                     attention_weights):
    """Mask2Former's and OneFormer's function: value (batch, S, heads, dim), value_spatial_shapes
    [(H, W), ...] (or an (L, 2) tensor), sampling_locations (batch, Q, heads, L, P, 2),
    attention_weights (batch, Q, heads, L, P) -> (batch, Q, heads * dim). Annotated for
    torch.jit.script, which records the op pymsda::ms_deform_attn."""
    return ms_deform_attn(value, value_spatial_shapes, None, sampling_locations,
                          attention_weights)


def _kernel_layer_class(original):
    """pymsda's layer for one transformers module, running that module's own forward while
    exporting; None where the original's forward is not the kernel layer's."""
    try:
        parameters = list(inspect.signature(original.forward).parameters)
    except (TypeError, ValueError):
        return None
    if parameters[1:] != _FORWARD_ARGUMENTS:
        return None
    client = original()  # no weights; its forward is transformers' pure-PyTorch MSDA
    return type("MultiScaleDeformableAttention", (MultiScaleDeformableAttention,),
                {"_client_forward": staticmethod(client.forward), "_client_class": original,
                 "_built": weakref.WeakSet(),
                 "__module__": __name__, "__qualname__": "MultiScaleDeformableAttention"})


def _switch_back(layer):
    """transformers' own layer for a pymsda layer: the one replace_kernel_layers replaced, or a
    layer built while installed turned back into transformers' class (the layers hold no state
    but nn.Module's). None for a layer of neither kind."""
    client_class = type(layer)._client_class
    if client_class is not None:
        layer.__class__ = client_class
        return layer
    original = getattr(layer.__dict__.get("_client_forward"), "__self__", None)
    if original is not None:
        original.train(layer.training)
    return original


def _switch_back_built(original, replacement):
    for layer in list(getattr(replacement, "_built", None) or ()):
        _switch_back(layer)


def _give_back_copied_functions(functions):
    """Gives each layer that holds a switched function's replacement the original back:
    D-FINE's and DEIMv2's attention layers copy multi_scale_deformable_attention_v2 into
    themselves when built (self.ms_deformable_attn_core), and copies of such a layer hold it
    too. No pymsda code runs when they are built or copied, so they cannot be tracked as the
    kernel layers are: they are found among every nn.Module alive, once per uninstall() (as
    pymsda.compat.uninstall() finds the names bound to the extension's module). functions:
    [(original, replacement)]."""
    if not functions:
        return
    for layer in gc.get_objects():
        if issubclass(type(layer), nn.Module):  # (type(): no __class__ property is run)
            for name, value in list(vars(layer).items()):
                for original, replacement in functions:
                    if value is replacement:
                        setattr(layer, name, original)


def _replacement(original, module):
    name = original.__name__
    if isinstance(original, type):
        return _kernel_layer_class(original)
    if name == "multi_scale_deformable_attention_v2":
        return _switch.routed(original, deformable_attention_core_func_v2)
    return _switch.routed(original, multi_scale_deformable_attention)


def install():
    """Switches the MSDA of the transformers models listed above to pymsda, where this
    transformers has them; returns the names switched (a warning when there is none)."""
    return _switch.switch(_TARGETS, _replacement, "transformers")


def uninstall():
    """Restores transformers' own MSDA, the layers built while installed included (kernel
    layers become transformers' class again, D-FINE's and DEIMv2's get transformers' function
    back); returns the names restored."""
    functions = []

    def undo(original, replacement):
        if isinstance(original, type):
            _switch_back_built(original, replacement)
        else:
            functions.append((original, replacement))
    restored = _switch.restore(_TARGETS, undo)
    _give_back_copied_functions(functions)
    return restored
