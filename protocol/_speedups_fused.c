/* Optional C versions of a same-batch step with count rows in one call a side, made of
 * the module's own functions: the engine's read of the whole step (same_batch_scan:
 * the batch, counts, appends, drafts and count rows; reference engine_side.vllm.quick.
 * QuickEncoder.body's lines) and the worker's SchedulerOutput from the rows
 * (count_output; reference worker_side.vllm.quick.QuickDecoder.scheduler_output's
 * lines), and the worker's whole step with the lane's (counted_step; reference the lines
 * of QuickDecoder.lane_inputs, protocol.lane.SteadyLane.counted and scheduler_output).
 *
 * Contract: as protocol/_speedups.c -- each function returns exactly what its Python
 * reference returns for the inputs it accepts and None for every input it does not
 * accept (the caller then runs the Python path, refusals included);
 * tests/test_speedups_counts.py holds the two together on speculative streams (every
 * step against the general path's frames, with and without C).
 */
#include "_speedups.h"

/* The sum of a list of int64-range ints in *total: 0, or -1 when not such a list or
 * the sum overflows. */
static int
list_sum(PyObject *list, long long *total)
{
    *total = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        long long v;
        if (as_i64(PyList_GET_ITEM(list, i), &v) < 0 || __builtin_add_overflow(*total, v, total)) {
            return -1;
        }
    }
    return 0;
}

/* count_output(CachedRequestData, SchedulerOutput, basis, nsched_before, plen_less_one,
 * computed_rows, scheduled_rows, out_pos, out_delta, batch, nsched_map, new_blocks,
 * drafts, structured, pending, nspec) -> (SchedulerOutput, computed copy, nsched | None,
 * total) | None: the worker's SchedulerOutput of a same-batch step with count rows in
 * one call -- count_lists' counts (nsched_map updated), their total, ``new_blocks``
 * (None: n Nones), split_rows of ``drafts`` ((lengths, flat); None: {}) and
 * step_output's objects, as worker_side.vllm.quick.QuickDecoder.scheduler_output makes
 * them.  None when one of those does not take its part (nsched_map then holds the same
 * counts count_lists would write: setting them again changes nothing). */
static PyObject *
count_output(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *cls[2], *basis, *before, *plm1, *crows, *srows, *opos, *odelta, *batch, *names,
             *blocks, *drafts, *structured, *pending, *nspec;
    if (fast_args(args, nargs, "OOOOOOOOOO!O!OOOOO", &cls[0], &cls[1], &basis, &before, &plm1,
                          &crows, &srows, &opos, &odelta, &PyList_Type, &batch, &PyDict_Type,
                          &names, &blocks, &drafts, &structured, &pending, &nspec) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PyList_GET_SIZE(batch);
    PyObject *split = NULL, *made = NULL, *counts = NULL, *total = NULL, *so = NULL,
             *result = NULL;
    long long sum;
    if (!PyType_Check(cls[0]) || !PyType_Check(cls[1])) {
        Py_RETURN_NONE;
    }
    if (drafts == Py_None) {
        split = PyDict_New();
    } else if (PyTuple_CheckExact(drafts) && PyTuple_GET_SIZE(drafts) == 2) {
        split = split_rows(NULL, (PyObject *[]){batch, PyTuple_GET_ITEM(drafts, 0),
                                                PyTuple_GET_ITEM(drafts, 1)}, 3);
    } else {
        split = Py_NewRef(Py_None);
    }
    if (split == NULL || split == Py_None) {
        result = split;
        split = NULL;
        goto finish;
    }
    if (blocks == Py_None && (made = PyList_New(n)) != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyList_SET_ITEM(made, i, Py_NewRef(Py_None));
        }
    }
    if (blocks == Py_None && made == NULL) {
        goto finish;
    }
    counts = count_lists(NULL, (PyObject *[]){basis, before, plm1, crows, srows, opos, odelta,
                                              batch, names}, 9);
    if (counts == NULL || counts == Py_None) {
        result = counts;
        counts = NULL;
        goto finish;
    }
    PyObject *nsched = PyTuple_GET_ITEM(counts, 2);
    if (list_sum(nsched == Py_None ? before : nsched, &sum) < 0) {
        result = Py_NewRef(Py_None);
        goto finish;
    }
    if ((total = PyLong_FromLongLong(sum)) == NULL) {
        goto finish;
    }
    so = step_output(NULL, (PyObject *[]){cls[0], cls[1], batch, names, made ? made : blocks,
                                          PyTuple_GET_ITEM(counts, 0),
                                          PyTuple_GET_ITEM(counts, 1), total, split, structured,
                                          pending, nspec}, 12);
    if (so == NULL || so == Py_None) {
        result = so;
        so = NULL;
        goto finish;
    }
    result = PyTuple_Pack(4, so, PyTuple_GET_ITEM(counts, 3), nsched, total);
finish:
    Py_XDECREF(split);
    Py_XDECREF(made);
    Py_XDECREF(counts);
    Py_XDECREF(total);
    Py_XDECREF(so);
    return result;
}

