"""Drop-in replacements for the MSDA entry points of other projects, on pymsda's kernels.

Switching is a one-line change of an import (see README.md, "Switching from ..."): each module
keeps the names, argument names and order, output shapes and dtypes of the project it mirrors,
and modules keep their parameter names, so checkpoints load unchanged.

    deformable_detr  Deformable DETR: MSDeformAttnFunction, ms_deform_attn_core_pytorch,
                     MSDeformAttn; install() for `import MultiScaleDeformableAttention as MSDA`
    mmcv             MultiScaleDeformableAttnFunction, multi_scale_deformable_attn_pytorch,
                     and mmcv's MultiScaleDeformableAttention module (registered in mmengine's
                     MODELS where mmcv has no compiled ops, e.g. mmcv-lite)
    transformers     the MultiScaleDeformableAttention kernel layer of HF transformers,
                     replace_kernel_layers(model) to put it into a built transformers model,
                     and install() / uninstall() (the kernel layer of models built afterwards,
                     RT-DETRv2's, D-FINE's, Mask2Former's and OneFormer's functions)
    ultralytics      install() / uninstall(): Ultralytics RT-DETR's MSDeformAttn
    rfdetr           install() / uninstall(): RF-DETR's MSDeformAttn (and LW-DETR's, given its
                     module), value in their (batch, heads, head_dim, S) layout
    rtdetr           RT-DETR's deformable_attention_core_func, RT-DETRv2's
                     deformable_attention_core_func_v2 and its MSDeformableAttention module
    paddle           ms_deformable_attn, the Paddle RT-DETR ext_op's call shape, on torch
                     tensors (and deformable_attention_core_func, its fallback's name)

Functions named *_pytorch run the pure-PyTorch reference (grid_sample), as their originals do;
everything else runs pymsda's C/CUDA kernels.
"""
import sys

from . import deformable_detr, extension, mmcv, paddle, rfdetr, rtdetr, transformers, ultralytics

__all__ = ["deformable_detr", "mmcv", "transformers", "rtdetr", "paddle", "ultralytics", "rfdetr",
           "install"]

EXTENSION_NAME = "MultiScaleDeformableAttention"


def install():
    """Makes `import MultiScaleDeformableAttention as MSDA` give pymsda's implementation of
    Deformable DETR's compiled extension (MSDA.ms_deform_attn_forward and
    MSDA.ms_deform_attn_backward), so unmodified code that imports it runs on pymsda.

    Call it before the code that imports the extension is imported; it replaces any module of
    that name already in sys.modules. Returns the installed module."""
    sys.modules[EXTENSION_NAME] = extension
    return extension
