"""tests/factories.py: random MSDA inputs and small comparison helpers shared by the tests.

Inputs are drawn in float64 from a torch.Generator and then cast, so every dtype of a test sees
the same numbers (up to rounding), and the f64 oracle is fed the *rounded* inputs: the error we
measure is the computation's, not the input quantisation's.
"""
import zlib

import numpy as np
import torch

import oracle
import pymsda

ARG_NAMES = ("value", "spatial_shapes", "level_start_index", "sampling_locations",
             "attention_weights")
GRAD_NAMES = ("value", "sampling_locations", "attention_weights")

HALF_DTYPES = (torch.float16, torch.bfloat16)


def random_level_shapes(generator, levels, max_side=12, min_side=1):
    """`levels` (H_l, W_l) pairs, mostly rectangular, each side in [min_side, max_side]."""
    sides = torch.randint(min_side, max_side + 1, (levels, 2), generator=generator)
    return [(int(h), int(w)) for h, w in sides]


def level_start_index_of(shapes):
    starts, total = [], 0
    for h, w in shapes:
        starts.append(total)
        total += h * w
    return starts


def kink_free_locations(generator, batch, queries, heads, shapes, points, margin=0.2):
    """Locations whose pixel coordinates loc*W - 0.5 and loc*H - 0.5 have a fractional part in
    [margin, 1 - margin]: bilinear sampling is smooth there (its kinks sit at integer pixel
    coordinates), so finite differences and low-precision roundings of the location never cross
    a kink. The integer part ranges over [-2, side], so some corners (and some whole samples)
    fall outside the map."""
    levels = len(shapes)
    heights = torch.tensor([h for h, _ in shapes], dtype=torch.float64)
    widths = torch.tensor([w for _, w in shapes], dtype=torch.float64)
    size = (batch, queries, heads, levels, points)
    coords = []
    for sides in (widths, heights):
        unit = torch.rand(size, generator=generator, dtype=torch.float64)
        integer = torch.floor(unit * (sides[:, None] + 3.0)) - 2.0  # in [-2, side]
        fraction = margin + (1.0 - 2.0 * margin) * torch.rand(size, generator=generator,
                                                              dtype=torch.float64)
        coords.append((integer + fraction + 0.5) / sides[:, None])
    return torch.stack(coords, dim=-1)


def make_inputs(generator, batch, queries, heads, channels, shapes, points,
                dtype=torch.float64, device="cpu", loc_low=-0.1, loc_high=1.1,
                kink_free=False, index_dtype=torch.int64):
    """A dict of MSDA inputs. Locations are uniform in [loc_low, loc_high] (outside [0, 1] on
    purpose) unless kink_free; attention weights are a softmax over (levels, points)."""
    levels = len(shapes)
    total = sum(h * w for h, w in shapes)
    value = torch.randn(batch, total, heads, channels, generator=generator, dtype=torch.float64)
    if kink_free:
        locations = kink_free_locations(generator, batch, queries, heads, shapes, points)
    else:
        locations = loc_low + (loc_high - loc_low) * torch.rand(
            batch, queries, heads, levels, points, 2, generator=generator, dtype=torch.float64)
    logits = torch.randn(batch, queries, heads, levels * points, generator=generator,
                         dtype=torch.float64)
    weights = torch.softmax(logits, -1).reshape(batch, queries, heads, levels, points)
    return _inputs_dict(value, shapes, locations, weights, device, dtype, index_dtype)


def _inputs_dict(value, shapes, locations, weights, device, dtype, index_dtype):
    """The op's arguments by name, the float ones cast to dtype, all on device."""
    return dict(
        value=value.to(device=device, dtype=dtype),
        spatial_shapes=torch.tensor(shapes, dtype=index_dtype, device=device),
        level_start_index=torch.tensor(level_start_index_of(shapes), dtype=index_dtype,
                                       device=device),
        sampling_locations=locations.to(device=device, dtype=dtype),
        attention_weights=weights.to(device=device, dtype=dtype),
    )


