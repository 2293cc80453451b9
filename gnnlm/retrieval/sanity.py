"""Whether retrieval discriminates: the spread of similarities within a query's top k.

kNN-LM's gain rests on the neighbours' order: p_kNN weighs neighbour i by exp(s_i / T)
(Khandelwal et al. 2020; ``gnnlm.retrieval.knn``), so it only retrieves when the similarities of
a query's top k differ by a fair part of T. When a base LM's keys all point the same way (an
LM trained for a few steps: every valid query's top-1 cosine ≥ 0.999), the top k of every query
lie within float rounding of each other, the weights are uniform whatever T, and kNN-LM's
"gain" is smoothing by the next tokens of near-arbitrary train positions, not retrieval.

``retrieval_sanity`` measures it on a key's valid kNN cache (where k, T and λ are fitted):

- ``spread_at_k`` / ``spread_at_K``: the median over queries of top-1 minus the k-th (K-th)
  similarity (max − min of the first k: exact scores in the index's order need not be sorted);
- ``flat_share``: the share of queries whose first k similarities all lie within
  ``flat_tolerance`` of each other (0.05 × the smallest T of the metric's default grid: even at
  that T their weights differ by under 5%, exp(0.05) = 1.05; 1e-4 for cosine);
- ``temperature_on_grid_edge``: the fitted T is the grid's smallest or largest;
- ``temperature_effect``: valid perplexity's relative range over the grid's T at the fitted k and
  λ (None with one T): near 0 when T changes nothing.

``degenerate`` is ``flat_share`` ≥ ``FLAT_SHARE_WARN``. Everything is numpy/torch over the
stored arrays, in row blocks: no model or index is read.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from gnnlm.retrieval.knn import check_k, default_temperatures, sweep

# Measured on WikiText-2 slices, cosine similarity, `final` keys, on the valid caches:
# - degenerate: the own-corpus example's base LM (2 layers, width 64, 80 steps on 1,500 train
#   lines; configs/examples/own_corpus): median top-1 minus top-64 1.4e-4, 38% of queries with
#   their 64 neighbours within 1e-4 (78% at k = 8), T changes valid perplexity by 0.08%;
# - healthy: the test pipeline's base LM (configs/tests/pipeline.yaml): median spread 4.1e-3
#   (`att` keys 4.8e-3), 0.00% within 1e-4 at k = 64 (5.5% at k = 8), T changes it by 2.2%.
# A fifth of queries sits between the two at every k from 8 to 64.
FLAT_SHARE_WARN = 0.2
# T moving valid perplexity by less than this at the fitted k and λ is T changing nothing
# (measured above: 0.08% degenerate, 2.2-2.5% healthy); `gnnlm sweep` notes it.
TEMPERATURE_EFFECT_NOTE = 0.005
# 0.05 × the metric grid's smallest T: within it, weights differ by under 5% at any T of the grid
FLAT_TOLERANCE_OF_T = 0.05
# rows per block: sims [rows, K] in float64 stay under 32 MB at K = 1024, whatever the split
_BLOCK = 1 << 12


def flat_tolerance(metric: str) -> float:
    """Similarities closer than this are not told apart at any T of the metric's default grid."""
    return FLAT_TOLERANCE_OF_T * min(default_temperatures(metric))


def spread(sims: Any, k: int) -> np.ndarray:
    """Per query, max − min of its first k similarities, float64 [n]; NaN where one of them is
    missing (-inf: fewer than k neighbours)."""
    out = np.empty(len(sims), dtype=np.float64)
    for r0 in range(0, len(sims), _BLOCK):
        s = np.asarray(sims[r0:r0 + _BLOCK, :k], dtype=np.float64)
        gap = s.max(axis=1) - s.min(axis=1)
        out[r0:r0 + _BLOCK] = np.where(np.isfinite(s).all(axis=1), gap, np.nan)
    return out


