/* Optional C version of the steady lane's block appends written into the state at a
 * settle (absorb_rows; reference protocol.state.absorb_rows_py): a few
 * journaled rows, a scalar numpy write each in Python (~0.3 µs apiece), one call here.
 *
 * Contract: as protocol/_speedups.c -- the arrays it writes end exactly as the Python
 * loop leaves them, or it returns None having written nothing (an array of another
 * dtype, shape or layout, a row outside the arrays, a value that does not fit: the
 * Python loop then runs, growing the table as it needs); tests/test_speedups_absorb.py
 * holds the two together.
 */
#include "_speedups.h"

typedef struct {
    int32_t *cells;
    long long *lengths;
    uint64_t *sums;
    Py_ssize_t rows, width, nlengths, nsums;
} Arrays;

/* One journal entry (handles, starts, counts, ids, terms) checked against ``a``
 * (``write``: 0) or written into it (1, once every entry checked): 0, or -1 when not
 * taken (nothing written by this entry; no error set). */
static int
absorb_entry(PyObject *entry, const Arrays *a, int write)
{
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5) {
        return -1;
    }
    PyObject *hs = PyTuple_GET_ITEM(entry, 0), *starts = PyTuple_GET_ITEM(entry, 1),
             *counts = PyTuple_GET_ITEM(entry, 2), *ids = PyTuple_GET_ITEM(entry, 3),
             *terms = PyTuple_GET_ITEM(entry, 4);
    if (!PyList_CheckExact(hs) || !PyList_CheckExact(starts) || !PyList_CheckExact(counts)
            || !PyList_CheckExact(ids) || !PyList_CheckExact(terms)) {
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(hs), at = 0, total = PyList_GET_SIZE(ids);
    if (n == 0 || PyList_GET_SIZE(starts) != n || PyList_GET_SIZE(counts) != n
            || PyList_GET_SIZE(terms) != n) {
        return -1; /* (an entry without rows: the reference's max() raises) */
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        long long h, start, count;
        uint64_t term;
        if (as_i64(PyList_GET_ITEM(hs, j), &h) < 0 || as_i64(PyList_GET_ITEM(starts, j), &start) < 0
                || as_i64(PyList_GET_ITEM(counts, j), &count) < 0
                || as_u64(PyList_GET_ITEM(terms, j), &term) < 0 || h < 0 || h >= a->rows
                || h >= a->nlengths || h >= a->nsums || start < 0 || count < 1
                || count > a->width - start || count > total - at) {
            return -1;
        }
        for (Py_ssize_t k = 0; k < count; k++) {
            long long v;
            if (as_i64(PyList_GET_ITEM(ids, at + k), &v) < 0 || v < INT32_MIN || v > INT32_MAX) {
                return -1;
            }
            if (write) {
                a->cells[h * a->width + start + k] = (int32_t)v;
            }
        }
        if (write) {
            a->lengths[h] = start + count;
            a->sums[h] += term; /* mod 2**64, as the Python loop masks */
        }
        at += (Py_ssize_t)count;
    }
    return at == total ? 0 : -1;
}

/* absorb_rows(table, lengths, sums, entries) -> True | None: each journal entry
 * (handles, starts, counts, ids, terms) written in order -- row j's ids into
 * table[h, start:start + count], lengths[h] = start + count, sums[h] += term mod 2**64
 * -- when ``table`` is a 2-D int32 array and ``lengths`` and ``sums`` 1-D int64 and
 * uint64 arrays, all C-contiguous and writable, and every row fits them; None, nothing
 * written, otherwise. */
static PyObject *
absorb_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *table, *lengths, *sums, *entries;
    if (fast_args(args, nargs, "OOOO!", &table, &lengths, &sums, &PyList_Type, &entries) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer tv, lv, sv;
    if (typed_buffer(table, &tv, 1, 2, 4, "il") < 0) {
        Py_RETURN_NONE;
    }
    if (typed_buffer(lengths, &lv, 1, 1, 8, "lq") < 0) {
        PyBuffer_Release(&tv);
        Py_RETURN_NONE;
    }
    if (typed_buffer(sums, &sv, 1, 1, 8, "LQ") < 0) {
        PyBuffer_Release(&tv);
        PyBuffer_Release(&lv);
        Py_RETURN_NONE;
    }
    Arrays a = {tv.buf, lv.buf, sv.buf, tv.shape[0], tv.shape[1], lv.shape[0], sv.shape[0]};
    int taken = 1;
    for (int write = 0; write < 2 && taken; write++) { /* every entry checked, then written */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); i++) {
            if (absorb_entry(PyList_GET_ITEM(entries, i), &a, write) < 0) {
                taken = 0; /* (only while checking: a checked entry writes) */
                break;
            }
        }
    }
    PyBuffer_Release(&tv);
    PyBuffer_Release(&lv);
    PyBuffer_Release(&sv);
    if (taken) {
        Py_RETURN_TRUE;
    }
    Py_RETURN_NONE;
}

PyMethodDef absorb_methods[] = {
    {"absorb_rows", (PyCFunction)(void (*)(void))absorb_rows, METH_FASTCALL,
     "Journaled block appends written into a table, its lengths and block sums (None: not "
     "taken, nothing written)."},
    {NULL, NULL, 0, NULL},
};
