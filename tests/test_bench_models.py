"""tests/test_bench_models.py: `python -m pymsda bench --models` (pymsda/bench/models.py) on the
CPU at --size tiny (HF transformers models with one layer, small backbones, a 64x96 image).

Checks the output's structure, that every pymsda variant called libpymsda and no own variant
did, and that a silent non-switch and a failing variant are reported; never how fast anything
is. Skipped where transformers cannot be imported.
"""
import json

import pytest
import torch

from pymsda.bench import models as bench_models
from clients import client
from test_bench import run_cli

ROW_KEYS = {"dtype", "path", "ms", "p10_p90_ms", "steps_timed", "peak_bytes",
            "library_calls_per_step", "switch_ok", "speedup", "error"}
TINY = dict(device="cpu", size="tiny", rounds=1, steps=1, warmup=1, progress=False)


@pytest.fixture(autouse=True)
def needs_transformers():
    client("transformers")  # or a skip with the reason the client tests give


def test_models_command_on_cpu_reports_every_variant_and_counts_library_calls(tmp_path):
    path = tmp_path / "models.json"
    done = run_cli(["bench", "--models", "hf_ddetr,hf_rtdetr", "--device", "cpu", "--size", "tiny",
                    "--rounds", "2", "--steps", "2", "--warmup", "1", "--threads", "1",
                    "--json", str(path)],
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ms/step (p10-p90)" in done.stdout and "replace_kernel_layers" in done.stdout
    result = json.loads(path.read_text())
    assert result["settings"]["size"] == "tiny" and result["settings"]["dtypes"] == ["f32"]
    assert {"date", "device", "torch", "transformers", "commit", "command"} <= set(
        result["metadata"])
    # kernel layers per model at one layer: Deformable DETR's encoder and decoder, RT-DETR's decoder
    layers = {"hf_ddetr": 2, "hf_rtdetr": 1}
    assert [entry["model"] for entry in result["models"]] == list(layers)
    for entry in result["models"]:
        assert entry["rounds_run"] == 2 and entry["image"] == [64, 96]
        assert [(r["dtype"], r["path"]) for r in entry["rows"]] == [("f32", "own"),
                                                                    ("f32", "pymsda")]
        for row in entry["rows"]:
            assert set(row) == ROW_KEYS and row["error"] is None and row["switch_ok"] is True
            assert row["steps_timed"] == 4
            low, high = row["p10_p90_ms"]
            assert 0 < low <= row["ms"] <= high
            assert row["peak_bytes"] is None  # GPU memory only
            expected = layers[entry["model"]] if row["path"] == "pymsda" else 0
            assert row["library_calls_per_step"] == {"forward": expected, "backward": expected}
        own, ours = entry["rows"]
        assert own["speedup"] is None and ours["speedup"] == pytest.approx(own["ms"] / ours["ms"])


def test_a_model_left_on_its_own_msda_is_reported_as_not_switched(monkeypatch):
    monkeypatch.setattr(bench_models, "_kernel_layer_switch",
                        lambda model: (lambda path: None, "a switch that does nothing"))
    result = bench_models.run(["hf_ddetr"], **TINY)
    own, ours = result["models"][0]["rows"]
    assert own["switch_ok"] is True and ours["switch_ok"] is False
    assert ours["library_calls_per_step"] == {"forward": 0, "backward": 0}
    assert bench_models.problems(result) == [
        ("hf_ddetr", "f32", "pymsda", "NOT SWITCHED: pymsda's library was never called")]
    assert "NOT SWITCHED" in bench_models.format_table(result)


def autocast_on_cpu():
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # a torch before 2.4
        return torch.is_autocast_cpu_enabled()


def test_a_failing_variant_is_recorded_and_the_others_still_run(monkeypatch):
    build = bench_models.BUILDERS["hf_rtdetr"]

    def build_failing_in_bf16(layers, tiny):
        model, loss, switch, switched = build(layers, tiny)

        def failing(model, pixels):
            if autocast_on_cpu():
                raise RuntimeError("no bf16 here")
            return loss(model, pixels)
        return model, failing, switch, switched
    monkeypatch.setitem(bench_models.BUILDERS, "hf_rtdetr", build_failing_in_bf16)
    result = bench_models.run(["hf_rtdetr"], dtypes=["f32", "bf16"], **TINY)
    rows = {(r["dtype"], r["path"]): r for r in result["models"][0]["rows"]}
    assert all(rows[("f32", p)]["ms"] > 0 and rows[("f32", p)]["error"] is None
               for p in bench_models.PATHS)
    for path in bench_models.PATHS:
        assert rows[("bf16", path)]["ms"] is None
        assert rows[("bf16", path)]["error"] == "RuntimeError: no bf16 here"
    assert len(bench_models.problems(result)) == 2 and "FAILED" in bench_models.format_table(result)


def test_the_time_limit_cuts_the_rounds_but_keeps_one():
    result = bench_models.run(["hf_rtdetr"], **dict(TINY, rounds=3), time_limit=0)
    assert result["models"][0]["rounds_run"] == 1


def test_an_unimportable_model_is_skipped_with_the_reason(monkeypatch):
    def unavailable(layers, tiny):
        raise bench_models.Skip("ultralytics cannot be imported (here, on purpose)")
    monkeypatch.setitem(bench_models.BUILDERS, "ultralytics_rtdetr", unavailable)
    result = bench_models.run(["ultralytics_rtdetr"], **TINY)
    assert result["models"][0]["skipped"] == "ultralytics cannot be imported (here, on purpose)"
    assert "ultralytics_rtdetr: skipped: ultralytics cannot be imported" in (
        bench_models.format_table(result))
    assert bench_models.problems(result) == []
