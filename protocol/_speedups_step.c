/* Optional C versions of the same-batch step's checks and rows: the engine's test of a
 * plain step (engine_side.vllm.quick.plain_check_py) and its packed appends, the worker's
 * appends and new_block_ids, and the worker's forecast of the next step's counts.
 *
 * Contract: as protocol/_speedups.c -- each function returns exactly what its Python
 * reference returns for the inputs it accepts and None for every input it does not
 * accept (the caller then runs the Python path); tests/test_speedups.py and
 * tests/test_vllm_quick.py hold the two together.  Nothing here raises for bad data (plain_check reads attributes: an object
 * that lacks one is not a SchedulerOutput, and raises as the Python lines do).
 */
#include "_speedups.h"

/* Sets a[i] = x and b[i] = y, stealing both; -1, both released, when either is NULL
 * (the allocation failed and an exception is set). */
static int
set_both(PyObject *a, PyObject *b, Py_ssize_t i, PyObject *x, PyObject *y)
{
    if (x == NULL || y == NULL) {
        Py_XDECREF(x);
        Py_XDECREF(y);
        return -1;
    }
    PyList_SET_ITEM(a, i, x);
    PyList_SET_ITEM(b, i, y);
    return 0;
}

/* forecast_rows(base, nsched, plen_less_one, k) -> (computed rows, output rows) | None:
 * the next k rows of engine_side.vllm.quick.Forecast as fresh lists, row j (from 1)
 * computed[i] = base[i] + j * nsched[i] and outputs[i] = max(computed[i] -
 * plen_less_one[i], 0).  None unless three equally long lists of int64-range ints
 * whose rows stay in range, and 1 <= k <= 64.  No intermediate arrays: the int objects
 * are the only cost that grows with the batch. */
static PyObject *
forecast_rows(PyObject *self, PyObject *args)
{
    PyObject *base, *nsched, *plm1;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "OOOn", &base, &nsched, &plm1, &k) || !PyList_CheckExact(base)
            || !PyList_CheckExact(nsched) || !PyList_CheckExact(plm1) || k < 1 || k > 64) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(base);
    if (PyList_GET_SIZE(nsched) != n || PyList_GET_SIZE(plm1) != n) {
        Py_RETURN_NONE;
    }
    long long *v = PyMem_Malloc(sizeof(long long) * 3 * (size_t)(n ? n : 1));
    if (v == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* every value read and checked before any is made */
        long long *b = v + 3 * i, *s = b + 1, *p = b + 2, first, last, out;
        /* rows run monotonically from the first to the last: both in range, all are */
        if (as_i64(PyList_GET_ITEM(base, i), b) < 0 || as_i64(PyList_GET_ITEM(nsched, i), s) < 0
                || as_i64(PyList_GET_ITEM(plm1, i), p) < 0 || __builtin_add_overflow(*b, *s, &first)
                || __builtin_mul_overflow(*s, (long long)k, &last)
                || __builtin_add_overflow(*b, last, &last) || __builtin_sub_overflow(first, *p, &out)
                || __builtin_sub_overflow(last, *p, &out)) {
            PyMem_Free(v);
            Py_RETURN_NONE;
        }
    }
    PyObject *comp_rows = PyList_New(k), *out_rows = PyList_New(k);
    if (comp_rows == NULL || out_rows == NULL) {
        goto fail;
    }
    for (Py_ssize_t j = 0; j < k; j++) { /* NULL slots of a list dropped half made free fine */
        if (set_both(comp_rows, out_rows, j, PyList_New(n), PyList_New(n)) < 0) {
            goto fail;
        }
        PyObject *comp = PyList_GET_ITEM(comp_rows, j), *outs = PyList_GET_ITEM(out_rows, j);
        for (Py_ssize_t i = 0; i < n; i++) {
            long long c = v[3 * i] + (j + 1) * v[3 * i + 1], o = c - v[3 * i + 2];
            if (set_both(comp, outs, i, PyLong_FromLongLong(c),
                         PyLong_FromLongLong(o > 0 ? o : 0)) < 0) {
                goto fail;
            }
        }
    }
    PyMem_Free(v);
    return Py_BuildValue("(NN)", comp_rows, out_rows);
