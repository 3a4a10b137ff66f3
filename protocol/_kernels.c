/* Optional C kernels, module protocol._kernels: the packers of integer lists and int64
 * buffers (references in protocol/packing.py) and the module itself.  The other
 * protocol/_kernels_*.c files hold the row scans of integer arrays (_kernels_rows.c)
 * and the list kernels (_kernels_lists.c); their tables of functions are added here at
 * import.  protocol/kernels.py is the one typed facade over them (stubs: _kernels.pyi).
 *
 * Contract: each function returns exactly what its pure-Python reference returns for
 * the inputs it takes, and None for every input it does not take (the caller's Python
 * path then decides, errors included).  Nothing here raises for bad data;
 * tests/test_kernels*.py hold each function to its reference on generated and hostile
 * inputs.
 *
 * Packed array layout (SPEC §7.3): byte 0 the width in bits (0..64), then the count
 * (canonical unsigned LEB128), then ceil(count * width / 8) bytes, value i at bits
 * [i * width, (i + 1) * width) in little-endian bit order.
 */
#include "_kernels.h"

#define STACK_VALUES 128 /* lists up to this long need no heap scratch */

/* 0 and the value of an exact int in the int64 range; -1 otherwise.  Small ints (one or
 * two internal digits, the common case) are read inline. */
static inline int
as_i64(PyObject *item, long long *out)
{
    if (!PyLong_CheckExact(item)) {
        return -1;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        *out = (long long)PyUnstable_Long_CompactValue((PyLongObject *)item);
        return 0;
    }
#else
    Py_ssize_t digits = Py_SIZE(item);
    if (digits >= -1 && digits <= 1) { /* 3.11's layout: the sign is the size's */
        *out = digits == 0 ? 0 : digits * (long long)((PyLongObject *)item)->ob_digit[0];
        return 0;
    }
#if PYLONG_BITS_IN_DIGIT == 30
    if (digits == 2 || digits == -2) { /* below 2**60 */
        const digit *d = ((PyLongObject *)item)->ob_digit;
        uint64_t mag = (uint64_t)d[0] | ((uint64_t)d[1] << 30);
        *out = digits > 0 ? (long long)mag : -(long long)mag;
        return 0;
    }
#endif
#endif
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* 0 and the value of an exact int in [0, 2**64); -1 otherwise. */
static int
as_u64(PyObject *item, uint64_t *out)
{
    long long v;
    if (as_i64(item, &v) == 0) {
        if (v < 0) {
            return -1;
        }
        *out = (uint64_t)v;
        return 0;
    }
    if (!PyLong_CheckExact(item)) {
        return -1;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(item); /* 2**63 and up */
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* negative, or 2**64 or more */
        return -1;
    }
    *out = (uint64_t)u;
    return 0;
}

/* 0 and the zig-zag image of an exact int in the int64 range; -1 otherwise. */
static int
as_zigzag(PyObject *item, uint64_t *out)
{
    long long v;
    if (as_i64(item, &v) < 0) {
        return -1;
    }
    *out = v >= 0 ? (uint64_t)v << 1 : (((uint64_t)(-(v + 1))) << 1) + 1;
    return 0;
}

/* The packed bytes of n values: width byte, LEB128 count, bit-packed payload. */
static PyObject *
pack_values(const uint64_t *values, Py_ssize_t n)
{
    uint64_t top = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        top |= values[i];
    }
    int width = top ? 64 - __builtin_clzll(top) : 0; /* the width of the largest value */
    unsigned char head[11];
    Py_ssize_t hlen = 1;
    head[0] = (unsigned char)width;
    for (uint64_t count = (uint64_t)n;; count >>= 7) {
        head[hlen++] = (unsigned char)((count & 0x7F) | (count > 0x7F ? 0x80 : 0));
        if (count <= 0x7F) {
            break;
        }
    }
    Py_ssize_t size = hlen + (Py_ssize_t)(((uint64_t)n * (uint64_t)width + 7) / 8);
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    memcpy(p, head, (size_t)hlen);
    p += hlen;
    unsigned __int128 acc = 0; /* at most 7 + 64 bits pending */
    int bits = 0;
    for (Py_ssize_t i = 0; i < n && width; i++) {
        acc |= (unsigned __int128)values[i] << bits;
        bits += width;
        while (bits >= 8) {
            *p++ = (unsigned char)acc;
            acc >>= 8;
            bits -= 8;
        }
    }
    if (bits > 0) {
        *p = (unsigned char)acc;
    }
    return out;
}

