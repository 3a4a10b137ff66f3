/* Optional C kernels of protocol._kernels: row scans of integer arrays (references in
 * protocol/bitmask.py): the words of each row that differ from its background
 * (sparse_scan), and rows as references into a table both ends keep (row_refs,
 * row_rebuild).
 *
 * Contract: as protocol/_kernels.c -- exactly the Python reference's answer for the
 * inputs taken, None for any other (the Python path then decides);
 * tests/test_kernels_rows.py holds the two together.
 */
#include "_kernels.h"

/* sparse_scan(buf, rows, itemsize): an integer array's rows against their background
 * words, for protocol.bitmask.sparse_words.  ``buf``: a C-contiguous buffer of
 * native-order words of ``itemsize`` bytes (1, 2, 4 or 8), ``rows`` equal rows.  Row r's
 * background is all-one words when more than half its words are all ones, else zero
 * words.  Returns (background: one byte 0/1 per row, gaps: int64 per word that differs
 * from its row's background -- its flat position minus the previous one's minus 1, the
 * first counted from -1 --, values: those words' bytes), as scan_py does; None when not
 * taken (an unaligned buffer included). */
#define SCAN_COUNT(T)                                                              \
    {                                                                              \
        const T *w = (const T *)view.buf;                                          \
        for (Py_ssize_t r = 0; r < rows; r++) {                                    \
            Py_ssize_t ones = 0, zeros = 0;                                        \
            for (Py_ssize_t j = 0; j < words; j++) {                               \
                T v = w[r * words + j];                                            \
                ones += v == (T)~(T)0;                                             \
                zeros += v == 0;                                                   \
            }                                                                      \
            bg[r] = 2 * ones > words;                                              \
            total += words - (bg[r] ? ones : zeros);                               \
        }                                                                          \
    }
#define SCAN_EMIT(T)                                                               \
    {                                                                              \
        const T *w = (const T *)view.buf;                                          \
        T *vals = (T *)PyBytes_AS_STRING(values);                                  \
        for (Py_ssize_t r = 0; r < rows; r++) {                                    \
            T back = bg[r] ? (T)~(T)0 : 0;                                         \
            for (Py_ssize_t j = 0; j < words; j++) {                               \
                Py_ssize_t at = r * words + j;                                     \
                if (w[at] != back) {                                               \
                    gaps[k] = (int64_t)(at - last - 1);                            \
                    vals[k++] = w[at];                                             \
                    last = at;                                                     \
                }                                                                  \
            }                                                                      \
        }                                                                          \
    }