fail:
    PyMem_Free(v);
    Py_XDECREF(comp_rows);
    Py_XDECREF(out_rows);
    return NULL;
}

/* The SchedulerOutput attribute names (see _speedups.h), interned once. */
static const char *attr_names[A_COUNT] = {
    "scheduled_cached_reqs", "new_block_ids", "req_ids", "scheduled_spec_decode_tokens",
    "total_num_scheduled_tokens", "num_spec_tokens_to_schedule", "num_scheduled_tokens",
    "num_computed_tokens", "num_output_tokens", "has_structured_output_requests",
    "pending_structured_output_tokens"};
PyObject *attrs[A_COUNT];

int
intern_attrs(void)
{
    for (int i = 0; i < A_COUNT; i++) {
        if (attrs[i] == NULL && (attrs[i] = PyUnicode_InternFromString(attr_names[i])) == NULL) {
            return -1;
        }
    }
    return 0;
}

/* 1 when the lists are n long and computed[i] == basis[i] + nsched[i] and outputs[i] ==
 * max(computed[i] - plm1[i], 0) for every i; 0 otherwise (any value not an int64). */
static int
on_forecast(PyObject *computed, PyObject *outputs, PyObject *basis, PyObject *nsched,
            PyObject *plm1, Py_ssize_t n)
{
    PyObject *lists[5] = {computed, outputs, basis, nsched, plm1};
    for (int k = 0; k < 5; k++) {
        if (!PyList_CheckExact(lists[k]) || PyList_GET_SIZE(lists[k]) != n) {
            return 0;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long c, o, b, s, p;
        if (as_i64(PyList_GET_ITEM(computed, i), &c) < 0
                || as_i64(PyList_GET_ITEM(outputs, i), &o) < 0
                || as_i64(PyList_GET_ITEM(basis, i), &b) < 0
                || as_i64(PyList_GET_ITEM(nsched, i), &s) < 0
                || as_i64(PyList_GET_ITEM(plm1, i), &p) < 0) {
            return 0;
        }
        if (departs(c, b, s, 0) || departs(o, c, p, 1)) {
            return 0;
        }
    }
    return 1;
}

/* 1 when ``obj`` is false, 0 when true, -1 with an exception set. */
static int
is_false(PyObject *obj)
{
    int truth = PyObject_IsTrue(obj);
    return truth < 0 ? -1 : !truth;
}

/* The attribute ``a`` of ``obj`` (a new reference) or NULL with an exception set. */
static inline PyObject *
attr(PyObject *obj, int a)
{
    return PyObject_GetAttr(obj, attrs[a]);
}

static PyObject *pack_appends(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* 1 when ``v`` and ``w`` are both empty and of one exact type of list, set or dict (an
 * empty container equals another of its type: no compare needed). */
static inline int
both_empty(PyObject *v, PyObject *w)
{
    return Py_TYPE(v) == Py_TYPE(w)
        && ((PyList_CheckExact(v) && PyList_GET_SIZE(v) == 0 && PyList_GET_SIZE(w) == 0)
            || (PySet_CheckExact(v) && PySet_GET_SIZE(v) == 0 && PySet_GET_SIZE(w) == 0)
            || (PyDict_CheckExact(v) && PyDict_GET_SIZE(v) == 0 && PyDict_GET_SIZE(w) == 0));
}

int
rare_equal(PyObject *so, PyObject *rare, PyObject *plain)
{
    if (!PyTuple_CheckExact(rare)) {
        PyObject *got = PyObject_CallOneArg(rare, so);
        int eq = got == NULL ? -1 : PyObject_RichCompareBool(got, plain, Py_EQ);
        Py_XDECREF(got);
        return eq;
    }
    if (!PyTuple_CheckExact(plain) || PyTuple_GET_SIZE(plain) != PyTuple_GET_SIZE(rare)) {
        return 0;
    }
    PyObject *owner = NULL, *owner_name = NULL; /* the last pair's first attribute */
    int eq = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(rare) && eq == 1; i++) {
        PyObject *name = PyTuple_GET_ITEM(rare, i), *v;
        if (PyTuple_CheckExact(name) && PyTuple_GET_SIZE(name) == 2) {
            if (owner_name != PyTuple_GET_ITEM(name, 0)) {
                owner_name = PyTuple_GET_ITEM(name, 0);
                Py_XSETREF(owner, PyObject_GetAttr(so, owner_name));
                if (owner == NULL) {
                    return -1;
                }
            }
            v = PyObject_GetAttr(owner, PyTuple_GET_ITEM(name, 1));
        } else {
            v = PyObject_GetAttr(so, name);
        }
        if (v == NULL) {
            eq = -1;
            break;
        }
        PyObject *w = PyTuple_GET_ITEM(plain, i);
        eq = v == w || both_empty(v, w) ? 1 : PyObject_RichCompareBool(v, w, Py_EQ);
        Py_DECREF(v);
    }
    Py_XDECREF(owner);
    return eq;
}

/* pack_appends of ``appends`` (one_group_appends' (positions, counts, ids)) and
 * ``handles``: a new reference (Py_None when not taken) or NULL. */
PyObject *
packed_appends(PyObject *appends, PyObject *handles)
{
    if (appends == NULL || !PyTuple_CheckExact(appends) || PyTuple_GET_SIZE(appends) != 3) {
        return Py_NewRef(Py_None);
    }
    return pack_appends(NULL, (PyObject *[]){PyTuple_GET_ITEM(appends, 0),
                                             PyTuple_GET_ITEM(appends, 1),
                                             PyTuple_GET_ITEM(appends, 2), handles}, 4);
}

/* plain_check(so, batch, nsched, total, basis, plen_less_one, rare, plain, one_group,
 * handles) -> (appends, packed, structured, pending, computed) | None: engine_side.vllm.
 * quick.plain_check_py in one call -- the step is the forecast step (batch, scheduled
 * counts and their total, computed and output counts as forecast) but for one KV
 * group's block appends (one_group_appends' rows, None for none) and the
 * structured-output flags, and its rare fields are ``plain`` (rare_equal).
 * ``packed``: pack_appends of the appends and ``handles`` (None for none, or when it
 * does not take them); ``computed`` a fresh copy of the step's computed counts.  None for any other step or
 * input (Python's paths decide); an object without these attributes raises
 * AttributeError, as its reference does. */
static PyObject *
plain_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *so, *batch, *nsched, *total_obj, *basis, *plm1, *rare, *plain, *handles;
    long long total, got_total;
    int one_group;
    if (fast_args(args, nargs, "OOOOOOOOpO", &so, &batch, &nsched, &total_obj, &basis, &plm1,
                          &rare, &plain, &one_group, &handles) < 0 || intern_attrs() < 0) {
        return NULL;
    }
    if (!PyList_CheckExact(batch) || as_i64(total_obj, &total) < 0) {
        Py_RETURN_NONE; /* the lists are checked where they are read */
    }
    Py_ssize_t n = PyList_GET_SIZE(batch);
    PyObject *cached = NULL, *blocks = NULL, *ids = NULL, *obj = NULL, *actual = NULL,
             *outs = NULL, *appends = NULL, *result = NULL;
    int ok = 0; /* 1: a plain step so far; 0: not taken; -1: an exception is set */
#define READ(target, owner, a) if (((target) = attr((owner), (a))) == NULL) goto error
#define FLAG(a) do { READ(obj, so, a); ok = is_false(obj); Py_CLEAR(obj); \
                     if (ok <= 0) goto done; } while (0)
    READ(cached, so, A_CACHED);
    READ(blocks, cached, A_NEW_BLOCKS);
    if (!PyList_CheckExact(blocks) || PyList_GET_SIZE(blocks) != n) {
        goto done;
    }
    FLAG(A_SPEC);
    READ(ids, cached, A_REQ_IDS);
    if ((ok = PyObject_RichCompareBool(ids, batch, Py_EQ)) <= 0) {
        goto done;
    }
    READ(obj, so, A_TOTAL);
    ok = as_i64(obj, &got_total) == 0 && got_total == total;
    Py_CLEAR(obj);
    if (!ok) {
        goto done;
    }
    if ((ok = rare_equal(so, rare, plain)) <= 0) {
        goto done;
    }
    FLAG(A_NSPEC);
    READ(obj, so, A_NSCHED);
    ok = dict_match(obj, batch, nsched);
    Py_CLEAR(obj);
    if (ok == -1) {
        goto error;
    }
    if (ok != 2) {
        ok = 0;
        goto done;
    }
    ok = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_ITEM(blocks, i) != Py_None) {
            if (!one_group) {
                goto done;
            }
            if ((appends = one_group_appends(NULL, blocks)) == NULL) {
                goto error;
            }
            if (appends == Py_None) {
                goto done;
            }
            break;
        }
    }
    READ(actual, cached, A_COMPUTED);
    READ(outs, cached, A_OUTPUTS);
    if (!on_forecast(actual, outs, basis, nsched, plm1, n)) {
        goto done;
    }
    PyObject *structured, *pending, *copy, *packed;
    READ(structured, so, A_STRUCTURED);
    int s = PyObject_IsTrue(structured);
    Py_DECREF(structured);
    READ(pending, so, A_PENDING);
    int p = PyObject_IsTrue(pending);
    Py_DECREF(pending);
    if (s < 0 || p < 0 || (packed = packed_appends(appends, handles)) == NULL) {
        goto error;
    }
    if ((copy = PyList_GetSlice(actual, 0, n)) == NULL) {
        Py_DECREF(packed);
        goto error;
    }
    result = Py_BuildValue("(ONNNN)", appends ? appends : Py_None, packed, PyBool_FromLong(s),
                           PyBool_FromLong(p), copy);
    goto finish;
