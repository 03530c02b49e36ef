"""tests/test_clients.py: the projects pymsda.compat switches, as installed from PyPI (versions
pinned in tests/requirements-clients.txt and tests/requirements-clients-torchvision.txt):
transformers (RT-DETRv2, Mask2Former, RT-DETR's kernel layer), Ultralytics RT-DETR, RF-DETR and
rf-groundingdino (mmcv-lite + mmengine: tests/test_clients_mmcv.py).

Each test builds the project's own model or module from a config (no download), runs forward,
backward and one AdamW step with the project's own MSDA and again after pymsda's install(),
and compares outputs, gradients (their None-ness included) and the updated weights in float64
and float32 (tests/clients.py). Calls into libpymsda are counted, so a silent non-switch (or a
switch that leaks into the project's own run) fails. A project that cannot be imported here is
skipped with the reason: ultralytics, rfdetr and rf-groundingdino need PyPI's torchvision, which
is built against PyPI's CUDA build of torch (CI runs them in tests/matrix.py's torch 2.14.1
environment).
"""
import copy

import pytest
import torch

from clients import library_calls  # noqa: F401  (a fixture)
from clients import DTYPES, assert_same_step, client, compare_switched, square_mean, train_step
from conftest import expects_torchscript_deprecation
from factories import rel_l2

# The tracing tests trace on purpose, and the projects' imports make torch script its own
# functions (torch 2.14: one FutureWarning more)
pytestmark = expects_torchscript_deprecation

# ---- transformers ---------------------------------------------------------------------------

def rtdetr_config(module, config_name, **options):
    transformers = client("transformers")
    backbone = transformers.RTDetrResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1],
        layer_type="basic", out_features=["stage2", "stage3", "stage4"])
    return getattr(transformers, config_name)(
        backbone_config=backbone, d_model=32, encoder_hidden_dim=32,
        encoder_in_channels=[32, 64, 64], encoder_ffn_dim=64, decoder_ffn_dim=64,
        num_queries=10, decoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4,
        decoder_n_points=2, num_labels=3, decoder_in_channels=[32, 32, 32], num_denoising=0,
        use_pretrained_backbone=False, **options)


def detection_loss(model):
    pixels = torch.randn(2, 3, 32, 64, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64).to(next(model.parameters()).dtype)
    out = model(pixel_values=pixels)
    return out.pred_boxes, square_mean(out.logits, out.pred_boxes)


@DTYPES
@pytest.mark.parametrize("method", ["default", "discrete"])
def test_transformers_rtdetr_v2_trains_the_same_after_install(library_calls, dtype, method):
    """RT-DETRv2 calls the module-level multi_scale_deformable_attention_v2 (replace_kernel_layers
    finds nothing in it); install() switches that, models built before included. "discrete"
    gives the offsets no gradient (None) in both."""
    transformers = client("transformers")
    from pymsda.compat import transformers as compat
    config = rtdetr_config(transformers, "RTDetrV2Config", decoder_method=method)
    switched = compare_switched(lambda: transformers.RTDetrV2ForObjectDetection(config),
                                detection_loss, dtype, compat.install, compat.uninstall,
                                library_calls, calls_per_step=2)
    assert ("transformers.models.rt_detr_v2.modeling_rt_detr_v2."
            "multi_scale_deformable_attention_v2") in switched


