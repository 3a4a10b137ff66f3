/* The engine's frame of a same-batch step with count or draft rows, written without the
 * objects: lane_frame (the worker reads it with _speedups_view.c's lane_view); a plain
 * step's frame (plain_delta; plain_frame tells one on the worker) and a frame's body map
 * header in its shortest form (compact_map).  The bytes
 * are exactly those codec.encode writes for the Delta the general lines make (msgspec's
 * field order, defaults omitted, map16 headers for the
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

const char *const entry_keys[E_COUNT] = {"nt", "nc", "ba", "sp", "so", "ps", "ns", "x"};

Py_ssize_t
put_delta_head(unsigned char *o, const uint64_t *head, int entries)
{
    Py_ssize_t at = 2;
    o[0] = 0x95; /* [tag, epoch, seq, digest, body] */
    o[1] = 0x04;
    for (int k = 0; k < 3; k++) {
        at += put_uint(o + at, head[k]);
    }
    o[at++] = 0xDE; /* msgspec's map16 header for a DeltaBody (delta_frame compacts it) */
    o[at++] = 0;
    o[at++] = (unsigned char)entries;
    return at;
}

PyObject *
delta_frame(unsigned char *o, Py_ssize_t at, Py_ssize_t body, int entries)
{
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
    Py_ssize_t at = put_delta_head(o, head, entries), body = at - 3;
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
    return delta_frame(o, at, body, entries);
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
lane_frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *head_obj[3], *computed, *scheduled, *packed, *drafts, *outputs, *so, *ps, *ns;
    if (fast_args(args, nargs, "OOOOOOOOOOO", &head_obj[0], &head_obj[1], &head_obj[2],
                          &computed, &scheduled, &packed, &drafts, &outputs, &so, &ps, &ns) < 0) {
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

/* The offset of a Delta frame's body map: past the array header byte and four msgpack
 * ints (tag, epoch, seq, digest); len or more when the frame ends before it. */
static Py_ssize_t
body_offset(const unsigned char *b, Py_ssize_t len)
{
    Py_ssize_t at = 1;
    for (int k = 0; k < 4 && at < len; k++) {
        unsigned char h = b[at];
        at += h == 0xCC || h == 0xD0 ? 2 : h == 0xCD || h == 0xD1 ? 3
            : h == 0xCE || h == 0xD2 ? 5 : h == 0xCF || h == 0xD3 ? 9 : 1;
    }
    return at;
}

/* plain_frame(frame: bytes) -> bool: protocol.codec.may_be_plain -- the frame of a Delta
 * whose body map is empty or opens with one of the plain fields' keys ("ba", "so",
 * "ps"; keys come in field order and every other field but two precedes them).  False
 * for anything else, a frame too short to tell included; never raises. */
static PyObject *
plain_frame(PyObject *self, PyObject *frame)
{
    if (!PyBytes_CheckExact(frame)) {
        Py_RETURN_FALSE;
    }
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(frame);
    Py_ssize_t len = PyBytes_GET_SIZE(frame), at = body_offset(b, len);
    if (at >= len) {
        Py_RETURN_FALSE;
    }
    unsigned char h = b[at];
    Py_ssize_t n = (h & 0xF0) == 0x80 ? h & 0x0F : -1;
    if (h == 0xDE && at + 2 < len) { /* map16: msgspec's header for a DeltaBody */
        n = (Py_ssize_t)b[at + 1] << 8 | b[at + 2];
        at += 2;
    }
    if (n == 0) {
        Py_RETURN_TRUE;
    }
    if (n < 0 || at + 3 >= len || b[at + 1] != 0xA2) {
        Py_RETURN_FALSE;
    }
    const unsigned char *key = b + at + 2;
    return PyBool_FromLong((key[0] == 'b' && key[1] == 'a') || (key[0] == 's' && key[1] == 'o')
                           || (key[0] == 'p' && key[1] == 's'));
}

/* Writes the map entry ``key: bin`` of a non-empty bytes object; the bytes written. */
static Py_ssize_t
put_bin_entry(unsigned char *o, char key, PyObject *bin)
{
    o[0] = 0xA1;
    o[1] = (unsigned char)key;
    return 2 + put_bin(o + 2, bin);
}

/* plain_delta(epoch, seq, digest, handles, counts, values, structured, pending) -> bytes
 * | None: protocol.codec.plain_delta_frame -- the frame codec.encode writes for
 * Delta(epoch, seq, digest, DeltaBody(block_append=(Rows(handles, counts, values),),
 * has_structured_output=structured, pending_structured_output=pending)), without
 * making the objects.  None unless the three ints are in [0, 2**64), the Rows fields
 * bytes objects under 4 GiB, and the flags bools. */
static PyObject *
plain_delta(PyObject *self, PyObject *args)
{
    uint64_t head[3];
    PyObject *ints[3], *rows[3], *s, *p;
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &ints[0], &ints[1], &ints[2], &rows[0], &rows[1],
                          &rows[2], &s, &p) || !PyBool_Check(s) || !PyBool_Check(p)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    /* all but the Rows' bytes: at most array and tag 2, ints 27, map16 3, "ba" and its
     * array 4, the Rows map 1, three keys and bin headers 21, two flags 8 */
    Py_ssize_t size = 66, fields = 0;
    for (int k = 0; k < 3; k++) {
        if (!PyLong_CheckExact(ints[k]) || !PyBytes_CheckExact(rows[k])) {
            Py_RETURN_NONE;
        }
        head[k] = PyLong_AsUnsignedLongLong(ints[k]); /* all ones: 2**64 - 1, or an error */
        if (head[k] == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (PyBytes_GET_SIZE(rows[k]) >= 0xFFFFFFFFLL) {
            Py_RETURN_NONE;
        }
        size += PyBytes_GET_SIZE(rows[k]);
        fields += PyBytes_GET_SIZE(rows[k]) > 0;
    }
    unsigned char *o = PyMem_Malloc((size_t)size);
    if (o == NULL) {
        return PyErr_NoMemory();
    }
    int entries = 1 + (s == Py_True) + (p == Py_True);
    Py_ssize_t at = put_delta_head(o, head, entries), body = at - 3;
    static const unsigned char ba[4] = {0xA2, 'b', 'a', 0x91}, so[4] = {0xA2, 's', 'o', 0xC3},
                               ps[4] = {0xA2, 'p', 's', 0xC3}; /* keys; [1 Rows]; true */
    memcpy(o + at, ba, 4);
    at += 4;
    o[at++] = (unsigned char)(0x80 | fields);
    const char keys[3] = {'h', 'n', 'v'};
    for (int k = 0; k < 3; k++) {
        if (PyBytes_GET_SIZE(rows[k]) > 0) {
            at += put_bin_entry(o + at, keys[k], rows[k]);
        }
    }
    if (s == Py_True) {
        memcpy(o + at, so, 4);
        at += 4;
    }
    if (p == Py_True) {
        memcpy(o + at, ps, 4);
        at += 4;
    }
    return delta_frame(o, at, body, entries);
}

/* compact_map(frame: bytes) -> bytes: protocol.codec.compact_delta_map (the frame itself
 * when it has nothing to compact, or is not the frame of a Delta it can read). */
static PyObject *
compact_map(PyObject *self, PyObject *frame)
{
    if (!PyBytes_CheckExact(frame) || PyBytes_GET_SIZE(frame) > 1024) {
        return Py_NewRef(frame);
    }
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(frame);
    Py_ssize_t len = PyBytes_GET_SIZE(frame), at = body_offset(b, len);
    if (at + 2 >= len || b[at] != 0xDE || b[at + 1] != 0 || b[at + 2] > 15) {
        return Py_NewRef(frame);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, len - 2);
    if (out == NULL) {
        return NULL;
    }
    char *o = PyBytes_AS_STRING(out);
    memcpy(o, b, (size_t)at);
    o[at] = (char)(0x80 | b[at + 2]);
    memcpy(o + at + 1, b + at + 3, (size_t)(len - at - 3));
    return out;
}

PyMethodDef frame_methods[] = {
    {"plain_delta", plain_delta, METH_VARARGS,
     "The frame of a plain step's Delta, written without the objects (None: not taken)."},
    {"plain_frame", plain_frame, METH_O,
     "Whether a Delta frame's body may be a plain step's (its first key)."},
    {"compact_map", compact_map, METH_O,
     "A Delta frame with its body map's header in the shortest form."},
    {"lane_frame", (PyCFunction)(void (*)(void))lane_frame, METH_FASTCALL,
     "The frame of a same-batch step's Delta with count or draft rows, written without the "
     "objects "
     "(None: not taken)."},
    {NULL, NULL, 0, NULL},
};
