"""Which MoE method each sparse block gets on this machine with these settings."""

from __future__ import annotations

import logging

import torch
from torch import nn

from nanoserve.common.config import EngineConfig
from nanoserve.moe.layer import install_moe_method

logger = logging.getLogger("nanoserve.moe")


def install_moe_methods(model: nn.Module, config: EngineConfig, device: torch.device) -> None:
    """The portable grouped method stays unless a faster one applies (none yet)."""
    del model, config, device
