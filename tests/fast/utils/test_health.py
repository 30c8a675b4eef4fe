"""Collapse alarms: the health figures on constructed cases, a deliberately collapsed student (its output
projection zeroed) through the real engine, and real digits standing in for a healthy student."""

import math

import pytest
import torch

from miles.models import get_model_family
from miles.models.base import read_scheduler_config
from miles.rollout.conditioning import PromptConditioner
from miles.rollout.data_source import make_prompt_shard
from miles.rollout.engine import RolloutEngine
from miles.utils.health import (
    EVAL_FIGURES,
    THRESHOLDS,
    alarms,
    eval_health_figures,
    health_figures,
    reference_figures,
    sample_figures,
)
from tests.support.rollout import engine_spec
from tests.support.trainer import make_args, make_pipeline

PROMPTS = [f"a handwritten digit {digit}" for digit in (1, 1, 1, 1, 7, 7, 7, 7)]


def _digits(count: int, offset: int = 0) -> torch.Tensor:
    from sklearn.datasets import load_digits

    data = load_digits()
    order = torch.argsort(torch.from_numpy(data.target), stable=True)  # grouped by class
    images = torch.from_numpy(data.images)[order][offset : offset + count]
    return (images / 16.0 * 2 - 1).float().unsqueeze(1)


def test_the_figures_on_constructed_cases():
    teacher = _digits(8)
    same = health_figures(teacher, teacher, PROMPTS)
    assert same["health/diversity_ratio"] == 1.0 and same["health/mean_drift"] == 0.0
    assert same["health/std_ratio"] == 1.0 and same["health/saturated_frac"] == 0.0
    # Every sample of a prompt the same image: no within-prompt spread at all.
    collapsed = torch.cat([teacher[:1].expand(4, -1, -1, -1), teacher[4:5].expand(4, -1, -1, -1)])
    assert health_figures(collapsed, teacher, PROMPTS)["health/diversity_ratio"] == 0.0
    # Blown out: twice the values, a quarter of them beyond 1.5 × the teacher's 99th percentile.
    assert health_figures(teacher * 3, teacher, PROMPTS)["health/saturated_frac"] > 0.2
    # No prompt with two samples: no diversity figure.
    assert "health/diversity_ratio" not in health_figures(teacher[:2], teacher[:2], ["a", "b"])


def test_alarms_name_each_figure_outside_its_threshold():
    healthy = {"health/diversity_ratio": 0.9, "health/saturated_frac": 0.0, "health/mean_drift": 0.1,
               "health/std_ratio": 1.1, "health/eval_diversity": 0.15, "eval/diversity_ratio": 0.9,
               "eval/saturated_excess": -0.2}  # fmt: skip
    assert alarms(healthy) == []
    sick = {**healthy, "health/diversity_ratio": 0.05, "health/std_ratio": 3.0}
    assert alarms(sick) == [
        "health/diversity_ratio=0.05 (healthy: 0.3..inf)",
        "health/std_ratio=3 (healthy: 0.5..2)",
    ]
    assert alarms({"health/mean_drift": math.nan}) == ["health/mean_drift=nan (healthy: -inf..0.5)"]
    assert set(THRESHOLDS) == set(healthy)


def _student_x0(pipeline, tmp_path, zero_output: bool) -> torch.Tensor:
    args = make_args(pipeline, tmp_path, "--loss-type", "dmd2", "--teacher-load", str(pipeline),
                     "--actor-num-gpus-per-node", "1", "--dmd2-critic-steps-per-rollout", "2",
                     train_only=False)  # fmt: skip
    family = get_model_family(pipeline)
    denoiser = family.load_denoiser(pipeline)
    if zero_output:
        with torch.no_grad():
            denoiser.proj_out.weight.zero_()
            denoiser.proj_out.bias.zero_()
    spec = engine_spec(args)
    engine = RolloutEngine(
        spec,
        family,
        denoiser,
        PromptConditioner(spec, family, pipeline),
        family.latent_shape(pipeline),
        read_scheduler_config(pipeline)["num_train_timesteps"],
        args=args,
    )
    samples = engine.generate(make_prompt_shard(0, [{"prompt": p} for p in PROMPTS], input_key="prompt"))
    return torch.stack([sample.trajectory.x0_preds[0] for sample in samples])


