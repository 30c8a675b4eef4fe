"""Checks that open the files and hook modules a command names, before Ray starts (``miles.driver.preflight``)."""

import json

import pytest

from miles.driver.preflight import validate_inputs
from miles.utils.validation import ArgumentValidationError
from tests.support.arguments import BASE
from tests.support.arguments import validated as _validate
from tests.support.inputs import checkpoint_layout


def _fake_digits_pipeline(path):
    """A pipeline directory as far as the input checks read it: model_index.json, the transformer and scheduler
    configs and a finite weights file."""
    import torch
    from safetensors.torch import save_file

    (path / "transformer").mkdir(parents=True)
    (path / "scheduler").mkdir(parents=True)
    (path / "scheduler" / "scheduler_config.json").write_text('{"shift": 3.0}')
    (path / "model_index.json").write_text('{"_class_name": "DigitsPipeline"}')
    (path / "transformer" / "config.json").write_text('{"in_channels": 1, "sample_size": 8}')
    save_file(
        {"proj_out.weight": torch.zeros(4, 4)}, str(path / "transformer" / "diffusion_pytorch_model.safetensors")
    )
    return path


def test_input_checks_name_the_flag_and_the_path_before_ray_starts(tmp_path):
    pipeline = _fake_digits_pipeline(tmp_path / "pipe")
    image = [[0] * 8 for _ in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "image": image}) + "\n" for i in range(4)))
    base = ["--hf-checkpoint", str(pipeline), "--prompt-data", str(data), "--num-rollout", "1"]
    base += ["--rollout-batch-size", "4", "--train-only"]

    def rejected(*extra, check_paths=True):
        with pytest.raises(ArgumentValidationError) as exc_info:
            validate_inputs(_validate([*base, *extra]), check_paths=check_paths)
        return str(exc_info.value)

    validate_inputs(_validate(base))
    assert rejected("--hf-checkpoint", str(tmp_path / "nope")).startswith(f"--hf-checkpoint {tmp_path / 'nope'}: no")
    corrupt = _fake_digits_pipeline(tmp_path / "corrupt")
    (corrupt / "model_index.json").write_text('{"_class_name": ')
    assert "model_index.json is not valid JSON" in rejected("--hf-checkpoint", str(corrupt))
    assert rejected("--prompt-data", str(tmp_path)) == f"--prompt-data {tmp_path} is a directory; pass a JSONL file"
    records = [{"prompt": "a", "image": image}, {"prompt": "b"}]
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert "record 2 (prompt 'b') has no image under --image-key 'image'" in rejected()
    records[1]["image"] = [[0] * 16 for _ in range(16)]
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    message = rejected()
    assert (
        "record 2 (prompt 'b')" in message and "latent of shape (1, 16, 16) but the model takes (1, 8, 8)" in message
    )
    records[1]["image"] = [[300] * 8 for _ in range(8)]
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    assert "record 2 (prompt 'b'): image values must be in 0..255" in rejected()
    data.write_text(json.dumps({"prompt": "a", "image": image}) + "\n")
    missing = str(tmp_path / "eval.jsonl")
    assert rejected("--eval-interval", "1", "--eval-prompt-data", missing).startswith("--eval-prompt-data")
    # Hooks and --load are checked in a dry run too; the data paths are not (they may live on the cluster).
    hook = rejected("--eval-function-path", "miles.utils.misc.no_such_hook", check_paths=False)
    assert hook.startswith("--eval-function-path: hook path 'miles.utils.misc.no_such_hook'")
    assert "no attribute 'no_such_hook'" in hook
    assert "is a dict, not a callable" in rejected("--custom-loss-function-path", "miles.driver.plan.HOOK_FLAGS")
    assert rejected("--load", str(tmp_path / "ckpt"), check_paths=False).startswith(f"--load {tmp_path / 'ckpt'}")
    validate_inputs(_validate([*base, "--hf-checkpoint", str(tmp_path / "nope")]), check_paths=False)


def _fake_checkpoint(save_dir, *rollout_ids, commit=True):
    """Real checkpoints of a tiny module (``tests.support.inputs.checkpoint_layout``) of ``rollout_ids``, and (with
    ``commit``) ``latest`` naming the last of them."""
    for rollout_id in rollout_ids:
        checkpoint_layout(save_dir, rollout_id, commit=False)
    if commit:
        (save_dir / "latest").write_text(f"{rollout_ids[-1]}\n")


