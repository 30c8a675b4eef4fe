"""The DMD2 end-to-end path of a model family on its tiny stock pipeline (``tests.support.tiny_pipelines``).

:func:`write_inputs` prepares what a user's recipe prepares: the pipeline at a 32 × 32 sample size, a prompt cache
(``python -m miles.rollout.prompt_cache``: no text encoder is loaded by the training ranks) and real latent records
from photos (``python -m miles.rollout.encode_images``: the GAN's real data). :func:`train_and_resume` runs the
family's recipe (``examples/<recipe>/run_dmd2.sh``: DMD2 phase 2 with its own LoRA roles, GAN head, EMA) for 2
rollouts on 2 CPU ranks with a checkpoint after each and the ``--save-hf`` export, then resumes from rollout 0's
commit and runs rollout 1 again. :func:`stock_latents` and :func:`miles_latents` sample the export with the
family's stock diffusers pipeline and with miles' sampler from the same noise.

Noise: the stock pipelines draw the initial latents from their ``generator`` (FLUX.1 as ``(B, C, H, W)``, Qwen-Image
as ``(B, 1, C, H, W)``: the same values), pack them 2×2, and ``FlowMatchLCMScheduler.step`` draws the re-noise from
torch's global RNG in the packed token shape (the pipelines do not pass their generator to it). The miles side is
handed the same tensors, unpacked.
"""

import json
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from miles.models import get_model_family
from miles.models.packed_dit import unpack_latents
from miles.models.sampling_schedule import stock_sampling_kwargs
from miles.models.stock_defaults import write_sample_size
from miles.utils.paths import LORA_EXPORT_DIR, LORA_EXPORT_WEIGHTS
from miles.utils.sampling import FlowNoiseSchedule, denoise
from miles.utils.tracking import read_metrics
from tests.support.driver import run_main

