"""tests/matrix.py: one wheel, many PyTorch and Python versions; the compatibility matrix.

Builds the wheel once (`make wheel`; or takes the one --wheel names), then for each environment
asked for creates a fresh virtual environment, installs that torch, numpy and pytest, installs
the wheel with `pip install --no-deps --no-index` (nothing is compiled, nothing rebuilt) and runs
the test suite from a folder where the source checkout is not importable, so the tests exercise
the installed wheel (tests/conftest.py refuses to run otherwise). The tests run from a copy of
tests/ (and the sources they read) taken with the wheel, so both are of one moment of the
checkout. Prints a table and exits nonzero if any environment failed.

    python tests/matrix.py                                   # 2.13.0 2.14.1 debian 1.13.1@3.8
    python tests/matrix.py --torch 2.13.0 --wheel dist/pymsda-0.1.0-py3-none-manylinux_2_28_x86_64.whl
    python tests/matrix.py --torch 1.13.1@3.8                # torch from pip for pyenv's 3.8
    python tests/matrix.py --here --wheel dist/pymsda-*.whl  # this python, no venv, no registry

Environments (--torch):
    VERSION          pip's torch==VERSION in a venv of the Python running this script
    VERSION@X.Y      the same for Python X.Y (pyenv's, or pythonX.Y on the PATH)
    debian           Debian's python3-torch for /usr/bin/python3 (apt-get installs it when missing,
                     as root): a venv with --system-site-packages, pytest from Debian too
--here: the Python running this script as it is (a GPU machine with its own torch and no package
registry): the wheel goes into a temporary folder with `pip install --target` and on PYTHONPATH.
"""
import argparse
import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The lowest supported versions (pyproject.toml: Python 3.8, torch 1.13) are among them.
DEFAULT_ENVS = ["2.13.0", "2.14.1", "debian", "1.13.1@3.8"]
DEBIAN_PYTHON = "/usr/bin/python3"
DEBIAN_PACKAGES = ["python3-torch", "python3-pytest", "python3-venv"]

# Run by each environment's python from a scratch folder: what it imports, and from where.
PROBE = r"""
import json, platform, torch, pymsda
device = "cpu"
if torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability(0)
    device = "%s (sm_%d%d)" % (torch.cuda.get_device_name(0), major, minor)
    if not pymsda.has_cuda():
        device += ", library without CUDA kernels"
elif torch.version.cuda:
    device = "cpu (torch built for CUDA %s, no GPU)" % torch.version.cuda
print(json.dumps({"torch": torch.__version__, "python": platform.python_version(),
                  "device": device, "package": pymsda.__file__,
                  "library": pymsda.library_path()}))
"""


def log(message):
    print("[matrix %s] %s" % (time.strftime("%H:%M:%S"), message), flush=True)


def run(command, log_file=None, **kwargs):
    """Runs command; its output goes to log_file (appended) or is returned. Raises on failure
    with the last lines of the output."""
    text = " ".join(command)
    if log_file:
        with open(log_file, "a") as f:
            f.write("\n$ %s\n" % text)
            f.flush()
            done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, text=True, **kwargs)
        if done.returncode != 0:
            with open(log_file) as f:
                tail = "".join(f.readlines()[-15:])
            raise RuntimeError("`%s` exited %d; end of %s:\n%s" % (text, done.returncode, log_file, tail))
        return None
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError("`%s` exited %d:\n%s" % (text, done.returncode, (done.stdout + done.stderr)[-3000:]))
    return done.stdout


