"""DigitsPipeline: loading an init'ed / exported directory, the student schedule in the scheduler config, sampling."""

import json

import numpy as np
import pytest
import torch

from miles.driver.arguments import parse_args
from miles.models.digits import init_digits_pipeline
from miles.models.digits_pipeline import (
    SCHEDULE_KEYS,
    TEACHER_NUM_STEPS,
    DigitsPipeline,
    read_sampling_schedule,
    write_sampling_schedule,
)
from tests.support.rollout import make_engine, prompt_shard

TINY = {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8}
PROMPTS = ["a handwritten digit seven", "a handwritten digit one", "a handwritten digit seven"]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return init_digits_pipeline(tmp_path_factory.mktemp("teacher"), seed=0, **TINY)


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    # an "export": a copy of the pipeline with its own weights, then the student's schedule
    path = init_digits_pipeline(tmp_path_factory.mktemp("student"), seed=1, **TINY)
    write_sampling_schedule(path, num_steps=4, shift=3.0, step_rule="dmd2", distilled_guidance_scale=3.0)
    return path


@pytest.fixture(scope="module")
def student(student_dir):
    return DigitsPipeline.from_pretrained(student_dir)


def reference(pipeline_dir, prompts, *, num_steps, shift, guidance_scale, step_rule, seed, timesteps=None):
    """The rollout engine's evaluation sampler (``RolloutEngine.sample``) on the pipeline's weights, with the same
    schedule and the evaluation seeds the pipeline uses."""
    argv = ["--hf-checkpoint", str(pipeline_dir), "--prompt-data", "unused.jsonl", "--num-rollout", "1"]
    argv += [
        "--rollout-batch-size",
        "1",
        "--diffusion-num-steps",
        str(num_steps),
        "--diffusion-flow-shift",
        str(shift),
    ]
    argv += ["--diffusion-step-rule", step_rule, "--rollout-seed", str(seed)]
    if timesteps is not None:
        argv += ["--diffusion-timesteps", ",".join(str(t) for t in timesteps)]
    engine = make_engine(parse_args(argv), pipeline_dir)
    latents = engine.sample(prompt_shard("eval", prompts), guidance_scale=guidance_scale)
    return engine.family.latents_to_images(latents).numpy()


def test_schedule_is_written_into_the_scheduler_config_and_survives_diffusers(student_dir, student, tmp_path):
    raw = json.loads((student_dir / "scheduler" / "scheduler_config.json").read_text())
    assert raw["shift"] == 3.0
    assert raw["_miles_num_inference_steps"] == 4 and raw["_miles_step_rule"] == "dmd2"
    assert raw["_miles_timesteps"] is None and raw["_miles_distilled_guidance_scale"] == 3.0
    assert raw["_class_name"] == "FlowMatchEulerDiscreteScheduler"  # diffusers' own keys untouched
    # diffusers keeps "_"-prefixed keys on load, so the defaults come from the loaded scheduler
    assert {key: student.scheduler.config[key] for key in SCHEDULE_KEYS.values()} == {
        key: raw[key] for key in SCHEDULE_KEYS.values()
    }
    defaults = student.sampling_defaults
    assert defaults == read_sampling_schedule(raw)
    assert (defaults["num_inference_steps"], defaults["step_rule"], defaults["shift"]) == (4, "dmd2", 3.0)
    assert defaults["guidance_scale"] == 1.0 and defaults["is_student"]
    assert student.resolve_schedule()["sigmas"] == [1.0, 0.9, 0.75, 0.5, 0.0]
    # save_pretrained keeps the schedule and the text-encoder settings
    student.save_pretrained(tmp_path / "copy")
    again = DigitsPipeline.from_pretrained(tmp_path / "copy")
    assert again.sampling_defaults == defaults
    assert (tmp_path / "copy" / "digits.json").read_text() == (student_dir / "digits.json").read_text()


def test_student_draws_with_its_exported_schedule(student_dir, student):
    images = student(PROMPTS, seed=5).images
    assert images.shape == (3, 8, 8, 1) and images.dtype == np.uint8
    expected = reference(student_dir, PROMPTS, num_steps=4, shift=3.0, guidance_scale=1.0, step_rule="dmd2", seed=5)
    np.testing.assert_array_equal(images, expected)
    np.testing.assert_array_equal(student(PROMPTS, seed=5).images, images)  # deterministic for a seed
    assert not np.array_equal(student(PROMPTS, seed=6).images, images)
    # diffusers' call shape: a generator seeded with 5 draws what seed=5 draws, and return_dict=False a tuple
    generator = torch.Generator().manual_seed(5)
    (drawn,) = student(PROMPTS, generator=generator, return_dict=False)
    np.testing.assert_array_equal(drawn, images)
    # a sample depends on its seed and index, not on the batch it is drawn in (up to float rounding of a pixel)
    alone = student(PROMPTS[2], seed=5, sample_indices=[2]).images
    assert np.abs(alone.astype(int) - images[2:].astype(int)).max() <= 1
    # overrides: 1 step of the same rule, CFG with the negative prompt
    one_step = reference(student_dir, PROMPTS, num_steps=1, shift=3.0, guidance_scale=2.0, step_rule="dmd2", seed=5)
    np.testing.assert_array_equal(student(PROMPTS, num_inference_steps=1, guidance_scale=2.0, seed=5).images, one_step)


