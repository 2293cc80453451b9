"""The sampling settings of generation, checked without torch (``gnnlm generate`` answers a
mistake in them at once, before any model loads): ``greedy``, or a ``temperature``, ``top_k``
and ``top_p`` as Hugging Face's warpers read them (``gnnlm.inference.generation.choose``)."""
from __future__ import annotations

from typing import Optional

from gnnlm.inference.served import NotServed

# the smallest normal float32: the log-probabilities are float32, and a temperature below it
# rounds towards 0 when they are divided by it (0/0 at the most likely token: NaN)
MIN_TEMPERATURE = 1.1754943508222875e-38


def check_sampling(max_new_tokens: int, greedy: bool, temperature: Optional[float],
                   top_k: Optional[int], top_p: Optional[float]) -> None:
    """Refuse settings generation cannot use, in one line each."""
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise NotServed(f"max_new_tokens must be at least 1 (got {max_new_tokens}).")
    if greedy and any(v is not None for v in (temperature, top_k, top_p)):
        raise NotServed("greedy decoding takes the most likely token: leave temperature, top_k "
                        "and top_p unset, or sample (greedy off).")
    if temperature is not None and not temperature > 0:
        raise NotServed(f"temperature must be > 0 (got {temperature}).")
    if temperature is not None and temperature < MIN_TEMPERATURE:
        raise NotServed(f"temperature must be at least {MIN_TEMPERATURE:.3g}, the smallest "
                        f"float32 the log-probabilities can be divided by (got {temperature}); "
                        f"as the temperature falls to 0, sampling becomes greedy decoding "
                        f"(greedy on).")
    if top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise NotServed(f"top_k must be a positive integer (got {top_k}).")
    if top_p is not None and not 0 < top_p <= 1:
        raise NotServed(f"top_p must lie in (0, 1] (got {top_p}).")
