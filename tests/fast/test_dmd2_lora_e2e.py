"""DMD2 with a LoRA student and a LoRA critic end to end through ``train_diffusion.main`` (issue 19): it trains,
checkpoints only the adapters, resumes exactly, logs the bytes the memory planner predicts, and exports the merged
pipeline beside the adapter alone. Tiny random SD3 pipeline, 2 DP ranks on the CPU, the session's Ray cluster.
"""

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.memory import assert_plan_agrees
from tests.support.sd3 import tiny_sd3_pipeline

PROMPTS = ["a red square", "a blue circle", "two green dots", "a yellow line"]
EXACT_KEYS = ["train/loss", "train/grad_norm", "train/critic-loss", "train/critic-grad_norm"]


def _argv(pipeline: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", str(data), "--actor-num-gpus-per-node", "2", "--rollout-batch-size", "4",
        "--micro-batch-size", "1", "--dmd2-critic-steps-per-rollout", "2", "--num-rollout", "2",
        "--lr", "1e-3", "--critic-lr", "1e-3", "--lora-rank", "4", "--lora-alpha", "8", "--critic-lora-rank", "2",
        # the teacher unguided, as before SD3's stock 7 became the default: no negative prompt to encode
        "--dmd2-teacher-guidance-scale", "1", "--ema-decay", "0.9", "--output-dir", str(out), *extra,
    ]  # fmt: skip


def _records(out: Path, key: str) -> dict[int, list[dict]]:
    grouped: dict[int, list[dict]] = {}
    for record in read_metrics(out):
        if key in record:
            grouped.setdefault(record["rollout_id"], []).append(record)
    return grouped


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("dmd2_lora_e2e")
    _, pipeline = tiny_sd3_pipeline(root / "sd3")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    save, export, out = root / "ckpt", root / "student", root / "full"
    extra = ("--save", str(save), "--save-interval", "1", "--save-hf", str(export), "--save-hf-lora")
    run_main(_argv(pipeline, data, out, *extra))
    return {"root": root, "pipeline": pipeline, "data": data, "save": save, "export": export, "out": out}


def test_each_group_logs_the_bytes_the_planner_predicts_and_one_base(run):
    figures = assert_plan_agrees(_argv(run["pipeline"], run["data"], run["out"]), read_metrics(run["out"]))
    # The critic group holds one base (the teacher is it with the adapters off), as large as the actor's base.
    assert figures["critic-frozen"][1] == figures["actor-frozen"][1] > 0
    assert 0 < figures["critic-parameters"][1] < figures["actor-parameters"][1] < figures["actor-frozen"][1] / 5


def test_checkpoints_hold_only_the_adapters_and_the_resume_is_exact(run):
    save = run["save"]
    for directory in (save, Path(f"{save}_critic")):
        keys = FileSystemReader(str(directory / "rollout_0" / "dcp")).read_metadata().state_dict_metadata
        model_keys = [key for key in keys if key.startswith("train.model.")]
        assert model_keys and all(".lora_A." in key or ".lora_B." in key for key in model_keys), directory
    (save / "latest").write_text("0\n")
    out = run["root"] / "resumed"
    run_main(_argv(run["pipeline"], run["data"], out, "--load", str(save)))
    for key in ("train/loss", "train/critic-loss"):
        full, resumed = _records(run["out"], key)[1], _records(out, key)
        assert sorted(resumed) == [1] and len(resumed[1]) == len(full)
        for a, b in zip(full, resumed[1]):
            assert {k: a[k] for k in EXACT_KEYS if k in a} == {k: b[k] for k in EXACT_KEYS if k in b}, key


def test_the_merged_export_and_the_adapter_on_the_base_agree(run):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    export, pipeline = run["export"], run["pipeline"]
    merged = SD3Transformer2DModel.from_pretrained(export / "transformer")
    initial = SD3Transformer2DModel.from_pretrained(pipeline / "transformer")
    assert merged.state_dict().keys() == initial.state_dict().keys()
    assert not torch.equal(merged.state_dict()["transformer_blocks.0.attn.to_q.weight"],
                           initial.state_dict()["transformer_blocks.0.attn.to_q.weight"])  # fmt: skip
    base = StableDiffusion3Pipeline.from_pretrained(pipeline, text_encoder_3=None, tokenizer_3=None)  # no T5
    base.load_lora_weights(export / "lora")
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, merged.config.in_channels, 8, 8, generator=gen)
    hidden = torch.randn(1, 5, merged.config.joint_attention_dim, generator=gen)
    pooled = torch.randn(1, merged.config.pooled_projection_dim, generator=gen)
    with torch.no_grad():
        outputs = [
            model(hidden_states=latents, encoder_hidden_states=hidden, pooled_projections=pooled,
                  timestep=torch.tensor([500.0]), return_dict=False)[0]
            for model in (merged, base.transformer)
        ]  # fmt: skip
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5, rtol=0)
