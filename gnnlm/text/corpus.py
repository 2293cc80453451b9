"""Finding a corpus on disk: an explicit path, then ``$GNNLM_DATA/<name>``, then a download.

A corpus is a folder with one text file per split (``train``, ``valid``, ``test``), named
``train.txt`` or ``wiki.train.tokens`` (the WikiText release names) and so on. When neither an
explicit path nor ``$GNNLM_DATA`` has it, known names are downloaded once through Hugging Face
``datasets`` into a cache folder; offline, or when one request finds the Hub unreachable (its
client would retry five times, for half a minute), the error says every place that was
searched. ``check_corpus`` asks the same before any work, without downloading.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

SPLITS = ("train", "valid", "test")
SPLIT_FILES = {
    "train": ("train.txt", "wiki.train.tokens", "train.tokens", "train.raw"),
    "valid": ("valid.txt", "wiki.valid.tokens", "valid.tokens", "validation.txt", "valid.raw"),
    "test": ("test.txt", "wiki.test.tokens", "test.tokens", "test.raw"),
}
# corpus name -> (HF dataset, config); the HF "validation" split is our "valid".
HF_DATASETS = {
    "wikitext-2": ("Salesforce/wikitext", "wikitext-2-v1"),
    "wikitext-2-raw": ("Salesforce/wikitext", "wikitext-2-raw-v1"),
    "wikitext-103": ("Salesforce/wikitext", "wikitext-103-v1"),
    "wikitext-103-raw": ("Salesforce/wikitext", "wikitext-103-raw-v1"),
}
DEFAULT_CACHE = Path(os.environ.get("GNNLM_CACHE", Path.home() / ".cache" / "gnnlm" / "corpora"))


class CorpusNotFoundError(FileNotFoundError):
    pass


def split_files(folder: Path) -> dict[str, Path] | None:
    """The split files of a corpus folder, or None if it lacks the train split."""
    found = {}
    for split in SPLITS:
        for name in SPLIT_FILES[split]:
            if (folder / name).is_file():
                found[split] = folder / name
                break
    return found if "train" in found else None


def _download(name: str, target: Path) -> dict[str, Path]:
    """Fetch a known corpus with HF ``datasets`` and write it as plain split files."""
    import datasets  # imported lazily: slow to import and only needed here

    repo, config = HF_DATASETS[name]
    loaded = datasets.load_dataset(repo, config)
    tmp = target.with_name(target.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    for split, hf_split in (("train", "train"), ("valid", "validation"), ("test", "test")):
        # HF wikitext keeps each line's trailing newline; the release files are the concatenation.
        (tmp / f"{split}.txt").write_text("".join(loaded[hf_split]["text"]))
    os.replace(tmp, target)
    files = split_files(target)
    if files is None:
        raise CorpusNotFoundError(f"The download of {name} into {target} has no train split.")
    return files


def hub_endpoint() -> str:
    """The Hugging Face Hub that ``datasets`` downloads from (``HF_ENDPOINT``, as it reads it)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


@functools.lru_cache(maxsize=8)
def hub_unreachable(endpoint: str, timeout: float = 10.0) -> Optional[str]:
    """Why ``endpoint`` cannot be reached from here, from one request without retries (None:
    it answers, whatever the status). Asked once per endpoint and process."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"),
                               timeout=timeout).close()
    except urllib.error.HTTPError:  # a status other than 2xx: it answered
        return None
    except (OSError, ValueError) as err:  # URLError, a timeout, a bad address
        return f"{endpoint}: {getattr(err, 'reason', None) or err}"
    return None


def _offline() -> bool:
    return any(os.environ.get(v) == "1" for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def check_corpus(name: str, path: str | os.PathLike | None = None,
                 data_dir: str | os.PathLike | None = None,
                 cache_dir: str | os.PathLike | None = None) -> None:
    """Refuse now, before anything loads, a corpus that ``locate_corpus`` would neither find on
    this machine nor download (a known name passes when the Hub answers one request), with the
    error it would give; nothing is downloaded here."""
    try:
        locate_corpus(name, path=path, data_dir=data_dir, cache_dir=cache_dir, download=False)
    except CorpusNotFoundError:
        if path is not None or name not in HF_DATASETS or _offline():
            raise
        if hub_unreachable(hub_endpoint()) is not None:  # then it says so, and where it looked
            locate_corpus(name, path=path, data_dir=data_dir, cache_dir=cache_dir)


def locate_corpus(name: str, path: str | os.PathLike | None = None,
                  data_dir: str | os.PathLike | None = None,
                  cache_dir: str | os.PathLike | None = None,
                  download: bool = True) -> dict[str, Path]:
    """Return ``{split: file}`` for corpus ``name``.

    Looks at ``path`` (a folder or its parent), ``data_dir/name`` (``data_dir`` defaults to
    ``$GNNLM_DATA``), ``cache_dir/name``, and finally downloads known names when online.
    """
    looked: list[str] = []
    candidates: list[Path] = []
    if path is not None:
        # an explicit path that is wrong must stop the run, never fall back to another corpus
        if not Path(path).exists():
            raise CorpusNotFoundError(f"Corpus path {path} does not exist: point corpus_path "
                                      f"at the folder holding train.txt, valid.txt, test.txt.")
        candidates += [Path(path), Path(path) / name]
    data_dir = data_dir or os.environ.get("GNNLM_DATA")
    if data_dir:
        candidates.append(Path(data_dir) / name)
    else:
        looked.append("$GNNLM_DATA (not set)")
    cache = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    candidates.append(cache / name)
    for folder in candidates:
        looked.append(str(folder))
        if folder.is_dir() and (files := split_files(folder)):
            return files
    if path is not None:
        raise CorpusNotFoundError(f"Corpus path {path} holds no {name} corpus: expected "
                                  f"train/valid/test text files in {path} or {Path(path) / name}.")
    offline = _offline()
    if name not in HF_DATASETS:
        raise CorpusNotFoundError(
            f"Unknown corpus {name!r}: not found in {', '.join(looked)}, and it is not one of the "
            f"corpora that can be downloaded ({', '.join(sorted(HF_DATASETS))}). Point "
            f"`path` at a folder with train/valid/test text files, or set GNNLM_DATA to a folder "
            f"that contains {name}/.")
    unreachable = hub_unreachable(hub_endpoint()) if download and not offline else None
    if download and not offline and unreachable is None:
        try:
            return _download(name, cache / name)
        except Exception as err:  # no network, hub down, ...
            looked.append(f"Hugging Face datasets {HF_DATASETS[name]} ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:200] if str(err) else ''})")
    elif unreachable is not None:
        looked.append(f"Hugging Face datasets {HF_DATASETS[name]} (the Hub is not reachable: "
                      f"{unreachable})")
    else:
        looked.append("Hugging Face datasets (offline)" if offline else
                      "Hugging Face datasets (not downloaded here)")
    raise CorpusNotFoundError(
        f"Corpus {name!r} not found. Looked in: {'; '.join(looked)}. Set GNNLM_DATA to the folder "
        f"that holds {name}/ (with train.txt, valid.txt, test.txt) or pass its path.")
