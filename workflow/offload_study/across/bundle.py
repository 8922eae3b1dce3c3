"""Bundles: one portable, checked file per cluster x study, exchanged between clusters.

CLI::

    python -m offload_study.across.bundle create --cluster C --study S [--root .] \
        [--report reports/S/report.html] --out bundles/S--C.tar.gz
    python -m offload_study.across.bundle verify bundles/*.tar.gz

A bundle is a gzip'd tar whose members are paths of the working tree under one top folder
``<study>--<cluster>/`` (:func:`bundle_name`): ``results/<cluster>/<study>/**`` (run records with
their steps, provenance and raw logs, the DeepSpeed configs and run specs, plan.json, the runs
and summary tables, the rules' logs; not ``archive/``, the copies of superseded records),
``results/<cluster>/calibration.json`` when the cluster was calibrated (or has a shipped
calibration in config/calibration/),
``reports/<study>/report.html`` when given, and ``manifest.json`` (:class:`Manifest`: identity
and the sha256 and size of every other member). Extracted, the top folder is laid out like the
working tree, so collect reads a bundle's records as it reads local ones.

This module is the one writer (:func:`create`) and the one reader (:func:`extract`,
:func:`opened`) of bundles. Bundles come from other machines, so nothing in one is trusted:
a member must be a plain file or folder below the top folder (no absolute path, no '..', no
link, device or sparse file), within the size limits (:class:`Limits`), in one of the places
a bundle carries, and listed in the manifest with its sha256 and size; anything else refuses
the whole bundle with one error naming the member. Extraction writes plain files only (never
the tar's modes or owners), each created new below a fresh folder; nothing in a bundle is run
or imported. The checksums catch a damaged or edited member, not a bundle re-made from edited
records: the sha256 of the bundle file itself, shown on every page made from it, is for that.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import socket
import tarfile
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from offload_study import __version__
from offload_study.core import contracts, layout, yamlsafe
from offload_study.core.contracts import read_json, sha256_file
from offload_study.core.study import load_schema

BUNDLE_VERSION = 1
MANIFEST = "manifest.json"
SUFFIX = ".tar.gz"
_NAME = load_schema("study")["$defs"]["name"]
_NAME_RE, _DOTS_RE = re.compile(_NAME["pattern"]), re.compile(_NAME["not"]["pattern"])
#: Study-folder entries a bundle leaves out: superseded records (each record is bundled once).
SKIPPED_DIRS = ("archive",)
#: Half-written files and records (write_json's and placement's temp names).
_TEMP_RE = re.compile(r"\.(tmp|old)-\d+$")
_CHUNK = 1 << 20


class BundleError(ValueError):
    """A bundle that cannot be made or must not be read; the message names the file or member."""

    def __str__(self) -> str:
        # member names come from the bundle: a megabyte-long one must not become the message
        return yamlsafe.cap_text(super().__str__())


@dataclass(frozen=True)
class Limits:
    """What one bundle may hold, checked on each member as it is read, before anything parses it
    (a bundle from elsewhere must not fill a disk, exhaust memory or a parser's recursion)."""

    members: int = 200_000  # files and folders: a 1,000-run study has about 20,000
    member_bytes: int = 2 << 30  # one raw log of a long run is megabytes; 2 GiB is far beyond
    total_bytes: int = 16 << 30  # all members, extracted
    json_bytes: int = 64 << 20  # one JSON member: a record is kilobytes, a large plan megabytes
    json_depth: int = contracts.JSON_MAX_DEPTH  # nesting of one JSON member (records: < 10)
    name_chars: int = 1024  # a member's whole path (names of the layout are 100 characters)
    name_parts: int = 16  # parts of its path (the deepest a study writes: 9, <top>/results/<c>/<s>/<scen>/rep<k>/pair/logs/<log>)


LIMITS = Limits()


def valid_name(name) -> bool:
    """A study, cluster or scenario name as the study schema allows it: it can make no path
    outside its folder (letters, digits, '.', '_', '-'; not dots only)."""
    return (
        isinstance(name, str)
        and len(name) <= _NAME["maxLength"]
        and bool(_NAME_RE.match(name))
        and not _DOTS_RE.match(name)
    )


def bundle_name(study: str, cluster: str) -> str:
    """``<study>--<cluster>``: the bundle's top folder and file stem."""
    return f"{study}--{cluster}"


def study_dir(cluster: str, study: str) -> str:
    """The study's results folder, relative to the working tree (and to a bundle's top)."""
    return layout.study_dir(cluster, study)


def calibration_path(cluster: str) -> str:
    """Where a bundle carries the cluster's calibration (where calibrate writes it)."""
    return layout.measured_calibration(cluster)


def calibration_source(root: Path, cluster: str) -> Path | None:
    """The cluster's calibration: measured here (results/), else shipped (config/calibration/)."""
    for path in (
        root / calibration_path(cluster),
        root / layout.shipped_calibration(cluster),
    ):
        if path.is_file():
            return path
    return None


def report_path(study: str) -> str:
    """Where a bundle carries its report (inside the bundle, whose top names the cluster)."""
    return f"reports/{study}/report.html"


# --------------------------------------------------------------------------- manifest
@dataclass(frozen=True, kw_only=True)
class Manifest:
    """manifest.json: what a bundle is and the sha256 and size of each other member."""

    bundle_version: int = BUNDLE_VERSION
    study: str
    cluster: str
    created_at: str  # ISO 8601 UTC
    created_by: dict  # offload-study version and host that made the bundle
    report: str | None  # member path of the study's report.html, if bundled
    calibration: str | None  # member path of the cluster's calibration.json, if bundled
    members: dict  # member path -> {"sha256": hex, "bytes": int}

    @property
    def name(self) -> str:
        return bundle_name(self.study, self.cluster)

    def allowed(self, member: str) -> bool:
        """Whether a bundle of this study may carry ``member`` (nothing but its own places)."""
        extra = {p for p in (self.report, self.calibration) if p}
        return member.startswith(study_dir(self.cluster, self.study) + "/") or member in extra

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data, source: str) -> Manifest:
        if not isinstance(data, dict):
            raise BundleError(f"{source}: not a manifest (a JSON object)")
        names = {f.name for f in dataclasses.fields(cls)}
        wrong = sorted(set(data) ^ names)
        if wrong:
            raise BundleError(
                f"{source}: not a bundle manifest: key {wrong[0]!r} unknown or missing"
            )
        if data["bundle_version"] != BUNDLE_VERSION:
            raise BundleError(
                f"{source}: bundle_version {data['bundle_version']!r}; this reader knows "
                f"{BUNDLE_VERSION}"
            )
        for key in ("study", "cluster"):
            if not valid_name(data[key]):
                raise BundleError(f"{source}: {key}: {data[key]!r} is not a valid name")
        manifest = cls(**data)
        for member, entry in manifest.members.items():
            if not (isinstance(entry, dict) and set(entry) == {"sha256", "bytes"}):
                raise BundleError(f"{source}: members: {member!r} needs exactly sha256 and bytes")
        return manifest


