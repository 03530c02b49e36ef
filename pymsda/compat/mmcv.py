"""mmcv's MSDA functions (mmcv.ops.multi_scale_deform_attn), on pymsda.

    MultiScaleDeformableAttnFunction.apply(value, value_spatial_shapes, value_level_start_index,
                                           sampling_locations, attention_weights, im2col_step)
        -> (bs, num_queries, num_heads * embed_dims_per_head). mmcv casts
        sampling_locations and attention_weights to value's dtype; this follows
        ms_deform_attn's dtype rule instead (float32 points with a half value are read as
        float32), so under AMP it is more precise than mmcv, never less; output and gradient
        dtypes are mmcv's
    multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                        attention_weights)      (the pure-PyTorch path)
    MultiScaleDeformableAttention(embed_dims=256, num_heads=8, num_levels=4, num_points=4,
                                  im2col_step=64, dropout=0.1, batch_first=False,
                                  norm_cfg=None, init_cfg=None, value_proj_ratio=1.0)
        mmcv's module (mmcv.ops.MultiScaleDeformableAttention, mmcv 2.x): the same constructor
        arguments, parameters (state_dict keys), initialisation and forward, on pymsda on every
        device (mmcv runs its compiled op on CUDA only, the pure-PyTorch one elsewhere). mmcv-lite
        (and an mmcv whose compiled ops do not build) has no such module: where mmengine is
        installed and mmcv's compiled ops are not, this one is registered in mmengine's MODELS
        registry under mmcv's name, so configs naming type="MultiScaleDeformableAttention" (e.g.
        mmcv's BaseTransformerLayer attn_cfgs) build it once pymsda.compat.mmcv is imported;
        uninstall() removes that entry and install() puts it back. Like mmcv's module (an
        mmengine BaseModule), it is initialised when built (is_init is true), so a parent
        BaseModule's init_weights() leaves its weights alone.
"""
import copy
import importlib.util
import os
import sys
import warnings
from typing import Any

import torch
from torch import nn

from .._torch_private import not_scriptable as _not_scriptable
from ..modules import initial_sampling_offsets
from ..ops import ms_deform_attn
from ..reference import ms_deform_attn_pytorch
from . import _switch

__all__ = ["MultiScaleDeformableAttnFunction", "multi_scale_deformable_attn_pytorch",
           "MultiScaleDeformableAttention", "install", "uninstall"]


class MultiScaleDeformableAttnFunction:
    """mmcv's autograd function: only `apply` is called by user code."""

    @staticmethod  # annotated for torch.jit.script (the op pymsda::ms_deform_attn)
    def apply(value, value_spatial_shapes: Any, value_level_start_index: Any, sampling_locations,
              attention_weights, im2col_step: int = 64):
        return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                              sampling_locations, attention_weights, im2col_step)


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                        attention_weights):
    """The pure-PyTorch MSDA (grid_sample): value (bs, num_keys, num_heads, embed_dims //
    num_heads), value_spatial_shapes (num_levels, 2) rows (h, w), sampling_locations (bs,
    num_queries, num_heads, num_levels, num_points, 2), attention_weights (bs, num_queries,
    num_heads, num_levels, num_points) -> (bs, num_queries, embed_dims)."""
    return ms_deform_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                  attention_weights)