def similarity_spread(sims: Any, k: int, tolerance: float) -> dict:
    """``{"queries", "median_spread", "flat_share"}`` of the first k of ``sims`` [n, K] over the
    queries with k neighbours: the median top-1 minus top-k gap and the share within
    ``tolerance``."""
    check_k(k, sims.shape[1])
    gaps = spread(sims, k)
    gaps = gaps[np.isfinite(gaps)]
    if not len(gaps):
        return {"queries": 0, "median_spread": None, "flat_share": None}
    return {"queries": int(len(gaps)), "median_spread": float(np.median(gaps)),
            "flat_share": float(np.mean(gaps < tolerance))}


@dataclass
class Sanity:
    """``retrieval_sanity``'s result: ``facts`` (what results.json records) and the valid
    perplexity grid ``valid_grid`` [T, λ] at the fitted k over ``temperatures`` × ``lambdas``,
    which the temperature's effect is read from and the report plots."""
    facts: dict
    temperatures: list[float]
    lambdas: list[float]
    valid_grid: np.ndarray


def retrieval_sanity(valid: Mapping[str, Any], metric: str, fitted: Mapping[str, Any],
                     grid: Sequence[Sequence[float]]) -> Sanity:
    """How much the valid cache's retrieval discriminates at the ``fitted`` ``k``,
    ``temperature`` and ``lambda`` (``gnnlm.retrieval.knn.fit_and_score``'s) of ``grid`` (ks,
    temperatures, lambdas: ``knn.grid()``); see the module docstring."""
    k, temperature, lambda_ = int(fitted["k"]), float(fitted["temperature"]), float(
        fitted["lambda"])
    sims = valid["sims"]
    K = int(sims.shape[1])
    tolerance = flat_tolerance(metric)
    at_k = similarity_spread(sims, k, tolerance)
    at_K = similarity_spread(sims, K, tolerance)
    ts, lams = [float(t) for t in grid[1]], [float(x) for x in grid[2]]
    valid_grid = sweep(valid, [k], ts, lams)[0]                            # [T, λ]
    effect: Optional[float] = None
    if len(ts) > 1 and lambda_ in lams:
        by_t = valid_grid[:, lams.index(lambda_)]
        effect = float((by_t.max() - by_t.min()) / by_t.min())
    flat = at_k["flat_share"]
    facts = {"split": "valid", "metric": metric, "k": k, "K": K, "temperature": temperature,
             "lambda": lambda_, "queries": at_k["queries"], "spread_at_k": at_k["median_spread"],
             "spread_at_K": at_K["median_spread"], "flat_tolerance": tolerance,
             "flat_share": flat, "flat_share_at_K": at_K["flat_share"],
             "temperature_on_grid_edge": len(ts) > 1 and temperature in (min(ts), max(ts)),
             "temperature_effect": effect,
             "degenerate": flat is not None and flat >= FLAT_SHARE_WARN}
    return Sanity(facts=facts, temperatures=ts, lambdas=lams, valid_grid=valid_grid)


def warning(key: str, facts: Mapping[str, Any], row_label: str) -> dict:
    """The report's warning for a degenerate key (``retrieval_sanity``'s facts)."""
    effect = facts.get("temperature_effect")
    t_said = ("" if effect is None else
              f"; T changes valid perplexity by {effect:.2%} across the grid")
    return {"kind": "degenerate_retrieval", "key": key,
            **{name: facts[name] for name in ("flat_share", "spread_at_k", "k")},
            "message": f"retrieval with `{key}` keys does not discriminate: "
                       f"{facts['flat_share']:.0%} of valid queries have their top "
                       f"{facts['k']} similarities within {facts['flat_tolerance']:.0e} of each "
                       f"other (median top-1 minus top-{facts['k']} "
                       f"{facts['spread_at_k']:.1e}){t_said}, so {row_label}'s gain is "
                       f"smoothing by near-arbitrary neighbours' next tokens, not retrieval. "
                       f"Likely cause: an under-trained base LM whose `{key}` keys all point "
                       f"the same way; train it longer, or use `att` keys or a pretrained LM."}
