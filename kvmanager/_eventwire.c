/* _eventwire: the central KV manager's decoder of a packed KVEventBatch (wire version 2).
 *
 * decode_batch_fields(data) -> (worker_id, incarnation, first_seq, events, occupancy,
 *                               created_at, oldest_event_at, is_draining) or None
 *
 * The fields of ``events.WireBatch``, in its order, from any bytes-like object: events as
 * (kind, tier code, keys) tuples, keys a bytes copy of the event's packed little-endian
 * keys (None for a clear). None when the data is not exactly one well-formed batch: the
 * caller then runs the Python decoder (``events._decode_batch_py``), which says why. The
 * checks are the same as that decoder's, so both accept exactly the same input.
 *
 * Header, little-endian: version B, is_draining B, len(worker_id) B, len(incarnation) B,
 * number of events H, first_seq Q, created_at d, oldest_event_at d, occupancy 4 I per tier;
 * then the two ids (UTF-8); then per event: kind B, tier code B, number of keys I, the keys.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define WIRE_VERSION 2
#define NUM_TIERS 2
#define NUM_OCCUPANCY (4 * NUM_TIERS)
#define HEADER_SIZE (1 + 1 + 1 + 1 + 2 + 8 + 8 + 8 + 4 * NUM_OCCUPANCY)
#define EVENT_HEADER_SIZE (1 + 1 + 4)
#define KIND_CLEARED 2
#define ALL_TIERS 255

static inline uint64_t load_le(const unsigned char *p, int n)
{
    uint64_t value = 0;
    for (int i = n - 1; i >= 0; i--)
        value = (value << 8) | p[i];
    return value;
}

static inline double load_le_double(const unsigned char *p)
{
    uint64_t bits = load_le(p, 8);
    double value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The events list, or NULL with *malformed set (no exception) or an exception set. */
static PyObject *decode_events(const unsigned char *p, Py_ssize_t size, Py_ssize_t offset,
                               unsigned num_events, int *malformed)
{
    PyObject *events = PyList_New(num_events);
    if (events == NULL)
        return NULL;
    for (unsigned i = 0; i < num_events; i++) {
        if (size - offset < EVENT_HEADER_SIZE)
            goto bad;
        unsigned kind = p[offset], tier = p[offset + 1];
        uint64_t num_keys = load_le(p + offset + 2, 4);
        Py_ssize_t start = offset + EVENT_HEADER_SIZE;
        if (num_keys > (uint64_t)(size - start) / 8)
            goto bad;
        offset = start + (Py_ssize_t)(8 * num_keys);
        PyObject *keys;
        if (kind < KIND_CLEARED && tier < NUM_TIERS) {
            keys = PyBytes_FromStringAndSize((const char *)p + start, (Py_ssize_t)(8 * num_keys));
            if (keys == NULL)
                goto error;
        } else if (kind == KIND_CLEARED && num_keys == 0 && (tier < NUM_TIERS || tier == ALL_TIERS)) {
            keys = Py_NewRef(Py_None);
        } else {
            goto bad;
        }
        PyObject *event = Py_BuildValue("(IIN)", kind, tier, keys);
        if (event == NULL)
            goto error;
        PyList_SET_ITEM(events, i, event);
    }
    if (offset != size)
        goto bad;
    return events;
bad:
    *malformed = 1;
error:
    Py_DECREF(events);
    return NULL;
}

static PyObject *decode_batch_fields(PyObject *module, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = view.buf;
    Py_ssize_t size = view.len;
    PyObject *worker_id = NULL, *incarnation = NULL, *events = NULL, *occupancy = NULL, *result = NULL;
    int malformed = 0;
    if (size < HEADER_SIZE || p[0] != WIRE_VERSION)
        goto bad;
    Py_ssize_t id_end = HEADER_SIZE + p[2], ids_end = id_end + p[3];
    if (ids_end > size)
        goto bad;
    worker_id = PyUnicode_DecodeUTF8((const char *)p + HEADER_SIZE, p[2], "strict");
    incarnation = worker_id ? PyUnicode_DecodeUTF8((const char *)p + id_end, p[3], "strict") : NULL;
    if (incarnation == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            goto done;
        PyErr_Clear();
        goto bad;
    }
    events = decode_events(p, size, ids_end, (unsigned)load_le(p + 4, 2), &malformed);
    if (events == NULL) {
        if (malformed)
            goto bad;
        goto done;
    }
    occupancy = PyTuple_New(NUM_OCCUPANCY);
    if (occupancy == NULL)
        goto done;
    for (int i = 0; i < NUM_OCCUPANCY; i++) {
        PyObject *count = PyLong_FromUnsignedLongLong(load_le(p + 30 + 4 * i, 4));
        if (count == NULL)
            goto done;
        PyTuple_SET_ITEM(occupancy, i, count);
    }
    result = Py_BuildValue("(OOKOOddO)", worker_id, incarnation, (unsigned long long)load_le(p + 6, 8),
                           events, occupancy, load_le_double(p + 14), load_le_double(p + 22),
                           p[1] ? Py_True : Py_False);
    goto done;
bad:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(worker_id);
    Py_XDECREF(incarnation);
    Py_XDECREF(events);
    Py_XDECREF(occupancy);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef eventwire_methods[] = {
    {"decode_batch_fields", decode_batch_fields, METH_O,
     "A packed KVEventBatch's WireBatch fields, or None if it is not exactly one well-formed batch."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef eventwire_module = {
    PyModuleDef_HEAD_INIT, "_eventwire", "The central KV manager's native KV event batch decoder.", -1,
    eventwire_methods,
};

PyMODINIT_FUNC PyInit__eventwire(void)
{
    return PyModule_Create(&eventwire_module);
}
