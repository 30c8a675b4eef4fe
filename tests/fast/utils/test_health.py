"""Collapse alarms: the health figures on constructed cases, a deliberately collapsed student (its output
projection zeroed) through the real engine, and real digits standing in for a healthy student."""

import math

import torch

from miles.models import get_model_family
from miles.models.base import read_scheduler_config
from miles.rollout.conditioning import PromptConditioner
from miles.rollout.data_source import make_prompt_shard
from miles.rollout.engine import RolloutEngine
from miles.utils.health import THRESHOLDS, alarms, health_figures
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
               "health/std_ratio": 1.1}  # fmt: skip
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
