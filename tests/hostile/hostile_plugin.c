/* HostileEP: a plugin that breaks the ABI on purpose, one rule at a time.
 *
 * One source serves every case of tests/hostile. A case is a ';'-separated list of tokens given
 * to Hostile_Configure() (or read from $HOSTILE_CASE when nothing was configured), read afresh
 * at each call, so one process can register the library case after case:
 *
 *   null=<Table>@<offset>      the slot at that byte offset of every <Table> the plugin makes is NULL
 *   version=<Table>:<n>        <Table>.version is n          size=<Table>:<n>  struct_size is n
 *   fail=<Table>.<Slot>        the slot returns an error status (a status slot), an absurd value (an
 *                              int32 slot) or invalid UTF-8 (a name getter)
 *   nullout=<Table>.<Slot>     a creating slot returns OK but leaves its out pointer NULL
 *   abuse=EpApi.<Slot>         the plugin calls that host function with bad arguments and checks
 *                              that the host answers with an error (else it fails the call itself)
 *   fail_every=<n>             every n-th EpKernel.Compute call (counted across threads) fails
 *   concurrent                 IsConcurrentRunSupported says yes (kernels keep no state per call)
 *   anything else              a named special case (rank_huge, kept_context, no_output, ...)
 *
 * The EP claims float32 Add nodes whose inputs and output share one known shape. By default it
 * lives on a mock device (device type GPU, memory from malloc) so that the host must use its
 * allocator, data transfer, streams and notifications; provider option graph=1 turns on a
 * recorded "graph capture" (replay re-runs the recorded Adds on the captured buffers). From v7 each
 * compiled Add saves a fixed context (compat_absurd: the factory answers 77 when asked about it).
 *
 * Every object the plugin creates is counted and uncounted when the host releases it
 * (Hostile_Live); objects a parent had to free because the host never released them are
 * counted as orphans (Hostile_Orphans). Slot calls are counted by name (Hostile_Calls).
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef HOSTILE_DATA_ENTRY
/* The variant whose CreateEpFactories is a data object: hide the header's prototype. */
#define CreateEpFactories HostileHiddenCreateEpFactories
#endif
#include "ep_abi.h"
#ifdef HOSTILE_DATA_ENTRY
#undef CreateEpFactories
const unsigned char CreateEpFactories[64] = {0xff, 0xff, 0xff, 0xff}; /* not code: calling it must crash */
#endif

#define EP_NAME "HostileEP"
#define ELEM_FLOAT 1
#define BAD_UTF8 "\xff\xfe\xfdname"
#define MAX_GRAPHS 16
#define MAX_STEPS 8

/* ---- configuration, counters ------------------------------------------------------------- */

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static char g_spec[8192];
static int g_configured = 0;

enum { K_FACTORY, K_EP, K_KERNEL, K_ALLOCATOR, K_TRANSFER, K_STREAM, K_NOTIFICATION, K_BLOCK, K_INFO, K_STATE,
       K_COUNT };
static const char* const KIND_NAMES[K_COUNT] = {"factory", "ep", "kernel", "allocator", "transfer",
                                                "stream", "notification", "block", "compute_info", "state"};
static int g_live[K_COUNT];
static int g_orphans[K_COUNT];

#define MAX_CALLED 128
static struct { char name[64]; int count; } g_calls[MAX_CALLED];
static int g_ncalls = 0;
static char g_report[1024];

void Hostile_Configure(const char* spec);
int Hostile_Live(void);
int Hostile_Orphans(void);
const char* Hostile_LiveReport(void);
int Hostile_Calls(const char* slot);

void Hostile_Configure(const char* spec) {
  pthread_mutex_lock(&g_lock);
  snprintf(g_spec, sizeof g_spec, "%s", spec != NULL ? spec : "");
  g_configured = 1;
  g_ncalls = 0;
  pthread_mutex_unlock(&g_lock);
}

int Hostile_Live(void) {
  int n = 0;
  for (int k = 0; k < K_COUNT; ++k) n += __atomic_load_n(&g_live[k], __ATOMIC_SEQ_CST);
  return n;
}

int Hostile_Orphans(void) {
  int n = 0;
  for (int k = 0; k < K_COUNT; ++k) n += __atomic_load_n(&g_orphans[k], __ATOMIC_SEQ_CST);
  return n;
}

const char* Hostile_LiveReport(void) {
  size_t used = 0;
  g_report[0] = '\0';
  for (int k = 0; k < K_COUNT; ++k)
    used += (size_t)snprintf(g_report + used, sizeof g_report - used, "%s%s=%d/%d", k ? " " : "", KIND_NAMES[k],
                             g_live[k], g_orphans[k]);
  return g_report;
}

int Hostile_Calls(const char* slot) {
  int n = 0;
  pthread_mutex_lock(&g_lock);
  for (int i = 0; i < g_ncalls; ++i)
    if (strcmp(g_calls[i].name, slot) == 0) n = g_calls[i].count;
  pthread_mutex_unlock(&g_lock);
  return n;
}

/* At process exit (after the interpreter finalised): whatever the host never released. */
__attribute__((destructor)) static void report_at_exit(void) {
  if (Hostile_Live() != 0) fprintf(stderr, "HostileEP: at exit, live objects %s\n", Hostile_LiveReport());
}

static void live(int kind, int delta) { __atomic_add_fetch(&g_live[kind], delta, __ATOMIC_SEQ_CST); }

static void orphan(int kind) {
  __atomic_add_fetch(&g_live[kind], -1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&g_orphans[kind], 1, __ATOMIC_SEQ_CST);
}

static void called(const char* slot) {
  pthread_mutex_lock(&g_lock);
  int i = 0;
  while (i < g_ncalls && strcmp(g_calls[i].name, slot) != 0) ++i;
  if (i == g_ncalls && g_ncalls < MAX_CALLED) {
    snprintf(g_calls[i].name, sizeof g_calls[i].name, "%s", slot);
    g_calls[i].count = 0;
    ++g_ncalls;
  }
  if (i < MAX_CALLED) ++g_calls[i].count;
  pthread_mutex_unlock(&g_lock);
}

__attribute__((unused)) static void load_spec(void) {
  if (g_configured) return;
  const char* env = getenv("HOSTILE_CASE");
  snprintf(g_spec, sizeof g_spec, "%s", env != NULL ? env : "");
  g_configured = 1;
}

/* The value of the first token starting with `prefix`, copied into `out`; 0 when absent. */
static int token_value(const char* prefix, int skip, char* out, size_t size) {
  size_t plen = strlen(prefix);
  const char* p = g_spec;
  while (*p) {
    const char* end = strchr(p, ';');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    if (len >= plen && strncmp(p, prefix, plen) == 0) {
      if (skip-- == 0) {
        size_t vlen = len - plen < size - 1 ? len - plen : size - 1;
        memcpy(out, p + plen, vlen);
        out[vlen] = '\0';
        return 1;
      }
    }
    p = end ? end + 1 : p + len;
  }
  return 0;
}

