"""A frozen denoiser of two experts split by noise level, as a two-expert diffusers pipeline samples with them.

Wan 2.2 A14B's ``WanPipeline`` (diffusers 0.42.1, ``pipeline_wan.py``, ``__call__``) holds a high-noise expert
``transformer`` and a low-noise expert ``transformer_2``; at each step it runs ``transformer`` where
``t >= boundary_ratio · num_train_timesteps`` and ``transformer_2`` below. :class:`ExpertSwitch` makes the pair one
module with that rule per sample, so that everything that runs a denoiser (the family's ``predict_velocity``, its
guidance, DMD2's scoring) runs the teacher unchanged and each σ is scored by its own expert.
"""

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from miles.models.pipeline_files import DENOISER, SECOND_EXPERT

__all__ = ["ExpertSwitch", "load_teacher"]


class ExpertSwitch(nn.Module):
    """Two experts behind one forward: per sample, ``first`` where its timestep ≥ ``boundary``, else ``second``.

    The forward takes the experts' own keywords (``hidden_states`` ``(B, ...)``, ``timestep`` ``(B,)`` float32 in
    [0, 1000] or per token ``(B, N)``, the cond kwargs ``(B, ...)``) and returns ``(velocity,)`` ``(B, ...)`` in the
    experts' output dtype, each row from its expert. A per-token timestep is judged by its largest token (the
    pipeline's scalar ``t``; Wan 2.2's ``expand_timesteps`` only lowers the conditioning frame's tokens).

    Sharded experts (FSDP2) all-gather their weights in their forward, a collective every rank must join: an expert
    that no sample of this rank's batch needs still runs, on this batch's first sample, and its output is dropped,
    so that the ranks' collectives line up whatever σ each drew. An unsharded expert with no sample is skipped.

    Attributes:
        experts: ``{"transformer": first, "transformer_2": second}``, the pipeline's component names.
        boundary: the switch timestep in [0, 1000] (``boundary_ratio · num_train_timesteps``).
        config: the first expert's config (what a family reads of a denoiser: ``patch_size``, head sizes).
    """

    def __init__(self, first: nn.Module, second: nn.Module, boundary: float) -> None:
        super().__init__()
        self.experts = nn.ModuleDict({DENOISER: first, SECOND_EXPERT: second})
        self.boundary = float(boundary)
        # diffusers' rule by module name (miles.models.precision reads it): the experts share one class.
        self._keep_in_fp32_modules = list(getattr(first, "_keep_in_fp32_modules", None) or [])

    @property
    def config(self):
        return self.experts[DENOISER].config

    def first_expert_rows(self, timestep: Tensor) -> Tensor:
        """bool ``(B,)``: the samples ``transformer`` scores (``t >= boundary``, the stock pipeline's test)."""
        per_sample = timestep.reshape(timestep.shape[0], -1).amax(dim=1)
        return per_sample >= self.boundary

    def forward(self, hidden_states: Tensor, timestep: Tensor, return_dict: bool = False, **kwargs) -> tuple[Tensor]:
        """``(velocity,)`` ``(B, ...)``: each sample through its expert (class docstring). ``return_dict`` is
        accepted for the experts' signature; the output is always the tuple.

        Raises:
            ValueError: for an empty batch.
        """
        batch = hidden_states.shape[0]
        if batch == 0:
            raise ValueError("ExpertSwitch got an empty batch")
        first = self.first_expert_rows(timestep)
        inputs = {"hidden_states": hidden_states, "timestep": timestep, **kwargs}
        out = None
        for name, rows in ((DENOISER, first), (SECOND_EXPERT, ~first)):
            expert = self.experts[name]
            index = rows.nonzero().squeeze(1)
            if index.numel() == 0 and not isinstance(expert, FSDPModule):
                continue
            if index.numel() == batch:  # the whole batch: the call as the stock pipeline makes it
                out = expert(**inputs, return_dict=False)[0]
                continue
            run = index if index.numel() else index.new_zeros(1)  # a throwaway sample keeps FSDP's collectives
            pred = expert(**{key: _rows(value, run, batch) for key, value in inputs.items()}, return_dict=False)[0]
            if index.numel() == 0:
                continue
            if out is None:
                out = pred.new_empty((batch, *pred.shape[1:]))
            out[index] = pred
        return (out,)


def _rows(value, index: Tensor, batch: int):
    """``value``'s rows ``index`` when it is a tensor with a leading batch dim of ``batch``; else as it is."""
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == batch:
        return value.index_select(0, index.to(value.device))
    return value


def load_teacher(family, path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The teacher of pipeline ``path`` whole, in eval mode on the CPU (offline tools: the regression pairs): the
    family's ``load_denoiser``, or for a two-expert pipeline (``family.expert_boundary(path)`` not None) an
    :class:`ExpertSwitch` of ``transformer`` and ``transformer_2``, each loaded by ``from_pretrained`` of the class its
    config names.

    Raises:
        FileNotFoundError / ValueError: as ``load_denoiser`` and ``expert_boundary``.
    """
    from pathlib import Path

    first = family.load_denoiser(str(path), dtype=dtype)
    boundary = family.expert_boundary(path)
    if boundary is None:
        return first
    cls = family.denoiser_class(path, SECOND_EXPERT)
    second = cls.from_pretrained(Path(path) / SECOND_EXPERT, torch_dtype=dtype).eval()
    return ExpertSwitch(first, second, boundary).eval()
