"""gnnlm.workdir.reports: a report records its own sha256 and the artifacts it was computed
from, and is refused when edited, unsealed or outlived by them; on a pipeline's work directory,
``gnnlm.load`` and ``gnnlm verify`` (a process of its own) refuse an edited report and one
written before a ``--rebuild`` that was stopped, serve it again once the pipeline rewrote it,
and ask which report to serve when there are several."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import gnnlm
from gnnlm.inference.served import NotServed
from gnnlm.workdir.builder import ArtifactBuilder
from gnnlm.workdir.layout import Workdir
from gnnlm.workdir.manifests import MANIFEST_SHA256, read_manifest, write_json_atomic
from gnnlm.workdir.refusals import ArtifactError
from gnnlm.workdir.reports import ARTIFACTS, REPORT_SHA256, check_report, seal
from gnnlm.workdir.verify import find_artifacts
from tests.conftest import REPO

REWRITE = ("rerun `gnnlm pipeline` with its config to write it again (the finished stages are "
           "reused).")


def artifact(path, config=None, rebuild=False, value=1.0):
    builder = ArtifactBuilder(path, kind="demo", config=config or {}, rebuild=rebuild)
    if not builder.is_complete():
        with builder:
            builder.array("values", np.float32, (3,))[...] = value
            builder.finish()
    return path


@pytest.fixture
def sealed(tmp_path):
    """A work directory of two artifacts and a report sealed there: (work directory, the
    report's path)."""
    wd = Workdir(tmp_path / "w")
    artifact(wd.features("train"))
    artifact(wd.index("final", "cos"))
    path = wd.report("run") / "results.json"
    path.parent.mkdir(parents=True)
    write_json_atomic(path, seal({"hparams": {"knn": {"k": 8, "lambda": 0.25}}}, wd.root))
    return wd, path


def edit(path, change) -> None:
    report = json.loads(path.read_text())
    change(report)
    path.write_text(json.dumps(report))


def test_a_report_records_what_it_was_computed_from_and_its_own_sha256(sealed):
    wd, path = sealed
    report = check_report(path, wd.root)
    assert report["hparams"]["knn"]["lambda"] == 0.25
    assert report[ARTIFACTS] == {
        folder: {"fingerprint": read_manifest(wd.root / folder)["fingerprint"],
                 "manifest_sha256": read_manifest(wd.root / folder)[MANIFEST_SHA256]}
        for folder in ("features/train", "index/final-cos")}
    assert len(report[REPORT_SHA256]) == 64


def test_an_edited_report_or_one_without_its_checksum_is_refused(sealed):
    wd, path = sealed
    edit(path, lambda report: report["hparams"]["knn"].update({"lambda": 0.9}))
    with pytest.raises(ArtifactError) as err:
        check_report(path, wd.root)
    assert str(err.value) == (f"{path} was edited after it was written (its content no longer "
                              f"matches its report_sha256): {REWRITE}")
    edit(path, lambda report: report.pop(REPORT_SHA256))
    with pytest.raises(ArtifactError) as err:
        check_report(path, wd.root)
    assert str(err.value) == (f"{path} records no report_sha256 (it was edited and its checksum "
                              f"removed, or written by an older gnnlm), so its numbers cannot be "
                              f"trusted: {REWRITE}")
    path.write_text('{"hparams": ')
    with pytest.raises(ArtifactError, match="is not valid JSON"):
        check_report(path, wd.root)


def test_a_report_made_from_artifacts_since_rebuilt_or_removed_is_refused(sealed):
    """Rebuilt with the same settings (the same fingerprint, as a ``--rebuild`` does: other
    bytes, as a retrained model's) or with others, or gone: each artifact is named."""
    wd, path = sealed
    index = wd.index("final", "cos")
    artifact(index, rebuild=True, value=2.0)
    said = f"{path} was computed from artifacts {wd.root} no longer holds as they were ("
    with pytest.raises(ArtifactError) as err:
        check_report(path, wd.root)
    assert str(err.value) == f"{said}index/final-cos: rebuilt after the report was written): " \
                             f"{REWRITE}"
    before = read_manifest(wd.features("train"))["fingerprint"]
    artifact(wd.features("train"), config={"d": 2}, rebuild=True)
    shutil.rmtree(index)
    with pytest.raises(ArtifactError) as err:
        check_report(path, wd.root)
    after = read_manifest(wd.features("train"))["fingerprint"]
    assert str(err.value) == (f"{said}features/train: rebuilt with other settings (fingerprint "
                              f"{before} → {after}); index/final-cos: no complete artifact): "
                              f"{REWRITE}")


# -- on a pipeline's work directory (tests.conftest's hf_family_built) ---------------------------
def verify(work) -> subprocess.CompletedProcess:
    """``gnnlm verify`` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "gnnlm.cli", "verify", str(work)],
                          capture_output=True, text=True, timeout=600)


def refusal(work, **kwargs) -> str:
    with pytest.raises(NotServed) as err:
        gnnlm.load(work, **kwargs)
    return str(err.value)


@pytest.mark.integration
def test_an_edited_report_is_refused_by_load_and_verify(hf_family_built, tmp_path):
    _, source = hf_family_built
    work = shutil.copytree(source, tmp_path / "work")
    path = work / "reports" / "hf-family" / "results.json"
    fitted = json.loads(path.read_text())["hparams"]["knn"]
    # as written: served, and every artifact of the work directory is one it was computed from
    assert gnnlm.load(work).settings("knn").weight == fitted["lambda"]
    assert set(json.loads(path.read_text())[ARTIFACTS]) == {
        str(p.relative_to(work)) for p in find_artifacts(work)[0]}
    done = verify(work)
    assert done.returncode == 0, done.stderr
    assert any(line.startswith("reports/hf-family/results.json") and "  ok: sha256 matches"
               in line for line in done.stdout.splitlines()), done.stdout

    edit(path, lambda report: report["hparams"]["knn"].update({"lambda": 0.99}))
    said = (f"{path} was edited after it was written (its content no longer matches its "
            f"report_sha256): {REWRITE}")
    assert refusal(work) == said
    done = verify(work)
    assert done.returncode == 2
    assert [line for line in done.stderr.splitlines() if line.startswith("gnnlm ")] == [
        f"gnnlm verify: error: 1 of 1 reports in {work} cannot be trusted: {said}"]
    edit(path, lambda report: report.pop(REPORT_SHA256))            # and its checksum removed
    assert "records no report_sha256" in refusal(work)
    assert verify(work).returncode == 2


@pytest.mark.integration
def test_a_report_written_before_a_stopped_rebuild_is_refused_until_rewritten(hf_family_built,
                                                                             tmp_path):
    """``--rebuild=[features]`` stopped by SIGTERM once the features are built again: the old
    report describes artifacts the work directory no longer holds; the rerun that finishes the
    rebuild writes it again, and it is served."""
    args, source = hf_family_built
    work = shutil.copytree(source, tmp_path / "work")
    command = [sys.executable, "-m", "gnnlm.cli", "pipeline", *args, f"--workdir={work}",
               "--rebuild=[features]"]
    run = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True)
    assert run.stderr is not None
    for line in run.stderr:
        if f"features {work / 'features' / 'test'}: built in" in line:
            run.send_signal(signal.SIGTERM)  # the next stages (neighbours, ...) not run
            break
    run.stderr.read()
    assert run.wait(timeout=600) == 143
    path = work / "reports" / "hf-family" / "results.json"
    said = refusal(work)
    assert said.startswith(f"{path} was computed from artifacts {work} no longer holds as they "
                           f"were (features/test: rebuilt after the report was written; ")
    assert "features/train: rebuilt after the report was written" in said
    assert said.endswith(REWRITE)
    done = verify(work)
    assert done.returncode == 2 and f"cannot be trusted: {said}" in done.stderr

    finished = subprocess.run(command[:-1], cwd=REPO, capture_output=True, text=True,
                              timeout=1800)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert gnnlm.load(work).settings("knn").weight == json.loads(path.read_text())[
        "hparams"]["knn"]["lambda"]
    assert verify(work).returncode == 0


@pytest.mark.integration
def test_of_several_reports_the_one_to_serve_is_named(hf_family_built, tmp_path):
    _, source = hf_family_built
    work = shutil.copytree(source, tmp_path / "work")
    shutil.copytree(work / "reports" / "hf-family", work / "reports" / "other")
    assert refusal(work) == (f"{work} holds several reports (hf-family, other): name the one to "
                             f"serve (report= in gnnlm.load, --report on the command line).")
    assert gnnlm.load(work, report="other").served.name == "other"
