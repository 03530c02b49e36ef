/* c/ort_abi.h: the part of ONNX Runtime's C ABI this library uses, declared here from the documented
 * C API (onnxruntime_c_api.h is not included, vendored or needed): everything the runtime hands a
 * custom-op library travels through the function table OrtApiBase gives, so nothing links
 * libonnxruntime.
 *
 * What holds across releases: OrtApi is a struct of function pointers that only ever grows at its
 * end (a slot keeps its index once released); GetApi(v) hands out the table of API version v
 * when the runtime is at least that new. OrtCustomOp is read by the runtime only as far as the
 * `version` it carries. The slots below exist from API 17 (onnxruntime 1.17) on; the library asks
 * for version 17, so the range is onnxruntime 1.17 and every later release (tested: 1.17.3 and
 * 1.32.0, tests/test_onnxruntime_op.py and .ci/run). */
#ifndef MSDA_ORT_ABI_H
#define MSDA_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

/* The API version requested, and the OrtCustomOp layout version this library fills in. */
#define MSDA_ORT_API_VERSION 17

/* Opaque runtime objects, only ever handled by pointer. */
typedef struct OrtApi OrtApi;
typedef struct OrtStatus OrtStatus;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtMemoryInfo OrtMemoryInfo;

typedef struct {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

/* OrtErrorCode values used here. */
enum { MSDA_ORT_FAIL = 1, MSDA_ORT_INVALID_ARGUMENT = 2 };

/* ONNXTensorElementDataType values (the ONNX TensorProto data types). */
enum {
    MSDA_ORT_UNDEFINED = 0, MSDA_ORT_FLOAT = 1, MSDA_ORT_INT32 = 6, MSDA_ORT_INT64 = 7,
    MSDA_ORT_FLOAT16 = 10, MSDA_ORT_DOUBLE = 11, MSDA_ORT_BFLOAT16 = 16,
};

/* OrtMemType: where an execution provider wants an input (Default: its own device memory). */
enum { MSDA_ORT_MEM_CPU_INPUT = -2, MSDA_ORT_MEM_DEFAULT = 0 };

/* OrtCustomOpInputOutputCharacteristic */
enum { MSDA_ORT_REQUIRED = 0 };

/* OrtCustomOp up to API 17's members; `version` says how far the runtime may read. */
typedef struct OrtCustomOp OrtCustomOp;
struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const OrtCustomOp *op);
    int (*GetInputType)(const OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const OrtCustomOp *op);
    int (*GetOutputType)(const OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const OrtCustomOp *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const OrtCustomOp *op, size_t index);
    int (*GetOutputCharacteristic)(const OrtCustomOp *op, size_t index);
    int (*GetInputMemoryType)(const OrtCustomOp *op, size_t index); /* API 13 */
    int (*GetVariadicInputMinArity)(const OrtCustomOp *op);        /* API 14 */
    int (*GetVariadicInputHomogeneity)(const OrtCustomOp *op);
    int (*GetVariadicOutputMinArity)(const OrtCustomOp *op);
    int (*GetVariadicOutputHomogeneity)(const OrtCustomOp *op);
    OrtStatus *(*CreateKernelV2)(const OrtCustomOp *op, const OrtApi *api,  /* API 16 */
                                 const OrtKernelInfo *info, void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *context);
    OrtStatus *(*InferOutputShapeFn)(const OrtCustomOp *op, void *context); /* API 17 */
    int (*GetStartVersion)(const OrtCustomOp *op);
    int (*GetEndVersion)(const OrtCustomOp *op);
};

