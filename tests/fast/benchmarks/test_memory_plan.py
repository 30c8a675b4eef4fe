"""``benchmarks/memory_plan.py``: every model of the docs table has a sourced config, and the table and the per-group
breakdown come out of a config (a tiny SD3 one here: the five real models take a minute on the CPU)."""

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TINY_SD3 = {
    "_class_name": "SD3Transformer2DModel", "sample_size": 8, "patch_size": 2, "in_channels": 4, "out_channels": 4,
    "num_layers": 4, "attention_head_dim": 8, "num_attention_heads": 3, "joint_attention_dim": 32,
    "caption_projection_dim": 24, "pooled_projection_dim": 32, "pos_embed_max_size": 8,
    "_source": ["tests/fast/benchmarks/test_memory_plan.py (toy width)"],
}  # fmt: skip


def _script():
    spec = importlib.util.spec_from_file_location("memory_plan_script", REPO / "benchmarks" / "memory_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_model_of_the_table_has_a_sourced_config():
    script = _script()
    assert len(script.MODELS) == 5 and set(script.FAMILIES) == set(script.MODELS)
    for name in script.MODELS:
        config = json.loads((script.CONFIGS / f"{name}.json").read_text())
        assert config["_source"] and config["_class_name"]


def test_the_table_and_the_breakdown_of_one_config(tmp_path, monkeypatch, capsys):
    script = _script()
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_SD3))
    monkeypatch.setattr(script, "CONFIGS", tmp_path)
    monkeypatch.setattr(script, "MODELS", {"tiny": "Tiny SD3", "absent": "Absent"})
    monkeypatch.setattr(script, "FAMILIES", {"tiny": "sd3", "absent": "sd3"})
    rows = script.table(1024, ema=False)
    assert len(rows) == 2 + 3 * 2  # header, rule, then full and LoRA at 1, 8 and 64 GPUs; no row for "absent"
    assert "no sourced config" in capsys.readouterr().err
    cells = [row.strip("| ").split(" | ") for row in rows]
    one, eight = cells[2], cells[4]
    assert one[2:4] == ["1", "full"] and eight[2:4] == ["8", "full"] and cells[3][3] == "LoRA r64 + r32"
    assert one[4] == one[6] and one[5] == one[7] == "yes / yes"  # one GPU: both modes the same, a toy fits
    assert script.main(["--detail", "tiny", "--gpus", "8", "--lora", "--zero3"]) == 0
    out = capsys.readouterr().out
    assert "memory per GPU, DP rank 0 of 8: bfloat16 compute, 4096 image + 333 text tokens per sample" in out
    assert "ZeRO-3 per block" in out and "GPU of 80 GiB: fits" in out and "GPU of 141 GiB: fits" in out