/* Pack a list through ``convert`` (None when one item is refused). */
static PyObject *
pack_with(PyObject *arg, int (*convert)(PyObject *, uint64_t *))
{
    uint64_t stack[STACK_VALUES];
    if (!PyList_CheckExact(arg)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    uint64_t *values = n <= STACK_VALUES ? stack : PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    if (values == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *out = Py_None;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (convert(PyList_GET_ITEM(arg, i), &values[i]) < 0) {
            goto done; /* None: Python decides */
        }
    }
    out = pack_values(values, n);
done:
    if (values != stack) {
        PyMem_Free(values);
    }
    if (out == Py_None) {
        Py_RETURN_NONE;
    }
    return out;
}

/* pack_list(values: list) -> bytes | None: pack_uints of a list of exact ints in
 * [0, 2**64). */
static PyObject *
pack_list(PyObject *self, PyObject *arg)
{
    return pack_with(arg, as_u64);
}

/* pack_signed_list(values: list) -> bytes | None: pack_sints of a list of exact ints in
 * the int64 range. */
static PyObject *
pack_signed_list(PyObject *self, PyObject *arg)
{
    return pack_with(arg, as_zigzag);
}

/* A C-contiguous buffer of ``obj`` whose items are 8-byte ints (struct format q or l,
 * native order): 0, or -1 (nothing held, no error set). */
static int
int64_buffer(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return -1;
    }
    const char *f = view->format == NULL ? "B" : view->format;
    if (*f == '<' || *f == '=' || *f == '@') {
        f++;
    }
    if (view->itemsize != 8 || (f[0] != 'q' && f[0] != 'l') || f[1] != '\0') {
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* pack_array(values) -> bytes | None: pack_uints of a C-contiguous buffer of int64 (a
 * numpy array); None for any other object or a negative value. */
static PyObject *
pack_array(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (int64_buffer(arg, &view) < 0) {
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

/* The width, count and payload offset of a well-formed packed array of at most
 * ``limit`` values (the checks of protocol.packing.read_leb128 and _unpack_raw): 0, or
 * -1 (and for a limit past 2**56). */
static int
read_header(const unsigned char *buf, Py_ssize_t len, uint64_t limit, int *width,
            uint64_t *count, Py_ssize_t *pos)
{
    if (limit > (1ULL << 56) || len < 1 || buf[0] > 64) {
        return -1;
    }
    uint64_t value = 0;
    int shift = 0;
    Py_ssize_t at = 1;
    for (;;) {
        if (at >= len || shift > 56) {
            return -1; /* truncated or overlong */
        }
        unsigned char byte = buf[at++];
        value |= (uint64_t)(byte & 0x7F) << shift;
        shift += 7;
        if (!(byte & 0x80)) {
            if (byte == 0 && shift > 7) {
                return -1; /* non-canonical */
            }
            break;
        }
    }
    if (value > limit) {
        return -1;
    }
    uint64_t need = (value * (uint64_t)buf[0] + 7) / 8; /* value <= limit < 2**57 */
    if ((uint64_t)(len - at) != need) {
        return -1;
    }
    *width = buf[0];
    *count = value;
    *pos = at;
    return 0;
}

/* The values of a packed array one by one: ``z`` the next one read from ``p`` (advanced)
 * through the bit accumulator ``acc`` holding ``bits`` bits; never past the payload when
 * the caller reads at most read_header's count.  A macro: the state stays in registers. */
#define NEXT_PACKED(z, p, acc, bits, width, mask)                      \
    do {                                                               \
        while ((bits) < (width)) {                                     \
            (acc) |= (unsigned __int128)(*(p)++) << (bits);            \
            (bits) += 8;                                               \
        }                                                              \
        (z) = (width) ? (uint64_t)(acc) & (mask) : 0;                  \
        (acc) >>= (width);                                             \
        (bits) -= (width);                                             \
    } while (0)

/* The arguments (buf, limit) of the unpackers: 0 with ``view`` held and the header read,
 * or -1 (nothing held, no error set: not taken). */
static int
packed_args(PyObject *args, Py_buffer *view, int *width, uint64_t *count, Py_ssize_t *pos)
{
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "y*K", view, &limit)) {
        PyErr_Clear();
        return -1;
    }
    if (read_header((const unsigned char *)view->buf, view->len, limit, width, count, pos) < 0) {
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The list of a packed array's values, zig-zag decoded when ``signed_``. */
static PyObject *
unpacked(PyObject *args, int signed_)
{
    Py_buffer view;
    int width;
    uint64_t count;
    Py_ssize_t pos;
    if (packed_args(args, &view, &width, &count, &pos) < 0) {
        Py_RETURN_NONE; /* malformed or too long: Python decides (and raises) */
    }
    PyObject *out = PyList_New((Py_ssize_t)count);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf + pos;
    uint64_t mask = width == 64 ? UINT64_MAX : (((uint64_t)1 << width) - 1);
    unsigned __int128 acc = 0;
    int bits = 0;
    for (Py_ssize_t i = 0; i < (Py_ssize_t)count; i++) {
        uint64_t z;
        NEXT_PACKED(z, p, acc, bits, width, mask);
        PyObject *item = !signed_ ? PyLong_FromUnsignedLongLong(z)
            : (z & 1) ? PyLong_FromLongLong(-(long long)(z >> 1) - 1)
                      : PyLong_FromLongLong((long long)(z >> 1));
        if (item == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    PyBuffer_Release(&view);
    return out;
}

/* raw_list(buf, limit) -> list | None: the raw values of a well-formed packed array of
 * at most ``limit`` values (None: anything else, which Python decides). */
static PyObject *
raw_list(PyObject *self, PyObject *args)
{
    return unpacked(args, 0);
}

/* raw_signed_list(buf, limit) -> list | None: raw_list, zig-zag decoded. */
static PyObject *
raw_signed_list(PyObject *self, PyObject *args)
{
    return unpacked(args, 1);
}

/* unpack_array(buf, limit) -> bytearray | None: the values of a well-formed packed array
 * of at most ``limit`` values as native int64 bytes (numpy reads them without a copy);
 * None for anything else, a value past int64 included (Python decides, and raises). */
static PyObject *
unpack_array(PyObject *self, PyObject *args)
{
    Py_buffer view;
    int width;
    uint64_t count;
    Py_ssize_t pos;
    if (packed_args(args, &view, &width, &count, &pos) < 0) {
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

static PyMethodDef methods[] = {
    {"pack_list", pack_list, METH_O, "pack_uints of a list (None: not taken)."},
    {"pack_signed_list", pack_signed_list, METH_O, "pack_sints of a list (None: not taken)."},
    {"pack_array", pack_array, METH_O,
     "pack_uints of a contiguous int64 buffer (None: not taken)."},
    {"raw_list", raw_list, METH_VARARGS,
     "The raw values of a well-formed packed array (None: anything else)."},
    {"raw_signed_list", raw_signed_list, METH_VARARGS, "raw_list, zig-zag decoded."},
    {"unpack_array", unpack_array, METH_VARARGS,
     "A well-formed packed array as native int64 bytes (None: anything else)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "protocol._kernels",
    "Optional C kernels: integer packers, row scans, list kernels (see protocol.kernels).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__kernels(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddFunctions(m, rows_methods) < 0
                      || PyModule_AddFunctions(m, lists_methods) < 0
                      || PyModule_AddFunctions(m, terms_methods) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
