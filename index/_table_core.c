/* index._table_core: the hot part of index.table.BlockTable, in C.
 *
 * Which instance slots hold which block, as two arrays:
 *
 * - `entries`: dense, one per distinct block: its uint64 hash followed by the bitmask of the
 *   slots holding it, `words` uint64 words (64 slots each; widened when a slot beyond is first
 *   used). A block nobody holds any more is removed by moving the last entry into its place, so
 *   the array has no holes and grows by a quarter at a time: memory stays close to the blocks
 *   held (the issue's budget is 100 B per block in the mirror, at 256 instances too).
 * - `index`: an open-addressing hash table (linear probing, backward-shift deletion, no
 *   tombstones) of uint32 positions in `entries`, at most 3/4 full.
 *
 * A lookup probe costs two cache misses (index, entry) on a table larger than the CPU caches;
 * `lookup` hides them by prefetching the index bucket 16 blocks ahead and the entry 8 ahead.
 *
 * Everything else of BlockTable (instance names <-> slots, media, versions) stays in Python
 * (index/table_core.py). All memory comes from PyMem_* so that tracemalloc sees it. Every entry
 * point runs with the GIL held and none releases it: the object is never used by two threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

/* Grow the index when more than 3/4 of its buckets are used: probes stay short. */
#define LOAD_NUM 3
#define LOAD_DEN 4
#define MIN_CAP 64
#define EMPTY UINT32_MAX
#define MAX_ENTRIES ((Py_ssize_t)UINT32_MAX - 1)
/* How many blocks ahead a lookup prefetches the index bucket, and the entry, of. */
#define PREFETCH_INDEX 32
#define PREFETCH_ENTRY 16
/* Prompt blocks converted on the stack; a longer prompt takes a heap buffer. */
#define STACK_BLOCKS 512

typedef struct {
    PyObject_HEAD
    uint32_t *index;     /* cap buckets: a position in entries, or EMPTY */
    Py_ssize_t cap;      /* 0 or a power of two */
    uint64_t *entries;   /* alloc * (1 + words) uint64: hash, then mask words */
    Py_ssize_t alloc;    /* entries allocated */
    Py_ssize_t size;     /* entries in use (distinct blocks) */
    Py_ssize_t words;    /* mask words per entry */
    Py_ssize_t *counts;  /* blocks held per slot, words * 64 of them */
} Core;

