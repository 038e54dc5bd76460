/*
 * nvtxw_capture: a recording NVTXW backend, for testing the sidecar's exact-timestamp mode
 * (telemetry/sidecar/sinks/nvtx_ranges.py, NvtxWriterSink) through the real nvtx.writer module.
 *
 * nvtx.writer dlopens a backend library, resolves its exported nvtxwGetInterface, asks it
 * for interface version 2 and calls through the returned table of function pointers. This
 * backend implements that table and writes every call it receives as one tab-separated line
 * to the file named by ITERSCOPE_NVTXW_CAPTURE (nvtxwGetInterface fails when it is unset).
 * Strings and raw bytes are written as lowercase hex ("-" for NULL, an empty field for ""),
 * so that messages, config strings with newlines and binary payloads survive unchanged:
 *
 *     interface       <version>
 *     session_begin   <session> <name> <config>
 *     session_end     <session>
 *     domain          <session> <domain> <name>
 *     category        <domain> <category id> <name>
 *     string          <domain> <handle address> <text>
 *     schema          <domain> <schema id> <field mask> <type> <flags> <entries> <static size>
 *     entry           <schema id> <index> <flags> <type> <name> <array detail> <offset>
 *     counter         <domain> <counter id> <schema id> <name> <scope id> [<unit> <min> <max>]
 *                     (unit and limits when counter semantics are attached; limits as the
 *                     hex of their 8 bytes, whatever limitType says they hold)
 *     stream_open     <session> <stream> <name> <domain> <scope id> <time domain id>
 *     stream_close    <stream>
 *     event           <stream> (<schema id> <payload bytes>)...    one pair per payload
 *     event_batch     <stream> <schema id> <flags> <scope> <event bytes>
 *     counter_sample  <stream> <timestamp> <counter id> <sample bytes>
 *     counter_none    <stream> <timestamp> <counter id> <reason>
 *     counter_batch   <stream> <counter id> <flags> <sample bytes> <timestamp bytes>
 *     unsupported     <function>                                   (returns NOT_SUPPORTED)
 *     finalize
 *
 * Sessions, domains, streams and registered strings are numbered from 1 in order of creation.
 * Schema and counter IDs are handed out from 2^32 (the start of the dynamic ID range).
 *
 * ABI: the structs below are declared here from the installed nvtx package's
 * nvtx/_lib/writer.pxd (the `cdef extern from "nvtxw3/nvtxw3.h"` blocks: nvtxwInterface_v2_t,
 * attribute structs), lib.pxd (payload schema structs) and counters.pxd (nvtxCounterAttr_t),
 * cross-checked with NVIDIA's public nvtxw3.h / nvToolsExtPayload.h (NVIDIA/NVTX). Where the
 * two disagree the pxd wins, since it is what the installed package was built against. The
 * interface table's member order and its 43 trailing reserved slots follow the pxd; the pxd
 * declares no leading structSize member in the table (the older NVTXW3 "CORE_V1" table had
 * one), and none is assumed here.
 *
 * Build: gcc -shared -fPIC -O2 -Wall -Wextra -Werror nvtxw_capture.c -o libnvtxw_capture.so
 */
#include <inttypes.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A session whose config string is exactly this is refused (the sink's error path). */
#define REFUSE_CONFIG "refuse-session"

#define RESULT_SUCCESS 0
#define RESULT_FAILED 1
#define RESULT_INVALID_ARGUMENT 2
#define RESULT_INTERFACE_VERSION_NOT_SUPPORTED 6
#define RESULT_NOT_SUPPORTED 7

#define INTERFACE_VERSION 2
#define DYNAMIC_ID_START (UINT64_C(1) << 32)
#define HANDLE_MAGIC 0x6e767478u /* "nvtx": catches a handle passed in the wrong slot */

typedef int32_t result_t;

/* --- handles: every handle the backend gives out points to one of these ----------------- */

typedef struct Handle {
    uint32_t magic;
    char kind;     /* 'S' session, 'D' domain, 'T' stream, 'R' registered string */
    uint64_t id;
} Handle;

/* --- attribute structs (layouts from writer.pxd / lib.pxd / counters.pxd) ----------------- */

typedef struct SessionAttributes {
    size_t structSize;
    const char *name;
    const char *configString;
} SessionAttributes;

