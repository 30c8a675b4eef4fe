"""The ``qwen_image_edit`` family on a tiny offline ``QwenImageEditPipeline`` (``tests.support.tiny_pipelines``;
saved without a processor, so prompts are encoded text only: the tiny pipeline module says why) at 32 × 32.

The reference latents are the stock pipeline's ``prepare_latents`` image latents, the velocity is the stock
transformer call of ``QwenImageEditPipeline.__call__`` (the reference's tokens after the target's, both shapes in
``img_shapes``, the target's tokens of the output), and the guided velocity's unconditional branch sees the same
reference.
"""

import json

import numpy as np
import pytest
import torch

from miles.models import ImageConditioned, get_model_family, supports
from miles.models.packed_dit import pack_latents, unpack_latents
from miles.models.qwen_image_edit import CONDITION_KEY, QwenImageEditFamily, reference_size
from miles.models.stock_defaults import write_sample_size
from miles.utils.misc import make_generator
from tests.support.tiny_pipelines import write_tiny_qwen_image_edit

SIZE = 32
PROMPTS = ["make it red", "add a hat"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    path = write_tiny_qwen_image_edit(tmp_path_factory.mktemp("qwen_image_edit") / "pipeline")
    write_sample_size(path, (SIZE, SIZE))
    return path


@pytest.fixture(scope="module")
def stock(pipeline):
    from diffusers import QwenImageEditPipeline

    pipe = QwenImageEditPipeline.from_pretrained(pipeline, processor=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _references(count: int, height: int = 24, width: int = 36) -> list[torch.Tensor]:
    """uint8 (H, W, 3) references of a 3:2 aspect ratio (the stock pipeline resizes them to 1248 × 832); reference
    i is the same whatever ``count``."""
    return [
        torch.randint(
            0, 256, (height, width, 3), generator=make_generator("test_qwen_image_edit", i), dtype=torch.uint8
        )
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def encoded(pipeline):
    """The family, its prompt encoder and the cond of :data:`PROMPTS` with ``_references(2)``: encoded once, since
    each megapixel reference costs a VAE encode."""
    family = get_model_family(pipeline)
    encoder = family.load_text_encoder(pipeline)
    return family, encoder, family.encode_conditioned(encoder, PROMPTS, _references(2))


def test_the_family_reads_the_edit_pipeline_and_declares_its_reference(pipeline):
    family = get_model_family(pipeline)
    assert isinstance(family, QwenImageEditFamily) and family.name == "qwen_image_edit"
    assert supports(family, ImageConditioned) and family.latent_shape(pipeline) == (4, 4, 4)
    # diffusers' calculate_dimensions(1024²): about a megapixel, multiples of 32, the aspect ratio kept
    assert reference_size(36, 24) == (1248, 832) and reference_size(32, 32) == (1024, 1024)


def test_the_memory_plan_counts_the_reference_tokens(pipeline):
    family = get_model_family(pipeline)
    # 2 × 2 target tokens and a megapixel square reference's 64 × 64, 2048 text rows
    assert family.tokens_per_sample(pipeline) == (4 + 4096, 2048)
    flops, parameters = family.flops_per_sample(pipeline)
    assert flops > 0 and parameters == sum(p.numel() for p in family.load_denoiser(pipeline).parameters())


def test_reference_latents_are_the_stock_pipelines_image_latents(pipeline, stock):
    from PIL import Image

    family = get_model_family(pipeline)
    [reference] = _references(1)
    ours = family.reference_latents([reference])
    assert ours.shape == (1, 4, 104, 156)  # 832 / 8, 1248 / 8
    # QwenImageEditPipeline.__call__ step 3 and prepare_latents: resize, preprocess, VAE mode, normalise, pack
    pil = Image.fromarray(reference.numpy())
    image = stock.image_processor.resize(pil, 832, 1248)
    pixels = stock.image_processor.preprocess(image, 832, 1248).unsqueeze(2)
    _, image_latents = stock.prepare_latents(pixels, 1, 4, SIZE, SIZE, torch.float32, "cpu", None, None)
    torch.testing.assert_close(pack_latents(ours), image_latents, rtol=0, atol=1e-5)


def test_the_velocity_is_the_stock_edit_transformer_call(pipeline, stock, encoded):
    family, encoder, cond = encoded
    assert set(cond) == {"encoder_hidden_states", "encoder_hidden_states_mask", CONDITION_KEY}
    assert cond[CONDITION_KEY].shape == (2, 4, 104, 156)
    latents = torch.randn(2, 4, 4, 4, generator=make_generator("test_qwen_image_edit", "latents"))
    timestep = torch.tensor([750.0, 250.0])
    denoiser = family.load_denoiser(pipeline)
    with torch.no_grad():
        ours = family.predict_velocity(denoiser, latents, timestep, cond)

        # the stock call: text as the pipeline's encode_prompt gives it (no processor: QwenImagePipeline's text
        # encoding, the batch's own padding), the target's packed tokens, then the reference's
        states, mask = family.prompt_cond(encoder, PROMPTS).values()
        length = int(mask.sum(dim=1).max())
        out = stock.transformer(
            hidden_states=torch.cat([pack_latents(latents), pack_latents(cond[CONDITION_KEY])], dim=1),
            timestep=timestep / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask[:, :length] if not mask[:, :length].all() else None,
            encoder_hidden_states=states[:, :length],
            img_shapes=[[(1, 2, 2), (1, 52, 78)]] * 2,
            return_dict=False,
        )[0]
    stock_v = unpack_latents(out[:, :4], 4, 4)
    torch.testing.assert_close(ours, stock_v, rtol=0, atol=1e-5)
    # the reference matters: another reference changes the velocity
    other = dict(cond, **{CONDITION_KEY: torch.zeros_like(cond[CONDITION_KEY])})
    with torch.no_grad():
        assert not torch.allclose(family.predict_velocity(denoiser, latents, timestep, other), ours, atol=1e-4)


def _processor_without_video(tokenizer):
    """A ``Qwen2VLProcessor`` with its image half only (Pillow's ``Qwen2VLImageProcessorPil``): the stand-in for the
    real checkpoint's processor, whose ``Qwen2VLVideoProcessor`` needs torchvision, which this machine lacks. The
    processor's ``__init__`` insists on the video half, so the object is assembled from its parts."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.image_processor = Qwen2VLImageProcessorPil()
    processor.tokenizer = tokenizer
    processor.video_processor = None
    processor.chat_template = None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return processor


def test_with_a_processor_the_prompt_is_encoded_with_the_references_vision_tokens(pipeline, stock):
    from PIL import Image

    family = get_model_family(pipeline)
    encoder = family.load_text_encoder(pipeline)
    encoder.pipe.processor = _processor_without_video(encoder.pipe.tokenizer)
    [reference] = _references(1)
    cond = family.encode_conditioned(encoder, PROMPTS[:1], [reference])
    # the stock call's encode_prompt(image=prompt_image): the reference resized to the megapixel size (1248 × 832)
    stock.processor = _processor_without_video(stock.tokenizer)
    image = stock.image_processor.resize(Image.fromarray(reference.numpy()), 832, 1248)
    states, mask = stock.encode_prompt(PROMPTS[:1], image=image, device="cpu")
    length = states.shape[1]
    assert mask is None and 1000 < length <= family.max_sequence_length  # ~1,300 vision tokens joined the prompt
    torch.testing.assert_close(cond["encoder_hidden_states"][:, :length], states.float(), rtol=0, atol=1e-5)
    assert (
        cond["encoder_hidden_states_mask"][0].sum() == length and cond["encoder_hidden_states"][0, length:].eq(0).all()
    )


def test_the_unconditional_branch_sees_the_samples_reference(pipeline, encoded):
    family, encoder, cond = encoded
    negative = family.encode_prompts(encoder, [" ", " "])
    assert CONDITION_KEY not in negative
    denoiser = family.load_denoiser(pipeline)
    latents = torch.randn(2, 4, 4, 4, generator=make_generator("test_qwen_image_edit", "cfg"))
    timestep = torch.tensor([500.0, 500.0])

    def predict(x, t, c):
        return family.predict_velocity(denoiser, x, t, c)

    with torch.no_grad():
        guided = family.guided_velocity(predict, latents, timestep, cond, negative, 3.0, norm_rescale=False)
        v_cond = predict(latents, timestep, cond)
        v_uncond = predict(latents, timestep, {**negative, CONDITION_KEY: cond[CONDITION_KEY]})
    torch.testing.assert_close(guided, v_uncond + 3.0 * (v_cond - v_uncond), rtol=0, atol=1e-5)


def _stock_edit_sample(pipe, cond, references, steps: int, call: dict) -> torch.Tensor:
    """The stock edit pipeline's latents from generator seed 7 and re-noise seed 11, its prompt states the family's
    (the tiny pipelines have no processor), unpacked to ``(B, 4, 4, 4)``. Edit takes one reference per prompt;
    Edit-Plus one prompt whose references are the list (here one)."""
    from PIL import Image

    length = int(cond["encoder_hidden_states_mask"].sum(1).max())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)  # FlowMatchLCMScheduler's re-noise comes from the global RNG
        tokens = pipe(
            image=[Image.fromarray(reference.numpy()) for reference in references],
            prompt_embeds=cond["encoder_hidden_states"][:, :length],
            prompt_embeds_mask=cond["encoder_hidden_states_mask"][:, :length],
            generator=torch.Generator().manual_seed(7),
            output_type="latent",
            num_inference_steps=steps,
            **call,
        ).images
    return unpack_latents(tokens, 4, 4)


def _miles_sample(family, path, cond, schedule, steps: int, step_rule: str = "dmd2") -> torch.Tensor:
    """miles' sampler from the noise :func:`_stock_edit_sample` draws (``"dmd2"``: the re-noise too)."""
    from miles.utils.sampling import denoise

    batch = len(cond[CONDITION_KEY])
    noise = torch.randn(batch, 4, 4, 4, generator=torch.Generator().manual_seed(7))
    renoise = torch.Generator().manual_seed(11)
    draws = [unpack_latents(torch.randn(batch, 4, 16, generator=renoise), 4, 4) for _ in range(steps)]
    denoiser = family.load_denoiser(path)
    fresh = (lambda k: draws[k]) if step_rule == "dmd2" else None
    return denoise(family, denoiser, noise, cond, schedule, step_rule=step_rule, fresh_noise=fresh, record=False).final


def test_edit_plus_with_one_reference_samples_as_its_stock_pipeline(tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline

    from miles.utils.sampling import FlowNoiseSchedule

    path = write_tiny_qwen_image_edit(tmp_path / "plus", plus=True)
    write_sample_size(path, (SIZE, SIZE))
    family = get_model_family(path)
    assert isinstance(family, QwenImageEditFamily) and family.pipeline_class(path) == "QwenImageEditPlusPipeline"
    references = _references(1)  # the Plus pipeline samples one prompt at a time; its image list is that prompt's
    cond = family.encode_conditioned(family.load_text_encoder(path), PROMPTS[:1], references)
    pipe = QwenImageEditPlusPipeline.from_pretrained(path, processor=None)
    pipe.set_progress_bar_config(disable=True)
    # the stock Euler scheduler at the family's static shift: miles' Euler grid (sigmas=linspace(1, 1/S, S))
    shift = family.flow_shift(path)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift, use_dynamic_shifting=False)
    stock = _stock_edit_sample(pipe, cond, references, 2, {"height": SIZE, "width": SIZE, "true_cfg_scale": 1.0})
    ours = _miles_sample(family, path, cond, FlowNoiseSchedule(2, shift), 2, step_rule="euler")
    assert torch.isfinite(stock).all()
    torch.testing.assert_close(stock, ours, rtol=0, atol=1e-5)


def test_a_record_without_a_reference_is_one_line_naming_the_flag(pipeline, encoded):
    from miles.config import DataSpec, EngineSpec
    from miles.rollout.conditioning import PromptConditioner

    family = get_model_family(pipeline)
    spec = EngineSpec(family=type(family), pipeline=str(pipeline), converter=None, data=DataSpec(prompt_data=None))
    conditioner = PromptConditioner(spec, family, pipeline)
    with pytest.raises(ValueError, match="record has none under --condition-image-key 'condition_image'"):
        conditioner.cond(["make it red"], [{"prompt": "make it red"}])
    image = _references(1)[0].numpy()
    cond = conditioner.cond([PROMPTS[0]], [{"prompt": PROMPTS[0], "condition_image": image.tolist()}])
    expected = encoded[2]  # PROMPTS[0] with the same reference, in a batch of two
    assert set(cond) == set(expected) and np.asarray(image).dtype == np.uint8
    for key in cond:
        torch.testing.assert_close(cond[key][0], expected[key][0], rtol=0, atol=1e-5)
    assert json.loads((pipeline / "model_index.json").read_text())["processor"] == [None, None]


# ---- a prompt cache with the references, DMD2 on 2 ranks, the export in the stock edit pipeline ----


def _write_edit_records(root) -> list[torch.Tensor]:
    """Two records whose references are png files beside the JSONL (paths relative to it)."""
    from PIL import Image

    references = _references(2)
    lines = []
    for index, (prompt, reference) in enumerate(zip(PROMPTS, references)):
        Image.fromarray(reference.numpy()).save(root / f"ref{index}.png")
        lines.append(json.dumps({"prompt": prompt, "condition_image": f"ref{index}.png"}) + "\n")
    (root / "edits.jsonl").write_text("".join(lines))
    return references


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_cluster):
    from miles.rollout import prompt_cache
    from miles.utils.tracking import read_metrics
    from tests.support.driver import run_main

    root = tmp_path_factory.mktemp("qwen_image_edit_dmd2")
    pipeline = write_tiny_qwen_image_edit(root / "pipeline")
    write_sample_size(pipeline, (SIZE, SIZE))
    references = _write_edit_records(root)
    argv = [pipeline, root / "edits.jsonl", root / "cache", "--negative-prompt", " "]
    assert prompt_cache.main([str(each) for each in argv]) == 0
    run_main([
        "--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
        "--prompt-data", str(root / "cache" / "prompts.jsonl"),
        "--negative-cond", str(root / "cache" / "negative.safetensors"),
        "--actor-num-gpus-per-node", "2", "--num-cpus-per-rank", "1", "--rollout-batch-size", "2",
        "--micro-batch-size", "1", "--dmd2-critic-steps-per-rollout", "1", "--dmd2-teacher-guidance-scale", "2",
        "--num-rollout", "2", "--lr", "1e-3", "--critic-lr", "1e-3", "--output-dir", str(root / "run"),
        "--save-hf", str(root / "student"),
    ])  # fmt: skip
    return {
        "root": root,
        "pipeline": pipeline,
        "references": references,
        "records": read_metrics(root / "run"),
        "export": root / "student",
    }


def test_the_prompt_cache_holds_each_prompt_with_its_reference(trained, encoded):
    from miles.rollout.conditioning import load_cond_file

    records = [json.loads(line) for line in (trained["root"] / "cache" / "prompts.jsonl").read_text().splitlines()]
    expected = encoded[2]  # the same pipeline weights (seed 0), prompts and references, encoded in one batch
    assert len({record["cond"] for record in records}) == 2
    for row, record in enumerate(records):
        cached = load_cond_file(trained["root"] / "cache" / record["cond"])
        assert set(cached) == set(expected)
        for key in cached:
            torch.testing.assert_close(cached[key], expected[key][row], rtol=0, atol=1e-5)
    negative = load_cond_file(trained["root"] / "cache" / "negative.safetensors")
    assert CONDITION_KEY not in negative  # the unconditional branch takes each sample's reference


def test_dmd2_trains_the_edit_student_on_two_ranks(trained):
    import math

    actor = [r for r in trained["records"] if "train/loss" in r]
    critic = [r for r in trained["records"] if "train/critic-loss" in r]
    assert [r["rollout_id"] for r in actor] == [0, 1] and [r["rollout_id"] for r in critic] == [0, 1]
    assert all(r["train/dmd2_grad_abs_mean"] > 0 for r in actor)
    # the trainer's forward of the student (with the cached reference) gives the engine's x̂0_i
    assert all(r["train/x0_max_abs_diff"] < 1e-4 for r in actor)
    assert all(math.isfinite(v) for r in actor + critic for k, v in r.items() if k.startswith("train/"))


def test_the_stock_edit_pipeline_samples_the_export_as_miles_does(trained, encoded):
    from diffusers import QwenImageEditPipeline

    from miles.models.sampling_schedule import stock_sampling_kwargs
    from miles.utils.sampling import FlowNoiseSchedule

    export = trained["export"]
    assert json.loads((export / "model_index.json").read_text())["_class_name"] == "QwenImageEditPipeline"
    family = get_model_family(export)
    assert isinstance(family, QwenImageEditFamily)
    cond = encoded[2]  # the export keeps the pipeline's text encoder and VAE
    pipe = QwenImageEditPipeline.from_pretrained(export, processor=None)
    pipe.set_progress_bar_config(disable=True)
    call = stock_sampling_kwargs(export)
    assert call == {"num_inference_steps": 4, "true_cfg_scale": 1.0, "height": SIZE, "width": SIZE}
    steps = call.pop("num_inference_steps")
    stock = _stock_edit_sample(pipe, cond, trained["references"], steps, call)
    ours = _miles_sample(family, export, cond, FlowNoiseSchedule(steps, family.flow_shift(export)), steps)
    assert torch.isfinite(stock).all()
    torch.testing.assert_close(stock, ours, rtol=0, atol=1e-5)
