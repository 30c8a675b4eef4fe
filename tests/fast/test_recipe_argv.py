"""``tests.support.recipes``: the family DMD2 tests train each recipe's own phase-2 command, read out of
``examples/<recipe>/run_dmd2.sh`` by a stub ``python``, with only the tiny pipeline's paths and sizes replaced."""

from pathlib import Path

import pytest

from tests.support.recipes import recipe_argv, tiny_recipe_argv

# What tiny_recipe_argv may change: paths, ranks and sizes, the GPU dtype, the wandb logging.
REPLACED = {
    "--hf-checkpoint", "--teacher-load", "--prompt-data", "--eval-prompt-data", "--negative-cond",
    "--dmd2-gan-real-data", "--output-dir", "--save", "--save-hf", "--actor-num-nodes", "--actor-num-gpus-per-node",
    "--train-dtype", "--rollout-batch-size", "--dmd2-critic-steps-per-rollout", "--num-rollout", "--save-interval",
    "--diffusion-num-steps", "--lora-rank", "--critic-lora-rank", "--use-wandb", "--wandb-project", "--wandb-mode",
}  # fmt: skip


def _flags(argv: list[str]) -> dict[str, list[str]]:
    """``{flag: [values]}`` of an argv of ``--flag value...`` groups."""
    found: dict[str, list[str]] = {}
    flag = None
    for arg in argv:
        if arg.startswith("--"):
            flag = arg
            found[flag] = []
        else:
            found[flag].append(arg)
    return found


@pytest.mark.parametrize("recipe", ["flux_dev", "qwen_image", "flux2_klein", "wan", "sd35_large", "sd35_medium"])
def test_the_tiny_command_keeps_every_recipe_flag_but_paths_and_sizes(recipe):
    shipped = _flags(recipe_argv(recipe))
    tiny = _flags(tiny_recipe_argv(recipe, pipeline=Path("/p"), prompts=Path("/c/prompts.jsonl"),
                                   negative=Path("/c/neg"), real=Path("/r/data.jsonl"), out=Path("/o"),
                                   save=Path("/s"), export=Path("/e"), num_steps=2))  # fmt: skip
    kept = {flag: values for flag, values in shipped.items() if flag not in REPLACED}
    assert {flag: tiny[flag] for flag in kept} == kept
    # the recipe's phase-2 parts are all there: GAN head on real data, EMA, K critic steps
    assert {"--dmd2-gan-disc-weight", "--dmd2-gan-gen-weight", "--ema-decay"} <= set(tiny)
    assert tiny["--actor-num-gpus-per-node"] == ["2"] and tiny["--num-rollout"] == ["2"]
    assert tiny["--dmd2-gan-real-data"] == ["/r/data.jsonl"] and tiny["--save-hf"] == ["/e"]
    assert tiny["--train-dtype"] == ["float32"] and "--use-wandb" not in tiny
    assert ("--lora-rank" in tiny) == (recipe in ("flux_dev", "qwen_image", "sd35_large"))
    resumed = tiny_recipe_argv(recipe, pipeline=Path("/p"), prompts=Path("/c"), negative=Path("/n"),
                               real=Path("/r"), out=Path("/o"), save=Path("/s"), export=None)  # fmt: skip
    assert "--save-hf" not in resumed and "--save-hf-lora" not in resumed


def test_a_flag_the_recipe_does_not_pass_is_not_silently_added():
    from tests.support.recipes import override

    with pytest.raises(AssertionError, match="the recipe passes no --lora-rank"):
        override(recipe_argv("flux2_klein"), "--lora-rank", "8")
