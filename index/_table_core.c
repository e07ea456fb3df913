/* index._table_core: the hot part of index.table.BlockTable, in C.
 *
 * The Python type `Core` over the block store of _table_store.c (which slots hold which block),
 * with the argument conversions and `lookup`, the longest-prefix walk. A lookup probe costs two
 * cache misses (index, entry) on a table larger than the CPU caches; `lookup` hides them by
 * prefetching the index bucket PREFETCH_INDEX blocks ahead and the entry PREFETCH_ENTRY ahead.
 *
 * Everything else of BlockTable (instance names <-> slots, media, versions) stays in Python
 * (index/table_core.py). Every entry point runs with the GIL held and none releases it: the
 * object is never used by two threads.
 */
#include "_table_store.h"

#include <limits.h>
#include <string.h>

/* How many blocks ahead a lookup prefetches the index bucket, and the entry, of. */
#define PREFETCH_INDEX 32
#define PREFETCH_ENTRY 16
/* Prompt blocks converted on the stack; a longer prompt takes a heap buffer. */
#define STACK_BLOCKS 512

/* --- argument conversion ------------------------------------------------------------------ */

/* Not PyLong_AsUnsignedLongLong where unsigned long has 64 bits: for a multi-digit int it goes
 * through a byte array, at several times the cost, and a lookup converts every prompt block. */
#if ULONG_MAX == UINT64_MAX
#define U64_FROM_INT PyLong_AsUnsignedLong
#define U64_FROM_INT_T unsigned long
#else
#define U64_FROM_INT PyLong_AsUnsignedLongLong
#define U64_FROM_INT_T unsigned long long
#endif

static int to_u64(PyObject *o, uint64_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "a block hash must be an int, not %.100s",
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    U64_FROM_INT_T v = U64_FROM_INT(o);
    if (v == (U64_FROM_INT_T)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError,
                         "a block hash must be an unsigned 64-bit int, got %R", o);
        }
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int to_slot(Core *self, PyObject *o, Py_ssize_t *out)
{
    Py_ssize_t s = PyLong_AsSsize_t(o);
    if (s == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (s < 0 || s >= ((Py_ssize_t)1 << 20)) {
        PyErr_Format(PyExc_ValueError, "slot %zd out of range", s);
        return -1;
    }
    *out = s;
    (void)self;
    return 0;
}

/* The hashes of a sequence as uint64, in `stack` when they fit, else in a PyMem buffer the
 * caller frees when it differs from `stack`. */
static uint64_t *convert(PyObject *seq, uint64_t *stack, Py_ssize_t *n_out)
{
    PyObject *fast = PySequence_Fast(seq, "block hashes must be a sequence (or an iterable)");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    uint64_t *buf = stack;
    if (n > STACK_BLOCKS) {
        buf = PyMem_Malloc((size_t)n * sizeof(uint64_t));
        if (buf == NULL) {
            Py_DECREF(fast);
            PyErr_NoMemory();
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (to_u64(items[i], &buf[i]) < 0) {
            if (buf != stack) {
                PyMem_Free(buf);
            }
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *n_out = n;
    return buf;
}

/* --- methods ------------------------------------------------------------------------------ */

/* add(slot, hashes) and remove(slot, hashes): one parse, one store call. */
static PyObject *change(Core *self, PyObject *const *args, Py_ssize_t nargs, int add)
{
    Py_ssize_t slot, n, changed;
    uint64_t stack[STACK_BLOCKS];
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, add ? "add(slot, hashes)" : "remove(slot, hashes)");
        return NULL;
    }
    if (to_slot(self, args[0], &slot) < 0) {
        return NULL;
    }
    uint64_t *hs = convert(args[1], stack, &n);
    if (hs == NULL) {
        return NULL;
    }
    int rc = 0;
    if (add) {
        rc = tc_add(self, slot, hs, n, &changed);
    }
    else {
        tc_remove(self, slot, hs, n, &changed);
    }
    if (hs != stack) {
        PyMem_Free(hs);
    }
    return rc < 0 ? NULL : PyLong_FromSsize_t(changed);
}

static PyObject *core_add(Core *self, PyObject *const *args, Py_ssize_t nargs)
{
    return change(self, args, nargs, 1);
}

static PyObject *core_remove(Core *self, PyObject *const *args, Py_ssize_t nargs)
{
    return change(self, args, nargs, 0);
}

static PyObject *core_clear_slot(Core *self, PyObject *arg)
{
    Py_ssize_t slot;
    if (to_slot(self, arg, &slot) < 0) {
        return NULL;
    }
    return PyLong_FromSsize_t(tc_clear_slot(self, slot));
}

static PyObject *core_holds(Core *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    uint64_t key;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "holds(slot, hash)");
        return NULL;
    }
    if (to_slot(self, args[0], &slot) < 0 || to_u64(args[1], &key) < 0) {
        return NULL;
    }
    if (slot >= self->words * 64) {
        Py_RETURN_FALSE;
    }
    uint64_t *b = find(self, key);
    return PyBool_FromLong(b != NULL && (b[1 + slot / 64] >> (slot % 64)) & 1);
}

