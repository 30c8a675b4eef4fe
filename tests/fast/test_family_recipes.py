"""The GPU recipes of the model families (``examples/<model>/run_dmd2.sh``) pass their dry run on this CPU machine.

Each recipe runs on the family's tiny offline stock pipeline (``tests.support.tiny_pipelines``) in place of the real,
often gated, checkpoint, at a small sample size. Qwen-Image's runs the recipe's own ``prepare`` step (the sample size,
the prompt cache, the real images' latents with their cached conds: the shared code of
``examples/common/dmd2_phase2.sh``); the others get the same data layout written in-process, which is cheaper. Then
``DRY_RUN=1`` checks every input of the phase-2 command without Ray and prints the groups, the schedule and the
memory plan. Nothing here can show that a recipe trains well on a GPU: that needs the GPU.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miles.models import get_model_family
from miles.models.stock_defaults import write_sample_size
from tests.support.family_e2e import PROMPTS, SIZE, write_photos
from tests.support.ray import REPO


def _env(**extra: str) -> dict[str, str]:
    # The recipes call plain `python`: this interpreter's bin directory goes first so that they run the venv's.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1", "DEVICE": "cpu", **extra}


def _script(recipe: str) -> str:
    return str(REPO / "examples" / recipe / "run_dmd2.sh")


def _prepare_in_process(pipeline: Path, prompts: Path, data: Path, negative_prompt: str) -> None:
    """What the recipes' ``prepare`` writes, by the same two commands called in this process."""
    from miles.rollout.encode_images import main as encode_images
    from miles.rollout.prompt_cache import main as prompt_cache

    cache = ["--negative-prompt", negative_prompt, "--batch-size", "2"]
    assert prompt_cache([str(pipeline), str(prompts), str(data / "prompts"), *cache]) == 0
    assert encode_images([str(pipeline), str(write_photos(data.parent / "photos")), str(data / "real")]) == 0
    assert prompt_cache([str(pipeline), str(data / "real" / "data.jsonl"), str(data / "real"), *cache]) == 0


def _write_video_records(pipeline: Path, folder: Path) -> Path:
    """Real clips as the latent records the Wan recipe takes from its user (``REAL``)."""
    import torch

    from miles.rollout.offline_files import save_tensors

    family = get_model_family(pipeline)
    frames, height, width = 5, SIZE, SIZE
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(1)
    clips = torch.randint(0, 256, (2, frames, height, width, 3), generator=generator, dtype=torch.uint8)
    lines = []
    for index, latent in enumerate(family.images_to_latents(clips)):
        save_tensors(folder / f"clip{index}.safetensors", {"latent": latent})
        lines.append(json.dumps({"prompt": PROMPTS[index], "latent": f"clip{index}.safetensors"}) + "\n")
    (folder / "data.jsonl").write_text("".join(lines))
    return folder / "data.jsonl"


