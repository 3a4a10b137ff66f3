/* Optional C versions of the digest's terms (protocol/digest.py): the per-row block
 * terms (unit_terms), the linear count terms and their keys (keyed_sum, key_list, dot),
 * aligned adds (add_at), and the steady lane's one-group appends planned and committed
 * (plan_rows, lane_append; protocol/lane.py).
 *
 * Contract: as protocol/_speedups.c -- exactly the Python reference's answer for the
 * inputs taken, None for any other (the Python path then decides); sums are mod 2**64.
 * tests/test_speedups_digest.py holds the two together.
 */
#include "_speedups.h"

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

PyMethodDef digest_methods[] = {
    {"unit_terms", unit_terms, METH_VARARGS,
     "protocol.digest.block_unit_terms in C (None: not taken)."},
    {"add_at", add_at, METH_VARARGS, "target[p] += c for aligned pairs, all or nothing."},
    {"dot", dot, METH_VARARGS, "sum(values[j] * keys[at[j]]) mod 2**64 (None: not taken)."},
    {"keyed_sum", keyed_sum, METH_VARARGS,
     "The digest's linear count terms summed over two lists (None: not taken)."},
    {"key_list", key_list, METH_VARARGS,
     "The keys keyed_sum multiplies by, as a list (None: not taken)."},
    {"plan_rows", plan_rows, METH_VARARGS,
     "The steady lane's plan of one group's appends (None: not taken)."},
    {"lane_append", lane_append, METH_VARARGS,
     "The steady lane's one-group append: plan, digest and lengths (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
