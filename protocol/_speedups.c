/* Optional C versions of the packers, the digest's per-row block terms and linear count
 * terms, the same-batch forecast's comparisons, the replies' token lists and the grammar
 * bitmasks' row scans (sparse words, rows by reference).
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
 * values (the checks of protocol.packing.read_leb128 and _unpack_raw); -1 otherwise. */
static int
read_header(const unsigned char *buf, Py_ssize_t len, uint64_t limit, int *width,
            uint64_t *count, Py_ssize_t *pos)
{
    if (len < 1 || buf[0] > 64) {
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
    if (limit > (1ULL << 56)
            || read_header((const unsigned char *)view.buf, view.len, limit, &width, &count,
                           &pos) < 0) {
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
        while (bits < width) { /* never past the payload: its length was checked */
            acc |= (unsigned __int128)(*p++) << bits;
            bits += 8;
        }
        uint64_t z = width ? (uint64_t)acc & mask : 0;
        acc >>= width;
        bits -= width;
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
    if (limit > (1ULL << 56)
            || read_header((const unsigned char *)view.buf, view.len, limit, &width, &count,
                           &pos) < 0) {
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
        while (bits < width) { /* never past the payload: its length was checked */
            acc |= (unsigned __int128)(*p++) << bits;
            bits += 8;
        }
        uint64_t z = width ? (uint64_t)acc & mask : 0;
        acc >>= width;
        bits -= width;
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

static uint64_t
mix64(uint64_t z)
{
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* unit_terms(handles, positions, blocks, salt, k_block, k_pos, k_handle) -> list | None:
 * protocol.digest.block_unit_terms, mix64((b*k_block + p*k_pos + h*k_handle + salt)
 * mod 2**64) per row, for equally long lists of int64-range ints (the constants are
 * the caller's). */
static PyObject *
unit_terms(PyObject *self, PyObject *args)
{
    PyObject *handles, *positions, *blocks;
    unsigned long long salt, k_block, k_pos, k_handle;
    if (!PyArg_ParseTuple(args, "OOOKKKK", &handles, &positions, &blocks, &salt, &k_block,
                          &k_pos, &k_handle)) {
        return NULL;
    }
    if (!PyList_CheckExact(handles) || !PyList_CheckExact(positions)
            || !PyList_CheckExact(blocks)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(handles);
    if (PyList_GET_SIZE(positions) != n || PyList_GET_SIZE(blocks) != n) {
        Py_RETURN_NONE;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long h, p, b; /* & MASK of an int64: its two's-complement bits */
        if (as_i64(PyList_GET_ITEM(handles, i), &h) < 0
                || as_i64(PyList_GET_ITEM(positions, i), &p) < 0
                || as_i64(PyList_GET_ITEM(blocks, i), &b) < 0) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        PyObject *term = PyLong_FromUnsignedLongLong(
            mix64((uint64_t)b * k_block + (uint64_t)p * k_pos + (uint64_t)h * k_handle + salt));
        if (term == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, term);
    }
    return out;
}

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

/* add_at(target: list, positions: list, counts: list) -> True | None: target[p] += c
 * for each aligned pair, all or nothing; None (target untouched) unless every
 * position is in range, every count in [-2**31, 2**31) and every target value at most
 * 2**62 in size (so no sum overflows, positions repeated or not). */
static PyObject *
add_at(PyObject *self, PyObject *args)
{
    PyObject *target, *positions, *counts;
    if (!PyArg_ParseTuple(args, "OOO", &target, &positions, &counts)) {
        return NULL;
    }
    if (!PyList_CheckExact(target) || !PyList_CheckExact(positions)
            || !PyList_CheckExact(counts)
            || PyList_GET_SIZE(positions) != PyList_GET_SIZE(counts)) {
        Py_RETURN_NONE;
    }
    const long long big = 1LL << 62;
    Py_ssize_t n = PyList_GET_SIZE(positions), size = PyList_GET_SIZE(target);
    for (Py_ssize_t i = 0; i < n; i++) { /* check everything before changing anything */
        long long p, c, v;
        if (as_i64(PyList_GET_ITEM(positions, i), &p) < 0 || p < 0 || p >= size
                || as_i64(PyList_GET_ITEM(counts, i), &c) < 0 || c < INT32_MIN || c > INT32_MAX
                || as_i64(PyList_GET_ITEM(target, p), &v) < 0 || v > big || v < -big) {
            Py_RETURN_NONE;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* |v| <= 2**62 + n * 2**31 < 2**63 */
        long long p = 0, c = 0, v = 0; /* read again: checked by the loop above */
        as_i64(PyList_GET_ITEM(positions, i), &p);
        as_i64(PyList_GET_ITEM(counts, i), &c);
        as_i64(PyList_GET_ITEM(target, p), &v);
        PyObject *sum = PyLong_FromLongLong(v + c);
        if (sum == NULL) {
            return NULL;
        }
        PyList_SetItem(target, p, sum); /* steals sum, releases the old item */
    }
    Py_RETURN_TRUE;
}

/* dot(values, keys, at=None) -> int | None: sum(values[j] * keys[at[j]]) mod 2**64
 * (keys[j] without ``at``): the digest's linear count terms.  values are int64-range
 * ints, keys ints in [0, 2**64), at positions in range; None for anything else. */
static PyObject *
dot(PyObject *self, PyObject *args)
{
    PyObject *values, *keys, *at = Py_None;
    if (!PyArg_ParseTuple(args, "OO|O", &values, &keys, &at)) {
        return NULL;
    }
    if (!PyList_CheckExact(values) || !PyList_CheckExact(keys)
            || (at != Py_None && !PyList_CheckExact(at))) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(values), size = PyList_GET_SIZE(keys);
    if (at == Py_None ? n != size : PyList_GET_SIZE(at) != n) {
        Py_RETURN_NONE;
    }
    uint64_t total = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        long long v, k = (long long)j;
        uint64_t key;
        if (at != Py_None && (as_i64(PyList_GET_ITEM(at, j), &k) < 0 || k < 0 || k >= size)) {
            Py_RETURN_NONE;
        }
        if (as_i64(PyList_GET_ITEM(values, j), &v) < 0
                || as_u64(PyList_GET_ITEM(keys, (Py_ssize_t)k), &key) < 0) {
            Py_RETURN_NONE;
        }
        total += (uint64_t)v * key; /* wraps: the sum mod 2**64 */
    }
    return PyLong_FromUnsignedLongLong(total);
}

/* The odd multiplier of the linear count terms of handle h at position i (see keyed_sum). */
static inline uint64_t
linear_key(long long h, Py_ssize_t i, uint64_t k_handle, uint64_t k_add, uint64_t k_pos)
{
    return mix64((uint64_t)h * k_handle + (uint64_t)i * k_pos + k_add) | 1ULL;
}

/* keyed_sum(handles, values, k_handle, k_add, k_pos, plus) -> int | None:
 * sum((values[i] + plus) * (mix64(handles[i]*k_handle + i*k_pos + k_add) | 1)) mod 2**64
 * over two equally long lists of int64-range ints: the digest's linear count terms
 * (protocol.digest.computed_change with k_pos = 0 and plus = 0, schedule_term with
 * k_add = 0 and plus = 1).  None for anything else. */
static PyObject *
keyed_sum(PyObject *self, PyObject *args)
{
    PyObject *handles, *values;
    unsigned long long k_handle, k_add, k_pos, plus;
    if (!PyArg_ParseTuple(args, "OOKKKK", &handles, &values, &k_handle, &k_add, &k_pos,
                          &plus)) {
        return NULL;
    }
    if (!PyList_CheckExact(handles) || !PyList_CheckExact(values)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(handles);
    if (PyList_GET_SIZE(values) != n) {
        Py_RETURN_NONE;
    }
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long h, v;
        if (as_i64(PyList_GET_ITEM(handles, i), &h) < 0
                || as_i64(PyList_GET_ITEM(values, i), &v) < 0) {
            Py_RETURN_NONE;
        }
        uint64_t key = linear_key(h, i, k_handle, k_add, k_pos);
        total += ((uint64_t)v + plus) * key; /* wraps: the sum mod 2**64 */
    }
    return PyLong_FromUnsignedLongLong(total);
}

/* key_list(handles, k_handle, k_add, k_pos) -> list | None: the keys of keyed_sum,
 * [mix64(handles[i]*k_handle + i*k_pos + k_add) | 1 for i], for a list of int64-range
 * ints (protocol.digest.handle_keys with k_pos = 0, schedule_keys with k_add = 0).
 * None for anything else. */
static PyObject *
key_list(PyObject *self, PyObject *args)
{
    PyObject *handles;
    unsigned long long k_handle, k_add, k_pos;
    if (!PyArg_ParseTuple(args, "OKKK", &handles, &k_handle, &k_add, &k_pos)) {
        return NULL;
    }
    if (!PyList_CheckExact(handles)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(handles);
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long h;
        if (as_i64(PyList_GET_ITEM(handles, i), &h) < 0) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        PyObject *key = PyLong_FromUnsignedLongLong(linear_key(h, i, k_handle, k_add, k_pos));
        if (key == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, key);
    }
    return out;
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

/* plan_rows(positions, counts, ids, handles, lengths, salt, k_block, k_pos, k_handle,
 * check) -> (row handles, row starts, row terms, their sum mod 2**64) | None: the
 * steady lane's plan of one KV group's appends (protocol.lane.SteadyLane._plan).
 * Row i appends counts[i] of the flat ids to handles[positions[i]]'s table at
 * lengths[positions[i]]; its term is the sum of mix64(id * k_block + at * k_pos +
 * handle * k_handle + salt) over its blocks (protocol.digest.block_row_sums).  None
 * unless every check passes (then the Python path decides): ids in [0, 2**31) and
 * lengths in [0, 2**62]; with ``check`` also positions distinct and scheduled and
 * counts >= 1 summing to the ids (without it those are trusted, but never read past a
 * list). */
/* plan_rows' answer (hs, starts, terms, total) as a fresh tuple, the total also in
 * *total; Py_None (a new reference) when not taken, NULL with an exception set. */
PyObject *
plan_lists(const PlanArgs *a, uint64_t *total)
{
    PyObject *pos = a->pos, *counts = a->counts, *ids = a->ids;
    PyObject *handles = a->handles, *lengths = a->lengths;
    if (!PyList_CheckExact(pos) || !PyList_CheckExact(counts) || !PyList_CheckExact(ids)
            || !PyList_CheckExact(handles) || !PyList_CheckExact(lengths)
            || PyList_GET_SIZE(pos) != PyList_GET_SIZE(counts) || PyList_GET_SIZE(pos) == 0
            || PyList_GET_SIZE(handles) != PyList_GET_SIZE(lengths)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t rows = PyList_GET_SIZE(pos), sched = PyList_GET_SIZE(handles);
    Py_ssize_t nids = PyList_GET_SIZE(ids), at = 0;
    unsigned char *seen = a->check ? PyMem_Calloc((size_t)sched, 1) : NULL;
    if (a->check && seen == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *hs = PyList_New(rows), *starts = PyList_New(rows), *terms = PyList_New(rows);
    *total = 0;
    if (hs == NULL || starts == NULL || terms == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < rows; i++) {
        long long p, c, h, start;
        if (as_i64(PyList_GET_ITEM(pos, i), &p) < 0 || p < 0 || p >= sched
                || as_i64(PyList_GET_ITEM(counts, i), &c) < 0 || c < 1 || c > nids - at
                || (a->check && seen[p]++)) {
            goto refuse;
        }
        PyObject *handle = PyList_GET_ITEM(handles, p), *length = PyList_GET_ITEM(lengths, p);
        if (as_i64(handle, &h) < 0 || as_i64(length, &start) < 0 || start < 0
                || start > (1LL << 62)) {
            goto refuse;
        }
        uint64_t row_salt = (uint64_t)h * a->k_handle + a->salt, term = 0;
        for (long long j = 0; j < c; j++, at++) {
            long long b;
            if (as_i64(PyList_GET_ITEM(ids, at), &b) < 0 || b < 0 || b >= (1LL << 31)) {
                goto refuse;
            }
            term += mix64((uint64_t)b * a->k_block + (uint64_t)(start + j) * a->k_pos
                          + row_salt);
        }
        PyObject *t = PyLong_FromUnsignedLongLong(term);
        if (t == NULL) {
            goto fail;
        }
        Py_INCREF(handle);
        Py_INCREF(length);
        PyList_SET_ITEM(hs, i, handle);
        PyList_SET_ITEM(starts, i, length);
        PyList_SET_ITEM(terms, i, t);
        *total += term;
    }
    if (at != nids) {
        goto refuse; /* ids left over */
    }
    PyMem_Free(seen);
    return Py_BuildValue("(NNNK)", hs, starts, terms, (unsigned long long)*total);
refuse:
    PyMem_Free(seen);
    Py_DECREF(hs);
    Py_DECREF(starts);
    Py_DECREF(terms);
    Py_RETURN_NONE;
fail:
    PyMem_Free(seen);
    Py_XDECREF(hs);
    Py_XDECREF(starts);
    Py_XDECREF(terms);
    return NULL;
}

static PyObject *
plan_rows(PyObject *self, PyObject *args)
{
    PlanArgs a;
    if (!PyArg_ParseTuple(args, "OOOOOKKKKp", &a.pos, &a.counts, &a.ids, &a.handles,
                          &a.lengths, &a.salt, &a.k_block, &a.k_pos, &a.k_handle, &a.check)) {
        return NULL;
    }
    uint64_t total;
    return plan_lists(&a, &total);
}

/* lengths[positions[i]] += counts[i] for the rows plan_lists took; 0, or -1 with an
 * exception set (some lengths then grown). */
int
grow_lengths(const PlanArgs *a)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(a->pos); i++) { /* checked by plan_lists:
                                                                   in range, no overflow */
        long long p = 0, c = 0, v = 0;
        as_i64(PyList_GET_ITEM(a->pos, i), &p);
        as_i64(PyList_GET_ITEM(a->counts, i), &c);
        as_i64(PyList_GET_ITEM(a->lengths, p), &v); /* read again: a trusted repeat adds twice */
        PyObject *sum = PyLong_FromLongLong(v + c);
        if (sum == NULL) {
            return -1;
        }
        PyList_SetItem(a->lengths, p, sum); /* steals sum, releases the old item */
    }
    return 0;
}

/* lane_append(positions, counts, ids, handles, lengths, salt, k_block, k_pos, k_handle,
 * check, base, expected) -> (row handles, row starts, row terms, digest) | int | None:
 * plan_rows, then the step's digest (base + the terms' sum) mod 2**64 and, when it is
 * ``expected`` (None: anything), lengths[positions[i]] += counts[i] -- the steady
 * lane's one-group append (protocol.lane.SteadyLane.appended) in one call.  An int: the
 * digest, which differs from ``expected`` (nothing changed); None: not taken, nothing
 * changed (the Python path decides). */
static PyObject *
lane_append(PyObject *self, PyObject *args)
{
    PlanArgs a;
    unsigned long long base;
    PyObject *expected;
    if (!PyArg_ParseTuple(args, "OOOOOKKKKpKO", &a.pos, &a.counts, &a.ids, &a.handles,
                          &a.lengths, &a.salt, &a.k_block, &a.k_pos, &a.k_handle, &a.check,
                          &base, &expected)) {
        return NULL;
    }
    uint64_t total;
    PyObject *plan = plan_lists(&a, &total);
    if (plan == NULL || plan == Py_None) {
        return plan;
    }
    PyObject *digest = PyLong_FromUnsignedLongLong((unsigned long long)(base + total));
    int same = digest == NULL ? -1 : expected == Py_None ? 1
        : PyObject_RichCompareBool(digest, expected, Py_EQ);
    if (same != 1) { /* 0: the digest differs, nothing changes; -1: an exception is set */
        Py_DECREF(plan);
        if (same == 0) {
            return digest;
        }
        Py_XDECREF(digest);
        return NULL;
    }
    if (grow_lengths(&a) < 0) {
        Py_DECREF(plan);
        Py_DECREF(digest);
        return NULL;
    }
    if (PyTuple_SetItem(plan, 3, digest) < 0) { /* fresh and ours alone: the total gives way */
        Py_DECREF(plan); /* (SetItem released the digest) */
        return NULL;
    }
    return plan;
}

/* sparse_scan(buf, rows, itemsize): an integer array's rows against their background
 * words, for engine_side.vllm.schema.sparse_words.  ``buf``: a C-contiguous buffer of
 * native-order words of ``itemsize`` bytes (1, 2, 4 or 8), ``rows`` equal rows.  Row r's
 * background is all-one words when more than half its words are all ones, else zero
 * words.  Returns (background: one byte 0/1 per row, gaps: int64 per word that differs
 * from its row's background -- its flat position minus the previous one's minus 1, the
 * first counted from -1 --, values: those words' bytes), as scan_py does; None when not
 * taken (an unaligned buffer included). */
#define SCAN_COUNT(T)                                                              \
    {                                                                              \
        const T *w = (const T *)view.buf;                                          \
        for (Py_ssize_t r = 0; r < rows; r++) {                                    \
            Py_ssize_t ones = 0, zeros = 0;                                        \
            for (Py_ssize_t j = 0; j < words; j++) {                               \
                T v = w[r * words + j];                                            \
                ones += v == (T)~(T)0;                                             \
                zeros += v == 0;                                                   \
            }                                                                      \
            bg[r] = 2 * ones > words;                                              \
            total += words - (bg[r] ? ones : zeros);                               \
        }                                                                          \
    }
#define SCAN_EMIT(T)                                                               \
    {                                                                              \
        const T *w = (const T *)view.buf;                                          \
        T *vals = (T *)PyBytes_AS_STRING(values);                                  \
        for (Py_ssize_t r = 0; r < rows; r++) {                                    \
            T back = bg[r] ? (T)~(T)0 : 0;                                         \
            for (Py_ssize_t j = 0; j < words; j++) {                               \
                Py_ssize_t at = r * words + j;                                     \
                if (w[at] != back) {                                               \
                    gaps[k] = (int64_t)(at - last - 1);                            \
                    vals[k++] = w[at];                                             \
                    last = at;                                                     \
                }                                                                  \
            }                                                                      \
        }                                                                          \
    }

static PyObject *
sparse_scan(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t rows, itemsize;
    if (!PyArg_ParseTuple(args, "Onn", &obj, &rows, &itemsize)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *background = NULL, *gap_bytes = NULL, *values = NULL;
    Py_ssize_t n = itemsize > 0 ? view.len / itemsize : 0;
    if (rows <= 0 || (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8)
        || view.len % itemsize || n % rows || (uintptr_t)view.buf % itemsize) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    Py_ssize_t words = n / rows, total = 0, k = 0, last = -1;
    background = PyBytes_FromStringAndSize(NULL, rows);
    if (background == NULL) {
        goto fail;
    }
    unsigned char *bg = (unsigned char *)PyBytes_AS_STRING(background);
    switch (itemsize) {
    case 1: SCAN_COUNT(uint8_t) break;
    case 2: SCAN_COUNT(uint16_t) break;
    case 4: SCAN_COUNT(uint32_t) break;
    default: SCAN_COUNT(uint64_t) break;
    }
    gap_bytes = PyBytes_FromStringAndSize(NULL, total * (Py_ssize_t)sizeof(int64_t));
    values = PyBytes_FromStringAndSize(NULL, total * itemsize);
    if (gap_bytes == NULL || values == NULL) {
        goto fail;
    }
    int64_t *gaps = (int64_t *)PyBytes_AS_STRING(gap_bytes);
    switch (itemsize) {
    case 1: SCAN_EMIT(uint8_t) break;
    case 2: SCAN_EMIT(uint16_t) break;
    case 4: SCAN_EMIT(uint32_t) break;
    default: SCAN_EMIT(uint64_t) break;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(NNN)", background, gap_bytes, values);
fail:
    PyBuffer_Release(&view);
    Py_XDECREF(background);
    Py_XDECREF(gap_bytes);
    Py_XDECREF(values);
    return NULL;
}

/* Grammar bitmask rows by reference (engine_side.vllm.rowrefs).  A row is ``width``
 * bytes; a table is whole rows.  Ids: a table row's position, then the fresh rows in
 * first-use order. */
static uint64_t
row_hash(const unsigned char *p, Py_ssize_t n)
{
    /* every byte, eight independent lanes (each lane's multiplies are a chain: eight
     * chains keep the multiplier busy, a quarter less time than four at a real vocabulary):
     * rows that differ in one word collide only by chance, and a collision costs a
     * memcmp, never a wrong answer */
    uint64_t lane[8] = {0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL, 0x165667B19E3779F9ULL,
                        0xD6E8FEB86659FD93ULL, 0x27D4EB2F165667C5ULL, 0x94D049BB133111EBULL,
                        0xBF58476D1CE4E5B9ULL, 0x85EBCA77C2B2AE63ULL};
    Py_ssize_t i = 0;
    for (; i + 64 <= n; i += 64) {
        for (int k = 0; k < 8; k++) {
            uint64_t w;
            memcpy(&w, p + i + 8 * k, 8);
            lane[k] = (lane[k] ^ w) * 0xFF51AFD7ED558CCDULL;
        }
    }
    uint64_t h = (uint64_t)n;
    for (int k = 0; k < 8; k++) {
        h = (h ^ lane[k] ^ (lane[k] >> 29)) * 0xC4CEB9FE1A85EC53ULL;
    }
    for (; i < n; i++) {
        h = (h ^ p[i]) * 0x100000001B3ULL;
    }
    return h ^ (h >> 31);
}

/* The distinct rows named by ``ids`` (n of them, each < ``total``, rows at ``where``),
 * in first-use order, as one bytes object. */
static PyObject *
first_use_rows(const Py_ssize_t *ids, Py_ssize_t n, Py_ssize_t total,
               const unsigned char *const *where, Py_ssize_t width)
{
    unsigned char *seen = PyMem_Calloc((size_t)total + 1, 1);
    if (seen == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t distinct = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        distinct += !seen[ids[i]];
        seen[ids[i]] = 1;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, distinct * width);
    if (out != NULL) {
        memset(seen, 0, (size_t)total + 1);
        unsigned char *q = (unsigned char *)PyBytes_AS_STRING(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!seen[ids[i]]) {
                seen[ids[i]] = 1;
                memcpy(q, where[ids[i]], (size_t)width);
                q += width;
            }
        }
    }
    PyMem_Free(seen);
    return out;
}

/* Both buffers, C-contiguous: 0, or -1 with neither held and no error set. */
static int
two_buffers(PyObject *a, PyObject *b, Py_buffer *va, Py_buffer *vb)
{
    if (PyObject_GetBuffer(a, va, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return -1;
    }
    if (PyObject_GetBuffer(b, vb, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        PyBuffer_Release(va);
        return -1;
    }
    return 0;
}

/* Words of a row the first pass hashes (rows of at most this many words: all of them). */
#define ROW_SAMPLE 64
/* Rows that differ but hash alike the first pass tolerates before it hashes every byte. */
#define ROW_COLLISIONS 16

/* The first pass's hash: ROW_SAMPLE words spread over the row and its last word.  Rows
 * at different grammar states differ in most sampled words (a bitmask row mostly allows
 * or mostly refuses), so equal rows are found by one memcmp instead of hashing every
 * byte; rows that differ only between the samples collide, and past ROW_COLLISIONS the
 * caller hashes every byte instead. */
static uint64_t
row_sample_hash(const unsigned char *p, Py_ssize_t n)
{
    Py_ssize_t words = n / 8;
    if (words <= ROW_SAMPLE) {
        return row_hash(p, n);
    }
    Py_ssize_t stride = words / ROW_SAMPLE; /* >= 1 word apart */
    uint64_t h = (uint64_t)n * 0x9E3779B97F4A7C15ULL, w;
    for (Py_ssize_t k = 0; k < ROW_SAMPLE; k++) {
        memcpy(&w, p + 8 * k * stride, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDULL;
    }
    memcpy(&w, p + n - 8, 8);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 31);
}

/* The table rows (t, at ``tbuf``) and then the rows (n, at ``rbuf``), each ``width``
 * bytes, into the open-addressed table (``cap`` slots, a power of two >= 2 (t + n)):
 * ids[i] is row i's id (the first equal table row, else t + j for the j-th row no
 * earlier row equals), where[id] its bytes, *made the fresh rows.  ``sampled``: hash
 * with row_sample_hash; then 1, the answer unfinished, past ROW_COLLISIONS rows that
 * differ from a row hashing alike (every byte's hash then decides); else 0. */
static int
row_ids(const unsigned char *tbuf, Py_ssize_t t, const unsigned char *rbuf, Py_ssize_t n,
        Py_ssize_t width, int sampled, Py_ssize_t cap, Py_ssize_t *slot_id,
        uint64_t *slot_hash, const unsigned char **where, Py_ssize_t *ids, Py_ssize_t *made)
{
    Py_ssize_t collisions = 0;
    memset(slot_id, 0, sizeof(Py_ssize_t) * (size_t)cap); /* id + 1; 0: empty */
    *made = 0;
    for (Py_ssize_t r = 0; r < t + n; r++) {
        const unsigned char *p = r < t ? tbuf + r * width : rbuf + (r - t) * width;
        uint64_t h = sampled ? row_sample_hash(p, width) : row_hash(p, width);
        size_t s = (size_t)h & (size_t)(cap - 1);
        Py_ssize_t id = -1;
        while (slot_id[s]) {
            Py_ssize_t k = slot_id[s] - 1;
            if (slot_hash[s] == h) {
                if (memcmp(where[k], p, (size_t)width) == 0) {
                    id = k;
                    break;
                }
                if (sampled && ++collisions > ROW_COLLISIONS) {
                    return 1;
                }
            }
            s = (s + 1) & (size_t)(cap - 1);
        }
        if (id < 0) { /* a table row keeps its position (the first of equal ones wins) */
            id = r < t ? r : t + (*made)++;
            where[id] = p;
            slot_id[s] = id + 1;
            slot_hash[s] = h;
        }
        if (r >= t) {
            ids[r - t] = id;
        }
    }
    return 0;
}

/* row_refs(table, rows, width) -> (refs: list, fresh: bytes, table: bytes) | None: each
 * row of ``rows`` as the id of the first equal row (table rows first, then the rows no
 * earlier row equals -- the fresh ones, concatenated in order in ``fresh``); ``table``:
 * the distinct rows used, in first-use order (the next table).  As
 * engine_side.vllm.rowrefs.row_refs_py; None when not taken. */
static PyObject *
row_refs(PyObject *self, PyObject *args)
{
    PyObject *table_obj, *rows_obj;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OOn", &table_obj, &rows_obj, &width)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer tv, rv;
    if (two_buffers(table_obj, rows_obj, &tv, &rv) < 0) {
        Py_RETURN_NONE;
    }
    PyObject *refs = NULL, *fresh = NULL, *next = NULL, *out = NULL;
    Py_ssize_t *slot_id = NULL, *ids = NULL;
    uint64_t *slot_hash = NULL;
    const unsigned char **where = NULL;
    if (width <= 0 || tv.len % width || rv.len % width) {
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    Py_ssize_t t = tv.len / width, n = rv.len / width, cap = 8, made = 0;
    while (cap < 2 * (t + n)) {
        cap <<= 1;
    }
    slot_id = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)cap);
    slot_hash = PyMem_Malloc(sizeof(uint64_t) * (size_t)cap);
    where = PyMem_Malloc(sizeof(*where) * (size_t)(t + n + 1)); /* id -> its bytes */
    ids = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    refs = PyList_New(n);
    if (slot_id == NULL || slot_hash == NULL || where == NULL || ids == NULL || refs == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_NoMemory();
        }
        goto done;
    }
    const unsigned char *tbuf = tv.buf, *rbuf = rv.buf;
    if (row_ids(tbuf, t, rbuf, n, width, 1, cap, slot_id, slot_hash, where, ids, &made)) {
        row_ids(tbuf, t, rbuf, n, width, 0, cap, slot_id, slot_hash, where, ids, &made);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ref = PyLong_FromSsize_t(ids[i]);
        if (ref == NULL) {
            goto done;
        }
        PyList_SET_ITEM(refs, i, ref);
    }
    fresh = PyBytes_FromStringAndSize(NULL, made * width);
    if (fresh == NULL) {
        goto done;
    }
    for (Py_ssize_t j = 0; j < made; j++) {
        memcpy(PyBytes_AS_STRING(fresh) + j * width, where[t + j], (size_t)width);
    }
    next = first_use_rows(ids, n, t + made, where, width);
    if (next != NULL) {
        out = PyTuple_Pack(3, refs, fresh, next);
    }
done:
    PyMem_Free(slot_id);
    PyMem_Free(slot_hash);
    PyMem_Free(where);
    PyMem_Free(ids);
    Py_XDECREF(refs);
    Py_XDECREF(fresh);
    Py_XDECREF(next);
    PyBuffer_Release(&tv);
    PyBuffer_Release(&rv);
    return out;
}

/* row_rebuild(table, fresh, refs, width) -> (rows: bytearray, table: bytes) | None: the
 * rows ``refs`` name (table rows, then ``fresh`` rows), and the distinct rows used in
 * first-use order (the next table).  As engine_side.vllm.rowrefs.row_rebuild_py; None
 * when not taken -- including refs that are not exact ints naming a row, or fresh rows
 * that are not each first used in order after the previous one (Python then raises). */
static PyObject *
row_rebuild(PyObject *self, PyObject *args)
{
    PyObject *table_obj, *fresh_obj, *refs;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "OOOn", &table_obj, &fresh_obj, &refs, &width)
            || !PyList_CheckExact(refs)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer tv, fv;
    if (two_buffers(table_obj, fresh_obj, &tv, &fv) < 0) {
        Py_RETURN_NONE;
    }
    PyObject *rows = NULL, *next = NULL, *out = NULL;
    const unsigned char **where = NULL;
    Py_ssize_t *ids = NULL;
    unsigned char *seen = NULL;
    Py_ssize_t n = PyList_GET_SIZE(refs);
    if (width <= 0 || tv.len % width || fv.len % width || n > PY_SSIZE_T_MAX / width) {
        goto not_taken;
    }
    Py_ssize_t t = tv.len / width, k = fv.len / width, expect = t;
    where = PyMem_Malloc(sizeof(*where) * (size_t)(t + k + 1));
    ids = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1));
    seen = PyMem_Calloc((size_t)(t + k + 1), 1);
    if (where == NULL || ids == NULL || seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < t + k; j++) {
        where[j] = j < t ? (const unsigned char *)tv.buf + j * width
                         : (const unsigned char *)fv.buf + (j - t) * width;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(refs, i);
        if (!PyLong_CheckExact(item)) {
            goto not_taken;
        }
        Py_ssize_t id = PyLong_AsSsize_t(item);
        if (id == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto not_taken;
        }
        if (id < 0 || id >= t + k || (id >= t && !seen[id] && id != expect++)) {
            goto not_taken;
        }
        seen[id] = 1;
        ids[i] = id;
    }
    if (expect != t + k) {
        goto not_taken; /* a fresh row never used */
    }
    rows = PyByteArray_FromStringAndSize(NULL, n * width);
    if (rows == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(PyByteArray_AS_STRING(rows) + i * width, where[ids[i]], (size_t)width);
    }
    next = first_use_rows(ids, n, t + k, where, width);
    if (next != NULL) {
        out = PyTuple_Pack(2, rows, next);
    }
    goto done;
not_taken:
    out = Py_None;
    Py_INCREF(out);
done:
    PyMem_Free(where);
    PyMem_Free(ids);
    PyMem_Free(seen);
    Py_XDECREF(rows);
    Py_XDECREF(next);
    PyBuffer_Release(&tv);
    PyBuffer_Release(&fv);
    return out;
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

static PyMethodDef methods[] = {
    {"pack_list", pack_list, METH_O, "protocol.packing.pack_uints of a list (None: not taken)."},
    {"pack_array", pack_array, METH_O,
     "protocol.packing.pack_uints of a contiguous int64 buffer (None: not taken)."},
    {"int64_bytes", int64_bytes, METH_O,
     "A list of int64-range ints as native int64 bytes (None: not taken)."},
    {"unpack_array", unpack_array, METH_VARARGS,
     "A well-formed packed array as native int64 bytes (None: anything else)."},
    {"pack_signed_list", pack_signed_list, METH_O,
     "protocol.packing.pack_sints of a list (None: not taken)."},
    {"raw_list", raw_list, METH_VARARGS,
     "The raw values of a well-formed packed array (None: anything else)."},
    {"raw_signed_list", raw_signed_list, METH_VARARGS, "raw_list, zig-zag decoded."},
    {"raw_list_minus_one", raw_list_minus_one, METH_VARARGS, "raw_list, each value minus one."},
    {"pack_plus_one", pack_plus_one, METH_O,
     "protocol.packing.pack_uints of each value plus one (None: not taken)."},
    {"draft_rows", (PyCFunction)(void (*)(void))draft_rows, METH_FASTCALL,
     "A step's draft tokens as lengths by batch position and one flat list (None: not taken)."},
    {"split_rows", (PyCFunction)(void (*)(void))split_rows, METH_FASTCALL,
     "Consecutive rows of a flat list keyed by their non-empty lengths (None: not taken)."},
    {"one_group_appends", one_group_appends, METH_O,
     "A one-group step's new blocks as (positions, counts, flat ids) (None: not taken)."},
    {"add_at", add_at, METH_VARARGS, "target[p] += c for aligned pairs, all or nothing."},
    {"single_items", single_items, METH_O,
     "[row[0] for row in rows] when every row is a one-item list (None: not taken)."},
    {"singletons", singletons, METH_O, "[[item] for item in items] (None: not a list)."},
    {"keyed_sum", keyed_sum, METH_VARARGS,
     "The digest's linear count terms summed over two lists (None: not taken)."},
    {"key_list", key_list, METH_VARARGS,
     "The keys keyed_sum multiplies by, as a list (None: not taken)."},
    {"dict_matches", dict_matches, METH_VARARGS,
     "0: keys differ, 1: values differ, 2: both match a dict's (None: not taken)."},
    {"plan_rows", plan_rows, METH_VARARGS,
     "The steady lane's plan of one group's appends (None: not taken)."},
    {"lane_append", lane_append, METH_VARARGS,
     "The steady lane's one-group append: plan, digest and lengths (None: not taken)."},
    {"dot", dot, METH_VARARGS, "sum(values[j] * keys[at[j]]) mod 2**64 (None: not taken)."},
    {"unit_terms", unit_terms, METH_VARARGS,
     "protocol.digest.block_unit_terms in C (None: not taken)."},
    {"sparse_scan", sparse_scan, METH_VARARGS,
     "An integer array's rows against their background words (None: not taken)."},
    {"row_refs", row_refs, METH_VARARGS,
     "Rows as references into a table followed by the fresh rows (None: not taken)."},
    {"row_rebuild", row_rebuild, METH_VARARGS,
     "The rows references name, and the next table (None: not taken)."},
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
                      || PyModule_AddFunctions(m, absorb_methods) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
