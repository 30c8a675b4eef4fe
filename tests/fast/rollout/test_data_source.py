"""The JSONL prompt source: seeded per-epoch order, resumable cursor, clear errors, SFT images."""

import json

import numpy as np
import pytest
import torch

from miles.models.digits import DigitsFamily
from miles.rollout.data_source import (
    JsonlPromptSource,
    load_image,
    load_image_latent,
    load_latent_file,
    make_prompt_shard,
    split_prompts,
)
from miles.utils.misc import make_generator


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "p.jsonl", [{"text": f"digit {i}", "label": i} for i in range(10)])


def test_each_epoch_is_a_seeded_permutation(data):
    source = JsonlPromptSource(data, input_key="text", seed=5, shuffle=True)
    epoch0 = [r["label"] for r in source.next_batch(10)]
    epoch1 = [r["label"] for r in source.next_batch(10)]
    assert epoch0 == torch.randperm(10, generator=make_generator("prompt_shuffle", 5, 0)).tolist()
    assert epoch1 == torch.randperm(10, generator=make_generator("prompt_shuffle", 5, 1)).tolist()
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    assert source.state_dict() == {"epoch": 1, "cursor": 10}
    assert source.prompt(source.records[3]) == "digit 3"


def test_batches_cross_epochs_and_resume_from_state(data):
    source = JsonlPromptSource(data, input_key="text", seed=1)
    source.next_batch(4)
    state = source.state_dict()
    rest = [r["label"] for r in source.next_batch(8)]  # 6 from epoch 0, 2 from epoch 1
    assert source.state_dict() == {"epoch": 1, "cursor": 2}
    resumed = JsonlPromptSource(data, input_key="text", seed=1)
    resumed.load_state_dict(state)
    assert [r["label"] for r in resumed.next_batch(8)] == rest
    with pytest.raises(ValueError, match="cursor 11"):
        resumed.load_state_dict({"epoch": 0, "cursor": 11})


def test_unshuffled_order_is_the_file_order_and_batches_may_exceed_the_file(data):
    source = JsonlPromptSource(data, input_key="text", shuffle=False)
    assert [r["label"] for r in source.next_batch(13)] == list(range(10)) + [0, 1, 2]


def test_bad_files_are_rejected_with_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prompt-data"):
        JsonlPromptSource(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="--prompt-data /dev/null is not a regular file"):
        JsonlPromptSource("/dev/null")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"caption": "b"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2 has no field 'prompt'.*--input-key"):
        JsonlPromptSource(bad)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="broken.jsonl:2 is not valid JSON"):
        JsonlPromptSource(tmp_path / "broken.jsonl")
    null = write_jsonl(tmp_path / "null.jsonl", [{"prompt": "a"}, {"prompt": None}])
    with pytest.raises(ValueError, match=r"null.jsonl:2: 'prompt' must be a string .*got null"):
        JsonlPromptSource(null)


def test_empty_prompts_are_valid_but_all_empty_is_warned(tmp_path, caplog):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}, {"prompt": ""}])
    with caplog.at_level("WARNING", logger="miles.rollout.data_source"):
        assert [source["prompt"] for source in JsonlPromptSource(mixed, shuffle=False).records] == ["a", ""]
    assert not caplog.records
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": ""}, {"prompt": " "}])
    with caplog.at_level("WARNING", logger="miles.rollout.data_source"):
        JsonlPromptSource(empty)
    assert "all 2 prompts are empty" in caplog.text


def test_images_load_from_lists_npy_and_png(tmp_path):
    from PIL import Image

    pixels = (np.arange(64).reshape(8, 8) * 4).astype(np.uint8)
    np.save(tmp_path / "img.npy", pixels)
    Image.fromarray(pixels).save(tmp_path / "img.png")
    for value in (pixels.tolist(), "img.npy", str(tmp_path / "img.png")):
        image = load_image(value, base_dir=tmp_path)
        assert image.dtype == torch.uint8 and torch.equal(image, torch.from_numpy(pixels))
    latent = load_image_latent(DigitsFamily(tmp_path), pixels.tolist())
    assert latent.shape == (1, 8, 8)
    torch.testing.assert_close(latent[0], torch.from_numpy(pixels).float() / 255 * 2 - 1)
    with pytest.raises(ValueError, match="0..255"):
        load_image([[0, 256]])
    with pytest.raises(ValueError, match="integers"):
        load_image([[0.5, 1.0]])
    with pytest.raises(FileNotFoundError, match="nope.npy"):
        load_image("nope.npy", base_dir=tmp_path)


