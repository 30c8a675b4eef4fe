"""The teacher's noise → sample pairs of DMD's regression loss, written once, offline:
``python -m miles.rollout.regression_pairs``.

DMD (Yin et al. 2024, §3.3) regresses the student's one-step output from a noise ``z`` onto the teacher's
deterministic sample ``y`` from the same ``z`` (its ODE: Euler steps of the flow, no re-noising). The pairs are
computed once, before training, because a 28-step teacher sample per training sample would cost more than the
distillation itself::

    python -m miles.rollout.regression_pairs TEACHER PROMPTS.jsonl OUT_DIR [--num-pairs 1000] [--num-steps 28]
        [--guidance-scale W] [--flow-shift K] [--seed 0] [--input-key prompt] [--device cpu] [--batch-size 64]

writes::

    OUT_DIR/latents/<index>.safetensors   "latent": y, "noise": z, both float32 of the teacher's latent shape
    OUT_DIR/pairs.jsonl                   one record per pair: the prompt record's fields (a cached "cond" made
                                          absolute), "latent" (the file, read with the trainer's default
                                          --latent-key), "regression_seed" and "regression_index" (the noise's key)
    OUT_DIR/regression_pairs.json         teacher, family, steps, guidance, shift, seed, count, latent shape

Pair ``j`` takes prompt record ``j mod len(PROMPTS)`` (in file order) and the noise
``initial_noise(shape, seed, "regression", [j])`` (``stable_hash("init_noise", seed, "regression", j)``), which the
trainer draws again from the record's seed and index (:func:`regression_noise`); ``noise`` in the file is the same
tensor, kept for inspection. The same command, teacher and flags write the same files. Train with
``--dmd2-regression-weight 0.25 --dmd2-regression-pairs OUT_DIR/pairs.jsonl``.
"""

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from miles.models.experts import load_teacher
from miles.rollout.offline_files import (
    OfflineDataError,
    command_parser,
    ensure_writable_dir,
    replace_text,
    run_command,
    save_tensors,
)
from miles.rollout.prompt_cache import read_prompt_records
from miles.utils.sampling import FlowNoiseSchedule, initial_noise, sample_latents

__all__ = [
    "INDEX_KEY",
    "MANIFEST",
    "REGRESSION_ROLLOUT",
    "SEED_KEY",
    "main",
    "regression_noise",
    "write_regression_pairs",
]

logger = logging.getLogger(__name__)

MANIFEST = "regression_pairs.json"
# The rollout id of the pairs' noise keys: never a training rollout's (ints), the evaluation's ("eval") or the
# debug grid's ("debug").
REGRESSION_ROLLOUT = "regression"
# The fields of a pair's record that name its noise's key.
SEED_KEY, INDEX_KEY = "regression_seed", "regression_index"
DEFAULT_FLOW_SHIFT = 3.0  # the trainer's default where a family has no shift of its own (miles.driver)


def regression_noise(shape: tuple[int, ...], seed: int, indices: list[int]) -> torch.Tensor:
    """The pairs' noise ``z``: float32 ``(B, *shape)``, row b from ``stable_hash("init_noise", seed, "regression",
    index_b)``: the engine's initial-noise draw under the rollout id :data:`REGRESSION_ROLLOUT`, so this command and
    the trainer draw the same tensor."""
    return initial_noise(tuple(shape), seed, REGRESSION_ROLLOUT, list(indices))


