/* ephost execution-provider ABI: the single source of truth.
 *
 * Rules (see shared/ARCHITECTURE.md):
 *  - Every function table starts with `uint32_t struct_size; uint32_t version;`.
 *  - Tables are append-only. Every member carries a machine-readable tag
 *    `since N` (the ABI version that added it); `required` marks slots a plugin
 *    must fill. `abi/__init__.py` parses these tags, so keep one member per line.
 *  - Fixed-width types only: no C enum or bool inside structs.
 *  - A status pointer of NULL means success; a non-NULL status is created with
 *    EpApi.CreateStatus and released by whoever receives it.
 *  - The caller checks `version >= since && struct_size covers the slot &&
 *    slot != NULL` before every optional call.
 *
 * Version line: 1 bootstrap and kernels, 2 Sync/IsConcurrentRunSupported,
 * 3 graph capture, 4 KernelContext_GetSyncStream and ReleaseCapturedGraph,
 * 5 replay synchronised by the EP on its own graph stream, 6 compiled partitions
 * (EpApi.Graph_AddNodesToFuse, Ep.Compile, EpNodeComputeInfo and the EpCallFrame),
 * 7 compiled partitions saved and reloaded (EpNodeComputeInfo.GetContext, Ep.CompileFromContext,
 * Ep.GetCompiledModelCompatibilityInfo, EpFactory.ValidateCompiledModelCompatibilityInfo).
 *
 * A struct whose every member is newer than version N does not exist at N: the cffi
 * declarations of N name it as an opaque type only.
 */
#ifndef EPHOST_EP_ABI_H
#define EPHOST_EP_ABI_H

#include <stddef.h>
#include <stdint.h>

#define EP_ABI_VERSION 7
#define EP_ABI_MIN_VERSION 1
/* Versions at or above this value declare a future, incompatible generation. */
#define EP_ABI_NEXT_GENERATION 1000

/* Status codes. */
#define EP_OK 0
#define EP_FAIL 1
#define EP_INVALID_ARGUMENT 2
#define EP_NOT_FOUND 3
#define EP_NOT_IMPLEMENTED 4
#define EP_OUT_OF_MEMORY 5
#define EP_RUNTIME_EXCEPTION 6
#define EP_INVALID_GRAPH 7
#define EP_DEVICE_ERROR 8

/* Log severities. */
#define EP_LOG_VERBOSE 0
#define EP_LOG_INFO 1
#define EP_LOG_WARNING 2
#define EP_LOG_ERROR 3

/* Device types and memory types. */
#define EP_DEVICE_CPU 0
#define EP_DEVICE_GPU 1
#define EP_MEM_DEFAULT 0
#define EP_MEM_HOST_ACCESSIBLE 1

/* Value kinds in a graph view. */
#define EP_VALUE_INTERMEDIATE 0
#define EP_VALUE_GRAPH_INPUT 1
#define EP_VALUE_GRAPH_OUTPUT 2
#define EP_VALUE_INITIALIZER 3

/* Bits of EpValueInfo.flags (since 7; before 7 the field was `reserved` and always 0).
 * EP_VALUE_HOST_COMPUTED: the host computes this value itself from the input shapes (its shape
 * program: once per input-shape signature). Where a node reads it at an input the op reads on the
 * host (a Reshape's shape, Slice bounds: the table of abi/host_inputs.py, as onnxruntime's CUDA
 * kernels declare OrtMemTypeCPUInput), a v7+ EP's kernel gets it in host memory (an EpTensor with
 * device_type EP_DEVICE_CPU), never copied to the device; so the EP may claim that node without a
 * synchronising device read. At other inputs, and in compiled partitions, it is on the device. */
#define EP_VALUE_HOST_COMPUTED 1

/* Graph capture node-assignment policies (since 3). */
#define EP_GRAPH_ALL_NODES_ON_EP 0
#define EP_GRAPH_ALLOW_CPU_FOR_SHAPES 1

/* Answers of EpFactory.ValidateCompiledModelCompatibilityInfo (since 7; onnxruntime's
 * OrtCompiledModelCompatibility, same values). */