#undef FLAG
#undef READ
done:
    if (ok >= 0) {
        result = Py_NewRef(Py_None);
        goto finish;
    }
error:
    result = NULL;
finish:
    Py_XDECREF(cached);
    Py_XDECREF(blocks);
    Py_XDECREF(ids);
    Py_XDECREF(obj);
    Py_XDECREF(actual);
    Py_XDECREF(outs);
    Py_XDECREF(appends);
    return result;
}

/* The raw values of ``packed`` (unpack_bytes; a new reference, Py_None when not taken)
 * or NULL. */
static PyObject *
unpack(PyObject *packed)
{
    return unpack_bytes(packed, RAW);
}

/* append_rows(handles, counts, values, at, n) -> (positions, counts, ids, new_blocks) |
 * None: a one-group block_append row set (packed handles, counts -- b"" for one each --
 * and ids) as worker_side.vllm.quick.QuickDecoder.blocks lists it, with the step's
 * ``new_block_ids`` made from it (QuickDecoder._new_blocks: n entries, None or a tuple
 * holding a fresh list).  None unless the arrays unpack, every handle is a key of
 * ``at`` (handle -> batch position < n), every count is >= 1 and they add up to the ids. */
PyObject *
append_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *handles_b, *counts_b, *values_b, *at;
    Py_ssize_t n;
    if (fast_args(args, nargs, "OOOO!n", &handles_b, &counts_b, &values_b, &PyDict_Type, &at,
                          &n) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *handles = NULL, *counts = NULL, *values = NULL, *pos = NULL, *blocks = NULL,
             *result = NULL;
    if ((handles = unpack(handles_b)) == NULL || (values = unpack(values_b)) == NULL) {
        goto finish;
    }
    int one_each = PyBytes_Check(counts_b) && PyBytes_GET_SIZE(counts_b) == 0;
    if (!one_each && (counts = unpack(counts_b)) == NULL) {
        goto finish;
    }
    if (handles == Py_None || values == Py_None || counts == Py_None) {
        result = Py_NewRef(Py_None);
        goto finish;
    }
    Py_ssize_t rows = PyList_GET_SIZE(handles), ids = PyList_GET_SIZE(values);
    if (one_each && (counts = PyList_New(rows)) != NULL) {
        for (Py_ssize_t j = 0; j < rows; j++) {
            PyList_SET_ITEM(counts, j, PyLong_FromLong(1)); /* a cached small int */
        }
    }
    if (counts == NULL || (pos = PyList_New(rows)) == NULL || (blocks = PyList_New(n)) == NULL) {
        goto finish;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyList_SET_ITEM(blocks, i, Py_NewRef(Py_None));
    }
    int taken = PyList_GET_SIZE(counts) == rows;
    Py_ssize_t start = 0;
    for (Py_ssize_t j = 0; taken && j < rows; j++) {
        PyObject *p = PyDict_GetItemWithError(at, PyList_GET_ITEM(handles, j));
        long long k, c;
        if (p == NULL && PyErr_Occurred()) {
            goto finish;
        }
        taken = p != NULL && as_i64(p, &k) == 0 && k >= 0 && k < n
                && as_i64(PyList_GET_ITEM(counts, j), &c) == 0 && c >= 1 && c <= ids - start;
        if (!taken) {
            break;
        }
        PyObject *row = PyList_GetSlice(values, start, start + (Py_ssize_t)c);
        PyObject *entry = row == NULL ? NULL : PyTuple_Pack(1, row);
        Py_XDECREF(row);
        if (entry == NULL) {
            goto finish;
        }
        PyObject *was = PyList_GET_ITEM(blocks, (Py_ssize_t)k); /* None, or a row named
                                                                   twice: the lane refuses */
        PyList_SET_ITEM(blocks, (Py_ssize_t)k, entry);
        Py_DECREF(was);
        PyList_SET_ITEM(pos, j, Py_NewRef(p));
        start += (Py_ssize_t)c;
    }
    if (!taken || start != ids) {
        result = Py_NewRef(Py_None);
        goto finish;
    }
    result = PyTuple_Pack(4, pos, counts, values, blocks);
finish:
    Py_XDECREF(handles);
    Py_XDECREF(counts);
    Py_XDECREF(values);
    Py_XDECREF(pos);
    Py_XDECREF(blocks);
    return result;
}