static int has(const char* token) {
  char value[8];
  size_t n = strlen(token);
  char prefix[160];
  snprintf(prefix, sizeof prefix, "%s", token);
  if (!token_value(prefix, 0, value, sizeof value)) return 0;
  (void)n;
  return value[0] == '\0';
}

static int has2(const char* kind, const char* slot) {
  char token[160];
  snprintf(token, sizeof token, "%s=%s", kind, slot);
  return has(token);
}

/* Apply null=/version=/size= tokens to a freshly made table. */
static void finish_table(const char* table, void* obj, size_t size) {
  char prefix[96], value[64];
  snprintf(prefix, sizeof prefix, "null=%s@", table);
  for (int i = 0; token_value(prefix, i, value, sizeof value); ++i) {
    size_t off = (size_t)strtoul(value, NULL, 10);
    if (off + sizeof(void*) <= size) memset((char*)obj + off, 0, sizeof(void*));
  }
  uint32_t* head = (uint32_t*)obj;
  snprintf(prefix, sizeof prefix, "version=%s:", table);
  if (token_value(prefix, 0, value, sizeof value)) head[1] = (uint32_t)strtoul(value, NULL, 10);
  snprintf(prefix, sizeof prefix, "size=%s:", table);
  if (token_value(prefix, 0, value, sizeof value)) head[0] = (uint32_t)strtoul(value, NULL, 10);
}

/* ---- objects ------------------------------------------------------------------------------- */

typedef struct HFactory HFactory;

typedef struct HEp HEp;

typedef struct HAllocator {
  EpAllocator table;
  HFactory* factory;
  HEp* ep; /* the EP that created it, while that EP lives: releasing it first is out of order */
  struct HAllocator* next;
  int blocks;
  int released;
} HAllocator;

typedef struct Step { const float* a; const float* b; float* out; int64_t n; } Step;

struct HEp {
  Ep table;
  HFactory* factory;
  const EpApi* api;
  const EpLogger* logger;
  int graph;
  int capturing;
  int runs[MAX_GRAPHS];
  int captured[MAX_GRAPHS];
  Step steps[MAX_GRAPHS][MAX_STEPS];
  int nsteps[MAX_GRAPHS];
  EpKernelContext* kept; /* kept_context: a context kept past its Compute */
  int fuse;              /* provider option fuse=1: every claimed Add is also offered for compilation (v6) */
  EpCallFrame kept_frame; /* kept_frame: a copy of a call frame kept past its Compute */
  int has_kept_frame;
  int kernels;
  struct HKernel* kernel_list;
};

typedef struct HKernel {
  EpKernel table;
  HEp* ep;
  int index;
  struct HKernel* next;
  int released;
} HKernel;

struct HFactory {
  EpFactory table;
  const EpApi* api;
  const EpLogger* logger;
  EpMemoryInfo memory;
  HAllocator* allocators;
};

typedef struct HStream { EpSyncStream table; const EpApi* api; int handle; } HStream;
typedef struct HNotification { EpNotification table; const EpApi* api; } HNotification;
typedef struct HTransfer { EpDataTransfer table; const EpApi* api; } HTransfer;

static const EpApi* g_api = NULL; /* the last negotiated API, for objects that keep none */

static EpStatus* error(const EpApi* api, int32_t code, const char* fmt, ...) __attribute__((format(printf, 3, 4)));

static EpStatus* error(const EpApi* api, int32_t code, const char* fmt, ...) {
  char text[400];
  char message[480];
  va_list args;
  va_start(args, fmt);
  vsnprintf(text, sizeof text, fmt, args);
  va_end(args);
  snprintf(message, sizeof message, "%s: %s", EP_NAME, text);
  return api->CreateStatus(code, message);
}

/* Count the call; return an injected error when the case asks for it. */
#define ENTER(api, qual)                                                                    \
  do {                                                                                      \
    called(qual);                                                                           \
    if (has2("fail", qual)) return error((api), EP_FAIL, "injected failure in %s", qual);    \
    if (has2("bogus", qual)) return (EpStatus*)(uintptr_t)0xdead0;                          \
  } while (0)

#define ENTER_INT(qual, absurd)             \
  do {                                      \
    called(qual);                           \
    if (has2("fail", qual)) return (absurd); \
  } while (0)

#define ENTER_NAME(qual)                    \
  do {                                      \
    called(qual);                           \
    if (has2("fail", qual)) return BAD_UTF8; \
    if (has2("nullret", qual)) return NULL; \
  } while (0)

/* ---- host-callback abuse (abuse=EpApi.<Slot>) --------------------------------------------- */

static char g_complaint[512];

static void complain(const char* what) {
  if (g_complaint[0] == '\0') snprintf(g_complaint, sizeof g_complaint, "%s", what);
}

static void expect_error(const EpApi* api, EpStatus* st, const char* what) {
  if (st == NULL) {
    complain(what);
    return;
  }
  api->ReleaseStatus(st);
}

/* Host functions that need no kernel context; called from CreateEp. */
__attribute__((unused)) static void abuse_base(const EpApiBase* base) {
  if (has("abuse=EpApiBase.GetApi")) {
    if (base->GetApi(0) != NULL) complain("GetApi(0) returned a table");
    if (base->GetApi(EP_ABI_NEXT_GENERATION) != NULL) complain("GetApi(future) returned a table");
  }
  if (has("abuse=EpApiBase.GetVersionString")) {
    if (base->GetVersionString() == NULL) complain("GetVersionString returned NULL");
  }
}

static void abuse_global(const EpApi* api, const EpSessionOptions* so, const EpLogger* logger) {
  EpStatus* bogus = (EpStatus*)(uintptr_t)0xbad0;
  if (has("abuse=EpApi.CreateStatus")) {
    EpStatus* a = api->CreateStatus(EP_FAIL, NULL);
    EpStatus* b = api->CreateStatus(EP_FAIL, BAD_UTF8);
    EpStatus* c = api->CreateStatus(-12345, "negative code");
    if (a == NULL || b == NULL || c == NULL) complain("CreateStatus returned NULL (OK) for a failure");
    if (a) api->ReleaseStatus(a);
    if (b) api->ReleaseStatus(b);
    if (c) api->ReleaseStatus(c);
  }
  if (has("abuse=EpApi.GetErrorCode")) {
    if (api->GetErrorCode(NULL) == EP_OK) complain("GetErrorCode(NULL) answered EP_OK");
    if (api->GetErrorCode(bogus) == EP_OK) complain("GetErrorCode(bogus) answered EP_OK");
  }
  if (has("abuse=EpApi.GetErrorMessage")) {
    if (api->GetErrorMessage(NULL) == NULL) complain("GetErrorMessage(NULL) returned NULL");
    if (api->GetErrorMessage(bogus) == NULL) complain("GetErrorMessage(bogus) returned NULL");
  }
  if (has("abuse=EpApi.ReleaseStatus")) {
    EpStatus* a = api->CreateStatus(EP_FAIL, "released twice");
    api->ReleaseStatus(a);
    api->ReleaseStatus(a);
    api->ReleaseStatus(NULL);
    api->ReleaseStatus(bogus);
  }
  if (has("abuse=EpApi.Logger_Log")) {
    api->Logger_Log(NULL, EP_LOG_ERROR, "to a NULL logger");
    api->Logger_Log(logger, 99, NULL);
    api->Logger_Log(logger, -5, BAD_UTF8);
    api->Logger_Log((const EpLogger*)(uintptr_t)0xbad0, EP_LOG_INFO, "to a bogus logger");
  }
  if (has("abuse=EpApi.SessionOptions_GetConfigEntry")) {
    size_t size = 0;
    char small[2];
    expect_error(api, api->SessionOptions_GetConfigEntry(NULL, "k", NULL, &size), "GetConfigEntry(NULL options)");
    expect_error(api, api->SessionOptions_GetConfigEntry(so, NULL, NULL, &size), "GetConfigEntry(NULL key)");
    expect_error(api, api->SessionOptions_GetConfigEntry(so, "k", NULL, NULL), "GetConfigEntry(NULL size)");
    expect_error(api, api->SessionOptions_GetConfigEntry(so, BAD_UTF8, NULL, &size),
                 "GetConfigEntry(key not UTF-8) answered OK");
    size = sizeof small;
    expect_error(api, api->SessionOptions_GetConfigEntry(so, "hostile.entry", small, &size),
                 "GetConfigEntry(buffer too small) answered OK");
  }
}