typedef struct DomainAttributes {
    size_t structSize;
    const char *name;
} DomainAttributes;

typedef struct StreamAttributes {
    size_t structSize;
    const char *name;
    Handle *domain;
    uint64_t scopeId;
    uint64_t timeDomainId;
    int16_t orderInterleaving;
    int16_t orderingType;
    int32_t orderingSkid;
    int64_t orderingSkidAmount;
} StreamAttributes;

typedef struct SemanticsHeader {
    uint32_t structSize;
    uint16_t semanticId;
    uint16_t version;
    const struct SemanticsHeader *next;
} SemanticsHeader;

/* The counter semantics extension (nvtxSemanticsCounter_t in counters.pxd), semanticId 5. */
#define SEMANTIC_ID_COUNTERS 5

typedef struct CounterSemantics {
    SemanticsHeader header;
    uint64_t flags;
    const char *unit;
    uint64_t unitScaleNumerator;
    uint64_t unitScaleDenominator;
    int64_t limitType;
    double min; /* a union of int64 / uint64 / double; limitType says which */
    double max;
} CounterSemantics;

typedef struct SchemaEntry {
    uint64_t flags;
    uint64_t type;
    const char *name;
    const char *description;
    uint64_t arrayOrUnionDetail;
    uint64_t offset;
    const SemanticsHeader *semantics;
    const void *reserved;
} SchemaEntry;

typedef struct SchemaAttributes {
    uint64_t fieldMask;
    const char *name;
    uint64_t type;
    uint64_t flags;
    const SchemaEntry *entries;
    size_t numEntries;
    size_t payloadStaticSize;
    size_t packAlign;
    uint64_t schemaId;
    void *extension;
} SchemaAttributes;

/* fieldMask bits of SchemaAttributes (nvToolsExtPayload.h) */
#define SCHEMA_FIELD_NAME (1u << 1)
#define SCHEMA_FIELD_TYPE (1u << 2)
#define SCHEMA_FIELD_FLAGS (1u << 3)
#define SCHEMA_FIELD_ENTRIES (1u << 4)
#define SCHEMA_FIELD_NUM_ENTRIES (1u << 5)
#define SCHEMA_FIELD_STATIC_SIZE (1u << 6)

typedef struct CounterAttributes {
    size_t structSize;
    uint64_t schemaId;
    const char *name;
    const char *description;
    uint64_t scopeId;
    const SemanticsHeader *semantics;
    uint64_t counterId;
} CounterAttributes;

typedef struct PayloadData {
    uint64_t schemaId;
    size_t size;
    const void *payload;
} PayloadData;

typedef struct EventBatch {
    uint64_t eventSchemaId;
    size_t size;
    const void *events;
    uint64_t scope;
    uint64_t flags;
    const void *flexData;
    size_t flexDataSize;
    size_t flexDataOffset;
} EventBatch;

typedef struct CounterBatch {
    uint64_t counterId;
    const void *counters;
    size_t countersSize;
    uint64_t flags;
    const int64_t *timestamps;
    size_t timestampsSize;
} CounterBatch;

/* Attributes this backend does not read: only pointers to them are passed. */
typedef struct Opaque Opaque;

/* --- the interface table, member order as in writer.pxd's nvtxwInterface_v2_t ----------- */

