/* ExampleCEP: an EP plugin in plain C, written against ep_abi.h alone.
 *
 * It shows that the ABI needs no Python on the plugin side: one factory, one CPU device, an Ep
 * that claims float32 Add nodes whose inputs and output have one known shape (no broadcasting),
 * and a kernel that adds into the output the host allocates. Every host object is reached
 * through the EpApi negotiated at CreateEpFactories (GetApi(min(EP_ABI_VERSION, host))); each
 * factory keeps its own, so one process can register the library with hosts of different
 * versions. Live factories, EPs and kernels are counted for leak tests (ExampleC_LiveObjects).
 *
 * Built for ABI EXAMPLE_C_ABI (default EP_ABI_VERSION; build.py passes -DEXAMPLE_C_ABI=N for
 * older versions): every table declares that version and is sized for it. From v6 it compiles
 * partitions: each run of two or more consecutive claimable Add nodes (a range of the
 * topological order, so fusing it never makes a cycle) is claimed as one fused group
 * (EpApi.Graph_AddNodesToFuse, only where the host serves it), and Ep.Compile turns the group
 * into a program: per node the slots of its operands, constants copied, intermediates in the
 * state's buffer. Compute runs the whole chain from one call frame (ExampleC_ComputeCalls
 * counts those calls, ExampleC_KernelCalls the per-node ones).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_abi.h"

#define EP_NAME "ExampleCEP"
#define EP_VENDOR "ephost-tests"
#define EP_PLUGIN_VERSION "1.0.0"
#define ELEM_FLOAT 1

#ifndef EXAMPLE_C_ABI
#define EXAMPLE_C_ABI EP_ABI_VERSION
#endif
#if EXAMPLE_C_ABI < EP_ABI_MIN_VERSION || EXAMPLE_C_ABI > EP_ABI_VERSION
#error "EXAMPLE_C_ABI is outside the versions ep_abi.h describes"
#endif

/* A slot is usable when the table's version and struct_size cover it and it is not NULL. */
#define COVERS(table, type, slot, since) \
  ((table)->version >= (since) && (table)->struct_size >= offsetof(type, slot) + sizeof((table)->slot) && \
   (table)->slot != NULL)

static int g_live = 0;
static int g_compute_calls = 0;
static int g_kernel_calls = 0;

int ExampleC_LiveObjects(void);
int ExampleC_LiveObjects(void) { return __atomic_load_n(&g_live, __ATOMIC_SEQ_CST); }
int ExampleC_ComputeCalls(void);
int ExampleC_ComputeCalls(void) { return __atomic_load_n(&g_compute_calls, __ATOMIC_SEQ_CST); }
int ExampleC_KernelCalls(void);
int ExampleC_KernelCalls(void) { return __atomic_load_n(&g_kernel_calls, __ATOMIC_SEQ_CST); }

static void live_add(int delta) { __atomic_add_fetch(&g_live, delta, __ATOMIC_SEQ_CST); }

typedef struct CFactory {
  EpFactory table; /* first: the host's EpFactory* is a CFactory* */
  const EpApi* api;
  const EpLogger* logger;
  EpMemoryInfo memory;
} CFactory;

typedef struct CEp {
  Ep table;
  const EpApi* api;
  const EpLogger* logger;
} CEp;

typedef struct CKernel {
  EpKernel table;
  const EpApi* api;
} CKernel;

static EpStatus* error(const EpApi* api, int32_t code, const char* fmt, ...) __attribute__((format(printf, 3, 4)));

/* Every error goes back as a host status (EpApi.CreateStatus copies the message). */
static EpStatus* error(const EpApi* api, int32_t code, const char* fmt, ...) {
  char text[256];
  char message[320];
  va_list args;
  va_start(args, fmt);
  vsnprintf(text, sizeof text, fmt, args);
  va_end(args);
  snprintf(message, sizeof message, "%s: %s", EP_NAME, text);
  return api->CreateStatus(code, message);
}

static void log_info(const EpApi* api, const EpLogger* logger, const char* message) {
  if (logger != NULL) api->Logger_Log(logger, EP_LOG_INFO, message);
}

