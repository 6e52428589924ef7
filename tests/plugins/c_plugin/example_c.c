/* ExampleCEP: an EP plugin in plain C, written against ep_abi.h alone.
 *
 * It shows that the ABI needs no Python on the plugin side: one factory, one CPU device, an Ep
 * that claims float32 Add nodes whose inputs and output have one known shape (no broadcasting),
 * and a kernel that adds into the output the host allocates. Every host object is reached
 * through the EpApi negotiated at CreateEpFactories (GetApi(min(EP_ABI_VERSION, host))); each
 * factory keeps its own, so one process can register the library with hosts of different
 * versions. Live factories, EPs and kernels are counted for leak tests (ExampleC_LiveObjects).
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

/* A slot is usable when the table's version and struct_size cover it and it is not NULL. */
#define COVERS(table, type, slot, since) \
  ((table)->version >= (since) && (table)->struct_size >= offsetof(type, slot) + sizeof((table)->slot) && \
   (table)->slot != NULL)

static int g_live = 0;

int ExampleC_LiveObjects(void);
int ExampleC_LiveObjects(void) { return __atomic_load_n(&g_live, __ATOMIC_SEQ_CST); }

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

static EpStatus* ep_get_capability(Ep* self, const EpGraphView* graph, uint8_t* claimed) {
  CEp* ep = (CEp*)self;
  if (graph == NULL || (graph->num_nodes > 0 && (graph->nodes == NULL || claimed == NULL)))
    return error(ep->api, EP_INVALID_ARGUMENT, "GetCapability got a NULL graph or claim array");
  for (int32_t i = 0; i < graph->num_nodes; ++i)
    if (claimable(graph, i)) claimed[i] = 1;
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
  k->table.version = EP_ABI_VERSION;
  k->table.Compute = add_compute;
  k->table.Release = kernel_release;
  k->api = ep->api;
  live_add(1);
  *out = &k->table;
  return NULL;
}

static EpStatus* ep_is_concurrent_run_supported(Ep* self, int32_t* supported) {
  CEp* ep = (CEp*)self;
  if (supported == NULL) return error(ep->api, EP_INVALID_ARGUMENT, "IsConcurrentRunSupported got NULL");
  *supported = 1; /* kernels hold no state between calls */
  return NULL;
}

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
  ep->table.struct_size = sizeof(Ep);
  ep->table.version = EP_ABI_VERSION;
  ep->table.GetName = ep_get_name;
  ep->table.GetCapability = ep_get_capability;
  ep->table.CreateKernel = ep_create_kernel;
  ep->table.IsConcurrentRunSupported = ep_is_concurrent_run_supported;
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
  uint32_t version = api_base->version < EP_ABI_VERSION ? api_base->version : EP_ABI_VERSION;
  const EpApi* api = api_base->GetApi(version);
  if (api == NULL || !COVERS(api, EpApi, KernelContext_GetGPUComputeStream, 1) || !COVERS(api, EpApi, CreateStatus, 1))
    return NULL;
  if (factories == NULL || num_factories == NULL || max_factories < 1)
    return error(api, EP_INVALID_ARGUMENT, "CreateEpFactories needs room for one factory");
  CFactory* f = calloc(1, sizeof *f);
  if (f == NULL) return error(api, EP_OUT_OF_MEMORY, "out of memory creating the factory");
  f->table.struct_size = sizeof(EpFactory);
  f->table.version = EP_ABI_VERSION;
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
