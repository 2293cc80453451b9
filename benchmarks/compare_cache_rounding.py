"""Incremental decoding through a Hugging Face base LM's key/value cache against each prefix read
from scratch, in float32 and in bfloat16: how far generation's next-token distribution is from
``score``'s and ``next_token_logprobs``' when the model rounds its sums to bf16.

    make smollm2
    python benchmarks/compare_cache_rounding.py [--ckpt models/smollm2/...gguf] [--json OUT]

A stretch of WikiText-2 valid, opened with the model's BOS, is read through the sliding windows
gnnlm decodes with (``gnnlm.models.decode``: ``StreamDecoder`` with the cache, ``stream_features``
from scratch), one token at a time past the first window. Printed per dtype: the largest
difference of a probability, of log p of the token that follows, and the largest total
variation over the steps.
"""
from __future__ import annotations

import argparse
import json

import torch

from gnnlm.models import load_base_lm
from gnnlm.models.decode import StreamDecoder, stream_features
from gnnlm.text.corpus import locate_corpus

GGUF = "models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@torch.no_grad()
def compare(ckpt: str, dtype: str, ids: torch.Tensor, context: int, stride: int,
            first: int) -> dict:
    lm = load_base_lm(ckpt, None if dtype == "float32" else {"dtype": dtype})
    bos = int(ids[0, 0])
    decoder = StreamDecoder(lm, context, stride, bos)
    decoder.append(ids[:, :first], first - 1)
    worst_p = worst_next = worst_tv = 0.0
    for t in range(first, ids.shape[1] - 1):
        cached = decoder.append(ids[:, t:t + 1], t).final[:, -1]
        scratch = stream_features(lm, ids[:, :t + 1], [t], context, stride, bos).final[:, -1]
        a = torch.log_softmax(lm.logits(cached), -1)[0]
        b = torch.log_softmax(lm.logits(scratch), -1)[0]
        nxt = int(ids[0, t + 1])
        worst_p = max(worst_p, float((a.exp() - b.exp()).abs().max()))
        worst_next = max(worst_next, float((a[nxt] - b[nxt]).abs()))
        worst_tv = max(worst_tv, float(0.5 * (a.exp() - b.exp()).abs().sum()))
    return {"dtype": dtype, "steps": ids.shape[1] - 1 - first, "max_abs_p": worst_p,
            "max_abs_logp_next": worst_next, "max_total_variation": worst_tv}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", default=GGUF, help="the base LM (a GGUF file or hf:<folder>)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--stride", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=160, help="tokens read after BOS")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if args.ckpt.endswith(".gguf"):
        folder, name = args.ckpt.rsplit("/", 1)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.ckpt.removeprefix("hf:"))
    text = locate_corpus("wikitext-2", download=False)["valid"].read_text()[2000:8000]
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[bos, *tokenizer(text).input_ids[:args.tokens]]])
    rows = [compare(args.ckpt, dtype, ids, args.context, args.stride, first=32)
            for dtype in ("float32", "bfloat16")]
    for row in rows:
        print(f"{row['dtype']:>9}: {row['steps']} steps (window {args.context}, stride "
              f"{args.stride}): max |Δp| {row['max_abs_p']:.2e}, max |Δ log p(next)| "
              f"{row['max_abs_logp_next']:.2e}, max total variation "
              f"{row['max_total_variation']:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ckpt": args.ckpt, "context": args.context, "stride": args.stride,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
