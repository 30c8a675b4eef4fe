"""Sleep / wake of a trainer group: move its model shards and optimizer state off the accelerator and back.

Colocated trainer groups and the rollout engine share each device. A group sleeps right after its train so that
the next user of the device (the other group, the engine) has the memory, and wakes before its next train.

States: ``awake`` (on the training device) ⇄ ``asleep`` (on the CPU). Sleeping while asleep and waking while awake
are no-ops, so the driver may call them defensively. When the training device is the CPU there is nowhere to move
to: both transitions only flip the state (a CPU-to-CPU copy measured 6% of a critic rank's time). The driver does
not call them at all when nothing else uses the device (a group alone on its GPU).

FSDP2 supports ``module.to(device)`` on a ``fully_shard``-ed module: its ``_apply`` reshards first and re-registers
the moved shards (torch ``FSDPModule._apply``). Optimizer state is a dict of (DTensor) tensors per parameter and is
moved entry by entry.

Host memory, on purpose (on CUDA):

- the parameter shards, frozen models and buffers move with ``module.to``: blocking copies into ordinary (pageable)
  host memory, freed when the group wakes;
- the optimizer moments and the EMA shadows, the larger part, go into one flat host buffer per group
  (:class:`HostBuffers`), page-locked once with ``cudaHostRegister`` (as torch's DCP state-dict stager pins its
  buffers) so that the copies run asynchronously at full PCIe speed, and reused by every sleep: it stays allocated
  and pinned for the whole run (until :meth:`SleepController.release_host_buffers`). The memory plan counts it per
  node (``miles.driver.memory_plan.host_memory_line``). Nothing else is pinned: a ``.to("cpu", non_blocking=True)``
  of a CUDA tensor would allocate pinned memory from torch's host caching allocator, which rounds every block up to
  a power of two and keeps it after the group wakes (about 128 GB a node for SD3.5-Large on 8 GPUs, uncounted).
"""

import contextlib
import logging
from collections.abc import Hashable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from miles.backends.fsdp_utils.model import reshard

__all__ = ["AWAKE", "ASLEEP", "HostBuffers", "SleepController"]

logger = logging.getLogger(__name__)

AWAKE = "awake"
ASLEEP = "asleep"


# Each tensor's slot in the flat buffer starts at a multiple of this many bytes (any dtype's alignment, a cache line).
_ALIGN = 64


def _pin(buffer: torch.Tensor) -> None:
    """Page-lock ``buffer``'s memory for the GPU (``cudaHostRegister``)."""
    from torch.cuda._pin_memory_utils import pin_memory

    pin_memory(buffer.data_ptr(), buffer.numel() * buffer.element_size())


def _unpin(buffer: torch.Tensor) -> None:
    """Undo :func:`_pin` (``cudaHostUnregister``); the memory is then ordinary host memory, freed with the tensor."""
    from torch.cuda._pin_memory_utils import unpin_memory

    unpin_memory(buffer.data_ptr())