def clean_env(extra_path=None):
    """The environment for a test run: nothing that would point pymsda at another library or
    package than the installed one."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYMSDA_LIBRARY", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    if extra_path:
        env["PYTHONPATH"] = extra_path
    env["PYMSDA_TEST_INSTALLED"] = "1"  # tests/conftest.py: refuse a pymsda from the source tree
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # keep the checkout's tests/ free of other Pythons' caches
    return env


def version_tuple(text):
    return tuple(int(n) for n in re.findall(r"\d+", text)[:3])


def git_state():
    """Short commit, plus ' with uncommitted changes' when the tree differs from it."""
    try:
        commit = run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"]).strip()
        dirty = run(["git", "-C", REPO, "status", "--porcelain"]).strip()
    except (OSError, RuntimeError):
        return "unknown (not a git checkout)"
    return commit + (" with uncommitted changes" if dirty else "")


# ---- the wheel -------------------------------------------------------------------------------

def build_wheel(args, out_dir):
    command = ["make", "--no-print-directory", "-C", REPO, "wheel", "BUILD=" + args.build_dir,
               "DIST=" + out_dir, "PYTHON=" + sys.executable] + args.make_args
    log("building the wheel: " + " ".join(command))
    output = run(command)
    built = re.findall(r"^built (\S+\.whl) in \d+ s$", output, re.M)
    if not built:
        raise RuntimeError("`make wheel` printed no 'built ...whl' line:\n" + output[-2000:])
    return os.path.abspath(built[-1])


def snapshot_sources(work):
    """A copy of the tests and the sources they read (c/msda.h, the headers they scan, pymsda/ for
    the wheel test), taken when the wheel is: the suite then matches the wheel even while the
    checkout keeps changing. pymsda/ is never importable from it (tests/conftest.py checks)."""
    root = os.path.join(work, "source")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o")
    for name in ("tests", "c", "kernels", "pymsda"):
        if os.path.isdir(os.path.join(REPO, name)):
            shutil.copytree(os.path.join(REPO, name), os.path.join(root, name), ignore=ignore)
    for name in ("pyproject.toml", "README.md", "Makefile"):
        if os.path.isfile(os.path.join(REPO, name)):
            shutil.copy2(os.path.join(REPO, name), root)
    return root


# ---- environments ----------------------------------------------------------------------------

def find_python(version):
    """An interpreter of Python `version` (X.Y): pyenv's installs first, then pythonX.Y."""
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/%s.*/bin/python" % version)),
                        key=version_tuple, reverse=True)
    if shutil.which("python" + version):
        candidates.append(shutil.which("python" + version))
    for python in candidates:
        try:
            reported = run([python, "-c", "import platform; print(platform.python_version())"])
        except (OSError, RuntimeError):
            continue  # e.g. a pyenv shim of a version that is not active
        if reported.startswith(version + "."):
            return python
    raise RuntimeError("no Python %s found (pyenv install %s, or put python%s on the PATH)"
                       % (version, version, version))


def ensure_debian_torch(log_file):
    try:
        run([DEBIAN_PYTHON, "-c", "import torch, numpy, pytest, venv"])
        return
    except (OSError, RuntimeError):
        pass
    if not shutil.which("apt-get") or os.geteuid() != 0:
        raise RuntimeError("%s cannot import torch, numpy and pytest: run `apt-get install -y %s` "
                           "as root first" % (DEBIAN_PYTHON, " ".join(DEBIAN_PACKAGES)))
    log("apt-get install -y " + " ".join(DEBIAN_PACKAGES))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "install", "-y", "--no-install-recommends"] + DEBIAN_PACKAGES, log_file, env=env)


def create_env(spec, venv_root, reuse, log_file, requirements=None):
    """A venv for spec with torch, numpy and pytest in it (and the requirements file given, with
    torch held at spec's version); returns its python."""
    slug = re.sub(r"[^\w.]+", "-", spec)
    venv = os.path.join(venv_root, slug)
    python = os.path.join(venv, "bin", "python")
    if spec == "debian":
        ensure_debian_torch(log_file)
        base, packages, venv_options = DEBIAN_PYTHON, [], ["--system-site-packages"]
    else:
        torch_version, _, python_version = spec.partition("@")
        base = find_python(python_version) if python_version else sys.executable
        # torch releases before 2.4 were built against NumPy 1 and cannot import NumPy 2.
        numpy = "numpy<2" if version_tuple(torch_version) < (2, 4) else "numpy"
        packages, venv_options = ["torch==" + torch_version, numpy, "pytest"], []
        if version_tuple(torch_version) >= (2, 4):  # the export tests' onnx, onnxruntime, ...
            packages += ["-r", os.path.join(REPO, "tests", "requirements-export.txt")]
    if reuse and os.path.exists(python):
        log("%s: reusing %s" % (spec, venv))
        return python
    shutil.rmtree(venv, ignore_errors=True)
    log("%s: creating %s from %s" % (spec, venv, base))
    run([base, "-m", "venv"] + venv_options + [venv], log_file)
    if packages:
        log("%s: pip install %s" % (spec, " ".join(packages)))
        run([python, "-m", "pip", "install", "--quiet"] + packages, log_file)
    if requirements:
        constraints = os.path.join(venv, "torch-constraint.txt")
        with open(constraints, "w") as f:
            f.write("torch==%s\n" % spec.partition("@")[0])
        log("%s: pip install -r %s" % (spec, requirements))
        start = time.time()
        run([python, "-m", "pip", "install", "--quiet", "-c", constraints, "-r", requirements],
            log_file)
        log("%s: requirements installed in %.0f s" % (spec, time.time() - start))
    return python


