/* The worker's read of the frame _speedups_frame.c's lane_frame writes, without the
 * message objects: lane_view.  It takes lane_frame's canonical form alone (keys in field
 * order, flags true when present, bins and unsigned ints) and refuses anything else,
 * valid or not, for codec.decode to decide; tests/test_lane_frame.py holds it to the
 * objects' reading of any frame. */
#include "_speedups.h"


typedef struct {
    const unsigned char *b;
    Py_ssize_t at, len;
} Reader;

/* An unsigned msgpack int into *v: 1, or 0 for anything else (the objects decide). */
static int
read_u64(Reader *r, uint64_t *v)
{
    if (r->at >= r->len) {
        return 0;
    }
    unsigned char h = r->b[r->at++];
    int n = h < 0x80 ? 0 : h == 0xCC ? 1 : h == 0xCD ? 2 : h == 0xCE ? 4 : h == 0xCF ? 8 : -1;
    if (n < 0 || r->at + n > r->len) {
        return 0;
    }
    *v = n == 0 ? h : 0;
    for (int k = 0; k < n; k++) {
        *v = *v << 8 | r->b[r->at++];
    }
    return 1;
}

/* A fixmap or map16 header: its entry count, or -1. */
static Py_ssize_t
read_map(Reader *r)
{
    if (r->at >= r->len) {
        return -1;
    }
    unsigned char h = r->b[r->at++];
    if ((h & 0xF0) == 0x80) {
        return h & 0x0F;
    }
    if (h != 0xDE || r->at + 2 > r->len) {
        return -1;
    }
    r->at += 2;
    return (Py_ssize_t)r->b[r->at - 2] << 8 | r->b[r->at - 1];
}

/* The index in ``keys`` (``count`` of them) of a fixstr key, or -1. */
static int
read_key(Reader *r, const char *const *keys, int count)
{
    if (r->at >= r->len || (r->b[r->at] & 0xE0) != 0xA0) {
        return -1;
    }
    Py_ssize_t n = r->b[r->at] & 0x1F;
    if (r->at + 1 + n > r->len) {
        return -1;
    }
    const char *key = (const char *)r->b + r->at + 1;
    r->at += 1 + n;
    for (int k = 0; k < count; k++) {
        if ((Py_ssize_t)strlen(keys[k]) == n && memcmp(keys[k], key, (size_t)n) == 0) {
            return k;
        }
    }
    return -1;
}

/* A bin's payload as a new bytes object; Py_None (a new reference) when the next value
 * is not a bin; NULL with an exception set. */
static PyObject *
read_bin(Reader *r)
{
    if (r->at >= r->len) {
        return Py_NewRef(Py_None);
    }
    unsigned char h = r->b[r->at];
    int w = h == 0xC4 ? 1 : h == 0xC5 ? 2 : h == 0xC6 ? 4 : 0;
    if (w == 0 || r->at + 1 + w > r->len) {
        return Py_NewRef(Py_None);
    }
    Py_ssize_t n = 0;
    for (int k = 0; k < w; k++) {
        n = n << 8 | r->b[r->at + 1 + k];
    }
    if (r->at + 1 + w + n > r->len) {
        return Py_NewRef(Py_None);
    }
    r->at += 1 + w + n;
    return PyBytes_FromStringAndSize((const char *)r->b + r->at - n, n);
}

/* A sparse map of bin fields named ``keys`` (each at most once, in order) into out[]
 * (new references; b"" for an absent one): 1, 0 when it is anything else, -1 with an
 * exception set. */
static int
read_sparse(Reader *r, const char *const *keys, int count, PyObject **out)
{
    Py_ssize_t entries = read_map(r);
    int last = -1;
    for (int k = 0; k < count; k++) {
        out[k] = NULL;
    }
    for (Py_ssize_t e = 0; e < entries; e++) {
        int k = read_key(r, keys, count);
        if (k <= last || (out[k] = read_bin(r)) == NULL || out[k] == Py_None) {
            return k > last && out[k] == NULL ? -1 : 0;
        }
        last = k;
    }
    for (int k = 0; k < count; k++) {
        if (out[k] == NULL && (out[k] = PyBytes_FromStringAndSize(NULL, 0)) == NULL) {
            return -1;
        }
    }
    return entries >= 0;
}

/* A Rows map as a (handles, counts, values) tuple: a new reference, Py_None when it is
 * not one, NULL with an exception set. */
static PyObject *
read_rows(Reader *r)
{
    static const char *const keys[3] = {"h", "n", "v"};
    PyObject *f[3];
    int got = read_sparse(r, keys, 3, f);
    PyObject *out = got == 1 ? PyTuple_Pack(3, f[0], f[1], f[2])
                  : got == 0 ? Py_NewRef(Py_None) : NULL;
    for (int k = 0; k < 3; k++) {
        Py_XDECREF(f[k]);
    }
    return out;
}

