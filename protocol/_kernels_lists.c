/* Optional C kernels of protocol._kernels: list kernels (references in
 * protocol/kernels.py): the items of one-item lists (single_items), fresh one-item lists
 * (singletons), and a dict's keys and values in order against two lists
 * (dict_matches).
 *
 * Contract: as protocol/_kernels.c -- exactly the Python reference's answer for the
 * inputs taken, None for any other (the Python path then decides);
 * tests/test_kernels.py holds the two together.
 */
#include "_kernels.h"

/* single_items(rows: list) -> list | None: [row[0] for row in rows] when every row is
 * a list of exactly one item; None for anything else. */
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

/* singletons(items: list) -> list | None: [[item] for item in items] (fresh one-item
 * lists); None when items is not a list. */
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

/* 1 when ``a == b`` as Python compares them, 0 when not, -1 with an exception set.  Both
 * are held while __eq__ runs: it may change the dict or the list they came from. */
static int
same(PyObject *a, PyObject *b)
{
    if (a == b) {
        return 1;
    }
    Py_INCREF(a);
    Py_INCREF(b);
    int eq = PyObject_RichCompareBool(a, b, Py_EQ);
    Py_DECREF(b);
    Py_DECREF(a);
    return eq;
}

/* dict_matches(d: dict, keys: list, values: list) -> 0 | 1 | 2 | None: 0 when d's keys
 * in order are not ``keys``, 1 when they are but its values are not ``values``, 2 when
 * both match (list(d) == keys and list(d.values()) == values, without building
 * either list); None unless d is an exact dict and keys and values are lists.  An
 * exception an __eq__ raises propagates. */
static PyObject *
dict_matches(PyObject *self, PyObject *args)
{
    PyObject *d, *keys, *values;
    if (!PyArg_ParseTuple(args, "OOO", &d, &keys, &values)) {
        return NULL;
    }
    if (!PyDict_CheckExact(d) || !PyList_CheckExact(keys) || !PyList_CheckExact(values)) {
        Py_RETURN_NONE;
    }
    if (PyDict_GET_SIZE(d) != PyList_GET_SIZE(keys)) {
        return PyLong_FromLong(0);
    }
    int same_values = PyList_GET_SIZE(values) == PyList_GET_SIZE(keys);
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(d, &pos, &key, &value)) {
        if (i >= PyList_GET_SIZE(keys)) { /* only if an __eq__ below grew the dict */
            return PyLong_FromLong(0);
        }
        int eq = same(key, PyList_GET_ITEM(keys, i));
        if (eq <= 0) {
            return eq < 0 ? NULL : PyLong_FromLong(0);
        }
        if (same_values && i < PyList_GET_SIZE(values)) {
            same_values = same(value, PyList_GET_ITEM(values, i));
            if (same_values < 0) {
                return NULL;
            }
        }
        i++;
    }
    return PyLong_FromLong(i != PyList_GET_SIZE(keys) ? 0 : same_values ? 2 : 1);
}

PyMethodDef lists_methods[] = {
    {"single_items", single_items, METH_O,
     "[row[0] for row in rows] of a list of one-item lists (None: not taken)."},
    {"singletons", singletons, METH_O, "[[item] for item in items] (None: not a list)."},
    {"dict_matches", dict_matches, METH_VARARGS,
     "0: d's keys are not keys; 1: its values are not values; 2: both match (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