#define EP_COMPILED_MODEL_NOT_APPLICABLE 0
#define EP_COMPILED_MODEL_SUPPORTED_OPTIMAL 1
#define EP_COMPILED_MODEL_SUPPORTED_PREFER_RECOMPILATION 2
#define EP_COMPILED_MODEL_UNSUPPORTED 3

/* Element types are ONNX TensorProto.DataType values (1 float, 7 int64, 10 float16, ...).
 * Attribute types are ONNX AttributeProto.AttributeType values (1 FLOAT, 2 INT, 3 STRING,
 * 4 TENSOR, 6 FLOATS, 7 INTS, 8 STRINGS). */

typedef struct EpStatus EpStatus;               /* opaque, host-owned */
typedef struct EpKernelContext EpKernelContext; /* opaque, host-owned, valid during Compute */
typedef struct EpLogger EpLogger;               /* opaque, host-owned */
typedef struct EpSessionOptions EpSessionOptions; /* opaque, host-owned */

typedef struct EpKeyValue {
  const char* key;   /* since 1 */
  const char* value; /* since 1 */
} EpKeyValue;

typedef struct EpMemoryInfo {
  const char* name;    /* since 1 */
  int32_t device_type; /* since 1 */
  int32_t device_id;   /* since 1 */
  int32_t mem_type;    /* since 1 */
  uint32_t vendor_id;  /* since 1 */
} EpMemoryInfo;

typedef struct EpDevice {
  int32_t device_type;             /* since 1 */
  int32_t device_id;               /* since 1 */
  uint32_t vendor_id;              /* since 1 */
  uint32_t reserved;               /* since 1 */
  const char* name;                /* since 1 */
  const EpMemoryInfo* memory_info; /* since 1 */
} EpDevice;

/* A tensor as both sides see it. Memory is described, not owned. */
typedef struct EpTensor {
  void* data;           /* since 1 */
  const int64_t* shape; /* since 1 */
  int32_t ndim;         /* since 1 */
  int32_t elem_type;    /* since 1 */
  int32_t device_type;  /* since 1 */
  int32_t device_id;    /* since 1 */
  int64_t nbytes;       /* since 1 */
} EpTensor;

/* Read-only graph view handed to GetCapability and CreateKernel.
 * Lifetimes: everything a view points to (names, shapes, attributes, the data of a value's
 * `constant`) is host-owned and stays valid and unchanged as long as the view: the session's view
 * (GetCapability, CreateKernel) until the session is released, a fused group's view (Compile,
 * CompileFromContext) until the compute info made from it is released. An EP may therefore keep
 * pointers into a constant instead of copying it. */
typedef struct EpAttribute {
  const char* name;            /* since 1 */
  int32_t type;                /* since 1 */
  int32_t count;               /* since 1 */
  int64_t i;                   /* since 1 */
  double f;                    /* since 1 */
  const char* s;               /* since 1 */
  const int64_t* ints;         /* since 1 */
  const double* floats;        /* since 1 */
  const char* const* strings;  /* since 1 */
  const EpTensor* tensor;      /* since 1 */
} EpAttribute;

typedef struct EpValueInfo {
  const char* name;          /* since 1 */
  int32_t elem_type;         /* since 1 */
  int32_t ndim;              /* since 1 */
  const int64_t* shape;      /* since 1 */
  int32_t kind;              /* since 1 */
  int32_t flags;             /* since 1 */
  const EpTensor* constant;  /* since 1 */
} EpValueInfo;

typedef struct EpNodeView {
  const char* name;                 /* since 1 */
  const char* op_type;              /* since 1 */
  const char* domain;               /* since 1 */
  int32_t opset;                    /* since 1 */
  int32_t num_inputs;               /* since 1 */
  const int32_t* inputs;            /* since 1 */
  int32_t num_outputs;              /* since 1 */
  const int32_t* outputs;           /* since 1 */
  int32_t num_attributes;           /* since 1 */
  int32_t reserved;                 /* since 1 */
  const EpAttribute* attributes;    /* since 1 */
} EpNodeView;