@DTYPES
def test_transformers_kernel_layer_of_models_built_after_install(library_calls, dtype):
    """RT-DETR (v1) builds the MultiScaleDeformableAttention kernel layer: a model built after
    install() holds pymsda's; one built before keeps its own until replace_kernel_layers. After
    uninstall() the layers built while installed (a copy's too) are transformers' again."""
    transformers = client("transformers")
    from pymsda.compat import transformers as compat
    from transformers.models.rt_detr import modeling_rt_detr
    config = rtdetr_config(transformers, "RTDetrConfig")
    torch.manual_seed(0)
    model = transformers.RTDetrForObjectDetection(config)
    truth = train_step(copy.deepcopy(model).double(), detection_loss)
    model = model.to(dtype)
    own = train_step(copy.deepcopy(model), detection_loss)
    assert library_calls["forward"] == 0
    compat.install()
    try:
        torch.manual_seed(0)
        built_after = transformers.RTDetrForObjectDetection(config).to(dtype)
        built_after.load_state_dict(model.state_dict())
        copied = copy.deepcopy(built_after)
        layers = [m for built in (built_after, copied) for m in built.modules()
                  if type(m).__name__ == "MultiScaleDeformableAttention"]
        assert len(layers) == 4
        assert all(isinstance(m, compat.MultiScaleDeformableAttention) for m in layers)
        assert not any(isinstance(m, compat.MultiScaleDeformableAttention)
                       for m in model.modules())
        ours = train_step(built_after, detection_loss)
    finally:
        compat.uninstall()
    assert library_calls["forward"] == 2 and library_calls["backward"] == 2
    assert_same_step(ours, own, truth, dtype)
    assert not any(isinstance(m, compat.MultiScaleDeformableAttention)
                   for m in transformers.RTDetrForObjectDetection(config).modules())
    assert all(type(m) is modeling_rt_detr.MultiScaleDeformableAttention for m in layers)
    again = train_step(copied, detection_loss)
    assert library_calls["forward"] == 2  # transformers' own code again
    assert_same_step(again, own, truth, dtype)


# D-FINE's and DEIMv2's decoder attention: (config class, layer class in modeling_<model>)
FUNCTION_COPYING_LAYERS = {"d_fine": ("DFineConfig", "DFineMultiscaleDeformableAttention"),
                           "deimv2": ("Deimv2Config", "Deimv2MultiscaleDeformableAttention")}


def copying_layer_output(layer):
    """A forward of a D-FINE or DEIMv2 attention layer (d_model 32, two levels, boxes)."""
    generator = torch.Generator().manual_seed(8)
    shapes = [(6, 5), (3, 3)]

    def rand(*size):
        return torch.rand(*size, generator=generator, dtype=torch.float64)
    output, _ = layer(rand(2, 7, 32), reference_points=rand(2, 7, 1, 4) * 0.5 + 0.25,
                      encoder_hidden_states=rand(2, 39, 32), spatial_shapes=torch.tensor(shapes),
                      spatial_shapes_list=shapes)
    return output


@pytest.mark.parametrize("model", sorted(FUNCTION_COPYING_LAYERS))
def test_transformers_uninstall_gives_layers_built_while_installed_their_function_back(
        library_calls, model):
    """D-FINE's and DEIMv2's attention copy multi_scale_deformable_attention_v2 into the layer
    when it is built: one built while installed (and a copy of it) runs pymsda's; after
    uninstall() both hold and run transformers' own function again, as does one built before
    install() throughout."""
    transformers = client("transformers")
    modeling = client("transformers.models.%s.modeling_%s" % (model, model))
    config_name, layer_name = FUNCTION_COPYING_LAYERS[model]
    if not (hasattr(transformers, config_name) and hasattr(modeling, layer_name)):
        pytest.skip("this transformers (%s) has no %s" % (transformers.__version__, layer_name))
    from pymsda.compat import transformers as compat
    own = modeling.multi_scale_deformable_attention_v2
    layer_class = getattr(modeling, layer_name)
    config = getattr(transformers, config_name)(d_model=32, decoder_attention_heads=4,
                                                num_feature_levels=2, decoder_n_points=2)
    torch.manual_seed(0)
    before = layer_class(config).double()
    expected = copying_layer_output(before)
    compat.install()
    try:
        built = layer_class(config).double()
        built.load_state_dict(before.state_dict())
        copied = copy.deepcopy(built)
        assert built.ms_deformable_attn_core is not own
        ours = copying_layer_output(built)
        assert library_calls["forward"] == 1
    finally:
        compat.uninstall()
    assert rel_l2(ours, expected) < 1e-12
    for layer in (built, copied, before):
        assert layer.ms_deformable_attn_core is own
        assert torch.equal(copying_layer_output(layer), expected)
    assert library_calls["forward"] == 1  # transformers' own code again


