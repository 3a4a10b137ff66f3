/* Optional C versions of the same-batch steps' list reads (engine_side/vllm/quick.py,
 * convert.py): a one-group step's new blocks (one_group_appends), rows of one item
 * (single_items, singletons), a dict against a batch (dict_matches), and the drafts by
 * batch position and back (draft_rows, split_rows).
 *
 * Contract: as protocol/_speedups.c -- exactly the Python reference's answer for the
 * inputs taken, None for any other (the Python path then decides);
 * tests/test_speedups.py holds the two together.
 */
#include "_speedups.h"

/* one_group_appends(new_block_ids: list) -> (positions, counts, flat ids) | None: a
 * one-KV-group step's new blocks -- each entry None or a one-element tuple or list
 * holding a non-empty list -- as the rows that grew, how many ids each, and the ids
 * in order; None for any other entry (engine_side.vllm.quick decides in Python). */
PyObject *
one_group_appends(PyObject *self, PyObject *arg)
{
    if (!PyList_CheckExact(arg)) {
        Py_RETURN_NONE;
    }
    PyObject *pos = PyList_New(0), *counts = PyList_New(0), *flat = PyList_New(0);
    if (pos == NULL || counts == NULL || flat == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(arg); i++) {
        PyObject *entry = PyList_GET_ITEM(arg, i), *ids;
        if (entry == Py_None) {
            continue;
        }
        if (PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 1) {
            ids = PyTuple_GET_ITEM(entry, 0);
        } else if (PyList_CheckExact(entry) && PyList_GET_SIZE(entry) == 1) {
            ids = PyList_GET_ITEM(entry, 0);
        } else {
            goto refuse;
        }
        if (!PyList_CheckExact(ids) || PyList_GET_SIZE(ids) == 0) {
            goto refuse;
        }
        PyObject *at = PyLong_FromSsize_t(i), *n = PyLong_FromSsize_t(PyList_GET_SIZE(ids));
        int bad = at == NULL || n == NULL || PyList_Append(pos, at) < 0
                  || PyList_Append(counts, n) < 0;
        Py_XDECREF(at);
        Py_XDECREF(n);
        Py_ssize_t end = PyList_GET_SIZE(flat);
        if (bad || PyList_SetSlice(flat, end, end, ids) < 0) { /* flat.extend(ids) */
            goto fail;
        }
    }
    return Py_BuildValue("(NNN)", pos, counts, flat);
refuse:
    Py_DECREF(pos);
    Py_DECREF(counts);
    Py_DECREF(flat);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(pos);
    Py_XDECREF(counts);
    Py_XDECREF(flat);
    return NULL;
}

/* single_items(rows: list) -> list | None: [row[0] for row in rows] when every row is
 * a list of exactly one item (a step's sampled tokens, one per request); None for
 * anything else (the caller's general path decides). */