/* Reads every attribute same_batch_scan needs into got[] (new references); 0, or -1
 * with an exception set (an object without one is not a SchedulerOutput). */
static int
read_step(PyObject *so, PyObject **got)
{
    int on_cached[A_COUNT] = {[A_NEW_BLOCKS] = 1, [A_REQ_IDS] = 1, [A_COMPUTED] = 1,
                              [A_OUTPUTS] = 1};
    if (intern_attrs() < 0 || (got[A_CACHED] = PyObject_GetAttr(so, attrs[A_CACHED])) == NULL) {
        return -1;
    }
    for (int a = A_CACHED + 1; a < A_COUNT; a++) { /* (A_CACHED is the first) */
        PyObject *owner = on_cached[a] ? got[A_CACHED] : so;
        if ((got[a] = PyObject_GetAttr(owner, attrs[a])) == NULL) {
            return -1;
        }
    }
    return 0;
}

/* The step's scheduled counts as (list, same as ``before``) when its dict names the
 * batch in order: 1 and *nsched set (a new reference), 0 when not taken, -1 with an
 * exception set (QuickEncoder._nsched). */
static int
scheduled_counts(PyObject *counts, PyObject *batch, PyObject *before, PyObject **nsched,
                 int *same)
{
    int match = dict_match(counts, batch, before);
    if (match == -1) {
        return -1;
    }
    if (match == 2) {
        *nsched = Py_NewRef(before);
        *same = 1;
        return 1;
    }
    if (match != 1 || (*nsched = PyDict_Values(counts)) == NULL) {
        return match == 1 ? -1 : 0;
    }
    *same = PyObject_RichCompareBool(*nsched, before, Py_EQ);
    return *same < 0 ? -1 : 1;
}

/* A step's drafts as (lengths, flat, packed lengths, packed flat plus one): a new
 * reference, Py_None when not taken, NULL with an exception set (QuickEncoder._spec). */
static PyObject *
packed_drafts(PyObject *drafts, PyObject *pos, Py_ssize_t n)
{
    PyObject *size = PyLong_FromSsize_t(n);
    PyObject *rows = size == NULL ? NULL : draft_rows(NULL, (PyObject *[]){drafts, pos, size}, 3);
    Py_XDECREF(size);
    if (rows == NULL || rows == Py_None) {
        return rows;
    }
    PyObject *lengths = PyTuple_GET_ITEM(rows, 0), *flat = PyTuple_GET_ITEM(rows, 1);
    PyObject *pc = pack_list(NULL, lengths), *pv = pc == NULL ? NULL : pack_plus_one(NULL, flat);
    PyObject *out = pc == NULL || pv == NULL ? NULL
        : pc == Py_None || pv == Py_None ? Py_NewRef(Py_None)
        : PyTuple_Pack(4, lengths, flat, pc, pv);
    Py_XDECREF(pc);
    Py_XDECREF(pv);
    Py_DECREF(rows);
    return out;
}