# --------------------------------------------------------------------------- making one
def member_paths(root: Path, cluster: str, study: str) -> list[str]:
    """Working-tree paths (relative to ``root``) of the study's results that a bundle carries."""
    base = root / study_dir(cluster, study)
    if not (base / "plan.json").is_file():
        raise BundleError(f"{base}: no plan.json: run the study before bundling it")
    out = []
    for folder, dirs, files in os.walk(base):
        here = Path(folder)
        dirs[:] = sorted(
            d for d in dirs if not _TEMP_RE.search(d) and not (here == base and d in SKIPPED_DIRS)
        )
        for name in sorted(files):
            path = here / name
            if _TEMP_RE.search(name):
                continue
            if path.is_symlink() or not path.is_file():
                raise BundleError(
                    f"{path}: a link or special file; a bundle carries plain files only"
                )
            out.append(path.relative_to(root).as_posix())
    return out


def create(root: str | Path, cluster: str, study: str, out: str | Path, report=None) -> Manifest:
    """Write the bundle of ``results/<cluster>/<study>`` under ``root`` to ``out`` (atomically)."""
    root, out = Path(root), Path(out)
    members = member_paths(root, cluster, study)
    calibration = calibration_source(root, cluster)
    report_member = None
    if report:
        if not Path(report).is_file():
            raise BundleError(f"{report}: report not found")
        report_member = report_path(study)
    top = bundle_name(study, cluster)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    listed = {}
    # gzip's own header carries no time (mtime=0): the same records give the same bytes but for
    # the manifest's created_at.
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            sources = [(m, root / m) for m in members]
            sources += [(calibration_path(cluster), calibration)] if calibration else []
            sources += [(report_member, Path(report))] if report_member else []
            for member, source in sources:
                data = source.read_bytes()  # read once: what is hashed is what is stored
                listed[member] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                _add(tar, f"{top}/{member}", data, source.stat().st_mtime)
            manifest = Manifest(
                study=study,
                cluster=cluster,
                created_at=_now(),
                created_by={"offload_study": __version__, "host": socket.gethostname()},
                report=report_member,
                members=listed,
                calibration=calibration_path(cluster) if calibration else None,
            )
            text = json.dumps(manifest.to_dict(), indent=2, sort_keys=True) + "\n"
            _add(tar, f"{top}/{MANIFEST}", text.encode(), dt.datetime.now().timestamp())
    os.replace(tmp, out)
    return manifest


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
    tar.addfile(info, io.BytesIO(data))


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


