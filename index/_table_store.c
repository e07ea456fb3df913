/* The block store of index._table_core (see _table_store.h). */
#include "_table_store.h"

#include <string.h>

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
int tc_widen(Core *self, Py_ssize_t words)
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
uint64_t *tc_find_or_insert(Core *self, uint64_t key)
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
void tc_delete_entry(Core *self, Py_ssize_t e, Py_ssize_t i)
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

int tc_add(Core *self, Py_ssize_t slot, const uint64_t *hs, Py_ssize_t n, Py_ssize_t *changed)
{
    *changed = 0;
    if (slot >= self->words * 64 && tc_widen(self, slot / 64 + 1) < 0) {
        return -1;
    }
    Py_ssize_t w = slot / 64;
    uint64_t bit = (uint64_t)1 << (slot % 64);
    int rc = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t *b = tc_find_or_insert(self, hs[i]);
        if (b == NULL) {
            rc = -1; /* out of memory: what was added before stays added, and counted */
            break;
        }
        if (!(b[1 + w] & bit)) {
            b[1 + w] |= bit;
            ++*changed;
        }
    }
    self->counts[slot] += *changed;
    return rc;
}

void tc_remove(Core *self, Py_ssize_t slot, const uint64_t *hs, Py_ssize_t n, Py_ssize_t *changed)
{
    *changed = 0;
    if (slot >= self->words * 64) {
        return;
    }
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
        ++*changed;
        if (mask_empty(b + 1, self->words)) {
            tc_delete_entry(self, self->index[k], k);
        }
    }
    self->counts[slot] -= *changed;
}

Py_ssize_t tc_clear_slot(Core *self, Py_ssize_t slot)
{
    if (slot >= self->words * 64 || self->counts[slot] == 0) {
        return 0;
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
            tc_delete_entry(self, e, find_bucket(self, b[0]));
        }
        else {
            e++;
        }
    }
    self->counts[slot] = 0;
    return removed;
}
