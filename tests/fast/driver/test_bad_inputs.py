"""Bad inputs, tried the way a new user would: every one fails with one line that names the flag or path, the
right exit code, no traceback for a user error, and not one pre-existing file changed.

Two tables. ``COMMANDS``: flags, numbers, hook paths, data files, pipelines, checkpoints and output paths that the
checks before Ray reject; each runs ``train_diffusion.py`` as a command (a forked child of one warmed-up
interpreter, :mod:`tests.support.cli`; exit code 2). ``RUN_TIME``: hooks that return what the trainer cannot use,
or raise, or kill their process; each runs ``train_diffusion.main`` in the session's Ray cluster (exit code 1,
one line naming the group, rank, method and rollout).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cli import run_commands
from tests.support.driver import run_main
from tests.support.inputs import (
    checkpoint_layout,
    copy_pipeline,
    poison_weight,
    tree_hashes,
    truncate_weights,
    write_digit_records,
)
from tests.support.trainer import make_pipeline

PREFIX = "train_diffusion.py: error: "


@dataclass
class World:
    """What every case shares (never written by a case): a digits pipeline and data files."""

    root: Path
    pipeline: Path
    train: Path
    prompts: Path


def sft(w: World, d: Path, *extra: str) -> list[str]:
    return [
        "--loss-type", "sft_loss", "--train-only", "--hf-checkpoint", str(w.pipeline), "--prompt-data", str(w.train),
        "--rollout-batch-size", "8", "--micro-batch-size", "4", "--num-rollout", "2", "--output-dir", str(d / "out"),
        *extra,
    ]  # fmt: skip


def dmd2(w: World, d: Path, *extra: str) -> list[str]:
    return [
        "--loss-type", "dmd2", "--hf-checkpoint", str(w.pipeline), "--teacher-load", str(w.pipeline),
        "--prompt-data", str(w.prompts), "--rollout-batch-size", "4", "--micro-batch-size", "2",
        "--dmd2-critic-steps-per-rollout", "2", "--num-rollout", "2", "--output-dir", str(d / "out"), *extra,
    ]  # fmt: skip


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def flag_case(*extra: str, base=sft, message: str):
    return lambda w, d: (base(w, d, *extra), message)


# -- the cases the checks before Ray reject ---------------------------------------------------------------------
# Each builds its inputs in its own directory d and returns (argv, the message its one line must hold).


def _bad_json_line(w, d):
    data = write(d / "data.jsonl", json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b"}) + "\n{oops\n")
    return sft(w, d, "--prompt-data", str(data)), f"--prompt-data {data}:3 is not valid JSON"


def _record_without_prompt(w, d):
    data = write(
        d / "data.jsonl", json.dumps({"prompt": "a", "image": [[0]]}) + "\n" + json.dumps({"text": "b"}) + "\n"
    )
    return sft(w, d, "--prompt-data", str(data)), f"--prompt-data {data}:2 has no field 'prompt'"


def _record_without_image(w, d):
    data = write_digit_records(d / "data.jsonl", 4)
    lines = data.read_text().splitlines()
    lines[1] = json.dumps({"prompt": "a handwritten digit one"})
    data.write_text("\n".join(lines) + "\n")
    return sft(w, d, "--prompt-data", str(data)), "record 2 (prompt 'a handwritten digit one') has no image"


def _image_out_of_range(w, d):
    record = {"prompt": "a", "image": [[300] * 8] * 8}
    data = write(d / "data.jsonl", json.dumps(record) + "\n")
    return sft(w, d, "--prompt-data", str(data)), "record 1 (prompt 'a'): image values must be in 0..255"


def _eval_data_bad(w, d):
    data = write(d / "eval.jsonl", "not json\n")
    argv = sft(w, d, "--eval-interval", "1", "--eval-prompt-data", str(data))
    return argv, f"--eval-prompt-data {data}:1 is not valid JSON"


def _gan_real_data_without_image(w, d):
    data = write(d / "real.jsonl", json.dumps({"prompt": "a digit"}) + "\n")
    argv = dmd2(w, d, "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-real-data", str(data))
    return argv, f"--dmd2-gan-real-data {data} record 1 (prompt 'a digit') has no image under --image-key 'image' nor"


def _negative_cond_missing(w, d):
    return (
        sft(w, d, "--negative-cond", str(d / "neg.safetensors")),
        f"--negative-cond {d / 'neg.safetensors'} does not",
    )


def _pipeline_corrupt_index(w, d):
    pipe = copy_pipeline(w.pipeline, d / "pipe")
    (pipe / "model_index.json").write_text("{ broken")
    return sft(w, d, "--hf-checkpoint", str(pipe)), f"--hf-checkpoint {pipe} is not a usable pipeline directory"


def _pipeline_nan_weight(w, d):
    pipe = copy_pipeline(w.pipeline, d / "pipe")
    name = poison_weight(pipe)
    message = f"--hf-checkpoint {pipe}: diffusion_pytorch_model.safetensors tensor {name} holds 1 non-finite values"
    return sft(w, d, "--hf-checkpoint", str(pipe)), message


def _teacher_nan_weight(w, d):
    pipe = copy_pipeline(w.pipeline, d / "teacher")
    poison_weight(pipe)
    return dmd2(w, d, "--teacher-load", str(pipe)), f"--teacher-load {pipe}: diffusion_pytorch_model.safetensors"


def _pipeline_truncated(w, d):
    pipe = copy_pipeline(w.pipeline, d / "pipe")
    truncate_weights(pipe)
    return sft(w, d, "--hf-checkpoint", str(pipe)), f"--hf-checkpoint {pipe}: {pipe}/transformer/"


def _pipeline_without_weights(w, d):
    pipe = copy_pipeline(w.pipeline, d / "pipe")
    for path in (pipe / "transformer").glob("*.safetensors"):
        path.unlink()
    return sft(w, d, "--hf-checkpoint", str(pipe)), f"--hf-checkpoint {pipe}: {pipe}/transformer holds no weights"


def _pipeline_with_bin_weights(w, d):
    pipe = copy_pipeline(w.pipeline, d / "pipe")
    for path in (pipe / "transformer").glob("*.safetensors"):
        path.rename(path.with_suffix(".bin"))  # a pickled checkpoint's name; preflight refuses it by its name
    return sft(w, d, "--hf-checkpoint", str(pipe)), f"--hf-checkpoint {pipe}: {pipe}/transformer holds .bin weights"


def _teacher_other_token_length(w, d):
    teacher = make_pipeline_like(d / "teacher", max_length=8)
    message = f"--teacher-load {teacher} does not fit --hf-checkpoint {w.pipeline}: text token length (max_length) 8"
    return dmd2(w, d, "--teacher-load", str(teacher)), message


def _critic_other_channels(w, d):
    critic = make_pipeline_like(d / "critic", in_channels=2)
    message = f"--critic-load {critic} does not fit --hf-checkpoint {w.pipeline}: latent channels (in_channels) 2"
    return dmd2(w, d, "--critic-load", str(critic)), message


def make_pipeline_like(path: Path, **config) -> Path:
    from miles.models.digits import init_digits_pipeline

    return init_digits_pipeline(path, seed=0, num_layers=2, attention_head_dim=8, **config)


def _load_without_latest(w, d):
    checkpoint_layout(d / "ckpt", 0, commit=False)
    return sft(w, d, "--load", str(d / "ckpt")), f"--load {d / 'ckpt'}: no 'latest' file"


def _load_corrupt_latest(w, d):
    write(d / "ckpt" / "latest", "two\n")
    return sft(w, d, "--load", str(d / "ckpt")), f"--load {d / 'ckpt'}: 'latest' holds 'two', not a rollout id"


def _load_latest_names_missing_rollout(w, d):
    checkpoint_layout(d / "ckpt", 0)
    (d / "ckpt" / "latest").write_text("5\n")
    return sft(w, d, "--load", str(d / "ckpt")), f"--load {d / 'ckpt'} committed rollout 5, but checkpoint"


def _load_past_num_rollout(w, d):
    checkpoint_layout(d / "ckpt", 1)
    argv = sft(w, d, "--load", str(d / "ckpt"), "--num-rollout", "2")
    return argv, f"--load {d / 'ckpt'} committed rollout 1, the last of --num-rollout 2: nothing is left to train"


def _load_without_critic_checkpoint(w, d):
    checkpoint_layout(d / "ckpt", 0)
    message = f"--load {d / 'ckpt'} committed rollout 0, but checkpoint {d / 'ckpt_critic' / 'rollout_0'} is missing"
    return dmd2(w, d, "--load", str(d / "ckpt")), message


def _save_holds_another_run(w, d):
    checkpoint_layout(d / "ckpt", 7)
    argv = sft(w, d, "--save", str(d / "ckpt"))
    return argv, f"--save {d / 'ckpt'} holds checkpoints of another run (latest, rollout_7); resume it with --load"


def _critic_save_holds_another_run(w, d):
    checkpoint_layout(d / "ckpt_critic", 3, commit=False)
    argv = dmd2(w, d, "--save", str(d / "ckpt"))
    return argv, f"the critic group's --save {d / 'ckpt_critic'} holds checkpoints of another run (rollout_3)"


def _save_into_another_runs_critic_directory(w, d):
    # Run X's critic checkpoints, whose commit lives in X: nothing here is "uncommitted" to delete.
    checkpoint_layout(d / "run", 1)
    checkpoint_layout(d / "run_critic", 1, commit=False)
    argv = sft(w, d, "--save", str(d / "run_critic"))
    return argv, "a run whose commit lives in a sibling directory (X_critic belongs to the run saved in X)"


def _empty_hook_path(w, d):
    return sft(w, d, "--custom-loss-function-path", ""), "--custom-loss-function-path is empty"


def _overwrite_save_what_load_resumes(w, d):
    checkpoint_layout(d / "ckpt", 0)
    argv = sft(w, d, "--load", str(d / "ckpt"), "--save", str(d / "ckpt"), "--overwrite-save")
    return (
        argv,
        f"--overwrite-save would remove --save {d / 'ckpt'}, the actor group's checkpoints that --load {d / 'ckpt'}",
    )


def _overwrite_save_of_the_critic_that_load_resumes(w, d):
    # --save X_critic beside --load X: the new actor directory is the old run's critic directory.
    checkpoint_layout(d / "ckpt", 1)
    checkpoint_layout(d / "ckpt_critic", 1, commit=False)
    argv = dmd2(w, d, "--load", str(d / "ckpt"), "--save", str(d / "ckpt_critic"), "--overwrite-save")
    return (
        argv,
        f"--overwrite-save would remove --save {d / 'ckpt_critic'}, the critic group's checkpoints that --load",
    )


def _save_hf_is_save(w, d):
    return sft(w, d, "--save", str(d / "ckpt"), "--save-hf", str(d / "ckpt")), f"--save-hf {d / 'ckpt'} is also --save"


def _save_hf_contains_run(w, d):
    argv = sft(w, d, "--save", str(d / "run" / "ckpt"), "--output-dir", str(d / "run" / "logs"), "--save-hf",
               str(d / "run"))  # fmt: skip
    return argv, f"--save-hf {d / 'run'} contains --save {d / 'run' / 'ckpt'}"


def _save_hf_inside_model(w, d):
    return sft(w, d, "--save-hf", str(w.pipeline / "student")), f"--save-hf {w.pipeline / 'student'} lies inside"


def _save_hf_is_critic_save(w, d):
    argv = dmd2(w, d, "--save", str(d / "ckpt"), "--save-hf", str(d / "ckpt_critic"))
    return argv, f"--save-hf {d / 'ckpt_critic'} is also the critic group's --save"


def _save_hf_not_a_pipeline(w, d):
    write(d / "student" / "notes.txt", "mine\n")
    argv = sft(w, d, "--save-hf", str(d / "student"), "--overwrite-save-hf")
    return argv, f"--save-hf {d / 'student'} exists and is not a pipeline directory"


def _save_hf_pipeline_without_overwrite(w, d):
    copy_pipeline(w.pipeline, d / "student")
    return sft(w, d, "--save-hf", str(d / "student")), "holds a pipeline already; add --overwrite-save-hf"


def _keep_best_export_holds_a_pipeline(w, d):
    copy_pipeline(w.pipeline, d / "student-best")
    argv = sft(w, d, "--save-hf", str(d / "student"), "--eval-interval", "1", "--keep-best", "fd:min")
    return argv, f"--keep-best's export {d / 'student-best'} holds a pipeline already; add --overwrite-save-hf"


def _regression_pairs_missing(w, d):
    argv = dmd2(w, d, "--dmd2-regression-weight", "0.25", "--dmd2-regression-pairs", str(d / "pairs.jsonl"))
    return argv, f"error: --dmd2-regression-pairs {d / 'pairs.jsonl'} does not exist"


def _save_hf_pipeline_with_user_files(w, d):
    copy_pipeline(w.pipeline, d / "student")
    write(d / "student" / "notes.txt", "mine\n")
    argv = sft(w, d, "--save-hf", str(d / "student"), "--overwrite-save-hf")
    return argv, f"--save-hf {d / 'student'} holds notes.txt, not part of the pipeline the export writes"


def _save_hf_pipeline_with_user_files_in_a_component(w, d):
    copy_pipeline(w.pipeline, d / "student")
    write(d / "student" / "transformer" / "notes.txt", "mine\n")
    argv = sft(w, d, "--save-hf", str(d / "student"), "--overwrite-save-hf")
    return argv, f"--save-hf {d / 'student'} holds transformer/notes.txt, not part of the pipeline the export writes"


def _save_under_a_file(w, d):
    write(d / "file", "x")
    return sft(w, d, "--save", str(d / "file" / "ckpt")), f"--save {d / 'file' / 'ckpt'} is not writable"


def _output_dir_is_a_file(w, d):
    write(d / "file", "x")
    return sft(w, d, "--output-dir", str(d / "file")), f"--output-dir {d / 'file'} is a file"


def _profile_dir_is_a_file(w, d):
    # Without the check the first traced rollout would fail inside every worker, after its work.
    write(d / "file", "x")
    argv = sft(w, d, "--profile-rollouts", "1", "--profile-dir", str(d / "file"))
    return argv, f"--profile-dir {d / 'file'} is a file"


def _save_hf_unwritable(w, d):
    # Nobody, root included, creates files in /proc: the export would fail only after the whole training.
    return sft(w, d, "--save-hf", "/proc/miles_export"), "--save-hf /proc/miles_export is not writable"


def _prompt_data_gzip(w, d):
    import gzip

    data = d / "data.jsonl.gz"
    data.write_bytes(gzip.compress(w.train.read_bytes()))
    return sft(w, d, "--prompt-data", str(data)), f"--prompt-data {data} is gzip-compressed; decompress it"


def _prompt_data_not_utf8(w, d):
    data = d / "data.jsonl"
    data.write_bytes(w.prompts.read_bytes().splitlines(keepends=True)[0] + '{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    return dmd2(w, d, "--prompt-data", str(data)), f"--prompt-data {data}:2 is not UTF-8 text"


def _model_index(text: str, kind: str):
    def build(w, d):
        pipe = copy_pipeline(w.pipeline, d / "pipe")
        (pipe / "model_index.json").write_text(text)
        message = f"--hf-checkpoint {pipe} is not a usable pipeline directory: {pipe}/model_index.json holds {kind}"
        return sft(w, d, "--hf-checkpoint", str(pipe)), message

    return build


def _pipeline_without_scheduler(w, d):
    import shutil

    pipe = copy_pipeline(w.pipeline, d / "pipe")
    shutil.rmtree(pipe / "scheduler")
    return sft(w, d, "--hf-checkpoint", str(pipe)), f"--hf-checkpoint {pipe} is not a usable pipeline directory: sch"


def _train_image_file_missing(w, d):
    data = write(
        d / "data.jsonl", "".join(json.dumps({"prompt": f"p{i}", "image": f"img/{i}.png"}) + "\n" for i in range(8))
    )
    (d / "img").mkdir()
    from PIL import Image

    for i in (0, 1, 2, 4, 5, 6, 7):  # 3.png is missing
        Image.new("L", (8, 8)).save(d / "img" / f"{i}.png")
    return sft(w, d, "--prompt-data", str(data)), f"record 4 (prompt 'p3'): its image file {d / 'img' / '3.png'} does"


def _real_latent_of_another_shape(w, d):
    import torch
    from safetensors.torch import save_file

    (d / "latents").mkdir()
    save_file({"latent": torch.zeros(1, 4, 4)}, str(d / "latents" / "a.safetensors"))
    data = write(d / "real.jsonl", json.dumps({"prompt": "a digit", "latent": "latents/a.safetensors"}) + "\n")
    argv = dmd2(w, d, "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-real-data", str(data))
    return argv, f"latent file {d / 'latents' / 'a.safetensors'} has shape (1, 4, 4) but the model takes (1, 8, 8)"


def _cond_file_missing(w, d):
    data = write(d / "data.jsonl", "".join(json.dumps({"prompt": f"p{i}", "cond": f"cond/{i}.safetensors"}) + "\n"
                                           for i in range(4)))  # fmt: skip
    return (
        dmd2(w, d, "--prompt-data", str(data)),
        f"record 1 (prompt 'p0'): its cond file {d / 'cond' / '0.safetensors'}",
    )


def _cond_cache(d: Path, family: str | None, width: int = 384, count: int = 4) -> Path:
    """A prompt cache as ``miles.rollout.prompt_cache`` writes it (``family`` in every file's metadata), by hand."""
    import torch
    from safetensors.torch import save_file

    (d / "cond").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        tensors = {"encoder_hidden_states": torch.zeros(8, width), "pooled_projections": torch.zeros(width)}
        metadata = {"prompt": f"p{i}", **({"family": family} if family else {})}
        save_file(tensors, str(d / "cond" / f"{i}.safetensors"), metadata=metadata)
    return write(d / "data.jsonl", "".join(json.dumps({"prompt": f"p{i}", "cond": f"cond/{i}.safetensors"}) + "\n"
                                          for i in range(count)))  # fmt: skip


def _cond_of_another_family(w, d):
    data = _cond_cache(d, "qwen_image")
    message = (
        f"--prompt-data {data} record 1 (prompt 'p0'): {d / 'cond' / '0.safetensors'} was written for the qwen_image "
        f"family, but --hf-checkpoint {w.pipeline} is digits"
    )
    return dmd2(w, d, "--prompt-data", str(data)), message


def _cond_truncated(w, d):
    data = _cond_cache(d, "digits")
    file = d / "cond" / "2.safetensors"
    file.write_bytes(file.read_bytes()[:-16])
    return dmd2(w, d, "--prompt-data", str(data)), f"record 3 (prompt 'p2'): cond file {file} is not a readable"


def _conds_of_two_caches(w, d):
    data = _cond_cache(d, None)
    _cond_cache(d / "other", None, width=256, count=1)
    (d / "other" / "cond" / "0.safetensors").replace(d / "cond" / "3.safetensors")
    return (
        dmd2(w, d, "--prompt-data", str(data)),
        f"record 4 (prompt 'p3'): cond file {d / 'cond' / '3.safetensors'} h",
    )


def _negative_cond_of_another_family(w, d):
    _cond_cache(d, "flux", count=1)
    negative = d / "cond" / "0.safetensors"
    return dmd2(w, d, "--negative-cond", str(negative)), f"--negative-cond: {negative} was written for the flux family"


def _real_latents_of_another_family(w, d):
    import torch
    from safetensors.torch import save_file

    (d / "latents").mkdir()
    save_file({"latent": torch.zeros(1, 8, 8)}, str(d / "latents" / "a.safetensors"), metadata={"family": "sd3"})
    data = write(d / "real.jsonl", json.dumps({"prompt": "a digit", "latent": "latents/a.safetensors"}) + "\n")
    argv = dmd2(w, d, "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-real-data", str(data))
    return argv, f"{d / 'latents' / 'a.safetensors'} was written for the sd3 family, but --hf-checkpoint"


def _gan_feature_block_out_of_range(w, d):
    argv = dmd2(w, d, "--dmd2-gan-disc-weight", "1e-2", "--dmd2-gan-real-data", str(w.train),
                "--dmd2-gan-feature-blocks", "1,2")  # fmt: skip
    return argv, f"--dmd2-gan-feature-blocks holds block 2, but --teacher-load (the critic's init) {w.pipeline} has 2"


def _load_truncated_shard(w, d):
    checkpoint_layout(d / "ckpt", 0, commit=False)
    shard = next((checkpoint_layout(d / "ckpt", 1) / "dcp").glob("*.distcp"))
    size = shard.stat().st_size  # DCP writes the shard to exactly the end its metadata names
    shard.write_bytes(shard.read_bytes()[:100])
    message = (
        f"--load {d / 'ckpt'} committed rollout 1, but it is damaged: shard {shard} holds 100 bytes, but the "
        f"checkpoint's metadata needs {size}; rollout_0 is complete: write 0 into {d / 'ckpt' / 'latest'} to resume "
        "from it"
    )
    return sft(w, d, "--load", str(d / "ckpt"), "--num-rollout", "5"), message


def _load_truncated_data_state(w, d):
    path = checkpoint_layout(d / "ckpt", 0, data_state={"data_source": {"epoch": 0, "cursor": 8}})
    (path / "data_state.pt").write_bytes((path / "data_state.pt").read_bytes()[:20])
    message = f"--load {d / 'ckpt'} committed rollout 0, but it is damaged: its data cursor does not load"
    return sft(w, d, "--load", str(d / "ckpt")), message


def _load_another_loss_type(w, d):
    checkpoint_layout(d / "ckpt", 0, loss_type="dmd2")
    message = (
        f"--load {d / 'ckpt'} holds a --loss-type dmd2 checkpoint (rollout 0) but this command is --loss-type sft"
    )
    return sft(w, d, "--load", str(d / "ckpt")), message


def _load_a_dmd2_layout_without_record(w, d):
    checkpoint_layout(d / "ckpt", 0)
    checkpoint_layout(d / "ckpt_critic", 0, commit=False, role="critic")
    message = f"--load {d / 'ckpt'} has a critic group's checkpoint beside it ({d / 'ckpt_critic' / 'rollout_0'}) that"
    return sft(w, d, "--load", str(d / "ckpt")), message


def _output_dir_inside_the_pipeline(w, d):
    argv = sft(w, d, "--output-dir", str(w.pipeline / "run"))
    return (
        argv,
        f"--output-dir {w.pipeline / 'run'} lies inside --hf-checkpoint {w.pipeline}, a pipeline the run reads",
    )


def _save_is_the_teacher(w, d):
    teacher = copy_pipeline(w.pipeline, d / "teacher")
    argv = dmd2(w, d, "--teacher-load", str(teacher), "--save", str(teacher))
    return argv, f"--save {teacher} is also --teacher-load {teacher}, a pipeline the run reads"


def _dry_run_missing_teacher(w, d):
    return (
        dmd2(w, d, "--teacher-load", str(d / "nope"), "--dry-run"),
        f"--teacher-load {d / 'nope'}: no such directory",
    )


def _dead_ray_address(w, d):
    import socket

    with socket.socket() as probe:  # a port nothing listens on: bound, then closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return sft(w, d, "--ray-address", f"127.0.0.1:{port}"), f"--ray-address 127.0.0.1:{port}: no Ray cluster answers"


COMMANDS: dict[str, Callable] = {
    # numbers: finite and in range (argparse's float takes nan and inf)
    "lr-nan": flag_case("--lr", "nan", message="--lr must be a finite number, got nan"),
    "lr-inf": flag_case("--lr", "inf", message="--lr must be a finite number, got inf"),
    "lr-negative": flag_case("--lr", "-1", message="--lr must be >= 0, got -1.0"),
    "beta1-one": flag_case("--adam-beta1", "1", message="--adam-beta1 must be in [0, 1), got 1.0"),
    "beta2-negative": flag_case("--adam-beta2", "-0.1", message="--adam-beta2 must be in [0, 1), got -0.1"),
    "eps-zero": flag_case("--adam-eps", "0", message="--adam-eps must be > 0, got 0.0"),
    "weight-decay-negative": flag_case("--weight-decay=-0.01", message="--weight-decay must be >= 0, got -0.01"),
    "clip-grad-nan": flag_case("--clip-grad", "nan", message="--clip-grad must be a finite number"),
    "min-lr-above-lr": flag_case("--lr", "1e-3", "--min-lr", "1e-2", message="--min-lr 0.01 must be <= --lr 0.001"),
    "warmup-negative": flag_case("--lr-warmup-steps", "-5", message="--lr-warmup-steps must be >= 0, got -5"),
    "fsdp-shift-nan": flag_case("--fsdp-flow-shift", "nan", message="--fsdp-flow-shift must be a finite number"),
    "sampling-shift-zero": flag_case("--diffusion-flow-shift", "0", message="--diffusion-flow-shift must be > 0"),
    "guidance-inf": flag_case("--diffusion-guidance-scale", "inf", message="--diffusion-guidance-scale must be a fi"),
    "ema-decay-one": flag_case("--ema-decay", "1", message="--ema-decay must be in (0, 1)"),
    "ema-warmup-without-ema": flag_case(
        "--ema-update-after-step", "10", message="--ema-min-decay and --ema-update-after-step shape the EMA's"
    ),
    "no-ema-for-eval-without-ema": flag_case(
        "--no-ema-for-eval", message="--no-ema-for-eval evaluates the live weights instead of the EMA's: without"
    ),
    "gpu-memory-zero": flag_case(
        "--dry-run", "--gpu-memory-gb", "0", message="--gpu-memory-gb must be > 0 (e.g. 80), got 0.0"
    ),
    "gpu-memory-without-dry-run": flag_case("--gpu-memory-gb", "80", message="--gpu-memory-gb is read by --dry-run"),
    "max-skipped-zero": flag_case("--max-skipped-steps", "0", message="--max-skipped-steps must be >= 1, got 0"),
    "keep-last-zero": flag_case(
        "--save", "{d}/ckpt", "--save-keep-last", "0", message="--save-keep-last must be >= 1"
    ),
    "keep-every-alone": flag_case("--save-keep-every", "5", message="--save-keep-every only spares checkpoints"),
    "uncond-prob-one": flag_case("--sft-uncond-prob", "1", message="--sft-uncond-prob must be in [0, 1), got 1.0"),
    "timesteps-nan": flag_case("--diffusion-timesteps", "1000,nan", message="--diffusion-timesteps must be strictly"),
    "seed-beyond-64-bits": flag_case("--seed", str(2**64), message="--seed must be in [0, 9223372036854775807], got"),
    "num-rollout-zero": flag_case("--num-rollout", "0", message="--num-rollout must be a positive integer, got 0"),
    "uneven-micro-batch": flag_case("--micro-batch-size", "3", message="--global-batch-size 8 must be a multiple of"),
    "lr-not-a-number": flag_case("--lr", "fast", message="argument --lr: invalid float value: 'fast'"),
    "unknown-flag": flag_case("--learning-rate", "1e-3", message="unrecognized arguments: --learning-rate"),
    "teacher-cfg-nan": flag_case(
        "--dmd2-teacher-guidance-scale", "nan", base=dmd2, message="--dmd2-teacher-guidance-scale must be a finite"
    ),
    "timestep-ratio-nan": flag_case(
        "--dmd2-min-timestep-ratio", "nan", base=dmd2, message="--dmd2-min-timestep-ratio must be a finite number"
    ),
    "critic-lr-inf": flag_case("--critic-lr", "inf", base=dmd2, message="--critic-lr must be a finite number"),
    "gan-weight-inf": flag_case(
        "--dmd2-gan-gen-weight", "inf", base=dmd2, message="--dmd2-gan-gen-weight must be a finite number, got inf"
    ),
    "gan-disc-negative": flag_case(
        "--dmd2-gan-disc-weight", "-1", base=dmd2, message="--dmd2-gan-disc-weight must be >= 0, got -1.0"
    ),
    "min-lr-above-critic-lr": flag_case(
        "--lr", "1e-2", "--min-lr", "1e-3", "--critic-lr", "1e-4", base=dmd2, message="--min-lr 0.001 must be <= --c"
    ),
    # hooks
    "loss-hook-no-module": flag_case(
        "--custom-loss-function-path", "no_such_module.loss", message="--custom-loss-function-path: hook"
    ),
    "prepare-hook-no-attribute": flag_case(
        "--custom-prepare-train-batch-path", "tests.support.faults.no_such_hook", message="--custom-prepare-train-b"
    ),
    "train-input-hook-not-callable": flag_case(
        "--custom-train-input-function-path", "miles.models.base.DENOISER", message="not a callable"
    ),
    "model-family-no-module": flag_case(
        "--diffusion-model-family",
        "no_such_pkg.family.Family",
        message="--diffusion-model-family 'no_such_pkg.family.Family': cannot import module 'no_such_pkg.family'",
    ),
    "model-family-not-a-family": flag_case(
        "--diffusion-model-family",
        "tests.support.toy_video_family.ToyPromptEncoder",
        message="--diffusion-model-family tests.support.toy_video_family.ToyPromptEncoder is <class",
    ),
    "model-family-not-the-pipelines": flag_case(
        "--diffusion-model-family",
        "sd3",
        message="--diffusion-model-family sd3 does not match --hf-checkpoint",
    ),
    "model-family-unknown-name": flag_case(
        "--diffusion-model-family",
        "hunyuan",
        message="--diffusion-model-family hunyuan is unknown; pass a registered name",
    ),
    # flags that change nothing (issue 34): evaluation settings without evaluations, a trainer that is none
    "eval-max-prompts-without-evaluation": flag_case(
        "--eval-max-prompts", "8", message="--eval-max-prompts is read by the evaluations only: set --eval-interval N"
    ),
    "eval-prompt-data-without-evaluation": flag_case(
        "--eval-prompt-data", "{d}/eval.jsonl", message="--eval-prompt-data is read by the evaluations only: set --ev"
    ),
    "custom-trainer-not-a-trainer": flag_case(
        "--custom-trainer-path",
        "miles.utils.misc.make_generator",
        message="--custom-trainer-path miles.utils.misc.make_generator is <function make_generator",
    ),
    # data files
    "prompt-data-missing": flag_case(
        "--prompt-data", "{d}/nope.jsonl", message="--prompt-data {d}/nope.jsonl does not"
    ),
    "prompt-data-bad-json-line": _bad_json_line,
    "record-without-prompt": _record_without_prompt,
    "record-without-image": _record_without_image,
    "image-out-of-range": _image_out_of_range,
    "eval-data-bad-json": _eval_data_bad,
    "gan-real-data-without-image": _gan_real_data_without_image,
    "negative-cond-missing": _negative_cond_missing,
    "prompt-data-gzip": _prompt_data_gzip,
    "prompt-data-not-utf8": _prompt_data_not_utf8,
    "train-image-file-missing": _train_image_file_missing,
    "real-latent-of-another-shape": _real_latent_of_another_shape,
    "cond-file-missing": _cond_file_missing,
    # data of another model (issue 34): a prompt cache or latents written for another family, a cut cond file
    "cond-of-another-family": _cond_of_another_family,
    "cond-truncated": _cond_truncated,
    "conds-of-two-caches": _conds_of_two_caches,
    "negative-cond-of-another-family": _negative_cond_of_another_family,
    "real-latents-of-another-family": _real_latents_of_another_family,
    # pipelines
    "pipeline-missing": flag_case(
        "--hf-checkpoint", "{d}/nope", message="--hf-checkpoint {d}/nope: no such directory"
    ),
    "pipeline-corrupt-index": _pipeline_corrupt_index,
    "pipeline-nan-weight": _pipeline_nan_weight,
    "teacher-nan-weight": _teacher_nan_weight,
    "pipeline-truncated-weights": _pipeline_truncated,
    "pipeline-without-weights": _pipeline_without_weights,
    "pipeline-with-bin-weights": _pipeline_with_bin_weights,
    "teacher-other-token-length": _teacher_other_token_length,
    "critic-other-latent-channels": _critic_other_channels,
    "model-index-a-list": _model_index("[]", "list"),
    "model-index-null": _model_index("null", "NoneType"),
    "pipeline-without-scheduler": _pipeline_without_scheduler,
    "gan-feature-block-out-of-range": _gan_feature_block_out_of_range,
    "dry-run-missing-teacher": _dry_run_missing_teacher,
    # checkpoints
    "load-missing": flag_case("--load", "{d}/ckpt", message="--load {d}/ckpt: no such directory"),
    "load-without-latest": _load_without_latest,
    "load-corrupt-latest": _load_corrupt_latest,
    "load-latest-names-missing-rollout": _load_latest_names_missing_rollout,
    "load-past-num-rollout": _load_past_num_rollout,
    "load-without-critic-checkpoint": _load_without_critic_checkpoint,
    "save-holds-another-run": _save_holds_another_run,
    "critic-save-holds-another-run": _critic_save_holds_another_run,
    "save-into-another-runs-critic-directory": _save_into_another_runs_critic_directory,
    "empty-hook-path": _empty_hook_path,
    "overwrite-save-what-load-resumes": _overwrite_save_what_load_resumes,
    "overwrite-save-of-the-critic-that-load-resumes": _overwrite_save_of_the_critic_that_load_resumes,
    "load-truncated-shard": _load_truncated_shard,
    "load-truncated-data-state": _load_truncated_data_state,
    "load-another-loss-type": _load_another_loss_type,
    "load-a-dmd2-layout-without-record": _load_a_dmd2_layout_without_record,
    # output paths
    "save-hf-is-save": _save_hf_is_save,
    "save-hf-contains-the-run": _save_hf_contains_run,
    "save-hf-inside-the-model": _save_hf_inside_model,
    "save-hf-is-critic-save": _save_hf_is_critic_save,
    "save-hf-not-a-pipeline": _save_hf_not_a_pipeline,
    "save-hf-pipeline-without-overwrite": _save_hf_pipeline_without_overwrite,
    "save-hf-pipeline-with-user-files": _save_hf_pipeline_with_user_files,
    "save-hf-pipeline-with-user-files-in-a-component": _save_hf_pipeline_with_user_files_in_a_component,
    "save-under-a-file": _save_under_a_file,
    "output-dir-is-a-file": _output_dir_is_a_file,
    "profile-dir-is-a-file": _profile_dir_is_a_file,
    "save-hf-unwritable": _save_hf_unwritable,
    "output-dir-inside-the-pipeline": _output_dir_inside_the_pipeline,
    "save-is-the-teacher": _save_is_the_teacher,
    # --keep-best (issue 34): a direction, evaluations and somewhere to keep the rollout, an export of its own
    "keep-best-without-direction": flag_case(
        "--save", "{d}/ckpt", "--eval-interval", "1", "--keep-best", "fd", message="--keep-best fd needs a direction"
    ),
    "keep-best-bad-direction": flag_case(
        "--save",
        "{d}/ckpt",
        "--eval-interval",
        "1",
        "--keep-best",
        "fd:lowest",
        message="--keep-best fd:lowest: the direction must be min or max, got 'lowest'",
    ),
    "keep-best-without-evaluation": flag_case(
        "--save", "{d}/ckpt", "--keep-best", "fd:min", message="--keep-best fd:min picks a rollout by its evaluations"
    ),
    "keep-best-without-save": flag_case(
        "--eval-interval", "1", "--keep-best", "fd:min", message="--keep-best fd:min keeps the best rollout in --save"
    ),
    "keep-best-export-holds-a-pipeline": _keep_best_export_holds_a_pipeline,
    # DMD's regression loss (issue 34)
    "regression-weight-without-pairs": flag_case(
        "--dmd2-regression-weight", "0.25", base=dmd2, message="--dmd2-regression-weight > 0 needs --dmd2-regressio"
    ),
    "regression-pairs-without-weight": flag_case(
        "--dmd2-regression-pairs",
        "{d}/pairs.jsonl",
        base=dmd2,
        message="--dmd2-regression-pairs is read by the regression loss only",
    ),
    "regression-weight-negative": flag_case(
        "--dmd2-regression-weight", "-1", base=dmd2, message="--dmd2-regression-weight must be >= 0, got -1.0"
    ),
    "regression-pairs-missing": _regression_pairs_missing,
    # the cluster
    "dead-ray-address": _dead_ray_address,
}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("bad_inputs")
    shared = root / "shared"
    pipeline = make_pipeline(shared / "digits")
    train = write_digit_records(shared / "train.jsonl", 16)
    prompts = write_digit_records(shared / "prompts.jsonl", 8, images=False)
    return World(root, pipeline, train, prompts)


@pytest.fixture(scope="module")
def command_results(world):
    """Build every case's inputs, hash the whole tree, run every command, hash again."""
    cases = []
    for case_id, build in COMMANDS.items():
        d = world.root / case_id
        d.mkdir()
        argv, message = build(world, d)
        cases.append({"argv": [part.format(d=d) for part in argv], "cwd": str(d), "message": message.format(d=d)})
    before = tree_hashes(world.root)
    results = run_commands(cases)
    after = tree_hashes(world.root)
    return {case_id: (case, result) for case_id, case, result in zip(COMMANDS, cases, results)}, before, after


@pytest.mark.parametrize("case_id", list(COMMANDS))
def test_bad_command_fails_on_one_line_before_ray_and_touches_nothing(command_results, world, case_id):
    results, before, after = command_results
    case, result = results[case_id]
    err = result["stderr"]
    assert result["returncode"] == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(PREFIX) and case["message"] in lines[0], lines[0]
    prefix = f"{case_id}/"
    changed = {
        k for k in before.keys() | after.keys() if k.startswith((prefix, "shared/")) and before.get(k) != after.get(k)
    }
    assert not changed, f"{case_id} changed {sorted(changed)}"


def test_the_table_covers_every_kind_of_input():
    assert len(COMMANDS) >= 35


# -- the cases found at run time, in the session's Ray cluster --------------------------------------------------
# One of each kind (every other wrong return value: tests/fast/backends/fsdp_utils/test_hook_results.py, without
# a Ray run each).
FAULTS = "tests.support.faults"
RUN_TIME = {
    # hook path flag, hook, what the one line holds after "actor rank 0 failed in <method> (rollout 0): "
    "loss-returns-float": (
        "--custom-loss-function-path",
        "loss_returns_float",
        "train",
        f"ValueError: loss hook {FAULTS}.loss_returns_float returned float; expected a scalar tensor with grad",
    ),
    "prepare-returns-dict": (
        "--custom-prepare-train-batch-path",
        "prepare_returns_dict",
        "train",
        f"ValueError: prepare hook {FAULTS}.prepare_returns_dict returned dict; expected a "
        "miles.backends.fsdp_utils.loss_hub.types.PreparedBatch",
    ),
    "train-input-drops-a-pair": (
        "--custom-train-input-function-path",
        "train_input_drops_a_pair",
        "train",
        f"train-input hook {FAULTS}.train_input_drops_a_pair returned 7 train pairs for the 8 it was given",
    ),
    "converter-drops-a-pair": (
        "--custom-expand-samples-to-train-pairs-path",
        "converter_drops_a_pair",
        "generate",
        f"ValueError: converter {FAULTS}.converter_drops_a_pair returned 7 train pairs for 8 samples",
    ),
    "loss-raises": (
        "--custom-loss-function-path",
        "loss_raises",
        "train",
        "ValueError: my loss cannot handle rollout 0",
    ),
}


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(PREFIX)]