def test_dmd2_load_needs_the_critic_checkpoint_of_the_committed_rollout(tmp_path):
    """One commit (``<load>/latest``) names the rollout every group resumes from; the critic's ``<load>_critic``
    must hold that rollout complete. A crash between the groups' saves leaves the commit at the previous rollout, so
    no hand edit is needed (the old check asked to write the common rollout into the newer ``latest``)."""
    argv = [*BASE, "--rollout-batch-size", "4", "--loss-type", "dmd2", "--teacher-load", "/models/teacher"]
    argv += ["--dmd2-critic-steps-per-rollout", "1", "--load", str(tmp_path / "ckpt")]
    _fake_checkpoint(tmp_path / "ckpt", 1)
    with pytest.raises(ArgumentValidationError) as exc_info:
        validate_inputs(_validate(argv), check_paths=False)
    assert str(exc_info.value) == (
        f"--load {tmp_path / 'ckpt'} committed rollout 1, but checkpoint {tmp_path / 'ckpt_critic' / 'rollout_1'} is "
        "missing"
    )
    # Both groups hold rollout 0 whole: the message offers it.
    _fake_checkpoint(tmp_path / "ckpt", 0, commit=False)
    _fake_checkpoint(tmp_path / "ckpt_critic", 0, commit=False)
    with pytest.raises(ArgumentValidationError) as exc_info:
        validate_inputs(_validate(argv), check_paths=False)
    assert str(exc_info.value).endswith(
        f"is missing; rollout_0 is complete: write 0 into {tmp_path / 'ckpt' / 'latest'} to resume from it"
    )
    # A corrupt commit offers the newest rollout complete in both groups as well.
    (tmp_path / "ckpt" / "latest").write_text("two\n")
    with pytest.raises(ArgumentValidationError) as exc_info:
        validate_inputs(_validate(argv), check_paths=False)
    assert str(exc_info.value) == (
        f"--load {tmp_path / 'ckpt'}: 'latest' holds 'two', not a rollout id; the file is corrupt; rollout_0 is "
        f"complete: write 0 into {tmp_path / 'ckpt' / 'latest'} to resume from it"
    )
    (tmp_path / "ckpt" / "latest").write_text("1\n")
    # The critic saved one rollout further before the crash: its uncommitted rollout 2 does not matter.
    _fake_checkpoint(tmp_path / "ckpt_critic", 1, 2, commit=False)
    validate_inputs(_validate(argv), check_paths=False)
    # A commit at the last rollout leaves nothing to train.
    (tmp_path / "ckpt" / "latest").write_text("2\n")
    _fake_checkpoint(tmp_path / "ckpt", 2, commit=False)
    with pytest.raises(ArgumentValidationError, match="committed rollout 2, the last of --num-rollout 3"):
        validate_inputs(_validate(argv), check_paths=False)


def test_one_pass_reads_each_file_the_command_names_once(tmp_path, monkeypatch):
    """A DMD2 command whose teacher is the student's pipeline and whose records share a prompt cache: the pass opens
    model_index.json, the denoiser's config and weights, the data file and each cached cond once (a real digits pipeline; the
    opens are counted, nothing is mocked)."""
    import builtins
    import collections

    import torch
    from safetensors.torch import save_file

    from miles.driver.arguments import parse_args
    from tests.support.inputs import write_digit_records
    from tests.support.trainer import make_pipeline

    pipeline = make_pipeline(tmp_path / "digits")
    (tmp_path / "cond").mkdir()
    cond = {"encoder_hidden_states": torch.zeros(8, 384), "pooled_projections": torch.zeros(384)}
    save_file(cond, str(tmp_path / "cond" / "a.safetensors"), metadata={"family": "digits"})
    records = write_digit_records(tmp_path / "prompts.jsonl", 8, images=False)
    lines = [
        json.dumps({**json.loads(line), "cond": "cond/a.safetensors"}) for line in records.read_text().splitlines()
    ]
    records.write_text("\n".join(lines) + "\n")
    args = parse_args(
        ["--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline),
         "--prompt-data", str(records), "--rollout-batch-size", "4", "--micro-batch-size", "2",
         "--dmd2-critic-steps-per-rollout", "2", "--num-rollout", "2", "--output-dir", str(tmp_path / "out"),
         "--save", str(tmp_path / "ckpt")]
    )  # fmt: skip
    opened = collections.Counter()
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if str(file).startswith(str(tmp_path)):
            opened[str(file).replace(f"{tmp_path}/", "")] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    validate_inputs(args)
    weights = "digits/transformer/diffusion_pytorch_model.safetensors"
    for name in (
        "digits/model_index.json",
        "digits/transformer/config.json",
        weights,
        "prompts.jsonl",
        "cond/a.safetensors",
    ):
        assert opened[name] == 1, (name, dict(opened))


