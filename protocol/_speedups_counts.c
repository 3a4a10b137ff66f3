/* Optional C versions of a same-batch step's count rows (the step of speculative
 * decoding: accepted drafts move the computed counts, new drafts the scheduled ones,
 * every step).  Engine: the departures from the forecast, packed (count_rows; reference
 * engine_side.vllm.quick.count_rows_py).  Worker: a lane body's rows unpacked
 * (lane_rows; reference protocol.lane.lane_rows's lines) and the counts made from them
 * (count_lists; reference worker_side.vllm.quick.count_lists_py).  _speedups_fused.c
 * calls the first and the last inside its one-call steps.
 *
 * Contract: as protocol/_speedups.c -- each function returns exactly what its Python
 * reference returns for the inputs it accepts and None for every input it does not
 * accept (the caller then runs the Python path, refusals included);
 * tests/test_speedups_counts.py holds the two together, its speculative streams
 * included (every step against the general path's frames, with and without C).
 */
#include "_speedups.h"

#define STACK_ROWS 256 /* batches up to this size need no heap scratch */

/* A batch's int64 columns, read once: on the stack for small batches. */
typedef struct {
    long long stack[6 * STACK_ROWS];
    long long *v;
    Py_ssize_t n;
} Columns;

/* Reads ``k`` exact lists of n int64-range ints into c->v (column j at c->v + j * n); 0,
 * or -1 when one is not such a list (-2 with an exception set). */
static int
read_columns(Columns *c, PyObject **lists, int k, Py_ssize_t n)
{
    c->n = n;
    c->v = n <= STACK_ROWS ? c->stack : PyMem_Malloc(sizeof(long long) * (size_t)(k * n));
    if (c->v == NULL) {
        PyErr_NoMemory();
        return -2;
    }
    for (int j = 0; j < k; j++) {
        if (!PyList_CheckExact(lists[j]) || PyList_GET_SIZE(lists[j]) != n) {
            return -1;
        }
        long long *col = c->v + j * n;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (as_i64(PyList_GET_ITEM(lists[j], i), &col[i]) < 0) {
                return -1;
            }
        }
    }
    return 0;
}

static void
free_columns(Columns *c)
{
    if (c->v != NULL && c->v != c->stack) {
        PyMem_Free(c->v);
    }
}

/* A list of the ``n`` values as Python ints (NULL with an exception set). */
static PyObject *
int_list(const long long *values, Py_ssize_t n)
{
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *item = PyLong_FromLongLong(values[i]);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* (positions, values, packed positions, packed values) of the k rows at[0..k) ->
 * values[0..k); the values packed zig-zag when ``zigzag``; ``u`` scratch for 2 * k
 * values.  NULL with an exception. */
static PyObject *
row_set(const long long *at, const long long *values, Py_ssize_t k, int zigzag, uint64_t *u)
{
    for (Py_ssize_t j = 0; j < k; j++) {
        long long v = values[j];
        u[j] = (uint64_t)at[j];
        u[k + j] = !zigzag ? (uint64_t)v
                   : v >= 0 ? (uint64_t)v << 1 : (((uint64_t)(-(v + 1))) << 1) + 1;
    }
    return Py_BuildValue("(NNNN)", int_list(at, k), int_list(values, k), pack_values(u, k),
                         pack_values(u + k, k));
}

/* count_rows(computed, outputs, basis, nsched_before, nsched, plen_less_one) ->
 * (computed rows | None, scheduled rows | None, output rows | None, computed copy) | None:
 * a same-batch step's count exceptions against the forecast, as engine_side.vllm.
 * quick.count_rows_py -- computed rows where computed[i] != basis[i] + nsched_before[i]
 * (values: the signed move; None when none), scheduled rows where nsched[i] != nsched_before[i] (None
 * when none), output rows where outputs[i] != max(computed[i] - plen_less_one[i], 0)
 * (the signed move; None when none); each rows (positions, values, packed positions,
 * packed values, zig-zag for signed).  None unless six equally long lists of
 * int64-range ints, counts whose forecasts stay in range, a moved computed count >= 0
 * and scheduled counts >= 0 (the Python path decides, refusals included). */
PyObject *
count_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *lists[6];
    if (fast_args(args, nargs, "OOOOOO", &lists[0], &lists[1], &lists[2], &lists[3],
                          &lists[4], &lists[5]) || !PyList_CheckExact(lists[0])) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(lists[0]);
    Columns c = {.v = NULL};
    int got = read_columns(&c, lists, 6, n);
    PyObject *result = NULL, *rows[3] = {NULL, NULL, NULL};
    if (got < 0) {
        result = got == -1 ? Py_NewRef(Py_None) : NULL;
        goto finish;
    }
    const long long *comp = c.v, *outs = c.v + n, *basis = c.v + 2 * n, *before = c.v + 3 * n,
                    *ns = c.v + 4 * n, *plm1 = c.v + 5 * n;
    /* scratch: positions and values of the three row sets, 2 * n each, then row_set's */
    long long *scratch = PyMem_Malloc(sizeof(long long) * 8 * (size_t)(n ? n : 1));
    uint64_t *u = (uint64_t *)(scratch + 6 * n);
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto finish;
    }
    Py_ssize_t k[3] = {0, 0, 0};
    int taken = 1;
    for (Py_ssize_t i = 0; taken && i < n; i++) {
        long long want, out;
        taken = !__builtin_add_overflow(basis[i], before[i], &want)
                && !__builtin_sub_overflow(comp[i], plm1[i], &out) && ns[i] >= 0
                && !__builtin_sub_overflow(comp[i], want, &want);
        if (!taken) {
            break;
        }
        if (want != 0) { /* want: the move now */
            taken = comp[i] >= 0;
            scratch[k[0]] = i;
            scratch[n + k[0]++] = want;
        }
        if (ns[i] != before[i]) {
            scratch[2 * n + k[1]] = i;
            scratch[3 * n + k[1]++] = ns[i];
        }
        out = out > 0 ? out : 0;
        if (outs[i] != out) {
            taken = taken && !__builtin_sub_overflow(outs[i], out, &out);
            scratch[4 * n + k[2]] = i;
            scratch[5 * n + k[2]++] = out;
        }
    }
    if (!taken) {
        result = Py_NewRef(Py_None);
    } else if ((rows[0] = k[0] ? row_set(scratch, scratch + n, k[0], 1, u)
                               : Py_NewRef(Py_None)) != NULL
               && (rows[1] = k[1] ? row_set(scratch + 2 * n, scratch + 3 * n, k[1], 0, u)
                               : Py_NewRef(Py_None)) != NULL
               && (rows[2] = k[2] ? row_set(scratch + 4 * n, scratch + 5 * n, k[2], 1, u)
                               : Py_NewRef(Py_None)) != NULL) {
        PyObject *copy = PyList_GetSlice(lists[0], 0, n);
        result = copy == NULL ? NULL : Py_BuildValue("(OOON)", rows[0], rows[1], rows[2], copy);
    }
    PyMem_Free(scratch);
