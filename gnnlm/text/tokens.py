"""Tokenization: word level (WikiText convention), character level, and Hugging Face tokenizers.

The vocabulary is built from the train split only. Each split becomes one token stream, stored
as a uint16/uint32 memmap in ``<workdir>/tokens/`` with a manifest (vocabulary size, the id used
as beginning-of-stream, counts, the fingerprint of the source files and the tokenizer).

Word level follows the WikiText convention: ``line.split() + ['<eos>']`` for every line, empty
lines included, and ``<unk>`` is an ordinary token.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from gnnlm.text.corpus import SPLIT_FILES, SPLITS, locate_corpus
from gnnlm.text.gguf_paths import gguf_candidates
from gnnlm.text.settings import TokenizerConfig  # the settings, without tokenizers: for configs
from gnnlm.text.text_files import read_text
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.fingerprints import file_sha256, fingerprint
from gnnlm.workdir.manifests import open_array, read_manifest
from gnnlm.workdir.refusals import ArtifactError, refusal

EOS, UNK = "<eos>", "<unk>"


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":  # the file's final newline does not open another line
        lines.pop()
    return lines


class Tokenizer:
    """Common interface: ``encode(text) -> ids``, ``tokens(ids) -> strings``, ``bos_id`` (the
    token that opens each split's stream) and ``bos_each_window`` (whether the model also reads
    it first in every window: Hugging Face tokenizers that prepend a BOS, e.g. Llama's ``<s>``)."""
    kind: str
    vocab_size: int
    bos_id: int
    bos_each_window = False

    def vocabulary(self) -> list[str]:
        """The tokens in id order."""
        raise NotImplementedError

    def vocab_fingerprint(self) -> str:
        """A hash of the ordered token list: ids mean the same thing where it is equal."""
        text = json.dumps(self.vocabulary(), ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def encode_prompt(self, text: str) -> np.ndarray:
        """The ids of a text to be continued where it stops: as ``encode``, but a last line
        that the text does not end with a newline stays open (no end-of-line after it)."""
        return self.encode(text)

    def tokens(self, ids) -> list[str]:
        raise NotImplementedError

    def save(self, folder: Path) -> None:
        raise NotImplementedError

    @classmethod
    def load(cls, folder: Path) -> Tokenizer:
        raise NotImplementedError

    def decode(self, ids) -> str:
        return " ".join(self.tokens(ids))


class WordTokenizer(Tokenizer):
    kind = "word"

    def __init__(self, vocab: list[str]):
        self.vocab = vocab
        self.stoi = {w: i for i, w in enumerate(vocab)}
        self.vocab_size = len(vocab)
        self.bos_id = self.stoi[EOS]
        self.unk_id = self.stoi[UNK]

    @classmethod
    def fit(cls, train_text: str, max_vocab: Optional[int] = None) -> WordTokenizer:
        counts = Counter(w for line in _lines(train_text) for w in line.split())
        counts.pop(EOS, None), counts.pop(UNK, None)
        # Specials first, then by frequency (ties in order of first appearance).
        keep = None if max_vocab is None else max(0, max_vocab - 2)
        return cls([EOS, UNK] + [w for w, _ in counts.most_common(keep)])

    def encode(self, text: str) -> np.ndarray:
        words = [w for line in _lines(text) for w in (*line.split(), EOS)]
        get, unk = self.stoi.get, self.unk_id
        return np.fromiter((get(w, unk) for w in words), dtype=np.int64, count=len(words))

    def encode_prompt(self, text: str) -> np.ndarray:
        ids = self.encode(text)
        return ids if text.endswith("\n") or not len(ids) else ids[:-1]  # its line's <eos>

    def tokens(self, ids) -> list[str]:
        return [self.vocab[int(i)] for i in ids]

    def vocabulary(self) -> list[str]:
        return list(self.vocab)

    def save(self, folder: Path) -> None:
        (folder / "vocab.json").write_text(json.dumps(self.vocab, ensure_ascii=False))

    @classmethod
    def load(cls, folder: Path) -> WordTokenizer:
        return cls(json.loads((folder / "vocab.json").read_text()))


class CharTokenizer(Tokenizer):
    r"""One id per Unicode character of the raw text; ``\n`` marks line ends and opens streams."""
    kind = "char"

    def __init__(self, vocab: list[str]):
        self.vocab = vocab  # vocab[0] is UNK, the rest single characters
        self.vocab_size = len(vocab)
        self.codepoints = np.array([ord(c) for c in vocab[1:]], dtype=np.uint32)
        self.order = np.argsort(self.codepoints)
        self.bos_id = vocab.index("\n")
        self.unk_id = 0

    @staticmethod
    def _codepoints(text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)

    @classmethod
    def fit(cls, train_text: str) -> CharTokenizer:
        values, counts = np.unique(cls._codepoints(train_text + "\n"), return_counts=True)
        ranked = values[np.argsort(-counts, kind="stable")]
        return cls([UNK] + [chr(int(c)) for c in ranked])

    def encode(self, text: str) -> np.ndarray:
        cps = self._codepoints(text)
        sorted_cps = self.codepoints[self.order]
        pos = np.clip(np.searchsorted(sorted_cps, cps), 0, len(sorted_cps) - 1)
        ids = self.order[pos].astype(np.int64) + 1
        ids[sorted_cps[pos] != cps] = self.unk_id
        return ids

    def tokens(self, ids) -> list[str]:
        return [self.vocab[int(i)] for i in ids]

    def decode(self, ids) -> str:
        return "".join(self.tokens(ids))

    def vocabulary(self) -> list[str]:
        return list(self.vocab)

    def save(self, folder: Path) -> None:
        (folder / "vocab.json").write_text(json.dumps(self.vocab, ensure_ascii=False))

    @classmethod
    def load(cls, folder: Path) -> CharTokenizer:
        return cls(json.loads((folder / "vocab.json").read_text()))


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (trained BPE, a tokenizer.json, or a model's)."""
    kind = "hf"
    EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")

    def __init__(self, backend):
        self.backend = backend  # tokenizers.Tokenizer
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        prepended = self._prepended_bos(backend)
        if prepended is not None:  # the model saw this first in every training sequence
            self.bos_id, self.bos_each_window = prepended, True
            return
        ids = [backend.token_to_id(t) for t in self.EOS_CANDIDATES]
        ids = [i for i in ids if i is not None]
        if not ids:
            raise ValueError("The tokenizer has no end-of-text token (looked for "
                             f"{', '.join(self.EOS_CANDIDATES)}); it is needed to open streams.")
        self.bos_id = ids[0]

    @staticmethod
    def _prepended_bos(backend) -> int | None:
        """The token the tokenizer's post-processor puts before every text, if any."""
        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a").ids
        if len(full) > len(plain) and full[1:len(plain) + 1] == plain:
            return int(full[0])
        return None

    def vocabulary(self) -> list[str]:
        by_id = {i: t for t, i in self.backend.get_vocab(with_added_tokens=True).items()}
        return [by_id.get(i, "") for i in range(self.vocab_size)]

    @classmethod
    def train_bpe(cls, train_text: str, vocab_size: int) -> HFTokenizer:
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers, trainers

        backend = Backend(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        backend.train_from_iterator((line + "\n" for line in _lines(train_text)), trainer)
        return cls(backend)

    @classmethod
    def from_path(cls, path: str) -> HFTokenizer:
        from tokenizers import Tokenizer as Backend

        p = Path(path)
        gguf = cls._gguf_file(path)
        if gguf is not None:
            return cls._from_gguf(gguf)
        if p.is_file():
            return cls(Backend.from_file(str(p)))
        if (p / "tokenizer.json").is_file():
            return cls(Backend.from_file(str(p / "tokenizer.json")))
        # a hub name, or a folder with vocab/merges files
        from transformers import AutoTokenizer

        if p.is_dir() and not any((p / f).is_file() for f in (
                "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")):
            raise FileNotFoundError(f"No tokenizer at {path!r}: the folder has no tokenizer.json "
                                    f"(nor vocab.json + merges.txt, tokenizer.model): save the "
                                    f"model's tokenizer there (tokenizer.save_pretrained).")
        try:
            fast = AutoTokenizer.from_pretrained(path, use_fast=True)
        except (OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise FileNotFoundError(f"No tokenizer at {path!r}: not a tokenizer.json file, not a "
                                    f"folder with one, and not loadable by transformers "
                                    f"({first[:200]}).") from err
        return cls(fast.backend_tokenizer)

    @staticmethod
    def _gguf_file(path: str) -> Path | None:
        """The GGUF file ``path`` names, by the base LM's rule (``gnnlm.text.gguf_paths``), so
        that a model's tokenizer is read from the file its weights are: a ``.gguf`` file, or
        the one ``.gguf`` of a folder without config.json (several: refused, naming them)."""
        files = gguf_candidates(path)
        if len(files) > 1:
            folder = files[0].parent
            raise FileNotFoundError(f"{folder} holds {len(files)} GGUF files ("
                                    f"{', '.join(f.name for f in files)}): name the one whose "
                                    f"tokenizer to read.")
        return files[0] if files else None

    @classmethod
    def _from_gguf(cls, gguf: Path) -> HFTokenizer:
        """The tokenizer a GGUF file carries (its vocabulary, merges and pre-tokenizer), as
        transformers converts it to a fast tokenizer."""
        from transformers import AutoTokenizer

        if not gguf.is_file():
            raise FileNotFoundError(f"No tokenizer at {gguf}: there is no such GGUF file.")
        fast = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        return cls(fast.backend_tokenizer)

    def encode(self, text: str) -> np.ndarray:
        return self._encode_lines([line + "\n" for line in _lines(text)])

    def encode_prompt(self, text: str) -> np.ndarray:
        lines = [line + "\n" for line in _lines(text)]
        if lines and not text.endswith("\n"):
            lines[-1] = lines[-1][:-1]
        return self._encode_lines(lines)

    def _encode_lines(self, lines: list[str]) -> np.ndarray:
        encs = self.backend.encode_batch(lines, add_special_tokens=False)
        return np.fromiter((i for e in encs for i in e.ids), dtype=np.int64)

    def tokens(self, ids) -> list[str]:
        return [self.backend.decode([int(i)]) for i in ids]

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids])

    def save(self, folder: Path) -> None:
        self.backend.save(str(folder / "tokenizer.json"))

    @classmethod
    def load(cls, folder: Path) -> HFTokenizer:
        return cls.from_path(str(folder / "tokenizer.json"))


TOKENIZERS = {"word": WordTokenizer, "char": CharTokenizer, "bpe": HFTokenizer, "hf": HFTokenizer}


def fit_tokenizer(config: TokenizerConfig, train_text: str) -> Tokenizer:
    if config.kind == "word":
        return WordTokenizer.fit(train_text, config.max_vocab)
    if config.kind == "char":
        return CharTokenizer.fit(train_text)
    if config.kind == "bpe":
        return HFTokenizer.train_bpe(train_text, config.vocab_size)
    if config.kind == "hf":
        if not config.path:
            raise ValueError("tokenizer kind 'hf' needs `path`: a tokenizer.json file or a "
                             "pretrained model's name or folder.")
        return HFTokenizer.from_path(config.path)
    raise ValueError(f"Unknown tokenizer kind {config.kind!r} (expected one of "
                     f"{list(TOKENIZERS)}).")


def _read_split(files: dict[str, Path], split: str) -> str:
    if split not in files:
        folder = files["train"].parent
        raise FileNotFoundError(f"The corpus in {folder} has no {split} split: expected one of "
                                f"{', '.join(SPLIT_FILES[split])}.")
    text = read_text(files[split])  # UTF-8 text, or one line saying what the file is
    if not text.strip():
        raise ValueError(f"Split file {files[split]} is empty: a corpus needs text in train, "
                         f"valid and test.")
    return text


@dataclass
class TokenStore:
    """Read side of a tokens artifact: streams per split, the tokenizer, sizes."""
    path: Path
    manifest: dict
    tokenizer: Tokenizer

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    @property
    def bos_id(self) -> int:
        return self.manifest["bos_id"]

    @property
    def bos_each_window(self) -> bool:
        return bool(self.manifest.get("bos_each_window", False))

    @property
    def vocab_fingerprint(self) -> str:
        """What the ids mean (``Tokenizer.vocab_fingerprint``): as the manifest records it, or,
        for tokens built before manifests did, from the tokenizer saved with them."""
        return self.manifest.get("vocab_fingerprint") or self.tokenizer.vocab_fingerprint()

    @property
    def level(self) -> str:
        return self.manifest["config"]["tokenizer"]["kind"]

    def split(self, name: str) -> np.ndarray:
        return open_array(self.path, name, self.manifest)

    @classmethod
    def open(cls, path: str | Path) -> TokenStore:
        path = Path(path)
        manifest = read_manifest(path, kind="tokens")
        tokenizer = TOKENIZERS[manifest["config"]["tokenizer"]["kind"]].load(path)
        return cls(path, manifest, tokenizer)


def hf_identity(tok: HFTokenizer) -> dict:
    """What a Hugging Face tokenizer's ids depend on, not where it was read from: a copy of a
    model's folder elsewhere is the same tokenizer. Its vocabulary (the ordered token list), the
    rules that cut text into tokens (the model's merges or scores, added tokens, normalizer,
    pre-tokenizer, compared as ``tokenizers`` serialises them; merges as pairs, whichever of its
    two formats a file uses), and the token opening each stream and whether every window opens
    with it. Its decoder, padding and truncation do not change the ids and are left out."""
    saved = json.loads(tok.backend.to_str())
    model = dict(saved.get("model") or {})
    if isinstance(model.get("vocab"), dict):  # token -> id: what vocab_fingerprint hashes
        model.pop("vocab")
    if "merges" in model:
        model["merges"] = [m.split(" ", 1) if isinstance(m, str) else list(m)
                           for m in model["merges"] or []]
    rules = fingerprint(model, *(saved.get(k) for k in ("added_tokens", "normalizer",
                                                        "pre_tokenizer")))
    return {"kind": "hf", "vocab_fingerprint": tok.vocab_fingerprint(), "rules_fingerprint": rules,
            "bos_id": int(tok.bos_id), "bos_each_window": bool(tok.bos_each_window)}


def _recorded_config(out_dir: Path, config: dict, inputs: dict) -> dict:
    """The config to look for in ``out_dir``: ``config``, or the one a tokens artifact of a
    Hugging Face tokenizer was recorded with before tokenizers were identified by content (by
    their path) when the tokenizer it stored is the same: its fingerprint, which the features
    record, then stays. Another stored tokenizer is refused, naming what differs."""
    try:
        found = read_manifest(out_dir, kind="tokens")
    except ArtifactError:
        return config  # none, or not whole: the builder says so
    recorded = (found.get("config") or {}).get("tokenizer") or {}
    if recorded.get("kind") != "hf" or "vocab_fingerprint" in recorded:
        return config
    try:
        stored = HFTokenizer.load(out_dir)
    except Exception:  # noqa: BLE001 - unreadable: let the fingerprints decide
        return config
    before = {**found["config"], "tokenizer": hf_identity(stored)}
    if before == config:
        return found["config"]
    raise refusal(out_dir, "tokens", {"config": before, "inputs": found.get("inputs")},
                  {"config": config, "inputs": inputs})


def build_tokens(out_dir: str | Path, corpus: str = "wikitext-2", corpus_path: str | None = None,
                 data_dir: str | None = None, tokenizer: TokenizerConfig | None = None,
                 rebuild: bool = False) -> TokenStore:
    """Tokenize every split of a corpus into ``out_dir`` (skipped when already built).
    ``tokenizer`` may also be a mapping of TokenizerConfig fields (as checkpoints save it)."""
    if not isinstance(tokenizer, TokenizerConfig):
        tokenizer = TokenizerConfig(**dict(tokenizer or {}))
    files = locate_corpus(corpus, path=corpus_path, data_dir=data_dir)
    for split in SPLITS:  # fail on a missing or empty split before any work
        _read_split(files, split)
    sources = {s: file_sha256(files[s]) for s in SPLITS}
    tok_cfg = {k: v for k, v in asdict(tokenizer).items() if v is not None}
    if tokenizer.kind != "bpe":
        tok_cfg.pop("vocab_size")
    # a Hugging Face tokenizer is identified by its content (its path is in the manifest, as
    # information); the others by their settings, as the corpus is by its files' hashes
    hf = fit_tokenizer(tokenizer, "") if tokenizer.kind == "hf" else None
    if isinstance(hf, HFTokenizer):
        tok_cfg = hf_identity(hf)
    config = {"corpus": corpus, "tokenizer": tok_cfg}
    inputs = {f"{s}_sha256": h[:16] for s, h in sources.items()}
    if hf is not None and not rebuild:
        config = _recorded_config(Path(out_dir), config, inputs)
    builder = ArtifactBuilder(out_dir, kind="tokens", config=config, inputs=inputs,
                              rebuild=rebuild)
    if builder.is_complete():
        return TokenStore.open(out_dir)
    with builder:
        texts = {s: _read_split(files, s) for s in SPLITS}
        tok = hf if hf is not None else fit_tokenizer(tokenizer, texts["train"])
        dtype = np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max else np.uint32
        counts = {}
        for split in SPLITS:
            ids = tok.encode(texts[split])
            if len(ids) == 0:
                raise ValueError(f"{files[split]} gives no tokens with tokenizer "
                                 f"{tokenizer.kind!r}: check the file and the tokenizer.")
            builder.array(split, dtype, ids.shape)[...] = ids
            counts[split] = int(ids.shape[0])
        tok.save(builder.partial)
        builder.finish(extra={"vocab_size": tok.vocab_size, "bos_id": int(tok.bos_id),
                              "bos_each_window": tok.bos_each_window,
                              "vocab_fingerprint": tok.vocab_fingerprint(),
                              "counts": counts, "sources": {s: str(files[s]) for s in SPLITS},
                              **({"tokenizer_path": tokenizer.path} if hf is not None else {})})
    return TokenStore.open(out_dir)
