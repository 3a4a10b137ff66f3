/* Optional C version of the steady lane's count plan (protocol.lane.SteadyLane.
 * _plan_counts): the digest change of a step's computed-count corrections and changed
 * scheduled counts, the new scheduled counts and the next advance term, in one call;
 * and of the lane's whole step of such rows with one KV group's appends
 * (SteadyLane._counted: both plans, the digest check and the commit).
 *
 * Contract: as protocol/_speedups.c -- the same answer as the Python lines for every
 * input it accepts, None for every input it does not (the Python path then decides,
 * refusals included); tests/test_speedups_digest.py and tests/test_lane.py hold the two
 * together.
 */
#include "_speedups.h"

#define COUNT_LIMIT (1LL << 62) /* protocol.lane._COUNT_LIMIT */

/* 0 and list[i] as an int64 for 0 <= i < size of an exact list; -1 otherwise. */
static int
item_at(PyObject *list, long long i, long long *out)
{
    if (i < 0 || i >= PyList_GET_SIZE(list)) {
        return -1;
    }
    return as_i64(PyList_GET_ITEM(list, (Py_ssize_t)i), out);
}

/* 0 and keys[i] for 0 <= i < size; -1 otherwise. */
static int
key_at(PyObject *keys, long long i, uint64_t *out)
{
    if (i < 0 || i >= PyList_GET_SIZE(keys)) {
        return -1;
    }
    return as_u64(PyList_GET_ITEM(keys, (Py_ssize_t)i), out);
}

/* The computed corrections' term: sum(moves[j] * keys[at[j]]) mod 2**64, each
 * corrected count comp[p] + ns[p] + move in [0, COUNT_LIMIT); -1 when not taken. */
static int
computed_term(PyObject *comp, PyObject *ns, PyObject *keys, PyObject *at, PyObject *moves,
              uint64_t *change)
{
    Py_ssize_t n = PyList_GET_SIZE(at);
    if (PyList_GET_SIZE(moves) != n) {
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        long long p, d, c, s;
        uint64_t key;
        if (as_i64(PyList_GET_ITEM(at, j), &p) < 0 || as_i64(PyList_GET_ITEM(moves, j), &d) < 0
                || item_at(comp, p, &c) < 0 || item_at(ns, p, &s) < 0 || key_at(keys, p, &key) < 0
                || c < -COUNT_LIMIT || c > COUNT_LIMIT || s < 0 || s > COUNT_LIMIT
                || d < -COUNT_LIMIT || d > COUNT_LIMIT) {
            return -1;
        }
        long long after = c + s + d; /* |each| <= 2**62: no overflow */
        if (after < 0 || after >= COUNT_LIMIT) {
            return -1;
        }
        *change += (uint64_t)d * key;
    }
    return 0;
}

/* The changed scheduled counts: ns with values at pos (a new list in *nsched, or NULL
 * when nothing changes) and their terms added to *change and *advance; -1 when not
 * taken, -2 with an exception set. */
static int
scheduled_terms(PyObject *ns, PyObject *keys, PyObject *skeys, PyObject *pos, PyObject *values,
                uint64_t *change, uint64_t *advance, PyObject **nsched)
{
    Py_ssize_t n = PyList_GET_SIZE(pos);
    *nsched = NULL;
    if (PyList_GET_SIZE(values) != n) {
        return -1;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        long long p, v, before;
        uint64_t key, skey;
        if (as_i64(PyList_GET_ITEM(pos, j), &p) < 0 || as_i64(PyList_GET_ITEM(values, j), &v) < 0
                || v < 0 || v >= COUNT_LIMIT || item_at(ns, p, &before) < 0
                || before < 0 || before >= COUNT_LIMIT
                || key_at(keys, p, &key) < 0 || key_at(skeys, p, &skey) < 0) {
            Py_CLEAR(*nsched);
            return -1;
        }
        if (v == before) {
            continue; /* adds zero terms */
        }
        if (*nsched == NULL && (*nsched = PyList_GetSlice(ns, 0, PyList_GET_SIZE(ns))) == NULL) {
            return -2;
        }
        PyObject *item = PyList_GET_ITEM(values, j);
        Py_INCREF(item);
        PyList_SetItem(*nsched, (Py_ssize_t)p, item); /* a repeated position: the last wins */
        *change += (uint64_t)(v - before) * skey;
        *advance += (uint64_t)(v - before) * key;
    }
    return 0;
}

/* plan_counts(comp, ns, keys, at, moves, pos, values, skeys, advance) -> (change,
 * nsched | None, advance) | None: SteadyLane._plan_counts on lists -- ``comp`` the
 * computed counts and ``ns`` the scheduled counts by position, ``keys`` and ``skeys``
 * the computed and scheduled terms' multipliers, (``at``, ``moves``) the computed
 * corrections, (``pos``, ``values``) the scheduled counts sent; the change and the
 * advance mod 2**64; nsched a new list, None when no count changes.  None for anything
 * it does not take (positions out of range, counts past 2**62, ...). */
