"""Ultralytics RT-DETR (the ultralytics package): its MSDeformAttn on pymsda.

    import pymsda.compat.ultralytics
    pymsda.compat.ultralytics.install()     # once, before or after the model is built

ultralytics.nn.modules.transformer.MSDeformAttn calls multi_scale_deformable_attn_pytorch, which
that module imports by name from ultralytics.nn.modules.utils; install() switches the name in
both modules (the call is looked up when it runs, so models built before install() switch too)
and returns the names switched; uninstall() restores them.

    multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                        attention_weights) -> (bs, num_queries, num_heads * embed_dims)
        value (bs, num_keys, num_heads, embed_dims); value_spatial_shapes [(H, W), ...];
        sampling_locations (bs, num_queries, num_heads, num_levels * num_points, 2) and
        attention_weights (bs, num_queries, num_heads, num_levels * num_points), the levels and
        points folded into one axis (level 0's points first) so every tensor has rank <= 5
        (Ultralytics' CoreML export). The output has value's dtype (pymsda's dtype rule).

While a tracer or exporter runs (torch.jit.trace, the ONNX exporters, torch.export: what
Ultralytics' exporter uses), the switched name calls Ultralytics' own function, so exported
models hold the same graph as without pymsda.
"""
from ..ops import ms_deform_attn
from . import _switch

__all__ = ["multi_scale_deformable_attn_pytorch", "install", "uninstall"]

_TARGETS = [("ultralytics.nn.modules.transformer", "multi_scale_deformable_attn_pytorch"),
            ("ultralytics.nn.modules.utils", "multi_scale_deformable_attn_pytorch")]


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                        attention_weights):
    # (.., L * P, ..) -> (.., L, P, ..): a view, level 0's points first as in the original
    # (reshape, not unflatten, which torch 1.13's ONNX exporter does not take)
    size = sampling_locations.shape
    levels = len(value_spatial_shapes)
    shape = [size[0], size[1], size[2], levels, size[3] // levels]
    return ms_deform_attn(value, value_spatial_shapes, None,
                          sampling_locations.reshape(shape + [2]), attention_weights.reshape(shape))


install, uninstall = _switch.routed_switch(_TARGETS, multi_scale_deformable_attn_pytorch,
                                           "ultralytics")
