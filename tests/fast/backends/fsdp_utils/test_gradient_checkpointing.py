"""``--gradient-checkpointing``: recomputing each block's activations in backward gives the same gradients."""

import torch

from miles.backends.fsdp_utils.converters import GradientCheckpointing
from miles.backends.fsdp_utils.model import load_trainable_denoiser, shard_model
from miles.models import get_model_family
from tests.support.trainer import denoiser_loss, make_pipeline, single_process_group


def _grads(model, family, block_calls: list | None = None) -> dict[str, torch.Tensor]:
    if block_calls is not None:
        # Count the first block's forward runs (a forward hook does not see the recomputation).
        block = family.blocks(model)[0]
        forward = block.forward
        block.forward = lambda *args, **kwargs: block_calls.append(1) or forward(*args, **kwargs)
    denoiser_loss(family, model, seed=3).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[name] = grad.detach().clone()
    return grads


def test_checkpointed_blocks_give_the_same_gradients(tmp_path):
    pipeline = make_pipeline(tmp_path / "digits")
    family = get_model_family(pipeline)
    with single_process_group() as mesh:
        plain = load_trainable_denoiser(family, str(pipeline), mesh, torch.device("cpu"), torch.float32)
        checkpointed = load_trainable_denoiser(
            family, str(pipeline), mesh, torch.device("cpu"), torch.float32, converters=[GradientCheckpointing()]
        )
        assert not plain.gradient_checkpointing and checkpointed.gradient_checkpointing
        plain_calls, checkpointed_calls = [], []
        expected = _grads(plain, family, plain_calls)
        got = _grads(checkpointed, family, checkpointed_calls)
        # The first block ran once without checkpointing, and once more in backward with it.
        assert (len(plain_calls), len(checkpointed_calls)) == (1, 2)
        # The same under FSDP2: checkpointing is applied before fully_shard.
        sharded = family.load_denoiser(pipeline)
        sharded.train()
        sharded.enable_gradient_checkpointing()
        shard_model(sharded, family.blocks(sharded), mesh, torch.float32)
        got_sharded = _grads(sharded, family)
    assert expected.keys() == got.keys() == got_sharded.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=0), name
        assert torch.allclose(got_sharded[name], expected[name], atol=1e-5, rtol=0), name
    assert max(g.abs().max().item() for g in expected.values()) > 1e-3  # real gradients, not zeros
