/* The CUDA driver side of the C library: loading libcuda on first use (so the library links against
 * nothing CUDA and its argument checks run on machines without a GPU), per-thread error messages,
 * the embedded kernels' modules per context, TMA descriptors and launches. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "runtime.h"

/* ---------------------------------------------------------------------------------------------
 * Errors */

static _Thread_local char last_error[1024];

flashtile_status ft_fail(flashtile_status status, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_error, sizeof last_error, format, args);
    va_end(args);
    return status;
}

void ft_clear_error(void) { last_error[0] = '\0'; }

const char *flashtile_last_error(void) { return last_error; }

flashtile_status ft_i32(int64_t value, int32_t *out, const char *what) {
    if (value < INT32_MIN || value > INT32_MAX)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT,
                       "%s = %lld does not fit the kernels' 32-bit arguments: the call is too large", what,
                       (long long)value);
    *out = (int32_t)value;
    return FLASHTILE_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------
 * The driver, through dlopen */

typedef struct driver {
    CUresult (*Init)(unsigned int);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxGetDevice)(CUdevice *);
    CUresult (*DeviceGetAttribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*ModuleLoadData)(CUmodule *, const void *);
    CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*FuncGetAttribute)(int *, CUfunction_attribute, CUfunction);
    CUresult (*FuncSetAttribute)(CUfunction, CUfunction_attribute, int);
    CUresult (*LaunchKernelEx)(const CUlaunchConfig *, CUfunction, void **, void **);
    CUresult (*TensorMapEncodeTiled)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                     const cuuint64_t *, const cuuint32_t *, const cuuint32_t *,
                                     CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                     CUtensorMapFloatOOBfill);
} driver;

static driver drv;
static int drv_state; /* 0: not tried, 1: loaded, -1: failed */
static char drv_problem[512];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int load_driver(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(drv_problem, sizeof drv_problem, "the CUDA driver (libcuda.so.1) could not be loaded: %s",
                 dlerror());
        return -1;
    }
#define FT_SYMBOL(field, name)                                                                                     \
    do {                                                                                                           \
        *(void **)&drv.field = dlsym(lib, name);                                                                   \
        if (!drv.field) {                                                                                          \
            snprintf(drv_problem, sizeof drv_problem, "libcuda.so.1 has no %s: the driver is older than CUDA 12", \
                     name);                                                                                        \
            return -1;                                                                                             \
        }                                                                                                          \
    } while (0)
    FT_SYMBOL(Init, "cuInit");
    FT_SYMBOL(GetErrorString, "cuGetErrorString");
    FT_SYMBOL(CtxGetCurrent, "cuCtxGetCurrent");
    FT_SYMBOL(CtxGetDevice, "cuCtxGetDevice");
    FT_SYMBOL(DeviceGetAttribute, "cuDeviceGetAttribute");
    FT_SYMBOL(ModuleLoadData, "cuModuleLoadData");
    FT_SYMBOL(ModuleGetFunction, "cuModuleGetFunction");
    FT_SYMBOL(FuncGetAttribute, "cuFuncGetAttribute");
    FT_SYMBOL(FuncSetAttribute, "cuFuncSetAttribute");
    FT_SYMBOL(LaunchKernelEx, "cuLaunchKernelEx");
    FT_SYMBOL(TensorMapEncodeTiled, "cuTensorMapEncodeTiled");
#undef FT_SYMBOL
    CUresult r = drv.Init(0);
    if (r != CUDA_SUCCESS) {
        const char *text = NULL;
        drv.GetErrorString(r, &text);
        snprintf(drv_problem, sizeof drv_problem, "cuInit failed: %s", text ? text : "unknown error");
        return -1;
    }
    return 1;
}

static flashtile_status cuda_error(CUresult r, const char *what) {
    const char *text = NULL;
    if (drv.GetErrorString)
        drv.GetErrorString(r, &text);
    return ft_fail(FLASHTILE_ERROR_CUDA, "%s failed: %s (CUDA error %d)", what, text ? text : "unknown error", (int)r);
}

/* Device facts per context (a process rarely has more than a few). */
#define FT_MAX_CONTEXTS 32
typedef struct context_facts {
    CUcontext ctx;
    int sm_count;
    int major, minor;
    int shared_optin;
} context_facts;
static context_facts contexts[FT_MAX_CONTEXTS];
static int n_contexts;