# --------------------------------------------------------------------------- reading one
@dataclass(frozen=True)
class Bundle:
    """An extracted, checked bundle."""

    path: Path  # the .tar.gz as given
    sha256: str  # of the .tar.gz file
    root: Path  # the extracted top folder, laid out like the working tree
    manifest: Manifest

    @property
    def name(self) -> str:
        """The file's name without .tar.gz (unique within one folder of bundles)."""
        return self.path.name.removesuffix(SUFFIX)

    @property
    def study_dir(self) -> Path:
        return self.root / study_dir(self.manifest.cluster, self.manifest.study)

    @property
    def calibration(self) -> Path | None:
        return self.root / self.manifest.calibration if self.manifest.calibration else None

    @property
    def report(self) -> Path | None:
        return self.root / self.manifest.report if self.manifest.report else None


def extract(path: str | Path, into: str | Path, limits: Limits = LIMITS) -> Bundle:
    """Check and extract the bundle ``path`` into the new folder ``into``; BundleError if refused
    (``into`` is then removed again)."""
    path, into = Path(path), Path(into)
    if not path.is_file():
        raise BundleError(f"{path}: bundle not found")
    into.mkdir(parents=True)
    try:
        top, found = _extract_members(path, into, limits)
        manifest = _verified_manifest(path, into / top, top, found)
    except BaseException:
        shutil.rmtree(into, ignore_errors=True)
        raise
    return Bundle(path=path, sha256=sha256_file(path), root=into / top, manifest=manifest)


@contextlib.contextmanager
def opened(paths: Sequence[str | Path], limits: Limits = LIMITS) -> Iterator[list[Bundle]]:
    """The bundles, checked and extracted into a temp folder that is removed afterwards.

    A folder of published records (e.g. ``docs/results/<cluster>/<study>``) is bundled on the fly
    (:func:`create_from_records`) and then checked like any other bundle: compare and check take
    our published records without a second copy of them in the repository."""
    with tempfile.TemporaryDirectory(prefix="offload-study-bundles-") as tmp:
        found = []
        for i, given in enumerate(paths):
            made = Path(tmp) / f"made{i}{SUFFIX}"
            path = create_from_records(given, made) if Path(given).is_dir() else given
            b = extract(path, Path(tmp) / str(i), limits)
            found.append(dataclasses.replace(b, path=Path(given)) if path == made else b)
        yield found