/* ---- the kernel ------------------------------------------------------------------------ */

static int64_t element_count(const int64_t* shape, int32_t ndim) {
  int64_t n = 1;
  for (int32_t d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

static int same_shape(const EpTensor* a, const EpTensor* b) {
  if (a->ndim != b->ndim) return 0;
  for (int32_t d = 0; d < a->ndim; ++d)
    if (a->shape[d] != b->shape[d]) return 0;
  return 1;
}

static EpStatus* add_compute(EpKernel* self, EpKernelContext* context) {
  CKernel* k = (CKernel*)self;
  const EpApi* api = k->api;
  const EpKernelIO* io = NULL;
  __atomic_add_fetch(&g_kernel_calls, 1, __ATOMIC_SEQ_CST);
  EpStatus* st = api->KernelContext_GetIO(context, &io);
  if (st != NULL) return st;
  if (io == NULL || io->num_inputs != 2 || io->inputs == NULL)
    return error(api, EP_INVALID_ARGUMENT, "Add needs 2 inputs");
  const EpTensor* a = &io->inputs[0];
  const EpTensor* b = &io->inputs[1];
  if (a->elem_type != ELEM_FLOAT || b->elem_type != ELEM_FLOAT)
    return error(api, EP_INVALID_ARGUMENT, "Add supports float32 inputs only");
  if (a->device_type != EP_DEVICE_CPU || b->device_type != EP_DEVICE_CPU)
    return error(api, EP_INVALID_ARGUMENT, "Add reads CPU memory only");
  if (!same_shape(a, b)) return error(api, EP_INVALID_ARGUMENT, "Add inputs differ in shape (no broadcasting)");
  int64_t n = element_count(a->shape, a->ndim);
  if (a->nbytes < n * (int64_t)sizeof(float) || b->nbytes < n * (int64_t)sizeof(float))
    return error(api, EP_INVALID_ARGUMENT, "an input holds fewer bytes than its shape needs");

  /* The framework stream (v4) is only asked for where the host serves it; a CPU kernel has
   * nothing to tag with it, but the call proves the version gate. */
  if (COVERS(api, EpApi, KernelContext_GetSyncStream, 4)) {
    EpSyncStream* stream = NULL;
    st = api->KernelContext_GetSyncStream(context, &stream);
    if (st != NULL) return st;
  }

  EpTensor* out = NULL;
  st = api->KernelContext_GetOutput(context, 0, a->shape, a->ndim, &out);
  if (st != NULL) return st;
  if (out == NULL || out->elem_type != ELEM_FLOAT || out->nbytes < n * (int64_t)sizeof(float) ||
      (n > 0 && out->data == NULL))
    return error(api, EP_FAIL, "the host returned an unusable output tensor");
  const float* x = (const float*)a->data;
  const float* y = (const float*)b->data;
  float* z = (float*)out->data;
  for (int64_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
  return NULL;
}

static void kernel_release(EpKernel* self) {
  if (self == NULL) return;
  free(self);
  live_add(-1);
}

/* ---- the Ep ---------------------------------------------------------------------------- */

static const char* ep_get_name(const Ep* self) {
  (void)self;
  return EP_NAME;
}

static int known_float(const EpGraphView* g, int32_t value) {
  if (value < 0 || value >= g->num_values) return 0;
  const EpValueInfo* v = &g->values[value];
  if (v->elem_type != ELEM_FLOAT || v->ndim < 0 || (v->ndim > 0 && v->shape == NULL)) return 0;
  for (int32_t d = 0; d < v->ndim; ++d)
    if (v->shape[d] < 0) return 0; /* an unknown dimension cannot be proven equal */
  return 1;
}

static int same_value_shape(const EpGraphView* g, int32_t a, int32_t b) {
  const EpValueInfo* x = &g->values[a];
  const EpValueInfo* y = &g->values[b];
  if (x->ndim != y->ndim) return 0;
  for (int32_t d = 0; d < x->ndim; ++d)
    if (x->shape[d] != y->shape[d]) return 0;
  return 1;
}

static int claimable(const EpGraphView* g, int32_t index) {
  if (index < 0 || index >= g->num_nodes) return 0;
  const EpNodeView* n = &g->nodes[index];
  if (n->op_type == NULL || strcmp(n->op_type, "Add") != 0) return 0;
  if (n->domain != NULL && n->domain[0] != '\0') return 0;
  if (n->num_inputs != 2 || n->num_outputs != 1 || n->inputs == NULL || n->outputs == NULL) return 0;
  int32_t a = n->inputs[0], b = n->inputs[1], c = n->outputs[0];
  if (!known_float(g, a) || !known_float(g, b) || !known_float(g, c)) return 0;
  return same_value_shape(g, a, b) && same_value_shape(g, a, c);
}

#if EXAMPLE_C_ABI >= 6
/* Claims each run of >= 2 consecutive claimable nodes as a fused group (v6 hosts only). */
static EpStatus* claim_fused_runs(CEp* ep, const EpGraphView* graph) {
  int32_t start = 0;
  while (start < graph->num_nodes) {
    if (!claimable(graph, start)) {
      ++start;
      continue;
    }
    int32_t end = start;
    while (end + 1 < graph->num_nodes && claimable(graph, end + 1)) ++end;
    if (end > start) {
      int32_t nodes[64];
      int32_t count = 0;
      for (int32_t i = start; i <= end && count < 64; ++i) nodes[count++] = i;
      EpStatus* st = ep->api->Graph_AddNodesToFuse(graph, nodes, (size_t)count);
      if (st != NULL) return st;
      start += count;
      continue;
    }
    start = end + 1;
  }
  return NULL;
}
#endif

static EpStatus* ep_get_capability(Ep* self, const EpGraphView* graph, uint8_t* claimed) {
  CEp* ep = (CEp*)self;
  if (graph == NULL || (graph->num_nodes > 0 && (graph->nodes == NULL || claimed == NULL)))
    return error(ep->api, EP_INVALID_ARGUMENT, "GetCapability got a NULL graph or claim array");
  /* Every claimable node is also claimed singly: if compiling fails, its kernel runs instead. */
  for (int32_t i = 0; i < graph->num_nodes; ++i)
    if (claimable(graph, i)) claimed[i] = 1;
#if EXAMPLE_C_ABI >= 6
  if (COVERS(ep->api, EpApi, Graph_AddNodesToFuse, 6)) return claim_fused_runs(ep, graph);
#endif
  return NULL;
}

static EpStatus* ep_create_kernel(Ep* self, const EpGraphView* graph, int32_t node, EpKernel** out) {
  CEp* ep = (CEp*)self;
  if (graph == NULL || out == NULL) return error(ep->api, EP_INVALID_ARGUMENT, "CreateKernel got NULL");
  *out = NULL;
  if (node < 0 || node >= graph->num_nodes)
    return error(ep->api, EP_INVALID_ARGUMENT, "CreateKernel: node index out of range");
  if (!claimable(graph, node)) {
    const char* name = graph->nodes[node].name;
    return error(ep->api, EP_NOT_IMPLEMENTED, "no kernel for node '%s' (float32 Add of one shape only)",
                 name != NULL ? name : "");
  }
  CKernel* k = calloc(1, sizeof *k);
  if (k == NULL) return error(ep->api, EP_OUT_OF_MEMORY, "out of memory creating a kernel");
  k->table.struct_size = sizeof(EpKernel);
  k->table.version = EXAMPLE_C_ABI;
  k->table.Compute = add_compute;
  k->table.Release = kernel_release;
  k->api = ep->api;
  live_add(1);
  *out = &k->table;
  return NULL;
}

#if EXAMPLE_C_ABI >= 6
/* ---- compiled partitions (v6) ------------------------------------------------------------ */

/* Where a value of a fused graph lives at run time. */
enum { SLOT_INPUT = 0, SLOT_OUTPUT = 1, SLOT_CONSTANT = 2, SLOT_TEMP = 3 };
#define MAX_FUSED_VALUES 512

typedef struct CSlot {
  int32_t where;
  int32_t index; /* frame input/output index, or temp number */
  float* constant;
} CSlot;

typedef struct CCompute {
  EpNodeComputeInfo table; /* first: the host's EpNodeComputeInfo* is a CCompute* */
  const EpApi* api;
  int32_t num_nodes;
  int32_t num_values;
  int32_t num_temps;
  int32_t rank;
  int64_t count;    /* elements per tensor: one shape for the whole chain */
  int32_t* program; /* per node: operand a, operand b, result (value indices) */
  CSlot* slots;     /* per value of the fused graph */
  int64_t* dims;
  char name[128];
} CCompute;

static void compute_info_free(CCompute* c) {
  if (c == NULL) return;
  for (int32_t v = 0; v < c->num_values && c->slots != NULL; ++v) free(c->slots[v].constant);
  free(c->slots);
  free(c->program);
  free(c->dims);
  free(c);
}

static EpStatus* compute_create_state(EpNodeComputeInfo* self, void** state) {
  CCompute* c = (CCompute*)self;
  size_t temps = (size_t)(c->num_temps > 0 ? c->num_temps : 1);
  size_t count = (size_t)(c->count > 0 ? c->count : 1);
  *state = malloc(temps * count * sizeof(float)); /* the intermediates of the chain */
  if (*state == NULL) return error(c->api, EP_OUT_OF_MEMORY, "out of memory for the state of '%s'", c->name);
  live_add(1);
  return NULL;
}

static void compute_release_state(EpNodeComputeInfo* self, void* state) {
  (void)self;
  if (state == NULL) return;
  free(state);
  live_add(-1);
}

/* The memory of value v: a frame tensor, a constant, or an intermediate of the state. */
static EpStatus* value_memory(CCompute* c, void* state, EpCallFrame* frame, int32_t v, float** out) {
  const CSlot* s = &c->slots[v];
  const EpApi* api = c->api;
  *out = NULL;
  if (s->where == SLOT_CONSTANT) {
    *out = s->constant;
  } else if (s->where == SLOT_TEMP) {
    *out = (float*)state + (int64_t)s->index * c->count;
  } else if (s->where == SLOT_INPUT) {
    if (s->index >= frame->num_inputs) return error(api, EP_INVALID_ARGUMENT, "the frame lacks input %d", s->index);
    const EpFrameTensor* t = &frame->inputs[s->index];
    if (t->elem_type != ELEM_FLOAT || t->rank < 0 || element_count(t->dims, t->rank) != c->count)
      return error(api, EP_INVALID_ARGUMENT, "input %d of '%s' is not %lld float32 values", s->index, c->name,
                   (long long)c->count);
    *out = (float*)t->data;
  } else {
    if (s->index >= frame->num_outputs) return error(api, EP_INVALID_ARGUMENT, "the frame lacks output %d", s->index);
    EpFrameTensor* t = &frame->outputs[s->index];
    if (t->data == NULL) { /* not preallocated: ask the host through the frame */
      void* data = NULL;
      EpStatus* st = frame->AllocateOutput(frame->allocate_context, s->index, c->dims, c->rank, &data);
      if (st != NULL) return st;
    }
    *out = (float*)t->data;
  }
  if (*out == NULL && c->count > 0) return error(api, EP_FAIL, "value %d of '%s' has no memory", v, c->name);
  return NULL;
}

static EpStatus* compute_run(EpNodeComputeInfo* self, void* state, EpCallFrame* frame) {
  CCompute* c = (CCompute*)self;
  __atomic_add_fetch(&g_compute_calls, 1, __ATOMIC_SEQ_CST);
  if (frame == NULL || frame->version < 6 || state == NULL)
    return error(c->api, EP_INVALID_ARGUMENT, "Compute of '%s' got no frame or no state", c->name);
  float* base[MAX_FUSED_VALUES];
  for (int32_t v = 0; v < c->num_values; ++v) {
    EpStatus* st = value_memory(c, state, frame, v, &base[v]);
    if (st != NULL) return st;
  }
  for (int32_t n = 0; n < c->num_nodes; ++n) {
    const float* x = base[c->program[3 * n]];
    const float* y = base[c->program[3 * n + 1]];
    float* z = base[c->program[3 * n + 2]];
    for (int64_t i = 0; i < c->count; ++i) z[i] = x[i] + y[i];
  }
  return NULL;
}

static void compute_release(EpNodeComputeInfo* self) {
  if (self == NULL) return;
  compute_info_free((CCompute*)self);
  live_add(-1);
}

static int32_t position_in(const int32_t* list, int32_t count, int32_t value) {
  for (int32_t i = 0; i < count; ++i)
    if (list[i] == value) return i;
  return -1;
}

static EpStatus* fill_slots(CCompute* c, const EpGraphView* g) {
  for (int32_t v = 0; v < g->num_values; ++v) {
    CSlot* s = &c->slots[v];
    const EpValueInfo* info = &g->values[v];
    int32_t in = position_in(g->inputs, g->num_inputs, v);
    int32_t out = position_in(g->outputs, g->num_outputs, v);
    if (info->constant != NULL) {
      s->where = SLOT_CONSTANT;
      s->constant = malloc((size_t)(c->count > 0 ? c->count : 1) * sizeof(float));
      if (s->constant == NULL || info->constant->nbytes < c->count * (int64_t)sizeof(float))
        return error(c->api, EP_INVALID_GRAPH, "Compile: constant '%s' is unusable", info->name);
      memcpy(s->constant, info->constant->data, (size_t)c->count * sizeof(float));
    } else if (in >= 0) {
      s->where = SLOT_INPUT;
      s->index = in;
    } else if (out >= 0) {
      s->where = SLOT_OUTPUT;
      s->index = out;
    } else {
      s->where = SLOT_TEMP;
      s->index = c->num_temps++;
    }
  }
  return NULL;
}

/* One fused graph into a program; the graph view is read here only, never after Compile. */
static EpStatus* compile_one(CEp* ep, const EpGraphView* g, const EpNodeView* fused, EpNodeComputeInfo** out) {
  const EpApi* api = ep->api;
  *out = NULL;
  if (g == NULL || g->num_nodes < 1 || g->num_values > MAX_FUSED_VALUES)
    return error(api, EP_INVALID_GRAPH, "Compile: an empty or too large fused graph");
  for (int32_t i = 0; i < g->num_nodes; ++i)
    if (!claimable(g, i))
      return error(api, EP_INVALID_GRAPH, "Compile: node '%s' is not a float32 Add of one shape",
                   g->nodes[i].name != NULL ? g->nodes[i].name : "");
  CCompute* c = calloc(1, sizeof *c);
  if (c == NULL) return error(api, EP_OUT_OF_MEMORY, "Compile: out of memory");
  c->api = api;
  c->num_nodes = g->num_nodes;
  c->num_values = g->num_values;
  snprintf(c->name, sizeof c->name, "%s", fused != NULL && fused->name != NULL ? fused->name : "?");
  const EpValueInfo* first = &g->values[g->nodes[0].outputs[0]];
  c->rank = first->ndim;
  c->count = element_count(first->shape, first->ndim);
  c->dims = calloc((size_t)(c->rank > 0 ? c->rank : 1), sizeof(int64_t));
  c->program = calloc((size_t)(3 * g->num_nodes), sizeof(int32_t));
  c->slots = calloc((size_t)g->num_values, sizeof(CSlot));
  if (c->dims == NULL || c->program == NULL || c->slots == NULL) {
    compute_info_free(c);
    return error(api, EP_OUT_OF_MEMORY, "Compile: out of memory");
  }
  for (int32_t d = 0; d < c->rank; ++d) c->dims[d] = first->shape[d];
  for (int32_t n = 0; n < g->num_nodes; ++n) {
    c->program[3 * n] = g->nodes[n].inputs[0];
    c->program[3 * n + 1] = g->nodes[n].inputs[1];
    c->program[3 * n + 2] = g->nodes[n].outputs[0];
  }
  EpStatus* st = fill_slots(c, g);
  if (st != NULL) {
    compute_info_free(c);
    return st;
  }
  c->table.struct_size = sizeof(EpNodeComputeInfo);
  c->table.version = EXAMPLE_C_ABI;
  c->table.CreateState = compute_create_state;
  c->table.Compute = compute_run;
  c->table.ReleaseState = compute_release_state;
  c->table.Release = compute_release;
  live_add(1);
  *out = &c->table;
  return NULL;
}

static EpStatus* ep_compile(Ep* self, const EpGraphView* const* graphs, const EpNodeView* fused_nodes, size_t count,
                            EpNodeComputeInfo** compute_infos_out) {
  CEp* ep = (CEp*)self;
  if (graphs == NULL || compute_infos_out == NULL) return error(ep->api, EP_INVALID_ARGUMENT, "Compile got NULL");
  for (size_t i = 0; i < count; ++i) {
    EpStatus* st = compile_one(ep, graphs[i], fused_nodes != NULL ? &fused_nodes[i] : NULL, &compute_infos_out[i]);
    if (st != NULL) { /* all or nothing: release what this call made */
      for (size_t j = 0; j < i; ++j) {
        compute_release(compute_infos_out[j]);
        compute_infos_out[j] = NULL;
      }
      return st;
    }
  }
  return NULL;
}
#endif

/* The size of the Ep table at the version this library is built for. */
static uint32_t ep_struct_size(void) {
#if EXAMPLE_C_ABI >= 6
  return (uint32_t)sizeof(Ep);
#elif EXAMPLE_C_ABI == 5
  return (uint32_t)offsetof(Ep, Compile);
#elif EXAMPLE_C_ABI == 4
  return (uint32_t)offsetof(Ep, ReplayGraphWithSync);
#elif EXAMPLE_C_ABI == 3
  return (uint32_t)offsetof(Ep, ReleaseCapturedGraph);
#elif EXAMPLE_C_ABI == 2
  return (uint32_t)offsetof(Ep, IsGraphCaptureEnabled);
#else
  return (uint32_t)offsetof(Ep, Sync);
#endif
}

#if EXAMPLE_C_ABI >= 2
static EpStatus* ep_is_concurrent_run_supported(Ep* self, int32_t* supported) {
  CEp* ep = (CEp*)self;
  if (supported == NULL) return error(ep->api, EP_INVALID_ARGUMENT, "IsConcurrentRunSupported got NULL");
  *supported = 1; /* kernels hold no state between calls */
  return NULL;
}
#endif

/* ---- the factory ----------------------------------------------------------------------- */

static const char* factory_get_name(const EpFactory* self) {
  (void)self;
  return EP_NAME;
}

static const char* factory_get_vendor(const EpFactory* self) {
  (void)self;
  return EP_VENDOR;
}

static const char* factory_get_version(const EpFactory* self) {
  (void)self;
  return EP_PLUGIN_VERSION;
}

static EpStatus* factory_get_supported_devices(EpFactory* self, EpDevice* devices, size_t max_devices,
                                               size_t* num_devices) {
  CFactory* f = (CFactory*)self;
  if (num_devices == NULL || (max_devices > 0 && devices == NULL))
    return error(f->api, EP_INVALID_ARGUMENT, "GetSupportedDevices got NULL");
  *num_devices = 0;
  if (max_devices == 0) return NULL;
  memset(&devices[0], 0, sizeof devices[0]);
  devices[0].device_type = EP_DEVICE_CPU;
  devices[0].device_id = 0;
  devices[0].vendor_id = 0;
  devices[0].name = "example-c-cpu";
  devices[0].memory_info = &f->memory;
  *num_devices = 1;
  return NULL;
}

static EpStatus* factory_create_ep(EpFactory* self, const EpDevice* devices, size_t num_devices,
                                   const EpKeyValue* options, size_t num_options,
                                   const EpSessionOptions* session_options, const EpLogger* logger, Ep** out) {
  CFactory* f = (CFactory*)self;
  (void)session_options;
  if (out == NULL) return error(f->api, EP_INVALID_ARGUMENT, "CreateEp got a NULL out pointer");
  *out = NULL;
  if (num_devices < 1 || devices == NULL)
    return error(f->api, EP_INVALID_ARGUMENT, "CreateEp needs one device");
  if (devices[0].device_type != EP_DEVICE_CPU)
    return error(f->api, EP_INVALID_ARGUMENT, "CreateEp: only the CPU device is supported");
  if (num_options > 0) /* no provider options are defined */
    return error(f->api, EP_INVALID_ARGUMENT, "unknown option '%s'; this EP takes none",
                 options != NULL ? options[0].key : "?");
  CEp* ep = calloc(1, sizeof *ep);
  if (ep == NULL) return error(f->api, EP_OUT_OF_MEMORY, "out of memory creating the EP");
  /* Graph capture slots (v3..v5) stay NULL: this EP has no graphs. */
  ep->table.struct_size = ep_struct_size();
  ep->table.version = EXAMPLE_C_ABI;
  ep->table.GetName = ep_get_name;
  ep->table.GetCapability = ep_get_capability;
  ep->table.CreateKernel = ep_create_kernel;
#if EXAMPLE_C_ABI >= 2
  ep->table.IsConcurrentRunSupported = ep_is_concurrent_run_supported;
#endif
#if EXAMPLE_C_ABI >= 6
  ep->table.Compile = ep_compile;
#endif
  ep->api = f->api;
  ep->logger = logger;
  live_add(1);
  log_info(f->api, logger, EP_NAME ": EP created");
  *out = &ep->table;
  return NULL;
}

static void factory_release_ep(EpFactory* self, Ep* ep) {
  (void)self;
  if (ep == NULL) return;
  free(ep);
  live_add(-1);
}

EpStatus* CreateEpFactories(const char* registration_name, const EpApiBase* api_base, const EpLogger* logger,
                            EpFactory** factories, size_t max_factories, size_t* num_factories) {
  (void)registration_name;
  if (num_factories != NULL) *num_factories = 0;
  /* Without a usable EpApi there is no way to create a status: report zero factories. */
  if (api_base == NULL || api_base->version < EP_ABI_MIN_VERSION || !COVERS(api_base, EpApiBase, GetApi, 1))
    return NULL;
  uint32_t version = api_base->version < EXAMPLE_C_ABI ? api_base->version : EXAMPLE_C_ABI;
  const EpApi* api = api_base->GetApi(version);
  if (api == NULL || !COVERS(api, EpApi, KernelContext_GetGPUComputeStream, 1) || !COVERS(api, EpApi, CreateStatus, 1))
    return NULL;
  if (factories == NULL || num_factories == NULL || max_factories < 1)
    return error(api, EP_INVALID_ARGUMENT, "CreateEpFactories needs room for one factory");
  CFactory* f = calloc(1, sizeof *f);
  if (f == NULL) return error(api, EP_OUT_OF_MEMORY, "out of memory creating the factory");
  f->table.struct_size = sizeof(EpFactory);
  f->table.version = EXAMPLE_C_ABI;
  f->table.GetName = factory_get_name;
  f->table.GetVendor = factory_get_vendor;
  f->table.GetVersion = factory_get_version;
  f->table.GetSupportedDevices = factory_get_supported_devices;
  f->table.CreateEp = factory_create_ep;
  f->table.ReleaseEp = factory_release_ep;
  f->api = api;
  f->logger = logger;
  f->memory.name = "Cpu";
  f->memory.device_type = EP_DEVICE_CPU;
  f->memory.device_id = 0;
  f->memory.mem_type = EP_MEM_DEFAULT;
  live_add(1);
  factories[0] = &f->table;
  *num_factories = 1;
  return NULL;
}

EpStatus* ReleaseEpFactory(EpFactory* factory) {
  if (factory == NULL) return NULL;
  free(factory);
  live_add(-1);
  return NULL;
}