/* block_append: a fixarray of Rows as a tuple of their tuples (as read_rows). */
static PyObject *
read_rows_array(Reader *r)
{
    if (r->at >= r->len || (r->b[r->at] & 0xF0) != 0x90) {
        return Py_NewRef(Py_None);
    }
    Py_ssize_t n = r->b[r->at++] & 0x0F;
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t k = 0; out != NULL && k < n; k++) {
        PyObject *rows = read_rows(r);
        if (rows == NULL || rows == Py_None) {
            Py_DECREF(out);
            return rows;
        }
        PyTuple_SET_ITEM(out, k, rows);
    }
    return out;
}

/* extension {"v": a StepExt of out_pos and out_delta alone} into ext[0..1] (new
 * references): 1, 0 for anything else, -1 with an exception set. */
static int
read_extension(Reader *r, PyObject **ext)
{
    static const char *const v[1] = {"v"}, *const keys[2] = {"op", "od"};
    ext[0] = ext[1] = NULL;
    if (read_map(r) != 1 || read_key(r, v, 1) != 0) {
        return 0;
    }
    PyObject *raw = read_bin(r);
    if (raw == NULL || raw == Py_None) {
        Py_XDECREF(raw);
        return raw == NULL ? -1 : 0;
    }
    Reader inner = {(const unsigned char *)PyBytes_AS_STRING(raw), 0, PyBytes_GET_SIZE(raw)};
    int got = read_sparse(&inner, keys, 2, ext);
    Py_DECREF(raw);
    return got == 1 && inner.at == inner.len ? 1 : got < 0 ? -1 : 0;
}

enum { V_EPOCH, V_SEQ, V_DIGEST, V_NT, V_NC, V_BA, V_SP, V_SO, V_PS, V_NS, V_OP, V_OD,
       V_COUNT };

/* Skips one value of lane_frame's canonical form (uint, true, bin, fixstr key, fixarray
 * or fixmap/map16 of those) without making objects: 1, or 0 for anything else. */
static int
skip_value(Reader *r, int depth)
{
    if (r->at >= r->len || depth > 3) {
        return 0;
    }
    unsigned char h = r->b[r->at];
    uint64_t v;
    if (h < 0x80 || h == 0xCC || h == 0xCD || h == 0xCE || h == 0xCF) {
        return read_u64(r, &v);
    }
    if (h == 0xC3) {
        r->at++;
        return 1;
    }
    if (h == 0xC4 || h == 0xC5 || h == 0xC6) {
        int w = h == 0xC4 ? 1 : h == 0xC5 ? 2 : 4;
        Py_ssize_t n = 0;
        if (r->at + 1 + w > r->len) {
            return 0;
        }
        for (int k = 0; k < w; k++) {
            n = n << 8 | r->b[r->at + 1 + k];
        }
        r->at += 1 + w + n;
        return r->at <= r->len;
    }
    if ((h & 0xF0) == 0x90) {
        r->at++;
        for (int k = 0; k < (h & 0x0F); k++) {
            if (!skip_value(r, depth + 1)) {
                return 0;
            }
        }
        return 1;
    }
    Py_ssize_t entries = read_map(r);
    for (Py_ssize_t e = 0; e < entries; e++) {
        if (r->at >= r->len || (r->b[r->at] & 0xE0) != 0xA0) {
            return 0;
        }
        r->at += 1 + (r->b[r->at] & 0x1F); /* the fixstr key */
        if (!skip_value(r, depth + 1)) {
            return 0;
        }
    }
    return entries >= 0;
}

/* Whether a body of ``entries`` entries at ``r`` (a copy: it is moved) names count,
 * draft or output rows or a number of speculative tokens (nt, nc, sp, the extension x or
 * ns), read without making objects: a plain step's body (block appends and flags alone)
 * is refused before any of it is made. */
static int
names_rows(Reader *r, Py_ssize_t entries)
{
    for (Py_ssize_t e = 0; e < entries; e++) {
        int k = read_key(r, entry_keys, E_COUNT);
        if (k == E_NT || k == E_NC || k == E_SP || k == E_X || k == E_NS) {
            return 1;
        }
        if (k < 0 || !skip_value(r, 0)) {
            return 0;
        }
    }
    return 0;
}

/* The body's entries into v[V_NT..V_OD] (new references): 1, 0 for a body that is not
 * one lane_frame could write with count or draft rows, -1 with an exception set. */
