"""``gnnlm verify WORKDIR``: checks that every artifact of a work directory is whole and unchanged.

A run that reuses an artifact checks its files' sizes, and the sha256 of those up to
``gnnlm.workdir.builder.REUSE_CHECK_BYTES``; this command reads every file of every artifact
against its manifest (after copying a work directory, or to check the big files a reuse does not
read), each manifest against its own checksum, and each artifact's recorded inputs (``reads``)
against the artifacts the work directory now holds; then each report (``reports/<name>/``)
against its own checksum and the artifacts it was computed from (``gnnlm.workdir.reports``).
It prints one line per artifact and report and a summary, and fails naming each bad or edited
file, or stale input, and the stage that rebuilds it, and each report to write again. An
unfinished build (``<name>.partial``) is listed but is no error: the next run of its stage
resumes it. In a work directory that predates checksums (none of its manifests
records one) every artifact has only its sizes checked ("no checksum recorded"); a manifest
without its checksum among manifests with theirs is bad (``gnnlm.workdir.predates``). The work
directory is only read.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from gnnlm.workdir.integrity import data_files, file_problems, stale_reads
from gnnlm.workdir.manifests import MANIFEST, MANIFEST_SHA256, read_manifest
from gnnlm.workdir.refusals import ArtifactError, rebuild_hint
from gnnlm.workdir.reports import ARTIFACTS, REPORT, check_report


def find_artifacts(root: Path) -> tuple[list[Path], list[Path]]:
    """The artifact folders under ``root`` (those with a manifest) and the unfinished builds
    (``*.partial``), in path order; artifacts linked in from elsewhere are followed."""
    complete, partial = [], []
    for folder, subfolders, files in os.walk(root, followlinks=True):
        here = Path(folder)
        if here.name.endswith(".partial"):
            partial.append(here)
            subfolders.clear()
        elif MANIFEST in files:
            complete.append(here)
            subfolders.clear()  # an artifact's own subfolders hold its files
        else:
            subfolders.sort()
    return sorted(complete), sorted(partial)


def check_artifact(path: Path) -> tuple[str, list[str], int]:
    """``(status, problems, bytes read)`` of one artifact: status "ok", "no checksum recorded"
    or "bad"; each problem names its file."""
    try:
        manifest = read_manifest(path)
    except ArtifactError as err:
        return "bad", [str(err)], 0
    files = data_files(manifest)
    problems = file_problems(path, manifest) + [
        f"made from {source}, since rebuilt" for source in stale_reads(path, manifest)]
    if problems:
        return "bad", problems, 0
    read = sum((path / name).stat().st_size for name, digest in files.items() if digest)
    # a manifest from before checksums has no "files" map (nor the other files it then lists)
    recorded = ("files" in manifest and all(digest for digest in files.values())
                and MANIFEST_SHA256 in manifest)
    return ("ok" if recorded else "no checksum recorded"), [], read


def main(args: list[str]) -> None:
    """``gnnlm verify WORKDIR``: checks every artifact under the work directory against its
    manifest (sizes, sha256 of every file) and lists unfinished builds, then checks every
    report (its sha256, the artifacts it was computed from); one line per artifact and report,
    then a summary. Exits 0 when every artifact is whole and every report can be trusted, 2
    naming each bad file or report otherwise."""
    parser = argparse.ArgumentParser(prog="gnnlm verify", description=main.__doc__)
    parser.add_argument("workdir", help="the pipeline's work directory (its `workdir:`)")
    root = Path(parser.parse_args(args).workdir)
    if not root.is_dir():
        raise ValueError(f"No work directory at {root}: give the folder a pipeline config's "
                         f"`workdir:` names.")
    complete, partial = find_artifacts(root)
    if not complete and not partial:
        raise ValueError(f"{root} holds no artifacts (no {MANIFEST} under it): give the folder "
                         f"a pipeline config's `workdir:` names.")
    t0 = time.perf_counter()
    counts = {"ok": 0, "no checksum recorded": 0, "bad": 0}
    total, failures = 0, []
    reports = sorted(root.glob(f"reports/*/{REPORT}"))
    width = max(len(str(p.relative_to(root))) for p in complete + partial + reports)
    for path in complete:
        status, problems, read = check_artifact(path)
        counts[status] += 1
        total += read
        name = str(path.relative_to(root))
        if status == "bad":
            kind = _kind(path)
            failures.append(f"{'; '.join(problems)}. {rebuild_hint(path, kind)}"
                            if kind else "; ".join(problems))
            detail = "; ".join(problems)
        elif status == "ok":
            detail = f"{size(read)}, sha256 matches"
        else:
            detail = "the manifest predates checksums; sizes match"
        print(f"{name:<{width}}  {status}: {detail}", flush=True)
    for path in partial:
        print(f"{str(path.relative_to(root)):<{width}}  unfinished: the next run of its stage "
              f"resumes it", flush=True)
    bad_reports = check_reports(root, reports, width)
    seconds = time.perf_counter() - t0
    said = (f"{len(reports)} reports: {len(reports) - len(bad_reports)} ok, "
            f"{len(bad_reports)} bad; " if reports else "")
    print(f"{len(complete)} artifacts: {counts['ok']} ok, {counts['no checksum recorded']} with "
          f"no checksum recorded, {counts['bad']} bad; {len(partial)} unfinished; {said}"
          f"{size(total)} checked in {seconds:.1f} s", flush=True)
    errors = ([f"{counts['bad']} of {len(complete)} artifacts in {root} are damaged: "
               + " ".join(failures)] if failures else []) + (
        [f"{len(bad_reports)} of {len(reports)} reports in {root} cannot be trusted: "
         + " ".join(bad_reports)] if bad_reports else [])
    if errors:
        raise ArtifactError(" ".join(errors))


def check_reports(root: Path, reports: list[Path], width: int) -> list[str]:
    """Check each report, printing a line for it; what is wrong with the bad ones, one line
    each (``gnnlm.workdir.reports.check_report``)."""
    bad = []
    for path in reports:
        name = f"{str(path.relative_to(root)):<{width}}"
        try:
            made_from = len(check_report(path, root).get(ARTIFACTS) or {})
        except ArtifactError as err:
            bad.append(str(err))
            print(f"{name}  bad: {err}", flush=True)
            continue
        print(f"{name}  ok: sha256 matches, made from the {made_from} artifacts it names as "
              f"they are", flush=True)
    return bad


def size(n: int) -> str:
    """Bytes as kB, MB or GB (decimal), one or two decimals."""
    return (f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB" if n >= 1e6
            else f"{n / 1e3:.1f} kB")


def _kind(path: Path) -> str | None:
    """The kind a manifest names, or None when it cannot be read."""
    try:
        return str(read_manifest(path).get("kind"))
    except ArtifactError:
        return None