def test_diffusers_generic_loader_opens_the_directory_as_a_digits_pipeline(student_dir, student, tmp_path):
    from diffusers import DiffusionPipeline

    # diffusers runs a custom pipeline's module file only when asked to
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        DiffusionPipeline.from_pretrained(student_dir)
    pipe = DiffusionPipeline.from_pretrained(student_dir, trust_remote_code=True)
    assert type(pipe) is DigitsPipeline and pipe.sampling_defaults == student.sampling_defaults
    images = pipe(PROMPTS, generator=torch.Generator().manual_seed(5)).images
    np.testing.assert_array_equal(images, student(PROMPTS, seed=5).images)
    # what save_pretrained writes opens the same way (the export and the recipe's stages go through it)
    pipe.save_pretrained(tmp_path / "copy")
    assert json.loads((tmp_path / "copy" / "model_index.json").read_text())["_class_name"] == [
        "pipeline_digits",
        "DigitsPipeline",
    ]
    assert type(DiffusionPipeline.from_pretrained(tmp_path / "copy", trust_remote_code=True)) is DigitsPipeline


def test_teacher_defaults_to_28_euler_steps(teacher_dir):
    teacher = DigitsPipeline.from_pretrained(teacher_dir)
    assert teacher.sampling_defaults["num_inference_steps"] == TEACHER_NUM_STEPS == 28
    assert teacher.sampling_defaults["step_rule"] == "euler" and not teacher.sampling_defaults["is_student"]
    prompts = PROMPTS[:2]
    expected = reference(teacher_dir, prompts, num_steps=28, shift=3.0, guidance_scale=3.0, step_rule="euler", seed=0)
    np.testing.assert_array_equal(teacher(prompts, guidance_scale=3.0).images, expected)
    pil = teacher(prompts[0], num_inference_steps=2, output_type="pil").images
    assert len(pil) == 1 and pil[0].mode == "L" and pil[0].size == (8, 8)
    np.testing.assert_array_equal(np.asarray(pil[0]), teacher(prompts[0], num_inference_steps=2).images[0, ..., 0])


def test_explicit_timesteps_are_the_default_grid_until_overridden(tmp_path):
    path = init_digits_pipeline(tmp_path / "p", seed=0, **TINY)
    write_sampling_schedule(path, num_steps=2, shift=3.0, step_rule="dmd2", timesteps=[1000.0, 500.0])
    pipe = DigitsPipeline.from_pretrained(path)
    assert pipe.resolve_schedule()["sigmas"] == [1.0, 0.5, 0.0]
    assert pipe.resolve_schedule(num_inference_steps=2)["sigmas"] == [1.0, 0.5, 0.0]
    # another step count or shift builds the grid from the shift: s = 1, 1/2 → σ = 1, 0.75
    assert pipe.resolve_schedule(num_inference_steps=2, shift=3.0)["sigmas"] == [1.0, 0.75, 0.0]
    assert pipe.resolve_schedule(num_inference_steps=1)["sigmas"] == [1.0, 0.0]
    expected = reference(
        path, PROMPTS, num_steps=2, shift=3.0, guidance_scale=1.0, step_rule="dmd2", seed=0, timesteps=[1000, 500]
    )
    np.testing.assert_array_equal(pipe(PROMPTS).images, expected)


def test_bad_schedules_and_calls_are_rejected(tmp_path, student):
    path = init_digits_pipeline(tmp_path / "p", seed=0, **TINY)
    with pytest.raises(ValueError, match="step rule 'ddim' is unknown"):
        write_sampling_schedule(path, num_steps=4, shift=3.0, step_rule="ddim")
    with pytest.raises(ValueError, match="got 2 explicit timesteps for num_steps=4"):
        write_sampling_schedule(path, num_steps=4, shift=3.0, step_rule="dmd2", timesteps=[900.0, 100.0])
    with pytest.raises(ValueError, match="strictly descending"):
        write_sampling_schedule(path, num_steps=2, shift=3.0, step_rule="dmd2", timesteps=[100.0, 900.0])
    with pytest.raises(FileNotFoundError, match="scheduler config not found"):
        write_sampling_schedule(tmp_path / "missing", num_steps=4, shift=3.0, step_rule="dmd2")
    # nothing was written by the rejected calls
    assert "_miles_num_inference_steps" not in json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    with pytest.raises(ValueError, match="at least one prompt"):
        student([])
    with pytest.raises(ValueError, match="output_type 'pt' is unknown"):
        student("a handwritten digit one", output_type="pt")
    with pytest.raises(ValueError, match="pass generator or seed, not both"):
        student("a handwritten digit one", generator=torch.Generator().manual_seed(1), seed=1)


def test_pipeline_moves_with_the_transformer(student):
    assert student.device == torch.device("cpu") and student.dtype == torch.float32
    assert not student.transformer.training