static int
read_body(Reader *r, PyObject **v)
{
    Py_ssize_t entries = read_map(r);
    int last = -1, got = 1;
    Reader probe = *r;
    if (!names_rows(&probe, entries)) {
        return 0;
    }
    for (Py_ssize_t e = 0; got == 1 && e < entries; e++) {
        int k = read_key(r, entry_keys, E_COUNT);
        if (k <= last) {
            return 0;
        }
        last = k;
        PyObject *value = NULL;
        uint64_t ns;
        if (k == E_NT || k == E_NC || k == E_SP) {
            value = read_rows(r);
        } else if (k == E_BA) {
            value = read_rows_array(r);
        } else if (k == E_SO || k == E_PS) {
            value = r->at < r->len && r->b[r->at++] == 0xC3 ? Py_NewRef(Py_True)
                                                            : Py_NewRef(Py_None);
        } else if (k == E_NS) {
            value = read_u64(r, &ns) ? PyLong_FromUnsignedLongLong(ns) : Py_NewRef(Py_None);
        } else {
            got = read_extension(r, v + V_OP);
            continue;
        }
        if (value == NULL || value == Py_None) {
            Py_XDECREF(value);
            return value == NULL ? -1 : 0;
        }
        v[V_NT + k] = value; /* the entries' order is the slots' */
    }
    if (got != 1) {
        return got;
    }
    return entries >= 0 && (v[V_NT] != NULL || v[V_NC] != NULL || v[V_SP] != NULL
                            || (v[V_OP] != NULL && PyBytes_GET_SIZE(v[V_OP]) > 0)
                            || (v[V_NS] != NULL && nonzero_int(v[V_NS])));
}

/* The defaults of the entries a body leaves out (new references): 0, or -1 with an
 * exception set. */
static int
defaults(PyObject **v)
{
    PyObject *none = Py_None, *no = Py_False;
    for (int k = V_NT; k <= V_OD; k++) {
        if (v[k] != NULL) {
            continue;
        }
        v[k] = k == V_BA ? PyTuple_New(0) : k == V_SO || k == V_PS ? Py_NewRef(no)
             : k == V_NS ? PyLong_FromLong(0) : k >= V_OP ? PyBytes_FromStringAndSize(NULL, 0)
             : Py_NewRef(none);
        if (v[k] == NULL) {
            return -1;
        }
    }
    return 0;
}

/* lane_view(frame) -> (epoch, seq, digest, computed, scheduled, spec, block_append,
 * out_pos, out_delta, structured, pending, nspec) | None (counted_step's order of the
 * body's fields, from ``computed``): the worker's read of a Delta
 * frame lane_frame could write, without the objects -- a body of count, draft or output
 * rows or a number of speculative tokens (computed_tokens, scheduled_tokens,
 * spec_tokens, the extension's out_pos or num_spec_tokens_to_schedule), at most the
 * same-batch step's other fields and
 * an extension of StepExt's out_pos and out_delta alone, in the canonical form (keys in
 * field order, flags true when present, bins and unsigned ints).  Each Rows is a
 * (handles, counts, values) tuple of bytes (b"" when absent; None for an absent Rows),
 * block_append a tuple of them (() for none), the flags bools, out_pos and out_delta
 * b"" when absent.  None for any other frame, bad ones included: codec.decode then
 * decides (and raises for a bad one). */
static PyObject *
lane_view(PyObject *self, PyObject *frame)
{
    if (!PyBytes_CheckExact(frame)) {
        Py_RETURN_NONE;
    }
    Reader r = {(const unsigned char *)PyBytes_AS_STRING(frame), 0, PyBytes_GET_SIZE(frame)};
    if (r.len < 2 || r.b[0] != 0x95 || r.b[1] != 0x04) {
        Py_RETURN_NONE;
    }
    r.at = 2;
    uint64_t head[3];
    PyObject *v[V_COUNT] = {NULL}, *result = NULL;
    int got = read_u64(&r, &head[0]) && read_u64(&r, &head[1]) && read_u64(&r, &head[2]);
    if (got) {
        got = read_body(&r, v);
    }
    if (got == 1 && r.at == r.len && defaults(v) == 0) {
        result = Py_BuildValue("(KKKOOOOOOOOO)", head[0], head[1], head[2], v[V_NC], v[V_NT],
                               v[V_SP], v[V_BA], v[V_OP], v[V_OD], v[V_SO], v[V_PS], v[V_NS]);
    } else if (got >= 0 && !PyErr_Occurred()) {
        result = Py_NewRef(Py_None);
    }
    for (int k = 0; k < V_COUNT; k++) {
        Py_XDECREF(v[k]);
    }
    return result;
}

PyMethodDef view_methods[] = {
    {"lane_view", lane_view, METH_O,
     "The worker's read of a count or draft step's Delta frame, without the objects (None: "
     "not taken)."},
    {NULL, NULL, 0, NULL},
};
