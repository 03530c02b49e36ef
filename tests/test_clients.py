"""tests/test_clients.py: the projects pymsda.compat switches, as installed from PyPI (versions
pinned in tests/requirements-clients.txt and tests/requirements-clients-torchvision.txt):
transformers (RT-DETRv2, Mask2Former, RT-DETR's kernel layer), Ultralytics RT-DETR, RF-DETR and
mmcv-lite + mmengine.

Each test builds the project's own model or module from a config (no download), runs forward,
backward and one AdamW step with the project's own MSDA and again after pymsda's install()
(or with pymsda's module), and compares outputs, gradients (their None-ness included) and the
updated weights in float64 and float32. Calls into libpymsda are counted, so a silent non-switch
(or a switch that leaks into the project's own run) fails. A project that cannot be imported
here is skipped with the reason: ultralytics and rfdetr need PyPI's torchvision, which is built
against PyPI's CUDA build of torch (CI runs them in tests/matrix.py's torch 2.14.1 environment).
"""
import copy
import importlib

import pytest
import torch

from pymsda import _autograd
from pymsda.compat import _switch
from factories import rel_l2

# ours may be off the float64 truth by twice the project's own error in the same dtype, plus
# this much relative to the size of the true quantity
FLOOR = {torch.float64: 1e-10, torch.float32: 1e-6}
LEARNING_RATE = 1e-3
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])


def client(name):
    """The project's module, or a skip that says why it cannot be imported here."""
    try:
        return importlib.import_module(name)
    except Exception as error:  # ImportError, or a torchvision built for another torch
        first_line = (str(error).splitlines() or [""])[0][:160]
        pytest.skip(f"{name} cannot be imported here ({type(error).__name__}: {first_line}); "
                    "ultralytics and rfdetr need PyPI's torchvision, built for PyPI's CUDA torch")


@pytest.fixture
def library_calls(monkeypatch):
    """Counts of the calls into libpymsda's msda_forward and msda_backward."""
    counts = {"forward": 0, "backward": 0}
    for name, key in (("_forward_c", "forward"), ("_backward_c", "backward")):
        entry = getattr(_autograd, name)

        def counted(*args, _entry=entry, _key=key):
            counts[_key] += 1
            return _entry(*args)
        monkeypatch.setattr(_autograd, name, counted)
    return counts


def train_step(model, loss_of):
    """Forward, backward and one AdamW step (weight decay on): (output, gradients by parameter
    name, None where no gradient flowed, parameters after the step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1)
    output, loss = loss_of(model)
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone()
             for n, p in model.named_parameters()}
    optimizer.step()
    return output.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def error(actual, expected):
    return (actual.double() - expected.double()).norm()


def assert_same_step(ours, own, truth, dtype):
    """ours and own: one training step in dtype on pymsda and on the project's own MSDA; truth:
    the project's own step in float64. Ours is no further from the truth than twice the
    project's own error in dtype (plus FLOOR) for the output, each gradient (4x in float32) and
    each weight after the step (float64); gradients that are None stay None (never zeros)."""
    floor = FLOOR[dtype]
    (out, grads, params), (own_out, own_grads, own_params) = ours, own
    true_out, true_grads, true_params = truth
    assert out.dtype == own_out.dtype == dtype and out.shape == own_out.shape
    assert error(out, true_out) <= 2 * error(own_out, true_out) + floor * true_out.norm()
    assert grads.keys() == own_grads.keys() == true_grads.keys()
    # A gradient that is 0 in exact arithmetic (a bias before a normalisation) is rounding
    # noise: its size is measured against all gradients together.
    total = torch.cat([g.flatten() for g in true_grads.values() if g is not None]).norm()
    noise = {n for n, g in true_grads.items() if g is not None and g.norm() < 1e-6 * total}
    # A float32 location that crosses a pixel edge (where bilinear sampling has a kink) moves
    # the location gradient by a step: both runs' offset gradients carry such steps at random
    # points, so float32 gradients get 4x the project's own error.
    factor = 2 if dtype == torch.float64 else 4
    for name, grad in grads.items():
        expected = true_grads[name]
        assert (grad is None) == (own_grads[name] is None) == (expected is None), name
        if expected is not None:
            scale = 1e-4 * total if name in noise else expected.norm()
            assert (error(grad, expected) <= factor * error(own_grads[name], expected)
                    + floor * scale), name
    if dtype != torch.float64:
        # AdamW's first step moves a weight by lr * g / (|g| + eps), which turns a float32
        # gradient's rounding error into up to lr where |g| is near eps: the weights are
        # compared in float64 only
        return
    for name, param in params.items():
        if name not in noise:  # weights whose gradient is only rounding noise: not compared
            expected = true_params[name]
            assert (error(param, expected) <= 2 * error(own_params[name], expected)
                    + floor * LEARNING_RATE * expected.numel() ** 0.5), name


def compare_switched(build, loss_of, dtype, install, uninstall, library_calls, calls_per_step):
    """The project's own step (in dtype and in float64), then pymsda's after install(), then the
    project's own again after uninstall(), on copies of one model."""
    torch.manual_seed(0)
    model = build()
    truth = train_step(copy.deepcopy(model).double(), loss_of)
    model = model.to(dtype)
    own = train_step(copy.deepcopy(model), loss_of)
    assert library_calls == {"forward": 0, "backward": 0}  # the project's own path
    switched = install()
    try:
        assert switched and install() == switched  # idempotent
        ours = train_step(copy.deepcopy(model), loss_of)
    finally:
        restored = uninstall()
    assert sorted(restored) == sorted(switched)
    assert library_calls["forward"] == calls_per_step and library_calls["backward"] >= 1
    assert_same_step(ours, own, truth, dtype)
    again = train_step(copy.deepcopy(model), loss_of)  # uninstalled: the project's own again
    assert library_calls["forward"] == calls_per_step
    assert_same_step(again, own, truth, dtype)
    return switched


