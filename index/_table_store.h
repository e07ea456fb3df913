/* The block store of index._table_core: which instance slots hold which block, as two arrays.
 *
 * - `entries`: dense, one per distinct block: its uint64 hash followed by the bitmask of the
 *   slots holding it, `words` uint64 words (64 slots each; widened when a slot beyond is first
 *   used). A block nobody holds any more is removed by moving the last entry into its place, so
 *   the array has no holes and grows by a quarter at a time: memory stays close to the blocks
 *   held (the budget is 100 B per block in the mirror, at 256 instances too).
 * - `index`: an open-addressing hash table (linear probing, backward-shift deletion, no
 *   tombstones) of uint32 positions in `entries`, at most 3/4 full.
 *
 * All memory comes from PyMem_* so that tracemalloc sees it; every function runs with the GIL
 * held. The Python type and its methods are in _table_core.c.
 */
#ifndef KVATLAS_TABLE_STORE_H
#define KVATLAS_TABLE_STORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Grow the index when more than 3/4 of its buckets are used: probes stay short. */
#define LOAD_NUM 3
#define LOAD_DEN 4
#define MIN_CAP 64
#define EMPTY UINT32_MAX
#define MAX_ENTRIES ((Py_ssize_t)UINT32_MAX - 1)

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

/* Functions that may fail set a Python exception and return -1 (or NULL). */
int tc_widen(Core *self, Py_ssize_t words);
uint64_t *tc_find_or_insert(Core *self, uint64_t key);
void tc_delete_entry(Core *self, Py_ssize_t e, Py_ssize_t i);
/* Set / clear `slot` on `n` hashes; `*changed` counts the blocks that changed (also on error). */
int tc_add(Core *self, Py_ssize_t slot, const uint64_t *hs, Py_ssize_t n, Py_ssize_t *changed);
void tc_remove(Core *self, Py_ssize_t slot, const uint64_t *hs, Py_ssize_t n, Py_ssize_t *changed);
/* Clear `slot` on every block (a scan of the entries); returns how many it held. */
Py_ssize_t tc_clear_slot(Core *self, Py_ssize_t slot);

#endif