static PyObject *core_count(Core *self, PyObject *arg)
{
    Py_ssize_t slot;
    if (to_slot(self, arg, &slot) < 0) {
        return NULL;
    }
    return PyLong_FromSsize_t(slot < self->words * 64 ? self->counts[slot] : 0);
}

static PyObject *core_entries(Core *self, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t total = 0;
    for (Py_ssize_t s = 0; s < self->words * 64; s++) {
        total += self->counts[s];
    }
    return PyLong_FromSsize_t(total);
}

static PyObject *core_slot_blocks(Core *self, PyObject *arg)
{
    Py_ssize_t slot;
    if (to_slot(self, arg, &slot) < 0) {
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL || slot >= self->words * 64) {
        return out;
    }
    Py_ssize_t w = slot / 64;
    uint64_t bit = (uint64_t)1 << (slot % 64);
    for (Py_ssize_t e = 0; e < self->size; e++) {
        uint64_t *b = entry_at(self, e);
        if (b[1 + w] & bit) {
            PyObject *h = PyLong_FromUnsignedLongLong(b[0]);
            if (h == NULL || PyList_Append(out, h) < 0) {
                Py_XDECREF(h);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(h);
        }
    }
    return out;
}

/* Record `count` for every slot of `bits` (word `w`) in `out`, keyed by the slot's name. */
static int record(PyObject *out, PyObject *names, Py_ssize_t w, uint64_t bits, Py_ssize_t count)
{
    PyObject *n = NULL;
    while (bits) {
        Py_ssize_t slot = w * 64 + __builtin_ctzll(bits);
        bits &= bits - 1;
        if (slot >= PyList_GET_SIZE(names) || PyList_GET_ITEM(names, slot) == Py_None) {
            PyErr_Format(PyExc_RuntimeError, "slot %zd holds blocks but has no name", slot);
            Py_XDECREF(n);
            return -1;
        }
        if (n == NULL && (n = PyLong_FromSsize_t(count)) == NULL) {
            return -1;
        }
        if (PyDict_SetItem(out, PyList_GET_ITEM(names, slot), n) < 0) {
            Py_DECREF(n);
            return -1;
        }
    }
    Py_XDECREF(n);
    return 0;
}

static PyObject *core_lookup(Core *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    uint64_t stack[STACK_BLOCKS];
    uint64_t active[16], *act = active;
    uint32_t homes_stack[STACK_BLOCKS], *homes = homes_stack;
    if (nargs != 2 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "lookup(hashes, names: list)");
        return NULL;
    }
    PyObject *names = args[1];
    uint64_t *hs = convert(args[0], stack, &n);
    if (hs == NULL) {
        return NULL;
    }
    PyObject *out = PyDict_New();
    const uint64_t *first = n ? find(self, hs[0]) : NULL;
    if (out == NULL || first == NULL) {
        goto done;
    }
    Py_ssize_t words = self->words;
    if (words > 16 && (act = PyMem_Malloc((size_t)words * sizeof(uint64_t))) == NULL) {
        PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    memcpy(act, first + 1, (size_t)words * sizeof(uint64_t));
    /* Each block's index bucket, computed once (the walk and both prefetches need it). */
    if (n > STACK_BLOCKS && (homes = PyMem_Malloc((size_t)n * sizeof(uint32_t))) == NULL) {
        PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    const uint32_t *index = self->index;
    const Py_ssize_t cmask = self->cap - 1, stride = 1 + words;
    for (Py_ssize_t i = 1; i < n; i++) {
        homes[i] = (uint32_t)(mix(hs[i]) & (uint64_t)cmask);
        if (i < PREFETCH_INDEX) {
            __builtin_prefetch(index + homes[i]);
        }
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        /* Two stages: the bucket far ahead, then the entry of a bucket fetched by now. */
        if (i + PREFETCH_INDEX < n) {
            __builtin_prefetch(index + homes[i + PREFETCH_INDEX]);
        }
        if (i + PREFETCH_ENTRY < n) {
            uint32_t e = index[homes[i + PREFETCH_ENTRY]];
            if (e != EMPTY) {
                __builtin_prefetch(self->entries + (size_t)e * stride);
            }
        }
        const uint64_t *b = NULL;
        for (Py_ssize_t j = homes[i];; j = (j + 1) & cmask) {
            uint32_t e = index[j];
            if (e == EMPTY) {
                break;
            }
            const uint64_t *c = self->entries + (size_t)e * stride;
            if (c[0] == hs[i]) {
                b = c;
                break;
            }
        }
        int alive = 0;
        for (Py_ssize_t w = 0; w < words; w++) {
            uint64_t nxt = b != NULL ? act[w] & b[1 + w] : 0;
            if (nxt != act[w]) {
                if (record(out, names, w, act[w] ^ nxt, i) < 0) {
                    Py_CLEAR(out);
                    goto done;
                }
                act[w] = nxt;
            }
            alive |= nxt != 0;
        }
        if (!alive) {
            goto done;
        }
    }
    for (Py_ssize_t w = 0; w < words; w++) {
        if (record(out, names, w, act[w], n) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
done:
    if (act != active) {
        PyMem_Free(act);
    }
    if (homes != homes_stack) {
        PyMem_Free(homes);
    }
    if (hs != stack) {
        PyMem_Free(hs);
    }
    return out;
}

static PyObject *core_memory(Core *self, PyObject *Py_UNUSED(ignored))
{
    size_t bytes = (size_t)self->cap * sizeof(uint32_t) +
                   (size_t)self->alloc * (size_t)(1 + self->words) * sizeof(uint64_t) +
                   (size_t)self->words * 64 * sizeof(Py_ssize_t);
    return PyLong_FromSize_t(bytes);
}

static Py_ssize_t core_len(Core *self)
{
    return self->size;
}

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Core() takes no arguments");
        return NULL;
    }
    Core *self = (Core *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->words = 1;
    self->counts = PyMem_Calloc(64, sizeof(Py_ssize_t));
    if (self->counts == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void core_dealloc(Core *self)
{
    PyMem_Free(self->index);
    PyMem_Free(self->entries);
    PyMem_Free(self->counts);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef core_methods[] = {
    {"add", (PyCFunction)(void (*)(void))core_add, METH_FASTCALL,
     "add(slot, hashes) -> blocks newly held by slot"},
    {"remove", (PyCFunction)(void (*)(void))core_remove, METH_FASTCALL,
     "remove(slot, hashes) -> blocks slot held and no longer holds"},
    {"clear_slot", (PyCFunction)core_clear_slot, METH_O,
     "clear_slot(slot) -> blocks slot held (a scan of the whole table)"},
    {"holds", (PyCFunction)(void (*)(void))core_holds, METH_FASTCALL,
     "holds(slot, hash) -> whether slot holds hash"},
    {"count", (PyCFunction)core_count, METH_O, "count(slot) -> blocks slot holds"},
    {"entries", (PyCFunction)core_entries, METH_NOARGS, "(slot, block) pairs held"},
    {"slot_blocks", (PyCFunction)core_slot_blocks, METH_O,
     "slot_blocks(slot) -> list of the hashes slot holds (a scan of the whole table)"},
    {"lookup", (PyCFunction)(void (*)(void))core_lookup, METH_FASTCALL,
     "lookup(hashes, names) -> {names[slot]: leading blocks of hashes slot holds} for every "
     "slot holding hashes[0]"},
    {"memory", (PyCFunction)core_memory, METH_NOARGS, "bytes allocated"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods core_as_sequence = {
    .sq_length = (lenfunc)core_len,
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "index._table_core.Core",
    .tp_doc = "uint64 block hash -> bitmask of instance slots, with a longest-prefix lookup.",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
    .tp_as_sequence = &core_as_sequence,
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT,
    .m_name = "index._table_core",
    .m_doc = "The compiled core of index.table.BlockTable.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__table_core(void)
{
    if (PyType_Ready(&CoreType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
