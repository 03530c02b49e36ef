# Makefile: builds build/libpymsda.so, the C/CUDA library pymsda loads with ctypes.
#   make                   what this machine can use, said in one line when the build starts: CPU
#                          kernels always; CUDA kernels when nvcc is found (the PATH, the usual
#                          toolkit folders, or pip's CUDA compiler: make info) and either a GPU is
#                          visible (built for the GPUs here) or $(PYTHON)'s torch is a CUDA build
#                          (built for the default GPU list below); on every core unless -j is given
#   make MSDA_CUDA=1       CUDA kernels even where nothing here can run them (a container build with
#                          no GPU visible): for the GPUs here, else the default list
#   make CUDA_ARCHS=90     CUDA kernels for one GPU architecture (a list: "80 90"); CUDA_ARCHS=default
#                          for the default list, CUDA_ARCHS=all for every architecture from sm_75
#                          this nvcc knows (release wheels)
#   make MSDA_CUDA=0       force a CPU-only build
#   make wheel             dist/pymsda-<version>-py3-none-<platform>.whl with the library inside:
#                          manylinux_2_28 with zig's linker (pip install ziglang), see below
#   make info | test | clean;  V=1 prints the compiler commands
# A build folder remembers the MSDA_CUDA, CUDA_ARCHS and CUDA_PTX it was made with: a later
# `make`, `make test` or `make wheel` that names none of them uses it as it is, instead of
# rebuilding it for the defaults; naming one (or `make clean`) chooses anew. A CPU-only build that
# the machine chose (no nvcc, or no GPU and no CUDA torch) is not remembered: a later `make` looks
# again, so the CUDA kernels come once something here can use them.
# No torch, ATen, c10 or pybind11 header is used: the library does not depend on any PyTorch or
# Python version. cudart is linked statically, so the .so needs only the driver (libcuda).

# Every core unless the command line says -j (nvcc's --threads 0 also compiles the architectures
# of one file in parallel); a sub-make shares its parent's jobs.
ifeq ($(filter -j%,$(MAKEFLAGS))$(filter-out 0,$(MAKELEVEL)),)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 1)
endif
ifneq ($(filter clean,$(MAKECMDGOALS)),)
.NOTPARALLEL:  # `make clean all` cleans first
endif

BUILD    ?= build
LIB      := $(BUILD)/libpymsda.so
PYTHON   ?= python3

CC       ?= cc
CXX      ?= c++
# CFLAGS, NVCCFLAGS and LDFLAGS are the user's (optimisation, extra -D); what the build needs is
# added in ALL_* so that `make CFLAGS=...` cannot drop it.
CFLAGS   ?= -O3
# CPU kernels: a*b + c may fuse into one FMA (ISO C mode would forbid it); no code reads the FP
# exception flags, so comparisons may be if-converted (-fno-trapping-math: the geometry loops
# vectorise); GCC's unroll-and-jam is off because it pairs the corners of the gather loop and then
# leaves its channel loop scalar (2x slower).
CPU_OPT_FLAGS := -ffp-contract=fast -fno-trapping-math $(shell $(CC) -fno-loop-unroll-and-jam -Werror -x c -c /dev/null -o /dev/null 2>/dev/null && echo -fno-loop-unroll-and-jam)
ALL_CFLAGS  = $(CFLAGS) -std=c11 $(CPU_OPT_FLAGS) -fPIC -fvisibility=hidden -fopenmp -Wall -Wextra -Wno-unused-parameter
# No OpenMP library is linked: c/omp_runtime.c finds the process's runtime when first needed
# (libdl for dlopen on glibc before 2.34).
ALL_LDFLAGS = $(LDFLAGS) -ldl

