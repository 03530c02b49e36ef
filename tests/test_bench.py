"""tests/test_bench.py: the benchmark machinery (pymsda/bench/) on the CPU, on tiny shapes.

Checks what the numbers mean, never how fast anything is: the rows and their keys, the precision
columns, the input distributions of shapes.json "locations", the JSON output, the CLI.
"""
import io
import json
import math
import os
import re
import subprocess
import sys
import zipfile

import pytest
import torch

import pymsda
from pymsda.bench import command, inputs as bench_inputs, op, report, timing
from pymsda.modules import initial_sampling_offsets
from conftest import grid_sample_supports, requires_torch_feature

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_SHAPES = {
    "tiny_enc": {"B": 1, "levels": [[6, 8], [3, 4]], "Q": None, "H": 4, "C": 4, "P": 2},
    "tiny_dec": {"B": 2, "levels": [[5, 7], [3, 3]], "Q": 5, "H": 2, "C": 8, "P": 3},
}
# The fixture's bf16 rows time and measure the reference too, which torch 1.13 cannot run.
needs_bf16_reference = requires_torch_feature(
    grid_sample_supports(torch.bfloat16), "bfloat16 grid_sample on the CPU (the bf16 rows' reference)")
ROW_KEYS = {"shape", "dtype", "dist", "pass", "pymsda_ms", "pymsda_p10_p90_ms", "reference_ms",
            "reference_p10_p90_ms", "reference_note", "speedup", "errors"}


@pytest.fixture(autouse=True, scope="module")
def one_cpu_round():
    """The CPU rows in one interleaved round of one call each (the tests check what the rows
    mean; the bench's own 30 s and 20 ms rounds are for timing)."""
    saved = timing.CPU_MIN_SECONDS, timing.CPU_ROUND_MS
    timing.CPU_MIN_SECONDS, timing.CPU_ROUND_MS = 0.0, 0.0
    yield
    timing.CPU_MIN_SECONDS, timing.CPU_ROUND_MS = saved


@pytest.fixture(scope="module")
def result():
    return op.run(TINY_SHAPES, device="cpu", dtypes=["f32", "bf16"], reps=1, sets=2,
                     overhead=True, progress=False)


@needs_bf16_reference
def test_run_gives_one_row_per_shape_dtype_and_pass_with_the_expected_keys(result):
    combos = [(r["shape"], r["dtype"], r["pass"]) for r in result["rows"]]
    assert combos == [(s, d, p) for s in TINY_SHAPES for d in ("f32", "bf16") for p in report.PASSES]
    for row in result["rows"]:
        assert set(row) == ROW_KEYS
        assert set(report.ERROR_KEYS) <= set(row["errors"])
        assert row["pymsda_ms"] > 0 and row["reference_ms"] > 0
        for who in ("pymsda", "reference"):  # the spread brackets the median
            low, high = row[who + "_p10_p90_ms"]
            assert 0 < low <= row[who + "_ms"] <= high
        assert row["speedup"] == pytest.approx(row["reference_ms"] / row["pymsda_ms"])
    assert {"date", "device", "driver", "torch", "cuda", "library", "commit", "command"} <= set(
        result["metadata"])


def test_metadata_names_the_commit_of_the_checkout_the_package_comes_from(result):
    """A checkout's bench records its commit (hex, "-dirty" when tracked files differ); an
    installed package "n/a"."""
    commit = result["metadata"]["commit"]
    package = os.path.dirname(os.path.realpath(pymsda.__file__))
    if package == os.path.join(os.path.realpath(REPO), "pymsda") and os.path.exists(
            os.path.join(REPO, ".git")):
        assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", commit), commit
    else:
        assert commit == "n/a"


@needs_bf16_reference
def test_run_reports_small_f32_errors_for_forward_and_gradients(result):
    for row in result["rows"]:
        errors = row["errors"]
        bound = 1e-5 if row["dtype"] == "f32" else 5e-2  # bf16: 8 bits of mantissa
        for key in ("forward",) + report.GRAD_KEYS:
            assert errors[key] < bound, (row["shape"], row["dtype"], key, errors[key])
            # the reference's own error in the same dtype, beside pymsda's
            assert 0 <= errors["reference_" + key] < 10 * bound, (row["shape"], key)
        if row["dtype"] == "bf16":  # a real rounding error, not 0: the bench ran in bf16
            assert errors["reference_forward"] > 1e-4


