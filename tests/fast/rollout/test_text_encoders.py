"""The text encoders an actor rank loads when a prompt has no cached cond (issue 30 item 9): in the compute dtype
(``--train-dtype``), handed to the group's sleep controller so that they leave the GPU when the group sleeps. The
memory plan's figure for them is tested in tests/fast/driver/test_memory_plan.py.

The pipeline is the tiny SD3 one with all three text encoders (two CLIPs and a T5, tests/support/sd3_t5.py).
"""

import json

import pytest
import torch

from miles.backends.fsdp_utils.sleep import SleepController
from miles.driver.arguments import parse_args
from miles.models import get_model_family
from miles.rollout.generator import RolloutGenerator
from miles.utils.collectives import LocalCollectives
from tests.support.rollout import engine_spec
from tests.support.sd3_t5 import tiny_sd3_t5_pipeline
from tests.support.trainer import make_pipeline

PROMPTS = ["a red square", "two green dots"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return tiny_sd3_t5_pipeline(tmp_path_factory.mktemp("sd3_t5"))


def _generator(pipeline, tmp_path, dtype: str, handed: list) -> RolloutGenerator:
    """An actor rank's generator, as ``FSDPTrainRayActor.generator`` builds it (its text encoders handed over)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in PROMPTS))
    args = parse_args(
        ["--hf-checkpoint", str(pipeline), "--prompt-data", str(data), "--num-rollout", "1", "--rollout-batch-size",
         "2", "--lr", "1e-3", "--train-dtype", dtype, "--output-dir", str(tmp_path / "out")]
    )  # fmt: skip
    family = get_model_family(pipeline)
    return RolloutGenerator(
        engine_spec(args), family, family.load_denoiser(pipeline), args=args, device=CPU,
        collectives=LocalCollectives(), on_text_encoder=handed.append,
    )  # fmt: skip


def test_the_text_encoders_load_in_the_compute_dtype_and_are_handed_to_the_group(pipeline, tmp_path):
    handed = []
    generator = _generator(pipeline, tmp_path, "bfloat16", handed)
    conditioner = generator.engine.conditioner
    assert handed == []  # loaded on first use only
    cond = conditioner.cond(PROMPTS, [{"prompt": prompt} for prompt in PROMPTS])
    conditioner.negative()
    (modules,) = handed  # once, whatever encodes after
    assert [type(module).__name__ for module in modules] == [
        "CLIPTextModelWithProjection",
        "CLIPTextModelWithProjection",
        "T5EncoderModel",
    ]
    # Before issue 30 they loaded in float32 whatever --train-dtype said (SD3.5: 22 GB on every actor rank).
    assert {param.dtype for module in modules for param in module.parameters()} == {torch.bfloat16}
    # The cond is the bf16 encoders' output, given as float32: close to the float32 encoders', not equal.
    family = generator.family
    expected = family.encode_prompts(family.load_text_encoder(pipeline, dtype=torch.bfloat16), PROMPTS)
    full = family.encode_prompts(family.load_text_encoder(pipeline), PROMPTS)
    for key, value in cond.items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[key]), key
        assert torch.allclose(value, full[key], atol=0.05, rtol=0.05), key
    assert not torch.equal(cond["encoder_hidden_states"], full["encoder_hidden_states"])


def test_a_float32_run_keeps_its_text_encoder_in_float32(tmp_path):
    """The default digits run: --train-dtype float32 keeps MiniLM as it was (its figures stay bit-identical)."""
    pipeline = make_pipeline(tmp_path / "digits")
    handed = []
    generator = _generator(pipeline, tmp_path, "float32", handed)
    cond = generator.engine.conditioner.cond(PROMPTS, [{"prompt": prompt} for prompt in PROMPTS])
    (modules,) = handed
    assert [type(module).__name__ for module in modules] == ["BertModel"]
    assert {param.dtype for param in modules[0].parameters()} == {torch.float32}
    family = generator.family
    expected = family.encode_prompts(family.load_text_encoder(pipeline), PROMPTS)
    assert all(torch.equal(value, expected[key]) for key, value in cond.items())


def test_registered_text_encoders_leave_the_gpu_when_the_group_sleeps(pipeline, monkeypatch):
    """Stands in for an actor rank on ``cuda:0``: torch.cuda's synchronize and empty_cache are mocked, and each
    module's ``to`` records where the sleep controller sends it (moving to a CUDA device needs one)."""
    from miles.models.base import text_encoder_modules

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    family = get_model_family(pipeline)
    modules = text_encoder_modules(family.load_text_encoder(pipeline, dtype=torch.bfloat16))
    moves = []
    for index, module in enumerate(modules):
        monkeypatch.setattr(
            module, "to", lambda device, index=index, module=module: moves.append((index, str(device)))
        )
    controller = SleepController([], None, torch.device("cuda", 0))
    controller.register(modules[:2])
    assert moves == []  # registered awake: they stay where they are
    controller.sleep()
    assert moves == [(0, "cpu"), (1, "cpu")]
    moves.clear()
    controller.wake_up()
    assert moves == [(0, "cuda:0"), (1, "cuda:0")]
    moves.clear()
    controller.sleep()
    controller.register(modules[2:])  # registered while the group sleeps: off the GPU at once
    assert moves == [(0, "cpu"), (1, "cpu"), (2, "cpu")]
    moves.clear()
    controller.wake_up()
    assert moves == [(0, "cuda:0"), (1, "cuda:0"), (2, "cuda:0")]


def test_on_the_cpu_nothing_moves_but_the_encoders_are_the_groups(pipeline):
    from miles.models.base import text_encoder_modules

    family = get_model_family(pipeline)
    modules = text_encoder_modules(family.load_text_encoder(pipeline))
    controller = SleepController([], None, CPU)
    controller.register(modules)
    assert controller.models == modules
    controller.sleep()
    controller.wake_up()
    assert {param.device.type for module in modules for param in module.parameters()} == {"cpu"}