# ---- what an earlier build of this folder chose -----------------------------------------------
# (restored only when the user names none of the three, on the command line or in the environment)
# A CPU-only build that the machine chose (no nvcc; no GPU and no CUDA torch) is no choice: it is
# remembered as MSDA_CUDA empty, and a later `make` looks again.
-include $(BUILD)/choice.mk
named := $(foreach v,MSDA_CUDA CUDA_ARCHS CUDA_PTX,$(filter command environment,$(firstword $(origin $(v)))))
given := $(foreach v,MSDA_CUDA CUDA_ARCHS CUDA_PTX,$(if $(filter command environment,$(firstword $(origin $(v)))),$(v)=$($(v))))
ifeq ($(strip $(named)),)
restore := $(REMEMBERED_MSDA_CUDA)
ifneq ($(restore),)
MSDA_CUDA := $(REMEMBERED_MSDA_CUDA)
CUDA_ARCHS := $(REMEMBERED_CUDA_ARCHS)
CUDA_PTX := $(REMEMBERED_CUDA_PTX)
endif
endif
START := $(shell date +%s)

# ---- CUDA detection ----------------------------------------------------------------------------
# nvcc: NVCC as given, else the PATH's, else the first of NVCC_FOLDERS, else the CUDA compiler pip
# installs into $(PYTHON)'s environment (layout nvidia/cu13/{bin,include,lib}; `make info` says
# the pip command). pip has no CUDA 12 compiler: nvidia-cuda-nvcc-cu12 holds ptxas and libnvvm only.
NVCC_FOLDERS ?= /usr/local/cuda/bin $(lastword $(sort $(wildcard /usr/local/cuda-*/bin))) /opt/cuda/bin
PIP_NVCC_PY := import glob, os, sys; found = [p for d in sys.path if d for p in sorted(glob.glob(\
    os.path.join(d, "nvidia", "cu*", "bin", "nvcc")), reverse=True) if os.access(p, os.X_OK)]; \
    print(found[0] if found else "")
ifeq ($(origin NVCC),undefined)
NVCC := $(or $(shell command -v nvcc 2>/dev/null),$(firstword $(wildcard $(addsuffix /nvcc,$(NVCC_FOLDERS)))),$(shell $(PYTHON) -c '$(PIP_NVCC_PY)' 2>/dev/null))
endif

# What this machine can use, when MSDA_CUDA is neither named nor remembered (nor implied by a named
# CUDA_ARCHS). A GPU: nvidia-smi's compute capabilities, or a /dev/nvidia<N> (a GPU of unknown
# kind: the default list). A CUDA torch: $(PYTHON)'s torch/version.py names a CUDA version (read,
# not imported: importing torch takes seconds). Neither: a CPU-only build, which no GPU here could
# serve faster, in a fraction of the CUDA build's minutes.
GPU_QUERY   ?= nvidia-smi --query-gpu=compute_cap --format=csv,noheader
GPU_DEVICES ?= $(wildcard /dev/nvidia[0-9]*)
gpu_caps     = $(shell { $(GPU_QUERY); } 2>/dev/null | sed -n 's/^ *\([0-9]*\)\.\([0-9]\) *$$/\1\2/p' | sort -nu)
# "<torch version> <its CUDA version>", "<torch version>" for a CPU build, nothing without torch
TORCH_BUILD_PY := import importlib.util as u, os, re; s = u.find_spec("torch"); \
    f = os.path.join(s.submodule_search_locations[0], "version.py") if s else ""; \
    t = open(f).read() if os.path.isfile(f) else ""; \
    v = (re.findall(r"^__version__\s*=\s*[\x22\x27]([^\x22\x27]+)", t, re.M) + [""])[0]; \
    c = (re.findall(r"^cuda\b[^=\n]*=\s*[\x22\x27]([\d.]+)", t, re.M) + [""])[0]; \
    print(v, c)
torch_build  = $(shell $(PYTHON) -c '$(TORCH_BUILD_PY)' 2>/dev/null)
ifeq ($(origin MSDA_CUDA),undefined)
ifeq ($(NVCC),)
MSDA_CUDA := 0
NVCC_MISSING := 1
else ifneq ($(strip $(CUDA_ARCHS)),)
MSDA_CUDA := 1
else
GPU_CAPS := $(gpu_caps)
GPU_SEEN := $(strip $(GPU_CAPS) $(GPU_DEVICES))
TORCH_BUILD := $(if $(GPU_SEEN),,$(torch_build))
MSDA_CUDA := $(if $(GPU_SEEN)$(word 2,$(TORCH_BUILD)),1,0)
MACHINE_CPU_ONLY := $(if $(filter 0,$(MSDA_CUDA)),1)
endif
endif
ifeq ($(NVCC)$(origin TORCH_BUILD),undefined)
TORCH_BUILD := $(torch_build)
endif
NVCC_VERSION := $(if $(NVCC),$(shell $(NVCC) --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))

