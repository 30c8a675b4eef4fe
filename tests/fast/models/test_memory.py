"""``miles.models.memory`` and ``miles.models.lora``: FSDP2 shard sizes, LoRA adapters on the meta device, and each
family's activation layout (``MemoryLayout.activation_layout``) against what autograd really keeps for tiny models
of every DiT class."""

import pytest
import torch

from miles.models import family_class
from miles.models.lora import DEFAULT_LORA_TARGET_MODULES, adapter_parameters, add_lora_adapter
from miles.models.memory import activation_estimate, full_config, meta_denoiser, shard_numel

# Tiny configs of the four DiT classes (structure of the real ones, toy width); 8×8 image tokens.
SIDE, TEXT, BATCH = 8, 24, 2
CONFIGS = {
    "SD3Transformer2DModel": dict(sample_size=2 * SIDE, patch_size=2, in_channels=4, out_channels=4, num_layers=3,
                                  attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                  caption_projection_dim=64, pooled_projection_dim=32, pos_embed_max_size=2 * SIDE,
                                  dual_attention_layers=[0], qk_norm="rms_norm"),
    "FluxTransformer2DModel": dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                   pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=[4, 6, 6]),
    "QwenImageTransformer2DModel": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=3,
                                        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                        axes_dims_rope=[4, 6, 6]),
    "Flux2Transformer2DModel": dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                    attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                                    timestep_guidance_channels=32, axes_dims_rope=[4, 4, 4, 4], guidance_embeds=False),
    "WanTransformer3DModel": dict(patch_size=[1, 2, 2], num_attention_heads=4, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64),
}  # fmt: skip
# The family that lays out each class's activations.
FAMILIES = {"SD3Transformer2DModel": "sd3", "FluxTransformer2DModel": "flux", "QwenImageTransformer2DModel": "qwen_image",
            "Flux2Transformer2DModel": "flux2", "WanTransformer3DModel": "wan"}  # fmt: skip


def _config(name: str) -> dict:
    return {"_class_name": name, **CONFIGS[name]}


def _real(name: str) -> torch.nn.Module:
    import diffusers

    torch.manual_seed(0)
    return getattr(diffusers, name).from_config(_config(name))


def _inputs(name: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    tokens = SIDE * SIDE
    grid = torch.zeros(SIDE, SIDE, 4)
    grid[..., 1], grid[..., 2] = torch.arange(SIDE)[:, None], torch.arange(SIDE)[None, :]
    text = torch.randn(BATCH, TEXT, 32, generator=gen)
    timestep = torch.rand(BATCH, generator=gen)
    if name == "SD3Transformer2DModel":
        return dict(hidden_states=torch.randn(BATCH, 4, 2 * SIDE, 2 * SIDE, generator=gen), encoder_hidden_states=text,
                    pooled_projections=torch.randn(BATCH, 32, generator=gen), timestep=timestep * 1000)  # fmt: skip
    if name == "WanTransformer3DModel":  # one frame of 16 × 16 latent pixels: 8 × 8 tokens of patch (1, 2, 2)
        return dict(hidden_states=torch.randn(BATCH, 4, 1, 2 * SIDE, 2 * SIDE, generator=gen), encoder_hidden_states=text,
                    timestep=timestep * 1000)  # fmt: skip
    latents = torch.randn(BATCH, tokens, 16, generator=gen)
    if name == "FluxTransformer2DModel":
        return dict(hidden_states=latents, encoder_hidden_states=text, timestep=timestep,
                    pooled_projections=torch.randn(BATCH, 32, generator=gen), guidance=torch.ones(BATCH),
                    img_ids=grid[..., :3].reshape(-1, 3), txt_ids=torch.zeros(TEXT, 3))  # fmt: skip
    if name == "Flux2Transformer2DModel":
        return dict(hidden_states=latents, encoder_hidden_states=text, timestep=timestep,
                    img_ids=grid.reshape(-1, 4), txt_ids=torch.zeros(TEXT, 4))  # fmt: skip
    return dict(hidden_states=latents, encoder_hidden_states=text, timestep=timestep,
                encoder_hidden_states_mask=torch.ones(BATCH, TEXT, dtype=torch.long),
                img_shapes=[[(1, SIDE, SIDE)]] * BATCH)  # fmt: skip


def _saved_bytes(model: torch.nn.Module, inputs: dict, checkpointing: bool) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward (parameters excluded)."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    if checkpointing:
        model.enable_gradient_checkpointing()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**inputs, return_dict=False)
    params = {param.untyped_storage().data_ptr() for param in model.parameters()}
    return sum(size for ptr, size in storages.items() if ptr not in params)


def test_shards_follow_torch_chunk_on_dim_0_and_add_up_to_the_whole():
    for rows, world in [(10, 4), (3, 4), (8, 2), (1, 8)]:
        chunks = torch.chunk(torch.empty(rows, 3), world, dim=0)
        for rank in range(world):
            expected = chunks[rank].numel() if rank < len(chunks) else 0
            assert shard_numel((rows, 3), world, rank) == expected
        assert sum(shard_numel((rows, 3), world, rank) for rank in range(world)) == rows * 3
    assert shard_numel((5, 7), 1, 0) == 35


def test_the_meta_model_has_the_real_models_parameters_without_storage():
    for name in CONFIGS:
        meta, real = meta_denoiser(_config(name)), _real(name)
        assert all(param.is_meta for param in meta.parameters())
        assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]


def test_a_lora_adapter_on_the_meta_model_counts_what_peft_adds_to_the_real_one():
    for name in CONFIGS:
        meta, real = meta_denoiser(_config(name)), _real(name)
        add_lora_adapter(meta, "student", 4)
        add_lora_adapter(real, "student", 4)
        meta_adapter, real_adapter = adapter_parameters(meta, "student"), adapter_parameters(real, "student")
        assert [(n, p.shape) for n, p in meta_adapter] == [(n, p.shape) for n, p in real_adapter]
        assert {id(p) for _, p in real_adapter} == {id(p) for p in real.parameters() if p.requires_grad}
        assert len(real_adapter) > 0 and all(p.is_meta for _, p in meta_adapter)


def test_a_target_list_that_matches_nothing_is_refused_before_peft_touches_the_model():
    model = _real("SD3Transformer2DModel")
    with pytest.raises(ValueError, match="no module of SD3Transformer2DModel matches the LoRA target modules"):
        add_lora_adapter(model, "student", 4, target_modules=["to_nothing"])
    add_lora_adapter(model, "student", 4)  # the model is still usable
    with pytest.raises(ValueError, match="rank must be > 0"):
        add_lora_adapter(model, "critic", 0)
    assert "to_q" in DEFAULT_LORA_TARGET_MODULES


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_activation_estimate_is_within_15_percent_of_what_autograd_keeps(name):
    model, inputs = _real(name), _inputs(name)
    for checkpointing in (False, True):
        saved = _saved_bytes(model, inputs, checkpointing)
        layout = family_class(FAMILIES[name])("unused").activation_layout(full_config(model))
        estimate = activation_estimate(layout, SIDE * SIDE, TEXT, BATCH, 4, checkpointing)
        assert abs(estimate.stored - saved) <= 0.15 * saved, (checkpointing, estimate.stored, saved)
        assert (estimate.recompute > 0) is checkpointing
