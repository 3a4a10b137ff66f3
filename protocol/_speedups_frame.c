/* The engine's frame of a same-batch step with count rows, written without the objects:
 * lane_frame.  The bytes are exactly those codec.encode writes for the Delta the
 * general lines make (msgspec's field order, defaults omitted, map16 headers for the
 * structs of more than 15 fields, the Delta body's made a fixmap by compact_map when
 * the frame is at most codec.COMPACT_LIMIT bytes); a test holds them together. */
#include "_speedups.h"

#define COMPACT_LIMIT 1024 /* protocol.codec.COMPACT_LIMIT */

/* Bytes a bin header and its payload take (payloads under 4 GiB). */
static Py_ssize_t
bin_size(PyObject *bin)
{
    Py_ssize_t n = PyBytes_GET_SIZE(bin);
    return n + (n <= 0xFF ? 2 : n <= 0xFFFF ? 3 : 5);
}

/* Writes the msgpack bin header of ``n`` bytes (under 4 GiB); the bytes written. */
static Py_ssize_t
put_bin_header(unsigned char *o, Py_ssize_t n)
{
    Py_ssize_t at = 0;
    if (n <= 0xFF) {
        o[at++] = 0xC4;
        o[at++] = (unsigned char)n;
    } else if (n <= 0xFFFF) {
        o[at++] = 0xC5;
        o[at++] = (unsigned char)(n >> 8);
        o[at++] = (unsigned char)n;
    } else {
        o[at++] = 0xC6;
        for (int k = 3; k >= 0; k--) {
            o[at++] = (unsigned char)(n >> (8 * k));
        }
    }
    return at;
}

Py_ssize_t
put_bin(unsigned char *o, PyObject *bin)
{
    Py_ssize_t n = PyBytes_GET_SIZE(bin), at = put_bin_header(o, n);
    memcpy(o + at, PyBytes_AS_STRING(bin), (size_t)n);
    return at + n;
}

/* Writes a msgpack fixstr key (under 32 bytes); the bytes written. */
static Py_ssize_t
put_key(unsigned char *o, const char *key)
{
    Py_ssize_t n = (Py_ssize_t)strlen(key);
    o[0] = (unsigned char)(0xA0 | n);
    memcpy(o + 1, key, (size_t)n);
    return 1 + n;
}

Py_ssize_t
put_uint(unsigned char *o, unsigned long long v)
{
    int n = v < 0x80 ? 0 : v <= 0xFF ? 1 : v <= 0xFFFF ? 2 : v <= 0xFFFFFFFFULL ? 4 : 8;
    if (n == 0) {
        o[0] = (unsigned char)v;
        return 1;
    }
    o[0] = n == 1 ? 0xCC : n == 2 ? 0xCD : n == 4 ? 0xCE : 0xCF;
    for (int k = 0; k < n; k++) {
        o[1 + k] = (unsigned char)(v >> (8 * (n - 1 - k)));
    }
    return 1 + n;
}

/* One sparse map of bytes fields, as a _Body or _Map struct encodes: ``keys[k]``
 * holding ``bins[k]`` where it is a non-empty bytes object (an empty one is the
 * default, omitted); ``wide``: the struct has more than 15 fields (a map16 header). */
typedef struct {
    const char *keys[3];
    PyObject *bins[3];
    int count, wide;
} Sparse;

/* 1 when every bin of ``s`` is a bytes object under 4 GiB (its size added to *size),
 * 0 otherwise. */
static int
sparse_ok(const Sparse *s, Py_ssize_t *size)
{
    for (int k = 0; k < s->count; k++) {
        if (!PyBytes_CheckExact(s->bins[k]) || PyBytes_GET_SIZE(s->bins[k]) >= 0xFFFFFFFFLL) {
            return 0;
        }
        *size += 4 + bin_size(s->bins[k]);
    }
    *size += 3;
    return 1;
}

static Py_ssize_t
put_sparse(unsigned char *o, const Sparse *s)
{
    int entries = 0;
    for (int k = 0; k < s->count; k++) {
        entries += PyBytes_GET_SIZE(s->bins[k]) > 0;
    }
    Py_ssize_t at = 0;
    if (s->wide) {
        o[at++] = 0xDE;
        o[at++] = 0;
    }
    o[at++] = (unsigned char)(s->wide ? entries : 0x80 | entries);
    for (int k = 0; k < s->count; k++) {
        if (PyBytes_GET_SIZE(s->bins[k]) > 0) {
            at += put_key(o + at, s->keys[k]);
            at += put_bin(o + at, s->bins[k]);
        }
    }
    return at;
}

