/*
 * nvtx_capture: an NVTX tool (injection library) for tests and benchmarks.
 *
 * Loaded by the NVTX headers of any library in the process when NVTX_INJECTION64_PATH names
 * this .so. It records every domain range, mark and counter sample, one tab-separated line
 * each, to the file named by NVTX_CAPTURE_PATH (stderr when unset):
 *
 *     start    <ts_ns> <domain> <range_id> <payload> <message>   (nvtxDomainRangeStartEx)
 *     end      <ts_ns> <domain> <range_id>                        (nvtxDomainRangeEnd)
 *     push     <ts_ns> <domain> -          <payload> <message>   (nvtxDomainRangePushEx)
 *     pop      <ts_ns> <domain>                                   (nvtxDomainRangePop)
 *     mark     <ts_ns> <domain> -          <payload> <message>   (nvtxDomainMarkEx)
 *     counter  <ts_ns> <domain> <counter name> <value>            (nvtxCounterSample*)
 *
 * ts_ns is CLOCK_MONOTONIC, the clock of Python's time.monotonic_ns(), so ranges can be
 * compared with the engine's record timestamps. <payload> is "-" when the event has none.
 *
 * Core callbacks come through InitializeInjectionNvtx2 (the CORE2 function table of
 * nvtxDetail/nvtxTypes.h). Counters live in an NVTX extension module (module id 4) that
 * the headers of nvidia-nvtx-cu12 do not describe, so the few structs this needs are
 * declared below with the layout of nvToolsExtCounters.h / nvtxExtTypes.h.
 *
 * Build: gcc -shared -fPIC -O2 -I<site-packages>/nvidia/nvtx/include nvtx_capture.c
 *        -o libnvtx_capture.so -lpthread
 */
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct nvtxDomainRegistration_st {
    char *name;
};

struct nvtxStringRegistration_st {
    char *text;
};

static pthread_mutex_t capture_lock = PTHREAD_MUTEX_INITIALIZER;
static FILE *capture_file;
static uint64_t num_ranges_started;

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static const char *domain_name(nvtxDomainHandle_t domain)
{
    return domain ? domain->name : "";
}

static const char *message_text(const nvtxEventAttributes_t *attrib)
{
    if (attrib->messageType == NVTX_MESSAGE_TYPE_REGISTERED && attrib->message.registered)
        return attrib->message.registered->text;
    if (attrib->messageType == NVTX_MESSAGE_TYPE_ASCII && attrib->message.ascii)
        return attrib->message.ascii;
    return "";
}

static void format_payload(const nvtxEventAttributes_t *attrib, char *out, size_t size)
{
    switch (attrib->payloadType) {
    case NVTX_PAYLOAD_TYPE_INT64:
        snprintf(out, size, "%lld", (long long)attrib->payload.llValue);
        break;
    case NVTX_PAYLOAD_TYPE_UNSIGNED_INT64:
        snprintf(out, size, "%llu", (unsigned long long)attrib->payload.ullValue);
        break;
    case NVTX_PAYLOAD_TYPE_DOUBLE:
        snprintf(out, size, "%.17g", attrib->payload.dValue);
        break;
    default:
        snprintf(out, size, "-");
    }
}

/* Caller holds capture_lock. */
static void write_event(const char *kind, int64_t ts_ns, nvtxDomainHandle_t domain,
                        const char *id, const nvtxEventAttributes_t *attrib)
{
    char payload[64];
    format_payload(attrib, payload, sizeof payload);
    fprintf(capture_file, "%s\t%lld\t%s\t%s\t%s\t%s\n", kind, (long long)ts_ns,
            domain_name(domain), id, payload, message_text(attrib));
}

static nvtxDomainHandle_t domain_create(const char *name)
{
    nvtxDomainHandle_t domain = calloc(1, sizeof *domain);
    domain->name = strdup(name ? name : "");
    return domain;
}

static void domain_destroy(nvtxDomainHandle_t domain)
{
    (void)domain; /* kept: events may still name it */
}

static nvtxStringHandle_t register_string(nvtxDomainHandle_t domain, const char *text)
{
    (void)domain;
    nvtxStringHandle_t handle = calloc(1, sizeof *handle);
    handle->text = strdup(text ? text : "");
    return handle;
}

static void name_category(nvtxDomainHandle_t domain, uint32_t category, const char *name)
{
    (void)domain, (void)category, (void)name;
}

static nvtxRangeId_t range_start(nvtxDomainHandle_t domain, const nvtxEventAttributes_t *attrib)
{
    int64_t ts_ns = now_ns();
    char id[32];
    pthread_mutex_lock(&capture_lock);
    nvtxRangeId_t range_id = ++num_ranges_started;
    snprintf(id, sizeof id, "%llu", (unsigned long long)range_id);
    write_event("start", ts_ns, domain, id, attrib);
    pthread_mutex_unlock(&capture_lock);
    return range_id;
}

static void range_end(nvtxDomainHandle_t domain, nvtxRangeId_t range_id)
{
    int64_t ts_ns = now_ns();
    pthread_mutex_lock(&capture_lock);
    fprintf(capture_file, "end\t%lld\t%s\t%llu\n", (long long)ts_ns, domain_name(domain),
            (unsigned long long)range_id);
    pthread_mutex_unlock(&capture_lock);
}

static int range_push(nvtxDomainHandle_t domain, const nvtxEventAttributes_t *attrib)
{
    int64_t ts_ns = now_ns();
    pthread_mutex_lock(&capture_lock);
    write_event("push", ts_ns, domain, "-", attrib);
    pthread_mutex_unlock(&capture_lock);
    return 0;
}

