/* c/ort_op.h: what ONNX Runtime's op MSDeformAttn (c/ort_op.c) shares with its CUDA provider's
 * kernel (c/ort_cuda.c). Internal: users see the op, its inputs and attributes (docs/export.md). */
#ifndef MSDA_ORT_OP_H
#define MSDA_ORT_OP_H

#include "msda_internal.h"
#include "ort_abi.h"

/* The switch of the CUDA execution provider's kernel: 0 leaves it out of every build. */
#ifndef MSDA_ORT_CUDA_EP
#define MSDA_ORT_CUDA_EP 1
#endif

#define MSDA_ORT_DOMAIN "pymsda"
#define MSDA_ORT_OP_NAME "MSDeformAttn"

/* One registered variant: the op's struct first (the runtime hands back its address), then
 * the value type it serves and its execution provider. */
typedef struct {
    OrtCustomOp op;
    int value_type; /* MSDA_ORT_FLOAT or MSDA_ORT_FLOAT16 */
    int cuda;       /* 0: CPUExecutionProvider, 1: CUDAExecutionProvider */
} msda_ort_op;

/* A node's kernel: its attributes, read once when the session is created. */
typedef struct {
    const OrtApi *api;
    int value_type, cuda;
    int flags;    /* MSDA_NEAREST for sampling="nearest" */
    int n_points; /* entries of num_points_list, -1 without the attribute */
    int64_t points[MSDA_MAX_POINT_LEVELS];
} msda_ort_kernel;

/* A call's inputs checked against each other (shapes, ranks, types: never their contents), its
 * output allocated, and the msda_args of the call filled in (device -1; the caller sets the
 * rest). NULL, or the runtime's error status naming the input and the layout it expects. */
OrtStatus *msda_ort_prepare(const msda_ort_kernel *k, OrtKernelContext *context, msda_args *args);

/* The runtime's error status with pymsda's message (printf-style). */
OrtStatus *msda_ort_error(const OrtApi *api, int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#if MSDA_ORT_CUDA_EP
/* The CUDA provider's compute (c/ort_cuda.c). */
OrtStatus *msda_ort_compute_cuda(const msda_ort_kernel *k, OrtKernelContext *context);
#endif

#endif /* MSDA_ORT_OP_H */