typedef struct EpGraphView {
  uint32_t struct_size;         /* since 1 */
  uint32_t version;             /* since 1 */
  const char* name;             /* since 1 */
  int32_t num_nodes;            /* since 1 */
  int32_t num_values;           /* since 1 */
  const EpNodeView* nodes;      /* since 1 */
  const EpValueInfo* values;    /* since 1 */
  int32_t num_inputs;           /* since 1 */
  int32_t num_outputs;          /* since 1 */
  const int32_t* inputs;        /* since 1 */
  const int32_t* outputs;       /* since 1 */
} EpGraphView;

/* Everything a kernel reads in one call (KernelContext_GetIO). */
typedef struct EpKernelIO {
  uint32_t struct_size;       /* since 1 */
  uint32_t version;           /* since 1 */
  int32_t num_inputs;         /* since 1 */
  int32_t num_outputs;        /* since 1 */
  const EpTensor* inputs;     /* since 1 */
  void* gpu_compute_stream;   /* since 1 */
} EpKernelIO;

typedef struct EpRunOptions {
  uint32_t struct_size;        /* since 1 */
  uint32_t version;            /* since 1 */
  int32_t num_entries;         /* since 1 */
  int32_t reserved;            /* since 1 */
  const EpKeyValue* entries;   /* since 1 */
} EpRunOptions;

typedef struct EpSyncStream EpSyncStream;

typedef struct EpNotification {
  uint32_t struct_size;                                                          /* since 1 */
  uint32_t version;                                                              /* since 1 */
  EpStatus* (*Activate)(struct EpNotification* self);                            /* since 1, required */
  EpStatus* (*WaitOnDevice)(struct EpNotification* self, EpSyncStream* consumer); /* since 1, required */
  EpStatus* (*WaitOnHost)(struct EpNotification* self);                          /* since 1, required */
  void (*Release)(struct EpNotification* self);                                  /* since 1, required */
} EpNotification;

struct EpSyncStream {
  uint32_t struct_size;                                                             /* since 1 */
  uint32_t version;                                                                 /* since 1 */
  void* (*GetHandle)(struct EpSyncStream* self);                                    /* since 1, required */
  EpStatus* (*CreateNotification)(struct EpSyncStream* self, EpNotification** out); /* since 1, required */
  EpStatus* (*Flush)(struct EpSyncStream* self);                                    /* since 1 */
  EpStatus* (*OnSessionRunEnd)(struct EpSyncStream* self);                          /* since 1 */
  void (*Release)(struct EpSyncStream* self);                                       /* since 1, required */
};

typedef struct EpAllocator {
  uint32_t struct_size;                                                                      /* since 1 */
  uint32_t version;                                                                          /* since 1 */
  EpStatus* (*Alloc)(struct EpAllocator* self, size_t size, void** out);                     /* since 1, required */
  void (*Free)(struct EpAllocator* self, void* p);                                           /* since 1, required */
  const EpMemoryInfo* (*Info)(const struct EpAllocator* self);                               /* since 1, required */
  EpStatus* (*AllocOnStream)(struct EpAllocator* self, size_t size, EpSyncStream* stream, void** out); /* since 1 */
} EpAllocator;

typedef struct EpDataTransfer {
  uint32_t struct_size; /* since 1 */
  uint32_t version;     /* since 1 */
  int32_t (*CanCopy)(const struct EpDataTransfer* self, const EpMemoryInfo* src, const EpMemoryInfo* dst); /* since 1, required */
  EpStatus* (*CopyTensors)(struct EpDataTransfer* self, const EpTensor* src, EpTensor* dst, EpSyncStream* const* streams, size_t count); /* since 1, required */
  void (*Release)(struct EpDataTransfer* self); /* since 1, required */
} EpDataTransfer;

typedef struct EpKernel {
  uint32_t struct_size;                                                  /* since 1 */
  uint32_t version;                                                      /* since 1 */
  EpStatus* (*Compute)(struct EpKernel* self, EpKernelContext* context); /* since 1, required */
  void (*Release)(struct EpKernel* self);                                /* since 1, required */
} EpKernel;