def test_image_errors_name_the_record_and_a_wrong_size_is_rejected(tmp_path):
    family = DigitsFamily(tmp_path)
    where = "--train-only sample 3 (prompt 'a 3')"
    with pytest.raises(ValueError, match=r"^--train-only sample 3 \(prompt 'a 3'\): image values must be in 0\.\.255"):
        load_image_latent(family, [[0, 300]], where=where)
    with pytest.raises(FileNotFoundError, match=r"^--train-only sample 3 .*nope\.png"):
        load_image_latent(family, "nope.png", base_dir=tmp_path, where=where)
    big = [[0] * 16 for _ in range(16)]
    with pytest.raises(ValueError, match=r"latent of shape \(1, 16, 16\) but the model takes \(1, 8, 8\)"):
        load_image_latent(family, big, expected_shape=(1, 8, 8), where=where)
    assert load_image_latent(family, big).shape == (1, 16, 16)  # no expected shape: no check
    with pytest.raises(FileNotFoundError, match="is a directory; pass a JSONL file"):
        JsonlPromptSource(tmp_path)


def test_a_non_finite_stored_latent_is_refused_naming_the_sample_and_the_file(tmp_path):
    """Trained on, a latent with an inf only made the non-finite guard skip steps, and the run exited 0 without
    naming the record."""
    from safetensors.torch import save_file

    from miles.rollout.data_source import load_record_latent

    latent = torch.zeros(1, 8, 8)
    latent[0, 2, 3] = float("inf")
    save_file({"latent": latent}, str(tmp_path / "bad.safetensors"))
    np.save(tmp_path / "good.npy", np.zeros((1, 8, 8), dtype=np.float32))
    args = type("Args", (), {"latent_key": "latent", "image_key": "image"})()
    where = "real sample 5 (prompt 'a 5')"
    with pytest.raises(ValueError) as exc_info:
        load_record_latent(args, None, {"latent": "bad.safetensors"}, tmp_path, (1, 8, 8), where=where)
    assert str(exc_info.value) == (
        f"{where}: latent file {tmp_path / 'bad.safetensors'} holds 1 non-finite values (NaN/inf); re-encode the image"
    )
    assert load_record_latent(args, None, {"latent": "good.npy"}, tmp_path, (1, 8, 8)).abs().sum() == 0


def test_split_prompts_is_contiguous_equal_and_exact():
    assert split_prompts(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert split_prompts(4, 1) == [range(0, 4)]
    with pytest.raises(ValueError, match="6 prompts do not split evenly over 4 DP ranks"):
        split_prompts(6, 4)
    with pytest.raises(ValueError, match="cannot split prompts into 0 parts"):
        split_prompts(6, 0)


def test_make_prompt_shard_keeps_a_prompts_samples_together():
    records = [{"text": "digit 3", "label": 3}, {"text": "digit 5", "label": 5}]
    shard = make_prompt_shard(4, records, input_key="text", n_samples_per_prompt=3, first_prompt_index=2)
    assert shard.sample_indices == [6, 7, 8, 9, 10, 11]  # prompt p's j-th sample: p · 3 + j
    assert shard.prompts == ["digit 3"] * 3 + ["digit 5"] * 3
    assert shard.records == [records[0]] * 3 + [records[1]] * 3
    assert shard.rollout_id == 4 and len(shard) == 6 and shard.base_dir == "."


def test_latent_files_of_video_rank_load_and_a_family_without_a_codec_refuses_images(tmp_path):
    from safetensors.torch import save_file

    from tests.support.toy_video_family import ToyVideoFamily

    clip = torch.randn(4, 2, 8, 8, generator=make_generator("test_clip"))
    save_file({"latent": clip}, str(tmp_path / "clip.safetensors"))
    assert torch.equal(load_latent_file(tmp_path / "clip.safetensors"), clip)  # (C, F, H, W)
    save_file({"latent": clip[None]}, str(tmp_path / "batch.safetensors"))
    with pytest.raises(ValueError, match=r"holds shape \(1, 4, 2, 8, 8\); a latent is \(C, H, W\) or, for video"):
        load_latent_file(tmp_path / "batch.safetensors")
    with pytest.raises(
        ValueError, match="^record 3: an image record .* needs a model family that implements .*PixelCodec"
    ):
        load_image_latent(ToyVideoFamily(tmp_path), [[0, 255]], where="record 3")