/* pack_appends(positions, counts, ids, handles) -> (handles, counts, ids) packed | None:
 * the Rows fields of one group's appends (engine_side.vllm.quick.QuickEncoder.
 * _one_group_rows): pack_uints of handles[p] for each position, pack_row_counts of the
 * counts (b"" when every count is 1) and pack_uints of the ids.  None unless the lists
 * pack and every position indexes ``handles``. */
static PyObject *
pack_appends(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *pos, *counts, *ids, *handles;
    if (fast_args(args, nargs, "O!O!OO!", &PyList_Type, &pos, &PyList_Type, &counts, &ids,
                          &PyList_Type, &handles) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t rows = PyList_GET_SIZE(pos), ones = 0;
    PyObject *named = PyList_New(rows), *result = NULL, *packed[3] = {NULL, NULL, NULL};
    if (named == NULL) {
        return NULL;
    }
    for (Py_ssize_t j = 0; j < rows; j++) {
        long long p;
        if (as_i64(PyList_GET_ITEM(pos, j), &p) < 0 || p < 0 || p >= PyList_GET_SIZE(handles)) {
            result = Py_NewRef(Py_None);
            goto finish;
        }
        PyList_SET_ITEM(named, j, Py_NewRef(PyList_GET_ITEM(handles, (Py_ssize_t)p)));
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(counts); j++) {
        long long c;
        ones += as_i64(PyList_GET_ITEM(counts, j), &c) == 0 && c == 1;
    }
    packed[0] = pack_list(NULL, named);
    packed[1] = ones == PyList_GET_SIZE(counts) ? PyBytes_FromStringAndSize("", 0)
                                                : pack_list(NULL, counts);
    packed[2] = pack_list(NULL, ids);
    if (packed[0] == NULL || packed[1] == NULL || packed[2] == NULL) {
        goto finish;
    }
    result = packed[0] == Py_None || packed[1] == Py_None || packed[2] == Py_None
             ? Py_NewRef(Py_None) : PyTuple_Pack(3, packed[0], packed[1], packed[2]);
finish:
    Py_DECREF(named);
    for (int k = 0; k < 3; k++) {
        Py_XDECREF(packed[k]);
    }
    return result;
}

PyMethodDef step_methods[] = {
    {"pack_appends", (PyCFunction)(void (*)(void))pack_appends, METH_FASTCALL,
     "One group's appends as packed Rows fields (None: not taken)."},
    {"append_rows", (PyCFunction)(void (*)(void))append_rows, METH_FASTCALL,
     "A one-group step's appends as positions, counts, ids and new_block_ids (None: not taken)."},
    {"plain_check", (PyCFunction)(void (*)(void))plain_check, METH_FASTCALL,
     "The engine's plain-step test and its appends in one call (None: not taken)."},
    {"forecast_rows", forecast_rows, METH_VARARGS,
     "The forecast's next rows of computed and output counts (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