def run_msda(inputs, **overrides):
    """pymsda.ms_deform_attn on an inputs dict, with some arguments replaced by keyword."""
    args = {k: inputs[k] for k in ARG_NAMES}
    args.update(overrides)
    return pymsda.ms_deform_attn(**args)


def forward_and_grads(inputs, grad_output):
    """The op's output and its gradients for grad_output (in GRAD_NAMES order), taken on
    detached copies of the inputs."""
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
    out = run_msda(inputs, **leaves)
    out.backward(grad_output)
    return out.detach(), [leaves[k].grad for k in GRAD_NAMES]


def random_grad_output(generator, like):
    grad = torch.randn(like.shape, generator=generator, dtype=torch.float64)
    return grad.to(device=like.device, dtype=like.dtype)


def to_numpy(tensor):
    return tensor.detach().to(device="cpu", dtype=torch.float64).numpy()


def oracle_forward(inputs):
    return oracle.forward(to_numpy(inputs["value"]), to_numpy(inputs["spatial_shapes"]),
                          to_numpy(inputs["sampling_locations"]),
                          to_numpy(inputs["attention_weights"]))


def oracle_backward(inputs, grad_output):
    return oracle.backward(to_numpy(inputs["value"]), to_numpy(inputs["spatial_shapes"]),
                           to_numpy(inputs["sampling_locations"]),
                           to_numpy(inputs["attention_weights"]), to_numpy(grad_output))


def rel_l2(actual, expected):
    """||actual - expected|| / ||expected|| in float64, of torch tensors or numpy arrays (the
    tests' one measure of error); actual must be finite."""
    actual, expected = (to_numpy(t) if isinstance(t, torch.Tensor) else np.asarray(t, np.float64)
                        for t in (actual, expected))
    assert np.all(np.isfinite(actual)), "result has non-finite entries"
    denominator = np.linalg.norm(expected.ravel())
    return float(np.linalg.norm((actual - expected).ravel()) / max(denominator, 1e-300))


def reference_in_dtype(reference, inputs):
    """The pure-PyTorch reference run in the inputs' own dtype and device: the yardstick for
    f16/bf16 ("no worse than twice the error of the reference computed in the same dtype").
    torch 2.x grid_sample supports f16/bf16 on CPU, so this is a plain call; should a torch
    build refuse half on CPU, fall back to what such a run would do at best: inputs already
    rounded to the dtype, computation in f32, output rounded to the dtype."""
    args = (inputs["value"], inputs["spatial_shapes"], inputs["sampling_locations"],
            inputs["attention_weights"])
    try:
        return reference(*args)
    except (RuntimeError, NotImplementedError):
        dtype = inputs["value"].dtype
        promoted = [a.float() if a.is_floating_point() else a for a in args]
        return reference(*promoted).to(dtype)


def loose_bound(reference_error, floor=1e-7):
    """Tolerance for f16/bf16: twice what the reference achieves in the same dtype."""
    return 2.0 * reference_error + floor


def seed_of(text):
    """A stable 31-bit seed from a string (a test's node id), different for every case."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def flat_size(shapes):
    return sum(h * w for h, w in shapes)


def assert_close_rel(actual, expected, bound, what):
    error = rel_l2(actual, expected)
    assert error < bound, f"{what}: rel L2 error {error:.3e} >= {bound:.3e}"
    return error


# ---- the small problem --------------------------------------------------------------------------
# Two levels, S = 26: the problem the input, table, non-finite and empty-problem tests perturb,
# small enough to pick a point or a table entry by hand.
SMALL_SHAPES = [(4, 5), (3, 2)]
SMALL_SIZES = (2, 3, 2, 4, 2, 3)  # B, Q, H, C, L, P


def small_inputs(generator, device="cpu", dtype=torch.float32, **options):
    """make_inputs of the small problem; options as make_inputs takes them."""
    B, Q, H, C, _, P = SMALL_SIZES
    return make_inputs(generator, B, Q, H, C, SMALL_SHAPES, P, dtype=dtype, device=device,
                       **options)



# ---- per-level point counts, nearest sampling, fused softmax ------------------------------------

def level_of_points(num_points_list):
    """The level of each point of a (b, q, h), level 0's points first."""
    return [level for level, count in enumerate(num_points_list) for _ in range(count)]


