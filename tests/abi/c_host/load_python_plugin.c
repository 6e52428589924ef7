/* A host in plain C: loads an EP plugin library through ep_abi.h alone.
 *
 * Used by tests/abi/test_c_abi.py with the cffi-embedded Python example plugin: dlopen starts
 * nothing, the first call into the plugin starts an interpreter (cffi embedding), and the
 * plugin must then behave exactly as it does under the Python host. This host serves its own
 * EpApiBase/EpApi: status and logging functions are real, the kernel-context functions answer
 * EP_NOT_IMPLEMENTED (no model runs here).
 *
 * usage: load_python_plugin PLUGIN.so
 * prints: name/vendor/version/devices/ep/requested lines; exit 0 on success.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_abi.h"

struct EpStatus {
  int32_t code;
  char* message;
};

static EpStatus* create_status(int32_t code, const char* message) {
  EpStatus* s = malloc(sizeof *s);
  if (s == NULL) return NULL;
  s->code = code;
  s->message = strdup(message != NULL ? message : "");
  return s;
}

static int32_t get_error_code(const EpStatus* s) { return s == NULL ? EP_OK : s->code; }

static const char* get_error_message(const EpStatus* s) { return s == NULL || s->message == NULL ? "" : s->message; }

static void release_status(EpStatus* s) {
  if (s == NULL) return;
  free(s->message);
  free(s);
}

static void logger_log(const EpLogger* logger, int32_t severity, const char* message) {
  (void)logger;
  fprintf(stderr, "[plugin log %d] %s\n", (int)severity, message != NULL ? message : "");
}

static EpStatus* get_config_entry(const EpSessionOptions* o, const char* key, char* value, size_t* size) {
  (void)o, (void)key, (void)value, (void)size;
  return create_status(EP_NOT_FOUND, "this C host has no session config entries");
}

static EpStatus* get_io(EpKernelContext* c, const EpKernelIO** io) {
  (void)c, (void)io;
  return create_status(EP_NOT_IMPLEMENTED, "this C host runs no kernels");
}

static EpStatus* get_output(EpKernelContext* c, int32_t i, const int64_t* shape, int32_t ndim, EpTensor** out) {
  (void)c, (void)i, (void)shape, (void)ndim, (void)out;
  return create_status(EP_NOT_IMPLEMENTED, "this C host runs no kernels");
}

static EpStatus* get_gpu_stream(EpKernelContext* c, void** stream) {
  (void)c, (void)stream;
  return create_status(EP_NOT_IMPLEMENTED, "this C host runs no kernels");
}

static EpStatus* get_sync_stream(EpKernelContext* c, EpSyncStream** stream) {
  (void)c, (void)stream;
  return create_status(EP_NOT_IMPLEMENTED, "this C host runs no kernels");
}

/* One table per served version, each cut at that version's struct_size. */
static EpApi g_api[EP_ABI_VERSION + 1];
static uint32_t g_requested = 0;

static const EpApi* get_api(uint32_t version) {
  g_requested = version;
  if (version < EP_ABI_MIN_VERSION || version > EP_ABI_VERSION) return NULL;
  return &g_api[version];
}

static const char* get_version_string(void) { return "c-host 1.0"; }

static void init_api(void) {
  for (uint32_t v = EP_ABI_MIN_VERSION; v <= EP_ABI_VERSION; ++v) {
    EpApi* a = &g_api[v];
    memset(a, 0, sizeof *a);
    a->version = v;
    a->struct_size = v >= 4 ? sizeof(EpApi) : offsetof(EpApi, KernelContext_GetSyncStream);
    a->CreateStatus = create_status;
    a->GetErrorCode = get_error_code;
    a->GetErrorMessage = get_error_message;
    a->ReleaseStatus = release_status;
    a->Logger_Log = logger_log;
    a->SessionOptions_GetConfigEntry = get_config_entry;
    a->KernelContext_GetIO = get_io;
    a->KernelContext_GetOutput = get_output;
    a->KernelContext_GetGPUComputeStream = get_gpu_stream;
    if (v >= 4) a->KernelContext_GetSyncStream = get_sync_stream;
  }
}

static int fail(const char* what, EpStatus* st) {
  fprintf(stderr, "%s failed (%d): %s\n", what, (int)get_error_code(st), get_error_message(st));
  release_status(st);
  return 3;
}

#define HAS(table, type, slot) \
  ((table)->struct_size >= offsetof(type, slot) + sizeof((table)->slot) && (table)->slot != NULL)

typedef EpStatus* (*CreateFn)(const char*, const EpApiBase*, const EpLogger*, EpFactory**, size_t, size_t*);
typedef EpStatus* (*ReleaseFn)(EpFactory*);

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s PLUGIN.so\n", argv[0]);
    return 2;
  }
  init_api();
  /* RTLD_GLOBAL: the interpreter the plugin starts loads extension modules (numpy, _cffi_backend)
   * that expect libpython's symbols to be globally visible. */
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
  if (lib == NULL) {
    fprintf(stderr, "dlopen failed: %s\n", dlerror());
    return 2;
  }
  CreateFn create = (CreateFn)dlsym(lib, "CreateEpFactories");
  ReleaseFn release = (ReleaseFn)dlsym(lib, "ReleaseEpFactory");
  if (create == NULL || release == NULL) {
    fprintf(stderr, "missing entry symbols\n");
    return 2;
  }
  EpApiBase base;
  memset(&base, 0, sizeof base);
  base.struct_size = sizeof base;
  base.version = EP_ABI_VERSION;
  base.GetApi = get_api;
  base.GetVersionString = get_version_string;

  EpFactory* factories[4] = {NULL};
  size_t count = 0;
  EpStatus* st = create("c-host", &base, NULL, factories, 4, &count);
  if (st != NULL) return fail("CreateEpFactories", st);
  printf("requested: %u\n", (unsigned)g_requested);
  printf("factories: %zu\n", count);
  for (size_t i = 0; i < count; ++i) {
    EpFactory* f = factories[i];
    if (f == NULL || f->version < EP_ABI_MIN_VERSION || !HAS(f, EpFactory, ReleaseEp)) {
      fprintf(stderr, "factory %zu: NULL, bad version or truncated table\n", i);
      return 4;
    }
    printf("name: %s\n", f->GetName(f));
    printf("vendor: %s\n", f->GetVendor(f));
    printf("version: %s\n", HAS(f, EpFactory, GetVersion) ? f->GetVersion(f) : "");
    EpDevice devices[8];
    size_t num_devices = 0;
    st = f->GetSupportedDevices(f, devices, 8, &num_devices);
    if (st != NULL) return fail("GetSupportedDevices", st);
    printf("devices: %zu\n", num_devices);
    if (num_devices > 0) {
      Ep* ep = NULL;
      st = f->CreateEp(f, devices, 1, NULL, 0, NULL, NULL, &ep);
      if (st != NULL) return fail("CreateEp", st);
      printf("ep: %s (declared v%u)\n", ep->GetName(ep), (unsigned)ep->version);
      f->ReleaseEp(f, ep);
    }
    st = release(f);
    if (st != NULL) return fail("ReleaseEpFactory", st);
  }
  printf("released: %zu\n", count);
  return 0;
}