def create_from_records(folder: str | Path, out: str | Path) -> Path:
    """Bundle a study folder laid out like ``results/<cluster>/<study>`` (its plan.json names the
    study and the cluster) into ``out``; returns ``out``."""
    folder = Path(folder)
    try:
        plan = read_json(folder / "plan.json")
        study, cluster = plan["study"], plan["cluster"]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise BundleError(
            f"{folder}: not a study's records (plan.json naming study and cluster: {e!r})"
        ) from None
    if not (valid_name(study) and valid_name(cluster)):
        raise BundleError(
            f"{folder}/plan.json: study {study!r} or cluster {cluster!r} is not a valid name"
        )
    with tempfile.TemporaryDirectory(prefix="offload-study-records-") as tmp:
        tree = Path(tmp) / study_dir(cluster, study)
        # links are kept as links, so that member_paths refuses them as in any bundle
        shutil.copytree(folder, tree, symlinks=True, ignore=shutil.ignore_patterns(*SKIPPED_DIRS))
        create(tmp, cluster, study, out)
    return Path(out)


def _extract_members(path: Path, into: Path, limits: Limits) -> tuple[str, dict]:
    """Write every file member below ``into``; returns (top folder, member -> (sha256, bytes))."""
    found: dict[str, tuple[str, int]] = {}
    top, total = None, 0
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            for count, info in enumerate(tar, 1):
                if count > limits.members:
                    raise BundleError(
                        f"{path}: member {info.name!r}: more than {limits.members} members"
                    )
                parts = safe_parts(info.name, path, limits)
                top = top or parts[0]
                member = "/".join(parts[1:])
                if parts[0] != top:
                    raise BundleError(
                        f"{path}: member {info.name!r} is outside the top folder {top}/"
                    )
                if info.type == tarfile.DIRTYPE:
                    continue
                _check_file_member(path, info, member, found, limits)
                total += info.size
                if total > limits.total_bytes:
                    raise BundleError(
                        f"{path}: member {info.name!r}: more than {limits.total_bytes} bytes "
                        "extracted in all"
                    )
                target = into.joinpath(*parts)
                found[member] = _write_member(tar, info, target, _depth_check(path, info, limits))
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise BundleError(f"{path}: not a readable bundle (.tar.gz): {e}") from e
    if top is None:
        raise BundleError(f"{path}: an empty bundle")
    return top, found