def test_no_reference_leaves_the_reference_columns_empty():
    result = op.run({"tiny_dec": TINY_SHAPES["tiny_dec"]}, device="cpu", dtypes=["f64"],
                       passes=["fwd"], reps=1, sets=1, reference=False, progress=False)
    (row,) = result["rows"]
    assert row["reference_ms"] is None and row["speedup"] is None and row["reference_note"]
    assert row["errors"]["forward"] < 1e-12 and row["errors"]["reference_forward"] is None
    assert "n/a" in report.format_table(result)


def test_realistic_encoder_locations_minus_offsets_are_the_query_pixel_centres():
    spec = TINY_SHAPES["tiny_enc"]
    inputs = bench_inputs.make_inputs(spec, torch.float64, noise=0.0)
    loc = inputs["sampling_locations"]
    B, Q, H, L, P, _ = loc.shape
    levels = spec["levels"]
    assert Q == sum(h * w for h, w in levels)
    # Deformable DETR's initial offsets, in pixels: direction (cos, sin) / max-abs, times (p + 1).
    offsets = torch.zeros(H, L, P, 2, dtype=torch.float64)
    for h in range(H):
        direction = torch.tensor([math.cos(2 * math.pi * h / H), math.sin(2 * math.pi * h / H)],
                                 dtype=torch.float64)
        direction /= direction.abs().max()
        for level, (height, width) in enumerate(levels):
            for p in range(P):
                offsets[h, level, p] = direction * (p + 1) / torch.tensor([width, height])
    centres = [((j + 0.5) / width, (i + 0.5) / height)
               for height, width in levels for i in range(height) for j in range(width)]
    centres = torch.tensor(centres, dtype=torch.float64)[None, :, None, None, None, :]
    torch.testing.assert_close(loc - offsets, centres.expand_as(loc), rtol=0, atol=1e-12)


def test_realistic_decoder_reference_points_lie_in_the_inner_box_and_noise_moves_them():
    spec = TINY_SHAPES["tiny_dec"]
    quiet = bench_inputs.make_inputs(spec, torch.float64, noise=0.0, seed=3)["sampling_locations"]
    noisy = bench_inputs.make_inputs(spec, torch.float64, noise=1.0, seed=3)["sampling_locations"]
    start = initial_sampling_offsets(spec["H"], [spec["P"]] * 2, torch.float64)
    offsets = start.view(spec["H"], 2, spec["P"], 2) / torch.tensor(
        [[w, h] for h, w in spec["levels"]], dtype=torch.float64)[:, None, :]
    reference = quiet - offsets
    assert torch.allclose(reference, reference[:, :, :1, :1, :1].expand_as(reference))
    assert reference.min() >= 0.05 and reference.max() <= 0.95
    assert not torch.allclose(quiet, noisy)


@pytest.mark.parametrize("dist", ["realistic", "uniform"])
def test_attention_weights_sum_to_one_over_levels_and_points(dist):
    inputs = bench_inputs.make_inputs(TINY_SHAPES["tiny_dec"], torch.float64, dist=dist)
    sums = inputs["attention_weights"].sum((-2, -1))
    torch.testing.assert_close(sums, torch.ones_like(sums))
    if dist == "uniform":
        loc = inputs["sampling_locations"]
        assert loc.min() >= -0.05 and loc.max() <= 1.05


def test_input_sets_are_seeded_and_cast_to_the_dtype():
    spec = TINY_SHAPES["tiny_enc"]
    a = bench_inputs.make_inputs(spec, torch.bfloat16, seed=1)
    assert all(a[k].dtype == torch.bfloat16 for k in ("value", "sampling_locations",
                                                      "attention_weights", "grad_output"))
    assert torch.equal(a["value"], bench_inputs.make_inputs(spec, torch.bfloat16, seed=1)["value"])
    assert not torch.equal(a["value"], bench_inputs.make_inputs(spec, torch.bfloat16, seed=2)["value"])


