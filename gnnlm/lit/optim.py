"""The optimiser every trainable module here uses: AdamW with warmup + cosine decay per step,
built from the module's ``OptimConfig`` (``gnnlm.lit.settings``)."""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import pytorch_lightning as pl
import torch

from gnnlm.lit.settings import OptimConfig


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / max(1, warmup)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def decay_groups(params: list[torch.nn.Parameter], weight_decay: float,
                 **options) -> list[dict]:
    """Two parameter groups: matrices decay, biases/norms/gains (fewer than 2 dims) do not."""
    return [{"params": [p for p in params if p.dim() >= 2], **options,
             "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], **options, "weight_decay": 0.0}]


def on_cuda(params: list[torch.nn.Parameter]) -> bool:
    return bool(params) and all(p.is_cuda for p in params)


def takes_fused_step(params: list[torch.nn.Parameter], trainer: pl.Trainer) -> bool:
    """Whether AdamW takes its fused kernel: on CUDA, one launch per step for every parameter
    (a small model's step is otherwise dozens of launches); elsewhere torch's default, so CPU
    runs keep their bits. Not under a loss scaler (``16-mixed``) with clipping: the fused step
    unscales the gradients inside its kernel, so clipping before it would see them scaled
    (Lightning refuses the pair). ``bf16-mixed`` scales nothing: its gradients are clipped by
    ``TokenLevelModule.configure_gradient_clipping``."""
    if not on_cuda(params):
        return False
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return not (trainer.gradient_clip_val and scaler is not None)


def adamw_warmup_cosine(module: pl.LightningModule, named_params: Iterable, optim: OptimConfig,
                        lr_groups: Sequence[tuple[Iterable[torch.nn.Parameter], float]] = ()
                        ) -> dict:
    """``configure_optimizers`` result over the trainable ``named_params``, with ``optim``'s
    learning rate, weight decay, betas and schedule.

    ``lr_groups``: ``(parameters, lr)`` pairs trained at their own learning rate (e.g. what
    SPALM adds to a warm-started LM). Their parameters leave the two groups at ``lr``, which
    come first and are always there (a checkpoint's optimiser state counts them); each pair
    then adds its own decay / no-decay groups, leaving out one it has no parameters for. Every
    group lists its parameters in ``named_params``' order, and every group follows the one
    warmup + cosine schedule."""
    weight_decay = optim.weight_decay
    params = [p for _, p in named_params if p.requires_grad]
    own_lr = {id(p): i for i, (group, _) in enumerate(lr_groups) for p in group}
    groups = decay_groups([p for p in params if id(p) not in own_lr], weight_decay)
    for i, (_, group_lr) in enumerate(lr_groups):
        mine = [p for p in params if own_lr.get(id(p)) == i]
        groups += [g for g in decay_groups(mine, weight_decay, lr=group_lr) if g["params"]]
    fused = takes_fused_step(params, module.trainer)
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, fused=fused or None)
    total = max(1, int(module.trainer.estimated_stepping_batches))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, optim.warmup_steps, total, optim.min_lr_ratio))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
