"""The optimiser's settings (``OptimConfig``), standard library only: every LightningModule here
takes them as ``optim``, a checkpoint saves them among its hyper-parameters (hence
``checkpoint_safe``: checkpoints are read with ``weights_only=True``), and the ``gnnlm`` package
imports this module first so that the registry holds the class whatever a process imports.
Building the optimiser from them is ``gnnlm.lit.optim.adamw_warmup_cosine``.
"""
from __future__ import annotations

from dataclasses import dataclass

from gnnlm.workdir.checkpoints import checkpoint_safe


@checkpoint_safe()
@dataclass
class OptimConfig:
    """AdamW with a linear warmup and a cosine decay per optimiser step (a `gnnlm fit` config
    writes them under ``model.init_args.optim``; each model has its own defaults).

    Args:
        lr: the peak learning rate of AdamW.
        weight_decay: AdamW's decoupled weight decay (matrices only).
        warmup_steps: linear warmup steps before the cosine decay.
        min_lr_ratio: the learning rate at the end, as a share of ``lr``.
        betas: AdamW's betas.
    """
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self):
        # named as a `gnnlm fit` config writes them (model.init_args.optim.*): the user's fix
        if self.lr <= 0 or self.weight_decay < 0 or self.warmup_steps < 0:
            raise ValueError(f"optim.lr must be > 0, optim.weight_decay and optim.warmup_steps "
                             f">= 0 (got lr={self.lr}, weight_decay={self.weight_decay}, "
                             f"warmup_steps={self.warmup_steps}).")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio (the final learning rate as a share of lr) "
                             f"must be within [0, 1] (got {self.min_lr_ratio}).")
        self.betas = (float(self.betas[0]), float(self.betas[1]))

    @classmethod
    def of(cls, value: OptimConfig | dict) -> OptimConfig:
        """``value`` as an ``OptimConfig`` (a dict: hyper-parameters read back from YAML)."""
        return value if isinstance(value, OptimConfig) else cls(**dict(value))