static flashtile_status current_context(CUcontext *ctx, context_facts **facts) {
    pthread_mutex_lock(&lock);
    if (drv_state == 0)
        drv_state = load_driver();
    pthread_mutex_unlock(&lock);
    if (drv_state < 0)
        return ft_fail(FLASHTILE_ERROR_CUDA, "%s", drv_problem);
    CUresult r = drv.CtxGetCurrent(ctx);
    if (r != CUDA_SUCCESS)
        return cuda_error(r, "cuCtxGetCurrent");
    if (*ctx == NULL)
        return ft_fail(FLASHTILE_ERROR_CUDA, "no current CUDA context: make a device current first "
                                             "(cudaSetDevice, or cuCtxSetCurrent / cuDevicePrimaryCtxRetain)");
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_contexts; i++) {
        if (contexts[i].ctx == *ctx) {
            *facts = &contexts[i];
            pthread_mutex_unlock(&lock);
            return FLASHTILE_SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    context_facts f = {*ctx, 0, 0, 0, 0};
    CUdevice dev;
    if ((r = drv.CtxGetDevice(&dev)) != CUDA_SUCCESS)
        return cuda_error(r, "cuCtxGetDevice");
    if ((r = drv.DeviceGetAttribute(&f.sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)) != CUDA_SUCCESS ||
        (r = drv.DeviceGetAttribute(&f.major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)) != CUDA_SUCCESS ||
        (r = drv.DeviceGetAttribute(&f.minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)) != CUDA_SUCCESS ||
        (r = drv.DeviceGetAttribute(&f.shared_optin, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev)) !=
            CUDA_SUCCESS)
        return cuda_error(r, "cuDeviceGetAttribute");
    if (f.major != 9 || f.minor != 0)
        return ft_fail(FLASHTILE_ERROR_UNSUPPORTED,
                       "the current device is sm%d%d; this build holds kernels for sm90 (H100 / H200) only", f.major,
                       f.minor);
    pthread_mutex_lock(&lock);
    if (n_contexts == FT_MAX_CONTEXTS) {
        pthread_mutex_unlock(&lock);
        return ft_fail(FLASHTILE_ERROR_UNSUPPORTED, "more than %d CUDA contexts used flashtile", FT_MAX_CONTEXTS);
    }
    contexts[n_contexts] = f;
    *facts = &contexts[n_contexts++];
    pthread_mutex_unlock(&lock);
    return FLASHTILE_SUCCESS;
}

flashtile_status ft_device(int *sm_count) {
    CUcontext ctx;
    context_facts *facts;
    FT_TRY(current_context(&ctx, &facts));
    *sm_count = facts->sm_count;
    return FLASHTILE_SUCCESS;
}

/* ---------------------------------------------------------------------------------------------
 * Modules: each kernel's cubin loaded once per context, on first launch */

typedef struct loaded_function {
    CUcontext ctx;
    int kernel;
    CUfunction fn;
} loaded_function;
#define FT_MAX_FUNCTIONS 4096
static loaded_function functions[FT_MAX_FUNCTIONS];
static int n_functions;

static flashtile_status function_for(int index, CUfunction *fn) {
    CUcontext ctx;
    context_facts *facts;
    FT_TRY(current_context(&ctx, &facts));
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_functions; i++) {
        if (functions[i].kernel == index && functions[i].ctx == ctx) {
            *fn = functions[i].fn;
            pthread_mutex_unlock(&lock);
            return FLASHTILE_SUCCESS;
        }
    }
    /* Loaded with the lock held: two threads must not both load a kernel into one context. */
    const ft_kernel *k = &ft_kernels[index];
    CUmodule module;
    CUresult r = drv.ModuleLoadData(&module, k->cubin);
    if (r == CUDA_SUCCESS)
        r = drv.ModuleGetFunction(fn, module, k->name);
    if (r == CUDA_SUCCESS && k->shared_bytes > 49152) {
        int static_bytes = 0;
        r = drv.FuncGetAttribute(&static_bytes, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, *fn);
        if (r == CUDA_SUCCESS && k->shared_bytes > facts->shared_optin) {
            pthread_mutex_unlock(&lock);
            return ft_fail(FLASHTILE_ERROR_UNSUPPORTED, "%s needs %d bytes of shared memory, the device allows %d",
                           k->name, k->shared_bytes, facts->shared_optin);
        }
        if (r == CUDA_SUCCESS)
            r = drv.FuncSetAttribute(*fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     facts->shared_optin - static_bytes);
    }
    if (r == CUDA_SUCCESS && n_functions < FT_MAX_FUNCTIONS)
        functions[n_functions++] = (loaded_function){ctx, index, *fn};
    pthread_mutex_unlock(&lock);
    return r == CUDA_SUCCESS ? FLASHTILE_SUCCESS : cuda_error(r, "loading an embedded kernel (cuModuleLoadData)");
}