def kink_free_point_locations(generator, batch, queries, heads, shapes, num_points_list,
                              margin=0.2):
    """(B, Q, H, N, 2) locations, N = sum(num_points_list), point i on level level_of[i], whose
    pixel coordinates loc*W - 0.5 have a fractional part in [margin, 1 - margin]. That keeps
    them away from bilinear's kinks (integer loc*W - 0.5) and from nearest's jumps (integer
    loc*W + 0.5) alike. The integer part ranges over [-2, side]: some corners, some whole
    bilinear samples, fall outside the map (nearest sampling clamps them to the border)."""
    level_of = level_of_points(num_points_list)
    heights = torch.tensor([float(shapes[l][0]) for l in level_of], dtype=torch.float64)
    widths = torch.tensor([float(shapes[l][1]) for l in level_of], dtype=torch.float64)
    size = (batch, queries, heads, len(level_of))
    coords = []
    for sides in (widths, heights):
        unit = torch.rand(size, generator=generator, dtype=torch.float64)
        integer = torch.floor(unit * (sides + 3.0)) - 2.0
        fraction = margin + (1.0 - 2.0 * margin) * torch.rand(size, generator=generator,
                                                              dtype=torch.float64)
        coords.append((integer + fraction + 0.5) / sides)
    return torch.stack(coords, dim=-1)


def make_point_inputs(generator, batch, queries, heads, channels, shapes, num_points_list,
                      dtype=torch.float64, device="cpu", logits=False, index_dtype=torch.int64):
    """MSDA inputs in the num_points_list layout: sampling_locations (B, Q, H, N, 2) (kink-free),
    attention_weights (B, Q, H, N): a softmax over the N points, or raw logits (logits=True,
    for softmax=True). Like make_inputs, drawn in f64 and then cast."""
    total = sum(h * w for h, w in shapes)
    points = sum(num_points_list)
    value = torch.randn(batch, total, heads, channels, generator=generator, dtype=torch.float64)
    locations = kink_free_point_locations(generator, batch, queries, heads, shapes,
                                          num_points_list)
    weights = 2.0 * torch.randn(batch, queries, heads, points, generator=generator,
                                dtype=torch.float64)
    if not logits:
        weights = torch.softmax(weights, -1)
    return _inputs_dict(value, shapes, locations, weights, device, dtype, index_dtype)


def oracle_forward_general(inputs, **options):
    """oracle.forward_general on an inputs dict; options: num_points_list, nearest, softmax."""
    return oracle.forward_general(to_numpy(inputs["value"]), to_numpy(inputs["spatial_shapes"]),
                                  to_numpy(inputs["sampling_locations"]),
                                  to_numpy(inputs["attention_weights"]), **options)


def oracle_backward_general(inputs, grad_output, **options):
    return oracle.backward_general(to_numpy(inputs["value"]), to_numpy(inputs["spatial_shapes"]),
                                   to_numpy(inputs["sampling_locations"]),
                                   to_numpy(inputs["attention_weights"]), to_numpy(grad_output),
                                   **options)


TABLE_CHANGES = ("in place", ".data", ".data =")


def change_tables(shapes, starts, new_shapes, how):
    """Gives the spatial_shapes / level_start_index tensors the numbers of new_shapes (two
    levels) in one of TABLE_CHANGES: in place (bumps their version counters), through .data
    (which leaves the counters alone) or by .data = (new storage, a new data pointer)."""
    new = torch.tensor(new_shapes, device=shapes.device)
    new_starts = torch.tensor([0, new_shapes[0][0] * new_shapes[0][1]], device=starts.device)
    if how == "in place":
        shapes.copy_(new), starts.copy_(new_starts)
    elif how == ".data":
        shapes.data.copy_(new), starts.data.copy_(new_starts)
    else:
        shapes.data, starts.data = new, new_starts
