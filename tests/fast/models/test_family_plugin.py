"""A model family defined outside miles trains DMD2 with no edit of miles: ``--diffusion-model-family`` names the toy
video family of :mod:`tests.support.toy_video_family` (diffusers' Wan transformer over ``(C, F, H, W)`` latents)
by its dotted path. The run is the one docs/customization.md shows, read from the doc: 2 DP ranks on CPU, 2
rollouts, the critic with its GAN head on real latent files, an eval at the end (the eval grid and the DMD2 debug
grid draw video as frame strips) and the export; it joins the session's Ray cluster. The same command with
``--dry-run`` plans its memory and time from the layout the family declares (no Ray). The doc also shows the family's
module verbatim; the first test pins that."""

import json
import logging
import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from miles.utils.tracking import read_metrics
from tests.support.driver import run_main
from tests.support.toy_video_pipeline import write_toy_inputs

REPO = Path(__file__).resolve().parents[3]
FAMILY = "tests.support.toy_video_family.ToyVideoFamily"
ACTOR = ["train/loss", "train/dmd2_grad_abs_mean", "train/dmd2_gan_grad_abs_mean", "train/x0_max_abs_diff"]
CRITIC = ["train/critic-loss", "train/critic-sft_loss", "train/critic-gan_disc_loss", "train/critic-gan_logit_real"]


def _doc() -> str:
    return (REPO / "docs" / "customization.md").read_text()


def test_the_customization_doc_shows_the_family_module_verbatim():
    blocks = re.findall(r"```python\n# tests/support/toy_video_family\.py\n(.*?)```", _doc(), flags=re.S)
    assert len(blocks) == 1
    assert blocks[0] == (REPO / "tests" / "support" / "toy_video_family.py").read_text()


def _doc_commands(root: Path) -> tuple[str, list[str]]:
    """The doc's two commands with its directory replaced by ``root``: that directory and the driver's argv."""
    (block,) = re.findall(r"```bash\n(python -c .*?)```", _doc(), flags=re.S)
    inputs, train = block.replace("\\\n", " ").strip().split("\n")
    directory = re.search(r"write_toy_inputs\('([^']+)'\)", inputs).group(1)
    argv = shlex.split(train.replace(directory, str(root)))
    assert argv[:2] == ["python", "train_diffusion.py"]
    return directory, argv[2:]


