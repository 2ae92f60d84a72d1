"""Carry a newer Triton wheel to an offline GPU machine, in as few carry-sized parts as possible.

The GPU machine has no network; files reach it only inside the repo checkout (an ignored folder named in
the run's ``carry`` list, 64 MiB per call including the ~8 MiB repo).  A Triton wheel is ~290 MB
(``triton/_C/libtriton.so`` alone is 500 MB unpacked, most of it DWARF debug info), so ``pack`` trims it
to what compiling and running kernels for NVIDIA Hopper needs, compresses it with xz (x86 BCJ + LZMA2,
256 MiB dictionary) and splits the archive into parts; ``unpack`` puts the parts back together on the
GPU machine and extracts a ``PYTHONPATH``-ready tree.

What ``pack`` removes (Triton's own code is unchanged; only unused backends/tools go):

- ``triton/backends/amd/lib/`` (``libtriton_amd_codegen.so``, 105 MB, loaded by ctypes only when compiling
  for an AMD GPU, and the ``ocml``/``ockl``/``asanrtl`` bitcode) and ``triton/backends/amd/include/`` (HIP
  headers for the AMD launcher): the ``amd`` Python modules stay, so the wheel's ``triton.backends`` entry
  points still resolve and the AMD driver simply reports itself inactive;
- ``triton/backends/nvidia/lib/cupti/``, ``.../cupti-blackwell/`` and ``triton/_C/libproton.so``: the
  proton profiler (``import triton.profiler`` fails; nothing else uses them);
- ``triton/backends/nvidia/bin/ptxas``: the legacy ptxas that Triton uses only for arch < 90 (sm_90 and
  newer use the bundled ``ptxas-blackwell``, which is kept, with ``cuobjdump`` and ``nvdisasm``);
  ``--keep-legacy-ptxas`` keeps it, or set ``TRITON_PTXAS_PATH`` to a CUDA ptxas for sm_80 work;
- ``triton/FileCheck``, ``triton/plugins/*.so`` (loaded only via ``TRITON_PLUGIN_PATHS``) and
  ``triton/instrumentation/libGPUInstrumentationTestLib.so``: Triton's own test tools;
- and ``strip --strip-unneeded`` on ``triton/_C/libtriton.so`` (drops debug info and the static symbol
  table; the loaded sections and the dynamic symbols are byte-identical).  ``--no-strip`` skips that.

Triton picks its ptxas per arch: sm_90 and newer use ``ptxas-blackwell`` (``TRITON_PTXAS_BLACKWELL_PATH``
overrides it, ``TRITON_PTXAS_PATH`` only the legacy one).  Dropping it too (``--drop
'triton/backends/nvidia/bin/ptxas-blackwell'``, ~12 MB less archive) and pointing
``TRITON_PTXAS_BLACKWELL_PATH`` at CUDA 13.0's ptxas compiles, but gives different SASS (Triton 3.9.0's
is CUDA 13.4's): it is kept by default.

The dist-info ``RECORD`` is rewritten to match (removed files dropped, the stripped library rehashed).

Usage, here (network; MB = 10**6 bytes; by default the fewest parts of at most 54 MB, of equal size)::

    python scripts/carry_triton.py pack 3.9.0 --out .triton39 [--part-mb N] [--wheel PATH.whl]

writes ``.triton39/triton-3.9.0.partNN`` and ``.triton39/triton-3.9.0.manifest.json`` (sha256 of the
archive and of each part, and what was removed).  The output folder must be ignored by git (e.g. a line
``/.triton39/`` in ``.git/info/exclude``) so it travels only when named in ``carry``.

On the GPU machine (the script needs only the stdlib; the cp312-abi3 ``libtriton.so`` needs Python >= 3.12)::

    python3 scripts/carry_triton.py unpack .triton39 --target /tmp/t39
    PYTHONPATH=/tmp/t39 python3 -c 'import triton; print(triton.__version__)'

``unpack`` copies every verified part it finds into a stash (``--stash``, default
``/tmp/carry_triton_parts``), so parts can come over consecutive calls: carry the manifest with part 1
in the first call, the manifest with part 2 in the next, and run the same ``unpack`` command each time;
it exits 3 (listing the missing parts) until all are there, then verifies the whole archive's sha256 and
extracts.  Re-running it when TARGET already holds that archive is a no-op.  Exit codes: 0 done,
3 parts missing, 1 error (bad checksum, ...).
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import lzma
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from base64 import urlsafe_b64encode

DEFAULT_PART_MB = 54
MB = 10**6
DEFAULT_STASH = "/tmp/carry_triton_parts"
MARKER = ".carry_triton.json"

# (glob on the wheel path, why) -- fnmatch's ``*`` also matches ``/``
DROP = [
    ("triton/backends/amd/lib/*", "AMD code generator and device libraries (used only compiling for AMD)"),
    ("triton/backends/amd/include/*", "HIP headers (used only building the AMD launcher)"),
    ("triton/backends/nvidia/lib/cupti/*", "CUPTI for the proton profiler"),
    ("triton/backends/nvidia/lib/cupti-blackwell/*", "CUPTI for the proton profiler"),
    ("triton/_C/libproton.so", "proton profiler extension"),
    ("triton/FileCheck", "LLVM FileCheck (Triton's tests)"),
    ("triton/plugins/*", "test plugin libraries (loaded only via TRITON_PLUGIN_PATHS)"),
    ("triton/instrumentation/libGPUInstrumentationTestLib.so", "instrumentation test library"),
]
LEGACY_PTXAS = ("triton/backends/nvidia/bin/ptxas", "legacy ptxas, used only for arch < 90")
STRIP = ["triton/_C/libtriton.so"]
LZMA_FILTERS = [
    {"id": lzma.FILTER_X86},
    {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": 256 << 20},
]


def log(msg: str) -> None:
    print(f"[carry_triton] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def record_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256=" + urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


# ---------------------------------------------------------------------------------------------- pack


def download_wheel(version: str, dest: str, python: str) -> str:
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
           f"triton=={version}", "-d", dest]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)
    wheels = [f for f in os.listdir(dest) if f.startswith(f"triton-{version}-") and f.endswith(".whl")]
    if len(wheels) != 1:
        raise SystemExit(f"expected one triton {version} wheel in {dest}, found {wheels}")
    return os.path.join(dest, wheels[0])


def extract_trimmed(wheel: str, stage: str, drop: list) -> tuple:
    removed = []
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            why = next((w for pat, w in drop if fnmatch.fnmatchcase(name, pat)), None)
            if why is not None:
                removed.append({"path": name, "bytes": info.file_size, "why": why})
                continue
            if name.endswith("/"):
                continue
            dest = os.path.join(stage, *name.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with zf.open(info) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(dest, mode if mode else 0o644)
            os.utime(dest, (time.mktime(info.date_time + (0, 0, -1)), ) * 2)
    return removed


def strip_libs(stage: str, paths: list) -> list:
    strip = shutil.which("strip")
    done = []
    for rel in paths:
        path = os.path.join(stage, rel)
        if not os.path.exists(path):
            continue
        if strip is None:
            log(f"no `strip` here: {rel} stays unstripped (bigger archive)")
            continue
        before = os.path.getsize(path)
        st = os.stat(path)
        subprocess.run([strip, "--strip-unneeded", path], check=True)
        os.utime(path, (st.st_atime, st.st_mtime))
        after = os.path.getsize(path)
        log(f"strip --strip-unneeded {rel}: {before:,} -> {after:,} bytes")
        done.append({"path": rel, "bytes_before": before, "bytes_after": after})
    return done


def rewrite_record(stage: str, removed: list, stripped: list) -> None:
    dist = [d for d in os.listdir(stage) if d.endswith(".dist-info")]
    if len(dist) != 1:
        return
    record = os.path.join(stage, dist[0], "RECORD")
    gone = {r["path"] for r in removed}
    changed = {s["path"] for s in stripped}
    st = os.stat(record)
    lines = []
    with open(record, newline="") as f:
        for line in f.read().splitlines():
            path = line.rsplit(",", 2)[0]
            if path in gone:
                continue
            if path in changed:
                full = os.path.join(stage, path)
                line = f"{path},{record_hash(full)},{os.path.getsize(full)}"
            lines.append(line)
    with open(record, "w", newline="") as f:
        f.write("\n".join(lines) + "\n")
    os.utime(record, (st.st_atime, st.st_mtime))


def make_archive(stage: str, archive: str, dir_mtime: float) -> None:
    def normalize(ti: tarfile.TarInfo) -> tarfile.TarInfo:  # the same wheel gives the same archive
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        ti.mtime = int(dir_mtime if ti.isdir() else ti.mtime)
        return ti

    with lzma.open(archive, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=LZMA_FILTERS) as xz:
        with tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for top in sorted(os.listdir(stage)):
                for root, dirs, files in os.walk(os.path.join(stage, top)):
                    dirs.sort()
                    rel_root = os.path.relpath(root, stage)
                    tar.add(root, arcname=rel_root, recursive=False, filter=normalize)
                    for name in sorted(files):
                        tar.add(os.path.join(root, name), arcname=os.path.join(rel_root, name), filter=normalize)


def split(archive: str, out: str, stem: str, part_bytes: int) -> list:
    size = os.path.getsize(archive)
    n = max(1, math.ceil(size / part_bytes))
    each = math.ceil(size / n)  # equal parts, each at most part_bytes
    parts = []
    with open(archive, "rb") as f:
        for i in range(n):
            name = f"{stem}.part{i + 1:02d}"
            data = f.read(each)
            with open(os.path.join(out, name), "wb") as p:
                p.write(data)
            parts.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return parts


def cmd_pack(args) -> int:
    version = args.version
    stem = f"triton-{version}"
    os.makedirs(args.out, exist_ok=True)
    for f in os.listdir(args.out):  # old parts of this version would confuse a later unpack
        if f.startswith(stem + ".part") or f == stem + ".manifest.json":
            os.remove(os.path.join(args.out, f))
    drop = list(DROP) + ([] if args.keep_legacy_ptxas else [LEGACY_PTXAS])
    drop += [(pat, "--drop") for pat in args.drop]
    with tempfile.TemporaryDirectory(prefix="carry_triton_") as tmp:
        wheel = args.wheel or download_wheel(version, os.path.join(tmp, "dl"), args.pip_python)
        wheel_name = os.path.basename(wheel)
        if not wheel_name.startswith(stem + "-"):
            raise SystemExit(f"{wheel_name} is not a triton {version} wheel")
        wheel_sha = sha256_file(wheel)
        stage = os.path.join(tmp, "stage")
        log(f"extracting {wheel_name} ({os.path.getsize(wheel):,} bytes) without the dropped members")
        removed = extract_trimmed(wheel, stage, drop)
        stripped = [] if args.no_strip else strip_libs(stage, STRIP)
        rewrite_record(stage, removed, stripped)
        files = [os.path.join(r, f) for r, _, fs in os.walk(stage) for f in fs]
        tree_bytes = sum(os.path.getsize(f) for f in files)
        archive = os.path.join(tmp, f"{stem}.tar.xz")
        log(f"compressing {tree_bytes:,} bytes (xz, x86 BCJ + LZMA2 9e, 256 MiB dictionary; a few minutes)")
        t0 = time.time()
        make_archive(stage, archive, max(os.path.getmtime(f) for f in files))
        size = os.path.getsize(archive)
        log(f"archive: {size:,} bytes in {time.time() - t0:.0f} s")
        parts = split(archive, args.out, stem, int(args.part_mb * MB))
        manifest = {
            "version": version,
            "wheel": wheel_name,
            "wheel_sha256": wheel_sha,
            "wheel_bytes": os.path.getsize(wheel),
            "archive": f"{stem}.tar.xz",
            "archive_bytes": size,
            "archive_sha256": sha256_file(archive),
            "unpacked_bytes": tree_bytes,
            "compression": "tar (PAX) in xz: x86 BCJ + LZMA2 preset 9e, dict 256 MiB (tar -xJf also reads it)",
            "parts": parts,
            "removed": removed,
            "stripped": stripped,
        }
    with open(os.path.join(args.out, f"{stem}.manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(json.dumps({"archive_bytes": size, "parts": [(p["name"], p["bytes"]) for p in parts],
                      "removed_bytes": sum(r["bytes"] for r in removed), "out": args.out}, indent=1))
    return 0


# -------------------------------------------------------------------------------------------- unpack


def find_manifest(src: str, version) -> str:
    names = sorted(f for f in os.listdir(src) if f.startswith("triton-") and f.endswith(".manifest.json"))
    if version:
        names = [f for f in names if f == f"triton-{version}.manifest.json"]
    if len(names) != 1:
        raise SystemExit(f"need exactly one manifest in {src} (use --version): found {names}")
    return os.path.join(src, names[0])


def safe_extract(tar: tarfile.TarFile, dest: str) -> None:
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    root = os.path.realpath(dest)
    for m in tar.getmembers():
        target = os.path.realpath(os.path.join(dest, m.name))
        if not (target == root or target.startswith(root + os.sep)) or m.issym() or m.islnk() or m.isdev():
            raise SystemExit(f"refusing archive member {m.name!r}")
    tar.extractall(dest)


def cmd_unpack(args) -> int:
    manifest_path = find_manifest(args.src, args.version)
    with open(manifest_path) as f:
        man = json.load(f)
    version, sha = man["version"], man["archive_sha256"]
    target = os.path.abspath(args.target)
    marker = os.path.join(target, MARKER)
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f).get("archive_sha256") == sha and os.path.isdir(os.path.join(target, "triton")):
                log(f"{target} already holds triton {version} ({sha[:12]}); nothing to do")
                return check_import(target, version) if not args.no_check else 0
    stash = os.path.join(args.stash, sha[:16])
    os.makedirs(stash, exist_ok=True)
    missing = []
    for part in man["parts"]:
        stashed = os.path.join(stash, part["name"])
        if os.path.exists(stashed) and sha256_file(stashed) == part["sha256"]:
            log(f"{part['name']}: in the stash")
            continue
        here = os.path.join(args.src, part["name"])
        if os.path.exists(here):
            got = sha256_file(here)
            if got != part["sha256"]:
                log(f"{part['name']}: sha256 {got} != manifest {part['sha256']}")
                return 1
            shutil.copyfile(here, stashed + ".tmp")
            os.replace(stashed + ".tmp", stashed)
            log(f"{part['name']}: verified, stashed in {stash}")
        else:
            missing.append(part["name"])
    if missing:
        log(f"waiting for {len(missing)} of {len(man['parts'])} parts: {', '.join(missing)} "
            f"(stash {stash}; carry them and run this again)")
        return 3
    archive = os.path.join(stash, man["archive"])
    h = hashlib.sha256()
    with open(archive + ".tmp", "wb") as out:
        for part in man["parts"]:
            with open(os.path.join(stash, part["name"]), "rb") as p:
                for block in iter(lambda: p.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != sha:
        log(f"archive sha256 {h.hexdigest()} != manifest {sha}")
        os.remove(archive + ".tmp")
        return 1
    os.replace(archive + ".tmp", archive)
    log(f"archive {man['archive']} ({man['archive_bytes']:,} bytes) verified; extracting into {target}")
    os.makedirs(target, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".carry_tmp_", dir=target)
    try:
        t0 = time.time()
        with tarfile.open(archive, "r:xz") as tar:
            safe_extract(tar, tmp)
        for name in os.listdir(target):  # an older carried triton in TARGET goes
            if name == "triton" or (name.startswith("triton-") and name.endswith(".dist-info")):
                shutil.rmtree(os.path.join(target, name))
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(target, name))
        log(f"extracted in {time.time() - t0:.0f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with open(marker, "w") as f:
        json.dump({"version": version, "archive_sha256": sha, "wheel": man["wheel"]}, f)
    if not args.keep_archive:
        os.remove(archive)
    return check_import(target, version) if not args.no_check else 0


def check_import(target: str, version: str) -> int:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [target, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__, triton.__file__)"],
                          env=env, capture_output=True, text=True)
    out = proc.stdout.strip()
    if proc.returncode != 0 or not out.startswith(version + " "):
        log(f"import check failed: {out} {proc.stderr[-2000:]}")
        if sys.version_info < (3, 12):
            log("(the cp312-abi3 wheel's libtriton.so needs Python >= 3.12; this is "
                f"{sys.version_info.major}.{sys.version_info.minor})")
        return 1
    log(f"PYTHONPATH={target} {sys.executable}: triton {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="download, trim, compress and split a triton wheel (needs network)")
    p.add_argument("version")
    p.add_argument("--out", required=True, help="output folder (git-ignored)")
    p.add_argument("--part-mb", type=float, default=DEFAULT_PART_MB,
                   help=f"largest part in MB of 10**6 bytes (default {DEFAULT_PART_MB}: the fewest such parts)")
    p.add_argument("--wheel", help="use this already downloaded wheel instead of `pip download`")
    p.add_argument("--pip-python", default=sys.executable, help="python whose pip downloads the wheel")
    p.add_argument("--keep-legacy-ptxas", action="store_true", help="keep bin/ptxas (arch < 90 only; +~8.6 MB)")
    p.add_argument("--no-strip", action="store_true", help="keep libtriton.so's debug info (+~4x its size)")
    p.add_argument("--drop", action="append", default=[], metavar="GLOB", help="also drop these wheel paths")
    p.set_defaults(fn=cmd_pack)
    u = sub.add_parser("unpack", help="verify, join and extract the parts (on the GPU machine)")
    u.add_argument("src", help="folder with the manifest and (some of) the parts")
    u.add_argument("--target", required=True, help="folder to extract into (put it on PYTHONPATH)")
    u.add_argument("--version", help="which manifest, if the folder has several")
    u.add_argument("--stash", default=DEFAULT_STASH, help=f"where parts wait between calls ({DEFAULT_STASH})")
    u.add_argument("--keep-archive", action="store_true", help="keep the joined .tar.xz in the stash")
    u.add_argument("--no-check", action="store_true", help="skip the `import triton` check")
    u.set_defaults(fn=cmd_unpack)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
