"""The phase-2 command of a GPU recipe (``examples/<recipe>/run_dmd2.sh``), as the recipe composes it, shrunk to a
family's tiny pipeline so that the family's DMD2 end-to-end fixture trains the recipe's own flags (LoRA roles, GAN
head, EMA, critic scoring, gradient checkpointing, clipping, evaluation, learning rates, guidance, flow shifts).

:func:`recipe_argv` runs the recipe with a stub ``python`` first on ``PATH`` that writes its arguments to a file
instead of training: the argv is the one ``examples/common/dmd2_phase2.sh`` would hand ``train_diffusion.py``.
:func:`tiny_recipe_argv` then overrides only what the tiny pipeline and this 2-CPU machine need (the paths, the
ranks, the batch, K critic steps, the rollouts and checkpoint interval, optionally the step count and the LoRA
ranks, which a 32-wide tiny model cannot take), trains in float32 (bf16 is the recipes' GPU dtype) and drops the
wandb logging; every other flag is the recipe's, so a recipe's new flag is trained here by the next test run.
"""

import os
import subprocess
import tempfile
from pathlib import Path

from tests.support.ray import REPO

# The recipe's flags that this machine replaces: Weights & Biases logging (offline files nobody reads here).
_DROPPED = {"--use-wandb": 0, "--wandb-project": 1, "--wandb-mode": 1}


def recipe_argv(recipe: str, env: dict[str, str] | None = None) -> list[str]:
    """The ``train_diffusion.py`` arguments ``examples/<recipe>/run_dmd2.sh`` composes (not run).

    Args:
        recipe: the folder under ``examples/`` (``"flux_dev"``, ``"qwen_image"``, ...).
        env: extra environment for the script (``MODEL_DIR``, ``OUT``, ...); placeholders are used for the rest.

    Raises:
        AssertionError: if the script fails or does not call ``python train_diffusion.py``.
    """
    with tempfile.TemporaryDirectory() as folder:
        stub, captured = Path(folder) / "python", Path(folder) / "argv"
        stub.write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > "{captured}"\n')
        stub.chmod(0o755)
        base = {
            "MODEL_DIR": "/model",
            "OUT": str(Path(folder) / "out"),
            "REAL": "/real/prompts.jsonl",
            "SAMPLE_SIZE": "",
        }
        full_env = {**os.environ, **base, **(env or {}), "PATH": f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"}
        script = REPO / "examples" / recipe / "run_dmd2.sh"
        proc = subprocess.run(["bash", str(script)], env=full_env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        argv = captured.read_text().split("\0")[:-1]
    assert argv[0] == "train_diffusion.py", argv[:3]
    return argv[1:]


def override(argv: list[str], flag: str, value: str | None) -> list[str]:
    """``argv`` with ``flag``'s value replaced (``value`` None: the flag and its value removed).

    Raises:
        AssertionError: if the recipe does not pass ``flag`` (so a renamed flag is noticed, not silently added).
    """
    assert flag in argv, f"the recipe passes no {flag}"
    index = argv.index(flag)
    if value is None:
        return argv[:index] + argv[index + 2 :]
    return argv[: index + 1] + [value] + argv[index + 2 :]


def tiny_recipe_argv(
    recipe: str,
    *,
    pipeline: Path,
    prompts: Path,
    negative: Path,
    real: Path,
    out: Path,
    save: Path,
    export: Path | None,
    num_steps: int | None = None,
    lora_ranks: tuple[int, int] | None = None,
) -> list[str]:
    """The recipe's phase-2 argv on a tiny pipeline: 2 CPU ranks, 4 prompts per rollout, K = 2, 2 rollouts, a commit
    after each.

    Args:
        pipeline: the tiny stock pipeline (student init, teacher and critic base).
        prompts, negative, real: the prompt cache's records and negative cond, the GAN's real latent records.
        out, save: ``--output-dir`` and ``--save``. export: ``--save-hf``; None drops it and ``--save-hf-lora``
            (a resumed run, whose export would be refused as existing).
        num_steps: ``--diffusion-num-steps`` (None: the recipe's).
        lora_ranks: ``(--lora-rank, --critic-lora-rank)`` (None: the recipe's); the recipe must train LoRA.
    """
    argv = recipe_argv(recipe)
    for flag, nargs in _DROPPED.items():
        if flag in argv:
            index = argv.index(flag)
            argv = argv[:index] + argv[index + 1 + nargs :]
    values = {
        "--hf-checkpoint": str(pipeline), "--teacher-load": str(pipeline), "--prompt-data": str(prompts),
        "--eval-prompt-data": str(prompts), "--negative-cond": str(negative), "--dmd2-gan-real-data": str(real),
        "--output-dir": str(out), "--save": str(save), "--actor-num-nodes": "1", "--actor-num-gpus-per-node": "2",
        "--train-dtype": "float32", "--rollout-batch-size": "4", "--dmd2-critic-steps-per-rollout": "2",
        "--num-rollout": "2", "--save-interval": "1",
    }  # fmt: skip
    if num_steps is not None:
        values["--diffusion-num-steps"] = str(num_steps)
    if lora_ranks is not None:
        values["--lora-rank"], values["--critic-lora-rank"] = (str(rank) for rank in lora_ranks)
    for flag, value in values.items():
        argv = override(argv, flag, value)
    if export is None:
        argv = override(argv, "--save-hf", None)
        if "--save-hf-lora" in argv:
            argv.remove("--save-hf-lora")
    else:
        argv = override(argv, "--save-hf", str(export))
    return [*argv, "--num-cpus-per-rank", "1"]
