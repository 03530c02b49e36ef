# pymsda/_build_backend.py: the PEP 517 / PEP 660 build backend named in pyproject.toml.
#
# Why not setuptools: the package is pure Python plus one prebuilt shared library made by the
# Makefile, so a wheel is just a zip of pymsda/*.py, build/libpymsda.so and three metadata files.
# An in-tree backend needs no build requirements (`requires = []`), so `pip install .` works
# offline and with --no-build-isolation, never imports torch, and lets us tag the wheel
# py3-none-<platform>: the library links neither Python nor torch, only the platform matters.
# The platform tag is read from the library itself (_platform_tag): manylinux_2_<N> when it needs
# only glibc's own libraries at symbol versions up to 2.<N> (`make wheel`'s portable link), else
# this machine's linux_<arch>.
# Standard library only; it must not import anything from the pymsda package.
import base64
import hashlib
import io
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = "libpymsda.so"
SDIST_PATHS = ["c", "kernels", "pymsda", "tests", "docs", "Makefile", "pyproject.toml", "README.md", "BENCHMARKS.md"]
EXCLUDED = re.compile(r"(^|/)__pycache__(/|$)|\.(pyc|so|o|a)$")  # build outputs never shipped as source
ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: same sources, same wheel bytes


def _read_table(text, header):
    """Plain strings, lists of strings and {key = "..."} of one TOML table (Python < 3.11 only)."""
    match = re.search(r"^\[" + re.escape(header) + r"\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    table = {}
    body = match.group(1) if match else ""
    for key, raw in re.findall(r'^([\w-]+)\s*=\s*(".*?"|\[.*?\]|\{.*?\})', body, re.M | re.S):
        if raw[0] == "{":
            table[key] = dict(re.findall(r'([\w-]+)\s*=\s*"([^"]*)"', raw))
        else:
            strings = re.findall(r'"([^"]*)"', raw)
            table[key] = strings[0] if raw[0] == '"' else strings
    return table


def _project():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    try:
        import tomllib
        return tomllib.loads(text)["project"]
    except ImportError:
        project = _read_table(text, "project")
        project["optional-dependencies"] = _read_table(text, "project.optional-dependencies")
        return project


def _metadata(project):
    lines = ["Metadata-Version: 2.1", "Name: " + project["name"], "Version: " + project["version"],
             "Summary: " + project.get("description", "")]
    if project.get("requires-python"):
        lines.append("Requires-Python: " + project["requires-python"])
    if "text" in project.get("license", {}):
        lines.append("License: " + project["license"]["text"])
    if project.get("keywords"):
        lines.append("Keywords: " + ",".join(project["keywords"]))
    lines += ["Classifier: " + c for c in project.get("classifiers", [])]
    lines += ["Requires-Dist: " + r for r in project.get("dependencies", [])]
    for extra, requirements in sorted(project.get("optional-dependencies", {}).items()):
        lines.append("Provides-Extra: " + extra)
        lines += ['Requires-Dist: %s; extra == "%s"' % (r, extra) for r in requirements]
    readme = os.path.join(ROOT, project.get("readme", "README.md"))
    if not os.path.isfile(readme):
        return "\n".join(lines) + "\n"
    with open(readme, encoding="utf-8") as f:
        return "\n".join(lines + ["Description-Content-Type: text/markdown", "", f.read()])


def _names(project, platform=None):
    platform = platform or re.sub(r"[-.]", "_", sysconfig.get_platform())
    base = "%s-%s" % (project["name"], project["version"])
    return base, "%s-py3-none-%s" % (base, platform), "py3-none-" + platform


# What a manylinux library may need: glibc's own libraries (PEP 600), nothing else (no libgomp).
GLIBC_LIBRARIES = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                   "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}
MANYLINUX_FLOOR = 28  # the glibc `make wheel` links for (Makefile: GLIBC_FLOOR)


def _platform_tag(library):
    """manylinux_2_<N>_<arch> when the library needs only GLIBC_LIBRARIES, N the highest GLIBC
    version it needs (at least MANYLINUX_FLOOR); else linux_<arch>. Read with binutils' readelf;
    without it, linux_<arch>."""
    platform = re.sub(r"[-.]", "_", sysconfig.get_platform())
    try:
        dynamic = subprocess.run(["readelf", "--dynamic", "--version-info", "--wide", library],
                                 check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    glibc = [int(minor) for minor in re.findall(r"\bGLIBC_2\.(\d+)", dynamic)]
    if not platform.startswith("linux_") or not needed or set(needed) - GLIBC_LIBRARIES:
        return platform
    return "manylinux_2_%d_%s" % (max(glibc + [MANYLINUX_FLOOR]), platform[len("linux_"):])


def _dist_info_files(project, platform=None):
    base, _, tag = _names(project, platform)
    wheel = "Wheel-Version: 1.0\nGenerator: pymsda._build_backend\nRoot-Is-Purelib: false\nTag: %s\n" % tag
    return {base + ".dist-info/METADATA": _metadata(project).encode("utf-8"),
            base + ".dist-info/WHEEL": wheel.encode("utf-8")}


def _ensure_library():
    # PYMSDA_BUILD_DIR: the Makefile's BUILD folder whose library goes in the wheel (`make wheel`
    # sets it); relative to the source root.
    build = os.environ.get("PYMSDA_BUILD_DIR") or "build"
    library = os.path.join(ROOT, build, LIBRARY)
    if os.path.isfile(library):
        return library
    # make asks PYTHON what torch it has (and where pip put nvcc): this interpreter, with -E, since
    # pip's build isolation (PYTHONPATH, PYTHONNOUSERSITE) hides the environment's packages.
    command = ["make", "BUILD=" + build, "PYTHON=%s -E" % shlex.quote(sys.executable)]
    command += shlex.split(os.environ.get("PYMSDA_MAKE_ARGS", ""))
    print("pymsda: %s not found, running: %s" % (library, shlex.join(command)), file=sys.stderr, flush=True)
    try:
        subprocess.run(command, cwd=ROOT, check=True)
    except FileNotFoundError:
        raise RuntimeError("pymsda: `make` was not found; install make and a C compiler, "
                           "or build %s yourself before `pip install`" % library) from None
    except subprocess.CalledProcessError as error:
        raise RuntimeError("pymsda: `%s` failed with exit status %d (its output is above); extra make "
                           "arguments go in PYMSDA_MAKE_ARGS, e.g. PYMSDA_MAKE_ARGS='CUDA_ARCHS=90'"
                           % (shlex.join(command), error.returncode)) from None
    if not os.path.isfile(library):
        raise RuntimeError("pymsda: `make` succeeded but did not produce %s" % library)
    return library


def _write_wheel(wheel_directory, project, files, platform=None):
    """files: {archive name: bytes}. RECORD lists each with sha256 (urlsafe base64, no padding) and size."""
    base, wheel_name, _ = _names(project, platform)
    path = os.path.join(wheel_directory, wheel_name + ".whl")
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in sorted(files.items(), key=lambda item: (".dist-info/" in item[0], item[0])):
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append("%s,sha256=%s,%d\n" % (name, digest, len(data)))
            _zip_add(wheel, name, data)
        _zip_add(wheel, base + ".dist-info/RECORD", "".join(record) + base + ".dist-info/RECORD,,\n")
    return os.path.basename(path)


def _zip_add(wheel, name, data):
    info = zipfile.ZipInfo(name, ZIP_DATE)
    info.external_attr = (0o100755 if name.endswith(".so") else 0o100644) << 16  # regular file + mode
    wheel.writestr(info, data, zipfile.ZIP_DEFLATED)


def _read(path):
    with open(path, "rb") as f:
        return f.read()


# ---- PEP 517 / PEP 660 hooks

def get_requires_for_build_wheel(config_settings=None):
    return []


get_requires_for_build_sdist = get_requires_for_build_editable = get_requires_for_build_wheel


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    project = _project()
    for name, data in _dist_info_files(project).items():
        os.makedirs(os.path.join(metadata_directory, os.path.dirname(name)), exist_ok=True)
        with open(os.path.join(metadata_directory, name), "wb") as f:
            f.write(data)
    return _names(project)[0] + ".dist-info"


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    library = _ensure_library()
    platform = _platform_tag(library)
    files = _dist_info_files(project, platform)
    for directory, subdirs, names in os.walk(os.path.join(ROOT, "pymsda")):
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        for path in [os.path.join(directory, n) for n in names if n.endswith((".py", ".json"))]:
            if path != os.path.abspath(__file__):
                files[os.path.relpath(path, ROOT).replace(os.sep, "/")] = _read(path)
    files["pymsda/" + LIBRARY] = _read(library)
    return _write_wheel(wheel_directory, project, files, platform)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    # A .pth line puts the source root on sys.path; the package's loader then finds build/libpymsda.so.
    project = _project()
    files = _dist_info_files(project)
    files["__editable__.%s.pth" % _names(project)[0]] = (ROOT + "\n").encode("utf-8")
    return _write_wheel(wheel_directory, project, files)


def build_sdist(sdist_directory, config_settings=None):
    project = _project()
    base = _names(project)[0]
    try:  # tracked and not-ignored files when this is a git checkout, else everything under SDIST_PATHS
        names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--"] + SDIST_PATHS, cwd=ROOT,
                               check=True, capture_output=True, text=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        names = []
    if not names:
        names = [p for p in SDIST_PATHS if os.path.isfile(os.path.join(ROOT, p))]
        for top in SDIST_PATHS:
            for directory, _, files in os.walk(os.path.join(ROOT, top)):
                names += [os.path.relpath(os.path.join(directory, n), ROOT) for n in files]
    names = sorted(n.replace(os.sep, "/") for n in set(names) if not EXCLUDED.search(n.replace(os.sep, "/")))
    path = os.path.join(sdist_directory, base + ".tar.gz")
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            if os.path.isfile(os.path.join(ROOT, name)):
                tar.add(os.path.join(ROOT, name), arcname=base + "/" + name, filter=_anonymous)
        pkg_info = _metadata(project).encode("utf-8")
        info = _anonymous(tarfile.TarInfo(base + "/PKG-INFO"))
        info.size, info.mode, info.mtime = len(pkg_info), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(pkg_info))
    return os.path.basename(path)


def _anonymous(info):
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
