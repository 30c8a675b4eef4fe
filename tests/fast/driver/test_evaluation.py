"""Train-time evaluation in the driver: ``maybe_evaluate`` through a real RolloutManager actor on a tiny digits
pipeline, the eval image grid, and the tracker's image records."""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

# trainer_support lives next to this file; train_diffusion.py is a script at the repository root.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

from trainer_support import make_args, make_pipeline, ray_session  # noqa: E402

import train_diffusion  # noqa: E402
from miles.eval.digits.data import prompt_for_label  # noqa: E402
from miles.eval.digits.grids import render_digit_grid  # noqa: E402
from miles.eval.grids import save_image_grid  # noqa: E402
from miles.utils.tracking import MetricsTracker, read_metrics  # noqa: E402

DIGITS_HOOK = "miles.eval.digits.digits_eval_hook"
LABELS = [3, 7, 0, 9, 1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("driver_eval")
    pipeline = make_pipeline(root / "digits")
    (root / "data.jsonl").write_text("".join(json.dumps({"prompt": prompt_for_label(d)}) + "\n" for d in range(10)))
    eval_data = root / "eval_prompts.jsonl"
    eval_data.write_text("".join(json.dumps({"prompt": prompt_for_label(d), "label": d}) + "\n" for d in LABELS))
    with ray_session(num_cpus=4):
        yield pipeline, root, eval_data


def _eval_args(setup, run_dir: Path, **overrides):
    pipeline, root, eval_data = setup
    extra = ["--eval-interval", "2", "--eval-prompt-data", str(eval_data), "--eval-n-samples-per-prompt", "2"]
    args = make_args(pipeline, root, *extra, "--num-rollout", "5", train_only=False)
    args.output_dir = str(run_dir)
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def _manager(args):
    from miles.ray.rollout import RayRolloutManager

    return RayRolloutManager.remote(args, 2)


def test_should_evaluate_at_the_interval_and_the_last_rollout_only():
    fires = lambda interval, n: [r for r in range(n) if train_diffusion.should_evaluate(  # noqa: E731
        SimpleNamespace(eval_interval=interval, num_rollout=n), r)]  # fmt: skip
    assert fires(2, 5) == [1, 3, 4]
    assert fires(2, 6) == [1, 3, 5]
    assert fires(3, 7) == [2, 5, 6]
    assert fires(1, 3) == [0, 1, 2]
    assert fires(10, 4) == [3]
    assert fires(None, 4) == []


def test_load_eval_records_repeats_each_record_per_sample(setup, tmp_path):
    args = _eval_args(setup, tmp_path)
    records = train_diffusion.load_eval_records(args)
    assert [r["label"] for r in records] == [label for label in LABELS for _ in range(2)]
    # Without --eval-prompt-data the training prompts are the eval prompts.
    args.eval_prompt_data = None
    assert [r["prompt"] for r in train_diffusion.load_eval_records(args)][:4] == [prompt_for_label(0)] * 2 + [
        prompt_for_label(1)
    ] * 2


def test_maybe_evaluate_saves_the_digit_grid_and_logs_the_figures_with_its_path(setup, tmp_path):
    import ray

    args = _eval_args(setup, tmp_path / "run", eval_function_path=DIGITS_HOOK)
    manager = _manager(args)
    tracker = MetricsTracker(args, job="driver")
    for rollout_id in range(args.num_rollout):
        train_diffusion.maybe_evaluate(args, rollout_id, manager, tracker)
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
    prompts = [prompt_for_label(label) for label in LABELS for _ in range(2)]
    images = ray.get(manager.evaluate.remote(prompts, list(range(len(prompts)))))
    assert images.shape == (10, 8, 8, 1) and images.dtype == torch.uint8
    expected = render_digit_grid(images, np.repeat(LABELS, 2), per_row=2, title="rollout_3: 4 steps")
    saved = Image.open(eval_dir / "rollout_3.png")
    assert saved.size == expected.size
    assert np.array_equal(np.asarray(saved), np.asarray(expected))
    ray.kill(manager)


def test_maybe_evaluate_without_a_hook_saves_the_plain_image_grid(setup, tmp_path):
    import ray

    args = _eval_args(setup, tmp_path / "run", eval_interval=5)
    manager = _manager(args)
    train_diffusion.maybe_evaluate(args, 3, manager, MetricsTracker(args, job="driver"))
    assert not (Path(args.output_dir) / "eval").exists()  # rollout 3 is neither a multiple of 5 nor the last
    train_diffusion.maybe_evaluate(args, 4, manager, MetricsTracker(args, job="driver"))
    grid = Path(args.output_dir) / "eval" / "rollout_4.png"
    [record] = read_metrics(args.output_dir)
    assert record["eval/samples"] == str(grid) and not any(
        k.startswith("eval/") and k != "eval/samples" for k in record
    )
    # 10 images of 8x8 upscaled 6x, 10 per row, 4 px spacing: 4 + 10·52 wide, 4 + 52 high.
    saved = np.asarray(Image.open(grid))
    assert saved.shape == (56, 524)
    images = ray.get(
        manager.evaluate.remote([prompt_for_label(label) for label in LABELS for _ in range(2)], list(range(10)))
    )
    for i in range(10):
        cell = saved[4 : 4 + 48, 4 + i * 52 : 4 + i * 52 + 48]
        assert np.array_equal(cell, np.kron(images[i, ..., 0].numpy(), np.ones((6, 6), dtype=np.uint8))), i
    ray.kill(manager)


def test_save_image_grid_pixel_layout(tmp_path):
    gen = torch.Generator().manual_seed(0)
    rgb = torch.randint(0, 256, (5, 3, 4, 3), dtype=torch.uint8, generator=gen)  # 5 images of 3x4, RGB
    path = save_image_grid(rgb, tmp_path / "nested" / "grid.png", per_row=2, scale=3, spacing=1)
    assert path == str(tmp_path / "nested" / "grid.png")
    grid = np.asarray(Image.open(path))
    cell_h, cell_w = 9, 12
    assert grid.shape == (1 + 3 * (cell_h + 1), 1 + 2 * (cell_w + 1), 3)
    background = np.ones(grid.shape[:2], dtype=bool)
    for i in range(5):
        top, left = 1 + (i // 2) * (cell_h + 1), 1 + (i % 2) * (cell_w + 1)
        upscaled = rgb[i].numpy().repeat(3, axis=0).repeat(3, axis=1)
        assert np.array_equal(grid[top : top + cell_h, left : left + cell_w], upscaled), i
        background[top : top + cell_h, left : left + cell_w] = False
    # Spacing and the empty sixth cell are white.
    assert (grid[background] == 255).all()

    # Grayscale [N, H, W] gives a mode-"L" PNG; the default scale makes 8-pixel digits 48 pixels wide.
    gray = np.arange(2 * 8 * 8, dtype=np.uint8).reshape(2, 8, 8)
    image = Image.open(save_image_grid(gray, tmp_path / "gray.png"))
    assert image.mode == "L" and image.size == (4 + 2 * 52, 4 + 52)
    assert np.array_equal(np.asarray(image)[4:52, 56:104], np.kron(gray[1], np.ones((6, 6), dtype=np.uint8)))
    with pytest.raises(ValueError, match="0 images"):
        save_image_grid(np.zeros((0, 8, 8), dtype=np.uint8), tmp_path / "empty.png")
    with pytest.raises(ValueError, match="per_row=0"):
        save_image_grid(gray, tmp_path / "bad.png", per_row=0)


def test_tracker_records_image_paths_and_sends_them_to_wandb_as_media(tmp_path, monkeypatch):
    png = save_image_grid(np.full((1, 8, 8), 128, dtype=np.uint8), tmp_path / "grid.png")
    args = SimpleNamespace(output_dir=str(tmp_path / "run"), use_wandb=False)
    MetricsTracker(args, job="driver").log({"eval/accuracy": 0.5}, 7, images={"eval/samples": Path(png)})
    [record] = read_metrics(args.output_dir)
    assert (record["rollout_id"], record["eval/accuracy"], record["eval/samples"]) == (7, 0.5, png)

    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb_args = SimpleNamespace(output_dir=str(tmp_path / "wb"), use_wandb=True, wandb_project="miles-test")
    tracker = MetricsTracker(wandb_args, job="driver")
    try:
        tracker.log({"eval/accuracy": 0.25}, 2, images={"eval/samples": png})
        run_dir = Path(tracker._wandb_run.dir)
    finally:
        tracker.finish()
    assert read_metrics(wandb_args.output_dir)[0]["eval/samples"] == png
    # wandb copies logged images into the run's media folder.
    assert list((run_dir / "media" / "images").glob("eval/samples_*.png"))


def test_a_failing_eval_hook_does_not_cost_the_rollouts_checkpoint(setup, monkeypatch):
    import ray

    calls = []

    class _Method:
        def __init__(self, name, value):
            self.name, self.value = name, value

        def remote(self, *args):
            calls.append(self.name)
            return ray.put(self.value)

    class _Group:
        def async_train(self, rollout_id, refs, external_data):
            calls.append(f"train {rollout_id}")
            return [ray.put(None)]

        def async_save(self, rollout_id, data_state):
            calls.append(f"save {rollout_id}")
            return [ray.put(None)]

        def async_update_weights(self, rollout_manager):
            calls.append("push")
            return [ray.put(None)]

    def failing_eval(args, rollout_id, rollout_manager, tracker):
        if train_diffusion.should_evaluate(args, rollout_id):
            raise RuntimeError("eval hook failed")

    monkeypatch.setattr(train_diffusion, "maybe_evaluate", failing_eval)
    manager = SimpleNamespace(generate=_Method("generate", []), state_dict=_Method("state_dict", {}))
    args = SimpleNamespace(
        num_rollout=2, train_only=True, rollout_num_gpus=0, save="/ckpt", save_interval=None, eval_interval=5
    )
    tracker = SimpleNamespace(log=lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="eval hook failed"):
        train_diffusion.run_rollouts(args, manager, {"actor": _Group()}, 0, tracker)
    # The last rollout is saved before its evaluation runs (and fails).
    assert calls == ["generate", "train 0", "generate", "train 1", "state_dict", "save 1", "push"]