/* Host functions on a kernel context; called from Compute. */
static void abuse_context(const EpApi* api, EpKernelContext* ctx) {
  EpKernelContext* bogus = (EpKernelContext*)(uintptr_t)0xbad0;
  EpTensor* out = NULL;
  int64_t shape[2] = {2, 3};
  int64_t negative[2] = {-3, 2};
  if (has("abuse=EpApi.KernelContext_GetIO")) {
    const EpKernelIO* io = NULL;
    expect_error(api, api->KernelContext_GetIO(NULL, &io), "GetIO(NULL context) answered OK");
    expect_error(api, api->KernelContext_GetIO(bogus, &io), "GetIO(bogus context) answered OK");
    expect_error(api, api->KernelContext_GetIO(ctx, NULL), "GetIO(NULL out) answered OK");
  }
  if (has("abuse=EpApi.KernelContext_GetOutput")) {
    expect_error(api, api->KernelContext_GetOutput(ctx, -1, shape, 2, &out), "GetOutput(index -1) answered OK");
    expect_error(api, api->KernelContext_GetOutput(ctx, 99, shape, 2, &out), "GetOutput(index 99) answered OK");
    expect_error(api, api->KernelContext_GetOutput(ctx, 0, shape, -1, &out), "GetOutput(ndim -1) answered OK");
    expect_error(api, api->KernelContext_GetOutput(ctx, 0, shape, 65, &out), "GetOutput(ndim 65) answered OK");
    expect_error(api, api->KernelContext_GetOutput(ctx, 0, NULL, 2, &out), "GetOutput(NULL shape) answered OK");
    expect_error(api, api->KernelContext_GetOutput(ctx, 0, negative, 2, &out), "GetOutput(dim -3) answered OK");
    expect_error(api, api->KernelContext_GetOutput(ctx, 0, shape, 2, NULL), "GetOutput(NULL out) answered OK");
    expect_error(api, api->KernelContext_GetOutput(bogus, 0, shape, 2, &out), "GetOutput(bogus ctx) answered OK");
  }
  if (has("abuse=EpApi.KernelContext_GetGPUComputeStream")) {
    void* stream = NULL;
    expect_error(api, api->KernelContext_GetGPUComputeStream(bogus, &stream), "GetGPUComputeStream(bogus) OK");
    expect_error(api, api->KernelContext_GetGPUComputeStream(ctx, NULL), "GetGPUComputeStream(NULL out) OK");
  }
  if (has("abuse=EpApi.KernelContext_GetSyncStream") && api->version >= 4) {
    EpSyncStream* stream = NULL;
    expect_error(api, api->KernelContext_GetSyncStream(bogus, &stream), "GetSyncStream(bogus) answered OK");
    expect_error(api, api->KernelContext_GetSyncStream(ctx, NULL), "GetSyncStream(NULL out) answered OK");
  }
}

/* ---- the kernel ---------------------------------------------------------------------------- */

static int g_compute_calls = 0;

static int64_t element_count(const EpTensor* t) {
  int64_t n = 1;
  for (int32_t d = 0; d < t->ndim; ++d) n *= t->shape[d];
  return n;
}

