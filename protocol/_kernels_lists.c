/* Optional C kernels of protocol._kernels: list kernels (references in
 * protocol/kernels.py): the items of one-item lists (single_items), fresh one-item
 * lists (singletons) and the positions where a list of ints departs from an int64
 * array (mismatches).
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

/* mismatches(values: list, array: int64 buffer) -> list | None: the positions p where
 * values[p] != array[p], in order; None unless values is a list of exact ints as long
 * as the C-contiguous int64 buffer array (an int past int64 differs from every entry,
 * but the reference decides that too). */
static PyObject *
mismatches(PyObject *self, PyObject *args)
{
    PyObject *values, *array;
    if (!PyArg_ParseTuple(args, "OO", &values, &array) || !PyList_CheckExact(values)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(array, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(values);
    PyObject *out = NULL;
    if (view.itemsize != 8 || view.len != n * 8 || view.format == NULL
        || (strcmp(view.format, "l") != 0 && strcmp(view.format, "q") != 0)) {
        goto not_taken;
    }
    out = PyList_New(0);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const int64_t *have = (const int64_t *)view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(values, i);
        if (!PyLong_CheckExact(item)) {
            goto not_taken;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) {
            goto not_taken;
        }
        if (v != have[i]) {
            PyObject *at = PyLong_FromSsize_t(i);
            if (at == NULL || PyList_Append(out, at) < 0) {
                Py_XDECREF(at);
                Py_DECREF(out);
                PyBuffer_Release(&view);
                return NULL;
            }
            Py_DECREF(at);
        }
    }
    PyBuffer_Release(&view);
    return out;
not_taken:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

PyMethodDef lists_methods[] = {
    {"mismatches", mismatches, METH_VARARGS,
     "Positions where a list of ints departs from an int64 array (None: not taken)."},
    {"single_items", single_items, METH_O,
     "[row[0] for row in rows] of a list of one-item lists (None: not taken)."},
    {"singletons", singletons, METH_O, "[[item] for item in items] (None: not a list)."},
    {NULL, NULL, 0, NULL},
};
