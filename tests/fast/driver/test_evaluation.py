"""Train-time evaluation in the driver (``miles.driver.evaluation``): ``maybe_evaluate`` through a real engine replica
on a tiny digits pipeline, the eval image grid, and a failing eval hook in a real run."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch
from PIL import Image

from miles.driver.evaluation import eval_shard, load_eval_records, maybe_evaluate, should_evaluate
from miles.driver.run_dir import read_latest
from miles.eval.digits.data import prompt_for_label, write_digits_jsonl
from miles.eval.digits.grids import render_digit_grid
from miles.ray.engine_group import EngineGroup
from miles.utils.tracking import MetricsTracker, read_metrics
from tests.support.driver import run_main, wait_for_free_cpus
from tests.support.trainer import make_args, make_pipeline, run_spec

DIGITS_HOOK = "miles.eval.digits.digits_eval_hook"
LABELS = [3, 7, 0, 9, 1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("driver_eval")
    pipeline = make_pipeline(root / "digits")
    (root / "data.jsonl").write_text("".join(json.dumps({"prompt": prompt_for_label(d)}) + "\n" for d in range(10)))
    eval_data = root / "eval_prompts.jsonl"
    eval_data.write_text("".join(json.dumps({"prompt": prompt_for_label(d), "label": d}) + "\n" for d in LABELS))
    return pipeline, root, eval_data


def _eval_args(setup, run_dir: Path, **overrides):
    pipeline, root, eval_data = setup
    extra = ["--eval-interval", "2", "--eval-prompt-data", str(eval_data), "--eval-n-samples-per-prompt", "2"]
    args = make_args(pipeline, root, *extra, "--num-rollout", "5", train_only=False)
    args.output_dir = str(run_dir)
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


@pytest.fixture(scope="module")
def sampler(ray_cluster, setup):
    """One engine replica of the student (anything with ``evaluate(shard)`` samples for ``maybe_evaluate``; the
    actor group's ranks do it the same way)."""
    pg = ray.util.placement_group([{"CPU": 1}])
    ray.get(pg.ready())
    engines = EngineGroup(run_spec(_eval_args(setup, setup[1] / "engine")), (pg, [0]), num_gpus=0.0, num_cpus=1)
    yield engines
    for engine in engines.engines:
        ray.kill(engine)
    ray.util.remove_placement_group(pg)


def test_should_evaluate_at_the_interval_and_the_last_rollout_only():
    fires = lambda interval, n: [r for r in range(n) if should_evaluate(  # noqa: E731
        SimpleNamespace(eval_interval=interval, num_rollout=n), r)]  # fmt: skip
    assert fires(2, 5) == [1, 3, 4]
    assert fires(2, 6) == [1, 3, 5]
    assert fires(3, 7) == [2, 5, 6]
    assert fires(1, 3) == [0, 1, 2]
    assert fires(10, 4) == [3]
    assert fires(None, 4) == []


def test_load_eval_records_repeats_each_record_per_sample(setup, tmp_path):
    args = _eval_args(setup, tmp_path)
    records = load_eval_records(args)
    assert [r["label"] for r in records] == [label for label in LABELS for _ in range(2)]
    # Without --eval-prompt-data the training prompts are the eval prompts.
    args.eval_prompt_data = None
    assert [r["prompt"] for r in load_eval_records(args)][:4] == [prompt_for_label(0)] * 2 + [prompt_for_label(1)] * 2


def test_the_eval_set_is_capped_to_evenly_spaced_prompts(setup, tmp_path):
    from miles.driver.evaluation import eval_prompt_indices

    assert eval_prompt_indices(5, 100) == [0, 1, 2, 3, 4]
    assert eval_prompt_indices(100, 10) == list(range(0, 100, 10))  # one per digit of a file sorted by digit
    assert eval_prompt_indices(7, 3) == [0, 2, 4]
    args = _eval_args(setup, tmp_path, eval_max_prompts=2)
    assert [r["label"] for r in load_eval_records(args)] == [3, 3, 0, 0]  # positions 0 and 2 of LABELS, twice


def test_a_hook_that_returns_no_dict_of_numbers_is_one_line_naming_it(setup, tmp_path):
    from miles.driver.evaluation import EvalHookError, _run_hook
    from tests.support.trainer import list_eval_hook, tensor_eval_hook

    args = _eval_args(setup, tmp_path)
    images = torch.zeros(2, 8, 8, 1, dtype=torch.uint8)
    with pytest.raises(EvalHookError) as exc_info:
        _run_hook(list_eval_hook, args, images, [{}, {}], 3)
    assert exc_info.value.summary == (
        "eval hook tests.support.trainer.list_eval_hook returned list after rollout 3; expected a dict of metric "
        "name -> number"
    )
    assert _run_hook(tensor_eval_hook, args, images, [{}, {}], 3) == {"mean": torch.tensor(0.0), "count": 2}


def test_a_fresh_run_moves_an_earlier_runs_eval_images_aside(tmp_path):
    from miles.driver.evaluation import move_aside_earlier_eval

    assert move_aside_earlier_eval(tmp_path) is None
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "rollout_1.png").write_bytes(b"first")
    assert move_aside_earlier_eval(tmp_path) == tmp_path / "eval.earlier"
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "rollout_1.png").write_bytes(b"second")
    assert move_aside_earlier_eval(tmp_path) == tmp_path / "eval.earlier.1"
    assert (tmp_path / "eval.earlier" / "rollout_1.png").read_bytes() == b"first"
    assert (tmp_path / "eval.earlier.1" / "rollout_1.png").read_bytes() == b"second"