finish:
    for (int j = 0; j < 3; j++) {
        Py_XDECREF(rows[j]);
    }
    free_columns(&c);
    return result;
}

/* The list unpack_bytes makes of ``packed`` (``mode``: its zigzag; b"": an empty list):
 * a new reference, Py_None when not taken, NULL with an exception set. */
static PyObject *
unpacked_or_empty(PyObject *packed, int mode)
{
    if (PyBytes_CheckExact(packed) && PyBytes_GET_SIZE(packed) == 0) {
        return PyList_New(0);
    }
    return unpack_bytes(packed, mode);
}

/* Adds values[j] to col[at[j]] for the rows of two equally long lists; 0, or -1 when
 * they are not such lists or a position is outside [0, n). */
static int
add_rows(long long *col, Py_ssize_t n, PyObject *at, PyObject *values)
{
    if (!PyList_CheckExact(at) || !PyList_CheckExact(values)
            || PyList_GET_SIZE(at) != PyList_GET_SIZE(values)) {
        return -1;
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(at); j++) {
        long long p, d;
        if (as_i64(PyList_GET_ITEM(at, j), &p) < 0 || p < 0 || p >= n
                || as_i64(PyList_GET_ITEM(values, j), &d) < 0
                || __builtin_add_overflow(col[p], d, &col[p])) {
            return -1;
        }
    }
    return 0;
}

/* Sets col[at[j]] = values[j] for the rows of two equally long lists of counts in
 * [0, 2**62); 0, or -1 as add_rows. */
static int
set_rows(long long *col, Py_ssize_t n, PyObject *at, PyObject *values)
{
    if (!PyList_CheckExact(at) || !PyList_CheckExact(values)
            || PyList_GET_SIZE(at) != PyList_GET_SIZE(values)) {
        return -1;
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(at); j++) {
        long long p, v;
        if (as_i64(PyList_GET_ITEM(at, j), &p) < 0 || p < 0 || p >= n
                || as_i64(PyList_GET_ITEM(values, j), &v) < 0 || v < 0 || v >= (1LL << 62)) {
            return -1;
        }
        col[p] = v;
    }
    return 0;
}

/* The pair (positions, values) of a count rows argument: 1 and both lists, 0 for None,
 * -1 for anything else. */
static int
rows_arg(PyObject *rows, PyObject **at, PyObject **values)
{
    if (rows == Py_None) {
        return 0;
    }
    if (!PyTuple_CheckExact(rows) || PyTuple_GET_SIZE(rows) != 2) {
        return -1;
    }
    *at = PyTuple_GET_ITEM(rows, 0);
    *values = PyTuple_GET_ITEM(rows, 1);
    return 1;
}