/* same_batch_scan(so, batch, pos, basis, nsched_before, total, plen_less_one, handles,
 * rare, plain, one_group) -> (nsched, same, appends | None, packed | None, drafts | None,
 * counts, structured, pending, nspec, total) | None: what engine_side.vllm.quick.QuickEncoder.
 * body reads of a same-batch step, in one call -- its rare fields are ``plain``
 * (rare_equal); the batch in
 * order with its scheduled counts (nsched, and whether they equal ``nsched_before``)
 * adding up to the step's total (``total`` when they are the same); one KV group's
 * appends (one_group_appends' rows and packed_appends' fields; None for none); the
 * drafts (draft_rows' lists with their packed counts and their values packed plus
 * one; None for none); count_rows of the counts; the structured-output flags as bools
 * and num_spec_tokens_to_schedule and total_num_scheduled_tokens (nsched's sum) as read.
 * None for any step or input one of those
 * does not take, or when ``one_group`` is false (QuickEncoder.body's lines decide); an
 * object without these attributes raises AttributeError, as those lines do. */
static PyObject *
same_batch_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *so, *batch, *pos, *basis, *before, *total_obj, *plm1, *handles, *rare, *plain;
    int one_group;
    if (fast_args(args, nargs, "OO!O!OO!OOOOOp", &so, &PyList_Type, &batch, &PyDict_Type,
                          &pos, &basis, &PyList_Type, &before, &total_obj, &plm1, &handles,
                          &rare, &plain, &one_group) < 0) {
        return NULL;
    }
    PyObject *got[A_COUNT] = {NULL}, *nsched = NULL, *appends = NULL,
             *packed = NULL, *drafts = NULL, *counts = NULL, *result = NULL;
    Py_ssize_t n = PyList_GET_SIZE(batch);
    int ok, same = 0, structured, pending, has_drafts; /* ok: 1 so far, 0 not taken, -1 error */
    long long total, want;
#define CHECK(cond) do { ok = (cond); if (ok <= 0) goto done; } while (0)
    CHECK(rare_equal(so, rare, plain));
    if (read_step(so, got) < 0) {
        goto error;
    }
    CHECK(one_group && PyList_CheckExact(got[A_NEW_BLOCKS]) && PyList_GET_SIZE(got[A_NEW_BLOCKS]) == n
          && as_i64(got[A_TOTAL], &total) == 0);
    CHECK(PyObject_RichCompareBool(got[A_REQ_IDS], batch, Py_EQ));
    CHECK(scheduled_counts(got[A_NSCHED], batch, before, &nsched, &same));
    CHECK((same ? as_i64(total_obj, &want) : list_sum(nsched, &want)) == 0 && want == total);
    if ((appends = one_group_appends(NULL, got[A_NEW_BLOCKS])) == NULL) {
        goto error;
    }
    CHECK(appends != Py_None);
    if (PyList_GET_SIZE(PyTuple_GET_ITEM(appends, 0)) == 0) {
        Py_CLEAR(appends); /* no row grew */
    } else {
        packed = packed_appends(appends, handles);
        if (packed == NULL) {
            goto error;
        }
        CHECK(packed != Py_None);
    }
    if ((has_drafts = PyObject_IsTrue(got[A_SPEC])) < 0) {
        goto error;
    }
    if (has_drafts) {
        if ((drafts = packed_drafts(got[A_SPEC], pos, n)) == NULL) {
            goto error;
        }
        CHECK(drafts != Py_None);
    }
    counts = count_rows(NULL, (PyObject *[]){got[A_COMPUTED], got[A_OUTPUTS], basis, before,
                                             nsched, plm1}, 6);
    if (counts == NULL) {
        goto error;
    }
    CHECK(counts != Py_None);
    if ((structured = PyObject_IsTrue(got[A_STRUCTURED])) < 0
            || (pending = PyObject_IsTrue(got[A_PENDING])) < 0) {
        goto error;
    }
    result = PyTuple_Pack(10, nsched, same ? Py_True : Py_False, appends ? appends : Py_None,
                          packed ? packed : Py_None, drafts ? drafts : Py_None, counts,
                          structured ? Py_True : Py_False, pending ? Py_True : Py_False,
                          got[A_NSPEC], got[A_TOTAL]);
    goto finish;
#undef CHECK
done:
    if (ok == 0) {
        result = Py_NewRef(Py_None);
        goto finish;
    }
error:
    result = NULL;
finish:
    for (int a = 0; a < A_COUNT; a++) {
        Py_XDECREF(got[a]);
    }
    Py_XDECREF(nsched);
    Py_XDECREF(appends);
    Py_XDECREF(packed);
    Py_XDECREF(drafts);
    Py_XDECREF(counts);
    return result;
}

