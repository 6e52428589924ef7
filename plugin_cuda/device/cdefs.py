"""The C declarations of the CUDA libraries the plugin calls through cffi (ABI mode).

Kept apart from the modules that call them (driver.py, cublas.py, cublaslt.py, cudnn.py) so that the package
build and build.py can write them as out-of-line cffi modules (abi/outofline.py) without importing
CuPy, NumPy or the plugin: an in-line FFI parses its declarations with pycparser at import, 0.13-0.15 s of
every CUDA session's creation on the H200."""

from __future__ import annotations

DRIVER = """
typedef int CUresult;
typedef void* CUfunction;
typedef void* CUstream;
typedef void* CUgraph;
typedef void* CUgraphExec;
CUresult cuGetErrorName(CUresult error, const char** pStr);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream, void** kernelParams, void** extra);
CUresult cuMemcpyAsync(unsigned long long dst, unsigned long long src, size_t ByteCount, CUstream hStream);
CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode);
CUresult cuStreamEndCapture(CUstream hStream, CUgraph* phGraph);
CUresult cuGraphInstantiateWithFlags(CUgraphExec* phGraphExec, CUgraph hGraph, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphDestroy(CUgraph hGraph);
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
"""

CUBLAS = """
typedef void* cublasHandle_t;
typedef void* cudaStream_t;
int cublasCreate_v2(cublasHandle_t* handle);
int cublasDestroy_v2(cublasHandle_t handle);
int cublasSetStream_v2(cublasHandle_t handle, cudaStream_t streamId);
int cublasSetWorkspace_v2(cublasHandle_t handle, void* workspace, size_t workspaceSizeInBytes);
int cublasSetMathMode(cublasHandle_t handle, int mode);
int cublasSgemm_v2(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                   const float* alpha, const float* A, int lda, const float* B, int ldb,
                   const float* beta, float* C, int ldc);
int cublasSgemmStridedBatched(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                              const float* alpha, const float* A, int lda, long long strideA,
                              const float* B, int ldb, long long strideB, const float* beta,
                              float* C, int ldc, long long strideC, int batchCount);
int cublasGemmEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                 const void* alpha, const void* A, int Atype, int lda,
                 const void* B, int Btype, int ldb, const void* beta,
                 void* C, int Ctype, int ldc, int computeType, int algo);
int cublasGemmStridedBatchedEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                               const void* alpha, const void* A, int Atype, int lda, long long strideA,
                               const void* B, int Btype, int ldb, long long strideB,
                               const void* beta, void* C, int Ctype, int ldc, long long strideC,
                               int batchCount, int computeType, int algo);
int cublasGemmBatchedEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                        const void* alpha, const void* Aarray, int Atype, int lda,
                        const void* Barray, int Btype, int ldb, const void* beta,
                        const void* Carray, int Ctype, int ldc, int batchCount, int computeType, int algo);
const char* cublasGetStatusName(int status);
"""

CUBLASLT = """
typedef void* cublasLtHandle_t;
typedef void* cublasLtMatmulDesc_t;
typedef void* cublasLtMatrixLayout_t;
typedef void* cublasLtMatmulPreference_t;
typedef struct { uint64_t data[8]; } cublasLtMatmulAlgo_t;
typedef struct {
    cublasLtMatmulAlgo_t algo;
    size_t workspaceSize;
    int state;
    float wavesCount;
    int reserved[4];
} cublasLtMatmulHeuristicResult_t;
int cublasLtCreate(cublasLtHandle_t* handle);
int cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, int computeType, int scaleType);
int cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
int cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, int attr, const void* buf, size_t size);
int cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, int type, uint64_t rows, uint64_t cols, int64_t ld);
int cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
int cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref);
int cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
int cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref, int attr, const void* buf, size_t size);
int cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                   cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                   cublasLtMatrixLayout_t d, cublasLtMatmulPreference_t pref, int requested,
                                   cublasLtMatmulHeuristicResult_t* results, int* returned);
int cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                   const void* A, cublasLtMatrixLayout_t a, const void* B, cublasLtMatrixLayout_t b,
                   const void* beta, const void* C, cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t d,
                   const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspaceSize, void* stream);
"""

