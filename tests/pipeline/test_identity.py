"""Artifacts are identified by what makes their contents: a trained part by the merged values of
its YAMLs (not their text) and by every artifact its data module and model read (on the test
pipeline's work directory: a head is never reused once any of them is rebuilt with other
settings, but retrained), a Hugging Face tokenizer by its vocabulary and rules (not its path);
work directories recorded the older way are reused; a refusal stays one short line and names
the ``--rebuild`` that remakes the artifact with what reads it."""
from __future__ import annotations

import os
import shutil
from typing import Optional

import numpy as np
import pytest

from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.fingerprints import fingerprint
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import read_manifest
from gnnlm.workdir.refusals import ArtifactError
from tests.conftest import wikitext_slice
from tests.fakes import as_older_code_wrote_it, write_corpus
from tests.families import FAMILIES, save_family, train_bpe

# One file of a tiny `gnnlm fit` run (two steps of a one-layer LM on a few lines).
TINY = """\
# gnnlm fit -c tiny.yaml
seed_everything: 1
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  limit_val_batches: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}/logs
model:
  class_path: gnnlm.lit.lm.LanguageModel
  init_args:
    context_length: 8
    n_layer: 1
    n_head: 1
    d_model: 8
    d_ff: 16
data:
  class_path: datamodules.lm.LMDataModule
  init_args:
    corpus: tiny
    corpus_path: {corpus}
    workdir: {root}/work
    block_size: 8
    eval_context: 8
    eval_stride: 4
    batch_size: 2
    eval_batch_size: 2
"""

# The same values in two files, keys in another order, other comments and spacing, and another
# log folder and work directory (which fit_with_cli sets itself).
BASE = """\
# the model and the trainer
model:
  init_args: {d_ff: 16, d_model: 8, n_head: 1, n_layer: 1, context_length: 8}
  class_path: gnnlm.lit.lm.LanguageModel
trainer:
  max_steps: 2          # two steps
  devices: 1
  accelerator: cpu
  limit_val_batches: 1
  enable_checkpointing: false
  default_root_dir: /somewhere/else
seed_everything: 1
"""
OVERLAY = """\
# the data, and what only shows progress
data:
  init_args:
    eval_batch_size: 2
    batch_size: 2
    eval_stride: 4
    eval_context: 8
    block_size: 8
    workdir: /another/workdir
    corpus_path: {corpus}
    corpus: tiny
  class_path: datamodules.lm.LMDataModule
trainer: {{enable_model_summary: false, enable_progress_bar: false, logger: false}}
"""