def _dry_run(recipe: str, env: dict) -> str:
    proc = subprocess.run(["bash", _script(recipe)], env={**env, "DRY_RUN": "1"}, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


def _common_lines(log: str, pipeline: Path, out: Path) -> None:
    # 8 ranks of one node; the critic group (K steps, the GAN head) first; the schedule of a 3000-rollout run.
    assert "placement: 8 bundles of" in log, log
    rows = [line.split("plan: ", 1)[-1] for line in log.splitlines()]
    critic = next(i for i, row in enumerate(rows) if row.startswith(f"  critic  {pipeline}"))
    actor = next(i for i, row in enumerate(rows) if row.startswith(f"  actor   {pipeline}"))
    assert critic < actor
    assert "--custom-build-modules-path" in log and "build_discriminator" in log
    assert "schedule: rollouts 0..2999" in log and f"export {out / 'student'}" in log
    assert not out.exists() or not (out / "run").exists()  # a dry run writes no run directory


def _planned_lora_roles(log: str) -> bool:
    """Whether the dry run plans a rank-32 critic adapter (the critic group's override) and a student adapter on a
    frozen base (the actor row of the memory plan holds frozen parameters)."""
    critic_adapter = re.search(r"--lora-rank\s+32\b", log) is not None
    actor_row = next(line.split("memory_plan: ", 1)[1].split() for line in log.splitlines()
                     if re.search(r"memory_plan:\s+actor\s", line))  # fmt: skip
    return critic_adapter and actor_row[2] != "0"


def test_the_qwen_image_recipe_prepares_its_data_and_plans_lora_roles(tmp_path):
    from tests.support.tiny_pipelines import write_tiny_qwen_image

    pipeline = write_tiny_qwen_image(tmp_path / "pipeline")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    data, out = tmp_path / "out" / "data", tmp_path / "out"
    env = _env(MODEL_DIR=str(pipeline), PROMPTS=str(prompts), IMAGES=str(write_photos(tmp_path / "photos")),
               DATA=str(data), OUT=str(out), SAMPLE_SIZE=f"{SIZE} {SIZE}")  # fmt: skip
    prepare = subprocess.run(["bash", _script("qwen_image"), "prepare"], env=env, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
    assert prepare.returncode == 0, prepare.stderr[-4000:]
    assert json.loads((pipeline / "model_index.json").read_text())["_miles_sample_size"] == [SIZE, SIZE]
    real = [json.loads(line) for line in (data / "real" / "prompts.jsonl").read_text().splitlines()]
    assert sorted(record["prompt"] for record in real) == sorted(PROMPTS)
    assert all((data / "real" / record["latent"]).is_file() and (data / "real" / record["cond"]).is_file()
               for record in real)  # fmt: skip

    log = _dry_run("qwen_image", env)
    _common_lines(log, pipeline, out)
    # LoRA roles on one base, and the memory plan counting them; the flow shift is the family's.
    assert _planned_lora_roles(log)
    assert "memory per GPU, DP rank 0 of 8" in log
    assert "flow shift" in log
    # the teacher as the recipe says: the stock pipeline's true_cfg_scale 4 with its per-token norm rescale
    assert (
        "teacher guidance: --dmd2-teacher-guidance-scale 4: set on the command line; true CFG u + w·(c − u) over two "
        "branches, with the stock per-token norm rescale"
    ) in log


@pytest.mark.parametrize(
    "recipe, builder, negative, teacher",
    [
        ("flux_dev", "write_tiny_flux", "", "3.5: set on the command line; embedded"),
        ("flux2_klein", "write_tiny_flux2_klein", "", "4: set on the command line; true CFG"),
        ("sd35_large", None, "", "3.5: set on the command line; true CFG"),
    ],
)
def test_an_image_recipe_passes_its_dry_run_with_the_memory_plan(tmp_path, recipe, builder, negative, teacher):
    import tests.support.tiny_pipelines as tiny
    from tests.support.sd3_t5 import tiny_sd3_t5_pipeline

    if builder is None:
        pipeline = tiny_sd3_t5_pipeline(tmp_path / "pipeline")
    else:
        pipeline = getattr(tiny, builder)(tmp_path / "pipeline")
        write_sample_size(pipeline, (SIZE, SIZE))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    data, out = tmp_path / "out" / "data", tmp_path / "out"
    _prepare_in_process(pipeline, prompts, data, negative)
    env = _env(MODEL_DIR=str(pipeline), DATA=str(data), OUT=str(out), SAMPLE_SIZE="")
    log = _dry_run(recipe, env)
    _common_lines(log, pipeline, out)
    assert "memory per GPU, DP rank 0 of 8" in log
    assert _planned_lora_roles(log) == (recipe != "flux2_klein")  # klein-4B fits 8 x 80 GB with full weights
    assert f"teacher guidance: --dmd2-teacher-guidance-scale {teacher}" in log  # the recipe's scale, in its form


def test_the_wan_recipe_passes_its_dry_run_on_user_prepared_video_latents(tmp_path):
    from tests.support.tiny_pipelines import write_tiny_wan

    pipeline = write_tiny_wan(tmp_path / "pipeline")
    write_sample_size(pipeline, (5, SIZE, SIZE))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    data, out = tmp_path / "out" / "data", tmp_path / "out"
    from miles.rollout.prompt_cache import main as prompt_cache

    assert prompt_cache([str(pipeline), str(prompts), str(data / "prompts"), "--batch-size", "2"]) == 0
    real = _write_video_records(pipeline, tmp_path / "real")
    env = _env(MODEL_DIR=str(pipeline), DATA=str(data), OUT=str(out), SAMPLE_SIZE="", REAL=str(real))
    log = _dry_run("wan", env)
    _common_lines(log, pipeline, out)
    assert "memory per GPU, DP rank 0 of 8" in log  # the wan family's activation layout plans it


@pytest.mark.parametrize(
    "builder, family, size, message",
    [
        ("write_tiny_qwen_image", "qwen_image", "500 500",
         "sample size 500 500: height 500 is not a multiple of 16, width 500 is not a multiple of 16"),
        ("write_tiny_qwen_image", "qwen_image", "512", "the qwen_image family takes 2 values (height width), got 1"),
        ("write_tiny_wan", "wan", "480 832", "the wan family takes 3 values (frames height width), got 2"),
        ("write_tiny_wan", "wan", "32 480 832", "frames 32 is not 4k + 1"),
    ],
)  # fmt: skip
def test_prepare_refuses_a_wrong_sample_size_before_it_writes_or_encodes(tmp_path, builder, family, size, message):
    # Issue 34 item 6: the size was written into the user's MODEL_DIR and the prompt cache ran (hours with a 7B text
    # encoder) before anything refused it. The recipe's shared `prepare` step is run as a user runs it.
    import tests.support.tiny_pipelines as tiny

    pipeline = getattr(tiny, builder)(tmp_path / "pipeline")
    index = (pipeline / "model_index.json").read_bytes()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    data, out = tmp_path / "out" / "data", tmp_path / "out"
    env = _env(MODEL_DIR=str(pipeline), PROMPTS=str(prompts), IMAGES=str(tmp_path / "photos"), DATA=str(data),
               OUT=str(out), SAMPLE_SIZE=size, REAL=str(tmp_path / "real.jsonl"))  # fmt: skip
    recipe = "wan" if family == "wan" else "qwen_image"
    proc = subprocess.run(["bash", _script(recipe), "prepare"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert (pipeline / "model_index.json").read_bytes() == index  # nothing written into the user's pipeline
    assert not data.exists()  # and the prompt cache never ran


def test_the_wan22_a14b_recipe_plans_lora_roles_over_both_experts(tmp_path):
    from tests.support.tiny_pipelines import write_tiny_wan
    from tests.support.tiny_pipelines.wan import A14B_BOUNDARY_RATIO

    pipeline = write_tiny_wan(tmp_path / "pipeline", boundary_ratio=A14B_BOUNDARY_RATIO)
    write_sample_size(pipeline, (5, SIZE, SIZE))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    data, out = tmp_path / "out" / "data", tmp_path / "out"
    from miles.rollout.prompt_cache import main as prompt_cache

    assert prompt_cache([str(pipeline), str(prompts), str(data / "prompts"), "--batch-size", "2"]) == 0
    real = _write_video_records(pipeline, tmp_path / "real")
    env = _env(MODEL_DIR=str(pipeline), DATA=str(data), OUT=str(out), SAMPLE_SIZE="", REAL=str(real))
    log = _dry_run("wan22_a14b", env)
    _common_lines(log, pipeline, out)
    assert "memory per GPU, DP rank 0 of 8" in log and "ZeRO-3 per block" in log  # --fsdp-reshard-every-microbatch
    assert _planned_lora_roles(log)
    # The critic group holds its base and the two-expert teacher: three frozen networks of one config, where the
    # actor holds its base alone.
    rows = [line.split("memory_plan: ", 1)[1].split() for line in log.splitlines()
            if re.search(r"memory_plan:\s+(actor|critic)\s", line)]  # fmt: skip
    frozen = {role: next(row[2] for row in rows if row[0] == role) for role in ("actor", "critic")}  # the plan's rows
    assert _count(frozen["critic"]) == pytest.approx(3 * _count(frozen["actor"]), rel=0.02), frozen
    assert "teacher guidance: --dmd2-teacher-guidance-scale 4: set on the command line; true CFG" in log


def _count(text: str) -> float:
    """A parameter count as the memory plan prints it (``42.9B``, ``307M``, ``12.5K``, ``880``)."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}
    return float(text[:-1]) * scale[text[-1]] if text[-1] in scale else float(text)


def test_the_qwen_image_edit_recipe_passes_its_dry_run_on_records_with_references(tmp_path):
    from PIL import Image

    from miles.rollout.encode_images import main as encode_images
    from miles.rollout.prompt_cache import main as prompt_cache
    from tests.support.tiny_pipelines import write_tiny_qwen_image_edit

    pipeline = write_tiny_qwen_image_edit(tmp_path / "pipeline")
    write_sample_size(pipeline, (SIZE, SIZE))
    # The edits: each instruction with the image it edits (a flipped photo), and the edited photos as real data
    # whose captions name the same reference; what the recipe's `prepare` writes, in-process. Two edits: the VAE
    # encodes every reference at the stock 1024², the slow part on a CPU.
    photos, edited, refs = write_photos(tmp_path / "photos"), tmp_path / "edited", tmp_path / "refs"
    edited.mkdir()
    refs.mkdir()
    prompts = PROMPTS[:2]
    for index in range(len(prompts)):
        photo = Image.open(photos / f"photo{index}.png")
        photo.save(edited / f"photo{index}.png")
        photo.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(refs / f"{index}.png")
    edits = [{"prompt": p, "condition_image": f"refs/{i}.png"} for i, p in enumerate(prompts)]
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps(e) + "\n" for e in edits * 2))
    captions = tmp_path / "edited.jsonl"
    captions.write_text("".join(json.dumps({"file_name": f"photo{i}.png", "prompt": p,
                                            "condition_image": str(refs / f"{i}.png")}) + "\n"
                                for i, p in enumerate(prompts)))  # fmt: skip
    data, out = tmp_path / "out" / "data", tmp_path / "out"
    cache = ["--negative-prompt", " "]
    assert prompt_cache([str(pipeline), str(tmp_path / "edits.jsonl"), str(data / "prompts"), *cache]) == 0
    assert encode_images([str(pipeline), str(edited), str(data / "real"), "--captions", str(captions)]) == 0
    assert prompt_cache([str(pipeline), str(data / "real" / "data.jsonl"), str(data / "real"), *cache]) == 0
    # each real record's cond is its (instruction, reference) pair's: the prompt cache of the edits holds the same
    real = [json.loads(line) for line in (data / "real" / "prompts.jsonl").read_text().splitlines()]
    cached = [json.loads(line) for line in (data / "prompts" / "prompts.jsonl").read_text().splitlines()]
    assert [r["cond"] for r in real] == [c["cond"] for c in cached[: len(prompts)]]

    env = _env(MODEL_DIR=str(pipeline), DATA=str(data), OUT=str(out), SAMPLE_SIZE="")
    log = _dry_run("qwen_image_edit", env)
    _common_lines(log, pipeline, out)
    assert "memory per GPU, DP rank 0 of 8" in log and "flow shift" in log
    assert _planned_lora_roles(log)
    # the sequence holds the target's 2 x 2 tokens and the reference's at the stock 1024² (64 x 64 tokens), and the
    # prompt cache covers every prompt with its reference: no rank loads the text encoder
    assert "4100 image + 2048 text tokens per sample" in log
    assert "text encoder" not in log
    assert (
        "teacher guidance: --dmd2-teacher-guidance-scale 4: set on the command line; true CFG u + w·(c − u) over two "
        "branches, with the stock per-token norm rescale"
    ) in log
