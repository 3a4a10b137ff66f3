/* Optional C version of the steady lane's count plan (protocol.lane.SteadyLane.
 * _plan_counts): the digest change of a step's computed-count corrections and changed
 * scheduled counts, the new scheduled counts and the next advance term, in one call.
 *
 * Contract: as protocol/_speedups.c -- the same answer as the Python lines for every
 * input it accepts, None for every input it does not (the Python path then decides,
 * refusals included); tests/test_speedups.py and tests/test_lane.py hold the two
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

PyMethodDef lane_methods[] = {
    {"plan_counts", plan_counts, METH_VARARGS,
     "The steady lane's count plan: change, new scheduled counts, advance (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
