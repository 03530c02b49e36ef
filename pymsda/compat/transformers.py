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
"""
import inspect

from torch import nn

from ..export import _not_scriptable
from ..ops import MSDeformAttnFunction, ms_deform_attn

__all__ = ["MultiScaleDeformableAttention", "MultiScaleDeformableAttentionFunction",
           "replace_kernel_layers"]

MultiScaleDeformableAttentionFunction = MSDeformAttnFunction

_FORWARD_ARGUMENTS = ["value", "value_spatial_shapes", "value_spatial_shapes_list",
                      "level_start_index", "sampling_locations", "attention_weights",
                      "im2col_step"]


class MultiScaleDeformableAttention(nn.Module):
    __prepare_scriptable__ = _not_scriptable  # say what works instead

    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
                sampling_locations, attention_weights, im2col_step=None):
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
                setattr(parent, name, layer)
                replaced += 1
    return replaced
