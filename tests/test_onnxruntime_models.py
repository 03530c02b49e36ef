"""Real models through pymsda's ONNX Runtime op: HF transformers' RT-DETR and Deformable DETR,
built from their configs with random weights (nothing downloaded; small backbones, two decoder
layers), pymsda's kernel layer put in by replace_kernel_layers, exported with
torch.onnx.export(dynamo=True) inside onnx_options(onnxruntime=True) with a dynamic batch axis:
every MSDA call is one pymsda::MSDeformAttn node, and ONNX Runtime's logits and boxes equal the
eager model's within 1e-4 on other pixels, at another batch size where the export kept the axis
dynamic (Deformable DETR; torch.export fixes RT-DETR's).

Every weight matrix and kernel is drawn from N(0, 0.3^2): with the configs' small initial
weights and eval-mode batch norms, a small random backbone's features fade to a constant, every
encoder proposal of RT-DETR then gets the same score, and top-k picks among equals in whatever
order a runtime likes. (The TorchScript exporter's graph of
these models differs from eager beyond MSDA, e.g. Deformable DETR's reference points; dynamo's
matches, which is what this test needs.)"""
import io
import warnings

import numpy as np
import pytest
import torch

import pymsda
from conftest import requires_torch_feature

onnx = pytest.importorskip("onnx", reason="needs onnx")
ort = pytest.importorskip("onnxruntime", reason="needs onnxruntime")
pytest.importorskip("onnxscript", reason="torch.onnx.export(dynamo=True) needs onnxscript")
transformers = pytest.importorskip("transformers", reason="needs HF transformers")

pytestmark = requires_torch_feature(
    pymsda.ops.HAS_TORCH_LIBRARY_OPS and hasattr(getattr(torch.onnx, "ops", None), "symbolic"),
    "torch.onnx.ops.symbolic (the node under torch.onnx.export(dynamo=True))")

BACKBONE = dict(embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1],
                layer_type="basic", out_features=["stage2", "stage3", "stage4"])
IMAGE = (128, 160)


def rtdetr():
    config = transformers.RTDetrConfig(
        backbone_config=transformers.RTDetrResNetConfig(**BACKBONE), d_model=32,
        encoder_hidden_dim=32, encoder_in_channels=[32, 64, 64], encoder_ffn_dim=64,
        decoder_ffn_dim=64, decoder_in_channels=[32, 32, 32], num_queries=10, decoder_layers=2,
        num_labels=5, use_pretrained_backbone=False, anchor_image_size=None)
    return transformers.RTDetrForObjectDetection(config)


def deformable_detr():
    config = transformers.DeformableDetrConfig(
        backbone_config=transformers.ResNetConfig(**BACKBONE), d_model=32, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_queries=10, encoder_layers=1, decoder_layers=2, num_labels=5,
        use_pretrained_backbone=False, use_timm_backbone=False)
    return transformers.DeformableDetrForObjectDetection(config)


class Detections(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        out = self.model(pixel_values=pixel_values)
        return out.logits, out.pred_boxes


def random_model(build):
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.3)
    from pymsda.compat import transformers as compat
    assert compat.replace_kernel_layers(model) >= 2
    return Detections(model)


def export_with_node(model, batch=2):
    pixels = torch.randn(batch, 3, *IMAGE)
    f = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad(), pymsda.export.onnx_options(onnxruntime=True):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (pixels,), f, dynamo=True, input_names=["pixel_values"],
                          output_names=["logits", "boxes"],
                          dynamic_shapes=({0: torch.export.Dim("batch", max=64)},))
    return onnx.load_from_string(f.getvalue())


@pytest.mark.parametrize("build", [rtdetr, deformable_detr])
def test_exported_model_with_the_node_gives_eager_logits_and_boxes(build):
    model = random_model(build)
    exported = export_with_node(model)
    onnx.checker.check_model(exported)
    layers = sum(type(m).__name__ == "MultiScaleDeformableAttention" for m in model.modules())
    assert sum(n.op_type == "MSDeformAttn" and n.domain == "pymsda"
               for n in exported.graph.node) == layers
    options = ort.SessionOptions()
    options.register_custom_ops_library(pymsda.library_path())
    session = ort.InferenceSession(exported.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    # another batch than exported where the graph kept the axis dynamic (transformers' RT-DETR
    # gets its batch specialised by torch.export; other pixels then)
    batch_axis = exported.graph.input[0].type.tensor_type.shape.dim[0]
    batch = 3 if batch_axis.dim_param else batch_axis.dim_value
    if build is deformable_detr:
        assert batch == 3
    pixels = torch.randn(batch, 3, *IMAGE, generator=torch.Generator().manual_seed(1))
    logits, boxes = session.run(None, {"pixel_values": pixels.numpy()})
    with torch.no_grad():
        eager_logits, eager_boxes = model(pixels)
    assert logits.shape == eager_logits.shape and boxes.shape == eager_boxes.shape
    assert np.abs(logits - eager_logits.numpy()).max() < 1e-4
    assert np.abs(boxes - eager_boxes.numpy()).max() < 1e-4
