/* Optional C kernels: the digest's sums of splitmix64-mixed keyed terms (SPEC §5).
 *
 * keyed_sum(handles, counts, k_handle, k_pos, k_add, plus): the sum mod 2**64 of
 * (counts[i] + plus) * (mix64(handles[i] * k_handle + i * k_pos + k_add) | 1) over two
 * equal-length C-contiguous int64 buffers (the schedule term: plus 1, positions keyed;
 * the computed terms and the steady advance: plus 0, k_pos 0); reference
 * protocol.digest.keyed_sum_py.  Other buffers, or unequal lengths: None.
 *
 * The per-row sums, reference protocol.digest.row_sums_py:
 *
 * row_mix_sums(handles, starts, counts, values, k_value, k_pos, k_handle, salt): for each
 * row i, the sum mod 2**64 of mix64(v * k_value + p * k_pos + handles[i] * k_handle +
 * salt) over the counts[i] values v of row i (taken in order from the flat list values)
 * at positions p = starts[i], starts[i] + 1, ...; a list of ints, one per row.  Every
 * argument list holds exact ints in the int64 range (values may be negative: taken as
 * two's complement); anything else, or lengths that do not add up: None.
 */
#include "_kernels.h"

static inline uint64_t
mix64(uint64_t z)
{
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* 0 and the value of an exact int in the int64 range; -1 (no error set) otherwise. */
static int
read_i64(PyObject *item, int64_t *out)
{
    if (!PyLong_CheckExact(item)) {
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

static PyObject *
row_mix_sums(PyObject *self, PyObject *args)
{
    PyObject *handles, *starts, *counts, *values;
    unsigned long long k_value, k_pos, k_handle, salt;
    if (!PyArg_ParseTuple(args, "O!O!O!O!KKKK", &PyList_Type, &handles, &PyList_Type, &starts,
                          &PyList_Type, &counts, &PyList_Type, &values, &k_value, &k_pos,
                          &k_handle, &salt)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t rows = PyList_GET_SIZE(handles), total = PyList_GET_SIZE(values);
    if (PyList_GET_SIZE(starts) != rows || PyList_GET_SIZE(counts) != rows) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(rows);
    if (out == NULL) {
        return NULL;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < rows; i++) {
        int64_t h, start, n;
        if (read_i64(PyList_GET_ITEM(handles, i), &h) < 0
            || read_i64(PyList_GET_ITEM(starts, i), &start) < 0
            || read_i64(PyList_GET_ITEM(counts, i), &n) < 0 || n < 0 || n > total - at) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        uint64_t base = (uint64_t)h * k_handle + salt, sum = 0;
        for (int64_t j = 0; j < n; j++, at++) {
            int64_t v;
            if (read_i64(PyList_GET_ITEM(values, at), &v) < 0) {
                Py_DECREF(out);
                Py_RETURN_NONE;
            }
            sum += mix64((uint64_t)v * k_value + (uint64_t)(start + j) * k_pos + base);
        }
        PyObject *item = PyLong_FromUnsignedLongLong(sum);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    if (at != total) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    return out;
}

static PyObject *
keyed_sum(PyObject *self, PyObject *args)
{
    PyObject *a, *b;
    unsigned long long k_handle, k_pos, k_add, plus;
    if (!PyArg_ParseTuple(args, "OOKKKK", &a, &b, &k_handle, &k_pos, &k_add, &plus)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer va, vb;
    if (PyObject_GetBuffer(a, &va, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (PyObject_GetBuffer(b, &vb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        PyBuffer_Release(&va);
        Py_RETURN_NONE;
    }
    PyObject *out = Py_None;
    if (va.itemsize == 8 && vb.itemsize == 8 && va.len == vb.len && va.format && vb.format
        && (strcmp(va.format, "l") == 0 || strcmp(va.format, "q") == 0)
        && (strcmp(vb.format, "l") == 0 || strcmp(vb.format, "q") == 0)) {
        const int64_t *h = (const int64_t *)va.buf, *c = (const int64_t *)vb.buf;
        Py_ssize_t n = va.len / 8;
        uint64_t sum = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t key = mix64((uint64_t)h[i] * k_handle + (uint64_t)i * k_pos + k_add) | 1;
            sum += ((uint64_t)c[i] + plus) * key;
        }
        out = PyLong_FromUnsignedLongLong(sum);
    } else {
        Py_INCREF(out);
    }
    PyBuffer_Release(&va);
    PyBuffer_Release(&vb);
    return out;
}

PyMethodDef terms_methods[] = {
    {"keyed_sum", keyed_sum, METH_VARARGS,
     "Sum of (c + plus) * (mix64(h * kh + i * kp + ka) | 1) over int64 buffers (None: not taken)."},
    {"row_mix_sums", row_mix_sums, METH_VARARGS,
     "Per-row sums of mix64(v * kv + p * kp + h * kh + salt) (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
