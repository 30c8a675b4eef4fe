"""``benchmarks/memory_plan.py``: the docs table's rows and one setting's breakdown, from the sourced configs on the
meta device (SD3.5-Medium only here, to stay fast; the script's full table covers five models)."""

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("memory_plan_script", REPO / "benchmarks" / "memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_model_of_the_table_has_a_sourced_config():
    script = _script()
    for name in script.MODELS:
        assert json.loads((script.CONFIGS / f"{name}.json").read_text())["_source"]


def test_the_table_rows_and_the_detail_of_sd35_medium(monkeypatch, capsys):
    script = _script()
    monkeypatch.setattr(script, "MODELS", {"sd35_medium": "SD3.5-Medium"})
    monkeypatch.setattr(script, "GPUS", (8,))
    rows = script.table(1024, ema=False)
    assert len(rows) == 2 + 2  # header, rule, full and LoRA
    full, lora = rows[2].split(" | "), rows[3].split(" | ")
    assert full[:4] == ["| SD3.5-Medium", "2.24B", "8", "full"] and lora[3] == "LoRA r64 + r32"
    # full weights: 16 bytes per parameter over 8 ranks plus the whole bf16 model gathered; LoRA: far less
    student_full, student_lora = float(full[4].split(" / ")[0]), float(lora[4].split(" / ")[0])
    assert 2.24e9 * 16 / 8 / 2**30 < student_full and student_lora < student_full / 2
    assert script.main(["--detail", "sd35_medium", "--gpus", "8", "--lora"]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU, DP rank 0 of 8: bfloat16 compute, 4096 image + 333 text tokens per sample" in out
    assert "GPU of 80 GiB: fits" in out and "GPU of 141 GiB: fits" in out
