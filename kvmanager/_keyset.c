/* KeySet: a set of 64-bit block-hash keys for the central cluster index.
 *
 * An open-addressing hash table of uint64 slots (linear probing, Fibonacci
 * hashing of the key, backward-shift deletion: no tombstones). Slot value 0
 * means empty; a real key 0 is kept in a separate flag. The table grows at
 * load 0.7 and shrinks below 1/8. No per-key objects: a key costs 8 bytes
 * (~11 at the average load) where a Python set of ints costs ~60.
 *
 * Batches are applied straight from the wire's packed little-endian keys
 * (add_packed / discard_packed), prefetching the slots a few keys ahead, so
 * a changed key costs about one cache miss and no allocation.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MIN_CAPACITY 8
#define PREFETCH_DISTANCE 8
#define FIB_MULTIPLIER 0x9E3779B97F4A7C15ULL

typedef struct {
    PyObject_HEAD
    uint64_t *table;     /* capacity slots, 0 = empty */
    Py_ssize_t capacity; /* a power of two */
    Py_ssize_t used;     /* non-zero keys in the table */
    int shift;           /* 64 - log2(capacity) */
    int has_zero;        /* whether key 0 is in the set */
} KeySetObject;

typedef struct {
    PyObject_HEAD
    KeySetObject *set;
    Py_ssize_t pos;
    Py_ssize_t length;   /* the set's length when iteration started */
    int zero_done;
} KeySetIterObject;

static PyTypeObject KeySetType;
static PyTypeObject KeySetIterType;

#define KeySet_Check(op) PyObject_TypeCheck(op, &KeySetType)

static inline Py_ssize_t keyset_len(KeySetObject *self) { return self->used + self->has_zero; }

static inline Py_ssize_t slot_of(const KeySetObject *self, uint64_t key)
{
    return (Py_ssize_t)((key * FIB_MULTIPLIER) >> self->shift);
}

static inline uint64_t load_le64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if PY_BIG_ENDIAN
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* ---- the table ------------------------------------------------------------------------ */

static int log2_of(Py_ssize_t capacity)
{
    int n = 0;
    while (((Py_ssize_t)1 << n) < capacity)
        n++;
    return n;
}

/* Smallest capacity holding n keys at load <= 0.5 (room to grow before the next resize). */
static Py_ssize_t capacity_for(Py_ssize_t n)
{
    Py_ssize_t capacity = MIN_CAPACITY;
    while (capacity < 2 * n)
        capacity <<= 1;
    return capacity;
}

static void insert_new(uint64_t *table, Py_ssize_t mask, int shift, uint64_t key)
{
    Py_ssize_t i = (Py_ssize_t)((key * FIB_MULTIPLIER) >> shift);
    while (table[i])
        i = (i + 1) & mask;
    table[i] = key;
}

static int resize(KeySetObject *self, Py_ssize_t capacity)
{
    uint64_t *table = PyMem_Calloc((size_t)capacity, sizeof(uint64_t));
    if (!table) {
        PyErr_NoMemory();
        return -1;
    }
    int shift = 64 - log2_of(capacity);
    Py_ssize_t mask = capacity - 1;
    for (Py_ssize_t i = 0; i < self->capacity; i++)
        if (self->table[i])
            insert_new(table, mask, shift, self->table[i]);
    PyMem_Free(self->table);
    self->table = table;
    self->capacity = capacity;
    self->shift = shift;
    return 0;
}

static inline int needs_growth(const KeySetObject *self)
{
    return (self->used + 1) * 10 > self->capacity * 7;
}

static int maybe_shrink(KeySetObject *self)
{
    if (self->capacity > MIN_CAPACITY && self->used * 8 < self->capacity)
        return resize(self, capacity_for(self->used));
    return 0;
}

static inline int contains_key(const KeySetObject *self, uint64_t key)
{
    if (!key)
        return self->has_zero;
    Py_ssize_t mask = self->capacity - 1, i = slot_of(self, key);
    for (;;) {
        uint64_t k = self->table[i];
        if (k == key)
            return 1;
        if (!k)
            return 0;
        i = (i + 1) & mask;
    }
}