static PyObject *
single_items(PyObject *self, PyObject *rows)
{
    if (!PyList_CheckExact(rows)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(rows);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyList_CheckExact(row) || PyList_GET_SIZE(row) != 1) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        PyObject *item = PyList_GET_ITEM(row, 0);
        Py_INCREF(item);
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* singletons(items: list) -> list: [[item] for item in items] (fresh one-item lists);
 * None when items is not a list. */
static PyObject *
singletons(PyObject *self, PyObject *items)
{
    if (!PyList_CheckExact(items)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_New(1);
        if (row == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyObject *item = PyList_GET_ITEM(items, i);
        Py_INCREF(item);
        PyList_SET_ITEM(row, 0, item);
        PyList_SET_ITEM(out, i, row);
    }
    return out;
}

/* dict_matches(d: dict, keys: list, values: list) -> 0 | 1 | 2 | None: 0 when d's keys
 * in order are not ``keys``, 1 when they are but its values are not ``values``, 2 when
 * both match (list(d) == keys and list(d.values()) == values, without building
 * either list); None unless d is an exact dict and keys and values are lists. */
static PyObject *
dict_matches(PyObject *self, PyObject *args)
{
    PyObject *d, *keys, *values;
    if (!PyArg_ParseTuple(args, "OOO", &d, &keys, &values)) {
        return NULL;
    }
    int got = dict_match(d, keys, values);
    if (got == -2) {
        Py_RETURN_NONE;
    }
    return got < 0 ? NULL : PyLong_FromLong(got);
}

/* dict_matches' answer as an int: 0, 1 or 2; -2 for None, -1 with an exception set. */
int
dict_match(PyObject *d, PyObject *keys, PyObject *values)
{
    if (!PyDict_CheckExact(d) || !PyList_CheckExact(keys) || !PyList_CheckExact(values)) {
        return -2;
    }
    if (PyDict_GET_SIZE(d) != PyList_GET_SIZE(keys)) {
        return 0;
    }
    int same_values = PyList_GET_SIZE(values) == PyList_GET_SIZE(keys);
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(d, &pos, &key, &value)) {
        if (i >= PyList_GET_SIZE(keys)) { /* only if an __eq__ below grew the dict */
            return 0;
        }
        PyObject *want = PyList_GET_ITEM(keys, i);
        if (key != want) { /* hold both: an __eq__ may change the dict or the list */
            Py_INCREF(key);
            Py_INCREF(want);
            int eq = PyObject_RichCompareBool(key, want, Py_EQ);
            Py_DECREF(want);
            Py_DECREF(key);
            if (eq < 0) {
                return -1;
            }
            if (!eq) {
                return 0;
            }
        }
        if (same_values && i < PyList_GET_SIZE(values)) {
            PyObject *v = PyList_GET_ITEM(values, i);
            if (value != v) {
                Py_INCREF(value);
                Py_INCREF(v);
                int eq = PyObject_RichCompareBool(value, v, Py_EQ);
                Py_DECREF(v);
                Py_DECREF(value);
                if (eq < 0) {
                    return -1;
                }
                same_values = eq;
            }
        }
        i++;
    }
    return i != PyList_GET_SIZE(keys) ? 0 : same_values ? 2 : 1;
}

/* draft_rows(drafts, pos, n) -> (lengths: list, flat: list) | None: a step's draft
 * tokens by batch position, as engine_side.vllm.convert.draft_rows_py: ``lengths[i]``
 * the number of tokens of the request at position ``pos[key]`` (0 for none), ``flat``
 * every token in dict order.  None unless ``drafts`` is a dict of non-empty lists whose
 * keys ``pos`` (a dict) maps to strictly increasing exact ints in [0, n). */
PyObject *
draft_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *drafts, *pos;
    Py_ssize_t n;
    if (fast_args(args, nargs, "OOn", &drafts, &pos, &n) < 0 || !PyDict_CheckExact(drafts)
            || !PyDict_CheckExact(pos) || n < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    /* the flat list is made at its size (one pass for the sizes, one for the tokens) */
    Py_ssize_t at = 0, total = 0;
    PyObject *key, *row;
    while (PyDict_Next(drafts, &at, &key, &row)) {
        if (!PyList_CheckExact(row)) {
            Py_RETURN_NONE;
        }
        total += PyList_GET_SIZE(row);
    }
    PyObject *lengths = PyList_New(n), *flat = PyList_New(total);
    if (lengths == NULL || flat == NULL) {
        Py_XDECREF(lengths);
        Py_XDECREF(flat);
        return NULL;
    }
    PyObject *zero = PyLong_FromLong(0);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(zero);
        PyList_SET_ITEM(lengths, i, zero);
    }
    Py_DECREF(zero);
    for (Py_ssize_t i = 0; i < total; i++) {
        /* until filled: a list always holds objects */
        PyList_SET_ITEM(flat, i, Py_NewRef(Py_None));
    }
    Py_ssize_t last = -1, filled = 0;
    at = 0;
    while (PyDict_Next(drafts, &at, &key, &row)) {
        PyObject *where = PyDict_GetItemWithError(pos, key); /* borrowed */
        long long p;
        Py_ssize_t k = PyList_GET_SIZE(row);
        if (where == NULL || as_i64(where, &p) < 0 || p <= last || p >= n || k == 0
                || k > total - filled) {
            goto not_taken;
        }
        PyObject *count = PyLong_FromSsize_t(k);
        if (count == NULL) {
            goto fail;
        }
        PyList_SetItem(lengths, (Py_ssize_t)p, count); /* steals count */
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject **slot = &PyList_GET_ITEM(flat, filled + j);
            Py_SETREF(*slot, Py_NewRef(PyList_GET_ITEM(row, j)));
        }
        filled += k;
        last = (Py_ssize_t)p;
    }
    if (filled != total) { /* (the dict changed under us: a key's __eq__ ran code) */
        goto not_taken;
    }
    PyObject *out = PyTuple_Pack(2, lengths, flat);
    Py_DECREF(lengths);
    Py_DECREF(flat);
    return out;