def test_eval_shard_has_fixed_indices_so_fixed_noise(setup, tmp_path):
    args = _eval_args(setup, tmp_path)
    shard = eval_shard(args, load_eval_records(args))
    assert shard.rollout_id == "eval" and shard.sample_indices == list(range(10))
    assert shard.prompts == [prompt_for_label(label) for label in LABELS for _ in range(2)]
    assert shard.base_dir == str(setup[2].parent)


def test_maybe_evaluate_saves_the_digit_grid_and_logs_the_figures_with_its_path(setup, sampler, tmp_path):
    args = _eval_args(setup, tmp_path / "run", eval_function_path=DIGITS_HOOK)
    tracker = MetricsTracker(args, job="driver")
    hook = run_spec(args).eval_hook  # imported once by the driver
    for rollout_id in range(args.num_rollout):
        maybe_evaluate(args, rollout_id, sampler, tracker, eval_hook=hook)
    eval_dir = Path(args.output_dir) / "eval"
    assert sorted(p.name for p in eval_dir.iterdir()) == ["rollout_1.png", "rollout_3.png", "rollout_4.png"]

    records = read_metrics(args.output_dir)
    assert [r["rollout_id"] for r in records] == [1, 3, 4]
    for record in records:
        assert record["job"] == "driver"
        assert record["eval/samples"] == str(eval_dir / f"rollout_{record['rollout_id']}.png")
        for name in ("accuracy", "fd", "precision", "recall", "spread_ratio"):
            assert isinstance(record[f"eval/{name}"], float) and math.isfinite(record[f"eval/{name}"]), name
        assert 0.0 <= record["eval/accuracy"] <= 1.0
    # The engine's weights did not change between evaluations and the sample indices are fixed: same figures.
    assert {k: v for k, v in records[0].items() if k.startswith("eval/") and k != "eval/samples"} == {
        k: v for k, v in records[2].items() if k.startswith("eval/") and k != "eval/samples"
    }

    # The saved grid is the digits hook's: one row per digit, two samples each, exactly the engine's eval images.
    images = sampler.evaluate(eval_shard(args, load_eval_records(args)))
    assert images.shape == (10, 8, 8, 1) and images.dtype == torch.uint8
    expected = render_digit_grid(images, np.repeat(LABELS, 2), per_row=2, title="rollout_3: 4 steps")
    saved = Image.open(eval_dir / "rollout_3.png")
    assert saved.size == expected.size
    assert np.array_equal(np.asarray(saved), np.asarray(expected))


def test_maybe_evaluate_without_a_hook_saves_the_plain_image_grid(setup, sampler, tmp_path):
    args = _eval_args(setup, tmp_path / "run", eval_interval=5)
    maybe_evaluate(args, 3, sampler, MetricsTracker(args, job="driver"))
    assert not (Path(args.output_dir) / "eval").exists()  # rollout 3 is neither a multiple of 5 nor the last
    maybe_evaluate(args, 4, sampler, MetricsTracker(args, job="driver"))
    grid = Path(args.output_dir) / "eval" / "rollout_4.png"
    [record] = read_metrics(args.output_dir)
    assert record["eval/samples"] == str(grid) and not any(
        k.startswith("eval/") and k != "eval/samples" for k in record
    )
    # 10 images of 8x8 upscaled 6x, 10 per row, 4 px spacing: 4 + 10·52 wide, 4 + 52 high.
    saved = np.asarray(Image.open(grid))
    assert saved.shape == (56, 524)
    images = sampler.evaluate(eval_shard(args, load_eval_records(args)))
    for i in range(10):
        cell = saved[4 : 4 + 48, 4 + i * 52 : 4 + i * 52 + 48]
        assert np.array_equal(cell, np.kron(images[i, ..., 0].numpy(), np.ones((6, 6), dtype=np.uint8))), i


def test_a_failing_eval_hook_does_not_cost_the_rollouts_checkpoint(ray_cluster, setup, tmp_path, capsys):
    """A real run of the driver: the last rollout is saved before its evaluation runs (and fails), and the run ends
    the actors and placement groups it started on the session's cluster (1 CPU per rank: the module's engine
    replica holds one of the cluster's 4)."""
    pipeline, root, eval_data = setup
    train = write_digits_jsonl(tmp_path / "data", prompt_repeats=1)["train"]
    free = ray.available_resources().get("CPU")
    argv = [
        "--train-only", "--hf-checkpoint", str(pipeline), "--prompt-data", str(train),
        "--actor-num-gpus-per-node", "2", "--num-cpus-per-rank", "1", "--rollout-batch-size", "4", "--num-rollout", "2",
        "--save", str(tmp_path / "ckpt"), "--eval-interval", "5", "--eval-prompt-data", str(eval_data),
        "--eval-function-path", "tests.support.trainer.failing_eval_hook", "--output-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc_info:
        run_main(argv)
    err = capsys.readouterr().err
    assert exc_info.value.code == 1
    (line,) = [line for line in err.splitlines() if line.startswith("train_diffusion.py: error: ")]
    assert line == (
        "train_diffusion.py: error: eval hook tests.support.trainer.failing_eval_hook failed after rollout 1: "
        "RuntimeError: eval hook failed after rollout 1"
    )
    assert "in failing_eval_hook" in err[err.index(line) :]  # the hook's own traceback below the line
    assert read_latest(tmp_path / "ckpt") == 1
    assert not (tmp_path / "ckpt" / "rollout_0").exists()  # saves at the last rollout only (no --save-interval)
    records = read_metrics(tmp_path / "run")
    # Rollout 0 finished (its perf record is written); rollout 1 failed in its evaluation, after the train records.
    assert [r["rollout_id"] for r in records if "perf/step_time" in r] == [0]
    assert [r["rollout_id"] for r in records if "train/loss" in r] == [0, 1]
    assert wait_for_free_cpus(free) == free