/* Bytes put_sparse writes for ``s``. */
static Py_ssize_t
sparse_len(const Sparse *s)
{
    Py_ssize_t n = s->wide ? 3 : 1;
    for (int k = 0; k < s->count; k++) {
        if (PyBytes_GET_SIZE(s->bins[k]) > 0) {
            n += 1 + (Py_ssize_t)strlen(s->keys[k]) + bin_size(s->bins[k]);
        }
    }
    return n;
}

/* The packed fields [2] and [3] of a count_rows / packed_drafts tuple as a Sparse of
 * ``keys``; 0 when ``rows`` is not a tuple of at least four items. */
static int
packed_pair(PyObject *rows, const char *k0, const char *k1, Sparse *s)
{
    if (!PyTuple_CheckExact(rows) || PyTuple_GET_SIZE(rows) < 4) {
        return 0;
    }
    *s = (Sparse){{k0, k1, NULL}, {PyTuple_GET_ITEM(rows, 2), PyTuple_GET_ITEM(rows, 3), NULL},
                  2, 0};
    return 1;
}

/* The body's entries in field order (nt, nc, ba, sp, so, ps, ns, x), as read from the
 * arguments; ``has[]`` says which are present. */
enum { E_NT, E_NC, E_BA, E_SP, E_SO, E_PS, E_NS, E_X, E_COUNT };
static const char *entry_keys[E_COUNT] = {"nt", "nc", "ba", "sp", "so", "ps", "ns", "x"};

/* Writes the Delta frame of lane_frame's checked entries (``size``: an upper bound of
 * its bytes) with the body map compacted as codec.compact_delta_map does. */
