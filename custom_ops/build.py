"""Build the csa2onnx custom-op library (`python custom_ops/build.py`).

The onnxruntime wheel ships `libonnxruntime.so` but no headers, and no third-party code is
kept in this repository, so the ONNX Runtime C/C++ headers come from, in order:
`ORT_INCLUDE_DIR`; a system install (`/usr/include/onnxruntime`); else Debian's
`libonnxruntime-dev` package, downloaded with `apt-get download` through a private apt
configuration under `custom_ops/.cache/` (nothing is installed, the system is untouched).
The mirror is read from this machine's own apt sources; only the suite is changed.

Standard library only: this runs before the package is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
DEBIAN_SUITE = "trixie"  # first Debian suite shipping libonnxruntime-dev >= 1.21
MIN_ORT_API = 21
LIBRARY_NAME = "libcsa2onnx_ops.so"
STAMP_NAME = "SOURCES.sha256"


def sources_digest() -> str:
    """Hash of everything the library is built from; a build records it to detect staleness."""
    h = hashlib.sha256()
    for path in sorted([HERE / "CMakeLists.txt", *(HERE / "src").iterdir()]):
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def built_from_current_sources(build_dir: Path) -> bool:
    """Whether the library in build_dir was built from today's sources (its build's stamp)."""
    stamp = build_dir / STAMP_NAME
    return stamp.is_file() and stamp.read_text().strip() == sources_digest()


def _ort_api_version(include_dir: Path) -> int:
    text = (include_dir / "onnxruntime_c_api.h").read_text(errors="replace")
    match = re.search(r"#define\s+ORT_API_VERSION\s+(\d+)", text)
    return int(match.group(1)) if match else 0


def _usable(include_dir: Path) -> bool:
    needed = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_lite_custom_op.h")
    if not all((include_dir / name).is_file() for name in needed):
        return False
    return _ort_api_version(include_dir) >= MIN_ORT_API


def _debian_mirror() -> str:
    """The first non-security Debian mirror this machine's apt sources name."""
    uris: list[str] = []
    sources_d = Path("/etc/apt/sources.list.d")
    for path in sorted(sources_d.glob("*.sources")) if sources_d.is_dir() else []:
        uris += re.findall(r"^URIs:\s*(\S+)", path.read_text(), flags=re.M)
    for path in [Path("/etc/apt/sources.list"), *sorted(sources_d.glob("*.list"))]:
        if path.is_file():
            uris += re.findall(r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)", path.read_text(), flags=re.M)
    for uri in uris:
        if "security" not in uri and "debian" in uri:
            return uri.rstrip("/")
    raise SystemExit(
        "custom_ops/build.py: no Debian mirror found in /etc/apt/sources*; "
        "set ORT_INCLUDE_DIR to a folder holding the ONNX Runtime >= 1.21 headers"
    )


def _fetch_debian_headers() -> Path:
    include_dir = CACHE / "root" / "usr" / "include" / "onnxruntime"
    if _usable(include_dir):
        return include_dir
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise SystemExit(
                f"custom_ops/build.py: {tool} not found; set ORT_INCLUDE_DIR to a folder "
                "holding the ONNX Runtime >= 1.21 headers"
            )
    apt = CACHE / "apt"
    (apt / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (apt / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    signed = f"[signed-by={keyring}] " if Path(keyring).is_file() else ""
    sources = apt / "sources.list"
    sources.write_text(f"deb {signed}{_debian_mirror()} {DEBIAN_SUITE} main\n")
    options = [
        f"-oDir::Etc::SourceList={sources}",
        "-oDir::Etc::SourceParts=/dev/null",
        f"-oDir::State::Lists={apt / 'lists'}",
        f"-oDir::Cache={apt}",
        "-oDir::State::status=/dev/null",
        "-oAPT::Sandbox::User=root" if os.geteuid() == 0 else "-oAPT::Sandbox::User=",
        "-qq",
    ]
    print(f"fetching libonnxruntime-dev headers (Debian {DEBIAN_SUITE}) ...", flush=True)
    subprocess.run(["apt-get", *options, "update"], check=True)
    subprocess.run(["apt-get", *options, "download", "libonnxruntime-dev"], check=True, cwd=apt)
    debs = sorted(apt.glob("libonnxruntime-dev_*.deb"))
    if not debs:
        raise SystemExit("custom_ops/build.py: apt-get download produced no libonnxruntime-dev")
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(CACHE / "root")], check=True)
    if not _usable(include_dir):
        raise SystemExit(f"custom_ops/build.py: {debs[-1].name} has no usable headers")
    return include_dir


def find_ort_headers() -> Path:
    env = os.environ.get("ORT_INCLUDE_DIR")
    if env:
        if not _usable(Path(env)):
            raise SystemExit(
                f"ORT_INCLUDE_DIR={env} lacks the ONNX Runtime C/C++ headers "
                f"(need onnxruntime_lite_custom_op.h and ORT_API_VERSION >= {MIN_ORT_API})"
            )
        return Path(env)
    system = Path("/usr/include/onnxruntime")
    return system if _usable(system) else _fetch_debian_headers()


def build(build_dir: Path, sanitize: bool, cuda: str) -> Path:
    include_dir = find_ort_headers()
    configure = [
        "cmake", "-S", str(HERE), "-B", str(build_dir),
        f"-DORT_INCLUDE_DIR={include_dir}",
        f"-DCMAKE_BUILD_TYPE={'Debug' if sanitize else 'Release'}",
        f"-DCSA_SANITIZE={'ON' if sanitize else 'OFF'}",
        f"-DCSA_CUDA={cuda}",
    ]
    subprocess.run(configure, check=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)
    library = build_dir / LIBRARY_NAME
    (build_dir / STAMP_NAME).write_text(sources_digest() + "\n")
    return library


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", type=Path, default=HERE / "build")
    parser.add_argument("--sanitize", action="store_true",
                        help="build with -fsanitize=address,undefined (for the fuzz tool)")
    parser.add_argument("--cuda", choices=["AUTO", "ON", "OFF"], default="AUTO",
                        help="compile the CUDA kernels (AUTO: when nvcc is found)")
    args = parser.parse_args(argv)
    library = build(args.build_dir.resolve(), args.sanitize, args.cuda)
    print(f"built {library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
