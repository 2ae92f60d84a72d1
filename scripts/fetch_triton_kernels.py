"""Export OpenAI's ``triton_kernels`` package (Triton's ``python/triton_kernels``) from a git directory into an ignored
folder, for the bench's optional ``triton-kernels-w4a16`` arm (``mxmoe/bench/arms.py``, ``TritonKernelsArm``).

    python3 scripts/fetch_triton_kernels.py --git-dir /path/to/triton.git [--ref REF] [--out .triton_kernels]
    PYTHONPATH=$PWD/.triton_kernels python3 -c "import triton_kernels"

``triton_kernels`` is not on PyPI (the PyPI name ``triton-kernels`` is another project): it lives in the Triton repository
and is installed from a checkout. The GPU machine has no network, so the package travels as plain files: this script
writes ``OUT/triton_kernels/`` (the importable package), ``OUT/pyproject.toml`` (its packaging, kept for reference),
``OUT/LICENSE`` (Triton's MIT license) and ``OUT/SOURCE.json`` (where it came from: the resolved commit, its date and
subject, the Triton version string at that commit). ``OUT`` is replaced whole.

The ref to take: the tag ``v3.6.0`` where the git directory has it (the Triton the bench machines run). Without it, the
default is ``e4e68d1b9c7d307785b230c0521095c753ffe071`` (main, 2025-11-23): the last main commit before
"[TRITON_KERNELS][BW-BREAKING] matrix multiplication refactor (#8765)" renamed ``matmul_ogs`` to ``matmul``. The
``triton_kernels`` that users of Triton 3.6.0 describe (sglang, vLLM: ``triton_kernels.matmul_ogs`` with
``RoutingData``/``GatherIndx``/``ScatterIndx``, no ``triton_kernels.routing``, ``topk`` returning a ``SparseMatrix``,
``FnSpecs.reduction_n``) is the one of main between 2025-10-29 and that commit; the release branch was cut around then
(its version bump to 3.6.0 was a cherry-pick). The commit taken is recorded, so a run says which one it used.
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

PACKAGE = "python/triton_kernels/triton_kernels"
EXTRAS = {"python/triton_kernels/pyproject.toml": "pyproject.toml", "LICENSE": "LICENSE"}
VERSION_FILE = "python/triton/__init__.py"
DEFAULT_REFS = ("v3.6.0", "e4e68d1b9c7d307785b230c0521095c753ffe071")


def git(git_dir: str, *args: str, binary: bool = False):
    out = subprocess.run(["git", "--git-dir", git_dir, *args], capture_output=True, check=True)
    return out.stdout if binary else out.stdout.decode().strip()


def resolve(git_dir: str, ref: str | None) -> tuple[str, str]:
    """``(ref as asked, commit sha)``: ``ref``, else the first of :data:`DEFAULT_REFS` the git directory has."""
    for candidate in ([ref] if ref else DEFAULT_REFS):
        try:
            return candidate, git(git_dir, "rev-parse", "--verify", "--quiet", f"{candidate}^{{commit}}")
        except subprocess.CalledProcessError:
            if ref:
                raise SystemExit(f"{git_dir} has no commit {ref!r}")
    raise SystemExit(f"{git_dir} has none of {DEFAULT_REFS}: pass --ref")


def export(git_dir: str, ref: str | None, out: Path) -> dict:
    asked, sha = resolve(git_dir, ref)
    tar_bytes = git(git_dir, "archive", "--format=tar", sha, PACKAGE, *EXTRAS, binary=True)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    n_files = 0
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            if member.name.startswith(PACKAGE + "/"):
                dest = out / "triton_kernels" / member.name[len(PACKAGE) + 1:]
            elif member.name in EXTRAS:
                dest = out / EXTRAS[member.name]
            else:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(tar.extractfile(member).read())
            n_files += 1
    version = None
    for line in git(git_dir, "show", f"{sha}:{VERSION_FILE}").splitlines():
        if line.startswith("__version__"):
            version = line.split("=", 1)[1].strip().strip("'\"")
    record = {
        "package": "triton_kernels", "source": "https://github.com/triton-lang/triton", "path": PACKAGE,
        "ref": asked, "commit": sha, "commit_date": git(git_dir, "show", "-s", "--format=%cI", sha),
        "subject": git(git_dir, "show", "-s", "--format=%s", sha), "triton_version_at_commit": version,
        "tag_v3_6_0_in_git_dir": bool(_has(git_dir, "v3.6.0")), "files": n_files,
        "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
    }
    (out / "SOURCE.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _has(git_dir: str, ref: str) -> bool:
    try:
        git(git_dir, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        return True
    except subprocess.CalledProcessError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--git-dir", required=True, help="a Triton git directory (bare mirror or .git)")
    p.add_argument("--ref", default=None, help=f"tag, branch or commit (default: the first found of {DEFAULT_REFS})")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / ".triton_kernels"),
                   help="folder to (re)create; put it on PYTHONPATH (default: .triton_kernels in the repo)")
    args = p.parse_args(argv)
    record = export(args.git_dir, args.ref, Path(args.out))
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
