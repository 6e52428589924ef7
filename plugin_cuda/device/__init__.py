"""The CUDA device layer of the plugin: what the per-node kernels (plugin_cuda/kernels) and the
compiled plans (plugin_cuda/plan) both import. One concept per module:

  streams   stream_scope (a raw stream as CuPy's current stream, not owned), launch geometry
            (grid_1d, row_threads), kernel-argument packing (arg_ptr)
  nvrtc     NVRTC compilation with its one cache (in process per device and source hash, on disk
            through CuPy's kernel cache): load() for generated modules, KernelLibrary for the raw
            per-dtype sources, elementwise_table for CuPy ElementwiseKernels
  driver    libcuda through cffi: cuLaunchKernel, cuMemcpyAsync, one error funnel (check)
  capture   capture modes, the sticky-error reset after a failed capture, Graph (driver-level
            capture of a callable's launches, ended in finally)
  cublas    cuBLAS handles bound to a stream (with their workspace), MatMul / Gemm, check()
  cublaslt  cuBLASLt GEMMs with a bias (and ReLU) epilogue
  memory    the EP's device memory (CuPy pool, stream-ordered pool or an external allocator)
  errors    DriverError

Importing the package needs neither CuPy nor a GPU (CuPy is resolved when a device is used).
"""