def mask2former_pixel_decoder():
    transformers = client("transformers")
    from transformers.models.mask2former.modeling_mask2former import Mask2FormerPixelDecoder
    config = transformers.Mask2FormerConfig(feature_size=32, mask_feature_size=32,
                                            encoder_layers=2, num_attention_heads=4,
                                            encoder_feedforward_dim=64, dropout=0.0)
    decoder = Mask2FormerPixelDecoder(config, feature_channels=[8, 16, 24, 32])
    torch.nn.init.normal_(decoder.level_embed)  # left uninitialised by its constructor
    return decoder


def pixel_decoder_loss(decoder):
    generator = torch.Generator().manual_seed(2)
    dtype = decoder.level_embed.dtype
    features = [torch.randn(2, c, s, s + 1, generator=generator, dtype=torch.float64).to(dtype)
                for c, s in ((8, 16), (16, 8), (24, 4), (32, 2))]
    out = decoder(features)
    return out.mask_features, square_mean(out.mask_features, *out.multi_scale_features)


@DTYPES
def test_transformers_mask2former_trains_the_same_after_install(library_calls, dtype):
    """Mask2Former's pixel decoder calls the module-level multi_scale_deformable_attention."""
    client("transformers")
    from pymsda.compat import transformers as compat
    switched = compare_switched(mask2former_pixel_decoder, pixel_decoder_loss, dtype,
                                compat.install, compat.uninstall, library_calls,
                                calls_per_step=2)
    assert ("transformers.models.mask2former.modeling_mask2former."
            "multi_scale_deformable_attention") in switched


def test_transformers_install_routes_tracing_to_transformers_code(library_calls):
    """While torch.jit.trace records, the switched function runs transformers' own code."""
    client("transformers")
    from pymsda.compat import transformers as compat
    decoder = mask2former_pixel_decoder().eval().requires_grad_(False)
    compat.install()
    try:
        with torch.no_grad():
            features = [torch.randn(1, c, s, s) for c, s in ((8, 16), (16, 8), (24, 4), (32, 2))]
            eager = decoder(features).mask_features
            assert library_calls["forward"] == 2
            traced = torch.jit.trace(lambda *f: decoder(list(f)).mask_features, features,
                                     check_trace=False)
            assert library_calls["forward"] == 2  # none while tracing
            assert rel_l2(traced(*features), eager) < 1e-5
    finally:
        compat.uninstall()


def test_replace_kernel_layers_and_install_warn_when_nothing_is_switched(monkeypatch):
    transformers = client("transformers")
    from pymsda.compat import transformers as compat
    model = transformers.RTDetrV2ForObjectDetection(rtdetr_config(transformers, "RTDetrV2Config"))
    with pytest.warns(UserWarning, match="nothing was replaced"):
        assert compat.replace_kernel_layers(model) == 0
    monkeypatch.setattr(compat, "_TARGETS", [("transformers.models.no_such_model", "x")])
    with pytest.warns(UserWarning, match="found no MSDA of transformers"):
        assert compat.install() == []


# ---- Ultralytics ----------------------------------------------------------------------------

def ultralytics_rtdetr():
    """Ultralytics' RT-DETR head (RTDETRDecoder: input projection, query selection, a decoder
    of MSDeformAttn layers), at a small width."""
    head = client("ultralytics.nn.modules.head")
    return head.RTDETRDecoder(nc=3, ch=(16, 24, 32), hd=32, nq=12, ndp=2, nh=4, ndl=3,
                              d_ffn=64)


def ultralytics_loss(model):
    generator = torch.Generator().manual_seed(3)
    dtype = next(model.parameters()).dtype
    features = [torch.randn(2, c, s, s + 1, generator=generator, dtype=torch.float64).to(dtype)
                for c, s in ((16, 8), (24, 4), (32, 2))]
    boxes, scores, enc_boxes, enc_scores, _ = model.train()(features)
    return boxes, square_mean(boxes, scores, enc_boxes, enc_scores)