static PyObject *
plan_counts(PyObject *self, PyObject *args)
{
    PyObject *comp, *ns, *keys, *at, *moves, *pos, *values, *skeys, *nsched = NULL;
    unsigned long long advance;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!K", &PyList_Type, &comp, &PyList_Type, &ns,
                          &PyList_Type, &keys, &PyList_Type, &at, &PyList_Type, &moves,
                          &PyList_Type, &pos, &PyList_Type, &values, &PyList_Type, &skeys,
                          &advance)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    uint64_t change = 0, next = advance;
    if (computed_term(comp, ns, keys, at, moves, &change) < 0) {
        Py_RETURN_NONE;
    }
    int got = scheduled_terms(ns, keys, skeys, pos, values, &change, &next, &nsched);
    if (got == -2) {
        return NULL;
    }
    if (got == -1) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(KNK)", (unsigned long long)change, nsched ? nsched : Py_NewRef(Py_None),
                         (unsigned long long)next);
}

/* 1 when the exact ints of ``pos`` are distinct positions in [0, n); 0 otherwise (-1
 * with an exception set).  ``seen``: n zeroed bytes, left dirty. */
static int
distinct(PyObject *pos, Py_ssize_t n, unsigned char *seen)
{
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(pos); j++) {
        long long p;
        if (as_i64(PyList_GET_ITEM(pos, j), &p) < 0 || p < 0 || p >= n || seen[p]++) {
            return 0;
        }
    }
    return 1;
}

/* Whether the count rows (at, moves) and (pos, values) are lists with distinct
 * positions in [0, n) (SteadyLane's LaneRows.fits of the count rows): 1, 0, or -1 with
 * an exception set. */
static int
rows_fit(PyObject *at, PyObject *moves, PyObject *pos, PyObject *values, Py_ssize_t n)
{
    if (PyList_GET_SIZE(at) != PyList_GET_SIZE(moves)
            || PyList_GET_SIZE(pos) != PyList_GET_SIZE(values)) {
        return 0;
    }
    unsigned char *seen = PyMem_Calloc((size_t)(n ? 2 * n : 1), 1);
    if (seen == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int fit = distinct(at, n, seen) && distinct(pos, n, seen + n);
    PyMem_Free(seen);
    return fit;
}

/* ``comp`` advanced by ``ns`` with moves[j] added at at[j]: a new list (NULL with an
 * exception set); the values were checked by computed_term. */
static PyObject *
advanced(PyObject *comp, PyObject *ns, PyObject *at, PyObject *moves)
{
    Py_ssize_t n = PyList_GET_SIZE(comp);
    long long stack[256], *v = n <= 256 ? stack : PyMem_Malloc(sizeof(long long) * (size_t)n);
    if (v == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long c, s;
        if (as_i64(PyList_GET_ITEM(comp, i), &c) < 0 || as_i64(PyList_GET_ITEM(ns, i), &s) < 0
                || __builtin_add_overflow(c, s, &v[i])) {
            goto done; /* out stays NULL: the caller refuses before any change */
        }
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(at); j++) {
        long long p = 0, d = 0;
        as_i64(PyList_GET_ITEM(at, j), &p);
        as_i64(PyList_GET_ITEM(moves, j), &d);
        v[p] += d; /* |each| <= 2**62 after computed_term's checks */
    }
    if ((out = PyList_New(n)) == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyLong_FromLongLong(v[i]);
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, item);
    }
done:
    if (v != stack) {
        PyMem_Free(v);
    }
    return out;
}

/* extra[at[j]] += moves[j] (positions checked by computed_term); 0, or -1 with an
 * exception set. */
static int
add_moves(PyObject *extra, PyObject *at, PyObject *moves)
{
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(at); j++) {
        long long p = 0, d = 0, e;
        as_i64(PyList_GET_ITEM(at, j), &p);
        as_i64(PyList_GET_ITEM(moves, j), &d);
        if (p >= PyList_GET_SIZE(extra)) {
            continue; /* not reached: the caller checked the lengths */
        }
        PyObject *sum = as_i64(PyList_GET_ITEM(extra, p), &e) == 0
            && !__builtin_add_overflow(e, d, &e) ? PyLong_FromLongLong(e)
            : PyNumber_Add(PyList_GET_ITEM(extra, p), PyList_GET_ITEM(moves, j));
        if (sum == NULL) {
            return -1;
        }
        PyList_SetItem(extra, p, sum); /* steals sum */
    }
    return 0;
}