static PyObject *
sparse_scan(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t rows, itemsize;
    if (!PyArg_ParseTuple(args, "Onn", &obj, &rows, &itemsize)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *background = NULL, *gap_bytes = NULL, *values = NULL;
    Py_ssize_t n = itemsize > 0 ? view.len / itemsize : 0;
    if (rows <= 0 || (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8)
        || view.len % itemsize || n % rows || (uintptr_t)view.buf % itemsize) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    Py_ssize_t words = n / rows, total = 0, k = 0, last = -1;
    background = PyBytes_FromStringAndSize(NULL, rows);
    if (background == NULL) {
        goto fail;
    }
    unsigned char *bg = (unsigned char *)PyBytes_AS_STRING(background);
    switch (itemsize) {
    case 1: SCAN_COUNT(uint8_t) break;
    case 2: SCAN_COUNT(uint16_t) break;
    case 4: SCAN_COUNT(uint32_t) break;
    default: SCAN_COUNT(uint64_t) break;
    }
    gap_bytes = PyBytes_FromStringAndSize(NULL, total * (Py_ssize_t)sizeof(int64_t));
    values = PyBytes_FromStringAndSize(NULL, total * itemsize);
    if (gap_bytes == NULL || values == NULL) {
        goto fail;
    }
    int64_t *gaps = (int64_t *)PyBytes_AS_STRING(gap_bytes);
    switch (itemsize) {
    case 1: SCAN_EMIT(uint8_t) break;
    case 2: SCAN_EMIT(uint16_t) break;
    case 4: SCAN_EMIT(uint32_t) break;
    default: SCAN_EMIT(uint64_t) break;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(NNN)", background, gap_bytes, values);
fail:
    PyBuffer_Release(&view);
    Py_XDECREF(background);
    Py_XDECREF(gap_bytes);
    Py_XDECREF(values);
    return NULL;
}

/* Rows by reference (protocol.bitmask.RowTable).  A row is ``width``
 * bytes; a table is whole rows.  Ids: a table row's position, then the fresh rows in
 * first-use order. */
static uint64_t
row_hash(const unsigned char *p, Py_ssize_t n)
{
    /* every byte, eight independent lanes (each lane's multiplies are a chain: eight
     * chains keep the multiplier busy, a quarter less time than four at a real vocabulary):
     * rows that differ in one word collide only by chance, and a collision costs a
     * memcmp, never a wrong answer */
    uint64_t lane[8] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
                        0xD6E8FEB86659FD93ULL, 0x27D4EB2F165667C5ULL, 0x94D049BB133111EBULL,
                        0xBF58476D1CE4E5B9ULL, 0x85EBCA77C2B2AE63ULL};
    Py_ssize_t i = 0;
    for (; i + 64 <= n; i += 64) {
        for (int k = 0; k < 8; k++) {
            uint64_t w;
            memcpy(&w, p + i + 8 * k, 8);
            lane[k] = (lane[k] ^ w) * 0xFF51AFD7ED558CCDULL;
        }
    }
    uint64_t h = (uint64_t)n;
    for (int k = 0; k < 8; k++) {
        h = (h ^ lane[k] ^ (lane[k] >> 29)) * 0xC4CEB9FE1A85EC53ULL;
    }
    for (; i < n; i++) {
        h = (h ^ p[i]) * 0x100000001B3ULL;
    }
    return h ^ (h >> 31);
}

/* The distinct rows named by ``ids`` (n of them, each < ``total``, rows at ``where``),
 * in first-use order, as one bytes object. */
static PyObject *
first_use_rows(const Py_ssize_t *ids, Py_ssize_t n, Py_ssize_t total,
               const unsigned char *const *where, Py_ssize_t width)
{
    unsigned char *seen = PyMem_Calloc((size_t)total + 1, 1);
    if (seen == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t distinct = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        distinct += !seen[ids[i]];
        seen[ids[i]] = 1;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, distinct * width);
    if (out != NULL) {
        memset(seen, 0, (size_t)total + 1);
        unsigned char *q = (unsigned char *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!seen[ids[i]]) {
                seen[ids[i]] = 1;
                memcpy(q, where[ids[i]], (size_t)width);
                q += width;
            }
        }
    }
    PyMem_Free(seen);
    return out;
}