static inline uint64_t mix(uint64_t x)
{
    /* splitmix64's finalizer: block hashes are already random, but a caller's are not bound to
     * be, and linear probing degrades badly on clustered keys. */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

static inline int mask_empty(const uint64_t *m, Py_ssize_t words)
{
    for (Py_ssize_t w = 0; w < words; w++) {
        if (m[w]) {
            return 0;
        }
    }
    return 1;
}

static inline uint64_t *entry_at(const Core *self, Py_ssize_t e)
{
    return self->entries + (size_t)e * (size_t)(1 + self->words);
}

static inline Py_ssize_t home(const Core *self, uint64_t key)
{
    return (Py_ssize_t)(mix(key) & (uint64_t)(self->cap - 1));
}

/* The index bucket of `key`, or -1. */
static inline Py_ssize_t find_bucket(const Core *self, uint64_t key)
{
    if (self->cap == 0) {
        return -1;
    }
    Py_ssize_t cmask = self->cap - 1;
    for (Py_ssize_t i = home(self, key);; i = (i + 1) & cmask) {
        uint32_t e = self->index[i];
        if (e == EMPTY) {
            return -1;
        }
        if (entry_at(self, e)[0] == key) {
            return i;
        }
    }
}

/* The entry of `key` (its hash word; the mask follows), or NULL. */
static inline uint64_t *find(const Core *self, uint64_t key)
{
    Py_ssize_t i = find_bucket(self, key);
    return i < 0 ? NULL : entry_at(self, self->index[i]);
}

/* A new index of `cap` buckets pointing at every entry. */
static int reindex(Core *self, Py_ssize_t cap)
{
    if (cap > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(uint32_t)) {
        PyErr_NoMemory();
        return -1;
    }
    uint32_t *ni = PyMem_Malloc((size_t)cap * sizeof(uint32_t));
    if (ni == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(ni, 0xff, (size_t)cap * sizeof(uint32_t)); /* every bucket EMPTY */
    PyMem_Free(self->index);
    self->index = ni;
    self->cap = cap;
    Py_ssize_t cmask = cap - 1;
    for (Py_ssize_t e = 0; e < self->size; e++) {
        Py_ssize_t i = home(self, entry_at(self, e)[0]);
        while (ni[i] != EMPTY) {
            i = (i + 1) & cmask;
        }
        ni[i] = (uint32_t)e;
    }
    return 0;
}

/* Make room for `words` mask words per entry (more slots than the masks had). */
static int widen(Core *self, Py_ssize_t words)
{
    Py_ssize_t stride = 1 + words, alloc = self->alloc;
    if (alloc > PY_SSIZE_T_MAX / stride / (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *ne = alloc ? PyMem_Calloc((size_t)alloc * (size_t)stride, sizeof(uint64_t)) : NULL;
    Py_ssize_t *nc = PyMem_Calloc((size_t)words * 64, sizeof(Py_ssize_t));
    if ((alloc && ne == NULL) || nc == NULL) {
        PyMem_Free(ne);
        PyMem_Free(nc);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t e = 0; e < self->size; e++) {
        memcpy(ne + (size_t)e * stride, entry_at(self, e),
               (size_t)(1 + self->words) * sizeof(uint64_t));
    }
    memcpy(nc, self->counts, (size_t)self->words * 64 * sizeof(Py_ssize_t));
    PyMem_Free(self->entries);
    PyMem_Free(self->counts);
    self->entries = ne;
    self->counts = nc;
    self->words = words;
    return 0;
}

/* The entry of `key`, appended with an empty mask (the caller fills it) if absent. */
static uint64_t *find_or_insert(Core *self, uint64_t key)
{
    Py_ssize_t i = find_bucket(self, key);
    if (i >= 0) {
        return entry_at(self, self->index[i]);
    }
    if (self->size >= MAX_ENTRIES) {
        PyErr_SetString(PyExc_OverflowError, "block table full (2**32 - 2 blocks)");
        return NULL;
    }
    if ((self->size + 1) * LOAD_DEN > self->cap * LOAD_NUM) {
        if (reindex(self, self->cap ? self->cap * 2 : MIN_CAP) < 0) {
            return NULL;
        }
    }
    Py_ssize_t stride = 1 + self->words;
    if (self->size == self->alloc) {
        /* A quarter more at a time (not double): the slack is memory every block pays for. */
        Py_ssize_t alloc = self->alloc + self->alloc / 4 + MIN_CAP;
        if (alloc > MAX_ENTRIES) {
            alloc = MAX_ENTRIES;
        }
        if (alloc > PY_SSIZE_T_MAX / stride / (Py_ssize_t)sizeof(uint64_t)) {
            PyErr_NoMemory();
            return NULL;
        }
        uint64_t *ne = PyMem_Realloc(self->entries, (size_t)alloc * stride * sizeof(uint64_t));
        if (ne == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        self->entries = ne;
        self->alloc = alloc;
    }
    Py_ssize_t cmask = self->cap - 1;
    for (i = home(self, key); self->index[i] != EMPTY; i = (i + 1) & cmask) {
    }
    self->index[i] = (uint32_t)self->size;
    uint64_t *d = entry_at(self, self->size);
    d[0] = key;
    memset(d + 1, 0, (size_t)self->words * sizeof(uint64_t));
    self->size++;
    return d;
}

/* Delete entry `e`, found at index bucket `i` (its mask is already empty). */
static void delete_entry(Core *self, Py_ssize_t e, Py_ssize_t i)
{
    Py_ssize_t cmask = self->cap - 1;
    /* Shift back the run after bucket i, so that no probe sequence is broken. */
    for (Py_ssize_t j = (i + 1) & cmask; self->index[j] != EMPTY; j = (j + 1) & cmask) {
        Py_ssize_t h = home(self, entry_at(self, self->index[j])[0]);
        /* Bucket j may fill the hole at i when i lies on its probe path, from h to j. */
        if (((j - h) & cmask) >= ((j - i) & cmask)) {
            self->index[i] = self->index[j];
            i = j;
        }
    }
    self->index[i] = EMPTY;
    /* Move the last entry into the hole, and repoint its bucket. */
    Py_ssize_t last = self->size - 1;
    if (e != last) {
        uint64_t *src = entry_at(self, last);
        memcpy(entry_at(self, e), src, (size_t)(1 + self->words) * sizeof(uint64_t));
        Py_ssize_t k = home(self, src[0]);
        while (self->index[k] != (uint32_t)last) {
            k = (k + 1) & cmask;
        }
        self->index[k] = (uint32_t)e;
    }
    self->size--;
}

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

/* The (slot, hashes) arguments of add and remove: the hashes as `convert` returns them. */
static uint64_t *slot_and_hashes(Core *self, PyObject *const *args, Py_ssize_t nargs,
                                 const char *usage, Py_ssize_t *slot, uint64_t *stack,
                                 Py_ssize_t *n)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return NULL;
    }
    if (to_slot(self, args[0], slot) < 0) {
        return NULL;
    }
    return convert(args[1], stack, n);
}

/* --- methods ------------------------------------------------------------------------------ */

static PyObject *core_add(Core *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot, n;
    uint64_t stack[STACK_BLOCKS];
    uint64_t *hs = slot_and_hashes(self, args, nargs, "add(slot, hashes)", &slot, stack, &n);
    if (hs == NULL) {
        return NULL;
    }
    Py_ssize_t added = 0;
    if (slot >= self->words * 64) {
        if (widen(self, slot / 64 + 1) < 0) {
            goto fail;
        }
    }
    Py_ssize_t w = slot / 64;
    uint64_t bit = (uint64_t)1 << (slot % 64);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t *b = find_or_insert(self, hs[i]);
        if (b == NULL) {
            goto fail;
        }
        if (!(b[1 + w] & bit)) {
            b[1 + w] |= bit;
            added++;
        }
    }
    self->counts[slot] += added;
    if (hs != stack) {
        PyMem_Free(hs);
    }
    return PyLong_FromSsize_t(added);
fail:
    /* What was added before the failure (out of memory) stays added, and counted. */
    self->counts[slot] += added;
    if (hs != stack) {
        PyMem_Free(hs);
    }
    return NULL;
}

static PyObject *core_remove(Core *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot, n;
    uint64_t stack[STACK_BLOCKS];
    uint64_t *hs = slot_and_hashes(self, args, nargs, "remove(slot, hashes)", &slot, stack, &n);
    if (hs == NULL) {
        return NULL;
    }
    Py_ssize_t removed = 0;
    if (slot < self->words * 64) {
        Py_ssize_t w = slot / 64;
        uint64_t bit = (uint64_t)1 << (slot % 64);
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t k = find_bucket(self, hs[i]);
            if (k < 0) {
                continue;
            }
            uint64_t *b = entry_at(self, self->index[k]);
            if (!(b[1 + w] & bit)) {
                continue;
            }
            b[1 + w] &= ~bit;
            removed++;
            if (mask_empty(b + 1, self->words)) {
                delete_entry(self, self->index[k], k);
            }
        }
        self->counts[slot] -= removed;
    }
    if (hs != stack) {
        PyMem_Free(hs);
    }
    return PyLong_FromSsize_t(removed);
}

static PyObject *core_clear_slot(Core *self, PyObject *arg)
{
    Py_ssize_t slot;
    if (to_slot(self, arg, &slot) < 0) {
        return NULL;
    }
    if (slot >= self->words * 64 || self->counts[slot] == 0) {
        return PyLong_FromSsize_t(0);
    }
    Py_ssize_t w = slot / 64;
    uint64_t bit = (uint64_t)1 << (slot % 64);
    Py_ssize_t removed = 0;
    for (Py_ssize_t e = 0; e < self->size;) {
        uint64_t *b = entry_at(self, e);
        if (!(b[1 + w] & bit)) {
            e++;
            continue;
        }
        b[1 + w] &= ~bit;
        removed++;
        if (mask_empty(b + 1, self->words)) {
            /* The last entry moves into e: look at e again. */
            delete_entry(self, e, find_bucket(self, b[0]));
        }
        else {
            e++;
        }
    }
    self->counts[slot] = 0;
    return PyLong_FromSsize_t(removed);
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
