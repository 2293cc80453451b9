"""The optimiser every trainable module here uses: AdamW with warmup + cosine decay per step."""
from __future__ import annotations

import math
from collections.abc import Iterable

import pytorch_lightning as pl
import torch


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def adamw_warmup_cosine(module: pl.LightningModule, named_params: Iterable, lr: float,
                        weight_decay: float, warmup_steps: int, min_lr_ratio: float,
                        betas: tuple[float, float] = (0.9, 0.95)) -> dict:
    """``configure_optimizers`` result; matrices decay, biases/norms/gains do not."""
    params = [(n, p) for n, p in named_params if p.requires_grad]
    groups = [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas))
    total = max(1, int(module.trainer.estimated_stepping_batches))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, total, min_lr_ratio))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