CUDNN = """
typedef void* cudnnHandle_t;
typedef void* cudaStream_t;
typedef void* cudnnTensorDescriptor_t;
typedef void* cudnnFilterDescriptor_t;
typedef void* cudnnConvolutionDescriptor_t;
typedef void* cudnnActivationDescriptor_t;
typedef struct {
    int algo; int status; float time; size_t memory; int determinism; int mathType; int reserved[3];
} cudnnConvolutionFwdAlgoPerf_t;
typedef struct {
    int algo; int status; float time; size_t memory; int determinism; int mathType; int reserved[3];
} cudnnConvolutionBwdDataAlgoPerf_t;
size_t cudnnGetVersion(void);
size_t cudnnGetCudartVersion(void);
const char* cudnnGetErrorString(int status);
int cudnnCreate(cudnnHandle_t* handle);
int cudnnDestroy(cudnnHandle_t handle);
int cudnnSetStream(cudnnHandle_t handle, cudaStream_t streamId);
int cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t* d);
int cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d);
int cudnnSetTensorNdDescriptor(cudnnTensorDescriptor_t d, int dataType, int nbDims, const int dimA[],
                               const int strideA[]);
int cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t* d);
int cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d);
int cudnnSetFilterNdDescriptor(cudnnFilterDescriptor_t d, int dataType, int format, int nbDims,
                               const int filterDimA[]);
int cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t* d);
int cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d);
int cudnnSetConvolutionNdDescriptor(cudnnConvolutionDescriptor_t d, int arrayLength, const int padA[],
                                    const int filterStrideA[], const int dilationA[], int mode,
                                    int computeType);
int cudnnSetConvolutionGroupCount(cudnnConvolutionDescriptor_t d, int groupCount);
int cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d, int mathType);
int cudnnGetConvolutionNdForwardOutputDim(cudnnConvolutionDescriptor_t convDesc,
                                          cudnnTensorDescriptor_t inputTensorDesc,
                                          cudnnFilterDescriptor_t filterDesc, int nbDims,
                                          int tensorOuputDimA[]);
int cudnnCreateActivationDescriptor(cudnnActivationDescriptor_t* d);
int cudnnDestroyActivationDescriptor(cudnnActivationDescriptor_t d);
int cudnnSetActivationDescriptor(cudnnActivationDescriptor_t d, int mode, int reluNanOpt, double coef);
int cudnnGetConvolutionForwardAlgorithmMaxCount(cudnnHandle_t handle, int* count);
int cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t handle, cudnnTensorDescriptor_t srcDesc,
                                           cudnnFilterDescriptor_t filterDesc,
                                           cudnnConvolutionDescriptor_t convDesc,
                                           cudnnTensorDescriptor_t destDesc, int requestedAlgoCount,
                                           int* returnedAlgoCount,
                                           cudnnConvolutionFwdAlgoPerf_t* perfResults);
int cudnnFindConvolutionForwardAlgorithmEx(cudnnHandle_t handle, cudnnTensorDescriptor_t xDesc,
                                           const void* x, cudnnFilterDescriptor_t wDesc, const void* w,
                                           cudnnConvolutionDescriptor_t convDesc,
                                           cudnnTensorDescriptor_t yDesc, void* y,
                                           int requestedAlgoCount, int* returnedAlgoCount,
                                           cudnnConvolutionFwdAlgoPerf_t* perfResults,
                                           void* workSpace, size_t workSpaceSizeInBytes);
int cudnnGetConvolutionForwardWorkspaceSize(cudnnHandle_t handle, cudnnTensorDescriptor_t xDesc,
                                            cudnnFilterDescriptor_t wDesc,
                                            cudnnConvolutionDescriptor_t convDesc,
                                            cudnnTensorDescriptor_t yDesc, int algo, size_t* sizeInBytes);
int cudnnConvolutionForward(cudnnHandle_t handle, const void* alpha, cudnnTensorDescriptor_t xDesc,
                            const void* x, cudnnFilterDescriptor_t wDesc, const void* w,
                            cudnnConvolutionDescriptor_t convDesc, int algo, void* workSpace,
                            size_t workSpaceSizeInBytes, const void* beta,
                            cudnnTensorDescriptor_t yDesc, void* y);
int cudnnConvolutionBiasActivationForward(cudnnHandle_t handle, const void* alpha1,
                                          cudnnTensorDescriptor_t xDesc, const void* x,
                                          cudnnFilterDescriptor_t wDesc, const void* w,
                                          cudnnConvolutionDescriptor_t convDesc, int algo,
                                          void* workSpace, size_t workSpaceSizeInBytes,
                                          const void* alpha2, cudnnTensorDescriptor_t zDesc,
                                          const void* z, cudnnTensorDescriptor_t biasDesc,
                                          const void* bias, cudnnActivationDescriptor_t activationDesc,
                                          cudnnTensorDescriptor_t yDesc, void* y);
int cudnnGetConvolutionBackwardDataAlgorithmMaxCount(cudnnHandle_t handle, int* count);
int cudnnGetConvolutionBackwardDataAlgorithm_v7(cudnnHandle_t handle, cudnnFilterDescriptor_t filterDesc,
                                                cudnnTensorDescriptor_t diffDesc,
                                                cudnnConvolutionDescriptor_t convDesc,
                                                cudnnTensorDescriptor_t gradDesc, int requestedAlgoCount,
                                                int* returnedAlgoCount,
                                                cudnnConvolutionBwdDataAlgoPerf_t* perfResults);
int cudnnFindConvolutionBackwardDataAlgorithmEx(cudnnHandle_t handle, cudnnFilterDescriptor_t wDesc,
                                                const void* w, cudnnTensorDescriptor_t dyDesc,
                                                const void* dy, cudnnConvolutionDescriptor_t convDesc,
                                                cudnnTensorDescriptor_t dxDesc, void* dx,
                                                int requestedAlgoCount, int* returnedAlgoCount,
                                                cudnnConvolutionBwdDataAlgoPerf_t* perfResults,
                                                void* workSpace, size_t workSpaceSizeInBytes);
int cudnnGetConvolutionBackwardDataWorkspaceSize(cudnnHandle_t handle, cudnnFilterDescriptor_t wDesc,
                                                 cudnnTensorDescriptor_t dyDesc,
                                                 cudnnConvolutionDescriptor_t convDesc,
                                                 cudnnTensorDescriptor_t dxDesc, int algo,
                                                 size_t* sizeInBytes);
int cudnnConvolutionBackwardData(cudnnHandle_t handle, const void* alpha, cudnnFilterDescriptor_t wDesc,
                                 const void* w, cudnnTensorDescriptor_t dyDesc, const void* dy,
                                 cudnnConvolutionDescriptor_t convDesc, int algo, void* workSpace,
                                 size_t workSpaceSizeInBytes, const void* beta,
                                 cudnnTensorDescriptor_t dxDesc, void* dx);
int cudnnActivationForward(cudnnHandle_t handle, cudnnActivationDescriptor_t activationDesc, const void* alpha,
                           cudnnTensorDescriptor_t xDesc, const void* x, const void* beta,
                           cudnnTensorDescriptor_t yDesc, void* y);
int cudnnAddTensor(cudnnHandle_t handle, const void* alpha, cudnnTensorDescriptor_t aDesc, const void* A,
                   const void* beta, cudnnTensorDescriptor_t cDesc, void* C);
typedef void* cudnnBackendDescriptor_t;
int cudnnBackendCreateDescriptor(int descriptorType, cudnnBackendDescriptor_t* descriptor);
int cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t descriptor);
int cudnnBackendFinalize(cudnnBackendDescriptor_t descriptor);
int cudnnBackendSetAttribute(cudnnBackendDescriptor_t descriptor, int attributeName, int attributeType,
                             int64_t elementCount, const void* arrayOfElements);
int cudnnBackendGetAttribute(cudnnBackendDescriptor_t const descriptor, int attributeName, int attributeType,
                             int64_t requestedElementCount, int64_t* elementCount, void* arrayOfElements);
int cudnnBackendExecute(cudnnHandle_t handle, cudnnBackendDescriptor_t executionPlan,
                        cudnnBackendDescriptor_t variantPack);
"""

# out-of-line module name -> declarations (abi.outofline.write_package_modules' `extra`)
MODULES = {"_ephost_cuda_driver": DRIVER, "_ephost_cublas": CUBLAS, "_ephost_cublaslt": CUBLASLT, "_ephost_cudnn": CUDNN}
