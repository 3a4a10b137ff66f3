/* Optional C versions of the packers of small lists (protocol/packing.py), the argument
 * parser the module's METH_FASTCALL functions share, and the module itself.  The other
 * protocol/_speedups_*.c files hold the rest of it, each saying what in its header;
 * their tables of functions are added here at import.
 *
 * Contract: each function returns exactly what its Python reference in
 * protocol/packing.py, protocol/digest.py or (the replies' lists, the bitmasks)
 * engine_side/vllm/convert.py, schema.py and rowrefs.py returns for the inputs it
 * accepts, and
 * None for every input it does not accept (the caller then runs the Python path,
 * which decides, errors included).  tests/test_speedups.py holds the two together
 * on generated and hostile inputs.  Nothing here raises for bad data.
 *
 * Packed array layout (SPEC §7.3): byte 0 the width in bits (0..64), then the count
 * (canonical unsigned LEB128), then ceil(count * width / 8) bytes, value i at bits
 * [i * width, (i + 1) * width) in little-endian bit order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#define STACK_VALUES 128 /* lists up to this long need no heap scratch */

#include "_speedups.h"
#include <stdarg.h>

int
fast_args(PyObject *const *args, Py_ssize_t nargs, const char *format, ...)
{
    va_list va;
    Py_ssize_t i = 0;
    int ok = 0;
    va_start(va, format);
    for (const char *f = format; *f; f++, i++) {
        if (i >= nargs) {
            goto count;
        }
        PyObject *o = args[i];
        if (*f == 'O' && f[1] == '!') {
            PyTypeObject *type = va_arg(va, PyTypeObject *);
            f++;
            if (!PyObject_TypeCheck(o, type)) {
                PyErr_Format(PyExc_TypeError, "argument %zd must be %.50s, not %.50s", i + 1,
                             type->tp_name, Py_TYPE(o)->tp_name);
                goto done;
            }
            *va_arg(va, PyObject **) = o;
        } else if (*f == 'O') {
            *va_arg(va, PyObject **) = o;
        } else if (*f == 'n') {
            Py_ssize_t v = PyNumber_AsSsize_t(o, PyExc_OverflowError);
            if (v == -1 && PyErr_Occurred()) {
                goto done;
            }
            *va_arg(va, Py_ssize_t *) = v;
        } else if (*f == 'K') {
            if (!PyLong_Check(o)) {
                PyErr_Format(PyExc_TypeError, "argument %zd must be int", i + 1);
                goto done;
            }
            *va_arg(va, unsigned long long *) = PyLong_AsUnsignedLongLongMask(o);
        } else if (*f == 'p') {
            int v = PyObject_IsTrue(o);
            if (v < 0) {
                goto done;
            }
            *va_arg(va, int *) = v;
        } else {
            PyErr_Format(PyExc_SystemError, "fast_args: bad format %s", format);
            goto done;
        }
    }
    if (i == nargs) {
        ok = 1;
        goto done;
    }
count:
    PyErr_Format(PyExc_TypeError, "wrong number of arguments (%zd)", nargs);
done:
    va_end(va);
    return ok ? 0 : -1;
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

static int
bit_length(uint64_t v)
{
    return v ? 64 - __builtin_clzll(v) : 0;
}

/* The packed bytes of n values: width byte, LEB128 count, bit-packed payload. */
PyObject *
pack_values(const uint64_t *values, Py_ssize_t n)
{
    uint64_t top = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        top |= values[i];
    }
    int width = bit_length(top); /* the width of the largest value */
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

/* pack_list(values: list) -> bytes | None: protocol.packing.pack_uints of a list of
 * exact ints in [0, 2**64). */
PyObject *
pack_list(PyObject *self, PyObject *arg)
{
    return pack_with(arg, as_u64);
}

/* pack_signed_list(values: list) -> bytes | None: protocol.packing.pack_sints of a list
 * of exact ints in the int64 range. */
static PyObject *
pack_signed_list(PyObject *self, PyObject *arg)
{
    return pack_with(arg, as_zigzag);
}

/* 0 and value + 1 for an exact int in [-1, 2**63 - 1); -1 otherwise (draft tokens
 * travel as token + 1, so vLLM's -1 placeholders pack as unsigned). */
static int
as_plus_one(PyObject *item, uint64_t *out)
{
    long long v;
    if (as_i64(item, &v) < 0 || v < -1 || v == LLONG_MAX) {
        return -1;
    }
    *out = (uint64_t)(v + 1);
    return 0;
}

/* pack_plus_one(values: list) -> bytes | None: protocol.packing.pack_uints_plus_one. */
PyObject *
pack_plus_one(PyObject *self, PyObject *arg)
{
    return pack_with(arg, as_plus_one);
}

/* Width, count and payload offset of a well-formed packed array of at most ``limit``
 * values (the checks of protocol.packing.read_leb128 and _unpack_raw); -1 otherwise,
 * and for a limit past 2**56. */
int
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

static PyObject *unpacked_view(Py_buffer view, unsigned long long limit, int zigzag);

static PyObject *
unpacked(PyObject *args, int zigzag) /* 0: raw, 1: zig-zag, 2: raw minus one */
{
    Py_buffer view;
    unsigned long long limit = 1ULL << 26;
    if (!PyArg_ParseTuple(args, "y*|K", &view, &limit)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return unpacked_view(view, limit, zigzag);
}

PyObject *
unpack_bytes(PyObject *packed, int zigzag)
{
    Py_buffer view;
    if (PyUnicode_Check(packed) || PyObject_GetBuffer(packed, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* (as "y*" refuses them) */
        Py_RETURN_NONE;
    }
    return unpacked_view(view, 1ULL << 26, zigzag);
}

/* unpacked's list of ``view`` (released here). */
static PyObject *
unpacked_view(Py_buffer view, unsigned long long limit, int zigzag)
{
    int width;
    uint64_t count;
    Py_ssize_t pos;
    if (read_header((const unsigned char *)view.buf, view.len, limit, &width, &count, &pos) < 0) {
        PyBuffer_Release(&view);
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
        if (zigzag == 2 && z > (uint64_t)LLONG_MAX) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            Py_RETURN_NONE; /* z - 1 would not fit int64: Python decides */
        }
        PyObject *item = zigzag == 0 ? PyLong_FromUnsignedLongLong(z)
            : zigzag == 2 ? PyLong_FromLongLong((long long)z - 1)
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

/* raw_list(buf, limit=2**26) -> list | None: the raw values of a well-formed packed
 * array of at most ``limit`` values (None: anything else, which Python decides). */
static PyObject *
raw_list(PyObject *self, PyObject *args)
{
    return unpacked(args, 0);
}

/* raw_list_minus_one(buf, limit=2**26) -> list | None: raw_list, each value minus one
 * (None too when a value is 2**63 or more). */
static PyObject *
raw_list_minus_one(PyObject *self, PyObject *args)
{
    return unpacked(args, 2);
}

/* raw_signed_list(buf, limit=2**26) -> list | None: raw_list, zig-zag decoded. */
static PyObject *
raw_signed_list(PyObject *self, PyObject *args)
{
    return unpacked(args, 1);
}

static PyMethodDef methods[] = {
    {"pack_list", pack_list, METH_O, "protocol.packing.pack_uints of a list (None: not taken)."},
    {"pack_signed_list", pack_signed_list, METH_O,
     "protocol.packing.pack_sints of a list (None: not taken)."},
    {"raw_list", raw_list, METH_VARARGS,
     "The raw values of a well-formed packed array (None: anything else)."},
    {"raw_signed_list", raw_signed_list, METH_VARARGS, "raw_list, zig-zag decoded."},
    {"raw_list_minus_one", raw_list_minus_one, METH_VARARGS, "raw_list, each value minus one."},
    {"pack_plus_one", pack_plus_one, METH_O,
     "protocol.packing.pack_uints of each value plus one (None: not taken)."},
    {NULL, NULL, 0, NULL},
};


static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "protocol._speedups",
    "Optional C versions of deltacast's small-list packers and block digest terms.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddFunctions(m, step_methods) < 0
                      || PyModule_AddFunctions(m, output_methods) < 0
                      || PyModule_AddFunctions(m, lane_methods) < 0
                      || PyModule_AddFunctions(m, counts_methods) < 0
                      || PyModule_AddFunctions(m, fused_methods) < 0
                      || PyModule_AddFunctions(m, frame_methods) < 0
                      || PyModule_AddFunctions(m, view_methods) < 0
                      || PyModule_AddFunctions(m, absorb_methods) < 0
                      || PyModule_AddFunctions(m, buffers_methods) < 0
                      || PyModule_AddFunctions(m, digest_methods) < 0
                      || PyModule_AddFunctions(m, lists_methods) < 0
                      || PyModule_AddFunctions(m, rows_methods) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
