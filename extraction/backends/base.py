"""The one interface every backend implements; the runner only talks to this."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from extraction.shards.filebytes import FileBytes


@dataclass
class Sample:
    """One tokenized conversation, ready for a forward pass."""

    sample_id: str
    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] int64 (0/1)
    truncated: bool = False
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class SampleStates:
    """Hidden states for one sample, in the shard layout (batch dim of 1 added by the writer)."""

    sample_id: str
    input_ids: torch.Tensor  # [L] int64, as the model saw them
    # [L, H], final layer after the final norm; [L, k*H], captured layers concatenated in layer-id
    # order. A FileBytes (the sglang backend) where the bytes are left in the server's dump files.
    hidden_state: torch.Tensor | FileBytes
    aux_hidden_state: torch.Tensor | FileBytes
    # True/False when the backend already checked both tensors for NaN/Inf (on the device, where it
    # is cheap); None when it did not and the runner must check them on the host.
    finite: bool | None = None


@dataclass
class ModelInfo:
    """What run.json records about the target, read from the backend."""

    model: str
    revision: str | None
    hidden_size: int
    num_layers: int
    vocab_size: int
    dtype: str


class Backend(Protocol):
    name: str

    def model_info(self) -> ModelInfo: ...

    def extract(self, samples: list[Sample]) -> list[SampleStates]:
        """Run the forward pass for a batch; raise on failure (the runner retries per sample)."""
        ...

    def close(self) -> None: ...