/* 1 if added, 0 if already there, -1 on error. */
static inline int add_key(KeySetObject *self, uint64_t key)
{
    if (!key) {
        int added = !self->has_zero;
        self->has_zero = 1;
        return added;
    }
    if (needs_growth(self) && resize(self, self->capacity * 2) < 0)
        return -1;
    Py_ssize_t mask = self->capacity - 1, i = slot_of(self, key);
    for (;;) {
        uint64_t k = self->table[i];
        if (k == key)
            return 0;
        if (!k) {
            self->table[i] = key;
            self->used++;
            return 1;
        }
        i = (i + 1) & mask;
    }
}

/* 1 if removed, 0 if absent. Backward-shift deletion keeps every probe chain unbroken. */
static inline int discard_key(KeySetObject *self, uint64_t key)
{
    if (!key) {
        int removed = self->has_zero;
        self->has_zero = 0;
        return removed;
    }
    uint64_t *table = self->table;
    Py_ssize_t mask = self->capacity - 1, i = slot_of(self, key);
    for (;;) {
        uint64_t k = table[i];
        if (!k)
            return 0;
        if (k == key)
            break;
        i = (i + 1) & mask;
    }
    Py_ssize_t hole = i, j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t k = table[j];
        if (!k)
            break;
        Py_ssize_t home = slot_of(self, k);
        /* k may move into the hole unless its home lies cyclically in (hole, j]. */
        int stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!stays) {
            table[hole] = k;
            hole = j;
        }
    }
    table[hole] = 0;
    self->used--;
    return 1;
}

/* ---- Python ints <-> keys ---------------------------------------------------------------- */

/* A key to store: an int in [0, 2**64), else TypeError / OverflowError. */
static int key_to_store(PyObject *obj, uint64_t *key)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "KeySet keys are ints, not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_OverflowError, "KeySet keys are ints in [0, 2**64)");
        }
        return -1;
    }
    *key = (uint64_t)v;
    return 0;
}

/* A key to look up: 1 and the key, or 0 when obj cannot be one (so it is in no KeySet). */
static int key_to_find(PyObject *obj, uint64_t *key)
{
    if (!PyLong_Check(obj))
        return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    *key = (uint64_t)v;
    return 1;
}