def install_wheel(python, wheel, log_file, target=None):
    """pip installs the wheel without looking at any index; no dependency, nothing compiled.
    With target, into that folder (for --here) instead of the environment."""
    command = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
               "--force-reinstall", "--disable-pip-version-check"]
    if target:
        command += ["--target", target]
    try:
        run(command + [wheel], log_file)
    except RuntimeError:
        if not target:
            raise
        import zipfile  # no pip in this python: a wheel is a zip archive of the installed tree
        log("pip could not install into %s; unpacking the wheel there instead" % target)
        zipfile.ZipFile(wheel).extractall(target)


def parse_summary(output):
    """Counts from pytest's last line, e.g. '164 passed, 119 skipped, 1 error in 17.72s'."""
    lines = [l for l in output.splitlines() if re.search(r"\bin [\d.]+s\b", l)
             and re.search(r"\d+ (passed|failed|skipped|errors?|no tests ran)", l)]
    if not lines:
        return None
    counts = {"passed": 0, "skipped": 0, "failed": 0, "error": 0, "xfailed": 0, "xpassed": 0}
    for number, word in re.findall(r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed)", lines[-1]):
        counts["error" if word.startswith("error") else word] += int(number)
    return counts


def new_row(name, problem=None):
    return {"env": name, "torch": "?", "python": "?", "device": "?", "self_check": "?",
            "passed": 0, "skipped": 0, "failed": 0, "error": 0, "seconds": 0.0,
            "problem": problem and str(problem).strip().splitlines()[0][:200]}


def run_suite(name, python, args, log_file, sources, extra_path=None):
    """Probe, self-check and the test suite in one environment; returns a result row."""
    row = new_row(name)
    scratch = tempfile.mkdtemp(prefix="pymsda-matrix-cwd-")  # the checkout is not on sys.path here
    env = clean_env(extra_path)
    try:
        probe = json.loads(run([python, "-c", PROBE], cwd=scratch, env=env).strip().splitlines()[-1])
        row.update({k: probe[k] for k in ("torch", "python", "device")})
        for key in ("package", "library"):
            if any(os.path.realpath(probe[key]).startswith(os.path.realpath(tree) + os.sep)
                   for tree in (REPO, sources)):
                raise RuntimeError("pymsda's %s came from the source checkout (%s), not from the wheel"
                                   % (key, probe[key]))
        log("%s: torch %s, Python %s, %s; pymsda from %s" % (name, row["torch"], row["python"],
                                                             row["device"], probe["package"]))
        check = subprocess.run([python, "-m", "pymsda"], cwd=scratch, env=env, capture_output=True,
                               text=True, timeout=600)
        with open(log_file, "a") as f:
            f.write("\n$ python -m pymsda\n" + check.stdout + check.stderr)
        row["self_check"] = "pass" if check.returncode == 0 else "FAIL"
        command = [python, "-m", "pytest", os.path.join(sources, "tests"), "-q", "-p", "no:cacheprovider",
                   "-rfEs"] + args.pytest_args
        log("%s: %s" % (name, " ".join(command[1:])))
        start = time.time()
        with open(log_file, "a") as f:  # streamed: `tail -f` the log to follow a long run
            f.write("\n$ %s\n" % " ".join(command))
            offset = f.tell()
            f.flush()
            done = subprocess.run(command, cwd=scratch, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=args.timeout)
        row["seconds"] = round(time.time() - start, 1)
        with open(log_file) as f:
            f.seek(offset)
            counts = parse_summary(f.read())
        if counts is None:
            raise RuntimeError("pytest exited %d without a summary line; see %s" % (done.returncode, log_file))
        row.update(counts)
        if done.returncode not in (0, 1):
            row["problem"] = "pytest exited %d" % done.returncode
    except (OSError, RuntimeError, subprocess.TimeoutExpired, ValueError) as error:
        row["problem"] = str(error).strip().splitlines()[0][:200]
        log("%s: %s" % (name, error))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return row


def failed(row):
    return bool(row["problem"] or row["failed"] or row["error"] or row["self_check"] != "pass"
                or row["passed"] == 0)


# ---- report ----------------------------------------------------------------------------------

COLUMNS = [("env", "env"), ("torch", "torch"), ("python", "Python"), ("device", "device"),
           ("self_check", "self-check"), ("passed", "passed"), ("skipped", "skipped"),
           ("failed", "failed"), ("error", "errors"), ("seconds", "seconds")]