class MultiScaleDeformableAttention(nn.Module):
    """mmcv's MultiScaleDeformableAttention (see the module docstring). forward(query, key=None,
    value=None, identity=None, query_pos=None, key_padding_mask=None, reference_points=None,
    spatial_shapes=None, level_start_index=None, **kwargs): query (num_query, bs, embed_dims)
    ((bs, num_query, embed_dims) with batch_first), value (num_value, bs, embed_dims) (query when
    None), key_padding_mask (bs, num_value) True at padding, reference_points (bs, num_query,
    num_levels, 2 or 4) in [0, 1], spatial_shapes (num_levels, 2) rows (h, w), level_start_index
    (num_levels,) -> dropout(output_proj(MSDA)) + identity, query's shape. The deprecated keyword
    residual is taken for identity, as in mmcv. While a tracer or exporter runs the MSDA is the
    pure-PyTorch one, which is what mmcv's module records off CUDA."""

    __prepare_scriptable__ = _not_scriptable  # (**kwargs, like mmcv's) say what works instead

    def __init__(self, embed_dims=256, num_heads=8, num_levels=4, num_points=4, im2col_step=64,
                 dropout=0.1, batch_first=False, norm_cfg=None, init_cfg=None,
                 value_proj_ratio=1.0):
        super().__init__()
        if embed_dims % num_heads != 0:
            raise ValueError(f"embed_dims must be divisible by num_heads, but got {embed_dims} "
                             f"and {num_heads}")
        self._is_init = False
        self.init_cfg = copy.deepcopy(init_cfg)  # as mmengine's BaseModule keeps it
        self.norm_cfg = norm_cfg
        self.dropout = nn.Dropout(dropout)
        self.batch_first = batch_first
        self.im2col_step = im2col_step
        self.embed_dims, self.num_levels = embed_dims, num_levels
        self.num_heads, self.num_points = num_heads, num_points
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * num_levels * num_points)
        value_proj_size = int(embed_dims * value_proj_ratio)
        self.value_proj = nn.Linear(embed_dims, value_proj_size)
        self.output_proj = nn.Linear(value_proj_size, embed_dims)
        self.init_weights()

    def init_weights(self):
        """mmcv's initialisation: Deformable DETR's sampling offsets
        (pymsda.modules.initial_sampling_offsets); zero attention weights; xavier-uniform
        projections with zero bias."""
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        # computed on the weights' device, as mmcv 2.x does (cos and sin may round otherwise)
        offsets = initial_sampling_offsets(self.num_heads, [self.num_points] * self.num_levels,
                                           device=self.sampling_offsets.weight.device)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(offsets.flatten())
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)
        for layer in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(layer.weight, gain=1)
            nn.init.constant_(layer.bias, 0.0)
        self._is_init = True

    # mmengine's BaseModule.init_weights() calls a child's init_weights() unless the child's
    # is_init is true: mmcv's module (a BaseModule) has it true from its constructor on, so a
    # parent leaves its weights alone. So does this property for pymsda's.
    @property
    def is_init(self):
        """mmengine's initialisation flag: True once init_weights() has run (the constructor
        runs it), so a parent BaseModule.init_weights() leaves these weights as they are."""
        return self._is_init

    @is_init.setter
    def is_init(self, value):
        self._is_init = value

    def __repr__(self):  # as mmengine's BaseModule shows it
        text = super().__repr__()
        return text + "\ninit_cfg=%s" % (self.init_cfg,) if self.init_cfg else text

    def forward(self, query, key=None, value=None, identity=None, query_pos=None,
                key_padding_mask=None, reference_points=None, spatial_shapes=None,
                level_start_index=None, **kwargs):
        if "residual" in kwargs:  # mmcv's deprecated name of identity
            if identity is not None:
                raise ValueError("pass identity or its deprecated name residual, not both")
            warnings.warn('"residual" is deprecated in `MultiScaleDeformableAttention.forward`, '
                          'please use "identity" instead', DeprecationWarning, stacklevel=2)
            identity = kwargs.pop("residual")
        if value is None:
            value = query
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query, value = query.permute(1, 0, 2), value.permute(1, 0, 2)
        bs, num_query, _ = query.shape
        num_value = value.shape[1]
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.view(bs, num_value, self.num_heads, -1)
        offsets = self.sampling_offsets(query).view(
            bs, num_query, self.num_heads, self.num_levels, self.num_points, 2)
        attention_weights = self.attention_weights(query).view(
            bs, num_query, self.num_heads, self.num_levels * self.num_points).softmax(-1)
        attention_weights = attention_weights.view(
            bs, num_query, self.num_heads, self.num_levels, self.num_points)
        if reference_points.shape[-1] == 2:
            normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
            sampling_locations = (reference_points[:, :, None, :, None, :]
                                  + offsets / normalizer[None, None, None, :, None, :])
        elif reference_points.shape[-1] == 4:
            sampling_locations = (reference_points[:, :, None, :, None, :2]
                                  + offsets / self.num_points
                                  * reference_points[:, :, None, :, None, 2:] * 0.5)
        else:
            raise ValueError(f"Last dim of reference_points must be 2 or 4, but get "
                             f"{reference_points.shape[-1]} instead.")
        if _switch.exporting():
            output = ms_deform_attn_pytorch(value, spatial_shapes, sampling_locations,
                                            attention_weights)
        else:
            output = ms_deform_attn(value, spatial_shapes, level_start_index,
                                    sampling_locations, attention_weights)
        output = self.output_proj(output)
        if not self.batch_first:
            output = output.permute(1, 0, 2)
        return self.dropout(output) + identity


