"""What the GPU table's rehearsal (``configs/tests/gpu_rehearsal.yaml`` and its fit overlays in
``configs/tests/gpu_rehearsal/``) may change in the GPU configs, listed, and the check that a
trained part's config changes nothing else."""
from __future__ import annotations

from typing import Any

from tests.conftest import yaml_leaves

# What a fit overlay may set: the device, the model's and the data's sizes, and the base LM's
# step counts (the GPU's time limit bounds them).
REHEARSAL_SIZE_FIELDS = {
    ("trainer", "accelerator"), ("trainer", "max_steps"), ("trainer", "val_check_interval"),
    ("trainer", "enable_progress_bar"),
    *(("model", "init_args", name) for name in ("context_length", "n_layer", "d_model", "d_ff",
                                                 "memory_length")),
    *(("data", "init_args", name) for name in ("block_size", "eval_context", "eval_stride",
                                                "train_tokens", "eval_tokens", "k_schedule",
                                                "eval_ks")),
    ("data", "init_args", "tokenizer", "kind"), ("data", "init_args", "tokenizer", "max_vocab"),
    ("data", "init_args", "graph", "k")}
# What it changes besides sizes, by trained part: field → (the GPU config's value, the
# rehearsal's). The base LM's schedule: 60 steps cannot warm up over the table's 300, and a
# 64-wide model takes a larger step than a 512-wide one.
REHEARSAL_OTHER_CHANGES: dict[str, dict[tuple, tuple[Any, Any]]] = {
    "base_lm": {("model", "init_args", "optim", "lr"): (1.0e-3, 5.0e-3),
                ("model", "init_args", "optim", "warmup_steps"): (300, 10)}}


def undeclared_changes(part: str, gpu: dict, overlay: dict, recorded: dict) -> list[str]:
    """How the config ``recorded`` for a trained ``part`` (nested dicts) departs from its GPU
    chain merged (``gpu``) otherwise than ``REHEARSAL_SIZE_FIELDS`` and
    ``REHEARSAL_OTHER_CHANGES`` allow, one phrase each; also each field the size ``overlay``
    sets that neither lists. Empty when the rehearsal ran the GPU config's every other option."""
    other = REHEARSAL_OTHER_CHANGES.get(part, {})
    table, rehearsed = yaml_leaves(gpu), yaml_leaves(recorded)
    found = [f"{'.'.join(path)} is set by the overlay but listed nowhere"
             for path in yaml_leaves(overlay)
             if path not in REHEARSAL_SIZE_FIELDS and path not in other]
    for path, value in table.items():
        if path in REHEARSAL_SIZE_FIELDS:
            continue
        expected = value
        if path in other:
            listed_table, expected = other[path]
            if value != listed_table:
                found.append(f"{'.'.join(path)} is {value!r} in the GPU config, listed as "
                             f"{listed_table!r}")
        if rehearsed.get(path) != expected:
            found.append(f"{'.'.join(path)}: {rehearsed.get(path)!r}, not {expected!r}")
    found += [f"{'.'.join(path)} is listed but not in the GPU config" for path in other
              if path not in table]
    return found