def test_a_two_expert_teachers_boundary_and_second_experts_weights_are_checked_before_ray(tmp_path):
    # Wan 2.2 A14B's layout: the dry run used to pass a boundary_ratio outside (0, 1) (a note in the memory plan
    # only) and a transformer_2 with a non-finite or truncated weights file, which failed only once a rank loaded it.
    import torch
    from safetensors.torch import load_file, save_file

    from tests.support.tiny_pipelines import write_tiny_wan

    teacher = write_tiny_wan(tmp_path / "wan2", boundary_ratio=0.875)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"a clip {i}"}) + "\n" for i in range(2)))
    argv = ["--loss-type", "dmd2", "--hf-checkpoint", str(teacher), "--teacher-load", str(teacher)]
    argv += ["--prompt-data", str(prompts), "--rollout-batch-size", "2", "--num-rollout", "1"]
    argv += ["--dmd2-critic-steps-per-rollout", "1"]
    validate_inputs(_validate(argv))  # the tiny two-expert pipeline as written passes

    weights = sorted((teacher / "transformer_2").glob("*.safetensors"))[0]
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, str(weights))
    with pytest.raises(ArgumentValidationError, match=f"^--hf-checkpoint {teacher}: .*transformer_2.*{name}"):
        validate_inputs(_validate(argv))

    index = json.loads((teacher / "model_index.json").read_text())
    (teacher / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 1.5}))
    with pytest.raises(ArgumentValidationError, match="boundary_ratio 1.5; a two-expert WanPipeline needs"):
        validate_inputs(_validate(argv))
    assert torch.isnan(load_file(str(weights))[name]).all()  # nothing was rewritten


def test_an_edit_models_records_name_a_reference_image_that_loads_before_ray(tmp_path):
    # qwen_image_edit encodes each prompt with its record's reference image: a record without one, or with one that
    # does not load, used to pass the dry run and fail on a rank after Ray started.
    from PIL import Image

    from tests.support.tiny_pipelines import write_tiny_qwen_image_edit

    pipeline = write_tiny_qwen_image_edit(tmp_path / "edit")
    Image.new("RGB", (32, 32), (200, 30, 30)).save(tmp_path / "ref.png")
    (tmp_path / "fake.png").write_text("not an image")
    prompts = tmp_path / "prompts.jsonl"
    argv = ["--loss-type", "dmd2", "--hf-checkpoint", str(pipeline), "--teacher-load", str(pipeline)]
    argv += ["--prompt-data", str(prompts), "--rollout-batch-size", "2", "--num-rollout", "1"]
    argv += ["--dmd2-critic-steps-per-rollout", "1"]

    def write(*references):
        records = [
            {"prompt": f"make it blue {i}", **({"condition_image": r} if r else {})} for i, r in enumerate(references)
        ]
        prompts.write_text("".join(json.dumps(record) + "\n" for record in records))

    write("ref.png", "ref.png")
    validate_inputs(_validate(argv))
    write("ref.png", None)
    with pytest.raises(ArgumentValidationError) as refused:
        validate_inputs(_validate(argv))
    assert str(refused.value) == (
        f"--prompt-data {prompts} record 2 (prompt 'make it blue 1') has no reference image under --condition-image-key "
        "'condition_image'; the qwen_image_edit family edits one per record"
    )
    for bad in ("missing.png", "fake.png"):
        write("ref.png", bad)
        with pytest.raises(
            ArgumentValidationError, match="record 2 .*: its reference image under --condition-image-key"
        ):
            validate_inputs(_validate(argv))


def test_a_condition_image_key_for_a_family_without_references_is_refused(tmp_path):
    # It would change nothing: the digits family encodes prompts only.
    pipeline = _fake_digits_pipeline(tmp_path / "pipe")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "p", "image": [[0] * 8 for _ in range(8)]}) + "\n")
    base = ["--hf-checkpoint", str(pipeline), "--prompt-data", str(data), "--num-rollout", "1"]
    base += ["--rollout-batch-size", "1", "--train-only"]
    validate_inputs(_validate([*base, "--condition-image-key", "condition_image"]))  # the default: nothing set
    with pytest.raises(ArgumentValidationError) as refused:
        validate_inputs(_validate([*base, "--condition-image-key", "ref"]))
    assert str(refused.value) == (
        "--condition-image-key ref is read by an image-conditioned family only (qwen_image_edit); the digits family "
        "takes no reference image: remove it"
    )
