"""Each stage of the GPU table at its rate, next to this device's limits, in one process.

    python benchmarks/bench_gpu.py --json bench_gpu.json   # a GPU: the table's shapes (~60 s)
    python benchmarks/bench_gpu.py --json out.json         # a CPU: small shapes (--small)

Limits, measured first: bf16 and float32 (no TF32) matrix products (TFLOP/s), a device-to-device
copy (GB/s), and the naive exact search: a float16 product of 1,024 queries with every key and
one top-K per block (queries/s). Then each stage on random data of the table's shapes
(``configs/wikitext2/pipeline.yaml``: 2,088,628 train keys of width 512, K = 1,024 searched
1,537 wide for the leakage mask; a 6-layer, 512-wide base LM of 33,278 words at context 512;
GNN-LM of 3 layers and 8 heads over blocks of 128 targets):

- ``exact_search``: ``gnnlm.retrieval.exact`` (float16 screening, certified), against the
  naive search; with the queries widened, screened again in float32 or against every key, and
  whether its neighbours equal a float32 screening's on a sample;
- ``kmeans``: ``gnnlm.retrieval.kmeans``, 163,840 keys into 4,096 lists, 10 iterations;
- ``features``: the base LM's forward in float32, as the features stage runs it, and
  ``features_stage``: the stage's loop (the forward, float16 rounding on the device, copies
  and memmap writes one batch behind) with the share of its time that is the forward;
- ``base_lm_step``: a training step (bf16 autocast, float32 softmax, clipping, fused AdamW);
- ``gnn_train[k]``: GNN-LM's training step at k = 32 and 128, its window nodes' features read
  from the features resident on the device, on graphs built beforehand (building and batching
  them on one CPU core, the DataLoader workers' job, is its
  ``graphs_built_tokens_per_s_one_core``; the batch's bytes copied to the device,
  ``batch_mb_copied``);
- ``gnn_eval``: GNN-LM's evaluation with each retrieved window computed once, against the base
  LM's evaluation of the same tokens (sliding windows, stride half the context).
- ``pq_codebooks``: the PQ codec's codebooks (``pq.clustering: torch``): 64 sub-spaces of 8
  dimensions of 65,536 features, 256 centroids each, faiss's 25 iterations; whether the timed
  run and its warm-up gave the same bytes (``same_bytes_twice``);
- ``knn_sweep``: one kNN-LM fit's (k, T, λ) grid (the table's: 8 k × 9 T × 20 λ) over a valid
  cache of WikiText-2's size (217,646 tokens × 1,024 neighbours) on the device, against the
  CPU's sweep of its first rows, and the largest relative gap between their perplexities.

Keys are clustered random vectors, queries near them: how many queries a trained LM's features
widen or send to a second screening is in the neighbours' manifests (``screen``), not here.
Every record has its rate and, where one applies, its limit and their ratio.
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from torch_geometric.data import Batch

from gnnlm.gnn.graph import build_context_graph, build_graph
from gnnlm.gnn.node_features import ResidentRows
from gnnlm.gnn.settings import GraphConfig
from gnnlm.lit.gnn import GNNLM
from gnnlm.models.encode import encode_windows
from gnnlm.models.gpt import GPT, GPTConfig
from gnnlm.retrieval.exact import ExactSearch
from gnnlm.retrieval.exact_scores import COLS, ROWS
from gnnlm.retrieval.features import encode_into
from gnnlm.retrieval.kmeans import batched_kmeans, kmeans
from gnnlm.retrieval.knn import DEFAULT_LAMBDAS, sweep
from gnnlm.retrieval.screening_error import full_precision
from gnnlm.utils.devices import torch_device
from gnnlm.workdir.manifests import write_json_atomic


@dataclass
class Shapes:
    keys: int
    dim: int
    queries: int
    K: int
    kmeans_points: int
    lists: int
    vocab: int
    layers: int
    heads: int
    context: int
    batch: int
    gnn_heads: int
    block: int
    graphs: int
    ks: tuple[int, ...]
    matmul: int
    pq_points: int
    valid_tokens: int
    cache_ks: tuple[int, ...]


TABLE = Shapes(keys=2_088_628, dim=512, queries=16_384, K=1_537, kmeans_points=163_840,
               lists=4_096, vocab=33_278, layers=6, heads=8, context=512, batch=32,
               gnn_heads=8, block=128, graphs=8, ks=(32, 128), matmul=8192, pq_points=65_536,
               valid_tokens=217_646, cache_ks=(8, 16, 32, 64, 128, 256, 512, 1024))
SMALL = Shapes(keys=20_000, dim=64, queries=512, K=80, kmeans_points=8_192, lists=64,
               vocab=2_000, layers=2, heads=2, context=64, batch=8, gnn_heads=4, block=32,
               graphs=2, ks=(4, 8), matmul=256, pq_points=2_048, valid_tokens=8_192,
               cache_ks=(8, 16, 32, 64))
TEMPERATURES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # the table's (cos)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeat: int = 3) -> float:
    """Seconds per call of ``fn`` after one warm-up call, the best of ``repeat``."""
    fn()
    sync(device)
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def clustered(n: int, d: int, device: torch.device, seed: int) -> torch.Tensor:
    """float16 [n, d]: points around n/512 random centres, as LM states crowd around contexts."""
    gen = torch.Generator(device=device).manual_seed(seed)
    centres = torch.randn(max(1, n // 512), d, device=device, generator=gen)
    label = torch.randint(0, len(centres), (n,), device=device, generator=gen)
    return (centres[label] + 0.5 * torch.randn(n, d, device=device, generator=gen)).half()


# -- limits ----------------------------------------------------------------------------------
def limits(s: Shapes, device: torch.device) -> dict:
    n = s.matmul
    out = {}
    for name, dtype in (("bf16_matmul_tflops", torch.bfloat16),
                        ("fp32_matmul_tflops", torch.float32)):
        a = torch.randn(n, n, device=device, dtype=dtype)
        with full_precision():
            seconds = timed(lambda a=a: a @ a, device)
        out[name] = 2 * n ** 3 / seconds / 1e12
    x = torch.empty(1 << (28 if device.type == "cuda" else 24), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    out["copy_gbps"] = 2 * x.numel() / timed(lambda: y.copy_(x), device) / 1e9  # read + write
    return out


# -- retrieval -------------------------------------------------------------------------------
def retrieval(s: Shapes, device: torch.device) -> dict:
    keys = clustered(s.keys, s.dim, device, seed=0)
    picks = torch.randint(0, s.keys, (s.queries,), device=device,
                          generator=torch.Generator(device=device).manual_seed(1))
    queries = (keys[picks].float() + 0.1 * torch.randn(s.queries, s.dim, device=device)).half()
    block = min(1024, s.queries)

    def naive(unit: torch.Tensor) -> None:
        for r0 in range(0, s.queries, block):
            q = F.normalize(queries[r0:r0 + block].float(), dim=1).half()
            (q @ unit.T).topk(s.K, dim=1)

    unit = F.normalize(keys.float(), dim=1).half()
    naive_qps = s.queries / timed(lambda unit=unit: naive(unit), device, repeat=1)
    unit = unit.new_empty(0)  # its memory back before the exact search takes its own
    t0 = time.perf_counter()
    search = ExactSearch(keys, "cos", device, screen="auto")
    sync(device)
    prepare = time.perf_counter() - t0
    search.search(queries[:block], s.K)                                   # warm-up
    search.stats = dict.fromkeys(search.stats, 0)
    t0 = time.perf_counter()
    search.search(queries, s.K)
    sync(device)
    exact_qps = s.queries / (time.perf_counter() - t0)
    stats = {f"{k}_rows": v for k, v in search.stats.items()}
    sample = queries[:256]
    fast = search.search(sample, s.K)
    slow = ExactSearch(keys, "cos", device, screen="float32").search(sample, s.K)
    record = {"queries_per_s": exact_qps, "limit_naive_queries_per_s": naive_qps,
              "ratio": exact_qps / naive_qps, "screen": search.screen,
              "prepare_seconds": prepare, **stats,
              "equal_to_float32_screening": bool(np.array_equal(fast[0], slow[0])
                                                 and np.array_equal(fast[1], slow[1])),
              "scores_independent_of_position": scores_independent_of_position(search,
                                                                               queries)}
    points = keys[:s.kmeans_points].float()
    seconds = timed(lambda: kmeans(points, s.lists, 10, metric="ip", spherical=True), device,
                    repeat=1)
    flops = 2 * 10 * s.kmeans_points * s.lists * s.dim
    return {"naive_search_queries_per_s": naive_qps, "exact_search": record,
            "kmeans": {"seconds": seconds, "tflops": flops / seconds / 1e12}}


def scores_independent_of_position(search: ExactSearch, queries: torch.Tensor) -> bool:
    """Whether this device's exact score of a pair is the same wherever the pair sits in the
    product's tiles, as the exact search's definition takes it to be (a GPU's product may split
    some tiles' sums otherwise than others'): the first 8,192 keys' scores against 32 queries,
    the keys reversed, shifted by one column, with 5 query rows, and re-scored in batches."""
    q = search._queries(queries[:ROWS])
    ids = torch.arange(min(2 * COLS, search.n), device=search.device)
    keys = search._rows(ids)
    scores = search.pair_scores(q, keys)
    gen = torch.Generator().manual_seed(0)
    cand = torch.stack([torch.randperm(len(ids), generator=gen)[:min(len(ids), 1537)]
                        for _ in range(ROWS)]).to(search.device)
    return (torch.equal(scores, search.pair_scores(q, keys.flip(0)).flip(1))
            and torch.equal(scores, search.pair_scores(q, torch.cat([keys[-1:], keys]))[:, 1:])
            and torch.equal(scores[:5], search.pair_scores(q[:5], keys))
            and torch.equal(scores.gather(1, cand), search._rescore(q, cand)))


# -- the base LM -----------------------------------------------------------------------------
def gpt(s: Shapes, device: torch.device) -> GPT:
    cfg = GPTConfig(vocab_size=s.vocab, context_length=s.context, n_layer=s.layers,
                    n_head=s.heads, d_model=s.dim, d_ff=4 * s.dim, dropout=0.0)
    return GPT(cfg).to(device)


def lm_flops_per_token(s: Shapes, model: GPT, training: bool) -> float:
    """Matrix-product flops of one token: 2 per weight (the embedding table is a lookup; the
    tied softmax is not), attention's scores and values, times 3 with the backward pass."""
    weights = sum(p.numel() for n, p in model.named_parameters()
                  if p.ndim == 2 and not n.startswith("wte"))
    forward = 2 * weights + 2 * 2 * s.layers * s.context * s.dim
    return forward * (3 if training else 1)


