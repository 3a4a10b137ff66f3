/* Optional C version of the worker's same-batch SchedulerOutput: the two objects of
 * worker_side.vllm.quick.QuickDecoder._assemble built in one call.
 *
 * Contract: as protocol/_speedups.c -- the objects equal the Python reference's, field
 * for field and in the same instance-dict order, every container fresh; None for any
 * input it does not accept (the caller then runs the Python path).
 * tests/test_vllm_quick.py holds the two together.
 */
#include "_speedups.h"

/* How a field's value is made: a fresh empty container, a constant, or an argument. */
enum { V_LIST, V_SET, V_DICT, V_NONE, V_FALSE, V_ARG };

typedef struct {
    const char *name;
    int kind;
    int arg; /* V_ARG: the index into the values passed */
} Field;

/* CachedRequestData's fields in declaration order (args: batch copy, new_block_ids,
 * computed, outputs). */
static const Field cached_fields[] = {
    {"req_ids", V_ARG, 0},        {"resumed_req_ids", V_SET, 0},
    {"new_token_ids", V_LIST, 0}, {"all_token_ids", V_DICT, 0},
    {"new_block_ids", V_ARG, 1},  {"num_computed_tokens", V_ARG, 2},
    {"num_output_tokens", V_ARG, 3},
};

/* SchedulerOutput's fields in declaration order (args: cached, nsched copy, total,
 * drafts, structured, pending, spec tokens to schedule). */
static const Field so_fields[] = {
    {"scheduled_new_reqs", V_LIST, 0},
    {"scheduled_cached_reqs", V_ARG, 0},
    {"num_scheduled_tokens", V_ARG, 1},
    {"total_num_scheduled_tokens", V_ARG, 2},
    {"scheduled_spec_decode_tokens", V_ARG, 3},
    {"scheduled_encoder_inputs", V_DICT, 0},
    {"finished_req_ids", V_SET, 0},
    {"free_encoder_mm_hashes", V_LIST, 0},
    {"scheduled_encoder_input_stats", V_NONE, 0},
    {"preempted_req_ids", V_SET, 0},
    {"has_structured_output_requests", V_ARG, 4},
    {"pending_structured_output_tokens", V_ARG, 5},
    {"num_invalid_spec_tokens", V_NONE, 0},
    {"kv_connector_metadata", V_NONE, 0},
    {"has_sync_kv_loads", V_FALSE, 0},
    {"aux_output_connector_metadata", V_NONE, 0},
    {"ec_connector_metadata", V_NONE, 0},
    {"ec_manager_metadata", V_NONE, 0},
    {"new_block_ids_to_zero", V_NONE, 0},
    {"kv_cache_block_copies", V_NONE, 0},
    {"kv_connector_block_state", V_NONE, 0},
    {"num_spec_tokens_to_schedule", V_ARG, 6},
    {"num_common_prefix_blocks", V_LIST, 0},
};

#define N_CACHED (sizeof(cached_fields) / sizeof(cached_fields[0]))
#define N_SO (sizeof(so_fields) / sizeof(so_fields[0]))
static PyObject *cached_keys[N_CACHED], *so_keys[N_SO], *dict_key, *no_args;
/* every key mapped to None: a new instance dict is a copy (no resizes as it fills) */
static PyObject *cached_template, *so_template;

/* A dict of ``keys`` mapped to None (a new reference) or NULL with an exception set. */
static PyObject *
template(PyObject *const *keys, size_t n)
{
    PyObject *dict = PyDict_New();
    for (size_t i = 0; dict != NULL && i < n; i++) {
        if (PyDict_SetItem(dict, keys[i], Py_None) < 0) {
            Py_CLEAR(dict);
        }
    }
    return dict;
}

