/* A stand-in for the NVIDIA driver library (libcuda.so.1) on machines without a GPU.
 *
 * SGLang 0.5.23's CPU engine imports sgl_kernel, whose shared objects link libcuda.so.1 and
 * so fail to load where no driver is installed. This library satisfies the link: every entry
 * point they (and the CUDA runtime, when it probes the driver) look up answers
 * CUDA_ERROR_NO_DEVICE, so nothing can run on a GPU and torch reports none. Built by
 * megatron_rl/engines/sglang_cpu.py and put on LD_LIBRARY_PATH of CPU engine processes only.
 * The entry points take no declared parameters: on x86-64 and aarch64 the caller owns its
 * arguments, so a callee that ignores them is safe.
 */
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NO_DEVICE 100

#define NO_DEVICE(name) \
    int name(void) { return CUDA_ERROR_NO_DEVICE; }

NO_DEVICE(cuInit)
NO_DEVICE(cuDriverGetVersion)
NO_DEVICE(cuDeviceGet)
NO_DEVICE(cuDeviceGetCount)
NO_DEVICE(cuGetProcAddress)
NO_DEVICE(cuGetProcAddress_v2)
NO_DEVICE(cuGetExportTable)
NO_DEVICE(cuPointerGetAttribute)
NO_DEVICE(cuStreamCreate)
NO_DEVICE(cuCtxPushCurrent_v2)
NO_DEVICE(cuCtxPopCurrent_v2)
NO_DEVICE(cuCtxFromGreenCtx)
NO_DEVICE(cuGreenCtxCreate)
NO_DEVICE(cuGreenCtxDestroy)
NO_DEVICE(cuGreenCtxGetDevResource)
NO_DEVICE(cuDevResourceGenerateDesc)
NO_DEVICE(cuDevSmResourceSplitByCount)
NO_DEVICE(cuDeviceGetDevResource)

/* Callers print this message, so it must be a valid string for any error code. */
int cuGetErrorString(int error, const char **message) {
    (void)error;
    if (message) *message = "no CUDA device (megatron-rl's CPU stand-in for libcuda.so.1)";
    return CUDA_SUCCESS;
}

int cuGetErrorName(int error, const char **name) {
    (void)error;
    if (name) *name = "CUDA_ERROR_NO_DEVICE";
    return CUDA_SUCCESS;
}