def base_lm(s: Shapes, device: torch.device, compile_step: bool) -> dict:
    torch.manual_seed(0)
    model = gpt(s, device)
    tokens = torch.randint(0, s.vocab, (s.batch, s.context + 1), device=device)
    out: dict = {}

    @torch.no_grad()
    def features() -> None:
        model.eval()
        model(tokens[:, :-1])

    with full_precision():
        seconds = timed(features, device)
    out["features"] = {"tokens_per_s": s.batch * s.context / seconds,
                       "tflops": lm_flops_per_token(s, model, False) * s.batch * s.context
                       / seconds / 1e12, "precision": "float32"}
    with full_precision():
        out["features_stage"] = features_stage(s, model, device, out["features"]["tokens_per_s"])
    params = list(model.parameters())
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=fused or None)
    forward = torch.compile(model) if compile_step else model

    def step() -> None:
        model.train()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            final = forward(tokens[:, :-1]).final
        logits = model.logits(final.float()).flatten(0, 1)      # the softmax in float32
        loss = F.cross_entropy(logits, tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    t0 = time.perf_counter()
    step()
    sync(device)
    first = time.perf_counter() - t0
    seconds = timed(step, device, repeat=5)
    out["base_lm_step"] = {"tokens_per_s": s.batch * s.context / seconds,
                           "tflops": lm_flops_per_token(s, model, True) * s.batch * s.context
                           / seconds / 1e12, "fused_adamw": fused, "compiled": compile_step,
                           "first_step_seconds": first}
    # evaluation as the report scores: windows of the context, stride half of it (every
    # scored token costs two positions' forward), the float32 log-softmax
    @torch.no_grad()
    def evaluate() -> None:
        model.eval()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            final = model(tokens[:, :-1]).final
        torch.log_softmax(model.logits(final[:, s.context // 2:].float()), dim=-1)

    seconds = timed(evaluate, device)
    out["base_lm_eval"] = {"tokens_per_s": s.batch * (s.context // 2) / seconds}
    return out


def features_stage(s: Shapes, model: GPT, device: torch.device,
                   forward_tokens_per_s: float) -> dict:
    """The features stage's own loop (``gnnlm.retrieval.features.encode_into``): 8 batches of
    windows (stride half the context) encoded and written into fresh memmaps, against the
    forward passes alone; and whether the float16 bytes it wrote equal the host's rounding of
    the same forward's float32 output (the device rounds and copies them, one batch behind)."""
    batches = 8
    windows = batches * s.batch
    stride = s.context // 2
    tokens = np.random.default_rng(0).integers(0, s.vocab, s.context + (windows - 1) * stride)
    n = len(tokens)
    with tempfile.TemporaryDirectory() as tmp:
        def encode() -> dict[str, np.ndarray]:
            arrays = {key: np.memmap(Path(tmp) / f"{key}.bin", dtype=np.float16, mode="w+",
                                     shape=(n, s.dim)) for key in ("final", "att")}
            encode_into(arrays, encode_windows(model, tokens, 0, s.context, stride, None,
                                               s.batch, False, device), "lm_logprob.bin")
            return arrays

        seconds = timed(encode, device)
        written = encode()
        same = True
        for batch in encode_windows(model, tokens, 0, s.context, stride, None, s.batch, False,
                                    device):
            span = slice(batch.start, batch.start + len(batch.final))
            for key in ("final", "att"):
                host = getattr(batch, key).cpu().numpy().astype(np.float16)
                same &= bool(np.array_equal(host.view(np.uint16),
                                            np.asarray(written[key][span]).view(np.uint16)))
        del written
    forward_seconds = windows * s.context / forward_tokens_per_s
    return {"tokens_per_s": n / seconds, "forward_share": forward_seconds / seconds,
            "equal_to_host_rounding": same}


# -- GNN-LM ----------------------------------------------------------------------------------
class TableFeatures:
    """Node features from an in-memory float16 table, as ``RawFeatures`` reads a memmap (and,
    like it, copied to the GPU that reads them)."""

    def __init__(self, values: np.ndarray):
        self.values, self.dim = values, values.shape[1]
        self.resident_bytes = values.nbytes

    def on_device(self, device: torch.device) -> ResidentRows:
        return ResidentRows(self.values, device)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return self.values[positions].astype(np.float32)


def graphs(s: Shapes, k: int, values: np.ndarray, windows: bool, seed: int) -> list:
    """``s.graphs`` blocks of ``s.block`` targets with random neighbours (K = 1,024 stored)."""
    rng = np.random.default_rng(seed)
    n_train = len(values)
    config = GraphConfig(k=k)
    out = []
    for i in range(s.graphs):
        ctx_pos = np.arange(i * s.block, (i + 1) * s.block) + 10 * s.context
        nbr_ids = rng.integers(0, n_train, (s.block, max(k, min(1024, n_train))))
        if windows:  # window nodes named by train position: the model reads their features
            data = build_graph(ctx_pos, nbr_ids, n_train, config, leakage_window=s.context)
        else:
            data = build_context_graph(ctx_pos, nbr_ids, n_train, config)
        data["ctx"].x = torch.from_numpy(values[ctx_pos].astype(np.float32))
        data["ctx"].y = torch.from_numpy(rng.integers(0, s.vocab, s.block))
        out.append(data)
    return out


def gnn_at(s: Shapes, device: torch.device, k: int, values: np.ndarray) -> tuple[dict, GNNLM]:
    """GNN-LM's training step at k on graphs built beforehand, and their building's rate."""
    torch.manual_seed(0)
    model = GNNLM(vocab_size=s.vocab, feature_dim=s.dim, heads=s.gnn_heads, dropout=0.1,
                  zero_init_output=False).to(device)
    model.graph = GraphConfig(k=k)
    model.attach_output_embedding(torch.randn(s.vocab, s.dim) * 0.02, None)
    model.attach_node_features(TableFeatures(values), len(values))
    t0 = time.perf_counter()
    batch = Batch.from_data_list(graphs(s, k, values, windows=True, seed=k))
    build = time.perf_counter() - t0
    moved = sum(v.numel() * v.element_size() for store in batch.stores
                for v in store.values() if isinstance(v, torch.Tensor))
    batch = batch.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                  fused=device.type == "cuda" or None)

    def step() -> None:
        del batch["nbr"].x  # read again from the resident features in every step, as in a fit
        model.train()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = F.cross_entropy(model(batch), batch["ctx"].y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    model.read_node_features(batch)
    seconds = timed(step, device)
    return {"tokens_per_s": s.graphs * s.block / seconds,
            "window_nodes": int(batch["nbr"].num_nodes),
            "batch_mb_copied": moved / 1e6,
            "graphs_built_tokens_per_s_one_core": s.graphs * s.block / build}, model


def gnn_eval(s: Shapes, device: torch.device, model: GNNLM, k: int, values: np.ndarray,
             base_tokens_per_s: float) -> dict:
    """GNN-LM's evaluation with every retrieved window computed once, against the base LM's."""
    context = Batch.from_data_list(graphs(s, k, values, windows=False, seed=k + 1)).to(device)

    @torch.no_grad()
    def evaluate() -> None:
        model.eval()
        model._window_states = None   # every window computed afresh, as for new text
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            torch.log_softmax(model(context), dim=-1)

    rate = s.graphs * s.block / timed(evaluate, device)
    return {"k": k, "tokens_per_s": rate, "base_lm_eval_tokens_per_s": base_tokens_per_s,
            "time_vs_base_lm": base_tokens_per_s / rate}


def gnn(s: Shapes, device: torch.device, base_eval_tokens_per_s: float) -> dict:
    # drawn on the device: numpy's one core takes seconds of the benchmark's minute for 400k
    gen = torch.Generator(device=device).manual_seed(0)
    values = torch.randn(min(s.keys, 400_000), s.dim, device=device, generator=gen).half()
    values = values.cpu().numpy()
    out: dict = {}
    for k in s.ks:
        out[f"gnn_train[{k}]"], model = gnn_at(s, device, k, values)
    out["gnn_eval"] = gnn_eval(s, device, model, max(s.ks), values, base_eval_tokens_per_s)
    return out


# -- host stages on the device --------------------------------------------------------------
def pq_codebooks(s: Shapes, device: torch.device) -> dict:
    """The PQ codec's training as ``pq.clustering: torch`` runs it (``gnnlm.gnn.pq``)."""
    m = s.dim // 8
    x = clustered(s.pq_points, s.dim, device, seed=3).float()
    subspaces = x.view(len(x), m, 8).transpose(0, 1).contiguous()             # [m, n, 8]
    runs: list[torch.Tensor] = []
    seconds = timed(lambda: runs.append(batched_kmeans(subspaces, 256, 25, seed=1234)), device,
                    repeat=1)
    return {"pq_codebooks": {"seconds": seconds, "subspaces": m, "points": s.pq_points,
                             "same_bytes_twice": bool(torch.equal(runs[0], runs[1]))}}


def knn_sweep(s: Shapes, device: torch.device) -> dict:
    """One fit's grid over a valid cache of the table's size (scores sorted as a search returns
    them, 5% of the neighbours hits), on the device and on the CPU (its first rows)."""
    n, K = s.valid_tokens, s.cache_ks[-1]
    gen = torch.Generator(device=device).manual_seed(4)
    cache = {"sims": torch.rand(n, K, device=device, generator=gen).sort(
                 dim=1, descending=True).values.cpu().numpy(),
             "hits": (torch.rand(n, K, device=device, generator=gen) < 0.05).cpu().numpy(),
             "lm_logprob": (-5 * torch.rand(n, device=device, generator=gen)).cpu().numpy()}
    grid = (list(s.cache_ks), list(TEMPERATURES), DEFAULT_LAMBDAS)
    seconds = timed(lambda: sweep(cache, *grid, device=device), device, repeat=1)
    rows = min(n, 16_384)
    head = {name: array[:rows] for name, array in cache.items()}
    t0 = time.perf_counter()
    on_cpu = sweep(head, *grid, device="cpu")
    cpu_seconds = (time.perf_counter() - t0) * n / rows
    gap = np.abs(sweep(head, *grid, device=device) / on_cpu - 1).max()
    return {"knn_sweep": {"seconds": seconds, "tokens": n, "K": K,
                          "points": len(grid[0]) * len(grid[1]) * len(grid[2]),
                          "cpu_seconds_estimate": cpu_seconds, "cpu_rows_timed": rows,
                          "max_relative_gap_to_cpu": float(gap)}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true",
                      help="small shapes (the default on a CPU)")
    size.add_argument("--table", action="store_true",
                      help="the table's shapes (the default on a GPU)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--compile", action="store_true",
                        help="also time the base-LM step under torch.compile")
    parser.add_argument("--json", type=Path, help="also write the records here")
    args = parser.parse_args(argv)
    device = torch_device(args.device)
    shapes = SMALL if args.small or (device.type != "cuda" and not args.table) else TABLE
    t0 = time.perf_counter()
    record: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else f"cpu ({torch.get_num_threads()} threads)",
                    "shapes": shapes.__dict__, "torch": torch.__version__}

    def save() -> None:  # after every part, whole: a time limit keeps what finished
        record["seconds"] = time.perf_counter() - t0
        if args.json:
            write_json_atomic(args.json, record)

    record["limits"] = limits(shapes, device)
    save()
    record.update(retrieval(shapes, device))
    save()
    record.update(base_lm(shapes, device, compile_step=False))
    save()
    if args.compile:
        record["base_lm_step_compiled"] = base_lm(shapes, device, True)["base_lm_step"]
        save()
    record.update(gnn(shapes, device, record["base_lm_eval"]["tokens_per_s"]))
    save()
    record.update(pq_codebooks(shapes, device))
    save()
    record.update(knn_sweep(shapes, device))
    lim = record["limits"]
    record["base_lm_step"]["share_of_bf16_matmul"] = (record["base_lm_step"]["tflops"]
                                                      / lim["bf16_matmul_tflops"])
    for name in ("features", "kmeans"):
        record[name]["share_of_fp32_matmul"] = record[name]["tflops"] / lim["fp32_matmul_tflops"]
    save()
    print(summary(record))
    return record


def summary(r: dict) -> str:
    """The records as lines: each rate, and the limit it is measured against."""
    lim, ex = r["limits"], r["exact_search"]
    lines = [f"{r['device']}, torch {r['torch']}: {r['seconds']:.0f} s",
             f"limits: bf16 matmul {lim['bf16_matmul_tflops']:.1f} TFLOP/s, float32 matmul "
             f"{lim['fp32_matmul_tflops']:.1f} TFLOP/s, copy {lim['copy_gbps']:.0f} GB/s",
             f"exact search ({ex['screen']} screening): {ex['queries_per_s']:,.0f} queries/s, "
             f"{ex['ratio']:.2f}x the naive product + top-k ({ex['limit_naive_queries_per_s']:,.0f}"
             f"); of {ex['queries_rows']:,} queries {ex['widened_rows']:,} widened, "
             f"{ex['rescreened_rows']:,} screened again in float32, "
             f"{ex['exhaustive_rows']:,} against every key; equal to float32 screening: "
             f"{ex['equal_to_float32_screening']}; a pair's score wherever it sits: "
             f"{ex['scores_independent_of_position']}",
             f"k-means: {r['kmeans']['seconds']:.2f} s, {r['kmeans']['tflops']:.1f} TFLOP/s "
             f"({r['kmeans']['share_of_fp32_matmul']:.0%} of float32 matmul)",
             f"features: {r['features']['tokens_per_s']:,.0f} tokens/s, "
             f"{r['features']['share_of_fp32_matmul']:.0%} of float32 matmul; the stage's "
             f"loop {r['features_stage']['tokens_per_s']:,.0f} scored tokens/s, "
             f"{r['features_stage']['forward_share']:.0%} of it the forward passes, bytes equal "
             f"to the host's rounding: {r['features_stage']['equal_to_host_rounding']}",
             f"base-LM step: {r['base_lm_step']['tokens_per_s']:,.0f} tokens/s, "
             f"{r['base_lm_step']['share_of_bf16_matmul']:.0%} of bf16 matmul"]
    if "base_lm_step_compiled" in r:
        c = r["base_lm_step_compiled"]
        lines.append(f"base-LM step compiled: {c['tokens_per_s']:,.0f} tokens/s after a first "
                     f"step of {c['first_step_seconds']:.0f} s")
    for name, rec in r.items():
        if name.startswith("gnn_train"):
            k = name[len("gnn_train"):]
            lines.append(f"GNN-LM training{k}: {rec['tokens_per_s']:,.0f} tokens/s; graphs "
                         f"built at {rec['graphs_built_tokens_per_s_one_core']:,.0f} tokens/s "
                         f"per CPU core, {rec['batch_mb_copied']:,.1f} MB per batch copied")
    g = r["gnn_eval"]
    lines.append(f"GNN-LM evaluation (k = {g['k']}): {g['tokens_per_s']:,.0f} tokens/s, "
                 f"{g['time_vs_base_lm']:.2f}x the base LM's time "
                 f"({g['base_lm_eval_tokens_per_s']:,.0f} tokens/s)")
    pq, sw = r["pq_codebooks"], r["knn_sweep"]
    lines.append(f"PQ codebooks ({pq['subspaces']} sub-spaces of {pq['points']:,} features): "
                 f"{pq['seconds']:.2f} s")
    lines.append(f"kNN-LM fit ({sw['points']:,} points over {sw['tokens']:,} tokens x "
                 f"{sw['K']:,}): {sw['seconds']:.2f} s, the CPU's about "
                 f"{sw['cpu_seconds_estimate']:.2f} s; perplexities apart by at most "
                 f"{sw['max_relative_gap_to_cpu']:.1e}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