def safe_parts(name: str, path: Path, limits: Limits = LIMITS) -> list[str]:
    """A member name's folders, refused when it could land outside the extraction folder or
    is not a plain relative path (absolute, '..' or '.', empty parts, backslash, control), or
    is longer or deeper than the limits."""
    if name.startswith("/") or "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise BundleError(f"{path}: member {name!r}: not a plain relative path")
    parts = name.rstrip("/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise BundleError(f"{path}: member {name!r}: '..', '.' or an empty folder name in its path")
    if len(name) > limits.name_chars or len(parts) > limits.name_parts:
        raise BundleError(
            f"{path}: member {name!r}: a path longer than {limits.name_chars} characters or "
            f"deeper than {limits.name_parts} folders"
        )
    return parts


def _check_file_member(path: Path, info: tarfile.TarInfo, member: str, found, limits) -> None:
    if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        kind = "link" if info.issym() or info.islnk() else "special file"
        raise BundleError(
            f"{path}: member {info.name!r} is a {kind}; bundles hold plain files only"
        )
    if not member:
        raise BundleError(f"{path}: member {info.name!r}: a file in place of the top folder")
    if member in found:
        raise BundleError(f"{path}: member {info.name!r} appears twice")
    cap = limits.json_bytes if _is_json(info.name) else limits.member_bytes
    if info.size > cap:
        raise BundleError(
            f"{path}: member {info.name!r} is larger than {cap} bytes ({info.size} bytes)"
        )


def _is_json(name: str) -> bool:
    return name.lower().endswith(".json")


def _depth_check(path: Path, info: tarfile.TarInfo, limits: Limits):
    """For a JSON member, a function of each chunk read that refuses it once it nests deeper
    than the limit (counted on the bytes: nothing has parsed it yet); None for other members."""
    if not _is_json(info.name):
        return None
    depth = contracts.JsonDepth()

    def check(chunk: bytes) -> None:
        if depth.feed(chunk) > limits.json_depth:
            raise BundleError(
                f"{path}: member {info.name!r}: JSON nested deeper than {limits.json_depth} levels"
            )

    return check


def _write_member(tar: tarfile.TarFile, info: tarfile.TarInfo, target: Path, check=None):
    """Copy one member into a new file (mode 0644 by umask), hashing it on the way and giving
    each chunk to ``check`` first; returns (sha256, bytes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    source = tar.extractfile(info)
    with source, open(target, "xb") as fh:  # "x": a name seen twice can never overwrite
        while chunk := source.read(_CHUNK):
            if check:
                check(chunk)
            digest.update(chunk)
            size += len(chunk)
            fh.write(chunk)
    return digest.hexdigest(), size


def _verified_manifest(path: Path, root: Path, top: str, found: dict) -> Manifest:
    """The manifest, once every member matches it and it matches the members."""
    if MANIFEST not in found:
        raise BundleError(f"{path}: no {top}/{MANIFEST}: not a bundle")
    manifest = Manifest.from_dict(read_json(root / MANIFEST), f"{path}: {MANIFEST}")
    if top != manifest.name:
        raise BundleError(f"{path}: top folder {top!r} is not {manifest.name!r} (its manifest's)")
    for member, (sha, size) in sorted(found.items()):
        if member == MANIFEST:
            continue
        entry = manifest.members.get(member)
        if entry is None:
            raise BundleError(f"{path}: member {member!r} is not in the manifest")
        if (entry["sha256"], entry["bytes"]) != (sha, size):
            raise BundleError(
                f"{path}: member {member!r} does not match its sha256 in the manifest "
                "(changed or damaged after the bundle was made)"
            )
        if not manifest.allowed(member):
            raise BundleError(f"{path}: member {member!r} is not a place a bundle carries")
    missing = sorted(set(manifest.members) - set(found))
    if missing:
        raise BundleError(f"{path}: member {missing[0]!r} is in the manifest but not the bundle")
    return manifest


# --------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m offload_study.across.bundle",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True)
    make = sub.add_parser("create", help="bundle one study's results on one cluster")
    make.add_argument("--root", default=".", help="working tree holding results/ (default: .)")
    make.add_argument("--cluster", required=True)
    make.add_argument("--study", required=True)
    make.add_argument("--report", help="the study's report.html to carry along")
    make.add_argument("--out", required=True, help="bundle to write (.tar.gz)")
    check = sub.add_parser("verify", help="check bundles (checksums, safe members)")
    check.add_argument("bundles", nargs="+")
    a = ap.parse_args(argv)
    try:
        if a.command == "create":
            m = create(a.root, a.cluster, a.study, a.out, a.report)
            print(f"bundle: wrote {a.out} ({len(m.members)} members)")
            return 0
        with opened(a.bundles) as bundles:
            for b in bundles:
                m = b.manifest
                print(
                    f"bundle: ok {b.path}: study {m.study} on {m.cluster}, "
                    f"{len(m.members)} members, made {m.created_at}, sha256 {b.sha256}"
                )
    except BundleError as e:
        print(f"bundle: {e}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def compare_name(paths) -> str:
    """A compare page's name from its bundles' file names: 'A__vs__B' (here, not in compare, so
    that the Snakefile can name the page without importing pandas at parse time). BundleError
    for a file name that is not ``<plain name>.tar.gz`` (it becomes a path under reports/)."""
    stems = [Path(str(p)).name.removesuffix(SUFFIX) for p in paths]
    for path, stem in zip(paths, stems, strict=True):
        if not (str(path).endswith(SUFFIX) and valid_name(stem)):
            raise BundleError(
                f"{str(path)[:200]!r}: not a bundle file name (<name>{SUFFIX}, the name of "
                "letters, digits, '.', '_' and '-')"
            )
    return "__vs__".join(stems)