typedef struct Interface {
    result_t (*SessionBegin)(const SessionAttributes *attr, Handle **sessionOut);
    result_t (*SessionEnd)(Handle *session);
    result_t (*DomainRegister)(Handle *session, const DomainAttributes *attr,
                               Handle **domainOut);
    result_t (*CategoryRegister)(Handle *domain, uint32_t category, const char *name);
    result_t (*StringRegister)(Handle *domain, const char *string, Handle **stringOut);
    result_t (*ResourceRegister)(Handle *domain, const Opaque *attr);
    result_t (*ScopeRegister)(Handle *domain, const Opaque *attr, uint64_t *scopeIdOut);
    result_t (*SchemaRegister)(Handle *domain, const SchemaAttributes *attr,
                               uint64_t *schemaIdOut);
    result_t (*EnumRegister)(Handle *domain, const Opaque *attr, uint64_t *enumIdOut);
    result_t (*CounterRegister)(Handle *domain, const CounterAttributes *attr,
                                uint64_t *counterIdOut);
    result_t (*TimeDomainRegister)(Handle *domain, const Opaque *attr,
                                   uint64_t *timeDomainIdOut);
    result_t (*StreamOpen)(Handle *session, const StreamAttributes *attr, Handle **streamOut);
    result_t (*StreamClose)(Handle *stream);
    result_t (*EventWrite)(Handle *stream, const PayloadData *payloads, size_t payloadCount);
    result_t (*EventBatchWrite)(Handle *stream, const EventBatch *batch);
    result_t (*CounterWrite)(Handle *stream, int64_t timestamp, uint64_t counterId,
                             const void *data, size_t size);
    result_t (*CounterNoValueWrite)(Handle *stream, int64_t timestamp, uint64_t counterId,
                                    uint8_t reason);
    result_t (*CounterBatchWrite)(Handle *stream, const CounterBatch *batch);
    result_t (*TimeSyncPointWrite)(Handle *stream, uint64_t timeDomainId1,
                                   uint64_t timeDomainId2, int64_t timestamp1,
                                   int64_t timestamp2);
    result_t (*TimeSyncPointTableWrite)(Handle *stream, uint64_t timeDomainIdSrc,
                                        uint64_t timeDomainIdDst, const Opaque *syncPoints,
                                        size_t count);
    result_t (*TimestampConversionFactorWrite)(Handle *stream, uint64_t timeDomainIdSrc,
                                               uint64_t timeDomainIdDst, double slope,
                                               int64_t timestampSrc, int64_t timestampDst);
    void (*reserved[43])(void);
} Interface;

/* --- recording ----------------------------------------------------------------------------- */

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static FILE *out;
static uint64_t next_handle_id[4] = {1, 1, 1, 1}; /* sessions, domains, streams, strings */
static uint64_t next_dynamic_id = DYNAMIC_ID_START;

/* Bytes as a hex field: "-" for NULL, an empty field for zero bytes. */
static void put_hex(const void *data, size_t size)
{
    const unsigned char *bytes = data;
    fputc('\t', out);
    if (data == NULL) {
        fputc('-', out);
        return;
    }
    for (size_t i = 0; i < size; ++i)
        fprintf(out, "%02x", bytes[i]);
}

static void put_string(const char *text)
{
    put_hex(text, text ? strlen(text) : 0);
}

static void put_u64(uint64_t value)
{
    fprintf(out, "\t%" PRIu64, value);
}

static void put_i64(int64_t value)
{
    fprintf(out, "\t%" PRId64, value);
}

static void end_line(void)
{
    fputc('\n', out);
    fflush(out);
}

static Handle *new_handle(char kind)
{
    static const char kinds[] = "SDTR";
    Handle *handle = calloc(1, sizeof *handle);
    if (handle == NULL)
        return NULL;
    handle->magic = HANDLE_MAGIC;
    handle->kind = kind;
    handle->id = next_handle_id[strchr(kinds, kind) - kinds]++;
    return handle;
}

static int is_handle(const Handle *handle, char kind)
{
    return handle != NULL && handle->magic == HANDLE_MAGIC && handle->kind == kind;
}

static result_t unsupported(const char *function)
{
    pthread_mutex_lock(&lock);
    fprintf(out, "unsupported\t%s", function);
    end_line();
    pthread_mutex_unlock(&lock);
    return RESULT_NOT_SUPPORTED;
}

/* --- the interface functions -------------------------------------------------------------- */

static result_t session_begin(const SessionAttributes *attr, Handle **sessionOut)
{
    if (attr == NULL || sessionOut == NULL || attr->structSize < sizeof *attr)
        return RESULT_INVALID_ARGUMENT;
    if (attr->configString && strcmp(attr->configString, REFUSE_CONFIG) == 0)
        return RESULT_FAILED;
    pthread_mutex_lock(&lock);
    Handle *session = new_handle('S');
    if (session != NULL) {
        fputs("session_begin", out);
        put_u64(session->id);
        put_string(attr->name);
        put_string(attr->configString);
        end_line();
    }
    pthread_mutex_unlock(&lock);
    *sessionOut = session;
    return session ? RESULT_SUCCESS : RESULT_FAILED;
}

