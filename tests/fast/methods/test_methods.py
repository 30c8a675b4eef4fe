"""The loss-type registry (``miles.methods``): one method per ``--loss-type``, and the single-group runs."""

import copy

import pytest

from miles.driver.arguments import build_parser, parse_args
from miles.driver.validators import group_layout
from miles.methods import METHODS, get_method
from miles.methods.base import student_group
from tests.support.arguments import BASE, CUSTOM_HOOKS


def test_every_loss_type_choice_is_a_registered_method():
    (loss_type,) = [action for action in build_parser()._actions if action.dest == "loss_type"]
    assert tuple(loss_type.choices) == tuple(METHODS) == ("sft_loss", "dmd2", "custom_loss")
    assert all(get_method(name).name == name for name in METHODS)
    with pytest.raises(ValueError, match=r"--loss-type 'ppo' is unknown; choose one of \['custom_loss', 'dmd2'"):
        get_method("ppo")


@pytest.mark.parametrize("loss_type", ["sft_loss", "custom_loss"])
def test_actor_alone_as_the_flags_describe_it_by_default(loss_type):
    extra = ["--rollout-batch-size", "4", "--loss-type", loss_type]
    if loss_type == "custom_loss":
        extra += CUSTOM_HOOKS
    args = parse_args([*BASE, *extra])
    snapshot = copy.deepcopy(vars(args))
    (actor,) = group_layout(args)
    assert actor == student_group(args, get_method(args).default_hooks(args))
    assert actor.role == "actor" and actor.init == "/models/student" and actor.teacher is None
    assert (actor.optimizer.lr, actor.steps_per_rollout, actor.micro_batch_size) == (1e-5, 1, 1)
    assert actor.checkpoint.load is None and actor.checkpoint.save is None and actor.ema is None
    assert vars(args) == snapshot  # building the specs leaves the parsed args as they were


def test_the_documented_method_is_one_file_that_registers_its_flags_and_groups():
    """docs/customization.md's "Add a method": the module as written there registers a --loss-type whose flag is
    declared once by its settings field, and whose actor group takes its hooks."""
    import re
    import types

    from miles.config import GroupHooks
    from miles.methods.base import METHODS
    from tests.support.ray import REPO

    doc = (REPO / "docs" / "customization.md").read_text()
    code = re.search(r"```python\n# miles/methods/my_method.py\n(.*?)```", doc, re.S).group(1)
    module = types.ModuleType("my_method")
    module.my_prepare, module.my_loss = (lambda ctx, pairs: None), (lambda *a, **k: None)
    try:
        exec(compile(code, "my_method.py", "exec"), module.__dict__)  # noqa: S102 - the documented file, run as is
        assert "my_loss" in METHODS and METHODS["my_loss"].description == "my flow-matching variant"
        args = parse_args([*BASE, "--rollout-batch-size", "4", "--loss-type", "my_loss", "--my-weight", "2"])
        assert args.method_settings == module.MySettings(weight=2.0)
        (actor,) = group_layout(args)
        assert actor.hooks == GroupHooks(prepare=module.my_prepare, loss=module.my_loss)
        # Its flag is rejected under another loss type, like every method's own.
        with pytest.raises(SystemExit):
            parse_args([*BASE, "--rollout-batch-size", "4", "--my-weight", "2"])
    finally:
        METHODS.pop("my_loss", None)