not_taken:
    PyErr_Clear(); /* an unhashable key included: Python decides */
    Py_DECREF(lengths);
    Py_DECREF(flat);
    Py_RETURN_NONE;
fail:
    Py_DECREF(lengths);
    Py_DECREF(flat);
    return NULL;
}

/* split_rows(keys, lengths, flat) -> dict | None: {keys[i]: flat[start_i:start_i +
 * lengths[i]]} for the non-zero lengths, rows consecutive in ``flat`` (fresh lists), as
 * engine_side.vllm.convert.split_rows_py; None unless three lists, one length per key,
 * lengths exact ints >= 0 adding up to len(flat), and hashable keys. */
PyObject *
split_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *keys, *lengths, *flat;
    if (fast_args(args, nargs, "OOO", &keys, &lengths, &flat) < 0 || !PyList_CheckExact(keys)
            || !PyList_CheckExact(lengths) || !PyList_CheckExact(flat)
            || PyList_GET_SIZE(keys) != PyList_GET_SIZE(lengths)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *out = PyDict_New();
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t start = 0, total = PyList_GET_SIZE(flat);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++) {
        long long k;
        if (as_i64(PyList_GET_ITEM(lengths, i), &k) < 0 || k < 0 || k > total - start) {
            goto not_taken;
        }
        if (k == 0) {
            continue;
        }
        PyObject *row = PyList_GetSlice(flat, start, start + (Py_ssize_t)k);
        if (row == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        int failed = PyDict_SetItem(out, PyList_GET_ITEM(keys, i), row);
        Py_DECREF(row);
        if (failed < 0) {
            PyErr_Clear(); /* an unhashable key: Python decides */
            goto not_taken;
        }
        start += (Py_ssize_t)k;
    }
    if (start == total) {
        return out;
    }
not_taken:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

PyMethodDef lists_methods[] = {
    {"one_group_appends", one_group_appends, METH_O,
     "A one-group step's new blocks as (positions, counts, flat ids) (None: not taken)."},
    {"single_items", single_items, METH_O,
     "[row[0] for row in rows] when every row is a one-item list (None: not taken)."},
    {"singletons", singletons, METH_O, "[[item] for item in items] (None: not a list)."},
    {"dict_matches", dict_matches, METH_VARARGS,
     "0: keys differ, 1: values differ, 2: both match a dict's (None: not taken)."},
    {"draft_rows", (PyCFunction)(void (*)(void))draft_rows, METH_FASTCALL,
     "A step's draft tokens as lengths by batch position and one flat list (None: not taken)."},
    {"split_rows", (PyCFunction)(void (*)(void))split_rows, METH_FASTCALL,
     "Consecutive rows of a flat list keyed by their non-empty lengths (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
