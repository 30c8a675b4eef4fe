"""Digits evaluation of pipelines: one row, the teacher/student suite, the train-time hook and the benchmark CLI.

All on freshly initialised (untrained) tiny pipelines with 3 samples per digit: the figures are poor, but their
fields, sample counts, seeds, determinism and files are what is checked.
"""

import importlib.util
import json
import math
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from miles.eval.digits.data import DIGIT_PROMPTS, load_split
from miles.eval.digits.hook import (
    digits_eval_hook,
    eval_grid_path,
    evaluate_pipeline,
    evaluate_suite,
    load_pipeline,
    sample_digits,
)
from miles.eval.digits.metrics import evaluate_images
from miles.models.digits import init_digits_pipeline
from miles.models.digits_pipeline import write_sampling_schedule

TINY = {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8}
N_PER_CLASS = 3
REPO = Path(__file__).resolve().parents[4]
# Grid layout of miles.eval.digits.grids at scale 6, spacing 4: cells 48 px, rows 52 px, a 32 px title band.
GRID_HEIGHT = 32 + 4 + 10 * 52
GRID_MIN_WIDTH = 4 + 24 + 4 + N_PER_CLASS * 52


@pytest.fixture(scope="module", autouse=True)
def classifier_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        cache = tmp_path_factory.mktemp("classifier_cache")
        patch.setenv("MILES_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return init_digits_pipeline(tmp_path_factory.mktemp("teacher"), seed=0, **TINY)


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    path = init_digits_pipeline(tmp_path_factory.mktemp("student"), seed=1, **TINY)
    write_sampling_schedule(path, num_steps=4, shift=3.0, step_rule="dmd2", distilled_guidance_scale=3.0)
    return path


@pytest.fixture(scope="module")
def teacher_row(teacher_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("row")
    kwargs = dict(name="teacher-4step", num_steps=4, guidance_scale=3.0, step_rule="euler", n_per_class=N_PER_CLASS)
    return evaluate_pipeline(teacher_dir, seed=11, out_dir=out, **kwargs), kwargs


def test_a_row_reports_its_samples_seed_settings_and_grid(teacher_row, teacher_dir):
    row, _ = teacher_row
    assert row["name"] == "teacher-4step" and row["seed"] == 11 and row["n_samples"] == 10 * N_PER_CLASS
    assert (row["model"], row["sampler"], row["steps"], row["guidance_scale"]) == ("teacher", "euler", 4, 3.0)
    assert row["sigmas"] == [1.0, 0.9, 0.75, 0.5, 0.0] and row["shift"] == 3.0
    assert row["pipeline"] == str(teacher_dir) and row["n_reference"] == 359
    for key in ("accuracy", "fd", "precision", "recall", "spread_ratio"):
        assert math.isfinite(row[key]), key
    assert 0 <= row["accuracy"] <= 1 and row["fd"] > 0
    assert len(row["per_class_accuracy"]) == 10
    grid = Image.open(row["grid"])
    assert Path(row["grid"]).name == "teacher-4step.png"
    assert grid.height == GRID_HEIGHT and grid.width >= GRID_MIN_WIDTH


def test_a_row_is_the_metrics_of_its_seeded_samples_and_repeats_exactly(teacher_row, teacher_dir):
    row, kwargs = teacher_row
    pipeline = load_pipeline(teacher_dir)
    call = {"num_inference_steps": 4, "guidance_scale": 3.0, "step_rule": "euler"}
    images, labels = sample_digits(pipeline, N_PER_CLASS, seed=11, **call)
    assert images.shape == (30, 8, 8, 1) and images.dtype == np.uint8
    np.testing.assert_array_equal(labels, np.repeat(np.arange(10), N_PER_CLASS))
    direct = evaluate_images(images, labels, seed=11, name="direct")
    for key in ("accuracy", "fd", "precision", "recall", "spread_ratio"):
        assert row[key] == direct[key], key
    again = evaluate_pipeline(pipeline, seed=11, **kwargs)
    assert again["grid"] is None
    for key in ("accuracy", "fd", "precision", "recall", "spread_ratio", "per_class_accuracy"):
        assert again[key] == row[key], key
    other = evaluate_pipeline(pipeline, seed=12, **kwargs)
    assert other["seed"] == 12 and other["fd"] != row["fd"]
    # the samples of class c are the pipeline's draws of c's prompt at indices c·n .. c·n + n − 1
    seven = pipeline(
        [DIGIT_PROMPTS[7]] * N_PER_CLASS,
        num_inference_steps=4,
        guidance_scale=3.0,
        seed=11,
        sample_indices=[21, 22, 23],
    ).images
    assert np.abs(seven.astype(int) - images[21:24].astype(int)).max() <= 1


def test_suite_compares_teacher_and_students_at_one_cfg(teacher_dir, student_dir, tmp_path):
    results = evaluate_suite(
        teacher_dir,
        {"student-4step": student_dir},
        tmp_path,
        guidance_scale=3.0,
        n_per_class=N_PER_CLASS,
        seed=4,
        teacher_steps=(2, 1),
        student_steps=(None, 1),
    )
    names = [r["name"] for r in results]
    assert names == ["teacher-2step-cfg3", "teacher-1step-cfg3", "student-4step", "student-4step-1step", "real-train"]
    assert {r["seed"] for r in results} == {4} and {r["n_samples"] for r in results} == {30}
    student, student_1 = results[2], results[3]
    assert (student["model"], student["sampler"], student["steps"]) == ("student", "dmd2", 4)
    # reported at the CFG it was distilled with, sampled unguided
    assert student["guidance_scale"] == 3.0 and student["sampling_guidance_scale"] == 1.0
    assert student_1["steps"] == 1 and student_1["sigmas"] == [1.0, 0.0]
    assert results[-1]["model"] == "real" and results[-1]["accuracy"] > 0.9
    for result in results[:-1]:
        assert Path(result["grid"]) == tmp_path / f"{result['name']}.png" and Path(result["grid"]).is_file()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["name"] for r in summary["results"]] == names
    markdown = (tmp_path / "summary.md").read_text()
    assert "CFG 3, 3 samples per digit, seed 4" in markdown
    assert all(f"| {name} |" in markdown for name in names)


def test_suite_over_several_seeds_reports_means_and_std_of_the_single_seed_rows(teacher_dir, tmp_path):
    kwargs = dict(guidance_scale=3.0, n_per_class=N_PER_CLASS, teacher_steps=(1,))
    results = evaluate_suite(teacher_dir, {}, tmp_path / "multi", seeds=(4, 5), **kwargs)
    singles = [evaluate_suite(teacher_dir, {}, tmp_path / f"s{seed}", seed=seed, **kwargs) for seed in (4, 5)]
    for merged, *per_seed in zip(results, *singles):
        assert merged["seed"] == [4, 5] and merged["n_samples"] == 10 * N_PER_CLASS
        for key in ("fd", "accuracy", "precision", "recall"):
            values = [row[key] for row in per_seed]
            assert merged[key] == pytest.approx(np.mean(values), abs=1e-12), key
            assert merged[f"{key}_std"] == pytest.approx(np.std(values, ddof=1), abs=1e-12), key
    assert results[0]["grid"] == str(tmp_path / "multi" / "teacher-1step-cfg3.png")
    markdown = (tmp_path / "multi" / "summary.md").read_text()
    assert "seeds 4, 5: means ± std" in markdown and " ± " in markdown.splitlines()[-1]
    with pytest.raises(ValueError, match="distinct sample seeds"):
        evaluate_suite(teacher_dir, {}, tmp_path, seeds=(1, 1), **kwargs)


def test_eval_hook_scores_engine_images_and_saves_a_grid(student_dir, tmp_path):
    args = Namespace(
        output_dir=str(tmp_path),
        rollout_seed=7,
        diffusion_num_steps=4,
        diffusion_step_rule="dmd2",
        diffusion_guidance_scale=1.0,
    )
    records = [{"prompt": DIGIT_PROMPTS[label], "label": label} for label in range(10)]
    pipeline = load_pipeline(student_dir)
    # two samples per record, prompt-major like Sample.index = prompt_idx · n + j
    prompts = [record["prompt"] for record in records for _ in range(2)]
    images = pipeline(prompts, seed=7).images
    figures = digits_eval_hook(args, images, records, rollout_id=3)
    assert set(figures) == {"accuracy", "fd", "precision", "recall", "spread_ratio", "diversity_ratio",
                            "saturated_excess"}  # fmt: skip
    assert all(isinstance(v, float) and math.isfinite(v) for v in figures.values())
    direct = evaluate_images(images, np.repeat(np.arange(10), 2), seed=7, name="direct")
    assert figures["fd"] == direct["fd"] and figures["accuracy"] == direct["accuracy"]
    # The collapse figures against the held-out real digits of each class (pixels in [0, 1]).
    real, real_labels = load_split("heldout")
    pixels = np.asarray(images)[..., 0] / 255.0
    student = np.mean([pixels[2 * d : 2 * d + 2].std(axis=0).mean() for d in range(10)])
    reference = np.mean([(real[real_labels == d] / 255.0).std(axis=0).mean() for d in range(10)])
    assert figures["diversity_ratio"] == pytest.approx(student / reference, rel=1e-12)
    ends = lambda x: np.isin(x, (0, 255)).mean()  # noqa: E731
    assert figures["saturated_excess"] == pytest.approx(ends(np.asarray(images)) - ends(real), abs=1e-12)
    grid_path = eval_grid_path(args, 3)
    assert grid_path == tmp_path / "eval" / "rollout_3.png" and Image.open(grid_path).height == GRID_HEIGHT
    # one record per image works too; labels may sit in metadata
    per_image = [{"metadata": {"label": label}} for label in range(10) for _ in range(2)]
    assert digits_eval_hook(args, images, per_image, rollout_id=4) == figures
    with pytest.raises(ValueError, match="20 images for 3 eval records"):
        digits_eval_hook(args, images, records[:3], rollout_id=5)
    with pytest.raises(ValueError, match="eval prompt record 0 has no 'label'"):
        digits_eval_hook(args, images, [{"prompt": "x"}] * 10, rollout_id=5)


def test_benchmark_cli_prints_the_table(teacher_dir, student_dir, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("digits_eval_cli", REPO / "benchmarks" / "digits_eval.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    argv = ["--teacher", str(teacher_dir), "--student", f"s4={student_dir}", "--guidance-scale", "3"]
    argv += ["--n-per-class", "2", "--seed", "1", "--out", str(tmp_path), "--teacher-steps", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| teacher-1step-cfg3 | teacher | euler | 1 | 3 | 20 | 1 |" in out
    assert "| s4 | student | dmd2 | 4 | 3 | 20 | 1 |" in out and "| real-train |" in out
    assert (tmp_path / "summary.md").is_file()
    with pytest.raises(SystemExit):
        cli.main(["--student", "no-equals-sign", "--guidance-scale", "3", "--out", str(tmp_path)])