static int get_packed(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len % 8) {
        PyErr_Format(PyExc_ValueError, "%zd bytes of packed keys is not a whole number of 8-byte keys",
                     view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ---- construction -------------------------------------------------------------------------- */

static int reset(KeySetObject *self)
{
    uint64_t *table = PyMem_Calloc(MIN_CAPACITY, sizeof(uint64_t));
    if (!table) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(self->table);
    self->table = table;
    self->capacity = MIN_CAPACITY;
    self->shift = 64 - log2_of(MIN_CAPACITY);
    self->used = 0;
    self->has_zero = 0;
    return 0;
}

static PyObject *keyset_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    KeySetObject *self = (KeySetObject *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->table = NULL;
    if (reset(self) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyObject *keyset_update(KeySetObject *self, PyObject *iterable);

static int keyset_init(KeySetObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *iterable = NULL;
    static char *kwlist[] = {"iterable", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:KeySet", kwlist, &iterable))
        return -1;
    if (keyset_len(self) && reset(self) < 0)
        return -1;
    if (iterable) {
        PyObject *r = keyset_update(self, iterable);
        if (!r)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

static void keyset_dealloc(KeySetObject *self)
{
    PyMem_Free(self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ---- methods ------------------------------------------------------------------------------- */

static PyObject *keyset_add(KeySetObject *self, PyObject *obj)
{
    uint64_t key;
    if (key_to_store(obj, &key) < 0 || add_key(self, key) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *keyset_discard(KeySetObject *self, PyObject *obj)
{
    uint64_t key;
    int r = key_to_find(obj, &key);
    if (r < 0)
        return NULL;
    if (r && discard_key(self, key) && maybe_shrink(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *keyset_clear(KeySetObject *self, PyObject *unused)
{
    if (reset(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *keyset_update(KeySetObject *self, PyObject *iterable)
{
    if (KeySet_Check(iterable)) {
        KeySetObject *other = (KeySetObject *)iterable;
        if (other == self)
            Py_RETURN_NONE;
        if (other->has_zero)
            self->has_zero = 1;
        for (Py_ssize_t i = 0; i < other->capacity; i++)
            if (other->table[i] && add_key(self, other->table[i]) < 0)
                return NULL;
        Py_RETURN_NONE;
    }
    PyObject *it = PyObject_GetIter(iterable), *item;
    if (!it)
        return NULL;
    while ((item = PyIter_Next(it))) {
        uint64_t key;
        int r = key_to_store(item, &key);
        Py_DECREF(item);
        if (r < 0 || add_key(self, key) < 0) {
            Py_DECREF(it);
            return NULL;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *keyset_difference_update(KeySetObject *self, PyObject *iterable)
{
    PyObject *it = PyObject_GetIter(iterable), *item;
    if (!it)
        return NULL;
    while ((item = PyIter_Next(it))) {
        uint64_t key;
        int r = key_to_find(item, &key);
        Py_DECREF(item);
        if (r < 0) {
            Py_DECREF(it);
            return NULL;
        }
        if (r)
            discard_key(self, key);
    }
    Py_DECREF(it);
    if (PyErr_Occurred() || maybe_shrink(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *keyset_add_packed(KeySetObject *self, PyObject *obj)
{
    Py_buffer view;
    if (get_packed(obj, &view) < 0)
        return NULL;
    const unsigned char *p = view.buf;
    Py_ssize_t n = view.len / 8;
    /* Grow once up front: the prefetched slots then stay where they are. */
    Py_ssize_t want = self->used + n;
    if (want * 10 > self->capacity * 7) {
        Py_ssize_t capacity = self->capacity;
        while (want * 10 > capacity * 7)
            capacity <<= 1;
        if (resize(self, capacity) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_DISTANCE < n)
            __builtin_prefetch(&self->table[slot_of(self, load_le64(p + 8 * (i + PREFETCH_DISTANCE)))], 1);
        if (add_key(self, load_le64(p + 8 * i)) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *keyset_discard_packed(KeySetObject *self, PyObject *obj)
{
    Py_buffer view;
    if (get_packed(obj, &view) < 0)
        return NULL;
    const unsigned char *p = view.buf;
    Py_ssize_t n = view.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_DISTANCE < n)
            __builtin_prefetch(&self->table[slot_of(self, load_le64(p + 8 * (i + PREFETCH_DISTANCE)))], 1);
        discard_key(self, load_le64(p + 8 * i));
    }
    PyBuffer_Release(&view);
    if (maybe_shrink(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Adds obj to result if it is a key of self. */
static int add_if_member(KeySetObject *self, PyObject *obj, PyObject *result)
{
    uint64_t key;
    int r = key_to_find(obj, &key);
    if (r <= 0)
        return r;
    return contains_key(self, key) ? PySet_Add(result, obj) : 0;
}

static PyObject *keyset_intersection(KeySetObject *self, PyObject *other)
{
    PyObject *result = PySet_New(NULL);
    if (!result)
        return NULL;
    /* A larger dict or set: walk our keys and ask it (C speed on both sides). */
    if ((PyDict_CheckExact(other) || PyAnySet_CheckExact(other)) && PyObject_Size(other) > keyset_len(self)) {
        int (*has)(PyObject *, PyObject *) = PyDict_CheckExact(other) ? PyDict_Contains : PySet_Contains;
        for (Py_ssize_t i = -1; i < self->capacity; i++) {
            uint64_t key;
            if (i < 0) {
                if (!self->has_zero)
                    continue;
                key = 0;
            } else if (!(key = self->table[i])) {
                continue;
            }
            PyObject *obj = PyLong_FromUnsignedLongLong(key);
            if (!obj)
                goto error;
            int r = has(other, obj);
            if (r > 0)
                r = PySet_Add(result, obj);
            Py_DECREF(obj);
            if (r < 0)
                goto error;
        }
        return result;
    }
    PyObject *it = PyObject_GetIter(other), *item;
    if (!it)
        goto error;
    while ((item = PyIter_Next(it))) {
        int r = add_if_member(self, item, result);
        Py_DECREF(item);
        if (r < 0) {
            Py_DECREF(it);
            goto error;
        }
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        goto error;
    return result;
error:
    Py_DECREF(result);
    return NULL;
}

static PyObject *keyset_to_set(KeySetObject *self, PyObject *unused)
{
    PyObject *result = PySet_New(NULL);
    if (!result)
        return NULL;
    for (Py_ssize_t i = -1; i < self->capacity; i++) {
        uint64_t key;
        if (i < 0) {
            if (!self->has_zero)
                continue;
            key = 0;
        } else if (!(key = self->table[i])) {
            continue;
        }
        PyObject *obj = PyLong_FromUnsignedLongLong(key);
        if (!obj || PySet_Add(result, obj) < 0) {
            Py_XDECREF(obj);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(obj);
    }
    return result;
}

static PyObject *keyset_reduce(KeySetObject *self, PyObject *unused)
{
    PyObject *keys = keyset_to_set(self, NULL);
    if (!keys)
        return NULL;
    PyObject *list = PySequence_List(keys);
    Py_DECREF(keys);
    if (!list)
        return NULL;
    return Py_BuildValue("O(N)", Py_TYPE(self), list);
}

static PyObject *keyset_sizeof(KeySetObject *self, PyObject *unused)
{
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(KeySetObject) + self->capacity * (Py_ssize_t)sizeof(uint64_t));
}

/* ---- protocols ----------------------------------------------------------------------------- */

static Py_ssize_t keyset_length(KeySetObject *self) { return keyset_len(self); }

static int keyset_contains(KeySetObject *self, PyObject *obj)
{
    uint64_t key;
    int r = key_to_find(obj, &key);
    return r <= 0 ? r : contains_key(self, key);
}

/* Every element of iterable is a key of self (iterable has len(self) distinct elements). */
static int holds_all(KeySetObject *self, PyObject *iterable)
{
    PyObject *it = PyObject_GetIter(iterable), *item;
    if (!it)
        return -1;
    int all = 1;
    while (all && (item = PyIter_Next(it))) {
        all = keyset_contains(self, item);
        Py_DECREF(item);
    }
    Py_DECREF(it);
    if (all < 0 || PyErr_Occurred())
        return -1;
    return all;
}

static PyObject *keyset_richcompare(KeySetObject *self, PyObject *other, int op)
{
    if ((op != Py_EQ && op != Py_NE) || !(KeySet_Check(other) || PyAnySet_Check(other)))
        Py_RETURN_NOTIMPLEMENTED;
    int equal;
    if (PyObject_Size(other) != keyset_len(self)) {
        equal = 0;
    } else if (KeySet_Check(other)) {
        KeySetObject *o = (KeySetObject *)other;
        equal = o->has_zero == self->has_zero;
        for (Py_ssize_t i = 0; equal && i < o->capacity; i++)
            if (o->table[i] && !contains_key(self, o->table[i]))
                equal = 0;
    } else if ((equal = holds_all(self, other)) < 0) {
        return NULL;
    }
    return PyBool_FromLong(op == Py_EQ ? equal : !equal);
}

static PyObject *keyset_iter(KeySetObject *self)
{
    KeySetIterObject *it = PyObject_New(KeySetIterObject, &KeySetIterType);
    if (!it)
        return NULL;
    Py_INCREF(self);
    it->set = self;
    it->pos = 0;
    it->length = keyset_len(self);
    it->zero_done = 0;
    return (PyObject *)it;
}

static PyObject *keyset_repr(KeySetObject *self)
{
    return PyUnicode_FromFormat("KeySet(<%zd keys>)", keyset_len(self));
}

static void keysetiter_dealloc(KeySetIterObject *it)
{
    Py_DECREF(it->set);
    PyObject_Free(it);
}

static PyObject *keysetiter_next(KeySetIterObject *it)
{
    KeySetObject *set = it->set;
    if (keyset_len(set) != it->length) {
        it->length = -1;   /* stays an error, like a set's iterator */
        PyErr_SetString(PyExc_RuntimeError, "KeySet changed size during iteration");
        return NULL;
    }
    if (!it->zero_done) {
        it->zero_done = 1;
        if (set->has_zero)
            return PyLong_FromLong(0);
    }
    while (it->pos < set->capacity) {
        uint64_t key = set->table[it->pos++];
        if (key)
            return PyLong_FromUnsignedLongLong(key);
    }
    return NULL;
}

/* ---- keys_in ------------------------------------------------------------------------------- */

static PyObject *keys_in(PyObject *module, PyObject *args)
{
    PyObject *packed, *container;
    if (!PyArg_ParseTuple(args, "OO:keys_in", &packed, &container))
        return NULL;
    Py_buffer view;
    if (get_packed(packed, &view) < 0)
        return NULL;
    PyObject *result = PyList_New(0);
    if (!result) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const unsigned char *p = view.buf;
    for (Py_ssize_t i = 0; i < view.len / 8; i++) {
        PyObject *obj = PyLong_FromUnsignedLongLong(load_le64(p + 8 * i));
        int r = obj ? PySequence_Contains(container, obj) : -1;
        if (r > 0)
            r = PyList_Append(result, obj);
        Py_XDECREF(obj);
        if (r < 0) {
            Py_DECREF(result);
            PyBuffer_Release(&view);
            return NULL;
        }
    }
    PyBuffer_Release(&view);
    return result;
}

/* ---- type objects -------------------------------------------------------------------------- */

static PyMethodDef keyset_methods[] = {
    {"add", (PyCFunction)keyset_add, METH_O, "Add one key (an int in [0, 2**64))."},
    {"discard", (PyCFunction)keyset_discard, METH_O, "Remove one key if present."},
    {"clear", (PyCFunction)keyset_clear, METH_NOARGS, "Remove every key (and free the table)."},
    {"update", (PyCFunction)keyset_update, METH_O, "Add every key of an iterable of ints."},
    {"difference_update", (PyCFunction)keyset_difference_update, METH_O,
     "Remove every key of an iterable (those absent are ignored)."},
    {"add_packed", (PyCFunction)keyset_add_packed, METH_O,
     "Add the keys of a bytes-like object of 8-byte little-endian keys (ValueError if its "
     "length is not a multiple of 8)."},
    {"discard_packed", (PyCFunction)keyset_discard_packed, METH_O,
     "Remove the keys of a bytes-like object of 8-byte little-endian keys."},
    {"intersection", (PyCFunction)keyset_intersection, METH_O,
     "A set of the elements of an iterable that are keys here."},
    {"to_set", (PyCFunction)keyset_to_set, METH_NOARGS, "The keys as a set of ints."},
    {"__reduce__", (PyCFunction)keyset_reduce, METH_NOARGS, NULL},
    {"__sizeof__", (PyCFunction)keyset_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods keyset_as_sequence = {
    .sq_length = (lenfunc)keyset_length,
    .sq_contains = (objobjproc)keyset_contains,
};

static PyTypeObject KeySetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pagedserve.kvmanager._keyset.KeySet",
    .tp_doc = "KeySet(iterable=()): a set of ints in [0, 2**64), stored inline (8 bytes a slot).",
    .tp_basicsize = sizeof(KeySetObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = keyset_new,
    .tp_init = (initproc)keyset_init,
    .tp_dealloc = (destructor)keyset_dealloc,
    .tp_methods = keyset_methods,
    .tp_as_sequence = &keyset_as_sequence,
    .tp_richcompare = (richcmpfunc)keyset_richcompare,
    .tp_iter = (getiterfunc)keyset_iter,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_repr = (reprfunc)keyset_repr,
};

static PyTypeObject KeySetIterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pagedserve.kvmanager._keyset.KeySetIterator",
    .tp_basicsize = sizeof(KeySetIterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)keysetiter_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)keysetiter_next,
};

static PyMethodDef module_methods[] = {
    {"keys_in", keys_in, METH_VARARGS,
     "keys_in(packed, container) -> list: the 8-byte little-endian keys of packed that are in container."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef keyset_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_keyset",
    .m_doc = "A native set of 64-bit keys for the central KV index (see keyset.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__keyset(void)
{
    if (PyType_Ready(&KeySetType) < 0 || PyType_Ready(&KeySetIterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&keyset_module);
    if (!m)
        return NULL;
    Py_INCREF(&KeySetType);
    if (PyModule_AddObject(m, "KeySet", (PyObject *)&KeySetType) < 0) {
        Py_DECREF(&KeySetType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