/* The three fields of a Rows (handles, counts, values) as new references in f[]: 0, or
 * -1 (f[] cleared) when one is missing (an exception is then set). */
static int
rows_fields(PyObject *rows, PyObject **f)
{
    for (int j = 0; j < 3; j++) {
        f[j] = NULL;
    }
    for (int j = 0; j < 3; j++) {
        if ((f[j] = rows_item(rows, j)) == NULL) {
            for (int k = 0; k < j; k++) {
                Py_CLEAR(f[k]);
            }
            return -1;
        }
    }
    return 0;
}

/* A body's block_append of at most one KV group as append_rows lists it: *added the
 * (positions, counts, ids) of the rows (None for none) and *blocks the step's
 * new_block_ids (None for no appends), both new references; 1, 0 when not taken (more
 * groups, or rows append_rows refuses), -1 with an exception set. */
static int
one_group_added(PyObject *appended, PyObject *at, Py_ssize_t n, PyObject **added,
                PyObject **blocks)
{
    *added = Py_NewRef(Py_None);
    *blocks = Py_NewRef(Py_None);
    if (PyTuple_GET_SIZE(appended) == 0) {
        return 1;
    }
    PyObject *f[3];
    if (PyTuple_GET_SIZE(appended) != 1 || rows_fields(PyTuple_GET_ITEM(appended, 0), f) < 0) {
        PyErr_Clear();
        return 0;
    }
    PyObject *size = PyLong_FromSsize_t(n);
    PyObject *got = size == NULL ? NULL
        : append_rows(NULL, (PyObject *[]){f[0], f[1], f[2], at, size}, 5);
    Py_XDECREF(size);
    for (int j = 0; j < 3; j++) {
        Py_DECREF(f[j]);
    }
    if (got == NULL || got == Py_None) {
        Py_XDECREF(got);
        return got == NULL ? -1 : 0;
    }
    Py_SETREF(*blocks, Py_NewRef(PyTuple_GET_ITEM(got, 3)));
    if (PyList_GET_SIZE(PyTuple_GET_ITEM(got, 0)) > 0) { /* (no rows: no ids either) */
        Py_SETREF(*added, PyTuple_GetSlice(got, 0, 3));
    }
    Py_DECREF(got);
    return *added == NULL ? -1 : 1;
}

/* Whether the drafts (lengths, flat) of lane_rows align with a batch of n: n lengths
 * adding up to the flat tokens (LaneRows.fits); None always does. */
static int
drafts_fit(PyObject *drafts, Py_ssize_t n)
{
    long long sum;
    return drafts == Py_None
        || (PyList_GET_SIZE(PyTuple_GET_ITEM(drafts, 0)) == n
            && list_sum(PyTuple_GET_ITEM(drafts, 0), &sum) == 0
            && sum == PyList_GET_SIZE(PyTuple_GET_ITEM(drafts, 1)));
}

/* counted_step(CachedRequestData, SchedulerOutput, (computed, scheduled, spec,
 * block_append, out_pos, out_delta, structured, pending, nspec), at, batch, nsched_map,
 * basis, nsched_before, plen_less_one, (comp, ns, keys, skeys, advance, extra, handles,
 * lengths, salt, k_block, k_pos, k_handle, base), expected) -> (lane, output | None,
 * rows, added | None, new_blocks | None) | int | None: the worker's same-batch step in
 * one call, the lines of worker_side.vllm.quick.QuickDecoder.lane_inputs,
 * protocol.lane.SteadyLane.counted and QuickDecoder.scheduler_output --
 * lane_rows of the body's three Rows fields (``rows``) and append_rows of its
 * block_append of one KV group (``added``: positions, counts and ids; None for no
 * rows), then lane_counts of them on the lane's lists (the rows checked as a
 * caller's; ``lane``: its result, the lane's commit done) and count_output of them
 * (``output``: its result; None when it does not take them: the lane's step stands and
 * the caller makes the SchedulerOutput).  An int: the digest, which differs from
 * ``expected``; None: not taken (more KV groups, rows that do not unpack or align,
 * lane_counts refused); both change nothing. */