@DTYPES
def test_ultralytics_rtdetr_trains_the_same_after_install(library_calls, dtype):
    """RT-DETR's decoder (MSDeformAttn layers, levels and points folded into one axis) on
    pymsda after install(), models built before included."""
    client("ultralytics.nn.modules.transformer")
    from pymsda.compat import ultralytics as compat
    switched = compare_switched(ultralytics_rtdetr, ultralytics_loss, dtype, compat.install,
                                compat.uninstall, library_calls, calls_per_step=3)
    assert "ultralytics.nn.modules.transformer.multi_scale_deformable_attn_pytorch" in switched


def test_ultralytics_export_tracing_runs_ultralytics_code(library_calls):
    transformer = client("ultralytics.nn.modules.transformer")
    from pymsda.compat import ultralytics as compat
    torch.manual_seed(0)
    attention = transformer.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
    attention.eval().requires_grad_(False)
    shapes = [(4, 5), (2, 3)]
    query, value = torch.randn(1, 7, 32), torch.randn(1, 26, 32)
    boxes = torch.rand(1, 7, 1, 4)
    compat.install()
    try:
        with torch.no_grad():
            eager = attention(query, boxes, value, shapes)
            assert library_calls["forward"] == 1
            traced = torch.jit.trace(lambda q, b, v: attention(q, b, v, shapes),
                                     (query, boxes, value), check_trace=False)
            assert library_calls["forward"] == 1
            assert rel_l2(traced(query, boxes, value), eager) < 1e-5
    finally:
        compat.uninstall()


# ---- RF-DETR --------------------------------------------------------------------------------

def rfdetr_attention():
    modules = client("rfdetr.models.ops.modules.ms_deform_attn")
    return modules.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)


def rfdetr_loss(attention):
    generator = torch.Generator().manual_seed(4)
    dtype = attention.value_proj.weight.dtype
    shapes = [(6, 5), (3, 3)]

    def rand(*size):
        return torch.rand(*size, generator=generator, dtype=torch.float64).to(dtype)
    query, value, reference = rand(2, 9, 32), rand(2, 39, 32), rand(2, 9, 2, 4) * 0.5 + 0.25
    out = attention(query, reference, value, torch.tensor(shapes), torch.tensor([0, 30]),
                    None, shapes)
    return out, square_mean(out)


@DTYPES
def test_rfdetr_trains_the_same_after_install(library_calls, dtype):
    """RF-DETR's MSDeformAttn ((B, heads, head_dim, S) value) on pymsda after install()."""
    client("rfdetr.models.ops.modules.ms_deform_attn")
    from pymsda.compat import rfdetr as compat
    switched = compare_switched(rfdetr_attention, rfdetr_loss, dtype, compat.install,
                                compat.uninstall, library_calls, calls_per_step=1)
    assert "rfdetr.models.ops.modules.ms_deform_attn.ms_deform_attn_core_pytorch" in switched


def test_rfdetr_export_mode_runs_rfdetr_code(library_calls):
    """MSDeformAttn.export() (rank-5 locations for CoreML) keeps RF-DETR's own code."""
    client("rfdetr.models.ops.modules.ms_deform_attn")
    from pymsda.compat import rfdetr as compat
    torch.manual_seed(0)
    attention = rfdetr_attention().double()
    eager, _ = rfdetr_loss(attention)
    exported = copy.deepcopy(attention)
    exported.export()
    compat.install()
    try:
        switched_eager, _ = rfdetr_loss(attention)
        assert library_calls["forward"] == 1
        out, _ = rfdetr_loss(exported)
        assert library_calls["forward"] == 1
    finally:
        compat.uninstall()
    assert rel_l2(switched_eager, eager) < 1e-12 and rel_l2(out, eager) < 1e-12