/* The OrtApi slots used: index in the table, then the signature. */
enum {
    MSDA_ORT_SLOT_CreateStatus = 0,
    MSDA_ORT_SLOT_GetErrorMessage = 2,
    MSDA_ORT_SLOT_CreateCustomOpDomain = 26,
    MSDA_ORT_SLOT_CustomOpDomain_Add = 27,
    MSDA_ORT_SLOT_AddCustomOpDomain = 28,
    MSDA_ORT_SLOT_GetTensorMutableData = 51,
    MSDA_ORT_SLOT_GetTensorElementType = 60,
    MSDA_ORT_SLOT_GetDimensionsCount = 61,
    MSDA_ORT_SLOT_GetDimensions = 62,
    MSDA_ORT_SLOT_GetTensorTypeAndShape = 65,
    MSDA_ORT_SLOT_MemoryInfoGetId = 72,
    MSDA_ORT_SLOT_KernelInfoGetAttribute_string = 87,
    MSDA_ORT_SLOT_KernelContext_GetInputCount = 88,
    MSDA_ORT_SLOT_KernelContext_GetInput = 90,
    MSDA_ORT_SLOT_KernelContext_GetOutput = 91,
    MSDA_ORT_SLOT_ReleaseStatus = 93,
    MSDA_ORT_SLOT_ReleaseTensorTypeAndShapeInfo = 99,
    MSDA_ORT_SLOT_ReleaseCustomOpDomain = 101,
    MSDA_ORT_SLOT_KernelInfoGetAttributeArray_int64 = 163,
    MSDA_ORT_SLOT_KernelContext_GetGPUComputeStream = 193,
    MSDA_ORT_SLOT_GetTensorMemoryInfo = 194,
    MSDA_ORT_SLOT_KernelContext_ParallelFor = 274, /* API 17 */
};

typedef OrtStatus *(*msda_ort_CreateStatus)(int code, const char *message);
typedef const char *(*msda_ort_GetErrorMessage)(const OrtStatus *status);
typedef OrtStatus *(*msda_ort_CreateCustomOpDomain)(const char *domain, OrtCustomOpDomain **out);
typedef OrtStatus *(*msda_ort_CustomOpDomain_Add)(OrtCustomOpDomain *domain, const OrtCustomOp *op);
typedef OrtStatus *(*msda_ort_AddCustomOpDomain)(OrtSessionOptions *options,
                                                 OrtCustomOpDomain *domain);
typedef OrtStatus *(*msda_ort_GetTensorMutableData)(OrtValue *value, void **out);
typedef OrtStatus *(*msda_ort_GetTensorElementType)(const OrtTensorTypeAndShapeInfo *info, int *out);
typedef OrtStatus *(*msda_ort_GetDimensionsCount)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
typedef OrtStatus *(*msda_ort_GetDimensions)(const OrtTensorTypeAndShapeInfo *info, int64_t *dims,
                                             size_t count);
typedef OrtStatus *(*msda_ort_GetTensorTypeAndShape)(const OrtValue *value,
                                                     OrtTensorTypeAndShapeInfo **out);
typedef OrtStatus *(*msda_ort_MemoryInfoGetId)(const OrtMemoryInfo *info, int *out);
typedef OrtStatus *(*msda_ort_KernelInfoGetAttribute_string)(const OrtKernelInfo *info,
                                                             const char *name, char *out,
                                                             size_t *size);
typedef OrtStatus *(*msda_ort_KernelContext_GetInputCount)(const OrtKernelContext *context,
                                                           size_t *out);
typedef OrtStatus *(*msda_ort_KernelContext_GetInput)(const OrtKernelContext *context, size_t index,
                                                      const OrtValue **out);
typedef OrtStatus *(*msda_ort_KernelContext_GetOutput)(OrtKernelContext *context, size_t index,
                                                       const int64_t *dims, size_t count,
                                                       OrtValue **out);
typedef void (*msda_ort_ReleaseStatus)(OrtStatus *status);
typedef void (*msda_ort_ReleaseTensorTypeAndShapeInfo)(OrtTensorTypeAndShapeInfo *info);
typedef void (*msda_ort_ReleaseCustomOpDomain)(OrtCustomOpDomain *domain);
typedef OrtStatus *(*msda_ort_KernelInfoGetAttributeArray_int64)(const OrtKernelInfo *info,
                                                                 const char *name, int64_t *out,
                                                                 size_t *size);
typedef OrtStatus *(*msda_ort_KernelContext_GetGPUComputeStream)(const OrtKernelContext *context,
                                                                 void **out);
typedef OrtStatus *(*msda_ort_GetTensorMemoryInfo)(const OrtValue *value,
                                                   const OrtMemoryInfo **out);
typedef OrtStatus *(*msda_ort_KernelContext_ParallelFor)(const OrtKernelContext *context,
                                                         void (*fn)(void *, size_t), size_t total,
                                                         size_t num_batch, void *data);

/* The function in slot NAME of table `api`, with its signature: ORT(api, CreateStatus)(...). */
typedef void (*msda_ort_fn)(void);
#define ORT(api, NAME) ((msda_ort_##NAME)((const msda_ort_fn *)(const void *)(api))[MSDA_ORT_SLOT_##NAME])

#endif /* MSDA_ORT_ABI_H */
