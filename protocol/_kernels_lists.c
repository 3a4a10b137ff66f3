/* Optional C kernels of protocol._kernels: list kernels (references in
 * protocol/kernels.py): the items of one-item lists (single_items) and fresh one-item
 * lists (singletons).
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

PyMethodDef lists_methods[] = {
    {"single_items", single_items, METH_O,
     "[row[0] for row in rows] of a list of one-item lists (None: not taken)."},
    {"singletons", singletons, METH_O, "[[item] for item in items] (None: not a list)."},
    {NULL, NULL, 0, NULL},
};