pytestmark = pytest.mark.usefixtures("in_repo")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny LM trained once by ``fit_with_cli`` into ``models/lm``: (folder, the YAML)."""
    from gnnlm.pipeline.training import fit_with_cli

    root = tmp_path_factory.mktemp("trained")
    corpus = write_corpus(root / "corpus", train="the cat sat on the mat\n" * 40)
    yaml_file = root / "tiny.yaml"
    yaml_file.write_text(TINY.format(root=root, corpus=corpus))
    fit_with_cli(Workdir(root / "work"), "lm", [str(yaml_file)], {}, predict=False)
    return root, yaml_file


@pytest.fixture
def work(trained, tmp_path):
    """A copy of the trained work directory, and the split YAMLs of the same values."""
    root, yaml_file = trained
    shutil.copytree(root / "work", tmp_path / "work")
    corpus = root / "corpus"
    (tmp_path / "base.yaml").write_text(BASE)
    (tmp_path / "overlay.yaml").write_text(OVERLAY.format(corpus=corpus))
    return Workdir(tmp_path / "work"), yaml_file, [str(tmp_path / "base.yaml"),
                                                   str(tmp_path / "overlay.yaml")]


def test_comments_key_order_and_an_overlay_split_reuse_the_trained_part(work, capsys):
    from gnnlm.pipeline.training import fit_with_cli

    wd, yaml_file, split = work
    before = read_manifest(wd.model("lm"))
    commented = wd.root.parent / "commented.yaml"
    commented.write_text("# a comment added later\n" + yaml_file.read_text().replace(
        "max_steps: 2", "max_steps: 2     # two steps"))
    for configs in ([str(commented)], split):
        assert fit_with_cli(wd, "lm", configs, {}, predict=False) == before
        assert capsys.readouterr().err.count("skipped (complete)") == 1
    assert before["config"]["values"]["model"]["init_args"]["d_ff"] == 16
    assert "default_root_dir" not in before["config"]["values"]["trainer"]
    assert "workdir" not in before["config"]["values"]["data"]["init_args"]


def test_a_changed_value_is_refused_naming_that_field(work):
    from gnnlm.pipeline.training import fit_with_cli

    wd, _, split = work
    overlay = wd.root.parent / "d_ff.yaml"
    overlay.write_text("model:\n  init_args:\n    d_ff: 32\n")
    before = (wd.model("lm") / "manifest.json").read_text()
    with pytest.raises(ArtifactError) as err:
        fit_with_cli(wd, "lm", [*split, str(overlay)], {}, predict=False)
    assert str(err.value) == (
        f"{wd.model('lm')} holds a trained_model made with other settings than this run asks for: "
        f"config.values.model.init_args.d_ff: 16 → 32. Use another work directory, delete the "
        f"folder, or rerun with --rebuild=[lm], which rebuilds it and every stage that reads "
        f"it.")
    assert (wd.model("lm") / "manifest.json").read_text() == before
    assert not wd.model("lm").with_name("lm.partial").exists()


def _as_recorded_before(path, config: dict) -> dict:
    """Rewrite the manifest at ``path`` as the previous version wrote it: ``config`` and its
    fingerprint."""
    return as_older_code_wrote_it(path, lambda manifest: manifest.update(
        config=config, fingerprint=fingerprint(manifest["kind"], config, manifest["inputs"])))


def test_a_trained_part_recorded_with_its_yaml_texts_is_reused_by_value(work, capsys):
    """Its fingerprint stays (the ablations record the memory LM's), so nothing downstream
    changes; texts of other values are refused naming the field, not quoting the texts."""
    from gnnlm.pipeline.training import fit_with_cli

    wd, yaml_file, split = work
    old = _as_recorded_before(wd.model("lm"), {"name": "lm", "yaml": [yaml_file.read_text()]})
    assert fit_with_cli(wd, "lm", split, {}, predict=False) == old
    assert "skipped (complete)" in capsys.readouterr().err

    overlay = wd.root.parent / "lr.yaml"
    overlay.write_text("model:\n  init_args:\n    optim:\n      lr: 0.01\n")
    with pytest.raises(ArtifactError) as err:
        fit_with_cli(wd, "lm", [*split, str(overlay)], {}, predict=False)
    assert str(err.value) == (
        f"{wd.model('lm')} holds a trained_model made with other settings than this run asks for: "
        f"config.values.model.init_args.optim.lr: (none) → 0.01. Use another work directory, "
        f"delete "
        f"the folder, or rerun with --rebuild=[lm], which rebuilds it and every stage that "
        f"reads it.")
    assert read_manifest(wd.model("lm")) == old


def test_a_long_difference_is_refused_in_one_short_line(tmp_path):
    text = "# gnnlm fit -c base_lm.yaml\n" + "trainer:\n  max_steps: 1\n" * 400   # ~8k chars
    builder = ArtifactBuilder(tmp_path / "a", kind="trained_model",
                              config={"yaml": [text], **{f"k{i:02d}": i for i in range(12)}})
    with builder:
        builder.finish()
    asked = {"yaml": [text.replace("max_steps: 1", "max_steps: 2")],
             **{f"k{i:02d}": i + 1 for i in range(12)}}
    with pytest.raises(ArtifactError) as err:
        ArtifactBuilder(tmp_path / "a", kind="trained_model", config=asked).is_complete()
    head = (f"{tmp_path / 'a'} holds a trained_model made with other settings than this run asks "
            f"for: ")
    message = str(err.value)
    assert message.startswith(head) and len(message) - len(head) < 400
    assert message[len(head):] == (
        'config.k00: 0 → 1; config.k01: 1 → 2; config.k02: 2 → 3; config.k03: 3 → 4; '
        'config.k04: 4 → 5; and 8 more. Use another work directory, delete the folder, or '
        'rerun with --rebuild=[a], which rebuilds it and every stage that reads it.')

    with pytest.raises(ArtifactError) as err:
        ArtifactBuilder(tmp_path / "a", kind="trained_model",
                        config={"yaml": asked["yaml"], **{f"k{i:02d}": i for i in range(12)}}
                        ).is_complete()
    old, new = (t.replace("\n", "\\n")[:58] for t in (text, asked["yaml"][0]))
    assert str(err.value)[len(head):] == (
        f'config.yaml.0: "{old}… → "{new}…. Use another work directory, delete the folder, '
        f'or rerun with --rebuild=[a], which rebuilds it and every stage that reads it.')


# -- a Hugging Face model's folder, copied elsewhere --------------------------------------------

@pytest.fixture(scope="module")
def hf_corpus(wikitext_root, tmp_path_factory):
    """The first 40k characters of train and 10k of valid and test, cut at line ends."""
    return wikitext_slice(wikitext_root, tmp_path_factory.mktemp("wt2-small"),
                          {"train": 40_000, "valid": 10_000, "test": 10_000})


def _first_stages(folder, corpus, work, *extra):
    from gnnlm.pipeline.config import load_config
    from gnnlm.pipeline.stages import stage_base_lm, stage_features

    cfg = load_config(["-c", "configs/tests/hf_family.yaml", f"--base_lm.ckpt=hf:{folder}",
                       f"--corpus.path={corpus}", f"--workdir={work}", "--gnn.config=null",
                       *extra])
    wd = Workdir(cfg.workdir)
    model, store, _, location = stage_base_lm(cfg, wd)
    stage_features(cfg, model, store, wd, location)
    return {name: read_manifest(path) for name, path in (
        ("tokens", wd.tokens), *((s, wd.features(s)) for s in ("train", "valid", "test")))}


def test_a_copied_model_folder_rebuilds_nothing(hf_corpus, tmp_path, capsys):
    bpe = train_bpe((hf_corpus / "train.txt").read_text(), 300)
    folder = save_family(FAMILIES["gpt2"], bpe, tmp_path / "gpt2")
    built = _first_stages(folder, hf_corpus, tmp_path / "work")
    capsys.readouterr()

    copy = shutil.copytree(folder, tmp_path / "elsewhere" / "gpt2-copy")
    assert _first_stages(copy, hf_corpus, tmp_path / "work") == built
    assert capsys.readouterr().err.count("skipped (complete)") == 5  # tokens, embedding, 3 splits
    assert built["tokens"]["tokenizer_path"] == str(folder)   # information, not identity

    # tokens built again from the copy (their folder deleted): the same fingerprint, so the
    # features stay theirs
    shutil.rmtree(tmp_path / "work" / "tokens")
    rebuilt = _first_stages(copy, hf_corpus, tmp_path / "work")
    assert rebuilt["tokens"]["fingerprint"] == built["tokens"]["fingerprint"]
    assert rebuilt["tokens"]["tokenizer_path"] == str(copy)
    assert {s: rebuilt[s] for s in ("train", "valid", "test")} == {
        s: built[s] for s in ("train", "valid", "test")}
    assert _first_stages(folder, hf_corpus, tmp_path / "work")["valid"] == built["valid"]
    # --rebuild=[tokens] also rebuilds the features, which read them: the same fingerprints
    capsys.readouterr()
    again = _first_stages(copy, hf_corpus, tmp_path / "work", "--rebuild=[tokens]")
    err = capsys.readouterr().err
    for split in ("train", "valid", "test"):
        assert f"features {tmp_path / 'work' / 'features' / split}: built in" in err
        assert again[split]["fingerprint"] == built[split]["fingerprint"]


def test_tokens_recorded_with_the_tokenizer_s_path_are_reused_from_a_copy(hf_corpus, tmp_path):
    """Their fingerprint (which the features record) stays; another tokenizer is refused."""
    from gnnlm.text.tokens import TokenizerConfig, build_tokens

    bpe = train_bpe((hf_corpus / "train.txt").read_text(), 300)
    folder = save_family(FAMILIES["gpt2"], bpe, tmp_path / "gpt2")
    out = tmp_path / "work" / "tokens"
    build_tokens(out, "small", str(hf_corpus), tokenizer=TokenizerConfig(kind="hf",
                                                                         path=str(folder)))
    old = _as_recorded_before(out, {"corpus": "small",
                                    "tokenizer": {"kind": "hf", "path": str(folder)}})
    copy = shutil.copytree(folder, tmp_path / "copy")
    store = build_tokens(out, "small", str(hf_corpus),
                         tokenizer=TokenizerConfig(kind="hf", path=str(copy)))
    assert store.manifest == old

    other = save_family(FAMILIES["llama"], bpe, tmp_path / "llama")   # BOS before every text
    with pytest.raises(ArtifactError) as err:
        build_tokens(out, "small", str(hf_corpus),
                     tokenizer=TokenizerConfig(kind="hf", path=str(other)))
    bos = bpe.token_to_id("<s>")
    assert str(err.value) == (
        f"{out} holds a tokens made with other settings than this run asks for: "
        f"config.tokenizer.bos_each_window: false → true; config.tokenizer.bos_id: 0 → {bos}. "
        f"Use another work directory, delete the folder, or rerun with --rebuild=[tokens], "
        f"which rebuilds it and every stage that reads it.")
    assert read_manifest(out) == old


# -- a trained head's identity: every artifact its data module and model read ----------------
# What each head of the test pipeline must have recorded reading, at least (paths relative to
# the work directory): the features and neighbours of every split it is trained and scored on,
# and what only some heads open (PQ codes, the output embedding, the token streams).
SPLIT_NEIGHBOURS = {f"neighbors/final-cos/{split}" for split in ("train", "valid", "test")}
FEATURES = {f"features/{split}" for split in ("train", "valid", "test")}
HEAD_READS = {
    "gnn": FEATURES | SPLIT_NEIGHBOURS | {"pq/final"},
    "spalm": FEATURES | SPLIT_NEIGHBOURS | {"features/output_embedding"},
    "spalm_ft": FEATURES | SPLIT_NEIGHBOURS | {"tokens"},
    "spalm_xl": SPLIT_NEIGHBOURS | {"tokens"},
    "learned_wds": FEATURES,
}


def head_reads(workdir, name: str) -> set[str]:
    manifest = read_manifest(workdir / "models" / name)
    return {os.path.relpath(os.path.normpath(workdir / "models" / name / relative), workdir)
            for relative in manifest["reads"]}


def view_with_own_copy(workdir, root, *relatives: str):
    """``root`` as the work directory: every entry a link to ``workdir``'s, except the folders
    on the way to each of ``relatives``, and each of them itself, a copy (so that it can be
    rebuilt without touching ``workdir``)."""
    def mirror(source, target, paths: list[list[str]]):
        target.mkdir(parents=True)
        for entry in source.iterdir():
            inner = [rest[1:] for rest in paths if rest[0] == entry.name]
            if [] in inner:
                shutil.copytree(entry, target / entry.name, symlinks=True)
            elif inner:
                mirror(entry, target / entry.name, inner)
            elif entry.name != ".lock":
                (target / entry.name).symlink_to(entry)

    mirror(workdir, root, [relative.split("/") for relative in relatives])
    return Workdir(root)


def rebuild_otherwise(wd: Workdir, relative: str) -> None:
    """Rebuild the artifact at ``relative`` with other settings than the pipeline's."""
    from gnnlm.gnn.pq import PQConfig, build_pq
    from gnnlm.retrieval.neighbors import NeighborsConfig, build_neighbors
    from gnnlm.text.tokens import TokenizerConfig, build_tokens
    from tests.fakes import write_features, write_output_embedding

    if relative == "tokens":
        build_tokens(wd.tokens, "wikitext-2", tokenizer=TokenizerConfig(max_vocab=5000),
                     rebuild=True)
    elif relative == "pq/final":
        build_pq(wd, "final", PQConfig(m=8), rebuild=True)
    elif relative == "neighbors/final-cos/test":
        build_neighbors(wd, "test", "final", "cos", NeighborsConfig(K=16), rebuild=True)
    elif relative == "features/valid":
        shutil.rmtree(wd.features("valid"))
        write_features(wd.features("valid"), np.zeros((4, 8), np.float32), split="valid")
    elif relative == "features/output_embedding":
        shutil.rmtree(wd.output_embedding)
        write_output_embedding(wd, np.zeros((4, 8), np.float32))
    else:
        raise AssertionError(relative)


def outdated(wd: Workdir, name: str) -> Optional[str]:
    """What the pipeline does with a trained head it finds (``fit_with_cli``), without changing
    the work directory (whose folders may be links to the shared one): None when it reuses it,
    else why it retrains it."""
    manifest = read_manifest(wd.model(name))
    return ArtifactBuilder(wd.model(name), kind="trained_model", config=manifest["config"],
                           inputs=manifest["inputs"]).outdated(manifest)


@pytest.mark.integration
def test_every_head_records_what_its_data_module_and_model_read(workdir):
    for name, expected in HEAD_READS.items():
        missing = expected - head_reads(workdir, name)
        assert not missing, f"{name} did not record reading {sorted(missing)}"
        assert outdated(Workdir(workdir), name) is None


@pytest.mark.integration
@pytest.mark.parametrize("relative", ["tokens", "features/valid", "features/output_embedding",
                                      "neighbors/final-cos/test", "pq/final"])
def test_a_head_is_retrained_once_an_artifact_it_read_is_rebuilt_otherwise(
        workdir, tmp_path, relative):
    wd = view_with_own_copy(workdir, tmp_path / "w", relative)
    before = read_manifest(wd.root / relative)["fingerprint"]
    rebuild_otherwise(wd, relative)
    after = read_manifest(wd.root / relative)["fingerprint"]
    assert after != before
    heads = sorted(p.name for p in (workdir / "models").iterdir()
                   if (p / "manifest.json").is_file() and p.name != "base_lm")
    readers = [name for name in heads if relative in head_reads(workdir, name)]
    assert readers, f"no head read {relative}"
    for name in heads:
        if name in readers:
            assert outdated(wd, name) == (f"made from artifacts since rebuilt ("
                                          f"{wd.root / relative}: fingerprint {before} → "
                                          f"{after})"), name
        else:
            assert outdated(wd, name) is None, name


@pytest.mark.integration
def test_the_pipeline_retrains_the_gnn_in_the_run_that_rebuilds_its_pq_codes_otherwise(
        workdir, tmp_path, capsys, in_repo):
    """The case found: ``--rebuild=[pq]`` with other PQ settings, then the GNN head was "skipped
    (complete)" and scored codes the work directory no longer held (later: refused, asking for
    another run). The same run retrains it, and only it, and says so first."""
    from gnnlm.cli import main
    from tests.conftest import PIPELINE

    root = tmp_path / "w"
    wd = view_with_own_copy(workdir, root, "pq/final", "models/gnn", "logs/gnn")
    (root / "reports").unlink()
    before, gnn_before = read_manifest(wd.pq("final")), read_manifest(wd.model("gnn"))
    capsys.readouterr()
    main(["pipeline", *PIPELINE, f"--workdir={root}", "--rebuild=[pq]", "--pq.m=8"])
    out, err = capsys.readouterr()
    after, gnn = read_manifest(wd.pq("final")), read_manifest(wd.model("gnn"))
    assert before["fingerprint"] != after["fingerprint"] and after["config"]["m"] == 8
    assert ("--rebuild=[pq] also rebuilds gnn, which reads pq (directly or through another "
            "stage); gnn is retrained, as its weights were fit to what is rebuilt."
            ) in out.splitlines()
    assert gnn["reads"][os.path.relpath(wd.pq("final"), wd.model("gnn"))] == after["fingerprint"]
    assert gnn["created"] > gnn_before["created"]
    for other in (workdir / "models").iterdir():
        if other.name != "gnn" and (other / "manifest.json").is_file():
            assert f"{wd.model(other.name)}: skipped (complete)" in err, other.name