class HostBuffers:
    """The host copies of a group's sleeping optimizer state and EMA shadows: one flat buffer, allocated at the first
    sleep, pinned when ``pin`` (a CUDA group), kept and reused by every later sleep.

    :meth:`stage` copies a set of device tensors into their slots and returns the slots, which become the sleeping
    state; waking copies them back to the device and leaves the buffer in place for the next sleep. The buffer is
    reallocated only when the set of tensors changes (the optimizer's moments appear after its first step), and freed
    (unpinned first) by :meth:`release`.

    Args:
        pin: page-lock the buffer (``cudaHostRegister``) so that the copies to and from the GPU are asynchronous.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffer: torch.Tensor | None = None
        self.pinned = False
        self._layout: list[tuple[Hashable, torch.Size, torch.dtype, int]] = []

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffer holds (0 before the first sleep or after :meth:`release`)."""
        return 0 if self.buffer is None else self.buffer.numel()

    def stage(self, tensors: dict[Hashable, torch.Tensor]) -> dict[Hashable, torch.Tensor]:
        """Copy ``tensors`` (plain tensors, e.g. DTensors' local shards) into their slots of the buffer.

        The copies are asynchronous when the buffer is pinned: synchronise the device before reading the slots.

        Returns:
            ``{key: slot}``: CPU views of the buffer with each tensor's shape and dtype.
        """
        layout, offset = [], 0
        for key, tensor in tensors.items():
            layout.append((key, tensor.shape, tensor.dtype, offset))
            offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        if layout != self._layout:
            self.release()
            self.buffer = torch.empty(offset, dtype=torch.uint8)
            if self.pin and offset:
                _pin(self.buffer)
                self.pinned = True
            self._layout = layout
            logger.debug("sleep: %d bytes of host buffers for %d tensors (pinned: %s)", offset, len(layout), self.pin)
        slots = {}
        for key, shape, dtype, start in layout:
            size = shape.numel() * dtype.itemsize
            slot = self.buffer[start : start + size].view(dtype).view(shape)
            slot.copy_(tensors[key], non_blocking=self.pinned)
            slots[key] = slot
        return slots

    def release(self) -> None:
        """Unpin and free the buffer (it is allocated again at the next :meth:`stage`)."""
        if self.buffer is not None and self.pinned:
            _unpin(self.buffer)
        self.buffer, self.pinned, self._layout = None, False, []


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _like(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` in ``value``'s place: a DTensor with ``value``'s mesh, placements and global shape, or itself."""
    if not isinstance(value, DTensor):
        return local
    return DTensor.from_local(
        local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
    )


class SleepController:
    """Owns the ``awake``/``asleep`` state of one trainer's models and optimizer.

    Args:
        models: every module of the trainer (trainable and frozen); each FSDP module is resharded before moving.
        optimizer: the trainer's optimizer, or None for a group without one.
        ema: the group's ``ParameterEMA``, or None; its shadows move with the weights.
        device: the training device (``cuda:<i>`` or ``cpu``).
        offload_device: where sleeping state lives (the CPU).
        pin_memory: page-lock the host buffers of the optimizer state and the EMA (:class:`HostBuffers`); default on
            CUDA.
    """

    def __init__(
        self,
        models: list[nn.Module],
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        offload_device: str | torch.device = "cpu",
        ema=None,
        pin_memory: bool | None = None,
    ) -> None:
        self.models = models
        self.optimizer = optimizer
        self.ema = ema
        self.device = torch.device(device)
        self.offload_device = torch.device(offload_device)
        self.state = AWAKE
        self.host = HostBuffers(self.device.type == "cuda" if pin_memory is None else pin_memory)

    def register(self, modules: list[nn.Module]) -> None:
        """Move ``modules`` with the group from now on: the text encoders an actor rank loads at its first rollout
        (:class:`~miles.rollout.conditioning.PromptConditioner`). Registered while asleep, they leave the device now.
        """
        self.models = [*self.models, *modules]
        if self.asleep and self.device != self.offload_device:
            for module in modules:
                module.to(self.offload_device)

    @property
    def asleep(self) -> bool:
        return self.state == ASLEEP

    def sleep(self) -> None:
        """``awake`` → ``asleep``: parameters (resharded first) and optimizer state move to the offload device."""
        if self.state == ASLEEP:
            logger.debug("sleep() while asleep: nothing to do")
            return
        self._move(self.offload_device)
        self.state = ASLEEP
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # The same transition as sleep(), the other way.
    def wake_up(self) -> None:
        """``asleep`` → ``awake``: everything moves back to the training device."""
        if self.state == AWAKE:
            logger.debug("wake_up() while awake: nothing to do")
            return
        self._move(self.device)
        self.state = AWAKE
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """Run a block with the state on the training device, restoring the previous state after it."""
        was_asleep = self.asleep
        self.wake_up()
        try:
            yield
        finally:
            if was_asleep:
                self.sleep()

    def release_host_buffers(self) -> None:
        """Free the pinned host buffers (the group is done sleeping: shutdown). Raises if the group is asleep, as its
        state lives in them then."""
        if self.asleep:
            raise RuntimeError("release_host_buffers() while asleep: the sleeping state lives in them; wake up first")
        self.host.release()

    def _state_tensors(self) -> dict[Hashable, torch.Tensor]:
        """The optimizer's tensors (not AdamW's ``step``) and the EMA's shadows, by a stable key."""
        tensors = {}
        if self.optimizer is not None:
            for i, group in enumerate(self.optimizer.param_groups):
                for j, param in enumerate(group["params"]):
                    for name, value in self.optimizer.state.get(param, {}).items():
                        # AdamW's "step" is a CPU scalar unless capturable/fused; it stays where the optimizer keeps it.
                        if name != "step" and isinstance(value, torch.Tensor):
                            tensors[("optimizer", i, j, name)] = value
        if self.ema is not None:
            tensors.update({("ema", i): shadow for i, shadow in enumerate(self.ema.shadows)})
        return tensors

    def _set_state_tensors(self, tensors: dict[Hashable, torch.Tensor]) -> None:
        for key, value in tensors.items():
            if key[0] == "optimizer":
                _, i, j, name = key
                self.optimizer.state[self.optimizer.param_groups[i]["params"][j]][name] = value
        if self.ema is not None:
            self.ema.shadows = [tensors[("ema", i)] for i in range(len(self.ema.shadows))]

    def _move(self, device: torch.device) -> None:
        if self.device == self.offload_device:
            return  # training on the CPU: the state is already where sleep would put it
        for model in self.models:
            # A frozen FSDP root stays unsharded after a no_grad forward; moving it then would move full weights.
            reshard(model)
            model.to(device)
        state = self._state_tensors()
        if device == self.offload_device:
            slots = self.host.stage({key: _local(value) for key, value in state.items()})
            moved = {key: _like(value, slots[key]) for key, value in state.items()}
        else:
            # From the buffers back to the device; the buffers stay for the next sleep.
            moved = {key: value.to(device, non_blocking=self.host.pinned) for key, value in state.items()}
        self._set_state_tensors(moved)