static int range_pop(nvtxDomainHandle_t domain)
{
    int64_t ts_ns = now_ns();
    pthread_mutex_lock(&capture_lock);
    fprintf(capture_file, "pop\t%lld\t%s\n", (long long)ts_ns, domain_name(domain));
    pthread_mutex_unlock(&capture_lock);
    return 0;
}

static void mark(nvtxDomainHandle_t domain, const nvtxEventAttributes_t *attrib)
{
    int64_t ts_ns = now_ns();
    pthread_mutex_lock(&capture_lock);
    write_event("mark", ts_ns, domain, "-", attrib);
    pthread_mutex_unlock(&capture_lock);
}

static void close_capture(void)
{
    pthread_mutex_lock(&capture_lock);
    if (capture_file && capture_file != stderr)
        fclose(capture_file);
    capture_file = NULL;
    pthread_mutex_unlock(&capture_lock);
}

static int open_capture(void)
{
    if (capture_file)
        return 1;
    const char *path = getenv("NVTX_CAPTURE_PATH");
    capture_file = path ? fopen(path, "w") : stderr;
    if (!capture_file)
        return 0;
    atexit(close_capture);
    return 1;
}

static void set_slot(NvtxFunctionTable table, unsigned int size, unsigned int id, void *fn)
{
    if (id < size && table[id])
        *table[id] = (NvtxFunctionPointer)fn;
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table)
{
    const NvtxExportTableCallbacks *callbacks = get_export_table(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable table = NULL;
    unsigned int size = 0;
    if (!open_capture() || !callbacks ||
        !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size))
        return 0;
    set_slot(table, size, NVTX_CBID_CORE2_DomainCreateA, domain_create);
    set_slot(table, size, NVTX_CBID_CORE2_DomainDestroy, domain_destroy);
    set_slot(table, size, NVTX_CBID_CORE2_DomainRegisterStringA, register_string);
    set_slot(table, size, NVTX_CBID_CORE2_DomainNameCategoryA, name_category);
    set_slot(table, size, NVTX_CBID_CORE2_DomainRangeStartEx, range_start);
    set_slot(table, size, NVTX_CBID_CORE2_DomainRangeEnd, range_end);
    set_slot(table, size, NVTX_CBID_CORE2_DomainRangePushEx, range_push);
    set_slot(table, size, NVTX_CBID_CORE2_DomainRangePop, range_pop);
    set_slot(table, size, NVTX_CBID_CORE2_DomainMarkEx, mark);
    return 1;
}

/* ---- counters extension (layouts of nvtxExtTypes.h and nvToolsExtCounters.h) ---- */
enum {
    COUNTERS_MODULE_ID = 4,
    CBID_COUNTER_REGISTER = 0,
    CBID_COUNTER_SAMPLE_INT64 = 1,
    CBID_COUNTER_SAMPLE_FLOAT64 = 2,
    MAX_COUNTERS = 256,
};

typedef struct {
    size_t segment_id;
    size_t slot_count;
    intptr_t *function_slots;
} ext_segment_t;

typedef struct {
    uint16_t nvtx_version;
    uint16_t struct_size;
    uint16_t module_id;
    uint16_t compat_id;
    size_t segments_count;
    ext_segment_t *segments;
    void *get_export_function;
    const void *ext_info;
} ext_module_info_t;

typedef struct {
    size_t struct_size;
    uint64_t schema_id;
    const char *name;
    const char *description;
    uint64_t scope_id;
    const void *semantics;
    uint64_t counter_id;
} counter_attr_t;

static char *counter_names[MAX_COUNTERS];
static uint64_t num_counters;

static uint64_t counter_register(nvtxDomainHandle_t domain, const counter_attr_t *attr)
{
    (void)domain;
    pthread_mutex_lock(&capture_lock);
    uint64_t counter_id = 0;
    if (num_counters < MAX_COUNTERS) {
        counter_names[num_counters] = strdup(attr->name ? attr->name : "");
        counter_id = ++num_counters;
    }
    pthread_mutex_unlock(&capture_lock);
    return counter_id;
}

static const char *counter_name(uint64_t counter_id)
{
    return counter_id >= 1 && counter_id <= num_counters ? counter_names[counter_id - 1] : "?";
}

static void counter_sample_int64(nvtxDomainHandle_t domain, uint64_t counter_id, int64_t value)
{
    int64_t ts_ns = now_ns();
    pthread_mutex_lock(&capture_lock);
    fprintf(capture_file, "counter\t%lld\t%s\t%s\t%lld\n", (long long)ts_ns,
            domain_name(domain), counter_name(counter_id), (long long)value);
    pthread_mutex_unlock(&capture_lock);
}

static void counter_sample_float64(nvtxDomainHandle_t domain, uint64_t counter_id, double value)
{
    int64_t ts_ns = now_ns();
    pthread_mutex_lock(&capture_lock);
    fprintf(capture_file, "counter\t%lld\t%s\t%s\t%.17g\n", (long long)ts_ns,
            domain_name(domain), counter_name(counter_id), value);
    pthread_mutex_unlock(&capture_lock);
}

/* Other extension modules (payload schemas, memory) are left to their defaults. */
int InitializeInjectionNvtxExtension(ext_module_info_t *info)
{
    if (!open_capture())
        return 0;
    if (info->module_id != COUNTERS_MODULE_ID || info->segments_count < 1)
        return 1;
    ext_segment_t *segment = &info->segments[0];
    if (segment->slot_count <= CBID_COUNTER_SAMPLE_FLOAT64)
        return 1;
    segment->function_slots[CBID_COUNTER_REGISTER] = (intptr_t)counter_register;
    segment->function_slots[CBID_COUNTER_SAMPLE_INT64] = (intptr_t)counter_sample_int64;
    segment->function_slots[CBID_COUNTER_SAMPLE_FLOAT64] = (intptr_t)counter_sample_float64;
    return 1;
}