static result_t session_end(Handle *session)
{
    if (!is_handle(session, 'S'))
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    fputs("session_end", out);
    put_u64(session->id);
    end_line();
    pthread_mutex_unlock(&lock);
    /* Domains and streams of the session stay allocated: a test backend may leak them. */
    session->magic = 0;
    free(session);
    return RESULT_SUCCESS;
}

static result_t domain_register(Handle *session, const DomainAttributes *attr,
                                Handle **domainOut)
{
    if (!is_handle(session, 'S') || domainOut == NULL)
        return RESULT_INVALID_ARGUMENT;
    if (attr != NULL && attr->structSize < sizeof *attr)
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    Handle *domain = new_handle('D');
    if (domain != NULL) {
        fputs("domain", out);
        put_u64(session->id);
        put_u64(domain->id);
        put_string(attr ? attr->name : NULL);
        end_line();
    }
    pthread_mutex_unlock(&lock);
    *domainOut = domain;
    return domain ? RESULT_SUCCESS : RESULT_FAILED;
}

static result_t category_register(Handle *domain, uint32_t category, const char *name)
{
    if (!is_handle(domain, 'D') || name == NULL || category == 0)
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    fputs("category", out);
    put_u64(domain->id);
    put_u64(category);
    put_string(name);
    end_line();
    pthread_mutex_unlock(&lock);
    return RESULT_SUCCESS;
}

static result_t string_register(Handle *domain, const char *string, Handle **stringOut)
{
    if (!is_handle(domain, 'D') || string == NULL || stringOut == NULL)
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    Handle *handle = new_handle('R');
    if (handle != NULL) {
        fputs("string", out);
        put_u64(domain->id);
        put_u64((uint64_t)(uintptr_t)handle); /* the value a payload carries for it */
        put_string(string);
        end_line();
    }
    pthread_mutex_unlock(&lock);
    *stringOut = handle;
    return handle ? RESULT_SUCCESS : RESULT_FAILED;
}

static result_t resource_register(Handle *domain, const Opaque *attr)
{
    (void)domain;
    (void)attr;
    return unsupported("ResourceRegister");
}

static result_t scope_register(Handle *domain, const Opaque *attr, uint64_t *scopeIdOut)
{
    (void)domain;
    (void)attr;
    (void)scopeIdOut;
    return unsupported("ScopeRegister");
}

static result_t schema_register(Handle *domain, const SchemaAttributes *attr,
                                uint64_t *schemaIdOut)
{
    const uint64_t required = SCHEMA_FIELD_TYPE | SCHEMA_FIELD_ENTRIES | SCHEMA_FIELD_NUM_ENTRIES;
    if (!is_handle(domain, 'D') || attr == NULL || schemaIdOut == NULL)
        return RESULT_INVALID_ARGUMENT;
    if ((attr->fieldMask & required) != required || attr->entries == NULL)
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    uint64_t id = next_dynamic_id++;
    fputs("schema", out);
    put_u64(domain->id);
    put_u64(id);
    put_u64(attr->fieldMask);
    put_u64(attr->type);
    put_u64(attr->fieldMask & SCHEMA_FIELD_FLAGS ? attr->flags : 0);
    put_u64(attr->numEntries);
    put_u64(attr->fieldMask & SCHEMA_FIELD_STATIC_SIZE ? attr->payloadStaticSize : 0);
    end_line();
    for (size_t i = 0; i < attr->numEntries; ++i) {
        const SchemaEntry *entry = &attr->entries[i];
        fputs("entry", out);
        put_u64(id);
        put_u64(i);
        put_u64(entry->flags);
        put_u64(entry->type);
        put_string(entry->name);
        put_u64(entry->arrayOrUnionDetail);
        put_u64(entry->offset);
        end_line();
    }
    pthread_mutex_unlock(&lock);
    *schemaIdOut = id;
    return RESULT_SUCCESS;
}

static result_t enum_register(Handle *domain, const Opaque *attr, uint64_t *enumIdOut)
{
    (void)domain;
    (void)attr;
    (void)enumIdOut;
    return unsupported("EnumRegister");
}

