"""The space estimate of the preflight against a nearly full disk, and what --overwrite-save removes.

A disk with less free space than a checkpoint cannot be made here without root, so ``shutil.disk_usage`` is the
one stand-in (the only mock of these tests); every other part is real: parsed args, a digits pipeline whose
safetensors headers give the size, the directories on the real filesystem.
"""

import logging
import shutil
from collections import namedtuple

import pytest

from miles.driver import preflight_outputs
from miles.driver.preflight_outputs import denoiser_numel
from miles.driver.run_dir import checkpoint_entries, remove_checkpoints
from miles.utils.validation import ArgumentValidationError
from tests.support.inputs import checkpoint_layout, write_digit_records
from tests.support.trainer import make_args, make_pipeline

Usage = namedtuple("Usage", "total used free")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return make_pipeline(tmp_path_factory.mktemp("space") / "digits")


def _args(pipeline, tmp_path, *extra):
    write_digit_records(tmp_path / "data.jsonl", 8)
    return make_args(pipeline, tmp_path, "--save", str(tmp_path / "ckpt"), "--num-rollout", "10", *extra)


def _with_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * free, 9 * free, free))


def test_the_estimate_is_weights_and_adam_moments_of_every_kept_checkpoint(pipeline, tmp_path):
    numel = denoiser_numel(str(pipeline))
    assert 50_000 < numel < 500_000  # the 2-layer digits denoiser, read from its safetensors header
    (need,) = preflight_outputs.estimate_needs(_args(pipeline, tmp_path, "--save-interval", "1")).values()
    one = int(numel * 4 * 3 * 1.05)
    assert need["one"] == one and need["all"] == 10 * one
    (kept,) = preflight_outputs.estimate_needs(
        _args(pipeline, tmp_path, "--save-interval", "1", "--save-keep-last", "2")
    ).values()
    assert kept["all"] == 3 * one  # the new one is written before the oldest is pruned


def test_a_disk_without_room_for_one_checkpoint_is_refused_and_a_tight_one_warned(
    pipeline, tmp_path, monkeypatch, caplog
):
    args = _args(pipeline, tmp_path, "--save-interval", "1")
    (need,) = preflight_outputs.estimate_needs(args).values()
    _with_free(monkeypatch, need["one"] - 1)
    with pytest.raises(ArgumentValidationError, match=rf"--save {tmp_path / 'ckpt'}: .* MB free on its filesystem, "
                       "but one checkpoint needs about"):  # fmt: skip
        preflight_outputs.check_disk_space(args)
    _with_free(monkeypatch, need["one"] * 2)
    with caplog.at_level(logging.WARNING, logger="miles.driver.preflight_outputs"):
        preflight_outputs.check_disk_space(args)
    assert "the run's checkpoints need about" in caplog.text and "--save-keep-last N bounds them" in caplog.text


def test_overwrite_save_removes_only_the_checkpoint_entries(tmp_path):
    save = tmp_path / "ckpt"
    checkpoint_layout(save, 3)
    (save / ".tmp_rollout_4").mkdir()
    (save / "notes.txt").write_text("mine")
    (save / "rollout_notes").mkdir()  # not a name checkpoint.py writes
    assert checkpoint_entries(save) == [".tmp_rollout_4", "latest", "rollout_3"]
    removed = remove_checkpoints([save, tmp_path / "ckpt_critic"])
    assert [path.name for path in removed] == ["latest", ".tmp_rollout_4", "rollout_3"]  # the commit goes first
    assert sorted(path.name for path in save.iterdir()) == ["notes.txt", "rollout_notes"]
