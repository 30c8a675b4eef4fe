"""A video model family defined outside miles: diffusers' Wan transformer over (C, F, H, W) latents.

The worked example of docs/customization.md ("Add your own model"): DMD2 trains it with
``--diffusion-model-family tests.support.toy_video_family.ToyVideoFamily`` and no edit of miles, and ``--dry-run``
plans its memory and time from the layout it declares.
"""

import json
from pathlib import Path

import torch
from torch import nn

from miles.models import DENOISER, MemoryLayout, ModelFamily, TokenFeatures, TrueCFG
from miles.models.memory import ActivationLayout, count_forward_flops, cross_attention_layout
from miles.models.precision import forward_device_dtype


class ToyPromptEncoder:
    """A deterministic text encoder: a prompt's first L bytes looked up in a fixed random table."""

    def __init__(self, length: int, width: int) -> None:
        self.length = length
        self.table = torch.randn(256, width, generator=torch.Generator().manual_seed(0))

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """float32 ``(B, L, width)``; byte 0 pads."""
        ids = torch.zeros(len(prompts), self.length, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            data = list(prompt.encode()[: self.length])
            ids[row, : len(data)] = torch.tensor(data, dtype=torch.long)
        return self.table[ids]


class ToyVideoFamily(ModelFamily, TrueCFG, TokenFeatures, MemoryLayout):
    """Pipelines whose model_index.json names ToyVideoPipeline: transformer/ holds a WanTransformer3DModel,
    toy_video.json the clip size {"frames", "height", "width"} and the prompt length {"text_length"}."""

    name = "toy_video"
    pipeline_classes = ("ToyVideoPipeline",)

    def settings(self, path) -> dict:
        return json.loads((Path(path) / "toy_video.json").read_text())

    def transformer_config(self, path) -> dict:
        return json.loads((Path(path) / DENOISER / "config.json").read_text())

    def load_denoiser(self, path, dtype=torch.float32) -> nn.Module:
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel.from_pretrained(Path(path) / DENOISER, torch_dtype=dtype).eval()

    def load_text_encoder(self, path, device="cpu", dtype=torch.float32) -> ToyPromptEncoder:
        return ToyPromptEncoder(self.settings(path)["text_length"], self.transformer_config(path)["text_dim"])

    def encode_prompts(self, encoder, prompts) -> dict[str, torch.Tensor]:
        return {"encoder_hidden_states": encoder.encode(list(prompts)).float()}

    def latent_shape(self, path) -> tuple[int, int, int, int]:
        clip = self.settings(path)
        return (self.transformer_config(path)["in_channels"], clip["frames"], clip["height"], clip["width"])

    def compatibility_signature(self, path) -> dict:
        # The teacher and the critic take the student's latents and its prompt encodings.
        config = self.transformer_config(path)
        return {**super().compatibility_signature(path), "text width (text_dim)": config["text_dim"]}

    def predict_velocity(self, denoiser, latents, timestep, cond) -> torch.Tensor:
        device, dtype = forward_device_dtype(denoiser)  # the timestep stays float32
        out = denoiser(
            hidden_states=latents.to(device, dtype),
            timestep=timestep.to(device, torch.float32),
            encoder_hidden_states=cond["encoder_hidden_states"].to(device, dtype),
            return_dict=False,
        )[0]
        return out.float()

    def blocks(self, denoiser) -> list[nn.Module]:
        return list(denoiser.blocks)

    # TokenFeatures: what the DMD2 GAN head reads.
    def image_tokens(self, block_output) -> torch.Tensor:
        return block_output  # a WanTransformerBlock returns the video tokens (B, f·h·w, D)

    def token_grid(self, denoiser, latent_shape) -> tuple[int, int, int]:
        _, frames, height, width = latent_shape
        p_t, p_h, p_w = denoiser.config.patch_size
        return frames // p_t, height // p_h, width // p_w

    def token_width(self, denoiser) -> int:
        return denoiser.config.num_attention_heads * denoiser.config.attention_head_dim

    # MemoryLayout: what the dry run's memory plan and time estimate ask.
    def tokens_per_sample(self, path) -> tuple[int, int]:
        _, frames, height, width = self.latent_shape(path)
        p_t, p_h, p_w = self.transformer_config(path)["patch_size"]
        return (frames // p_t) * (height // p_h) * (width // p_w), self.settings(path)["text_length"]

    def activation_layout(self, config) -> ActivationLayout:
        # a WanTransformerBlock: self-attention, cross-attention to the text, an MLP ffn_dim wide
        p_t, p_h, p_w = config["patch_size"]
        return cross_attention_layout(
            config,
            patch_inputs=config["in_channels"] * p_t * p_h * p_w,
            text_dim=config["text_dim"],
            ffn_dim=config["ffn_dim"],
            qk_norm=bool(config["qk_norm"]),
        )

    def flops_per_sample(self, path) -> tuple[float, int]:
        config = self.transformer_config(path)
        with torch.device("meta"):  # no weight is read: the forward runs on the meta device
            cond = {"encoder_hidden_states": torch.empty(1, self.settings(path)["text_length"], config["text_dim"])}
        return count_forward_flops(self, config, self.latent_shape(path), cond)