def format_table(rows):
    cells = [[title for _, title in COLUMNS]] + [[str(r[key]) for key, _ in COLUMNS] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r["problem"]:
            lines.append("%s: %s" % (r["env"], r["problem"]))
    return "\n".join(lines)


def format_markdown(rows, meta):
    """Rows for docs/build.md's "Tested with" table."""
    lines = []
    for r in rows:
        result = "%d passed, %d skipped, %d failed" % (r["passed"], r["skipped"], r["failed"] + r["error"])
        if r["problem"]:
            result += " (%s)" % r["problem"]
        torch = r["torch"] + (" (Debian)" if r["env"] == "debian" else "")
        lines.append("| %s | %s | %s | %s | %s, %s |" % (
            torch, r["python"], r["device"], result, meta["date"], meta["commit"]))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python tests/matrix.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch", nargs="+", default=None, metavar="SPEC",
                        help="environments: VERSION, VERSION@X.Y or debian (default: %s)"
                        % " ".join(DEFAULT_ENVS))
    parser.add_argument("--here", action="store_true",
                        help="test the Python running this script as it is (no venv, no registry)")
    parser.add_argument("--wheel", help="an existing wheel to test (default: build one with make wheel)")
    parser.add_argument("--build-dir", default="build", help="the Makefile's BUILD folder (default build)")
    parser.add_argument("--make-args", nargs="*", default=[], metavar="ARG",
                        help="extra make arguments for the wheel, e.g. CUDA_ARCHS=90")
    parser.add_argument("--venv-dir", help="where the venvs go (default: a temporary folder, removed after)")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse venvs already in --venv-dir (a quick re-run; not a fresh matrix)")
    parser.add_argument("--requirements", action="append", default=[], metavar="SPEC=FILE",
                        help="also pip install -r FILE into environment SPEC (torch held at its "
                        "version), e.g. 2.14.1=tests/requirements-clients-torchvision.txt")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for one test suite run")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--markdown", action="store_true", help="also print rows for docs/build.md's table")
    parser.add_argument("--commit", help="the commit to report (default: git rev-parse --short HEAD, "
                        "'with uncommitted changes' when the tree differs), e.g. on a copy without .git")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    specs = [] if args.here and args.torch is None else (args.torch or DEFAULT_ENVS)
    requirements = dict(item.split("=", 1) for item in args.requirements)
    requirements = {spec: os.path.abspath(path) for spec, path in requirements.items()}

    started = time.time()
    work = tempfile.mkdtemp(prefix="pymsda-matrix-")
    venv_root = os.path.abspath(args.venv_dir) if args.venv_dir else os.path.join(work, "venvs")
    os.makedirs(venv_root, exist_ok=True)
    wheel = os.path.abspath(args.wheel) if args.wheel else build_wheel(args, os.path.join(work, "dist"))
    sources = snapshot_sources(work)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "commit": args.commit or git_state(), "wheel": os.path.basename(wheel)}
    log("wheel: %s; commit %s; logs in %s" % (wheel, meta["commit"], work))

    rows = []
    if args.here:
        log_file = os.path.join(work, "here.log")
        target = os.path.join(work, "here-site")
        try:
            install_wheel(sys.executable, wheel, log_file, target)
            rows.append(run_suite("here", sys.executable, args, log_file, sources, extra_path=target))
        except (OSError, RuntimeError) as error:
            rows.append(new_row("here", error))
    for spec in specs:
        log_file = os.path.join(work, re.sub(r"[^\w.]+", "-", spec) + ".log")
        try:
            python = create_env(spec, venv_root, args.reuse, log_file, requirements.get(spec))
            install_wheel(python, wheel, log_file)
        except (OSError, RuntimeError) as error:
            log("%s: %s" % (spec, error))
            rows.append(new_row(spec, error))
            continue
        rows.append(run_suite(spec, python, args, log_file, sources))

    print()
    print("pymsda compatibility matrix, %s, commit %s, wheel %s (%.0f s in all)"
          % (meta["date"], meta["commit"], meta["wheel"], time.time() - started))
    print(format_table(rows))
    if args.markdown:
        print()
        print(format_markdown(rows, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"metadata": meta, "rows": rows}, f, indent=1)
    if not args.venv_dir:
        shutil.rmtree(venv_root, ignore_errors=True)
    print("logs: %s" % work)
    return 1 if any(failed(r) for r in rows) or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