/* ---------------------------------------------------------------------------------------------
 * TMA descriptors and launches */

flashtile_status ft_encode(CUtensorMap *map, CUdeviceptr base, int data_type, int elem_bytes, int swizzle, int rank,
                           const int64_t *shape, const int64_t *strides, const uint32_t *box, const char *what) {
    cuuint64_t dims[5], byte_strides[5];
    cuuint32_t boxes[5], unit[5] = {1, 1, 1, 1, 1};
    for (int i = 0; i < rank; i++) { /* the driver lists dims innermost first */
        dims[i] = (cuuint64_t)shape[rank - 1 - i];
        boxes[i] = box[rank - 1 - i];
    }
    for (int i = 0; i + 1 < rank; i++)
        byte_strides[i] = (cuuint64_t)(strides[rank - 2 - i] * elem_bytes);
    CUresult r = drv.TensorMapEncodeTiled(map, (CUtensorMapDataType)data_type, (cuuint32_t)rank, (void *)base, dims,
                                          byte_strides, boxes, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          (CUtensorMapSwizzle)swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        char where[128];
        snprintf(where, sizeof where, "cuTensorMapEncodeTiled (%s)", what);
        return cuda_error(r, where);
    }
    return FLASHTILE_SUCCESS;
}

flashtile_status ft_launch(int index, const int64_t grid[3], int pdl, CUstream stream, void **params) {
    CUfunction fn;
    FT_TRY(function_for(index, &fn));
    const ft_kernel *k = &ft_kernels[index];
    CUlaunchAttribute attrs[1];
    CUlaunchConfig config;
    memset(&config, 0, sizeof config);
    config.gridDimX = (unsigned)grid[0];
    config.gridDimY = (unsigned)grid[1];
    config.gridDimZ = (unsigned)grid[2];
    config.blockDimX = (unsigned)k->threads;
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = (unsigned)k->shared_bytes;
    config.hStream = stream;
    config.attrs = attrs;
    if (pdl) { /* a programmatic dependent launch: it may start before the previous kernel ends */
        memset(attrs, 0, sizeof attrs);
        attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[0].value.programmaticStreamSerializationAllowed = 1;
        config.numAttrs = 1;
    }
    if (grid[1] > 65535 || grid[2] > 65535 || grid[0] > INT32_MAX)
        return ft_fail(FLASHTILE_ERROR_INVALID_ARGUMENT, "%s: grid (%lld, %lld, %lld) exceeds CUDA's limits", k->name,
                       (long long)grid[0], (long long)grid[1], (long long)grid[2]);
    CUresult r = drv.LaunchKernelEx(&config, fn, params, NULL);
    if (r != CUDA_SUCCESS) {
        char where[160];
        snprintf(where, sizeof where, "launching %s (cuLaunchKernelEx)", k->name);
        return cuda_error(r, where);
    }
    return FLASHTILE_SUCCESS;
}

const char *flashtile_status_string(flashtile_status status) {
    switch (status) {
    case FLASHTILE_SUCCESS: return "success";
    case FLASHTILE_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case FLASHTILE_ERROR_NOT_EXPORTED: return "not exported in this build";
    case FLASHTILE_ERROR_UNSUPPORTED: return "unsupported";
    case FLASHTILE_ERROR_WORKSPACE: return "workspace too small or misaligned";
    case FLASHTILE_ERROR_CUDA: return "CUDA driver error";
    }
    return "unknown status";
}

const char *flashtile_build_info(void) { return ft_build_info; }
