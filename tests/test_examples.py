"""The example scripts run end to end (tiny --smoke configurations)."""

import importlib.util
import json
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_gpt_smoke(tmp_path):
    """Two tiny steps per attention (flashtile, then SDPA) from the same weights on the same batches,
    greedy decoding through the kv cache, and the result files."""
    train_gpt = load("train_gpt")
    # float32 on the GPU too, so that the two runs' first losses agree closely.
    results = train_gpt.main(["--smoke", "--precision", "fp32", "--out", str(tmp_path)])
    runs = results["runs"]
    assert set(runs) == {"flashtile", "sdpa"}
    flash, sdpa = runs["flashtile"]["log"]["loss"], runs["sdpa"]["log"]["loss"]
    assert len(flash) == len(sdpa) == 2
    # Same initial weights and batches: the first loss is the same forward up to rounding (TF32 on GPUs).
    assert abs(flash[0] - sdpa[0]) < 1e-3 * abs(sdpa[0])
    for run in runs.values():
        assert run["summary"]["tokens_per_s"] > 0 and 0.0 <= run["generation"]["accuracy"] <= 1.0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["config"]["steps"] == 2
    text = (tmp_path / "results.md").read_text()
    assert "| flashtile |" in text and "| sdpa |" in text and "train_gpt.py --smoke" in text


def test_train_programmable_smoke(tmp_path):
    """Two tiny steps of the model with learnable sinks and a document block mask: the first loss
    matches the float32 reference model's, and the sinks get gradients (they move)."""
    results = load("train_programmable").main(["--smoke", "--out", str(tmp_path)])
    check = results["summary"]["first_step_check"]
    assert abs(check["flashtile"] - check["reference"]) < 2e-2 * abs(check["reference"])
    first, last = results["log"]["sink_mean"][0], results["log"]["sink_mean"][-1]
    assert all(a != b for a, b in zip(first, last))
    assert "first-step loss" in (tmp_path / "results.md").read_text()
