"""``python -m miles.rollout.prompt_cache`` on a tiny digits pipeline and on the tiny SD3 + T5 pipeline: the cached
cond is the encoder's output, a RolloutEngine on the cached records draws bit-identical samples without loading a
text encoder, and bad inputs fail with one line naming the file."""

import json

import pytest
import torch
from safetensors.torch import load_file

from miles.driver.arguments import parse_args
from miles.models import get_model_family
from miles.rollout.conditioning import PromptConditioner
from miles.rollout.data_source import make_prompt_shard
from miles.rollout.engine import RolloutEngine
from miles.rollout.prompt_cache import main, prompt_hash, read_prompt_records, write_prompt_cache
from tests.support.rollout import engine_spec
from tests.support.sd3_t5 import tiny_sd3_t5_pipeline
from tests.support.trainer import make_pipeline

# 6 records, 4 distinct prompts; the engine's micro-batches of 2 hold the same distinct prompts as the cache's
# encoder batches of 2 (first-occurrence order), which SD3's CLIP projections need for bit-identity.
PROMPTS = ["a red square", "a blue circle", "two green dots", "a yellow line"]
RECORDS = [{"prompt": p, "id": i} for i, p in enumerate(PROMPTS)] + [{"prompt": PROMPTS[1], "id": 4}]
BATCH = 2


@pytest.fixture(scope="module", params=["digits", "sd3"])
def cached(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"cache_{request.param}")
    if request.param == "digits":
        pipeline = make_pipeline(root / "digits")
    else:
        pipeline = tiny_sd3_t5_pipeline(root / "sd3")
    source = root / "in.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    out = root / "cache"
    manifest = write_prompt_cache(pipeline, source, out, negative_prompt="blurry", batch_size=BATCH)
    return {"pipeline": pipeline, "out": out, "manifest": manifest, "root": root}


def test_the_cache_holds_the_encoders_output_once_per_distinct_prompt(cached):
    pipeline, out, manifest = cached["pipeline"], cached["out"], cached["manifest"]
    family = get_model_family(pipeline)
    encoder = family.load_text_encoder(pipeline)
    assert manifest["count"] == 4 and manifest["records"] == 5 and manifest["family"] == family.name
    assert sorted(p.name for p in (out / "cond").iterdir()) == sorted(f"{prompt_hash(p)}.safetensors" for p in PROMPTS)
    written = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert written == [{**record, "cond": f"cond/{prompt_hash(record['prompt'])}.safetensors"} for record in RECORDS]
    for start in range(0, len(PROMPTS), BATCH):
        batch = PROMPTS[start : start + BATCH]
        expected = family.encode_prompts(encoder, batch)
        for row, prompt in enumerate(batch):
            stored = load_file(str(out / "cond" / f"{prompt_hash(prompt)}.safetensors"))
            assert set(stored) == set(expected)
            for key, value in stored.items():
                assert value.dtype == torch.float32 and torch.equal(value, expected[key][row]), (prompt, key)
                assert manifest["shapes"][key] == list(value.shape)
    negative = load_file(str(out / "negative.safetensors"))
    expected = family.encode_prompts(encoder, ["blurry"])
    assert all(torch.equal(value, expected[key][0]) for key, value in negative.items())
    assert json.loads((out / "prompt_cache.json").read_text()) == manifest


def _engine_samples(pipeline, data, records, *extra):
    args = parse_args(
        ["--hf-checkpoint", str(pipeline), "--prompt-data", str(data), "--num-rollout", "1"]
        + ["--rollout-batch-size", str(len(records)), "--micro-batch-size", str(BATCH)]
        + ["--diffusion-num-steps", "3", "--diffusion-guidance-scale", "2", "--negative-prompt", "blurry", *extra]
    )
    family = get_model_family(pipeline)
    spec = engine_spec(args)
    conditioner = PromptConditioner(spec, family, pipeline)
    engine = RolloutEngine(spec, family, family.load_denoiser(pipeline), conditioner, family.latent_shape(pipeline))
    shard = make_prompt_shard(5, records, input_key="prompt", base_dir=data.parent)
    return engine.generate(shard), conditioner


def test_an_engine_on_the_cached_records_draws_the_same_samples_without_a_text_encoder(cached):
    pipeline, out, root = cached["pipeline"], cached["out"], cached["root"]
    records = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()][:4]
    uncached, _ = _engine_samples(pipeline, root / "in.jsonl", RECORDS[:4])
    samples, conditioner = _engine_samples(
        pipeline, out / "prompts.jsonl", records, "--negative-cond", str(out / "negative.safetensors")
    )
    assert conditioner._encoder is None  # the text encoder was never loaded
    assert len(samples) == len(uncached) == 4
    for ours, reference in zip(samples, uncached):
        assert ours.index == reference.index and ours.prompt == reference.prompt
        for key in reference.env.pos_cond:
            assert torch.equal(ours.env.pos_cond[key], reference.env.pos_cond[key])
            assert torch.equal(ours.env.neg_cond[key], reference.env.neg_cond[key])
        assert torch.equal(ours.trajectory.latents, reference.trajectory.latents)
        assert torch.equal(ours.trajectory.x0_preds, reference.trajectory.x0_preds)
        assert torch.equal(ours.trajectory.final, reference.trajectory.final)


def test_a_corrupted_cond_file_fails_naming_the_file(cached, tmp_path):
    out = cached["out"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "cond").mkdir()
    records = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()][:2]
    for record in records:
        (broken / record["cond"]).write_bytes((out / record["cond"]).read_bytes()[:40])  # truncated
    (broken / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match=f"cached cond file {broken / records[0]['cond']} is not a readable"):
        _engine_samples(cached["pipeline"], broken / "prompts.jsonl", records)


def test_a_bfloat16_cache_stores_the_rounded_cond(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"prompt": "a handwritten digit 3"}) + "\n")
    manifest = write_prompt_cache(pipeline, source, tmp_path / "cache", dtype="bfloat16")
    family = get_model_family(pipeline)
    expected = family.encode_prompts(family.load_text_encoder(pipeline), ["a handwritten digit 3"])
    stored = load_file(str(tmp_path / "cache" / "cond" / f"{prompt_hash('a handwritten digit 3')}.safetensors"))
    assert manifest["dtype"] == "bfloat16"
    assert all(
        value.dtype == torch.bfloat16 and torch.equal(value, expected[k][0].bfloat16()) for k, value in stored.items()
    )


def _error(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_the_command_fails_with_one_line_for_bad_inputs(tmp_path, capsys):
    pipeline = make_pipeline(tmp_path / "digits")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "a handwritten digit 3"}) + "\n")
    assert "pipeline directory" in _error(capsys, tmp_path / "missing", good, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    assert "model_index.json not found" in _error(capsys, tmp_path / "empty", good, tmp_path / "out")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n\n{not json\n")
    assert f"{bad}:3 is not valid JSON" in _error(capsys, pipeline, bad, tmp_path / "out")
    bad.write_text(json.dumps({"text": "ok"}) + "\n")
    assert f"{bad}:1 has no string field 'prompt'; set --input-key" in _error(capsys, pipeline, bad, tmp_path / "out")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert f"cannot write to output directory {blocker / 'out'}" in _error(capsys, pipeline, good, blocker / "out")
    # and the good case prints the flags to train with
    assert main([str(pipeline), str(good), str(tmp_path / "out"), "--input-key", "prompt"]) == 0
    assert f"--negative-cond {tmp_path / 'out' / 'negative.safetensors'}" in capsys.readouterr().out
    assert read_prompt_records(tmp_path / "out" / "prompts.jsonl")[0]["cond"].startswith("cond/")