def test_overhead_reports_microseconds_per_call(result):
    overhead = result["overhead"]
    for key in ("pymsda_plain_us", "pymsda_requires_grad_us", "pymsda_tables_plain_us",
                "pymsda_tables_requires_grad_us", "reference_plain_us",
                "reference_requires_grad_us", "torch_add_us"):
        assert overhead[key] > 0
    assert "pymsda requires_grad" in report.format_table(result)
    assert "pymsda plain (tensor tables)" in report.format_table(result)
    assert "torch value.add(1)" in report.format_table(result)
    assert "- torch value.add(1): " in report.format_markdown(result)


def test_json_file_is_strict_json_with_metadata_and_rows(result, tmp_path):
    result = dict(result, rows=[dict(r, errors=dict(r["errors"], forward=float("nan")))
                                for r in result["rows"]])
    path = tmp_path / "bench.json"
    report.write_json(result, path)
    loaded = json.loads(path.read_text())
    assert loaded["metadata"]["torch"] == torch.__version__
    assert len(loaded["rows"]) == len(result["rows"]) and loaded["rows"][0]["errors"]["forward"] == "nan"


def test_shapes_file_ships_in_the_package_and_names_both_groups(tmp_path):
    shapes = bench_inputs.load_shapes()
    assert {"ddetr_enc", "ddetr_dec"} <= set(shapes["gpu"]) and "small_enc" in shapes["cpu"]
    assert set(shapes["locations"]) == set(bench_inputs.DISTRIBUTIONS)
    sys.path.insert(0, os.path.join(REPO, "pymsda"))
    try:
        import _build_backend
    finally:
        sys.path.pop(0)
    if not os.path.isfile(os.path.join(REPO, "build", "libpymsda.so")):
        pytest.skip("no build/libpymsda.so to put in a wheel")
    name = _build_backend.build_wheel(str(tmp_path))
    assert "pymsda/bench/shapes.json" in zipfile.ZipFile(tmp_path / name).namelist()


