/* Optional C versions of the packers of int64 buffers (pack_array, int64_bytes,
 * unpack_array; references in protocol/packing.py) and the buffer check they share with
 * _speedups_absorb.c (typed_buffer).
 *
 * Contract: as protocol/_speedups.c -- exactly the Python reference's answer for the
 * inputs taken, None for any other (the Python path then decides);
 * tests/test_speedups.py holds the two together.
 */
#include "_speedups.h"

/* A C-contiguous buffer of ``obj`` (writable when ``writable``) of ``ndim`` dimensions
 * (-1: any) whose items are ``itemsize`` bytes of a one-letter struct format in
 * ``formats`` (after a native byte-order prefix): 0, or -1 (nothing held, no error set). */
int
typed_buffer(PyObject *obj, Py_buffer *view, int writable, int ndim, Py_ssize_t itemsize,
             const char *formats)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        return -1;
    }
    const char *f = view->format == NULL ? "B" : view->format;
    if (*f == '<' || *f == '=' || *f == '@') {
        f++;
    }
    if ((ndim >= 0 && view->ndim != ndim) || view->itemsize != itemsize || f[0] == '\0'
            || f[1] != '\0' || strchr(formats, f[0]) == NULL) {
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* pack_array(values) -> bytes | None: protocol.packing.pack_uints of a C-contiguous
 * buffer of int64 (a numpy array: a prompt, a block table); None for any other buffer or
 * a negative value (Python decides, and raises).  Reads the buffer, never a list. */
static PyObject *
pack_array(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (typed_buffer(arg, &view, 0, -1, 8, "ql") < 0) {
        Py_RETURN_NONE;
    }
    PyObject *out = Py_None;
    const int64_t *v = (const int64_t *)view.buf;
    Py_ssize_t n = view.len / 8;
    int64_t low = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        low |= v[i]; /* the sign bit of any negative value */
    }
    if (low >= 0) {
        out = pack_values((const uint64_t *)v, n);
    }
    PyBuffer_Release(&view);
    if (out == Py_None) {
        Py_RETURN_NONE;
    }
    return out;
}

/* int64_bytes(values: list) -> bytearray | None: a list of exact ints in the int64
 * range as native int64 bytes (numpy reads them without a copy: a prompt's token
 * ids); None for anything else (Python decides). */
static PyObject *
int64_bytes(PyObject *self, PyObject *arg)
{
    if (!PyList_CheckExact(arg)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * 8);
    if (out == NULL) {
        return NULL;
    }
    long long *dst = (long long *)PyByteArray_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (as_i64(PyList_GET_ITEM(arg, i), &dst[i]) < 0) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
    }
    return out;
}

/* unpack_array(buf, limit=2**26) -> bytearray | None: the values of a well-formed
 * packed array of at most ``limit`` values as native int64 bytes (numpy reads them
 * without a copy); None for anything else, a value past int64 included (Python
 * decides, and raises). */
static PyObject *
unpack_array(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned long long limit = 1ULL << 26;
    if (!PyArg_ParseTuple(args, "y*|K", &view, &limit)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    int width;
    uint64_t count;
    Py_ssize_t pos;
    if (read_header((const unsigned char *)view.buf, view.len, limit, &width, &count, &pos) < 0) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(count * 8));
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    int64_t *dst = (int64_t *)PyByteArray_AS_STRING(out);
    const unsigned char *p = (const unsigned char *)view.buf + pos;
    uint64_t mask = width == 64 ? UINT64_MAX : (((uint64_t)1 << width) - 1);
    unsigned __int128 acc = 0;
    int bits = 0;
    for (Py_ssize_t i = 0; i < (Py_ssize_t)count; i++) {
        uint64_t z;
        NEXT_PACKED(z, p, acc, bits, width, mask);
        if (z > (uint64_t)INT64_MAX) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            Py_RETURN_NONE;
        }
        dst[i] = (int64_t)z;
    }
    PyBuffer_Release(&view);
    return out;
}

PyMethodDef buffers_methods[] = {
    {"pack_array", pack_array, METH_O,
     "protocol.packing.pack_uints of a contiguous int64 buffer (None: not taken)."},
    {"int64_bytes", int64_bytes, METH_O,
     "A list of int64-range ints as native int64 bytes (None: not taken)."},
    {"unpack_array", unpack_array, METH_VARARGS,
     "A well-formed packed array as native int64 bytes (None: anything else)."},
    {NULL, NULL, 0, NULL},
};