/* ---- compiled partitions (since 6) -------------------------------------------------------
 * During GetCapability an EP may hand the host groups of node indices to fuse
 * (EpApi.Graph_AddNodesToFuse, next to the per-node `claimed` array). The host accepts a group
 * when none of its nodes was taken by an EP of higher priority and fusing it creates no cycle;
 * it then calls Ep.Compile once per EP with every accepted group: graphs[i] is a view of just
 * the group's nodes (its inputs are the values the group reads from outside, initializers
 * excluded: those are values of kind EP_VALUE_INITIALIZER with a constant; its outputs are the
 * values read after the group), fused_nodes[i] the node that replaces the group (its name
 * names the partition in errors; its inputs/outputs index graphs[i]'s values). The EP returns
 * one EpNodeComputeInfo per group, or an error status: the host then runs the group's nodes
 * through per-node kernels (those also marked in `claimed`) and the CPU EP.
 *
 * At run time the host calls Compute once per partition and run with one EpCallFrame that it
 * laid out before the call. Outputs whose shapes are static are preallocated by the host on
 * the EP's device (data != NULL): such a call makes no callback. An output with data == NULL
 * (dims holds the inferred dims, -1 for unknown ones, or rank is -1) is allocated through
 * AllocateOutput, which also fills outputs[index]. Scratch memory from AllocScratch is tagged
 * with the frame's sync stream; what Compute does not free is freed by the host after it. */

/* One tensor of a call frame: memory on the EP's device, dense, row-major. */
typedef struct EpFrameTensor {
  void* data;           /* since 6 */
  const int64_t* dims;  /* since 6 */
  int32_t rank;         /* since 6 */
  int32_t elem_type;    /* since 6 */
} EpFrameTensor;

/* Everything one Compute call reads, in one struct (host-owned, valid during the call). */
typedef struct EpCallFrame {
  uint32_t struct_size;                                                                          /* since 6 */
  uint32_t version;                                                                              /* since 6 */
  void* stream;                                                                                  /* since 6 */
  EpSyncStream* sync_stream;                                                                     /* since 6 */
  int32_t capturing;                                                                             /* since 6 */
  int32_t error_node;                                                                            /* since 6 */
  int32_t num_inputs;                                                                            /* since 6 */
  int32_t num_outputs;                                                                           /* since 6 */
  const EpFrameTensor* inputs;                                                                   /* since 6 */
  EpFrameTensor* outputs;                                                                        /* since 6 */
  EpStatus* (*AllocateOutput)(void* context, int32_t index, const int64_t* dims, int32_t rank, void** data); /* since 6 */
  void* allocate_context;                                                                        /* since 6 */
  EpStatus* (*AllocScratch)(void* context, size_t nbytes, void** data);                          /* since 6 */
  void (*FreeScratch)(void* context, void* data);                                                /* since 6 */
  void* scratch_context;                                                                         /* since 6 */
} EpCallFrame;
/* stream: the GPU stream handle of sync_stream (NULL on a CPU EP or one without streams).
 * capturing: 1 while the run belongs to graph capture of a graph id not yet captured (warm-up
 * or capture): Compute must be capture-safe (no host synchronisation, no allocation outside the
 * frame). error_node: -1 on entry; an EP that fails may store the index (into graphs[i]'s
 * nodes) of the node that failed, and the host names it in the error. */

