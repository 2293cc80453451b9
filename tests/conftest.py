"""Shared fixtures: where WikiText-2 lives, W&B offline, and small real-data work directories."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ``make test`` runs the suite on pytest-xdist workers (``--dist loadgroup``). Each worker
# computes on its share of the cores: two workers of two threads each on two cores would
# oversubscribe them (OpenMP threads spinning on a busy core). The subprocesses tests start
# inherit the setting.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, _threads)

# The session fixtures that take minutes, in order: a test reading one runs on the worker that
# built it (the first it reads, in this order); any other test runs beside its module, so that
# a module's own fixtures are built once too.
SHARED_FIXTURES = ("run_dir", "hf_family_built", "gpt2_work", "smollm2_work", "smollm2",
                   "wikitext_tokens")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = next((name for name in SHARED_FIXTURES if name in item.fixturenames),
                     item.nodeid.split("::")[0])
        item.add_marker(pytest.mark.xdist_group(group))


def data_dir() -> Path:
    return Path(os.environ.get("GNNLM_DATA", REPO.parent / "shared" / "data"))


def wikitext_slice(wikitext_root: Path, folder: Path, chars: dict[str, int]) -> Path:
    """A corpus folder of the first ``chars[split]`` characters of each WikiText-2 split, each
    cut at a line end."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in chars.items():
        text = (wikitext_root / "wikitext-2" / f"{split}.txt").read_text()[:n]
        (folder / f"{split}.txt").write_text(text[:text.rindex("\n") + 1])
    return folder


@pytest.fixture
def one_faiss_thread():
    """faiss on one thread: on 2 shared cores, OpenMP spinning on a busy core makes faiss
    training several times slower than one thread."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@pytest.fixture(scope="session")
def wikitext_root() -> Path:
    root = data_dir()
    if not (root / "wikitext-2" / "train.txt").is_file():
        pytest.fail(f"WikiText-2 not found under {root}: set GNNLM_DATA to the folder holding "
                    f"wikitext-2/ (the default is ../shared/data).")
    return root


@pytest.fixture(scope="session")
def wikitext_tokens(wikitext_root, tmp_path_factory):
    """The whole of WikiText-2, word level, tokenized once per session."""
    from gnnlm.text.tokens import build_tokens

    return build_tokens(tmp_path_factory.mktemp("wt2") / "tokens", "wikitext-2",
                        data_dir=str(wikitext_root))


# The demo's pipeline configs, and the CPU base LM's `gnnlm fit` configs.
CPU = ["-c", "configs/wikitext2/pipeline.yaml", "-c", "configs/wikitext2/pipeline_cpu.yaml"]
LM = ["-c", "configs/trainer/cpu.yaml", "-c", "configs/wikitext2/base_lm.yaml",
      "-c", "configs/wikitext2/base_lm_cpu.yaml"]


@pytest.fixture
def in_repo(monkeypatch):
    """Run in the repository root: configs name each other relative to it."""
    monkeypatch.chdir(REPO)


# The test pipeline's commands: its config is an overlay of the demo's configs.
PIPELINE = ["-c", "configs/wikitext2/pipeline.yaml", "-c", "configs/wikitext2/pipeline_cpu.yaml",
            "-c", "configs/tests/pipeline.yaml"]


def run_gnnlm(args: list[str], cwd: Path, timeout: int = 2700) -> subprocess.CompletedProcess:
    """Run the ``gnnlm`` command in ``cwd`` (where ``configs/`` points at the repo's)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([sys.executable, "-m", "gnnlm.cli", *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"gnnlm {' '.join(args)} failed:\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


# a wheel the table script installs from its wheel folder, as it installs faiss on a GPU machine
PROBE_WHEEL = "gnnlm_table_probe"


def write_probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (PEP 427: the package, METADATA, WHEEL, RECORD)."""
    import base64
    import hashlib
    import zipfile

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(
            b"=").decode()

    dist = f"{PROBE_WHEEL}-1.0.dist-info"
    files = {f"{PROBE_WHEEL}/__init__.py": "VERSION = '1.0'\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PROBE_WHEEL}\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = [f"{name},sha256={digest(text)},{len(text.encode())}"
              for name, text in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{PROBE_WHEEL}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


@pytest.fixture(scope="session")
def run_dir(wikitext_root, tmp_path_factory) -> Path:
    """The test pipeline once per session, in a fresh folder, through ``scripts/gpu_table.sh``
    (the one-command table) with the test overlays: its wheel folder holds a probe wheel, its
    output goes to ``table/``. It takes about 5 minutes on two idle cores; the timeout leaves
    room for a machine loaded several times over."""
    cwd = tmp_path_factory.mktemp("pipeline")
    (cwd / "configs").symlink_to(REPO / "configs")
    os.environ["GNNLM_DATA"] = str(wikitext_root)
    write_probe_wheel(cwd / "wheels")
    env = {**os.environ, "PYTHON": sys.executable, "GNNLM_WHEELS": str(cwd / "wheels"),
           "GNNLM_SITE": str(cwd / "site")}
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_table.sh"), "table",
                             *PIPELINE[2:]], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=2700)
    if result.returncode != 0:
        raise AssertionError(f"scripts/gpu_table.sh failed:\n{result.stdout[-6000:]}\n"
                             f"{result.stderr[-3000:]}")
    return cwd


@pytest.fixture(scope="session")
def workdir(run_dir) -> Path:
    return run_dir / "runs" / "tests" / "pipeline"


@pytest.fixture(scope="session")
def results(workdir) -> dict:
    return json.loads((workdir / "reports" / "tests" / "results.json").read_text())


@pytest.fixture(scope="session")
def hf_family_built(wikitext_root, tmp_path_factory):
    """The retrieval pipeline with GNN-LM (configs/tests/hf_family.yaml) on a tiny random-weight
    GPT-2 with a BPE trained on the slice: the first 40k characters of WikiText-2's train split
    and 10k of valid and test. Returns (its arguments without the work directory, the work
    directory); tests change copies of it."""
    from gnnlm.pipeline.config import load_config
    from gnnlm.pipeline.stages import run
    from tests.families import FAMILIES, save_family, train_bpe

    root = tmp_path_factory.mktemp("hf-family")
    corpus = wikitext_slice(wikitext_root, root / "slice",
                            {"train": 40_000, "valid": 10_000, "test": 10_000})
    folder = save_family(FAMILIES["gpt2"], train_bpe((corpus / "train.txt").read_text(), 300),
                         root / "gpt2")
    args = ["-c", "configs/tests/hf_family.yaml", f"--base_lm.ckpt=hf:{folder}",
            f"--corpus.path={corpus}", "--knn.keys=[final]"]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the config names others relative to the repository
        run(load_config([*args, f"--workdir={root / 'work'}"]))
    return args, root / "work"


# the GPU table's rehearsal: configs/tests/gpu_rehearsal.yaml and its fit overlays (sizes, the
# device and the other changes tests/rehearsal.py lists)
REHEARSAL_SIZE_OVERLAYS = "configs/tests/gpu_rehearsal/"


def yaml_leaves(tree, prefix=()) -> dict:
    """``{path: value}`` of a nested dict's leaves (lists are leaves)."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items()
                for k, v in yaml_leaves(sub, (*prefix, key)).items()}
    return {prefix: tree}