def square_mean(*tensors):
    return sum(t.double().square().mean() for t in tensors)


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
    install() holds pymsda's; one built before keeps its own until replace_kernel_layers."""
    transformers = client("transformers")
    from pymsda.compat import transformers as compat
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
        layers = [m for m in built_after.modules()
                  if type(m).__name__ == "MultiScaleDeformableAttention"]
        assert len(layers) == 2
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


# ---- mmcv-lite + mmengine -------------------------------------------------------------------

def mmcv_own_module_class(monkeypatch):
    """mmcv's own MultiScaleDeformableAttention, from the installed mmcv's source. mmcv-lite
    cannot import it (no compiled ops: mmcv._ext), so its loader is stubbed; off CUDA the module
    never calls the compiled op (it runs multi_scale_deformable_attn_pytorch), and its
    registration in mmengine's MODELS is left out (pymsda's holds the name)."""
    client("mmcv")
    registry = client("mmengine.registry")
    from mmcv.utils import ext_loader
    monkeypatch.setattr(ext_loader, "load_ext", lambda name, funcs: None)
    monkeypatch.setattr(registry.MODELS, "register_module",
                        lambda *args, **kwargs: (lambda cls: cls))
    path = importlib.util.find_spec("mmcv").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("mmcv.ops.multi_scale_deform_attn",
                                                  path + "/ops/multi_scale_deform_attn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MultiScaleDeformableAttention


def mmcv_loss(attention):
    generator = torch.Generator().manual_seed(6)
    dtype = attention.value_proj.weight.dtype
    shapes = torch.tensor([[6, 5], [3, 3]])

    def rand(*size):
        return torch.rand(*size, generator=generator, dtype=torch.float64).to(dtype)
    query, value = rand(9, 2, 32), rand(39, 2, 32)
    out = attention(query, value=value, query_pos=rand(9, 2, 32),
                    reference_points=rand(2, 9, 2, 2), spatial_shapes=shapes,
                    level_start_index=torch.tensor([0, 30]),
                    key_padding_mask=torch.arange(39).expand(2, 39) > 36)
    return out, square_mean(out)


@DTYPES
def test_mmcv_module_trains_like_mmcvs_own(monkeypatch, library_calls, dtype):
    """pymsda.compat.mmcv.MultiScaleDeformableAttention against mmcv's own class (off CUDA:
    its pure-PyTorch path): same state_dict keys and initial weights, same training step."""
    own_class = mmcv_own_module_class(monkeypatch)
    from pymsda.compat import mmcv as compat
    options = dict(embed_dims=32, num_heads=4, num_levels=2, num_points=2, dropout=0.0)
    torch.manual_seed(0)
    own = own_class(**options)
    torch.manual_seed(0)
    ours = compat.MultiScaleDeformableAttention(**options)
    assert list(ours.state_dict()) == list(own.state_dict())
    for name, tensor in own.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    truth = train_step(copy.deepcopy(own).double(), mmcv_loss)
    own_step = train_step(own.to(dtype), mmcv_loss)
    assert library_calls["forward"] == 0
    our_step = train_step(ours.to(dtype), mmcv_loss)
    assert library_calls["forward"] == 1 and library_calls["backward"] == 1
    assert_same_step(our_step, own_step, truth, dtype)


def test_mmcv_module_builds_from_an_mmengine_config(library_calls):
    """With mmcv-lite (no compiled ops) a config naming mmcv's module builds pymsda's."""
    client("mmcv")
    registry = client("mmengine.registry")
    from pymsda.compat import mmcv as compat
    assert compat.REGISTERED
    attention = registry.MODELS.build(dict(type="MultiScaleDeformableAttention", embed_dims=32,
                                           num_heads=4, num_levels=2, num_points=2,
                                           batch_first=False))
    assert type(attention) is compat.MultiScaleDeformableAttention
    out, loss = mmcv_loss(attention.double())
    assert out.shape == (9, 2, 32) and library_calls["forward"] == 1
