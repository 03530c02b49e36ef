"""The OpenMP runtime of the CPU kernels (c/omp_runtime.c): the library defines, hidden, the
OpenMP entry points its compiled pragmas call and binds them at the first parallel call to the
runtime already in the process (torch's), else to the system's libgomp.so.1, else to one thread.

- the kernels' objects need exactly the entry points c/omp_runtime.c defines (a new pragma that
  needs another one fails here, before a library that cannot load ships);
- with torch: one OpenMP runtime mapped in the process, and it is the one the kernels use;
- without torch (torch made unimportable in a fresh process): `import pymsda` works,
  pymsda.library_path() loads in ONNX Runtime, the op runs on threads of the system's libgomp,
  and the torch-only attributes raise ImportError naming `pip install torch`."""
import ctypes.util
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import pymsda
from pymsda import _clib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def defined_entry_points():
    with open(os.path.join(REPO, "c", "omp_runtime.c")) as f:
        source = f.read()
    table = re.search(r"entry_names\[\] = \{(.*?)\};", source, re.S).group(1)
    return set(re.findall(r'"(\w+)"', table))


def test_kernel_objects_need_exactly_the_entry_points_the_library_defines():
    objects = [os.path.join(REPO, "build", name + ".o")
               for name in ("cpu_plain", "cpu_options", "msda", "ort_op")]
    if not all(os.path.exists(o) for o in objects) or shutil.which("nm") is None:
        pytest.skip("needs a source checkout's build/ objects and nm")
    needed = set()
    for obj in objects:
        undefined = subprocess.run(["nm", "-u", obj], capture_output=True, text=True,
                                   check=True).stdout
        needed |= set(re.findall(r"\b((?:GOMP|omp)_\w+)", undefined))
    assert needed == defined_entry_points()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_with_torch_and_the_kernels_use_it(generator):
    import torch
    value = torch.randn(2, 500, 4, 32, generator=generator)
    loc = torch.rand(2, 300, 4, 2, 4, 2, generator=generator)
    attn = torch.rand(2, 300, 4, 2, 4, generator=generator)
    pymsda.ms_deform_attn(value, [(20, 20), (10, 10)], None, loc, attn)  # a parallel call
    used = _clib.lib.msda_openmp_runtime().decode()
    with open("/proc/self/maps") as maps:
        mapped = {os.path.realpath(line.split()[-1]) for line in maps
                  if re.search(r"/lib(gomp|omp|iomp5)[^/]*\.so", line)}
    assert used and len(mapped) == 1 and os.path.realpath(used) in mapped, (used, mapped)


NO_TORCH = textwrap.dedent("""
    import re
    import sys
    sys.modules["torch"] = None  # as if torch were not installed
    sys.path.insert(0, {tests!r})
    import numpy as np
    import pymsda
    from onnx_node import oracle_of, random_inputs, rel_l2, session
    try:
        pymsda.ms_deform_attn
    except ImportError as error:
        assert "pip install torch" in str(error), error
    else:
        raise AssertionError("pymsda.ms_deform_attn without torch")
    feed = random_inputs(np.random.default_rng(1), 2, 300, [(20, 20), (10, 10)], heads=4,
                         channels=32, points=4)
    sess = session(open(sys.argv[1], "rb").read(), pymsda.library_path(), threads=2)
    assert rel_l2(sess.run(None, feed)[0], oracle_of(feed)) < 1e-6
    libraries = {{line.split()[-1] for line in open("/proc/self/maps") if ".so" in line}}
    assert not [p for p in libraries if re.search(r"/torch/lib/|libtorch|libc10", p)], libraries
    print("runtime", pymsda._clib.lib.msda_openmp_runtime().decode())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_without_torch_the_library_loads_in_onnx_runtime_and_runs_on_threads(tmp_path):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx_node import node_model
    model = tmp_path / "node.onnx"
    model.write_bytes(node_model().SerializeToString())
    env = dict(os.environ, PYMSDA_LIBRARY=pymsda.library_path(),
               PYTHONPATH=os.path.dirname(os.path.dirname(pymsda.__file__)))
    done = subprocess.run([sys.executable, "-c", NO_TORCH.format(tests=TESTS), str(model)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    runtime = done.stdout.split("runtime", 1)[1].strip()
    # the system's GNU runtime when it is installed (a threaded run), else none (one thread)
    if ctypes.util.find_library("gomp"):
        assert os.path.basename(runtime).startswith("libgomp"), runtime
    else:
        assert runtime == "", runtime
