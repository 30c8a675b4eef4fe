"""The loss-type registry (``miles.methods``): one method per ``--loss-type``, and the single-group runs."""

import pytest

from miles.driver.arguments import build_parser, parse_args
from miles.methods import METHODS, compute_trainer_configs, get_method
from miles.utils.trainer_config import TrainerConfig, compute_trainer_args
from tests.support.arguments import BASE, CUSTOM_HOOKS


def test_every_loss_type_choice_is_a_registered_method():
    (loss_type,) = [action for action in build_parser()._actions if action.dest == "loss_type"]
    assert tuple(loss_type.choices) == tuple(METHODS) == ("sft_loss", "dmd2", "custom_loss")
    assert all(get_method(name).name == name for name in METHODS)
    with pytest.raises(ValueError, match=r"--loss-type 'ppo' is unknown; choose one of \['custom_loss', 'dmd2'"):
        get_method("ppo")


@pytest.mark.parametrize("loss_type", ["sft_loss", "custom_loss"])
def test_actor_alone_without_overrides_by_default(loss_type):
    extra = ["--rollout-batch-size", "4", "--loss-type", loss_type]
    if loss_type == "custom_loss":
        extra += CUSTOM_HOOKS
    args = parse_args([*BASE, *extra])
    assert compute_trainer_configs(args) == [TrainerConfig("actor", {})]
    actor_args = compute_trainer_args(args, compute_trainer_configs(args)[0])
    assert actor_args is not args and vars(actor_args) == vars(args)