/* count_lists(basis, nsched_before, plen_less_one, computed_rows, scheduled_rows,
 * out_pos, out_delta, batch, nsched_map) -> (computed, outputs, nsched | None, computed
 * copy) | None: the worker's counts of a same-batch step with count rows, as
 * worker_side.vllm.quick.count_lists_py -- computed = basis + nsched_before with the
 * computed rows' moves added, outputs = max(computed - plen_less_one, 0) with the
 * packed output moves added, nsched = nsched_before with the scheduled rows' counts
 * (None when there are none), each such count also written to nsched_map under its
 * request's id in ``batch``.  Rows are (positions, values) pairs of lists or None.
 * None, nothing changed, unless the lists are equally long lists of int64-range ints,
 * positions are in range, counts stay in int64 and the packed rows unpack. */
PyObject *
count_lists(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *lists[3], *crows, *srows, *opos, *odelta, *batch, *names;
    PyObject *cat = NULL, *cmoves = NULL, *sat = NULL, *svalues = NULL;
    if (fast_args(args, nargs, "OOOOOOOO!O!", &lists[0], &lists[1], &lists[2], &crows, &srows,
                          &opos, &odelta, &PyList_Type, &batch, &PyDict_Type, &names)) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(batch);
    int has_c = rows_arg(crows, &cat, &cmoves), has_s = rows_arg(srows, &sat, &svalues);
    PyObject *out_at = NULL, *out_moves = NULL, *result = NULL, *made[3] = {NULL, NULL, NULL};
    Columns c = {.v = NULL};
    int got = has_c < 0 || has_s < 0 ? -1 : read_columns(&c, lists, 3, n);
    if (got == 0) {
        out_at = unpacked_or_empty(opos, RAW);
        out_moves = out_at == NULL || out_at == Py_None ? NULL
                    : unpacked_or_empty(odelta, SIGNED);
        got = out_at == NULL || (out_at != Py_None && out_moves == NULL) ? -2
              : out_at == Py_None || out_moves == Py_None ? -1 : 0;
    }
    if (got < 0) {
        result = got == -1 ? Py_NewRef(Py_None) : NULL;
        goto finish;
    }
    long long *comp = c.v, *ns = c.v + n, *plm1 = c.v + 2 * n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (__builtin_add_overflow(comp[i], ns[i], &comp[i])) {
            result = Py_NewRef(Py_None);
            goto finish;
        }
    }
    if (has_c && add_rows(comp, n, cat, cmoves) < 0) {
        result = Py_NewRef(Py_None);
        goto finish;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* plm1 becomes the outputs */
        long long o;
        if (__builtin_sub_overflow(comp[i], plm1[i], &o)) {
            result = Py_NewRef(Py_None);
            goto finish;
        }
        plm1[i] = o > 0 ? o : 0;
    }
    if (add_rows(plm1, n, out_at, out_moves) < 0 || (has_s && set_rows(ns, n, sat, svalues) < 0)) {
        result = Py_NewRef(Py_None);
        goto finish;
    }
    if ((made[0] = int_list(comp, n)) == NULL || (made[1] = int_list(plm1, n)) == NULL
            || (made[2] = has_s ? int_list(ns, n) : Py_NewRef(Py_None)) == NULL) {
        goto finish;
    }
    for (Py_ssize_t j = 0; has_s && j < PyList_GET_SIZE(sat); j++) { /* checked: in range */
        long long p = 0;
        as_i64(PyList_GET_ITEM(sat, j), &p);
        if (PyDict_SetItem(names, PyList_GET_ITEM(batch, (Py_ssize_t)p),
                           PyList_GET_ITEM(svalues, j)) < 0) {
            goto finish;
        }
    }
    PyObject *copy = PyList_GetSlice(made[0], 0, n);
    result = copy == NULL ? NULL : Py_BuildValue("(OOON)", made[0], made[1], made[2], copy);
finish:
    Py_XDECREF(out_at);
    Py_XDECREF(out_moves);
    for (int j = 0; j < 3; j++) {
        Py_XDECREF(made[j]);
    }
    free_columns(&c);
    return result;
}

/* The list ``unpack`` makes of the bytes attribute ``name`` of a Rows (b"": a fresh copy
 * of the list ``empty``, or Py_None when ``empty`` is NULL): a new reference, Py_None
 * when not taken -- a 64-bit wide array included, whose values may not fit int64 --,
 * NULL with an exception set. */