PROMPTS = ["a red square", "a blue circle", "two green dots", "a yellow line"]
SIZE = 32  # pixels: latents (4, 4, 4), a 2 × 2 token grid
LATENT = (len(PROMPTS), 4, SIZE // 8, SIZE // 8)
# Exactly reproduced on resume: every training figure but the timers.
EXACT_KEYS = [
    "train/loss",
    "train/grad_norm",
    "train/dmd2_grad_abs_mean",
    "train/dmd2_gan_grad_abs_mean",
    "train/critic-loss",
    "train/critic-grad_norm",
    "train/critic-gan_disc_loss",
    "train/critic-gan_logit_real",
    "train/critic-gan_logit_fake",
]


def write_photos(folder: Path) -> Path:
    """Four 32 × 32 crops of scikit-learn's two sample photos (real JPEGs), saved as png, with a caption each."""
    from sklearn.datasets import load_sample_images

    china, flower = load_sample_images().images  # (427, 640, 3) uint8 each
    folder.mkdir(parents=True)
    crops = [china[100:132, 200:232], china[300:332, 50:82], flower[50:82, 300:332], flower[200:232, 200:232]]
    for index, (crop, prompt) in enumerate(zip(crops, PROMPTS)):
        Image.fromarray(np.ascontiguousarray(crop)).save(folder / f"photo{index}.png")
        (folder / f"photo{index}.txt").write_text(prompt + "\n")
    return folder


def write_inputs(root: Path, write_pipeline, negative_prompt: str = "") -> dict:
    """The tiny pipeline (``write_pipeline(folder)``) at :data:`SIZE`, its prompt cache and its real latent records.

    Returns:
        ``{"pipeline", "prompts" (the cached records), "negative" (the cached negative cond), "real" (the latent
        records)}``, paths.
    """
    from miles.rollout.encode_images import main as encode_images
    from miles.rollout.prompt_cache import main as prompt_cache

    pipeline = write_pipeline(root / "pipeline")
    write_sample_size(pipeline, (SIZE, SIZE))
    source = root / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    cache = root / "cache"
    argv = [pipeline, source, cache, "--negative-prompt", negative_prompt, "--batch-size", "2"]
    assert prompt_cache([str(each) for each in argv]) == 0
    real = root / "real"
    assert encode_images([str(pipeline), str(write_photos(root / "photos")), str(real)]) == 0
    return {
        "pipeline": pipeline,
        "prompts": cache / "prompts.jsonl",
        "negative": cache / "negative.safetensors",
        "real": real / "data.jsonl",
    }


def train_and_resume(root: Path, inputs: dict, recipe: str) -> dict:
    """The recipe's phase-2 command (``tests.support.recipes.tiny_recipe_argv``: its own LoRA roles, GAN head, EMA,
    guidance, learning rates; 2 CPU ranks, 4 prompts, K = 2, 2 rollouts) with a checkpoint after each rollout and
    the ``--save-hf`` export, then a resume from rollout 0's commit.

    Returns:
        ``{"records", "resumed" (metrics.jsonl records of each run), "export", "save", "argv" (the full run's)}``.
    """
    from tests.support.recipes import tiny_recipe_argv

    save, export = root / "ckpt", root / "student"
    paths = {"pipeline": inputs["pipeline"], "prompts": inputs["prompts"], "negative": inputs["negative"],
             "real": inputs["real"], "save": save}  # fmt: skip
    argv = tiny_recipe_argv(recipe, out=root / "full", export=export, **paths)
    run_main(argv)
    (save / "latest").write_text("0\n")  # as if the run had died during rollout 1
    run_main([*tiny_recipe_argv(recipe, out=root / "resumed", export=None, **paths), "--load", str(save)])
    return {
        "records": read_metrics(root / "full"),
        "resumed": read_metrics(root / "resumed"),
        "export": export,
        "save": save,
        "argv": argv,
    }


def check_phase2_records(records: list[dict]) -> None:
    """The full run's figures: one student step and K = 2 critic steps per rollout; the student takes both the DMD
    and the GAN gradient; the trainer's forward of the student on the engine's x_i gives the engine's x̂0_i (same
    packing, cond and guidance input); a fresh GAN head's loss near 2·ln 2; every figure finite."""
    actor = [r for r in records if "train/loss" in r]
    critic = [r for r in records if "train/critic-loss" in r]
    assert [r["rollout_id"] for r in actor] == [0, 1] and [r["rollout_id"] for r in critic] == [0, 0, 1, 1]
    for record in actor:
        assert record["train/dmd2_grad_abs_mean"] > 0 and record["train/dmd2_gan_grad_abs_mean"] > 0
        assert record["train/x0_max_abs_diff"] < 1e-4
    for record in critic:
        assert 0.5 < record["train/critic-gan_disc_loss"] < 3.0
    assert all(math.isfinite(value) for r in actor + critic for key, value in r.items() if key.startswith("train/"))


def check_lora_export(transformer_class, export: Path, pipeline: Path) -> None:
    """A LoRA student's ``--save-hf`` export (the recipes' ``--lora-rank``, ``--save-hf-lora``): its transformer holds
    the merged weights, changed by training in an adapted layer (the first block's ``attn.to_q``) and equal to the
    pipeline's in a layer no adapter targets (the final ``proj_out``); ``lora/`` holds the adapter alone, with
    nonzero ``lora_B`` matrices (peft starts them at zero, so training moved them) except on the layers whose output
    the model drops (``ModelFamily.unused_parameters``: frozen, so a resume finds an optimizer state for every
    trained adapter)."""
    from safetensors.torch import load_file

    exported = transformer_class.from_pretrained(export / "transformer").state_dict()
    initial = transformer_class.from_pretrained(pipeline / "transformer").state_dict()
    adapted = next(key for key in initial if key.endswith("attn.to_q.weight"))
    assert not torch.equal(exported[adapted], initial[adapted])
    assert torch.equal(exported["proj_out.weight"], initial["proj_out.weight"])
    adapter = load_file(export / LORA_EXPORT_DIR / LORA_EXPORT_WEIGHTS)
    family = get_model_family(pipeline)
    unused = {name.rsplit(".", 1)[0] for name in family.unused_parameters(family.load_denoiser(pipeline))}
    b_matrices = {key.removeprefix("transformer.").removesuffix(".lora_B.weight"): value
                  for key, value in adapter.items() if "lora_B" in key}  # fmt: skip
    # The adapters of layers whose output the model drops stay frozen at zero (ModelFamily.unused_parameters); a last
    # block's text queries (Qwen-Image's add_q_proj) only reach the dropped text rows: a zero gradient, also zero.
    zero = {module for module, value in b_matrices.items() if value.abs().max() == 0}
    assert b_matrices and {module for module in b_matrices if module in unused} <= zero
    assert len(zero) < len(b_matrices) / 4, sorted(zero)


def figures(records: list[dict], rollout_id: int) -> dict[str, list[float]]:
    """``{key: [value per record]}`` of :data:`EXACT_KEYS` in rollout ``rollout_id``, in file order."""
    found: dict[str, list[float]] = {}
    for record in records:
        if record.get("rollout_id") == rollout_id:
            for key in EXACT_KEYS:
                if key in record:
                    found.setdefault(key, []).append(record[key])
    return found


def stock_latents(pipeline_class, export: Path, init_seed: int, renoise_seed: int, **kwargs) -> torch.Tensor:
    """The export sampled by its stock pipeline with :func:`stock_sampling_kwargs`, unpacked to ``(B, C, h, w)``."""
    pipe = pipeline_class.from_pretrained(export)
    pipe.set_progress_bar_config(disable=True)
    call = {**stock_sampling_kwargs(export), **kwargs}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(renoise_seed)  # FlowMatchLCMScheduler's re-noise comes from the global RNG
        tokens = pipe(PROMPTS, generator=torch.Generator().manual_seed(init_seed), output_type="latent", **call).images
    return unpack_latents(tokens, LATENT[2], LATENT[3])


def miles_latents(
    export: Path, init_seed: int, renoise_seed: int, schedule: FlowNoiseSchedule, step_rule: str = "dmd2"
) -> torch.Tensor:
    """miles' sampler on the export from the noise the stock pipeline draws (module docstring)."""
    family = get_model_family(export)
    cond = family.encode_prompts(family.load_text_encoder(export), PROMPTS)
    noise = torch.randn(LATENT, generator=torch.Generator().manual_seed(init_seed))
    renoise = torch.Generator().manual_seed(renoise_seed)
    packed = (LATENT[0], LATENT[2] * LATENT[3] // 4, LATENT[1] * 4)
    draws = [
        unpack_latents(torch.randn(packed, generator=renoise), LATENT[2], LATENT[3]) for _ in range(schedule.num_steps)
    ]
    result = denoise(
        family,
        family.load_denoiser(export),
        noise,
        cond,
        schedule,
        step_rule=step_rule,
        fresh_noise=lambda k: draws[k],
        record=False,
    )
    return result.final