static result_t counter_register(Handle *domain, const CounterAttributes *attr,
                                 uint64_t *counterIdOut)
{
    if (!is_handle(domain, 'D') || attr == NULL || counterIdOut == NULL)
        return RESULT_INVALID_ARGUMENT;
    if (attr->structSize < sizeof *attr || attr->name == NULL)
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    uint64_t id = next_dynamic_id++;
    fputs("counter", out);
    put_u64(domain->id);
    put_u64(id);
    put_u64(attr->schemaId);
    put_string(attr->name);
    put_u64(attr->scopeId);
    for (const SemanticsHeader *header = attr->semantics; header; header = header->next) {
        if (header->semanticId != SEMANTIC_ID_COUNTERS
            || header->structSize < sizeof(CounterSemantics))
            continue;
        const CounterSemantics *semantics = (const CounterSemantics *)header;
        put_string(semantics->unit);
        put_hex(&semantics->min, sizeof semantics->min);
        put_hex(&semantics->max, sizeof semantics->max);
        break;
    }
    end_line();
    pthread_mutex_unlock(&lock);
    *counterIdOut = id;
    return RESULT_SUCCESS;
}

static result_t time_domain_register(Handle *domain, const Opaque *attr,
                                     uint64_t *timeDomainIdOut)
{
    (void)domain;
    (void)attr;
    (void)timeDomainIdOut;
    return unsupported("TimeDomainRegister");
}

static result_t stream_open(Handle *session, const StreamAttributes *attr, Handle **streamOut)
{
    if (!is_handle(session, 'S') || attr == NULL || streamOut == NULL)
        return RESULT_INVALID_ARGUMENT;
    if (attr->structSize < sizeof *attr)
        return RESULT_INVALID_ARGUMENT;
    if (attr->domain != NULL && !is_handle(attr->domain, 'D'))
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    Handle *stream = new_handle('T');
    if (stream != NULL) {
        fputs("stream_open", out);
        put_u64(session->id);
        put_u64(stream->id);
        put_string(attr->name);
        put_u64(attr->domain ? attr->domain->id : 0);
        put_u64(attr->scopeId);
        put_u64(attr->timeDomainId);
        end_line();
    }
    pthread_mutex_unlock(&lock);
    *streamOut = stream;
    return stream ? RESULT_SUCCESS : RESULT_FAILED;
}

static result_t stream_close(Handle *stream)
{
    if (!is_handle(stream, 'T'))
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    fputs("stream_close", out);
    put_u64(stream->id);
    end_line();
    pthread_mutex_unlock(&lock);
    stream->magic = 0;
    free(stream);
    return RESULT_SUCCESS;
}

static result_t event_write(Handle *stream, const PayloadData *payloads, size_t payloadCount)
{
    if (!is_handle(stream, 'T') || payloads == NULL || payloadCount == 0)
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    fputs("event", out);
    put_u64(stream->id);
    for (size_t i = 0; i < payloadCount; ++i) {
        put_u64(payloads[i].schemaId);
        put_hex(payloads[i].payload, payloads[i].size);
    }
    end_line();
    pthread_mutex_unlock(&lock);
    return RESULT_SUCCESS;
}

static result_t event_batch_write(Handle *stream, const EventBatch *batch)
{
    if (!is_handle(stream, 'T') || batch == NULL || batch->events == NULL)
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    fputs("event_batch", out);
    put_u64(stream->id);
    put_u64(batch->eventSchemaId);
    put_u64(batch->flags);
    put_u64(batch->scope);
    put_hex(batch->events, batch->size);
    end_line();
    pthread_mutex_unlock(&lock);
    return RESULT_SUCCESS;
}

static result_t counter_write(Handle *stream, int64_t timestamp, uint64_t counterId,
                              const void *data, size_t size)
{
    if (!is_handle(stream, 'T') || data == NULL || size == 0)
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    fputs("counter_sample", out);
    put_u64(stream->id);
    put_i64(timestamp);
    put_u64(counterId);
    put_hex(data, size);
    end_line();
    pthread_mutex_unlock(&lock);
    return RESULT_SUCCESS;
}

static result_t counter_no_value_write(Handle *stream, int64_t timestamp, uint64_t counterId,
                                       uint8_t reason)
{
    if (!is_handle(stream, 'T'))
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    fputs("counter_none", out);
    put_u64(stream->id);
    put_i64(timestamp);
    put_u64(counterId);
    put_u64(reason);
    end_line();
    pthread_mutex_unlock(&lock);
    return RESULT_SUCCESS;
}