static PyObject *
rows_field(PyObject *rows, int j, int unpack,
           PyObject *empty)
{
    PyObject *packed = rows_item(rows, j);
    if (packed == NULL) {
        return NULL;
    }
    PyObject *out;
    if (!PyBytes_CheckExact(packed)) {
        out = Py_NewRef(Py_None);
    } else if (PyBytes_GET_SIZE(packed) == 0) {
        out = empty != NULL ? PyList_GetSlice(empty, 0, PY_SSIZE_T_MAX) : Py_NewRef(Py_None);
    } else if ((unsigned char)PyBytes_AS_STRING(packed)[0] >= 64) {
        out = Py_NewRef(Py_None);
    } else {
        out = unpacked_or_empty(packed, unpack);
    }
    Py_DECREF(packed);
    return out;
}

/* The pair rows_field makes of two fields of ``rows`` (None: Py_None, a new
 * reference); *taken cleared when one is not taken.  NULL with an exception set. */
static PyObject *
rows_pair(PyObject *rows, int a, int ua, PyObject *ea, int b, int ub, PyObject *eb,
          int *taken)
{
    if (rows == Py_None || !*taken) {
        return Py_NewRef(Py_None);
    }
    PyObject *x = rows_field(rows, a, ua, ea), *y = x == NULL ? NULL : rows_field(rows, b, ub, eb);
    if (x == NULL || y == NULL) {
        Py_XDECREF(x);
        return NULL;
    }
    *taken = x != Py_None && y != Py_None;
    return Py_BuildValue("(NN)", x, y);
}

static PyObject *rows_names[3];

static int
intern_rows_names(void)
{
    static const char *spelled[3] = {"handles", "counts", "values"};
    for (int j = 0; j < 3; j++) {
        if (rows_names[j] == NULL
                && (rows_names[j] = PyUnicode_InternFromString(spelled[j])) == NULL) {
            return -1;
        }
    }
    return 0;
}

PyObject *
rows_item(PyObject *rows, int j)
{
    if (PyTuple_CheckExact(rows) && PyTuple_GET_SIZE(rows) == 3) { /* lane_view's */
        return Py_NewRef(PyTuple_GET_ITEM(rows, j));
    }
    return intern_rows_names() < 0 ? NULL : PyObject_GetAttr(rows, rows_names[j]);
}

/* lane_rows(computed, scheduled, spec, n) -> (computed, scheduled, drafts) | None: the
 * count and draft rows of a lane body's three Rows fields (each None when absent) as
 * protocol.lane.lane_rows lists them -- computed (handles, signed values), scheduled
 * (handles, values), drafts (counts, b"" meaning n ones; values less one) -- in one call.
 * None unless every array present unpacks and is narrower than 64 bits, and ``spec``
 * has no handles (the Python path decides). */
PyObject *
lane_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *computed, *scheduled, *spec, *empty = NULL, *ones = NULL, *out[3] = {0};
    Py_ssize_t n;
    if (fast_args(args, nargs, "OOOn", &computed, &scheduled, &spec, &n) < 0 || n < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    int taken = 1;
    PyObject *result = NULL;
    if ((empty = PyList_New(0)) == NULL) {
        return NULL;
    }
    if (spec != Py_None) {
        PyObject *handles = rows_item(spec, 0);
        if (handles == NULL) {
            goto finish;
        }
        taken = PyBytes_CheckExact(handles) && PyBytes_GET_SIZE(handles) == 0;
        Py_DECREF(handles);
        if (taken && (ones = PyList_New(n)) == NULL) {
            goto finish;
        }
        for (Py_ssize_t i = 0; taken && i < n; i++) {
            PyList_SET_ITEM(ones, i, PyLong_FromLong(1)); /* a cached small int */
        }
    }
    if ((out[0] = rows_pair(computed, 0, RAW, empty, 2, SIGNED, NULL,
                            &taken)) == NULL
            || (out[1] = rows_pair(scheduled, 0, RAW, empty, 2, RAW, empty,
                                   &taken)) == NULL
            || (out[2] = rows_pair(spec, 1, RAW, ones, 2, MINUS_ONE, NULL,
                                   &taken)) == NULL) {
        goto finish;
    }
    result = taken ? PyTuple_Pack(3, out[0], out[1], out[2]) : Py_NewRef(Py_None);
finish:
    Py_XDECREF(empty);
    Py_XDECREF(ones);
    for (int j = 0; j < 3; j++) {
        Py_XDECREF(out[j]);
    }
    return result;
}

PyMethodDef counts_methods[] = {
    {"count_rows", (PyCFunction)(void (*)(void))count_rows, METH_FASTCALL,
     "A same-batch step's count exceptions against the forecast, packed (None: not taken)."},
    {"count_lists", (PyCFunction)(void (*)(void))count_lists, METH_FASTCALL,
     "The worker's counts of a same-batch step with count rows (None: not taken)."},
    {"lane_rows", (PyCFunction)(void (*)(void))lane_rows, METH_FASTCALL,
     "A lane body's count and draft rows as lists, unpacked in one call (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