def test_lwdetr_module_is_switched_when_given(library_calls):
    """LW-DETR's models.ops.modules.ms_deform_attn (a source checkout): install(module)."""
    import types
    original = pytest.importorskip("pymsda.reference").ms_deform_attn_pytorch
    module = types.ModuleType("lwdetr_ms_deform_attn")

    def ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations,
                                    attention_weights):  # LW-DETR's layout and signature
        return original(value.permute(0, 3, 1, 2), value_spatial_shapes, sampling_locations,
                        attention_weights.unflatten(3, sampling_locations.shape[3:5]))
    module.ms_deform_attn_core_pytorch = ms_deform_attn_core_pytorch
    from pymsda.compat import rfdetr as compat
    generator = torch.Generator().manual_seed(5)
    value = torch.randn(2, 4, 3, 26, generator=generator, dtype=torch.float64)
    loc = torch.rand(2, 5, 4, 2, 3, 2, generator=generator, dtype=torch.float64)
    attn = torch.rand(2, 5, 4, 6, generator=generator, dtype=torch.float64)
    expected = module.ms_deform_attn_core_pytorch(value, [(4, 5), (2, 3)], loc, attn)
    assert compat.install(module) == ["lwdetr_ms_deform_attn.ms_deform_attn_core_pytorch"]
    try:
        out = module.ms_deform_attn_core_pytorch(value, [(4, 5), (2, 3)], loc, attn)
    finally:
        assert compat.uninstall() == ["lwdetr_ms_deform_attn.ms_deform_attn_core_pytorch"]
    assert module.ms_deform_attn_core_pytorch is ms_deform_attn_core_pytorch
    assert library_calls["forward"] == 1 and rel_l2(out, expected) < 1e-13


# ---- rf-groundingdino -----------------------------------------------------------------------

def groundingdino_encoder_layer():
    """rf-groundingdino's deformable encoder layer (its MultiScaleDeformableAttention, the FFN and
    norms), at a small width."""
    transformer = client("groundingdino.models.GroundingDINO.transformer")
    return transformer.DeformableTransformerEncoderLayer(d_model=32, d_ffn=64, dropout=0.0,
                                                         n_levels=2, n_heads=4, n_points=2)


def groundingdino_loss(layer):
    generator = torch.Generator().manual_seed(7)
    dtype = layer.linear1.weight.dtype

    def rand(*size):
        return torch.rand(*size, generator=generator, dtype=torch.float64).to(dtype)
    shapes = torch.tensor([[6, 5], [3, 3]])
    src, pos, reference = rand(2, 39, 32), rand(2, 39, 32), rand(2, 39, 2, 2)
    out = layer(src, pos, reference, shapes, torch.tensor([0, 30]),
                key_padding_mask=torch.arange(39).expand(2, 39) > 36)
    return out, square_mean(out)


@DTYPES
def test_groundingdino_trains_the_same_after_install(library_calls, dtype):
    """rf-groundingdino's encoder layer on pymsda after install(), layers built before
    included: its MultiScaleDeformableAttention calls the module-level
    multi_scale_deformable_attn_pytorch."""
    client("groundingdino.models.GroundingDINO.ms_deform_attn")
    from pymsda.compat import groundingdino as compat
    switched = compare_switched(groundingdino_encoder_layer, groundingdino_loss, dtype,
                                compat.install, compat.uninstall, library_calls,
                                calls_per_step=1)
    assert switched == ["groundingdino.models.GroundingDINO.ms_deform_attn."
                        "multi_scale_deformable_attn_pytorch"]


def test_groundingdino_tracing_runs_groundingdino_code(library_calls):
    """While torch.jit.trace records, the switched function runs rf-groundingdino's own."""
    client("groundingdino.models.GroundingDINO.ms_deform_attn")
    from pymsda.compat import groundingdino as compat
    torch.manual_seed(0)
    layer = groundingdino_encoder_layer().double().eval().requires_grad_(False)
    shapes, starts = torch.tensor([[6, 5], [3, 3]]), torch.tensor([0, 30])
    inputs = tuple(torch.rand(*size, dtype=torch.float64)
                   for size in ((1, 39, 32), (1, 39, 32), (1, 39, 2, 2)))

    def run(src, pos, reference):
        return layer(src, pos, reference, shapes, starts)
    compat.install()
    try:
        with torch.no_grad():
            eager = run(*inputs)
            assert library_calls["forward"] == 1
            traced = torch.jit.trace(run, inputs, check_trace=False)
            assert library_calls["forward"] == 1  # none while tracing
            assert rel_l2(traced(*inputs), eager) < 1e-12
    finally:
        compat.uninstall()