def write_regression_pairs(
    teacher: str | Path,
    prompts_path: str | Path,
    out_dir: str | Path,
    *,
    num_pairs: int = 1000,
    num_steps: int = 28,
    guidance_scale: float | None = None,
    flow_shift: float | None = None,
    seed: int = 0,
    input_key: str = "prompt",
    device: str | torch.device = "cpu",
    batch_size: int = 64,
    family_name: str | None = None,
) -> dict[str, Any]:
    """Sample the teacher's ODE from each pair's keyed noise and write the pairs (module docstring).

    Args:
        teacher: the teacher pipeline directory (any model family).
        prompts_path: JSONL prompt records (``input_key``); pair j takes record ``j mod count``.
        out_dir: the output directory (created; existing pair files are replaced).
        num_pairs: pairs to write (≥ 1).
        num_steps: the teacher's Euler steps (its stock sampler's count; 28 for SD3).
        guidance_scale: the teacher's guidance in its family's form; None: its stock pipeline's scale (1 where it
            names none), as ``--dmd2-teacher-guidance-scale`` defaults.
        flow_shift: the sampling grid's shift; None: the family's (its stock pipeline's at the teacher's
            resolution), else 3.0, as ``--diffusion-flow-shift`` defaults.
        seed: the noise seed (the records' ``regression_seed``).
        device: where the teacher and its text encoder run.
        batch_size: pairs per teacher forward.
        family_name: a registered family name or a dotted path (``--diffusion-model-family``); None reads
            ``model_index.json``.

    Returns:
        The manifest written to ``regression_pairs.json``.

    Raises:
        OfflineDataError: for a missing or unsupported pipeline, a bad prompt file, a bad count, step number,
            guidance or seed, or an unwritable ``out_dir``.
    """
    from miles.models import get_model_family
    from miles.models.base import encode_one_prompt

    for name, value, low in (
        ("--num-pairs", num_pairs, 1),
        ("--num-steps", num_steps, 1),
        ("--batch-size", batch_size, 1),
    ):
        if value < low:
            raise OfflineDataError(f"{name} must be >= {low}, got {value}")
    if not 0 <= seed < 2**63:
        raise OfflineDataError(f"--seed must be in [0, 2**63 - 1], got {seed}")
    teacher, out_dir = Path(teacher), Path(out_dir)
    if not teacher.is_dir():
        raise OfflineDataError(f"teacher pipeline directory {teacher} does not exist")
    try:
        family = get_model_family(teacher, family_name)
        stock_scale = family.stock_guidance_scale(teacher)
        stock_shift = family.flow_shift(teacher, num_steps=num_steps)
        shape = tuple(family.latent_shape(teacher))
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise OfflineDataError(str(exc)) from exc
    scale = float(guidance_scale if guidance_scale is not None else (stock_scale or 1.0))
    if not (scale >= 1 and scale < float("inf")):
        raise OfflineDataError(f"--guidance-scale must be a finite number >= 1 (1 = no CFG), got {scale}")
    shift = float(flow_shift if flow_shift is not None else (stock_shift or DEFAULT_FLOW_SHIFT))
    if not (0 < shift < float("inf")):
        raise OfflineDataError(f"--flow-shift must be a finite number > 0, got {shift}")
    records = read_prompt_records(prompts_path, input_key)
    ensure_writable_dir(out_dir, "latents")

    chosen = [records[j % len(records)] for j in range(num_pairs)]
    prompts = [str(record[input_key]) for record in chosen]
    encoder = family.load_text_encoder(teacher, device=device)
    denoiser = load_teacher(family, teacher).to(device).eval()  # both experts of a two-expert teacher
    negative = encode_one_prompt(family, encoder, family.stock_negative_prompt) if scale != 1.0 else None
    schedule = FlowNoiseSchedule(num_steps, shift)
    indices = list(range(num_pairs))
    with torch.no_grad():
        samples = sample_latents(
            family,
            denoiser,
            lambda start, end: family.encode_prompts(encoder, prompts[start:end]),
            indices,
            latent_shape=shape,
            schedule=schedule,
            guidance_scale=scale,
            step_rule="euler",
            seed=seed,
            negative=negative,
            batch_size=batch_size,
            rollout_id=REGRESSION_ROLLOUT,
        )
    width = max(6, len(str(num_pairs - 1)))
    lines = []
    for j, (record, sample) in enumerate(zip(chosen, samples)):
        name = f"latents/{j:0{width}d}.safetensors"
        noise = regression_noise(shape, seed, [j])[0]
        save_tensors(out_dir / name, {"latent": sample.float(), "noise": noise}, {"prompt": prompts[j]})
        fields = {key: value for key, value in record.items() if key not in ("latent", "image")}
        if isinstance(fields.get("cond"), str):
            # A prompt cache's cond file, relative to the prompt file: absolute here, so the trainer reads it too.
            fields["cond"] = str((Path(prompts_path).parent / fields["cond"]).resolve())
        lines.append(json.dumps({**fields, "latent": name, SEED_KEY: seed, INDEX_KEY: j}, ensure_ascii=False))
    # pairs.jsonl after the files it names: a crash before it leaves no record of a missing file.
    replace_text(out_dir / "pairs.jsonl", "\n".join(lines) + "\n")
    manifest = {
        "teacher": str(teacher.resolve()),
        "family": family.name,
        "prompts": str(Path(prompts_path).resolve()),
        "input_key": input_key,
        "count": num_pairs,
        "num_steps": num_steps,
        "step_rule": "euler",
        "guidance_scale": scale,
        "flow_shift": shift,
        "seed": seed,
        "latent_shape": list(shape),
    }
    replace_text(out_dir / MANIFEST, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    logger.info("wrote %d regression pairs of %s (%d Euler steps, CFG %g) to %s", num_pairs, teacher, num_steps,
                scale, out_dir)  # fmt: skip
    return manifest


def main(argv: list[str] | None = None) -> int:
    """``python -m miles.rollout.regression_pairs TEACHER PROMPTS OUT_DIR [--num-pairs N ...]``; returns the exit code
    (0, or 2 after one error line on stderr)."""
    parser = command_parser(
        "python -m miles.rollout.regression_pairs",
        "Write the teacher's noise -> ODE sample pairs of DMD's regression loss (--dmd2-regression-pairs).",
        ("prompts", "JSONL prompt file (pair j takes record j mod its count)"),
        "pairs directory to write",
        batch_size=64,
        batch_help="pairs per teacher forward",
    )
    parser.add_argument("--num-pairs", type=int, default=1000, help="pairs to write (default: 1000)")
    parser.add_argument("--num-steps", type=int, default=28, help="the teacher's Euler steps (default: 28)")
    parser.add_argument(
        "--guidance-scale", type=float, default=None, help="teacher guidance (default: its stock pipeline's, else 1)"
    )
    parser.add_argument(
        "--flow-shift", type=float, default=None, help="the grid's flow shift (default: the family's, else 3)"
    )
    parser.add_argument("--seed", type=int, default=0, help="noise seed (default: 0)")
    parser.add_argument("--input-key", default="prompt", help="JSONL key of the prompt (default: prompt)")
    parser.add_argument("--device", default="cpu", help="device of the teacher and its text encoder (default: cpu)")

    def summary(manifest: dict, out: Path) -> str:
        return (
            f"wrote {manifest['count']} regression pairs ({manifest['family']}, {manifest['num_steps']} Euler steps, "
            f"CFG {manifest['guidance_scale']:g}) to {out}; train with --dmd2-regression-weight 0.25 "
            f"--dmd2-regression-pairs {out / 'pairs.jsonl'}"
        )

    options = ("num_pairs", "num_steps", "guidance_scale", "flow_shift", "seed", "input_key", "device")
    return run_command(parser, argv, write_regression_pairs, options, summary)


if __name__ == "__main__":
    sys.exit(main())