@pytest.mark.parametrize("case_id", list(RUN_TIME))
def test_bad_hook_result_fails_on_one_line_naming_rank_hook_and_rollout(world, ray_cluster, tmp_path, capsys, case_id):
    flag, hook, method, message = RUN_TIME[case_id]
    argv = sft(world, tmp_path, "--num-rollout", "1", "--num-cpus-per-rank", "1", flag, f"{FAULTS}.{hook}")
    shared = tree_hashes(world.root / "shared")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 1, err[-3000:]
    assert len(_error_lines(err)) == 1, err[-3000:]
    (line,) = _error_lines(err)
    assert line.startswith(f"{PREFIX}actor rank 0 failed in {method} (rollout 0): ") and message in line, line
    user_error = case_id == "loss-raises"
    # The trainer's own checks say everything on the line; a hook that raised gets its own traceback below it,
    # without Ray's wrapper frames.
    assert ("Traceback" in err) == user_error, err[-3000:]
    if user_error:
        trace = err[err.index(line) + len(line) :]
        assert "in loss_raises" in trace and "ray/_private" not in trace and "ray::" not in trace, trace
    assert tree_hashes(world.root / "shared") == shared


def test_a_worker_that_exits_is_reported_dead_with_its_exit_code(world, ray_cluster, tmp_path, capsys):
    argv = sft(world, tmp_path, "--num-rollout", "1", "--num-cpus-per-rank", "1",
               "--custom-train-output-function-path", f"{FAULTS}.output_exits")  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 1
    assert _error_lines(err) == [f"{PREFIX}actor rank 0 died in train (rollout 0) (exit code 3)"], err[-3000:]


def test_a_save_hf_directory_that_appears_during_training_is_refused_before_the_export(
    world, ray_cluster, tmp_path, capsys
):
    export = tmp_path / "student"
    argv = sft(world, tmp_path, "--num-rollout", "1", "--num-cpus-per-rank", "1", "--save-hf", str(export),
               "--custom-train-output-function-path", f"{FAULTS}.output_fills_save_hf")  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert _error_lines(err) == [
        f"{PREFIX}--save-hf {export} exists and is not a pipeline directory; export somewhere else"
    ], err[-3000:]
    assert sorted(p.name for p in export.iterdir()) == ["notes.txt"]
    assert not list(tmp_path.glob(".*"))  # no temporary export left beside it