def _mmcv_has_compiled_ops():
    """Whether the installed mmcv ships its compiled ops (mmcv/_ext*.so), found without importing
    mmcv (whose import is slow): then mmcv's own module is the one to register."""
    spec = importlib.util.find_spec("mmcv")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(name.startswith("_ext") for folder in spec.submodule_search_locations
               if os.path.isdir(folder) for name in os.listdir(folder))


_NAME = "MultiScaleDeformableAttention"
_ENTRY = "mmengine.registry.MODELS." + _NAME


def _register():
    """Registers MultiScaleDeformableAttention in mmengine's MODELS where mmengine imports,
    mmcv's compiled ops are not installed and the name is free in the registry (Registry.get
    is not asked: for a name it does not hold it imports a top-level module of that name, such
    as Deformable DETR's compiled extension, and returns the module). Returns ([_ENTRY] or [],
    why not)."""
    if importlib.util.find_spec("mmengine") is None:
        return [], "mmengine is not installed"
    if _mmcv_has_compiled_ops():
        return [], ("mmcv's compiled ops are installed, so mmcv's own module holds the name (on "
                    "CUDA it runs pymsda after `mmcv.ops.multi_scale_deform_attn."
                    "MultiScaleDeformableAttnFunction = pymsda.compat.mmcv."
                    "MultiScaleDeformableAttnFunction`)")
    try:
        from mmengine.registry import MODELS
    except Exception as error:  # mmengine's own failure: reported, never raised
        return [], "importing " + _switch.failure_text("mmengine.registry", error)
    holder = MODELS.module_dict.get(_NAME)
    if holder is MultiScaleDeformableAttention:
        return [_ENTRY], None
    if holder is not None:
        return [], ("the name is registered to %s.%s; to build pymsda's instead: "
                    "MODELS.register_module(name=%r, module=pymsda.compat.mmcv."
                    "MultiScaleDeformableAttention, force=True)"
                    % (holder.__module__, getattr(holder, "__qualname__", holder), _NAME))
    MODELS.register_module(name=_NAME, module=MultiScaleDeformableAttention)
    return [_ENTRY], None


def _models_registry_holding_ours():
    """mmengine's MODELS where it is imported and holds pymsda's module under mmcv's name."""
    registry = getattr(sys.modules.get("mmengine.registry"), "MODELS", None)
    module_dict = getattr(registry, "module_dict", {})
    return registry if module_dict.get(_NAME) is MultiScaleDeformableAttention else None


def install():
    """Registers pymsda's MultiScaleDeformableAttention in mmengine's MODELS under mmcv's name
    (importing this module does it already), so configs naming type="MultiScaleDeformableAttention"
    build it; where mmengine is missing or fails to import, mmcv's compiled ops are installed,
    or another class holds the name, it warns saying which and registers nothing. Returns
    ["mmengine.registry.MODELS.MultiScaleDeformableAttention"], or []."""
    registered, why_not = _register()
    if why_not:
        warnings.warn("pymsda.compat.mmcv.install(): registered nothing: " + why_not,
                      stacklevel=2)
    return registered


def uninstall():
    """Removes pymsda's entry from mmengine's MODELS (where it is pymsda's), so the name is
    free as before pymsda. Modules already built stay pymsda's. Returns the names removed."""
    registry = _models_registry_holding_ours()
    if registry is None:
        return []
    del registry.module_dict[_NAME]  # mmengine's Registry has no unregister
    return [_ENTRY]


def __getattr__(name):
    if name == "REGISTERED":  # whether pymsda's module is in mmengine's MODELS now
        return _models_registry_holding_ours() is not None
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


# Configs naming mmcv's module build pymsda's once this module is imported (where mmengine is
# installed and mmcv's compiled ops are not): quietly, as the import cannot be told not to.
_register()
