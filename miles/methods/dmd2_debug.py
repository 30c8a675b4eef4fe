"""The DMD2 debug grid of each evaluation, drawn by the driver: the actor group generates fixed eval samples, the
critic group scores them with its train-output hook (no training step), and :mod:`miles.eval.debug_grid` draws the
columns with a title, one labelled row per distinct eval prompt and the colour legend (tianweiy/DMD2 issue #33: to
debug a collapsing run, look at exactly these).
"""

import argparse
from pathlib import Path

import torch

from miles.backends.fsdp_utils.loss_hub import dmd2 as dmd2_loss
from miles.backends.fsdp_utils.loss_hub.dmd2_types import dmd2_settings

__all__ = ["DEBUG_SAMPLES", "debug_records", "dmd2_debug_grid"]


# Rows of the debug grid of each evaluation: one per distinct eval prompt, at most this many.
DEBUG_SAMPLES = 10


def debug_records(records: list[dict], input_key: str, limit: int = DEBUG_SAMPLES) -> list[dict]:
    """One record per distinct prompt, in the order they first appear, at most ``limit``: the eval prompts of a
    file sorted by class (the digits' ten rows of ten) give one row per class, not ``limit`` rows of the first."""
    chosen: dict[str, dict] = {}
    for record in records:
        chosen.setdefault(str(record[input_key]), record)
        if len(chosen) == limit:
            break
    return list(chosen.values())


def _row_label(prompt: str, pair, sigma: float, num_steps: int) -> str:
    shown = prompt if len(prompt) <= 30 else prompt[:27] + "..."
    # x_i is the student's input of step i + 1 of num_steps (1-based, as a user counts steps).
    stopped = f"x_i: step {pair.step_index + 1} of {num_steps}, sigma {pair.sigma:.2f}"
    return f"{shown}\n{stopped}\nscored at sigma {sigma:.2f}"


def dmd2_debug_grid(args: argparse.Namespace, groups: dict, records: list[dict], rollout_id: int) -> dict[str, Path]:
    """Generate ``records``' samples with the actor group (rollout id ``"debug"``), score them with the critic
    group's train-output hook (no training step), and draw :func:`miles.eval.debug_grid.save_dmd2_debug_grid`
    with a title (the rollout, the weights that drew the samples), one labelled row per record (its prompt, the
    step the student stopped at with its σ, the σ the teacher and critic scored at) and the colour legend.

    Returns:
        ``{"eval/dmd2_debug": <output-dir>/eval/dmd2_debug_<rollout>.png}`` and, for a video family, also
        ``{"eval/dmd2_debug_video": ....gif}``, the same grid as one frame per video frame
        (:func:`miles.eval.debug_grid.save_dmd2_debug_video`)."""
    from miles.eval.debug_grid import save_dmd2_debug_grid, save_dmd2_debug_video
    from miles.models import PixelCodec, supports
    from miles.rollout.data_source import make_prompt_shard
    from miles.rollout.engine import data_base_dir

    actor, critic = groups["actor"], groups["critic"]
    base_dir = data_base_dir(args.eval_prompt_data or args.prompt_data)
    shard = make_prompt_shard("debug", records, input_key=args.input_key, base_dir=base_dir)
    boxes, pad = actor.generate_shard("debug", shard)
    scores = critic.run_train_output("debug", boxes)
    pairs = [pair for part in actor.unbox(boxes) for pair in part]
    keep = len(pairs) - pad
    pairs = pairs[:keep]

    def column(name: str) -> torch.Tensor:
        return torch.cat([part[name] for part in scores])[:keep].float()

    student = torch.stack([pair.x0 for pair in pairs]).float()
    real, fake = column("x0_real"), column("x0_fake")
    dims = tuple(range(1, student.ndim))  # every latent axis: (C, H, W), or (C, F, H, W) for video
    normalizer = (student - real).abs().mean(dim=dims, keepdim=True).clamp_min(dmd2_loss.NORMALIZER_FLOOR)
    columns = {
        "x_i": torch.stack([pair.latent for pair in pairs]).float(),
        "x0 student": student,
        "x0 teacher": real,
        "x0 critic": fake,
        "g": torch.nan_to_num((fake - real) / normalizer, nan=0.0, posinf=0.0, neginf=0.0),
    }
    if "g_gan" in scores[0]:
        columns["g_gan"] = column("g_gan")
    family = actor.run.engine.make_family()
    path = Path(args.output_dir) / "eval" / f"dmd2_debug_{rollout_id}.png"
    steps = len(args.diffusion_timesteps) if args.diffusion_timesteps else args.diffusion_num_steps
    sigmas = column("sigma").tolist()
    title = (
        f"DMD2 debug, after rollout {rollout_id}: student samples from its live weights (rollouts never use the "
        f"EMA), teacher CFG {dmd2_settings(args).teacher_guidance_scale:g}, critic unguided"
    )
    labels = [_row_label(pair.prompt, pair, sigma, steps) for pair, sigma in zip(pairs, sigmas)]
    decode = family.latents_to_images if supports(family, PixelCodec) else None  # else raw latents as pixels
    drawing = {"signed": {"g", "g_gan"}, "decode": decode, "title": title, "row_labels": labels}
    media = {"eval/dmd2_debug": save_dmd2_debug_grid(columns, path, **drawing)}
    if student.ndim == 5:
        media["eval/dmd2_debug_video"] = save_dmd2_debug_video(columns, path.with_suffix(".gif"), **drawing)
    return media