/* What the EP returns per fused node. CreateState may be NULL (state is then NULL). */
typedef struct EpNodeComputeInfo {
  uint32_t struct_size;                                                                          /* since 6 */
  uint32_t version;                                                                              /* since 6 */
  EpStatus* (*CreateState)(struct EpNodeComputeInfo* self, void** state);                        /* since 6 */
  EpStatus* (*Compute)(struct EpNodeComputeInfo* self, void* state, EpCallFrame* frame);         /* since 6, required */
  void (*ReleaseState)(struct EpNodeComputeInfo* self, void* state);                             /* since 6 */
  void (*Release)(struct EpNodeComputeInfo* self);                                               /* since 6, required */
  EpStatus* (*GetContext)(struct EpNodeComputeInfo* self, const void** data, size_t* size);      /* since 7 */
} EpNodeComputeInfo;
/* ---- saved compiled partitions (since 7) -------------------------------------------------
 * GetContext: the compiled form of this fused node as bytes the EP can rebuild it from
 * (CompileFromContext) without the subgraph; the bytes are EP-owned and stay valid until
 * Release. *data == NULL (or *size == 0) means "no context": the host keeps the group's nodes
 * in a saved model and compiles them again when it is loaded. Called only when the session
 * writes a context model (session config ep.context_enable=1); where the bytes go (embedded in
 * the model, or a file beside it: ep.context_embed_mode) is the host's business.
 *
 * Ep.CompileFromContext: rebuild the compute info of a saved fused node. `data`/`size` are the
 * context's bytes, host-owned and valid until the compute info made from them is released (the
 * host may map them from a file: an EP keeps views of them rather than a copy). `graph` shows the
 * fused node alone (its inputs and outputs with their types and shapes, no subgraph); fused_node
 * is that node (its name is the partition name the node was saved under). An error status
 * (a corrupt or truncated blob, another device) makes the host compile the kept subgraph.
 *
 * Ep.GetCompiledModelCompatibilityInfo: a string naming what the EP's compiled contexts depend
 * on (plugin version, ABI, device architecture, library versions), written into a saved model
 * (NULL: none). EpFactory.ValidateCompiledModelCompatibilityInfo judges such a string against
 * `devices` and writes one of EP_COMPILED_MODEL_* into *compatibility. */

typedef struct Ep {
  uint32_t struct_size;                                                                         /* since 1 */
  uint32_t version;                                                                             /* since 1 */
  const char* (*GetName)(const struct Ep* self);                                                /* since 1, required */
  EpStatus* (*GetCapability)(struct Ep* self, const EpGraphView* graph, uint8_t* claimed);      /* since 1, required */
  EpStatus* (*CreateKernel)(struct Ep* self, const EpGraphView* graph, int32_t node, EpKernel** out); /* since 1, required */
  EpStatus* (*OnRunStart)(struct Ep* self, const EpRunOptions* run_options);                    /* since 1 */
  EpStatus* (*OnRunEnd)(struct Ep* self, const EpRunOptions* run_options, int32_t sync_stream); /* since 1 */
  EpStatus* (*CreateAllocator)(struct Ep* self, const EpMemoryInfo* info, EpAllocator** out);  /* since 1 */
  EpStatus* (*CreateSyncStreamForDevice)(struct Ep* self, const EpMemoryInfo* info, EpSyncStream** out); /* since 1 */
  EpStatus* (*Sync)(struct Ep* self);                                                           /* since 2 */
  EpStatus* (*IsConcurrentRunSupported)(struct Ep* self, int32_t* supported);                   /* since 2 */
  int32_t (*IsGraphCaptureEnabled)(const struct Ep* self);                                      /* since 3 */
  int32_t (*IsGraphCaptured)(const struct Ep* self, int32_t graph_id);                          /* since 3 */
  EpStatus* (*ReplayGraph)(struct Ep* self, int32_t graph_id);                                  /* since 3 */
  int32_t (*GetGraphCaptureNodeAssignmentPolicy)(const struct Ep* self);                        /* since 3 */
  EpStatus* (*ReleaseCapturedGraph)(struct Ep* self, int32_t graph_id);                         /* since 4 */
  EpStatus* (*ReplayGraphWithSync)(struct Ep* self, int32_t graph_id, int32_t sync);            /* since 5 */
  EpStatus* (*Compile)(struct Ep* self, const EpGraphView* const* graphs, const EpNodeView* fused_nodes, size_t count, EpNodeComputeInfo** compute_infos_out); /* since 6 */
  EpStatus* (*CompileFromContext)(struct Ep* self, const EpGraphView* graph, const EpNodeView* fused_node, const void* data, size_t size, EpNodeComputeInfo** compute_info_out); /* since 7 */
  const char* (*GetCompiledModelCompatibilityInfo)(struct Ep* self, const EpGraphView* graph); /* since 7 */
} Ep;