static int
intern_keys(void)
{
    if (no_args != NULL) {
        return 0;
    }
    for (size_t i = 0; i < N_CACHED; i++) {
        if ((cached_keys[i] = PyUnicode_InternFromString(cached_fields[i].name)) == NULL) {
            return -1;
        }
    }
    for (size_t i = 0; i < N_SO; i++) {
        if ((so_keys[i] = PyUnicode_InternFromString(so_fields[i].name)) == NULL) {
            return -1;
        }
    }
    if ((cached_template = template(cached_keys, N_CACHED)) == NULL
            || (so_template = template(so_keys, N_SO)) == NULL
            || (dict_key = PyUnicode_InternFromString("__dict__")) == NULL) {
        return -1;
    }
    no_args = PyTuple_New(0);
    return no_args == NULL ? -1 : 0;
}

/* A fresh value of ``field`` (a new reference) or NULL with an exception set. */
static PyObject *
value(const Field *field, PyObject *const *args)
{
    switch (field->kind) {
    case V_LIST: return PyList_New(0);
    case V_SET: return PySet_New(NULL);
    case V_DICT: return PyDict_New();
    case V_NONE: return Py_NewRef(Py_None);
    case V_FALSE: return Py_NewRef(Py_False);
    default: return Py_NewRef(args[field->arg]);
    }
}

/* An instance of ``cls`` (made by its __new__ without arguments, no __init__) whose
 * instance dict holds ``fields`` filled from ``args``; NULL with an exception set. */
static PyObject *
instance(PyObject *cls, const Field *fields, PyObject *const *keys, size_t n,
         PyObject *template, PyObject *const *args)
{
    PyObject *dict = PyDict_Copy(template);
    if (dict == NULL) {
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        if (fields[i].kind == V_NONE) {
            continue; /* the template's */
        }
        PyObject *v = value(&fields[i], args);
        if (v == NULL || PyDict_SetItem(dict, keys[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(dict);
            return NULL;
        }
        Py_DECREF(v);
    }
    PyObject *obj = ((PyTypeObject *)cls)->tp_new((PyTypeObject *)cls, no_args, NULL);
    if (obj == NULL || PyObject_SetAttr(obj, dict_key, dict) < 0) {
        Py_XDECREF(obj);
        obj = NULL;
    }
    Py_DECREF(dict);
    return obj;
}

/* step_output(CachedRequestData, SchedulerOutput, batch, nsched, new_blocks, computed,
 * outputs, total, drafts, structured, pending, nspec) -> SchedulerOutput | None:
 * QuickDecoder._assemble's objects (``batch`` and ``nsched`` copied, the other values
 * placed as given).  None unless both classes are types, ``batch`` a list and
 * ``nsched`` a dict. */
PyObject *
step_output(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *cached_cls, *so_cls, *batch, *nsched, *blocks, *computed, *outputs, *total,
             *drafts, *structured, *pending, *nspec;
    if (fast_args(args, nargs, "OOOOOOOOOOOO", &cached_cls, &so_cls, &batch, &nsched,
                          &blocks, &computed, &outputs, &total, &drafts, &structured, &pending,
                          &nspec) < 0 || intern_keys() < 0) {
        return NULL;
    }
    if (!PyType_Check(cached_cls) || !PyType_Check(so_cls) || !PyList_CheckExact(batch)
            || !PyDict_CheckExact(nsched)) {
        Py_RETURN_NONE;
    }
    PyObject *ids = PyList_GetSlice(batch, 0, PyList_GET_SIZE(batch));
    if (ids == NULL) {
        return NULL;
    }
    PyObject *cached_args[] = {ids, blocks, computed, outputs};
    PyObject *cached = instance(cached_cls, cached_fields, cached_keys, N_CACHED, cached_template,
                                cached_args);
    Py_DECREF(ids);
    PyObject *counts = cached == NULL ? NULL : PyDict_Copy(nsched), *so = NULL;
    if (counts != NULL) {
        PyObject *so_args[] = {cached, counts, total, drafts, structured, pending, nspec};
        so = instance(so_cls, so_fields, so_keys, N_SO, so_template, so_args);
    }
    Py_XDECREF(cached);
    Py_XDECREF(counts);
    return so;
}

PyMethodDef output_methods[] = {
    {"step_output", (PyCFunction)(void (*)(void))step_output, METH_FASTCALL,
     "The worker's same-batch SchedulerOutput in one call (None: not taken)."},
    {NULL, NULL, 0, NULL},
};