def test_a_collapsed_student_fires_the_alarm_and_real_digits_keep_it_quiet(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    teacher = _digits(8, offset=0)
    # Zeroed output projection: v = 0, so x̂0 = x_i, the input noise: far outside the digits' range.
    collapsed = health_figures(_student_x0(pipeline, tmp_path, zero_output=True), teacher, PROMPTS)
    fired = alarms(collapsed)
    assert any(alarm.startswith("health/saturated_frac") for alarm in fired), collapsed
    assert any(alarm.startswith("health/std_ratio") or alarm.startswith("health/mean_drift") for alarm in fired)
    # Other real digits of the same classes stand in for a healthy student.
    healthy = torch.cat([_digits(4, offset=190), _digits(4, offset=1280)])
    assert alarms(health_figures(healthy, torch.cat([_digits(4, 180), _digits(4, 1270)]), PROMPTS)) == []


def test_the_eval_figures_on_constructed_images():
    # Prompt "a": a black and a white pixel (std 0.5 of the range); prompt "b": the same grey twice (std 0).
    images = torch.tensor([0, 255, 51, 51], dtype=torch.uint8).view(4, 1, 1, 1)
    prompts = ["a", "a", "b", "b"]
    assert sample_figures(images, prompts) == {"saturated_frac": 0.5, "diversity": 0.25}
    assert eval_health_figures(images, prompts) == {"health/eval_saturated_frac": 0.5, "health/eval_diversity": 0.25}
    # One image per prompt: no spread to measure; the share at the ends is 2 of 8 values.
    two = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 255]], dtype=torch.uint8).view(2, 2, 2, 1)
    assert sample_figures(two, ["a", "b"]) == {"saturated_frac": 0.25}
    with pytest.raises(ValueError, match="3 images for 2 prompts"):
        sample_figures(images[:3], ["a", "b"])


def test_a_collapsed_eval_alarms_and_a_diverse_one_does_not():
    gen = torch.Generator().manual_seed(0)
    prompts = [f"a handwritten digit {d}" for d in range(10) for _ in range(5)]
    diverse = torch.randint(1, 255, (50, 8, 8, 1), generator=gen, dtype=torch.uint8)
    collapsed = diverse[::5].repeat_interleave(5, dim=0)  # every seed of a prompt draws its first image again
    assert alarms(eval_health_figures(diverse, prompts)) == []
    assert eval_health_figures(collapsed, prompts)["health/eval_diversity"] == 0.0
    assert alarms(eval_health_figures(collapsed, prompts)) == ["health/eval_diversity=0 (healthy: 0.02..inf)"]
    # Against real digits of the same prompts: the collapsed set keeps no spread, the blown-out one saturates.
    real = torch.from_numpy(_digit_uint8(50))
    relative = reference_figures(collapsed, prompts, real, prompts)
    assert relative["diversity_ratio"] == 0.0
    assert "eval/diversity_ratio=0 (healthy: 0.6..inf)" in alarms({f"eval/{k}": v for k, v in relative.items()})
    blown = torch.where(diverse > 127, 255, 0).to(torch.uint8)
    excess = reference_figures(blown, prompts, real, prompts)["saturated_excess"]
    assert excess == pytest.approx(1.0 - float(((real == 0) | (real == 255)).double().mean()))
    assert any(alarm.startswith("eval/saturated_excess") for alarm in alarms({"eval/saturated_excess": excess}))
    # Real digits against themselves: ratio 1, no excess, no alarm; prompts in common: none, no figures.
    same = reference_figures(real, prompts, real, prompts)
    assert same == {"saturated_excess": 0.0, "diversity_ratio": 1.0}
    assert reference_figures(real, prompts, real, ["other"] * 50) == {}
    assert set(EVAL_FIGURES) <= set(THRESHOLDS) | {"health/eval_saturated_frac"}


def _digit_uint8(count: int):
    """``count`` real digits as uint8 ``(N, 8, 8, 1)``, five of each class 0..9 in class order."""
    from sklearn.datasets import load_digits

    data = load_digits()
    rows = [i for d in range(10) for i in (data.target == d).nonzero()[0][:5]][:count]
    return (data.images[rows] * 255 / 16 + 0.5).astype("uint8")[..., None]