static PyObject *
write_frame(const uint64_t *head, const Sparse *rows, const Sparse *ext, const int *has,
            int entries, uint64_t nspec, Py_ssize_t size)
{
    unsigned char *o = PyMem_Malloc((size_t)size);
    if (o == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t at = 2, body;
    o[0] = 0x95; /* [tag, epoch, seq, digest, body] */
    o[1] = 0x04;
    for (int k = 0; k < 3; k++) {
        at += put_uint(o + at, head[k]);
    }
    body = at;
    o[at++] = 0xDE; /* msgspec's map16 header for a DeltaBody, compacted below */
    o[at++] = 0;
    o[at++] = (unsigned char)entries;
    for (int e = 0; e < E_COUNT; e++) {
        if (!has[e]) {
            continue;
        }
        at += put_key(o + at, entry_keys[e]);
        if (e == E_BA) {
            o[at++] = 0x91; /* a tuple of one Rows */
        }
        if (e <= E_SP) {
            at += put_sparse(o + at, &rows[e]);
        } else if (e == E_SO || e == E_PS) {
            o[at++] = 0xC3;
        } else if (e == E_NS) {
            at += put_uint(o + at, nspec);
        } else { /* E_X: {"v": the StepExt's bytes} */
            o[at++] = 0x81;
            at += put_key(o + at, "v");
            at += put_bin_header(o + at, sparse_len(ext));
            at += put_sparse(o + at, ext);
        }
    }
    PyObject *out;
    if (at <= COMPACT_LIMIT) {
        o[body + 2] = (unsigned char)(0x80 | entries);
        out = PyBytes_FromStringAndSize(NULL, at - 2);
        if (out != NULL) {
            memcpy(PyBytes_AS_STRING(out), o, (size_t)body);
            memcpy(PyBytes_AS_STRING(out) + body, o + body + 2, (size_t)(at - body - 2));
        }
    } else {
        out = PyBytes_FromStringAndSize((const char *)o, at);
    }
    PyMem_Free(o);
    return out;
}

/* lane_frame(epoch, seq, digest, computed, scheduled, packed, drafts, outputs, structured,
 * pending, nspec) -> bytes | None: the frame codec.encode writes for the Delta of a
 * same-batch step as same_batch_scan reads it -- ``computed``, ``scheduled`` and
 * ``outputs`` its count_rows (None for none), ``packed`` its one group's appends as
 * packed Rows fields, ``drafts`` its packed_drafts (both None for none), the flags and
 * num_spec_tokens_to_schedule as read.  The body is QuickEncoder's: computed_tokens and
 * scheduled_tokens Rows(handles, values), block_append (Rows(*packed),), spec_tokens
 * Rows(counts, values), the flags, ns when non-zero and extension {"v": StepExt(out_pos,
 * out_delta)} when there are output rows.  None (the objects decide) for anything else:
 * ints out of [0, 2**64), flags that are not bools, fields that are not bytes. */
static PyObject *
lane_frame(PyObject *self, PyObject *args)
{
    PyObject *head_obj[3], *computed, *scheduled, *packed, *drafts, *outputs, *so, *ps, *ns;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOO", &head_obj[0], &head_obj[1], &head_obj[2],
                          &computed, &scheduled, &packed, &drafts, &outputs, &so, &ps, &ns)) {
        return NULL;
    }
    uint64_t head[3], nspec;
    for (int k = 0; k < 3; k++) {
        if (as_u64(head_obj[k], &head[k]) < 0) {
            Py_RETURN_NONE;
        }
    }
    if (as_u64(ns, &nspec) < 0 || !PyBool_Check(so) || !PyBool_Check(ps)) {
        Py_RETURN_NONE;
    }
    Sparse rows[E_COUNT], ext;
    int has[E_COUNT] = {0};
    Py_ssize_t size = 2 + 27 + 3 + 12; /* array and tag, three ints, map16, ns */
    if (scheduled != Py_None && !(has[E_NT] = packed_pair(scheduled, "h", "v", &rows[E_NT]))) {
        Py_RETURN_NONE;
    }
    if (computed != Py_None && !(has[E_NC] = packed_pair(computed, "h", "v", &rows[E_NC]))) {
        Py_RETURN_NONE;
    }
    if (packed != Py_None) {
        if (!PyTuple_CheckExact(packed) || PyTuple_GET_SIZE(packed) != 3) {
            Py_RETURN_NONE;
        }
        rows[E_BA] = (Sparse){{"h", "n", "v"}, {PyTuple_GET_ITEM(packed, 0),
                              PyTuple_GET_ITEM(packed, 1), PyTuple_GET_ITEM(packed, 2)}, 3, 0};
        has[E_BA] = 1;
        size += 1; /* the one-element array */
    }
    if (drafts != Py_None && !(has[E_SP] = packed_pair(drafts, "n", "v", &rows[E_SP]))) {
        Py_RETURN_NONE;
    }
    if (outputs != Py_None) {
        if (!packed_pair(outputs, "op", "od", &ext)) {
            Py_RETURN_NONE;
        }
        ext.wide = 1; /* StepExt has more than 15 fields */
        has[E_X] = 1;
        if (!sparse_ok(&ext, &size)) {
            Py_RETURN_NONE;
        }
        size += 4 + 5 + 5; /* {"v": bin} around it */
    }
    has[E_SO] = so == Py_True;
    has[E_PS] = ps == Py_True;
    has[E_NS] = nspec != 0;
    int entries = 0;
    for (int e = 0; e < E_COUNT; e++) {
        entries += has[e];
        size += has[e] ? 4 : 0;
        if (has[e] && e <= E_SP && !sparse_ok(&rows[e], &size)) {
            Py_RETURN_NONE;
        }
    }
    return write_frame(head, rows, &ext, has, entries, nspec, size);
}

/* ---- the worker's read of such a frame -------------------------------------------- */

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

/* The body's entries into v[V_NT..V_OD] (new references): 1, 0 for a body that is not
 * one lane_frame could write with count rows, -1 with an exception set. */
static int
read_body(Reader *r, PyObject **v)
{
    static const char *const keys[E_COUNT] = {"nt", "nc", "ba", "sp", "so", "ps", "ns", "x"};
    Py_ssize_t entries = read_map(r);
    int last = -1, got = 1;
    for (Py_ssize_t e = 0; got == 1 && e < entries; e++) {
        int k = read_key(r, keys, E_COUNT);
        if (k <= last || (e == 0 && k > E_NC)) { /* (no count rows: the first key says) */
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
    return entries >= 0 && (v[V_NT] != NULL || v[V_NC] != NULL);
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
 * frame lane_frame could write, without the objects -- a body of count rows
 * (computed_tokens or scheduled_tokens), at most the same-batch step's other fields and
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

PyMethodDef frame_methods[] = {
    {"lane_frame", lane_frame, METH_VARARGS,
     "The frame of a same-batch step's Delta with count rows, written without the objects "
     "(None: not taken)."},
    {"lane_view", lane_view, METH_O,
     "The worker's read of such a frame, without the objects (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