def run_cli(arguments, cwd):
    """`python -m pymsda ...` in a child that imports the same pymsda as these tests (the source
    checkout or an installed wheel), from a folder that holds no other copy."""
    env = dict(os.environ)
    paths = [os.path.dirname(os.path.dirname(pymsda.__file__)), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return subprocess.run([sys.executable, "-m", "pymsda"] + arguments, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_bench_on_cpu_exits_0_and_writes_json(tmp_path):
    path = tmp_path / "out.json"
    done = run_cli(["bench", "--device", "cpu", "--shapes", "small_enc", "--reps", "1", "--sets", "1",
                    "--no-reference", "--json", str(path)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "small_enc" in done.stdout and "pymsda ms" in done.stdout
    rows = json.loads(path.read_text())["rows"]
    assert [r["pass"] for r in rows] == list(report.PASSES)


def test_cli_bench_rejects_an_unknown_shape(tmp_path):
    done = run_cli(["bench", "--device", "cpu", "--shapes", "no_such_shape"], cwd=tmp_path)
    assert done.returncode == 2 and "small_enc" in done.stderr


def test_plot_writes_a_png(result, tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib (bench --plot): pip install matplotlib")
    path = tmp_path / "speedups.png"
    report.plot(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_stops_before_running_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(SystemExit) as stop:
        command.main(["--device", "cpu", "--plot", "never_written.png"])
    assert stop.value.code == 2 and "matplotlib" in capsys.readouterr().err


def test_a_failing_reference_gives_na_with_the_reason_and_the_run_goes_on(monkeypatch):
    def out_of_memory(*args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 TiB")

    monkeypatch.setattr(op, "ms_deform_attn_pytorch", out_of_memory)
    result = op.run(TINY_SHAPES, device="cpu", dtypes=["f32"], passes=["fwd", "bwd"], reps=1,
                    sets=1, progress=False)
    assert len(result["rows"]) == 4
    for row in result["rows"]:
        assert row["pymsda_ms"] > 0 and row["reference_ms"] is None and row["speedup"] is None
        assert row["reference_note"] == "out of memory" and row["errors"]["forward"] is None
    assert "n/a (out of memory)" in report.format_table(result)


def test_cpu_rows_are_timed_in_interleaved_rounds_that_alternate_direction():
    # Every round runs each (row, implementation) in turn, reversed on odd rounds, so that each
    # median spans the whole run; fake calls record the order.
    ran = []

    def fake_pass_calls(implementation, input_sets, pass_name):
        name = "reference" if implementation is op.ms_deform_attn_pytorch else "pymsda"
        return [lambda key=(pass_name, name): ran.append(key) for _ in input_sets]

    jobs = [({"pass": p}, [None, None]) for p in ("fwd", "bwd")]
    timing.time_rows(jobs, reps=3, warmup=0, make_calls=fake_pass_calls, op=op._pymsda,
                     reference_op=op.ms_deform_attn_pytorch)
    entries = [("fwd", "pymsda"), ("fwd", "reference"), ("bwd", "pymsda"), ("bwd", "reference")]
    sizing = [e for e in entries for _ in range(2)]  # one untimed pass of each entry's two calls
    forward = [e for e in entries for _ in range(2)]
    assert ran == sizing + forward + forward[::-1] + forward
    for row, _ in jobs:
        assert row["pymsda_ms"] >= 0 and row["reference_ms"] >= 0 and row["reference_note"] is None
        assert len(row["pymsda_p10_p90_ms"]) == 2


def test_alternated_groups_take_turns_to_run_first():
    # --points f32 times autocast's call and the all-half call alternated; the call that runs
    # second can find the first's data in L2, so the pair's order flips every other round.
    ran = []
    groups = [[lambda k=(g, i): ran.append(k) for i in range(2)] for g in ("A", "H")]
    (a_ms, *_), (h_ms, *_) = timing.time_ms_alternated(groups, reps=4, device=torch.device("cpu"),
                                                        warmup=0)
    warm = [("A", 0), ("H", 0), ("A", 1), ("H", 1)]
    forward, backward = warm, [("H", 0), ("A", 0), ("H", 1), ("A", 1)]
    assert ran == warm + (forward + backward) * 2
    assert a_ms >= 0 and h_ms >= 0


def test_the_all_half_sets_timed_beside_autocast_hold_their_own_value_and_grad_output():
    spec = bench_inputs.load_shapes()["cpu"]["small_enc"]
    inputs = bench_inputs.make_inputs(spec, torch.bfloat16, points32=True)
    shared, own = op._all_half(inputs), op._all_half(inputs, copies=True)
    for half in (shared, own):
        assert half["sampling_locations"].dtype == half["attention_weights"].dtype == torch.bfloat16
    assert shared["value"] is inputs["value"]
    for key in ("value", "grad_output"):
        assert own[key].data_ptr() != inputs[key].data_ptr() and torch.equal(own[key], inputs[key])


def test_queue_ran_dry_flags_idle_gaps_between_timed_calls():
    # GPU milliseconds between one call's end event and the next call's start event: a few
    # microseconds while the host keeps ahead of the GPU, more where the queue ran dry.
    assert not timing.queue_ran_dry([0.002] * 89)
    assert not timing.queue_ran_dry([0.002] * 81 + [0.3] * 8)  # 8 of 89: under a tenth
    assert timing.queue_ran_dry([0.002] * 79 + [0.3] * 10)
    assert timing.queue_ran_dry([1.0] * 20)
    assert not timing.queue_ran_dry([])


def test_cli_bench_rejects_negative_seconds(capsys):
    with pytest.raises(SystemExit) as stop:
        command.main(["--device", "cpu", "--seconds", "-1"])
    assert stop.value.code == 2 and "--seconds" in capsys.readouterr().err


def test_drift_line_says_whether_the_halves_of_the_run_agree():
    steady = {"rounds": 40, "seconds": 60.2, "halves_apart": {"a f32 fwd pymsda": 0.04}}
    drifted = {"rounds": 40, "seconds": 61.0, "halves_apart": {"a f32 fwd pymsda": 0.04,
                                                              "b f32 bwd reference": 0.31}}
    assert "held steady" in timing.drift_line(steady) and "4%" in timing.drift_line(steady)
    line = timing.drift_line(drifted)
    assert "31%" in line and "b f32 bwd reference" in line and "drifted" in line


def _wide_values_result():
    """Rows as wide as the table gets: the longest shape name of shapes.json, four-digit
    milliseconds, a reference that failed with a long reason, a NaN error (the reference's own
    f16 NaNs)."""
    longest = max((n for g in ("gpu", "cpu") for n in bench_inputs.load_shapes()[g]), key=len)
    errors = dict.fromkeys(report.ERROR_KEYS, 1.234e-07)
    errors["reference_grad_loc"] = float("nan")
    rows = []
    for dtype in ("bf16", "f16"):
        for index, pass_name in enumerate(report.PASSES):
            failed = index == 2
            rows.append(dict(shape=longest, dtype=dtype, pass_=pass_name, errors=errors,
                             pymsda_ms=1234.567, pymsda_p10_p90_ms=[1200.001, 1299.999],
                             reference_ms=None if failed else 9876.543,
                             reference_p10_p90_ms=None if failed else [9000.0, 9999.999],
                             reference_note="out of memory" if failed else None,
                             speedup=None if failed else 123.45))
    for row in rows:
        row["pass"] = row.pop("pass_")
    return {"rows": rows, "overhead": None}


def test_default_table_fits_100_columns_and_wide_shows_every_column():
    result = _wide_values_result()
    table = report.format_table(result)
    assert max(len(line) for line in table.splitlines()) <= report.TABLE_COLUMNS, table
    assert "n/a" in table and "ref n/a (out of memory): " in table
    header = table.splitlines()[0].split()
    assert header[:3] == ["shape", "dtype", "pass"] and "grad_loc" not in header
    assert re.search(r" nan$", table, re.M)  # the worst gradient error: NaN where one is NaN
    wide = report.format_table(result, wide=True)
    assert max(len(line) for line in wide.splitlines()) > report.TABLE_COLUMNS
    for column in ("pymsda ms (p10-p90)", "ref grad_value", "ref grad_loc", "grad_attn"):
        assert column in wide
    assert "1234.567 (1200.001-1299.999)" in wide and "n/a (out of memory)" in wide


def test_worst_gradient_error_is_the_largest_of_the_three():
    errors = {"grad_value": 1e-7, "grad_loc": 3e-5, "grad_attn": 2e-6,
              "reference_grad_value": None, "reference_grad_loc": None,
              "reference_grad_attn": None}
    assert report._worst(errors, "") == 3e-5 and report._worst(errors, "reference_") is None


def test_bench_help_lists_the_shapes_and_explains_every_option():
    cli = command.parser()
    for action in cli._actions:
        assert action.help, action.option_strings  # no option without its help text
    text = cli.format_help()
    for group in ("gpu", "cpu"):
        for name in bench_inputs.load_shapes()[group]:
            assert f"    {name} " in text
    assert "(default 3)" in text  # --sets' default, among others
    for option in ("--dist", "--pass", "--wide"):
        assert "default" in next(a.help for a in cli._actions if option in a.option_strings)


def test_time_rows_reports_progress_between_rounds():
    seen = []
    jobs = [({"pass": "fwd"}, [None])]
    timing.time_rows(jobs, reps=3, warmup=0, make_calls=lambda op, sets, p: [lambda: None],
                     op=op._pymsda, progress=lambda *args: seen.append(args))
    assert [(rounds, done) for rounds, _, done in seen] == [(1, False), (2, False), (3, False),
                                                            (3, True)]
    assert all(b[1] >= a[1] >= 0 for a, b in zip(seen, seen[1:]))  # elapsed seconds grow


class Stream(io.StringIO):
    def __init__(self, terminal):
        super().__init__()
        self.terminal = terminal

    def isatty(self):
        return self.terminal


def test_progress_is_a_line_every_few_seconds_in_a_log_and_a_bar_on_a_terminal():
    log = Stream(terminal=False)
    progress = timing.progress_reporter(reps=20, seconds=60.0, stream=log)
    progress(1, 2.4, False)  # before PROGRESS_EVERY_S: nothing yet
    assert log.getvalue() == ""
    progress(5, 12.0, False)  # 2.4 s a round: 25 rounds for 60 s, 20 left
    assert log.getvalue() == "  timing: round 5 of about 25, 12 s, about 48 s left\n"
    progress(25, 60.0, True)  # the rows that follow say the rest
    assert log.getvalue().count("\n") == 1
    terminal = Stream(terminal=True)
    progress = timing.progress_reporter(reps=20, seconds=60.0, stream=terminal)
    progress(5, 12.0, False)
    progress(25, 60.0, True)
    first, last = terminal.getvalue().split("\r")[1:]
    assert first.startswith("  timing [" + "#" * 6 + "." * 24 + "] round 5 of about 25")
    assert last.startswith("  timing [" + "#" * 30 + "] round 25 of 25, 60 s") and last.endswith("\n")