/* lane_counts(comp, ns, keys, at, moves, pos, values, skeys, advance, extra, appends,
 * handles, lengths, salt, k_block, k_pos, k_handle, check, base, expected) -> (digest,
 * nsched | None, advance, plan | None, comp | None) | int | None: the steady lane's
 * step of a body with count rows and at most one KV group's appends
 * (protocol.lane.SteadyLane.step) in one call -- plan_counts of the count rows, plan_rows
 * of ``appends`` ((positions, counts, ids), None for none), the digest base + advance +
 * both changes mod 2**64 and, when it is ``expected`` (None: anything), the commit:
 * lengths grown by the appends, extra[at[j]] += moves[j], and a new ``comp`` (None: the
 * lane keeps none) advanced by ``ns`` and moved.  ``check``: the rows' positions are
 * also checked distinct (LaneRows.fits of the count rows) and the appends' as plan_rows
 * checks them.  An int: the digest, which differs from ``expected``; None: not taken;
 * both change nothing (the Python path decides). */
PyObject *
lane_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *comp, *ns, *keys, *at, *moves, *pos, *values, *skeys, *extra, *appends, *expected;
    PyObject *nsched = NULL, *plan = NULL, *digest = NULL, *made = NULL;
    unsigned long long advance, base;
    PlanArgs a;
    if (fast_args(args, nargs, "OO!O!O!O!O!O!O!KO!OOOKKKKpKO", &comp, &PyList_Type, &ns,
                          &PyList_Type, &keys, &PyList_Type, &at, &PyList_Type, &moves,
                          &PyList_Type, &pos, &PyList_Type, &values, &PyList_Type, &skeys,
                          &advance, &PyList_Type, &extra, &appends, &a.handles, &a.lengths,
                          &a.salt, &a.k_block, &a.k_pos, &a.k_handle, &a.check, &base,
                          &expected) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(ns);
    int fit = a.check ? rows_fit(at, moves, pos, values, n) : 1;
    if (fit < 0) {
        return NULL;
    }
    int has_comp = PyList_CheckExact(comp);
    if (!fit || PyList_GET_SIZE(extra) != n || (has_comp && PyList_GET_SIZE(comp) != n)
            || (!has_comp && (comp != Py_None || PyList_GET_SIZE(at) != 0))) {
        Py_RETURN_NONE;
    }
    uint64_t change = 0, next = advance, total = 0;
    if (computed_term(has_comp ? comp : ns, ns, keys, at, moves, &change) < 0) {
        Py_RETURN_NONE; /* (no rows without a comp: ns stands in, unread) */
    }
    int got = scheduled_terms(ns, keys, skeys, pos, values, &change, &next, &nsched);
    if (got < 0) {
        return got == -2 ? NULL : Py_NewRef(Py_None);
    }
    if (appends != Py_None) {
        if (!PyTuple_CheckExact(appends) || PyTuple_GET_SIZE(appends) != 3) {
            Py_XDECREF(nsched);
            Py_RETURN_NONE;
        }
        a.pos = PyTuple_GET_ITEM(appends, 0);
        a.counts = PyTuple_GET_ITEM(appends, 1);
        a.ids = PyTuple_GET_ITEM(appends, 2);
        if ((plan = plan_lists(&a, &total)) == NULL || plan == Py_None) {
            Py_XDECREF(nsched);
            return plan;
        }
    }
    uint64_t sum = (uint64_t)base + (uint64_t)advance + change + total;
    if ((digest = PyLong_FromUnsignedLongLong((unsigned long long)sum)) == NULL) {
        goto fail;
    }
    int same = expected == Py_None ? 1 : PyObject_RichCompareBool(digest, expected, Py_EQ);
    if (same < 0) {
        goto fail;
    }
    if (!same) {
        Py_XDECREF(nsched);
        Py_XDECREF(plan);
        return digest;
    }
    if (has_comp && (made = advanced(comp, ns, at, moves)) == NULL) {
        if (PyErr_Occurred()) {
            goto fail;
        }
        Py_XDECREF(nsched);
        Py_XDECREF(plan);
        Py_DECREF(digest);
        Py_RETURN_NONE;
    }
    if ((plan != NULL && grow_lengths(&a) < 0) || add_moves(extra, at, moves) < 0) {
        goto fail; /* memory only, after the checks */
    }
    return Py_BuildValue("(NNKNN)", digest, nsched ? nsched : Py_NewRef(Py_None),
                         (unsigned long long)next, plan ? plan : Py_NewRef(Py_None),
                         made ? made : Py_NewRef(Py_None));
fail:
    Py_XDECREF(nsched);
    Py_XDECREF(plan);
    Py_XDECREF(digest);
    Py_XDECREF(made);
    return NULL;
}

PyMethodDef lane_methods[] = {
    {"plan_counts", plan_counts, METH_VARARGS,
     "The steady lane's count plan: change, new scheduled counts, advance (None: not taken)."},
    {"lane_counts", (PyCFunction)(void (*)(void))lane_counts, METH_FASTCALL,
     "The steady lane's step of count rows and one group's appends, planned and committed "
     "(None: not taken)."},
    {NULL, NULL, 0, NULL},
};
