"""Grounding DINO as rf-groundingdino packages it (PyPI; the groundingdino package): its
MultiScaleDeformableAttention on pymsda.

    import pymsda.compat.groundingdino
    pymsda.compat.groundingdino.install()   # once, before or after the model is built

groundingdino.models.GroundingDINO.ms_deform_attn.MultiScaleDeformableAttention (the encoder's
and decoder's deformable attention) calls multi_scale_deformable_attn_pytorch, defined in that
module (grid_sample; rf-groundingdino ships no compiled op), by its module-level name when the
call runs: install() switches that name, so models built before install() switch too, and
returns the names switched; uninstall() restores them.

    multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                        attention_weights) -> (bs, num_queries, num_heads * dims)
        value (bs, num_keys, num_heads, dims); value_spatial_shapes an (L, 2) tensor of (H, W)
        rows (or a list); sampling_locations (bs, num_queries, num_heads, L, P, 2);
        attention_weights (bs, num_queries, num_heads, L, P). The output has value's dtype.

While a tracer or exporter runs (torch.jit.trace, the ONNX exporters, torch.export), the
switched name calls rf-groundingdino's own function, so exported models hold the same graph as
without pymsda.
"""
from typing import Any

from ..ops import ms_deform_attn
from . import _switch

__all__ = ["multi_scale_deformable_attn_pytorch", "install", "uninstall"]

_TARGETS = [("groundingdino.models.GroundingDINO.ms_deform_attn",
             "multi_scale_deformable_attn_pytorch")]


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes: Any, sampling_locations,
                                        attention_weights):
    # annotated for torch.jit.script, which records the op pymsda::ms_deform_attn
    return ms_deform_attn(value, value_spatial_shapes, None, sampling_locations,
                          attention_weights)


install, uninstall = _switch.routed_switch(_TARGETS, multi_scale_deformable_attn_pytorch,
                                           "rf-groundingdino")
