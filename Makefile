# Makefile: builds build/libpymsda.so, the C/CUDA library pymsda loads with ctypes.
#   make                   CPU kernels always; CUDA kernels too when nvcc is found
#   make CUDA_ARCHS=90     a quick build for one GPU architecture (list: "75 80 90")
#   make MSDA_CUDA=0       force a CPU-only build
#   make info | test | clean
# No torch, ATen, c10 or pybind11 header is used: the library does not depend on any PyTorch or
# Python version. cudart is linked statically, so the .so needs only the driver (libcuda).

BUILD    ?= build
LIB      := $(BUILD)/libpymsda.so
PYTHON   ?= python3

CC       ?= cc
CXX      ?= c++
# CFLAGS, NVCCFLAGS and LDFLAGS are the user's (optimisation, extra -D); what the build needs is
# added in ALL_* so that `make CFLAGS=...` cannot drop it.
CFLAGS   ?= -O3
ALL_CFLAGS  = $(CFLAGS) -std=c11 -fPIC -fvisibility=hidden -fopenmp -Wall -Wextra -Wno-unused-parameter
ALL_LDFLAGS = $(LDFLAGS) -fopenmp

# ---- CUDA detection ----------------------------------------------------------------------------
NVCC     ?= $(shell command -v nvcc 2>/dev/null || { test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc; })
ifeq ($(NVCC),)
MSDA_CUDA ?= 0
else
MSDA_CUDA ?= 1
endif

ifeq ($(MSDA_CUDA),1)
# nvcc may be a wrapper script: ask it where its toolkit lives.
CUDA_HOME   ?= $(realpath $(shell $(NVCC) --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$$ TOP=//p'))
NVCC_VERSION := $(shell $(NVCC) --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
# Default: machine code for every architecture from sm_75 to the newest this nvcc knows, plus PTX
# of the newest so later GPUs can JIT-compile it.
CUDA_ARCHS  ?= $(shell $(NVCC) --list-gpu-arch 2>/dev/null | sed -n 's/^compute_\([0-9]*\)$$/\1/p' | awk '$$1 >= 75' | sort -n | tr '\n' ' ')
CUDA_PTX    := $(shell echo $(CUDA_ARCHS) | tr ' ' '\n' | sort -n | tail -n 1)
GENCODE     := $(foreach a,$(CUDA_ARCHS),-gencode=arch=compute_$(a),code=sm_$(a)) \
               -gencode=arch=compute_$(CUDA_PTX),code=compute_$(CUDA_PTX)
ARCH_LIST   := $(strip $(foreach a,$(CUDA_ARCHS),sm_$(a)) compute_$(CUDA_PTX))
NVCCFLAGS   ?= -O3
ALL_NVCCFLAGS = $(NVCCFLAGS) -std=c++17 --threads 0 -Xcompiler -fPIC,-fvisibility=hidden \
               $(GENCODE) -DMSDA_CUDA_ARCHS='"$(ARCH_LIST)"'
CUDA_OBJS   := $(patsubst kernels/%.cu,$(BUILD)/%.o,$(wildcard kernels/*.cu))
CUDA_LIBS   := -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/targets/x86_64-linux/lib -lcudart_static -lrt -ldl -lpthread
else
CUDA_OBJS   := $(BUILD)/cuda_stub.o
CUDA_LIBS   :=
endif

C_OBJS := $(BUILD)/msda.o $(BUILD)/cpu_kernels.o

# ---- targets -----------------------------------------------------------------------------------
.PHONY: all info test test-c clean
all: $(LIB)

$(BUILD):
	@mkdir -p $(BUILD)

# The flags a build used are kept in build/config so changing them (CUDA_ARCHS, MSDA_CUDA) rebuilds.
CONFIG := $(CC) $(ALL_CFLAGS) | $(MSDA_CUDA) $(NVCC) $(CUDA_ARCHS) $(ALL_NVCCFLAGS)
$(BUILD)/config: FORCE | $(BUILD)
	@echo '$(CONFIG)' | cmp -s - $@ || echo '$(CONFIG)' > $@
FORCE:

$(BUILD)/%.o: c/%.c c/msda.h c/msda_internal.h c/half.h c/cpu_kernels.inc $(BUILD)/config | $(BUILD)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/%.o: kernels/%.cu kernels/common.cuh c/msda.h c/msda_internal.h $(BUILD)/config | $(BUILD)
	$(NVCC) $(ALL_NVCCFLAGS) -c $< -o $@

# Only the msda_* symbols are exported; the static cudart and libstdc++ stay private.
$(LIB): $(C_OBJS) $(CUDA_OBJS)
	$(CXX) -shared -o $@ $^ $(ALL_LDFLAGS) $(CUDA_LIBS) -static-libstdc++ -static-libgcc \
	    -Wl,--exclude-libs,ALL -Wl,-z,defs -Wl,--as-needed
	@echo "built $@ (CUDA: $(if $(filter 1,$(MSDA_CUDA)),$(ARCH_LIST),none))"

info:
	@echo "C compiler:    $(CC) ($(shell $(CC) -dumpfullversion 2>/dev/null || $(CC) -dumpversion))"
	@echo "nvcc:          $(if $(NVCC),$(NVCC) (CUDA $(NVCC_VERSION)),not found)"
	@echo "CUDA kernels:  $(if $(filter 1,$(MSDA_CUDA)),yes,no (MSDA_CUDA=$(MSDA_CUDA)))"
	@echo "CUDA_HOME:     $(CUDA_HOME)"
	@echo "architectures: $(ARCH_LIST)"
	@echo "output:        $(LIB)"

# ---- tests -------------------------------------------------------------------------------------
$(BUILD)/test_c_api: tests/c/test_c_api.c $(LIB) c/msda.h c/half.h
	$(CC) -std=c11 -O1 -Wall -Ic $< -o $@ -L$(BUILD) -lpymsda -Wl,-rpath,'$$ORIGIN' -lm

test-c: $(BUILD)/test_c_api
	$(BUILD)/test_c_api

test: $(LIB) test-c
	$(PYTHON) -m pytest tests -q

clean:
	rm -rf $(BUILD)