/* Both buffers, C-contiguous: 0, or -1 with neither held and no error set. */
static int
two_buffers(PyObject *a, PyObject *b, Py_buffer *va, Py_buffer *vb)
{
    if (PyObject_GetBuffer(a, va, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return -1;
    }
    if (PyObject_GetBuffer(b, vb, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyBuffer_Release(va);
        return -1;
    }
    return 0;
}

/* Words of a row the first pass hashes (rows of at most this many words: all of them). */
#define ROW_SAMPLE 64
/* Rows that differ but hash alike the first pass tolerates before it hashes every byte. */
#define ROW_COLLISIONS 16

/* The first pass's hash: ROW_SAMPLE words spread over the row and its last word.  Rows
 * that differ usually differ in most sampled words (a bitmask's row mostly allows or
 * mostly refuses), so equal rows are found by one memcmp instead of hashing every
 * byte; rows that differ only between the samples collide, and past ROW_COLLISIONS the
 * caller hashes every byte instead. */
static uint64_t
row_sample_hash(const unsigned char *p, Py_ssize_t n)
{
    Py_ssize_t words = n / 8;
    if (words <= ROW_SAMPLE) {
        return row_hash(p, n);
    }
    Py_ssize_t stride = words / ROW_SAMPLE; /* >= 1 word apart */
    uint64_t h = (uint64_t)n * 0x9E3779B97F4A7C15ULL, w;
    for (Py_ssize_t k = 0; k < ROW_SAMPLE; k++) {
        memcpy(&w, p + 8 * k * stride, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
    }
    memcpy(&w, p + n - 8, 8);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 31);
}

/* The table rows (t, at ``tbuf``) and then the rows (n, at ``rbuf``), each ``width``
 * bytes, into the open-addressed table (``cap`` slots, a power of two >= 2 (t + n)):
 * ids[i] is row i's id (the first equal table row, else t + j for the j-th row no
 * earlier row equals), where[id] its bytes, *made the fresh rows.  ``sampled``: hash
 * with row_sample_hash; then 1, the answer unfinished, past ROW_COLLISIONS rows that
 * differ from a row hashing alike (every byte's hash then decides); else 0. */
static int
row_ids(const unsigned char *tbuf, Py_ssize_t t, const unsigned char *rbuf, Py_ssize_t n,
        Py_ssize_t width, int sampled, Py_ssize_t cap, Py_ssize_t *slot_id,
        uint64_t *slot_hash, const unsigned char **where, Py_ssize_t *ids, Py_ssize_t *made)
{
    Py_ssize_t collisions = 0;
    memset(slot_id, 0, sizeof(Py_ssize_t) * (size_t)cap); /* id + 1; 0: empty */
    *made = 0;
    for (Py_ssize_t r = 0; r < t + n; r++) {
        const unsigned char *p = r < t ? tbuf + r * width : rbuf + (r - t) * width;
        uint64_t h = sampled ? row_sample_hash(p, width) : row_hash(p, width);
        size_t s = (size_t)h & (size_t)(cap - 1);
        Py_ssize_t id = -1;
        while (slot_id[s]) {
            Py_ssize_t k = slot_id[s] - 1;
            if (slot_hash[s] == h) {
                if (memcmp(where[k], p, (size_t)width) == 0) {
                    id = k;
                    break;
                }
                if (sampled && ++collisions > ROW_COLLISIONS) {
                    return 1;
                }
            }
            s = (s + 1) & (size_t)(cap - 1);
        }
        if (id < 0) { /* a table row keeps its position (the first of equal ones wins) */
            id = r < t ? r : t + (*made)++;
            where[id] = p;
            slot_id[s] = id + 1;
            slot_hash[s] = h;
        }
        if (r >= t) {
            ids[r - t] = id;
        }
    }
    return 0;
}

/* row_refs(table, rows, width) -> (refs: list, fresh: bytes, table: bytes) | None: each
 * row of ``rows`` as the id of the first equal row (table rows first, then the rows no
 * earlier row equals -- the fresh ones, concatenated in order in ``fresh``); ``table``:
 * the distinct rows used, in first-use order (the next table).  As
 * protocol.bitmask.row_refs_py; None when not taken. */
static PyObject *
row_refs(PyObject *self, PyObject *args)
{
    PyObject *table_obj, *rows_obj;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OOn", &table_obj, &rows_obj, &width)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer tv, rv;
    if (two_buffers(table_obj, rows_obj, &tv, &rv) < 0) {
        Py_RETURN_NONE;
    }
    PyObject *refs = NULL, *fresh = NULL, *next = NULL, *out = NULL;
    Py_ssize_t *slot_id = NULL, *ids = NULL;
    uint64_t *slot_hash = NULL;
    const unsigned char **where = NULL;
    if (width <= 0 || tv.len % width || rv.len % width) {
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    Py_ssize_t t = tv.len / width, n = rv.len / width, cap = 8, made = 0;
    while (cap < 2 * (t + n)) {
        cap <<= 1;
    }
    slot_id = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)cap);
    slot_hash = PyMem_Malloc(sizeof(uint64_t) * (size_t)cap);
    where = PyMem_Malloc(sizeof(*where) * (size_t)(t + n + 1)); /* id -> its bytes */
    ids = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    refs = PyList_New(n);
    if (slot_id == NULL || slot_hash == NULL || where == NULL || ids == NULL || refs == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    const unsigned char *tbuf = tv.buf, *rbuf = rv.buf;
    if (row_ids(tbuf, t, rbuf, n, width, 1, cap, slot_id, slot_hash, where, ids, &made)) {
        row_ids(tbuf, t, rbuf, n, width, 0, cap, slot_id, slot_hash, where, ids, &made);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ref = PyLong_FromSsize_t(ids[i]);
        if (ref == NULL) {
            goto done;
        }
        PyList_SET_ITEM(refs, i, ref);
    }
    fresh = PyBytes_FromStringAndSize(NULL, made * width);
    if (fresh == NULL) {
        goto done;
    }
    for (Py_ssize_t j = 0; j < made; j++) {
        memcpy(PyBytes_AS_STRING(fresh) + j * width, where[t + j], (size_t)width);
    }
    next = first_use_rows(ids, n, t + made, where, width);
    if (next != NULL) {
        out = PyTuple_Pack(3, refs, fresh, next);
    }
done:
    PyMem_Free(slot_id);
    PyMem_Free(slot_hash);
    PyMem_Free(where);
    PyMem_Free(ids);
    Py_XDECREF(refs);
    Py_XDECREF(fresh);
    Py_XDECREF(next);
    PyBuffer_Release(&tv);
    PyBuffer_Release(&rv);
    return out;
}

/* row_rebuild(table, fresh, refs, width) -> (rows: bytearray, table: bytes) | None: the
 * rows ``refs`` name (table rows, then ``fresh`` rows), and the distinct rows used in
 * first-use order (the next table).  As protocol.bitmask.row_rebuild_py; None
 * when not taken -- including refs that are not exact ints naming a row, or fresh rows
 * that are not each first used in order after the previous one (Python then raises). */
static PyObject *
row_rebuild(PyObject *self, PyObject *args)
{
    PyObject *table_obj, *fresh_obj, *refs;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OOOn", &table_obj, &fresh_obj, &refs, &width)
            || !PyList_CheckExact(refs)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer tv, fv;
    if (two_buffers(table_obj, fresh_obj, &tv, &fv) < 0) {
        Py_RETURN_NONE;
    }
    PyObject *rows = NULL, *next = NULL, *out = NULL;
    const unsigned char **where = NULL;
    Py_ssize_t *ids = NULL;
    unsigned char *seen = NULL;
    Py_ssize_t n = PyList_GET_SIZE(refs);
    if (width <= 0 || tv.len % width || fv.len % width || n > PY_SSIZE_T_MAX / width) {
        goto not_taken;
    }
    Py_ssize_t t = tv.len / width, k = fv.len / width, expect = t;
    where = PyMem_Malloc(sizeof(*where) * (size_t)(t + k + 1));
    ids = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    seen = PyMem_Calloc((size_t)(t + k + 1), 1);
    if (where == NULL || ids == NULL || seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < t + k; j++) {
        where[j] = j < t ? (const unsigned char *)tv.buf + j * width
                         : (const unsigned char *)fv.buf + (j - t) * width;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(refs, i);
        if (!PyLong_CheckExact(item)) {
            goto not_taken;
        }
        Py_ssize_t id = PyLong_AsSsize_t(item);
        if (id == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto not_taken;
        }
        if (id < 0 || id >= t + k || (id >= t && !seen[id] && id != expect++)) {
            goto not_taken;
        }
        seen[id] = 1;
        ids[i] = id;
    }
    if (expect != t + k) {
        goto not_taken; /* a fresh row never used */
    }
    rows = PyByteArray_FromStringAndSize(NULL, n * width);
    if (rows == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(PyByteArray_AS_STRING(rows) + i * width, where[ids[i]], (size_t)width);
    }
    next = first_use_rows(ids, n, t + k, where, width);
    if (next != NULL) {
        out = PyTuple_Pack(2, rows, next);
    }
    goto done;
not_taken:
    out = Py_None;
    Py_INCREF(out);
done:
    PyMem_Free(where);
    PyMem_Free(ids);
    PyMem_Free(seen);
    Py_XDECREF(rows);
    Py_XDECREF(next);
    PyBuffer_Release(&tv);
    PyBuffer_Release(&fv);
    return out;
}

PyMethodDef rows_methods[] = {
    {"sparse_scan", sparse_scan, METH_VARARGS,
     "An integer array's rows against their background words (None: not taken)."},
    {"row_refs", row_refs, METH_VARARGS,
     "Rows as references into a table followed by the fresh rows (None: not taken)."},
    {"row_rebuild", row_rebuild, METH_VARARGS,
     "The rows references name, and the next table (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