def test_the_dry_run_plans_the_familys_memory_and_time_from_the_layout_it_declares(tmp_path, caplog):
    """The planner and the estimate know no family: the toy family's own MemoryLayout gives 2 frames × 4 × 4 = 32
    image tokens and 8 text tokens per sample, an activation layout and a FLOP count of its forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from miles.models import family_class

    _, argv = _doc_commands(tmp_path)
    write_toy_inputs(tmp_path)
    with caplog.at_level(logging.INFO):
        run_main([*argv, "--dry-run"])
    text = caplog.text
    assert "memory per GPU, DP rank 0 of 2: float32 compute, 32 image + 8 text tokens per sample" in text
    assert "  critic  " in text and "   actor  " in text  # a row of the plan per group
    assert "memory plan: not available" not in text and "time estimate: none" not in text
    assert "32 image + 8 text tokens); float32 compute: no seconds" in text
    # The count on the meta device is the real forward's (the math attention kernel: counted by its matmuls).
    family = family_class(FAMILY)(tmp_path / "pipeline")
    flops, parameters = family.flops_per_sample(tmp_path / "pipeline")
    denoiser = family.load_denoiser(tmp_path / "pipeline")
    cond = family.encode_prompts(family.load_text_encoder(tmp_path / "pipeline"), ["a ball rolls left"])
    latents = torch.zeros(1, *family.latent_shape(tmp_path / "pipeline"))
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        family.predict_velocity(denoiser, latents, torch.full((1,), 500.0), cond)
    assert flops == counter.get_total_flops() > 0 and parameters == sum(p.numel() for p in denoiser.parameters())


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("family_plugin")
    directory, argv = _doc_commands(root)
    assert directory == "/tmp/toy" and argv[argv.index("--diffusion-model-family") + 1] == FAMILY
    write_toy_inputs(root)
    run_main(argv)
    return {
        "pipeline": root / "pipeline",
        "out": root / "run",
        "export": root / "student",
        "records": read_metrics(root / "run"),
    }


def test_every_rollout_trains_the_critic_with_its_head_and_the_student_on_5d_latents(run):
    records = run["records"]
    actor = [r for r in records if "train/loss" in r]
    critic = [r for r in records if "train/critic-loss" in r]
    assert [r["rollout_id"] for r in actor] == [0, 1]
    assert [r["rollout_id"] for r in critic] == [0, 0, 1, 1]  # K = 2 critic steps per rollout
    for record in actor + critic:
        for name in ACTOR if record in actor else CRITIC:
            assert math.isfinite(record[name]), (record["rollout_id"], name)
    assert all(r["train/dmd2_grad_abs_mean"] > 0 and r["train/dmd2_gan_grad_abs_mean"] > 0 for r in actor)
    # The trainer's recomputed x0 of the video student matches the engine's x̂0_i (same weights, same inputs).
    assert all(r["train/x0_max_abs_diff"] < 1e-4 for r in actor)
    # softplus(D(fake)) + softplus(−D(real)) of a fresh head on folded frames: near 2·ln 2
    assert all(0.5 < r["train/critic-gan_disc_loss"] < 3.0 for r in critic)
    assert any("health/std_ratio" in r for r in records)


def test_the_export_is_the_trained_wan_transformer(run):
    from diffusers import WanTransformer3DModel

    trained = WanTransformer3DModel.from_pretrained(run["export"] / "transformer").state_dict()
    initial = WanTransformer3DModel.from_pretrained(run["pipeline"] / "transformer").state_dict()
    assert trained.keys() == initial.keys()
    assert sum(not torch.equal(trained[key], initial[key]) for key in initial) > len(initial) // 2
    assert json.loads((run["export"] / "model_index.json").read_text())["_class_name"] == "ToyVideoPipeline"


def test_the_eval_and_debug_grids_draw_each_clip_as_a_strip_of_its_frames(run):
    eval_dir = run["out"] / "eval"
    # 4 eval clips, each 2 frames of 8×8 side by side (8×16), tiled at scale 48 // 16 = 3 with 4 px spacing and
    # drawn from the raw latents' first 3 channels (the family has no codec).
    grid = np.asarray(Image.open(eval_dir / "rollout_1.png"))
    assert grid.shape == (4 + 1 * (3 * 8 + 4), 4 + 4 * (3 * 16 + 4), 3)
    # 6 columns (x_i, the three x0, g, g_gan) of 16-pixel-wide strips at scale 64 // 16 = 4, one row per clip.
    debug = np.asarray(Image.open(eval_dir / "dmd2_debug_1.png"))
    assert debug.shape[1] > 6 * 4 * 16 and 4 * 4 * 8 < debug.shape[0] < 4 * 4 * 16


def test_the_eval_and_debug_grids_also_play_as_animations_logged_beside_the_strips(run):
    from PIL import ImageSequence

    eval_dir = run["out"] / "eval"
    [record] = [r for r in run["records"] if "eval/samples" in r]
    assert record["eval/samples_video"] == str(eval_dir / "rollout_1.gif")
    assert record["eval/dmd2_debug_video"] == str(eval_dir / "dmd2_debug_1.gif")
    grid = np.asarray(Image.open(eval_dir / "rollout_1.png"))
    with Image.open(eval_dir / "rollout_1.gif") as gif:
        frames = [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(gif)]
    # 2 latent frames (no codec: drawn as they are), each at the strip's scale 3: frame f is every clip's frame f
    assert len(frames) == 2 and frames[0].shape == (4 + 3 * 8 + 4, 4 + 4 * (3 * 8 + 4), 3)
    strip_cells = grid[4 : 4 + 24].reshape(24, -1, 3)
    for f, frame in enumerate(frames):
        for clip in range(4):
            left = 4 + clip * (3 * 16 + 4) + f * 24
            # the GIF's palette may merge near colours of the raw-latent pixels: compare within a few levels
            cell = frame[4:28, 4 + clip * 28 : 4 + clip * 28 + 24].astype(int)
            assert np.abs(cell - strip_cells[:, left : left + 24].astype(int)).mean() < 8, (f, clip)
    with Image.open(eval_dir / "dmd2_debug_1.gif") as gif:
        assert gif.n_frames == 2