static PyObject *
counted_step(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *a[31]; /* the body's fields and the lane's inputs, unpacked in place */
    if (nargs != 11 || !PyTuple_CheckExact(args[2]) || PyTuple_GET_SIZE(args[2]) != 9
            || !PyTuple_CheckExact(args[9]) || PyTuple_GET_SIZE(args[9]) != 13) {
        Py_RETURN_NONE;
    }
    a[0] = args[0];
    a[1] = args[1];
    for (int j = 0; j < 9; j++) {
        a[2 + j] = PyTuple_GET_ITEM(args[2], j);
    }
    for (int j = 0; j < 6; j++) {
        a[11 + j] = args[3 + j];
    }
    for (int j = 0; j < 13; j++) {
        a[17 + j] = PyTuple_GET_ITEM(args[9], j);
    }
    a[30] = args[10];
    if (!PyTuple_CheckExact(a[5]) || !PyList_CheckExact(a[12])) {
        Py_RETURN_NONE;
    }
    PyObject *const *lane_args = a + 17; /* comp .. k_handle, then base and expected */
    Py_ssize_t n = PyList_GET_SIZE(a[12]);
    PyObject *rows = NULL, *added = NULL, *blocks = NULL, *lane = NULL, *out = NULL,
             *result = NULL, *empty = NULL;
    PyObject *size = PyLong_FromSsize_t(n);
    rows = size == NULL ? NULL : lane_rows(NULL, (PyObject *[]){a[2], a[3], a[4], size}, 4);
    Py_XDECREF(size);
    if (rows == NULL || rows == Py_None) {
        return rows;
    }
    PyObject *crows = PyTuple_GET_ITEM(rows, 0), *srows = PyTuple_GET_ITEM(rows, 1),
             *drafts = PyTuple_GET_ITEM(rows, 2);
    int got = drafts_fit(drafts, n) ? one_group_added(a[5], a[11], n, &added, &blocks) : 0;
    if (got <= 0 || (empty = PyList_New(0)) == NULL) {
        result = got < 0 || (got == 1 && empty == NULL) ? NULL : Py_NewRef(Py_None);
        goto finish;
    }
    PyObject *at = crows == Py_None ? empty : PyTuple_GET_ITEM(crows, 0),
             *moves = crows == Py_None ? empty : PyTuple_GET_ITEM(crows, 1),
             *pos = srows == Py_None ? empty : PyTuple_GET_ITEM(srows, 0),
             *values = srows == Py_None ? empty : PyTuple_GET_ITEM(srows, 1);
    lane = lane_counts(NULL, (PyObject *[]){
        lane_args[0], lane_args[1], lane_args[2], at, moves, pos, values, lane_args[3],
        lane_args[4], lane_args[5], added, lane_args[6], lane_args[7], lane_args[8],
        lane_args[9], lane_args[10], lane_args[11], Py_True, lane_args[12], lane_args[13]}, 20);
    if (lane == NULL || !PyTuple_Check(lane)) { /* an int (the digest differs), or None */
        result = lane;
        lane = NULL;
        goto finish;
    }
    out = count_output(NULL, (PyObject *[]){
        a[0], a[1], a[14], a[15], a[16], crows, srows, a[6], a[7], a[12], a[13], blocks,
        drafts, a[8], a[9], a[10]}, 16);
    if (out == NULL) { /* the lane's step is done: the caller's lines make the output
                          (and raise what this raised) */
        PyErr_Clear();
        out = Py_NewRef(Py_None);
    }
    result = PyTuple_Pack(5, lane, out, rows, added, blocks);
finish:
    Py_XDECREF(rows);
    Py_XDECREF(added);
    Py_XDECREF(blocks);
    Py_XDECREF(lane);
    Py_XDECREF(out);
    Py_XDECREF(empty);
    return result;
}

PyMethodDef fused_methods[] = {
    {"count_output", (PyCFunction)(void (*)(void))count_output, METH_FASTCALL,
     "The worker's SchedulerOutput of a same-batch step with count rows (None: not taken)."},
    {"same_batch_scan", (PyCFunction)(void (*)(void))same_batch_scan, METH_FASTCALL,
     "What the engine reads of a same-batch step, in one call (None: not taken)."},
    {"counted_step", (PyCFunction)(void (*)(void))counted_step, METH_FASTCALL,
     "The worker's same-batch step with count rows, lane and output, in one call "
     "(None: not taken)."},
    {NULL, NULL, 0, NULL},
};