ifeq ($(MSDA_CUDA),1)
# nvcc may be a wrapper script: ask it where its toolkit lives.
CUDA_HOME   ?= $(realpath $(shell $(NVCC) --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$$ TOP=//p'))
NVCC_ARCHS  := $(shell $(NVCC) --list-gpu-arch 2>/dev/null | sed -n 's/^compute_\([0-9]*\)$$/\1/p' | awk '$$1 >= 75' | sort -n | tr '\n' ' ')
# The default GPU code: machine code for each distinct GPU generation people run MSDA on, since
# machine code of X.Y runs on every X.Z with Z >= Y: 75 (T4, RTX 20), 80 (A100, A30), 86 (RTX 30,
# A10, A40; also runs on 87 Orin and 89 Ada: L4, L40, RTX 40), 90 (H100, H200), 100 (B200; also
# B300's 103), 120 (RTX 50, RTX PRO; also GB10's 121). PTX of compute_90, the newest feature
# level the kernels use (half-precision vector reductions, programmatic launch), which the driver
# compiles at first use for every newer GPU: sm_110 (Jetson Thor), which no machine code above
# serves, and GPUs newer than the list. Architectures this nvcc does not know are left out.
DEFAULT_ARCHS := 75 80 86 90 100 120
DEFAULT_PTX   := 90
ifeq ($(strip $(CUDA_ARCHS)),all)
override CUDA_ARCHS := $(NVCC_ARCHS)
else ifeq ($(strip $(CUDA_ARCHS)),default)
override CUDA_ARCHS := $(filter $(NVCC_ARCHS),$(DEFAULT_ARCHS))
endif
# None named: the GPUs here when this nvcc knows each of them, else the default list.
ifeq ($(strip $(CUDA_ARCHS)),)
ifeq ($(origin GPU_CAPS),undefined)
GPU_CAPS := $(gpu_caps)
endif
ifneq ($(GPU_CAPS),)
ifeq ($(filter-out $(NVCC_ARCHS),$(GPU_CAPS)),)
override CUDA_ARCHS := $(GPU_CAPS)
ARCHS_WHY := for the GPU$(if $(word 2,$(GPU_CAPS)),s) here only; CUDA_ARCHS=default for every GPU generation
else
ARCHS_WHY := the default list: sm_$(firstword $(filter-out $(NVCC_ARCHS),$(GPU_CAPS))) (the GPU here) is not among this nvcc's targets from sm_75
endif
endif
endif
ifeq ($(strip $(CUDA_ARCHS)),)
override CUDA_ARCHS := $(filter $(NVCC_ARCHS),$(DEFAULT_ARCHS))
ARCHS_WHY ?= the default list, minutes; CUDA_ARCHS=90 builds one architecture
endif
# PTX: the default's with the default list, else that of the newest architecture named.
ifeq ($(CUDA_ARCHS),$(filter $(NVCC_ARCHS),$(DEFAULT_ARCHS)))
CUDA_PTX    ?= $(DEFAULT_PTX)
endif
CUDA_PTX    ?= $(shell echo $(CUDA_ARCHS) | tr ' ' '\n' | sort -n | tail -n 1)
GENCODE     := $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(a),code=sm_$(a)) \
               -gencode=arch=compute_$(CUDA_PTX),code=compute_$(CUDA_PTX)
ARCH_LIST   := $(strip $(foreach a,$(CUDA_ARCHS),sm_$(a)) compute_$(CUDA_PTX))
NVCCFLAGS   ?= -O3
ALL_NVCCFLAGS = $(NVCCFLAGS) -std=c++17 --threads 0 -Xcompiler -fPIC,-fvisibility=hidden \
               $(GENCODE) -DMSDA_CUDA_ARCHS='"$(ARCH_LIST)"'
# The kernels' instances: kernels/instances/{forward,backward}.cu compiled once per row of
# c/dtypes.h (its suffixes: f32 f64 f16 bf16), so a new dtype's row needs no file here.
DTYPE_SUFFIXES := $(shell sed -n 's/^.define MSDA_DTYPE_[0-9]*.X. X.[A-Z0-9_]*, *\([a-z0-9_]*\),.*/\1/p' c/dtypes.h)
CUDA_OBJS   := $(patsubst kernels/%.cu,$(BUILD)/%.o,$(wildcard kernels/*.cu)) \
               $(foreach p,forward backward,$(foreach s,$(DTYPE_SUFFIXES),$(BUILD)/instances/$(p)_$(s).o))
# Static cudart: a toolkit's lib64 or targets/x86_64-linux/lib, pip's nvidia/cu13/lib.
CUDA_LIBDIRS := $(wildcard $(addprefix $(CUDA_HOME)/,lib64 targets/x86_64-linux/lib lib))
CUDA_LIBS   := $(addprefix -L,$(CUDA_LIBDIRS)) -lcudart_static -lrt -ldl -lpthread
else
CUDA_OBJS   := $(BUILD)/cuda_stub.o
CUDA_LIBS   :=
endif

# Why the build has CUDA kernels or not: the line the build starts with, and `make info`.
TORCH_VERSION := $(word 1,$(TORCH_BUILD))
TORCH_CUDA    := $(word 2,$(TORCH_BUILD))
ifneq ($(restore),)
CUDA_WHY := $(if $(filter 1,$(MSDA_CUDA)),,MSDA_CUDA=0 )remembered in $(BUILD)/choice.mk; naming MSDA_CUDA or CUDA_ARCHS, or make clean, chooses anew
else ifneq ($(NVCC_MISSING),)
CUDA_WHY := nvcc not found: make info says how to get it
else ifneq ($(MACHINE_CPU_ONLY),)
CUDA_WHY := no GPU visible, and $(if $(TORCH_VERSION),torch $(TORCH_VERSION) has no CUDA,no torch in $(PYTHON)): make MSDA_CUDA=1 builds them too, for the default GPU list (minutes)
else ifneq ($(strip $(given)),)
CUDA_WHY := $(strip $(given))$(if $(ARCHS_WHY),: $(ARCHS_WHY))
else ifneq ($(GPU_SEEN),)
CUDA_WHY := a GPU is visible: $(ARCHS_WHY)
else
CUDA_WHY := no GPU visible, but torch $(TORCH_VERSION) is a CUDA $(TORCH_CUDA) build: $(ARCHS_WHY)
endif

comma := ,

# Quiet commands unless V=1: one line a file says what is compiled.
ifeq ($(V),1)
Q :=
say = @true
else
Q := @
say = @echo "  $(1)"
endif

# omp_runtime: the OpenMP entry points the kernels call, bound to the runtime found at run time;
# ort_op, ort_cuda: ONNX Runtime's op (RegisterCustomOps, exported beside msda_*).
C_OBJS := $(BUILD)/msda.o $(BUILD)/routes.o $(BUILD)/cpu_plain.o $(BUILD)/cpu_options.o \
          $(BUILD)/omp_runtime.o $(BUILD)/ort_op.o $(BUILD)/ort_cuda.o

# ---- targets -----------------------------------------------------------------------------------
.PHONY: all info test test-c clean
all: $(LIB)

$(BUILD):
	@mkdir -p $(BUILD)

# The flags a build used are kept in build/config so changing them (CUDA_ARCHS, MSDA_CUDA)
# rebuilds; build/choice.mk remembers the choices for later runs (see the top).
CONFIG := $(CC) $(ALL_CFLAGS) | $(MSDA_CUDA) $(NVCC) $(CUDA_ARCHS) $(ALL_NVCCFLAGS)
$(BUILD)/config: FORCE | $(BUILD)
	@echo '$(CONFIG)' | cmp -s - $@ || echo '$(CONFIG)' > $@
	@printf 'REMEMBERED_MSDA_CUDA := %s\nREMEMBERED_CUDA_ARCHS := %s\nREMEMBERED_CUDA_PTX := %s\n' \
	    '$(if $(NVCC_MISSING)$(MACHINE_CPU_ONLY),,$(MSDA_CUDA))' '$(CUDA_ARCHS)' '$(CUDA_PTX)' > $(BUILD)/choice.mk
FORCE:

# Says what the build is about to compile (run before the first object, when any is stale).
$(BUILD)/started: $(wildcard c/*.c c/*.h c/*.inc kernels/*.cu kernels/*.cuh kernels/instances/*.cu) $(BUILD)/config | $(BUILD)
	@$(if $(filter 1,$(MSDA_CUDA)),$(if $(NVCC),,echo "MSDA_CUDA=1 (remembered in $(BUILD)/choice.mk?) but no nvcc found: see make info" && exit 1))
	@touch $@
	@echo "building $(LIB): C ($(CC))$(if $(filter 1,$(MSDA_CUDA)), and CUDA $(NVCC_VERSION) kernels for $(ARCH_LIST),$(comma) no CUDA kernels) ($(CUDA_WHY))"

$(BUILD)/%.o: c/%.c $(wildcard c/*.h c/*.inc) $(BUILD)/config | $(BUILD) $(BUILD)/started
	$(call say,CC    $<)
	$(Q)$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/%.o: kernels/%.cu $(wildcard kernels/*.cuh c/*.h) $(BUILD)/config | $(BUILD) $(BUILD)/started
	@mkdir -p $(dir $@)
	$(call say,NVCC  $< ($(words $(ARCH_LIST)) targets))
	$(Q)$(NVCC) $(ALL_NVCCFLAGS) -c $< -o $@

$(BUILD)/instances/forward_%.o: kernels/instances/forward.cu $(wildcard kernels/*.cuh c/*.h) $(BUILD)/config | $(BUILD) $(BUILD)/started
	@mkdir -p $(dir $@)
	$(call say,NVCC  $< for $* ($(words $(ARCH_LIST)) targets))
	$(Q)$(NVCC) $(ALL_NVCCFLAGS) -DMSDA_INSTANCE=$* -c $< -o $@
$(BUILD)/instances/backward_%.o: kernels/instances/backward.cu $(wildcard kernels/*.cuh c/*.h) $(BUILD)/config | $(BUILD) $(BUILD)/started
	@mkdir -p $(dir $@)
	$(call say,NVCC  $< for $* ($(words $(ARCH_LIST)) targets))
	$(Q)$(NVCC) $(ALL_NVCCFLAGS) -DMSDA_INSTANCE=$* -c $< -o $@

# Only the msda_* symbols and ONNX Runtime's RegisterCustomOps are exported; the static cudart
# and libstdc++ stay private.
$(LIB): $(C_OBJS) $(CUDA_OBJS)
	$(call say,LINK  $@)
	$(Q)$(CXX) -shared -o $@ $^ $(ALL_LDFLAGS) $(CUDA_LIBS) -static-libstdc++ -static-libgcc \
	    -Wl,--exclude-libs,ALL -Wl,-z,defs -Wl,--as-needed
	@echo "built $@ (CUDA: $(if $(filter 1,$(MSDA_CUDA)),$(ARCH_LIST),none)) in $$(( $$(date +%s) - $(START) )) s"

# Without nvcc, `make info` names the pip command for the CUDA of $(PYTHON)'s torch (13.x: its own
# version, so that pip keeps torch's pins; else 13.0) and the driver that build needs.
info:
	@echo "C compiler:    $(CC) ($(shell $(CC) -dumpfullversion 2>/dev/null || $(CC) -dumpversion))"
	@echo "nvcc:          $(if $(NVCC),$(NVCC) (CUDA $(NVCC_VERSION)),not found ($(strip PATH, $(NVCC_FOLDERS:%=%,) $(PYTHON)'s site-packages)))"
	@$(if $(NVCC),true,echo '               CUDA kernels without a toolkit: pip install "cuda-toolkit[nvcc,cccl]==$(if $(filter 13.%,$(TORCH_CUDA)),$(TORCH_CUDA),13.0).*"')
	@$(if $(NVCC),true,echo '               (the library then needs NVIDIA driver 580+; $(if $(TORCH_CUDA),torch $(TORCH_VERSION) uses CUDA $(TORCH_CUDA)$(if $(filter 12.%,$(TORCH_CUDA)),; pip has no CUDA 12 compiler: for an older driver install a CUDA 12 toolkit),$(if $(TORCH_VERSION),torch $(TORCH_VERSION) has no CUDA,no torch in $(PYTHON))))')
	@echo "CUDA kernels:  $(if $(filter 1,$(MSDA_CUDA)),yes,no) ($(CUDA_WHY))"
	@echo "CUDA_HOME:     $(CUDA_HOME)"
	@echo "architectures: $(ARCH_LIST)"
	@echo "output:        $(LIB)"

# ---- wheel -------------------------------------------------------------------------------------
# One wheel for every Python 3 and torch version, made by the in-tree PEP 517 backend from the
# library and pymsda/*.py: needs neither pip, setuptools nor torch, and installing it needs no
# compiler. The backend tags it by what the library needs: manylinux_2_28_<arch> for the portable
# library below, else linux_<arch> (pymsda/_build_backend.py).
# The portable library: the objects of $(LIB) relinked by zig's linker (pip install ziglang) against
# glibc $(GLIBC_FLOOR)'s symbol versions, with zig's static libc++abi and libunwind, msda_* and
# RegisterCustomOps the only exports, and no OpenMP library named (as in $(LIB)): c/omp_runtime.c
# binds the kernels' OpenMP calls at run time to the runtime the process has (torch's), else to
# the system's libgomp.so.1, else runs them on one thread. gcc's libgcc.a goes first: the target_clones resolvers then read the
# CPU-feature bits of the gcc that compiled them. Without zig, `make wheel` packs $(LIB) as it is.
ifneq ($(filter wheel portable,$(MAKECMDGOALS)),)
ZIG ?= $(shell $(PYTHON) -c 'import ziglang' 2>/dev/null && echo '$(PYTHON) -m ziglang')
endif
GLIBC_FLOOR  := 2.28
PORTABLE_LIB := $(BUILD)/portable/libpymsda.so
DIST ?= dist
.PHONY: wheel portable
portable: $(PORTABLE_LIB)
$(PORTABLE_LIB): $(C_OBJS) $(CUDA_OBJS)
	@$(if $(ZIG),mkdir -p $(dir $@),echo "zig not found: pip install ziglang" && exit 1)
	@printf '{\n  global: msda_*; RegisterCustomOps;\n  local: *;\n};\n' > $(dir $@)exports.map
	$(call say,LINK  $@ (zig, glibc $(GLIBC_FLOOR)))
	$(Q)$(ZIG) c++ -target $(shell uname -m)-linux-gnu.$(GLIBC_FLOOR) -shared -o $@ $^ $(CUDA_LIBS) -lm -ldl \
	    $(shell $(CC) -print-libgcc-file-name) -Wl,--version-script=$(dir $@)exports.map

wheel: $(if $(ZIG),$(PORTABLE_LIB),$(LIB))
	@mkdir -p $(DIST)
	@$(if $(ZIG),,echo "make wheel: zig not found (pip install ziglang), so the wheel carries $(LIB) as linked here")
	@wheel=$$(PYMSDA_BUILD_DIR='$(dir $<)' $(PYTHON) -c 'import sys; sys.path.insert(0, "pymsda"); \
	    import _build_backend; print(_build_backend.build_wheel(sys.argv[1]))' $(DIST)) && \
	    echo "built $(DIST)/$$wheel in $$(( $$(date +%s) - $(START) )) s"

# ---- tests -------------------------------------------------------------------------------------
$(BUILD)/test_c_api: tests/c/test_c_api.c $(LIB) c/msda.h c/dtypes.h
	$(CC) -std=c11 -O1 -Wall -Ic $< -o $@ -L$(BUILD) -lpymsda -Wl,-rpath,'$$ORIGIN' -lm

test-c: $(BUILD)/test_c_api
	$(BUILD)/test_c_api

test: $(LIB) test-c
	@$(PYTHON) -c 'import pytest, numpy' 2>/dev/null || { echo "make test needs pytest and numpy in \
	$(PYTHON)'s environment: pip install \".[test]\" (or pip install pytest numpy)"; exit 1; }
	$(PYTHON) -m pytest tests -q

clean:
	rm -rf $(BUILD)

# ---- sanitizers and fuzzing (not part of `make test`) ------------------------------------------
# make sanitize: the library built CPU-only with AddressSanitizer and UndefinedBehaviorSanitizer
#   into build-asan/, then the C-level test and the CPU pytest suite run against it. Python
#   itself is not instrumented, so libasan is preloaded into it (PYMSDA_LIBRARY points pymsda at
#   the instrumented library) and leak detection is off there: CPython and torch keep memory
#   until exit by design. The C test runs with leak detection on. Any report fails the target.
# make fuzz: builds tests/fuzz/fuzz_msda.c (libFuzzer, clang, ASan + UBSan, the C sources
#   compiled in without OpenMP) into build-fuzz/ and fuzzes msda_forward/msda_backward on the
#   CPU for FUZZ_SECONDS, starting from the seeds in tests/fuzz/corpus (new inputs go to
#   build-fuzz/corpus; a crash is written to build-fuzz/ and fails the target).
ASAN_BUILD   ?= build-asan
FUZZ_BUILD   ?= build-fuzz
FUZZ_SECONDS ?= 600
CLANG        ?= clang
SAN_FLAGS    := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
SAN_ENV      := UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# libstdc++ is preloaded too so that ASan's __cxa_throw interceptor finds it (C++ extensions
# such as matplotlib's throw); --capture=sys lets a sanitizer report reach the terminal.
SAN_PY_ENV    = ASAN_OPTIONS=detect_leaks=0 \
               LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libstdc++.so)" \
               PYMSDA_LIBRARY="$(abspath $(ASAN_BUILD))/libpymsda.so"
.PHONY: sanitize fuzz

sanitize:
	$(MAKE) --no-print-directory BUILD=$(ASAN_BUILD) MSDA_CUDA=0 CFLAGS="-O1 -g $(SAN_FLAGS)" \
	    LDFLAGS="$(SAN_FLAGS)" all
	$(CC) -std=c11 -O1 -g $(SAN_FLAGS) -Wall -Ic tests/c/test_c_api.c -o $(ASAN_BUILD)/test_c_api \
	    -L$(ASAN_BUILD) -lpymsda -Wl,-rpath,'$$ORIGIN' -lm -lpthread
	$(SAN_ENV) ASAN_OPTIONS=detect_leaks=1 $(ASAN_BUILD)/test_c_api
	$(SAN_ENV) $(SAN_PY_ENV) $(PYTHON) -c "import pymsda; print('pytest runs on', pymsda.library_path())"
	$(SAN_ENV) $(SAN_PY_ENV) $(PYTHON) -m pytest tests -q -p no:cacheprovider --capture=sys
	@echo "sanitize: C test and CPU pytest suite clean under ASan+UBSan ($(ASAN_BUILD)/libpymsda.so)"

# Every C source of the CPU-only library (c/*.c, cuda_stub.c included) goes into the binary.
$(FUZZ_BUILD)/fuzz_msda: tests/fuzz/fuzz_msda.c $(wildcard c/*.c c/*.h c/*.inc)
	@mkdir -p $(FUZZ_BUILD)
	$(CLANG) -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
	    -Wall -Wno-unknown-pragmas -Wno-unused-function -Ic $(filter %.c,$^) -o $@ -lm

fuzz: $(FUZZ_BUILD)/fuzz_msda
	@mkdir -p $(FUZZ_BUILD)/corpus
	$(SAN_ENV) $(FUZZ_BUILD)/fuzz_msda -max_total_time=$(FUZZ_SECONDS) -max_len=2048 -timeout=10 \
	    -print_final_stats=1 -artifact_prefix=$(FUZZ_BUILD)/ $(FUZZ_BUILD)/corpus tests/fuzz/corpus