static EpStatus* kernel_compute(EpKernel* self, EpKernelContext* context) {
  HKernel* k = (HKernel*)self;
  HEp* ep = k->ep;
  const EpApi* api = ep->api;
  ENTER(api, "EpKernel.Compute");
  char every[16];
  if (token_value("fail_every=", 0, every, sizeof every) && atoi(every) > 0) {
    int call = __atomic_add_fetch(&g_compute_calls, 1, __ATOMIC_SEQ_CST);
    if (call % atoi(every) == 0)
      return error(api, EP_FAIL, "injected failure in Compute call %d (one call in %s fails)", call, every);
  }
  abuse_context(api, context);
  if (g_complaint[0]) return error(api, EP_FAIL, "host accepted a bad call: %s", g_complaint);
  if (has("kept_context")) {
    if (ep->kept != NULL && ep->kept != context) {
      /* A context of another node, kept past its Compute: the host must refuse it. */
      EpTensor* stale = NULL;
      int64_t one[1] = {1};
      EpStatus* st = api->KernelContext_GetOutput(ep->kept, 0, one, 1, &stale);
      if (st == NULL) return error(api, EP_FAIL, "host served a kernel context kept past its Compute");
      api->ReleaseStatus(st);
    }
    if (k->index == 0) ep->kept = context;
  }
  const EpKernelIO* io = NULL;
  EpStatus* st = api->KernelContext_GetIO(context, &io);
  if (st != NULL) return st;
  if (io == NULL || io->num_inputs != 2) return error(api, EP_INVALID_ARGUMENT, "Add needs 2 inputs");
  const EpTensor* a = &io->inputs[0];
  const EpTensor* b = &io->inputs[1];
  if (has("no_output")) return NULL; /* claims success, produces nothing */
  int64_t n = element_count(a);
  EpTensor* out = NULL;
  if (has("rank_huge")) {
    int64_t dims[4] = {1, 1, 1, 1};
    st = api->KernelContext_GetOutput(context, 0, dims, 0x7fffffff, &out);
  } else if (has("dims_negative")) {
    int64_t dims[2] = {-3, 2};
    st = api->KernelContext_GetOutput(context, 0, dims, 2, &out);
  } else if (has("dims_overflow")) {
    int64_t dims[3] = {(int64_t)1 << 40, (int64_t)1 << 40, 16};
    st = api->KernelContext_GetOutput(context, 0, dims, 3, &out);
  } else {
    st = api->KernelContext_GetOutput(context, 0, a->shape, a->ndim, &out);
  }
  if (st != NULL) return st;
  if (out == NULL || out->nbytes < n * (int64_t)sizeof(float))
    return error(api, EP_FAIL, "the host returned an unusable output tensor");
  const float* x = (const float*)a->data;
  const float* y = (const float*)b->data;
  float* z = (float*)out->data;
  for (int64_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
  if (ep->capturing >= 0 && ep->nsteps[ep->capturing] < MAX_STEPS) {
    Step s = {x, y, z, n};
    ep->steps[ep->capturing][ep->nsteps[ep->capturing]++] = s;
  }
  return NULL;
}

static void kernel_release(EpKernel* self) {
  called("EpKernel.Release");
  HKernel* k = (HKernel*)self;
  if (k == NULL || k->released) return;
  k->released = 1; /* freed with its EP: a double release must not double free */
  live(K_KERNEL, -1);
}

/* ---- streams, notifications, transfer, allocator ------------------------------------------- */

static EpStatus* note_activate(EpNotification* self) {
  HNotification* n = (HNotification*)self;
  ENTER(n->api, "EpNotification.Activate");
  return NULL;
}

static EpStatus* note_wait_device(EpNotification* self, EpSyncStream* consumer) {
  HNotification* n = (HNotification*)self;
  (void)consumer;
  ENTER(n->api, "EpNotification.WaitOnDevice");
  return NULL;
}

static EpStatus* note_wait_host(EpNotification* self) {
  HNotification* n = (HNotification*)self;
  ENTER(n->api, "EpNotification.WaitOnHost");
  return NULL;
}

static void note_release(EpNotification* self) {
  called("EpNotification.Release");
  free(self);
  live(K_NOTIFICATION, -1);
}

static void* stream_get_handle(EpSyncStream* self) {
  HStream* s = (HStream*)self;
  called("EpSyncStream.GetHandle");
  if (has("fail=EpSyncStream.GetHandle")) return (void*)(uintptr_t)0xbad0;
  return &s->handle;
}

static EpStatus* stream_create_notification(EpSyncStream* self, EpNotification** out) {
  HStream* s = (HStream*)self;
  ENTER(s->api, "EpSyncStream.CreateNotification");
  *out = NULL;
  if (has("nullout=EpSyncStream.CreateNotification")) return NULL;
  HNotification* n = calloc(1, sizeof *n);
  n->table.struct_size = sizeof(EpNotification);
  n->table.version = EP_ABI_VERSION;
  n->table.Activate = note_activate;
  n->table.WaitOnDevice = note_wait_device;
  n->table.WaitOnHost = note_wait_host;
  n->table.Release = note_release;
  n->api = s->api;
  finish_table("EpNotification", n, sizeof n->table);
  live(K_NOTIFICATION, 1);
  *out = &n->table;
  return NULL;
}

static EpStatus* stream_flush(EpSyncStream* self) {
  ENTER(((HStream*)self)->api, "EpSyncStream.Flush");
  return NULL;
}

static EpStatus* stream_on_run_end(EpSyncStream* self) {
  ENTER(((HStream*)self)->api, "EpSyncStream.OnSessionRunEnd");
  return NULL;
}

static void stream_release(EpSyncStream* self) {
  called("EpSyncStream.Release");
  free(self);
  live(K_STREAM, -1);
}

static EpStatus* make_stream(const EpApi* api, EpSyncStream** out) {
  *out = NULL;
  HStream* s = calloc(1, sizeof *s);
  s->table.struct_size = sizeof(EpSyncStream);
  s->table.version = EP_ABI_VERSION;
  s->table.GetHandle = stream_get_handle;
  s->table.CreateNotification = stream_create_notification;
  s->table.Flush = stream_flush;
  s->table.OnSessionRunEnd = stream_on_run_end;
  s->table.Release = stream_release;
  s->api = api;
  finish_table("EpSyncStream", s, sizeof s->table);
  live(K_STREAM, 1);
  *out = &s->table;
  return NULL;
}

static int32_t transfer_can_copy(const EpDataTransfer* self, const EpMemoryInfo* src, const EpMemoryInfo* dst) {
  (void)self, (void)src, (void)dst;
  ENTER_INT("EpDataTransfer.CanCopy", -77);
  return 1;
}

static EpStatus* transfer_copy(EpDataTransfer* self, const EpTensor* src, EpTensor* dst, EpSyncStream* const* streams,
                               size_t count) {
  HTransfer* t = (HTransfer*)self;
  (void)streams;
  ENTER(t->api, "EpDataTransfer.CopyTensors");
  for (size_t i = 0; i < count; ++i) {
    if (dst[i].nbytes < src[i].nbytes) return error(t->api, EP_INVALID_ARGUMENT, "copy into a smaller buffer");
    if (src[i].nbytes > 0) memcpy(dst[i].data, src[i].data, (size_t)src[i].nbytes);
  }
  return NULL;
}

static void transfer_release(EpDataTransfer* self) {
  called("EpDataTransfer.Release");
  free(self);
  live(K_TRANSFER, -1);
}

static EpStatus* alloc_alloc(EpAllocator* self, size_t size, void** out) {
  HAllocator* a = (HAllocator*)self;
  ENTER(g_api, "EpAllocator.Alloc");
  *out = NULL;
  if (has("nullout=EpAllocator.Alloc")) return NULL;
  *out = malloc(size ? size : 1);
  if (*out == NULL) return error(g_api, EP_OUT_OF_MEMORY, "malloc of %zu bytes failed", size);
  a->blocks++;
  live(K_BLOCK, 1);
  return NULL;
}

static EpStatus* alloc_on_stream(EpAllocator* self, size_t size, EpSyncStream* stream, void** out) {
  HAllocator* a = (HAllocator*)self;
  (void)stream;
  ENTER(g_api, "EpAllocator.AllocOnStream");
  *out = NULL;
  if (has("nullout=EpAllocator.AllocOnStream")) return NULL;
  *out = malloc(size ? size : 1);
  if (*out == NULL) return error(g_api, EP_OUT_OF_MEMORY, "malloc of %zu bytes failed", size);
  a->blocks++;
  live(K_BLOCK, 1);
  return NULL;
}

static void alloc_free(EpAllocator* self, void* p) {
  HAllocator* a = (HAllocator*)self;
  called("EpAllocator.Free");
  if (p == NULL) return;
  if (a->released) {
    /* The analogue of "EpAllocator.Free called with an unknown EpAllocator pointer". */
    fprintf(stderr, "HostileEP: Free into an allocator the host already released\n");
    return;
  }
  free(p);
  a->blocks--;
  live(K_BLOCK, -1);
}

static const EpMemoryInfo* alloc_info(const EpAllocator* self) {
  called("EpAllocator.Info");
  if (has("fail=EpAllocator.Info")) return NULL;
  return &((const HAllocator*)self)->factory->memory;
}

static EpStatus* make_allocator(HFactory* f, EpAllocator** out) {
  HAllocator* a = calloc(1, sizeof *a);
  a->table.struct_size = sizeof(EpAllocator);
  a->table.version = EP_ABI_VERSION;
  a->table.Alloc = alloc_alloc;
  a->table.Free = alloc_free;
  a->table.Info = alloc_info;
  a->table.AllocOnStream = alloc_on_stream;
  a->factory = f;
  a->next = f->allocators;
  f->allocators = a;
  finish_table("EpAllocator", a, sizeof a->table);
  live(K_ALLOCATOR, 1);
  *out = &a->table;
  return NULL;
}

/* ---- compiled partitions (v6) ------------------------------------------------------------- */

typedef struct HInfo { EpNodeComputeInfo table; HEp* ep; } HInfo;

static EpStatus* info_create_state(EpNodeComputeInfo* self, void** state) {
  HInfo* info = (HInfo*)self;
  ENTER(info->ep->api, "EpNodeComputeInfo.CreateState");
  *state = NULL;
  if (has("nullout=EpNodeComputeInfo.CreateState")) return NULL;
  *state = malloc(16);
  live(K_STATE, 1);
  return NULL;
}

static void info_release_state(EpNodeComputeInfo* self, void* state) {
  (void)self;
  called("EpNodeComputeInfo.ReleaseState");
  if (state == NULL) return;
  free(state);
  live(K_STATE, -1);
}

static void info_release(EpNodeComputeInfo* self) {
  called("EpNodeComputeInfo.Release");
  free(self);
  live(K_INFO, -1);
}

/* Frame callbacks with bad arguments (abuse=EpCallFrame.<Slot>); each must answer an error. */
static void abuse_frame(const EpApi* api, EpCallFrame* f) {
  void* data = NULL;
  void* bogus = (void*)(uintptr_t)0xbad0;
  int64_t dims[2] = {2, 3};
  int64_t negative[2] = {-3, 2};
  if (has("abuse=EpCallFrame.AllocateOutput")) {
    void* ctx = f->allocate_context;
    expect_error(api, f->AllocateOutput(bogus, 0, dims, 2, &data), "AllocateOutput(bogus context) answered OK");
    expect_error(api, f->AllocateOutput(ctx, 99, dims, 2, &data), "AllocateOutput(index 99) answered OK");
    expect_error(api, f->AllocateOutput(ctx, 0, dims, 65, &data), "AllocateOutput(rank 65) answered OK");
    expect_error(api, f->AllocateOutput(ctx, 0, dims, -2, &data), "AllocateOutput(rank -2) answered OK");
    expect_error(api, f->AllocateOutput(ctx, 0, NULL, 2, &data), "AllocateOutput(NULL dims) answered OK");
    expect_error(api, f->AllocateOutput(ctx, 0, negative, 2, &data), "AllocateOutput(dim -3) answered OK");
    expect_error(api, f->AllocateOutput(ctx, 0, dims, 2, NULL), "AllocateOutput(NULL out) answered OK");
  }
  if (has("abuse=EpCallFrame.AllocScratch")) {
    expect_error(api, f->AllocScratch(bogus, 8, &data), "AllocScratch(bogus context) answered OK");
    expect_error(api, f->AllocScratch(f->scratch_context, 8, NULL), "AllocScratch(NULL out) answered OK");
    expect_error(api, f->AllocScratch(f->scratch_context, (size_t)1 << 62, &data), "AllocScratch(2^62) OK");
  }
  if (has("abuse=EpCallFrame.FreeScratch")) {
    f->FreeScratch(bogus, bogus);
    f->FreeScratch(f->scratch_context, bogus);
    f->FreeScratch(f->scratch_context, NULL);
  }
}

static EpStatus* info_compute(EpNodeComputeInfo* self, void* state, EpCallFrame* f) {
  HInfo* info = (HInfo*)self;
  HEp* ep = info->ep;
  const EpApi* api = ep->api;
  (void)state;
  ENTER(api, "EpNodeComputeInfo.Compute");
  g_complaint[0] = '\0';
  abuse_frame(api, f);
  if (g_complaint[0]) return error(api, EP_FAIL, "host accepted a bad call: %s", g_complaint);
  if (has("kept_frame")) {
    ep->kept_frame = *f;
    ep->has_kept_frame = 1;
  }
  /* The frame holds the distinct values the partition reads: Add(X, X) has one input. */
  if (f->num_inputs < 1 || f->num_inputs > 2 || f->num_outputs != 1)
    return error(api, EP_INVALID_ARGUMENT, "a fused Add reads 1 or 2 values and writes 1");
  const EpFrameTensor* a = &f->inputs[0];
  const EpFrameTensor* b = &f->inputs[f->num_inputs - 1];
  EpFrameTensor* out = &f->outputs[0];
  int64_t n = 1;
  for (int32_t d = 0; d < a->rank; ++d) n *= a->dims[d];
  void* scratch = NULL;
  EpStatus* st = f->AllocScratch(f->scratch_context, 64, &scratch);
  if (st != NULL) return st;
  f->FreeScratch(f->scratch_context, scratch);
  if (has("frame_rank_huge")) {
    void* data = NULL;
    st = f->AllocateOutput(f->allocate_context, 0, a->dims, 0x7fffffff, &data);
    if (st != NULL) return st;
  }
  if (out->data == NULL) {
    void* data = NULL;
    st = f->AllocateOutput(f->allocate_context, 0, a->dims, a->rank, &data);
    if (st != NULL) return st;
  }
  const float* x = (const float*)a->data;
  const float* y = (const float*)b->data;
  float* z = (float*)out->data;
  for (int64_t i = 0; i < n; ++i) z[i] = x[i] + y[i];
  return NULL;
}

/* v7: every fused Add saves the same context; CompileFromContext accepts only that one. */
static const char HOSTILE_CONTEXT[] = "HOSTILE-CONTEXT-1";

static EpStatus* info_get_context(EpNodeComputeInfo* self, const void** data, size_t* size) {
  HInfo* info = (HInfo*)self;
  ENTER(info->ep->api, "EpNodeComputeInfo.GetContext");
  *data = HOSTILE_CONTEXT;
  *size = sizeof HOSTILE_CONTEXT - 1;
  return NULL;
}

static EpNodeComputeInfo* make_info(HEp* ep) {
  HInfo* info = calloc(1, sizeof *info);
  info->table.struct_size = sizeof(EpNodeComputeInfo);
  info->table.version = EP_ABI_VERSION;
  info->table.CreateState = info_create_state;
  info->table.Compute = info_compute;
  info->table.ReleaseState = info_release_state;
  info->table.Release = info_release;
  info->table.GetContext = info_get_context;
  info->ep = ep;
  finish_table("EpNodeComputeInfo", info, sizeof info->table);
  live(K_INFO, 1);
  return &info->table;
}

static EpStatus* ep_compile(Ep* self, const EpGraphView* const* graphs, const EpNodeView* fused, size_t count,
                            EpNodeComputeInfo** out) {
  HEp* ep = (HEp*)self;
  (void)graphs, (void)fused;
  ENTER(ep->api, "Ep.Compile");
  for (size_t i = 0; i < count; ++i) out[i] = has("nullout=Ep.Compile") ? NULL : make_info(ep);
  return NULL;
}

static EpStatus* ep_compile_from_context(Ep* self, const EpGraphView* graph, const EpNodeView* fused, const void* data,
                                         size_t size, EpNodeComputeInfo** out) {
  HEp* ep = (HEp*)self;
  (void)graph, (void)fused;
  ENTER(ep->api, "Ep.CompileFromContext");
  *out = NULL;
  if (data == NULL || size != sizeof HOSTILE_CONTEXT - 1 || memcmp(data, HOSTILE_CONTEXT, size) != 0)
    return error(ep->api, EP_INVALID_GRAPH, "not a HostileEP context (%zu bytes)", size);
  if (has("nullout=Ep.CompileFromContext")) return NULL;
  *out = make_info(ep);
  return NULL;
}

static const char* ep_compatibility(Ep* self, const EpGraphView* graph) {
  (void)self, (void)graph;
  ENTER_NAME("Ep.GetCompiledModelCompatibilityInfo");
  return "HostileEP;context=1";
}

/* ---- the Ep ---------------------------------------------------------------------------------- */

static const char* ep_get_name(const Ep* self) {
  (void)self;
  ENTER_NAME("Ep.GetName");
  return EP_NAME;
}

static int known_float(const EpGraphView* g, int32_t value) {
  if (value < 0 || value >= g->num_values) return 0;
  const EpValueInfo* v = &g->values[value];
  if (v->elem_type != ELEM_FLOAT || v->ndim < 0 || (v->ndim > 0 && v->shape == NULL)) return 0;
  for (int32_t d = 0; d < v->ndim; ++d)
    if (v->shape[d] < 0) return 0;
  return 1;
}

static int claimable(const EpGraphView* g, int32_t index) {
  const EpNodeView* n = &g->nodes[index];
  if (n->op_type == NULL || strcmp(n->op_type, "Add") != 0) return 0;
  if (n->num_inputs != 2 || n->num_outputs != 1) return 0;
  return known_float(g, n->inputs[0]) && known_float(g, n->inputs[1]) && known_float(g, n->outputs[0]);
}

static EpStatus* ep_get_capability(Ep* self, const EpGraphView* graph, uint8_t* claimed) {
  HEp* ep = (HEp*)self;
  ENTER(ep->api, "Ep.GetCapability");
  const EpApi* api = ep->api;
  if (api->version >= 6 && has("abuse=EpApi.Graph_AddNodesToFuse")) {
    int32_t nodes[2] = {0, 0};
    int32_t far[1] = {999};
    g_complaint[0] = '\0';
    expect_error(api, api->Graph_AddNodesToFuse(graph, nodes, 0), "AddNodesToFuse(count 0) answered OK");
    expect_error(api, api->Graph_AddNodesToFuse(graph, NULL, 1), "AddNodesToFuse(NULL nodes) answered OK");
    expect_error(api, api->Graph_AddNodesToFuse(graph, far, 1), "AddNodesToFuse(node 999) answered OK");
    expect_error(api, api->Graph_AddNodesToFuse(graph, nodes, 2), "AddNodesToFuse(node twice) answered OK");
    expect_error(api, api->Graph_AddNodesToFuse(graph, nodes, (size_t)1 << 40), "AddNodesToFuse(2^40) OK");
    expect_error(api, api->Graph_AddNodesToFuse((const EpGraphView*)(uintptr_t)0xbad0, nodes, 1),
                 "AddNodesToFuse(bogus graph) answered OK");
    if (g_complaint[0]) return error(api, EP_FAIL, "host accepted a bad call: %s", g_complaint);
  }
  for (int32_t i = 0; i < graph->num_nodes; ++i) {
    if (!claimable(graph, i)) continue;
    claimed[i] = has("claim_lies") ? 0xff : 1;
    if (ep->fuse && api->version >= 6) {
      EpStatus* st = api->Graph_AddNodesToFuse(graph, &i, 1);
      if (st != NULL) return st;
    }
  }
  if (has("claim_lies")) /* also claims every other node, which it cannot run */
    for (int32_t i = 0; i < graph->num_nodes; ++i) claimed[i] = 0xff;
  return NULL;
}

static EpStatus* ep_create_kernel(Ep* self, const EpGraphView* graph, int32_t node, EpKernel** out) {
  HEp* ep = (HEp*)self;
  ENTER(ep->api, "Ep.CreateKernel");
  *out = NULL;
  if (has("nullout=Ep.CreateKernel")) return NULL;
  if (!claimable(graph, node)) return error(ep->api, EP_NOT_IMPLEMENTED, "no kernel for node %d", node);
  HKernel* k = calloc(1, sizeof *k);
  k->table.struct_size = sizeof(EpKernel);
  k->table.version = EP_ABI_VERSION;
  k->table.Compute = kernel_compute;
  k->table.Release = kernel_release;
  k->ep = ep;
  k->index = ep->kernels++;
  k->next = ep->kernel_list;
  ep->kernel_list = k;
  finish_table("EpKernel", k, sizeof k->table);
  live(K_KERNEL, 1);
  *out = &k->table;
  return NULL;
}

static int graph_id_of(const EpRunOptions* ro) {
  if (ro == NULL) return 0;
  for (int32_t i = 0; i < ro->num_entries; ++i)
    if (ro->entries[i].key != NULL && strcmp(ro->entries[i].key, "gpu_graph_id") == 0)
      return atoi(ro->entries[i].value);
  return 0;
}

static EpStatus* ep_on_run_start(Ep* self, const EpRunOptions* ro) {
  HEp* ep = (HEp*)self;
  ENTER(ep->api, "Ep.OnRunStart");
  int gid = graph_id_of(ro);
  if (ep->graph && gid >= 0 && gid < MAX_GRAPHS && !ep->captured[gid] && ++ep->runs[gid] > 1) {
    ep->capturing = gid;
    ep->nsteps[gid] = 0;
  }
  return NULL;
}

static EpStatus* ep_on_run_end(Ep* self, const EpRunOptions* ro, int32_t sync) {
  HEp* ep = (HEp*)self;
  (void)ro, (void)sync;
  ENTER(ep->api, "Ep.OnRunEnd");
  if (ep->kept != NULL && has("kept_context")) {
    EpTensor* stale = NULL;
    int64_t one[1] = {1};
    EpStatus* st = ep->api->KernelContext_GetOutput(ep->kept, 0, one, 1, &stale);
    if (st == NULL) return error(ep->api, EP_FAIL, "host served a kernel context after its Compute returned");
    ep->api->ReleaseStatus(st);
  }
  if (ep->has_kept_frame && has("kept_frame")) {
    void* data = NULL;
    int64_t dims[2] = {2, 3};
    EpStatus* st = ep->kept_frame.AllocateOutput(ep->kept_frame.allocate_context, 0, dims, 2, &data);
    if (st == NULL) return error(ep->api, EP_FAIL, "host served a call frame after its Compute returned");
    ep->api->ReleaseStatus(st);
  }
  if (ep->capturing >= 0) {
    ep->captured[ep->capturing] = 1;
    ep->capturing = -1;
  }
  return NULL;
}

static EpStatus* ep_create_allocator(Ep* self, const EpMemoryInfo* info, EpAllocator** out) {
  HEp* ep = (HEp*)self;
  (void)info;
  ENTER(ep->api, "Ep.CreateAllocator");
  *out = NULL;
  if (has("nullout=Ep.CreateAllocator")) return NULL;
  EpStatus* st = make_allocator(ep->factory, out);
  if (st == NULL) ((HAllocator*)*out)->ep = ep;
  return st;
}

static EpStatus* ep_create_stream(Ep* self, const EpMemoryInfo* info, EpSyncStream** out) {
  HEp* ep = (HEp*)self;
  (void)info;
  ENTER(ep->api, "Ep.CreateSyncStreamForDevice");
  *out = NULL;
  if (has("nullout=Ep.CreateSyncStreamForDevice")) return NULL;
  return make_stream(ep->api, out);
}

static EpStatus* ep_sync(Ep* self) {
  ENTER(((HEp*)self)->api, "Ep.Sync");
  return NULL;
}

static EpStatus* ep_concurrent(Ep* self, int32_t* supported) {
  HEp* ep = (HEp*)self;
  ENTER(ep->api, "Ep.IsConcurrentRunSupported");
  *supported = has("concurrent_absurd") ? 12345 : has("concurrent") ? 1 : 0;
  return NULL;
}

static int32_t ep_graph_enabled(const Ep* self) {
  ENTER_INT("Ep.IsGraphCaptureEnabled", 777);
  return ((const HEp*)self)->graph;
}

static int32_t ep_graph_captured(const Ep* self, int32_t gid) {
  ENTER_INT("Ep.IsGraphCaptured", -9);
  return gid >= 0 && gid < MAX_GRAPHS && ((const HEp*)self)->captured[gid];
}

static EpStatus* replay(HEp* ep, int32_t gid) {
  if (gid < 0 || gid >= MAX_GRAPHS || !ep->captured[gid])
    return error(ep->api, EP_INVALID_ARGUMENT, "graph %d was not captured", gid);
  for (int i = 0; i < ep->nsteps[gid]; ++i) {
    Step* s = &ep->steps[gid][i];
    for (int64_t j = 0; j < s->n; ++j) s->out[j] = s->a[j] + s->b[j];
  }
  return NULL;
}

static EpStatus* ep_replay(Ep* self, int32_t gid) {
  HEp* ep = (HEp*)self;
  ENTER(ep->api, "Ep.ReplayGraph");
  return replay(ep, gid);
}

static int32_t ep_graph_policy(const Ep* self) {
  (void)self;
  ENTER_INT("Ep.GetGraphCaptureNodeAssignmentPolicy", 4242);
  return EP_GRAPH_ALL_NODES_ON_EP;
}

static EpStatus* ep_release_graph(Ep* self, int32_t gid) {
  HEp* ep = (HEp*)self;
  ENTER(ep->api, "Ep.ReleaseCapturedGraph");
  if (gid >= 0 && gid < MAX_GRAPHS) ep->captured[gid] = ep->runs[gid] = 0;
  return NULL;
}

static EpStatus* ep_replay_sync(Ep* self, int32_t gid, int32_t sync) {
  HEp* ep = (HEp*)self;
  (void)sync;
  ENTER(ep->api, "Ep.ReplayGraphWithSync");
  return replay(ep, gid);
}

/* ---- the factory ----------------------------------------------------------------------------- */

static const char* factory_get_name(const EpFactory* self) {
  (void)self;
  ENTER_NAME("EpFactory.GetName");
  return EP_NAME;
}

static const char* factory_get_vendor(const EpFactory* self) {
  (void)self;
  ENTER_NAME("EpFactory.GetVendor");
  return "ephost-hostile";
}

static const char* factory_get_version(const EpFactory* self) {
  (void)self;
  ENTER_NAME("EpFactory.GetVersion");
  return "6.6.6";
}

static EpStatus* factory_validate(EpFactory* self, const EpDevice* devices, size_t num_devices, const char* info,
                                  int32_t* compatibility) {
  HFactory* f = (HFactory*)self;
  (void)devices, (void)num_devices;
  ENTER(f->api, "EpFactory.ValidateCompiledModelCompatibilityInfo");
  *compatibility = has("compat_absurd") ? 77
                   : strcmp(info, "HostileEP;context=1") == 0 ? EP_COMPILED_MODEL_SUPPORTED_OPTIMAL
                                                              : EP_COMPILED_MODEL_UNSUPPORTED;
  return NULL;
}

static EpStatus* factory_devices(EpFactory* self, EpDevice* devices, size_t max_devices, size_t* num_devices) {
  HFactory* f = (HFactory*)self;
  ENTER(f->api, "EpFactory.GetSupportedDevices");
  *num_devices = 0;
  if (has("devices_zero") || max_devices == 0) return NULL;
  memset(&devices[0], 0, sizeof devices[0]);
  devices[0].device_type = has("device=cpu") ? EP_DEVICE_CPU : EP_DEVICE_GPU;
  devices[0].name = has("badutf8_device") ? BAD_UTF8 : "hostile-device";
  devices[0].memory_info = &f->memory;
  *num_devices = has("devices_huge") ? ((size_t)1 << 40) : 1;
  return NULL;
}

static EpStatus* factory_create_ep(EpFactory* self, const EpDevice* devices, size_t num_devices,
                                   const EpKeyValue* options, size_t num_options,
                                   const EpSessionOptions* session_options, const EpLogger* logger, Ep** out) {
  HFactory* f = (HFactory*)self;
  (void)devices, (void)num_devices;
  ENTER(f->api, "EpFactory.CreateEp");
  *out = NULL;
  g_complaint[0] = '\0';
  abuse_global(f->api, session_options, logger);
  if (g_complaint[0]) return error(f->api, EP_FAIL, "host accepted a bad call: %s", g_complaint);
  if (has("nullout=EpFactory.CreateEp")) return NULL;
  HEp* ep = calloc(1, sizeof *ep);
  ep->table.struct_size = sizeof(Ep);
  ep->table.version = EP_ABI_VERSION;
  ep->table.GetName = ep_get_name;
  ep->table.GetCapability = ep_get_capability;
  ep->table.CreateKernel = ep_create_kernel;
  ep->table.OnRunStart = ep_on_run_start;
  ep->table.OnRunEnd = ep_on_run_end;
  ep->table.CreateAllocator = ep_create_allocator;
  ep->table.CreateSyncStreamForDevice = ep_create_stream;
  ep->table.Sync = ep_sync;
  ep->table.IsConcurrentRunSupported = ep_concurrent;
  ep->table.IsGraphCaptureEnabled = ep_graph_enabled;
  ep->table.IsGraphCaptured = ep_graph_captured;
  ep->table.ReplayGraph = ep_replay;
  ep->table.GetGraphCaptureNodeAssignmentPolicy = ep_graph_policy;
  ep->table.ReleaseCapturedGraph = ep_release_graph;
  ep->table.ReplayGraphWithSync = ep_replay_sync;
  ep->table.Compile = ep_compile;
  ep->table.CompileFromContext = ep_compile_from_context;
  ep->table.GetCompiledModelCompatibilityInfo = ep_compatibility;
  ep->factory = f;
  ep->api = f->api;
  ep->logger = logger;
  ep->capturing = -1;
  for (size_t i = 0; i < num_options; ++i)
    if (strcmp(options[i].key, "graph") == 0 && strcmp(options[i].value, "1") == 0) ep->graph = 1;
    else if (strcmp(options[i].key, "fuse") == 0 && strcmp(options[i].value, "1") == 0) ep->fuse = 1;
  finish_table("Ep", ep, sizeof ep->table);
  live(K_EP, 1);
  *out = &ep->table;
  return NULL;
}

static void factory_release_ep(EpFactory* self, Ep* e) {
  called("EpFactory.ReleaseEp");
  HEp* ep = (HEp*)e;
  if (ep == NULL) return;
  for (HAllocator* a = ((HFactory*)self)->allocators; a != NULL; a = a->next)
    if (a->ep == ep) a->ep = NULL;
  for (HKernel* k = ep->kernel_list; k != NULL;) {
    HKernel* next = k->next;
    if (!k->released) orphan(K_KERNEL); /* the host never released it */
    free(k);
    k = next;
  }
  free(ep);
  live(K_EP, -1);
}

static EpStatus* factory_create_allocator(EpFactory* self, const EpMemoryInfo* info, EpAllocator** out) {
  HFactory* f = (HFactory*)self;
  (void)info;
  ENTER(f->api, "EpFactory.CreateAllocator");
  *out = NULL;
  if (has("nullout=EpFactory.CreateAllocator")) return NULL;
  return make_allocator(f, out);
}

static void factory_release_allocator(EpFactory* self, EpAllocator* allocator) {
  (void)self;
  called("EpFactory.ReleaseAllocator");
  HAllocator* a = (HAllocator*)allocator;
  if (a == NULL || a->released) return;
  if (a->ep != NULL) fprintf(stderr, "HostileEP: allocator released before the EP that created it\n");
  a->released = 1;
  live(K_ALLOCATOR, -1);
}

static EpStatus* factory_create_transfer(EpFactory* self, EpDataTransfer** out) {
  HFactory* f = (HFactory*)self;
  ENTER(f->api, "EpFactory.CreateDataTransfer");
  *out = NULL;
  if (has("nullout=EpFactory.CreateDataTransfer")) return NULL;
  HTransfer* t = calloc(1, sizeof *t);
  t->table.struct_size = sizeof(EpDataTransfer);
  t->table.version = EP_ABI_VERSION;
  t->table.CanCopy = transfer_can_copy;
  t->table.CopyTensors = transfer_copy;
  t->table.Release = transfer_release;
  t->api = f->api;
  finish_table("EpDataTransfer", t, sizeof t->table);
  live(K_TRANSFER, 1);
  *out = &t->table;
  return NULL;
}

static int32_t factory_stream_aware(const EpFactory* self) {
  (void)self;
  ENTER_INT("EpFactory.IsStreamAware", -3);
  return 1;
}

static EpStatus* factory_create_stream(EpFactory* self, const EpMemoryInfo* info, EpSyncStream** out) {
  HFactory* f = (HFactory*)self;
  (void)info;
  ENTER(f->api, "EpFactory.CreateSyncStreamForDevice");
  *out = NULL;
  if (has("nullout=EpFactory.CreateSyncStreamForDevice")) return NULL;
  return make_stream(f->api, out);
}

__attribute__((unused)) static HFactory* make_factory(const EpApi* api, const EpLogger* logger) {
  HFactory* f = calloc(1, sizeof *f);
  f->table.struct_size = sizeof(EpFactory);
  f->table.version = EP_ABI_VERSION;
  f->table.GetName = factory_get_name;
  f->table.GetVendor = factory_get_vendor;
  f->table.GetVersion = factory_get_version;
  f->table.GetSupportedDevices = factory_devices;
  f->table.CreateEp = factory_create_ep;
  f->table.ReleaseEp = factory_release_ep;
  f->table.CreateAllocator = factory_create_allocator;
  f->table.ReleaseAllocator = factory_release_allocator;
  f->table.CreateDataTransfer = factory_create_transfer;
  f->table.IsStreamAware = factory_stream_aware;
  f->table.CreateSyncStreamForDevice = factory_create_stream;
  f->table.ValidateCompiledModelCompatibilityInfo = factory_validate;
  f->api = api;
  f->logger = logger;
  f->memory.name = has("badutf8_memory") ? BAD_UTF8 : "HostileMem";
  f->memory.device_type = has("device=cpu") ? EP_DEVICE_CPU : EP_DEVICE_GPU;
  f->memory.device_id = 0;
  f->memory.mem_type = EP_MEM_DEFAULT;
  live(K_FACTORY, 1);
  return f;
}

static void free_factory(HFactory* f) {
  for (HAllocator* a = f->allocators; a != NULL;) {
    HAllocator* next = a->next;
    if (!a->released) orphan(K_ALLOCATOR);
    for (int b = 0; b < a->blocks; ++b) orphan(K_BLOCK); /* blocks the host never freed */
    free(a);
    a = next;
  }
  free(f);
}

#ifndef HOSTILE_DATA_ENTRY
EpStatus* CreateEpFactories(const char* registration_name, const EpApiBase* api_base, const EpLogger* logger,
                            EpFactory** factories, size_t max_factories, size_t* num_factories) {
  (void)registration_name;
  load_spec();
  called("CreateEpFactories");
  *num_factories = 0;
  uint32_t version = api_base->version < EP_ABI_VERSION ? api_base->version : EP_ABI_VERSION;
  const EpApi* api = api_base->GetApi(version);
  if (api == NULL) return NULL;
  g_api = api;
  g_complaint[0] = '\0';
  abuse_base(api_base);
  if (g_complaint[0]) return error(api, EP_FAIL, "host accepted a bad call: %s", g_complaint);
  if (has("fail=CreateEpFactories")) return error(api, EP_FAIL, "injected failure in CreateEpFactories");
  if (max_factories < 2) return error(api, EP_INVALID_ARGUMENT, "need room for two factories");
  HFactory* f = make_factory(api, logger);
  finish_table("EpFactory", f, sizeof f->table);
  factories[0] = &f->table;
  *num_factories = 1;
  if (has("factories_huge")) *num_factories = (size_t)1 << 40;
  if (has("second_factory_bad")) {
    /* A second factory the host must reject, after accepting the first. */
    HFactory* g = make_factory(api, logger);
    g->table.version = 0;
    factories[1] = &g->table;
    *num_factories = 2;
  }
  return NULL;
}
#endif

EpStatus* ReleaseEpFactory(EpFactory* factory) {
  called("ReleaseEpFactory");
  if (factory == NULL) return NULL;
  if (g_live[K_EP] > 0) fprintf(stderr, "HostileEP: factory released while %d EP(s) live\n", g_live[K_EP]);
  free_factory((HFactory*)factory);
  live(K_FACTORY, -1);
  if (has("fail=ReleaseEpFactory") && g_api != NULL)
    return error(g_api, EP_FAIL, "injected failure in ReleaseEpFactory");
  return NULL;
}