typedef struct EpFactory {
  uint32_t struct_size;                                                                  /* since 1 */
  uint32_t version;                                                                      /* since 1 */
  const char* (*GetName)(const struct EpFactory* self);                                  /* since 1, required */
  const char* (*GetVendor)(const struct EpFactory* self);                                /* since 1, required */
  const char* (*GetVersion)(const struct EpFactory* self);                               /* since 1 */
  EpStatus* (*GetSupportedDevices)(struct EpFactory* self, EpDevice* devices, size_t max_devices, size_t* num_devices); /* since 1, required */
  EpStatus* (*CreateEp)(struct EpFactory* self, const EpDevice* devices, size_t num_devices, const EpKeyValue* options, size_t num_options, const EpSessionOptions* session_options, const EpLogger* logger, Ep** out); /* since 1, required */
  void (*ReleaseEp)(struct EpFactory* self, Ep* ep);                                     /* since 1, required */
  EpStatus* (*CreateAllocator)(struct EpFactory* self, const EpMemoryInfo* info, EpAllocator** out); /* since 1 */
  void (*ReleaseAllocator)(struct EpFactory* self, EpAllocator* allocator);              /* since 1 */
  EpStatus* (*CreateDataTransfer)(struct EpFactory* self, EpDataTransfer** out);        /* since 1 */
  int32_t (*IsStreamAware)(const struct EpFactory* self);                                /* since 1 */
  EpStatus* (*CreateSyncStreamForDevice)(struct EpFactory* self, const EpMemoryInfo* info, EpSyncStream** out); /* since 1 */
  EpStatus* (*ValidateCompiledModelCompatibilityInfo)(struct EpFactory* self, const EpDevice* devices, size_t num_devices, const char* compatibility_info, int32_t* compatibility); /* since 7 */
} EpFactory;

/* The host's table. A plugin obtains it with EpApiBase.GetApi(version). */
typedef struct EpApi {
  uint32_t struct_size;                                                           /* since 1 */
  uint32_t version;                                                               /* since 1 */
  EpStatus* (*CreateStatus)(int32_t code, const char* message);                   /* since 1, required */
  int32_t (*GetErrorCode)(const EpStatus* status);                                /* since 1, required */
  const char* (*GetErrorMessage)(const EpStatus* status);                         /* since 1, required */
  void (*ReleaseStatus)(EpStatus* status);                                        /* since 1, required */
  void (*Logger_Log)(const EpLogger* logger, int32_t severity, const char* message); /* since 1, required */
  EpStatus* (*SessionOptions_GetConfigEntry)(const EpSessionOptions* options, const char* key, char* value, size_t* size); /* since 1, required */
  EpStatus* (*KernelContext_GetIO)(EpKernelContext* context, const EpKernelIO** io); /* since 1, required */
  EpStatus* (*KernelContext_GetOutput)(EpKernelContext* context, int32_t index, const int64_t* shape, int32_t ndim, EpTensor** out); /* since 1, required */
  EpStatus* (*KernelContext_GetGPUComputeStream)(EpKernelContext* context, void** stream); /* since 1, required */
  EpStatus* (*KernelContext_GetSyncStream)(EpKernelContext* context, EpSyncStream** stream); /* since 4, required */
  EpStatus* (*Graph_AddNodesToFuse)(const EpGraphView* graph, const int32_t* nodes, size_t count); /* since 6, required */
} EpApi;

typedef struct EpApiBase {
  uint32_t struct_size;                          /* since 1 */
  uint32_t version;                              /* since 1 */
  const EpApi* (*GetApi)(uint32_t version);      /* since 1, required */
  const char* (*GetVersionString)(void);         /* since 1, required */
} EpApiBase;

/* Exported by every plugin library. */
EpStatus* CreateEpFactories(const char* registration_name, const EpApiBase* api_base, const EpLogger* logger, EpFactory** factories, size_t max_factories, size_t* num_factories);
EpStatus* ReleaseEpFactory(EpFactory* factory);

#endif /* EPHOST_EP_ABI_H */
