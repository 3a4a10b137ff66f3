/* Optional C versions of the same-batch step's per-request rows (the worker's
 * forecast of the next step's counts).
 *
 * Contract: as protocol/_speedups.c -- each function returns exactly what its Python
 * reference returns for the inputs it accepts and None for every input it does not
 * accept (the caller then runs the Python path); tests/test_speedups.py holds the two
 * together.  Nothing here raises for bad data.
 */
#include "_speedups.h"

/* forecast_rows(base, nsched, plen_less_one, k) -> (computed rows, output rows) | None:
 * the next k rows of engine_side.vllm.quick.Forecast as fresh lists, row j (from 1)
 * computed[i] = base[i] + j * nsched[i] and outputs[i] = max(computed[i] -
 * plen_less_one[i], 0).  None unless three equally long lists of int64-range ints
 * whose rows stay in range, and 1 <= k <= 64.  No intermediate arrays: the int objects
 * are the only cost that grows with the batch. */
static PyObject *
forecast_rows(PyObject *self, PyObject *args)
{
    PyObject *base, *nsched, *plm1;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "OOOn", &base, &nsched, &plm1, &k) || !PyList_CheckExact(base)
            || !PyList_CheckExact(nsched) || !PyList_CheckExact(plm1) || k < 1 || k > 64) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(base);
    if (PyList_GET_SIZE(nsched) != n || PyList_GET_SIZE(plm1) != n) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* every value checked before anything is made */
        long long b, s, p, first, last, out;
        /* rows run monotonically from the first to the last: both in range, all are */
        if (as_i64(PyList_GET_ITEM(base, i), &b) < 0 || as_i64(PyList_GET_ITEM(nsched, i), &s) < 0
                || as_i64(PyList_GET_ITEM(plm1, i), &p) < 0 || __builtin_add_overflow(b, s, &first)
                || __builtin_mul_overflow(s, (long long)k, &last)
                || __builtin_add_overflow(b, last, &last) || __builtin_sub_overflow(first, p, &out)
                || __builtin_sub_overflow(last, p, &out)) {
            Py_RETURN_NONE;
        }
    }
    PyObject *comp_rows = PyList_New(k), *out_rows = PyList_New(k);
    if (comp_rows == NULL || out_rows == NULL) {
        goto fail;
    }
    for (Py_ssize_t j = 0; j < k; j++) { /* NULL slots of a list dropped half made free fine */
        PyObject *comp = PyList_New(n), *outs = PyList_New(n);
        if (comp == NULL || outs == NULL) {
            Py_XDECREF(comp);
            Py_XDECREF(outs);
            goto fail;
        }
        PyList_SET_ITEM(comp_rows, j, comp);
        PyList_SET_ITEM(out_rows, j, outs);
        for (Py_ssize_t i = 0; i < n; i++) {
            long long b = 0, s = 0, p = 0;
            as_i64(PyList_GET_ITEM(base, i), &b); /* checked above */
            as_i64(PyList_GET_ITEM(nsched, i), &s);
            as_i64(PyList_GET_ITEM(plm1, i), &p);
            long long c = b + (j + 1) * s, o = c - p;
            PyObject *cv = PyLong_FromLongLong(c), *ov = PyLong_FromLongLong(o > 0 ? o : 0);
            if (cv == NULL || ov == NULL) {
                Py_XDECREF(cv);
                Py_XDECREF(ov);
                goto fail;
            }
            PyList_SET_ITEM(comp, i, cv);
            PyList_SET_ITEM(outs, i, ov);
        }
    }
    return Py_BuildValue("(NN)", comp_rows, out_rows);
fail:
    Py_XDECREF(comp_rows);
    Py_XDECREF(out_rows);
    return NULL;
}

PyMethodDef step_methods[] = {
    {"forecast_rows", forecast_rows, METH_VARARGS,
     "The forecast's next rows of computed and output counts (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