static result_t counter_batch_write(Handle *stream, const CounterBatch *batch)
{
    if (!is_handle(stream, 'T') || batch == NULL || batch->counters == NULL)
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    fputs("counter_batch", out);
    put_u64(stream->id);
    put_u64(batch->counterId);
    put_u64(batch->flags);
    put_hex(batch->counters, batch->countersSize);
    put_hex(batch->timestamps, batch->timestampsSize);
    end_line();
    pthread_mutex_unlock(&lock);
    return RESULT_SUCCESS;
}

static result_t time_sync_point_write(Handle *stream, uint64_t timeDomainId1,
                                      uint64_t timeDomainId2, int64_t timestamp1,
                                      int64_t timestamp2)
{
    (void)stream;
    (void)timeDomainId1;
    (void)timeDomainId2;
    (void)timestamp1;
    (void)timestamp2;
    return unsupported("TimeSyncPointWrite");
}

static result_t time_sync_point_table_write(Handle *stream, uint64_t timeDomainIdSrc,
                                            uint64_t timeDomainIdDst,
                                            const Opaque *syncPoints, size_t count)
{
    (void)stream;
    (void)timeDomainIdSrc;
    (void)timeDomainIdDst;
    (void)syncPoints;
    (void)count;
    return unsupported("TimeSyncPointTableWrite");
}

static result_t timestamp_conversion_factor_write(Handle *stream, uint64_t timeDomainIdSrc,
                                                  uint64_t timeDomainIdDst, double slope,
                                                  int64_t timestampSrc, int64_t timestampDst)
{
    (void)stream;
    (void)timeDomainIdSrc;
    (void)timeDomainIdDst;
    (void)slope;
    (void)timestampSrc;
    (void)timestampDst;
    return unsupported("TimestampConversionFactorWrite");
}

/* Every baseline member is set; the reserved slots stay NULL, as the contract requires. */
static const Interface interface_v2 = {
    .SessionBegin = session_begin,
    .SessionEnd = session_end,
    .DomainRegister = domain_register,
    .CategoryRegister = category_register,
    .StringRegister = string_register,
    .ResourceRegister = resource_register,
    .ScopeRegister = scope_register,
    .SchemaRegister = schema_register,
    .EnumRegister = enum_register,
    .CounterRegister = counter_register,
    .TimeDomainRegister = time_domain_register,
    .StreamOpen = stream_open,
    .StreamClose = stream_close,
    .EventWrite = event_write,
    .EventBatchWrite = event_batch_write,
    .CounterWrite = counter_write,
    .CounterNoValueWrite = counter_no_value_write,
    .CounterBatchWrite = counter_batch_write,
    .TimeSyncPointWrite = time_sync_point_write,
    .TimeSyncPointTableWrite = time_sync_point_table_write,
    .TimestampConversionFactorWrite = timestamp_conversion_factor_write,
};

/* --- exported entry points ---------------------------------------------------------------- */

__attribute__((visibility("default")))
result_t nvtxwGetInterface(int32_t version, const void **ifaceOut)
{
    if (ifaceOut == NULL)
        return RESULT_INVALID_ARGUMENT;
    pthread_mutex_lock(&lock);
    if (out == NULL) {
        const char *path = getenv("ITERSCOPE_NVTXW_CAPTURE");
        out = path && *path ? fopen(path, "a") : NULL;
    }
    if (out == NULL) {
        pthread_mutex_unlock(&lock);
        return RESULT_FAILED;
    }
    fprintf(out, "interface\t%" PRId32, version);
    end_line();
    pthread_mutex_unlock(&lock);
    if (version != INTERFACE_VERSION)
        return RESULT_INTERFACE_VERSION_NOT_SUPPORTED;
    *ifaceOut = &interface_v2;
    return RESULT_SUCCESS;
}

/* Optional hook; nvtx.writer calls it when the last wrapper of the backend is closed. */
__attribute__((visibility("default")))
void nvtxwFinalize(void)
{
    pthread_mutex_lock(&lock);
    if (out != NULL) {
        fputs("finalize", out);
        end_line();
        fclose(out);
        out = NULL;
    }
    pthread_mutex_unlock(&lock);
}
