/* Shared by the C speedups' source files (protocol/_speedups*.c, one module). */
#ifndef DELTACAST_SPEEDUPS_H
#define DELTACAST_SPEEDUPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* 0 and the value of an exact int in the int64 range; -1 otherwise.  Ints of one
 * internal digit (the counts and ids of a step) are read inline. */
static inline int
as_i64(PyObject *item, long long *out)
{
    if (!PyLong_CheckExact(item)) {
        return -1;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        *out = (long long)PyUnstable_Long_CompactValue((PyLongObject *)item);
        return 0;
    }
#else
    Py_ssize_t digits = Py_SIZE(item);
    if (digits >= -1 && digits <= 1) { /* 3.11's layout: the sign is the size's */
        *out = digits == 0 ? 0 : digits * (long long)((PyLongObject *)item)->ob_digit[0];
        return 0;
    }
#if PYLONG_BITS_IN_DIGIT == 30
    if (digits == 2 || digits == -2 || digits == 3 || digits == -3) { /* below 2**90 */
        const digit *d = ((PyLongObject *)item)->ob_digit;
        if (digits == 2 || digits == -2 || d[2] < 8) { /* (2**63 and up: the call below) */
            uint64_t mag = (uint64_t)d[0] | ((uint64_t)d[1] << 30)
                | (digits == 3 || digits == -3 ? (uint64_t)d[2] << 60 : 0);
            *out = digits > 0 ? (long long)mag : -(long long)mag;
            return 0;
        }
    }
#endif
#endif
    int overflow = 0;
    *out = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

/* 0 and the value for an exact non-negative int below 2**64; -1 otherwise. */
static inline int
as_u64(PyObject *item, uint64_t *out)
{
    long long v;
    if (as_i64(item, &v) == 0) {
        if (v < 0) {
            return -1;
        }
        *out = (uint64_t)v;
        return 0;
    }
    if (!PyLong_CheckExact(item)) {
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    /* 3.11's layout: 2**63 and up (the digest's keys) take three 30-bit digits, read
     * inline (PyLong_AsUnsignedLongLong goes through a byte array) */
    if (Py_SIZE(item) == 3) {
        const digit *d = ((PyLongObject *)item)->ob_digit;
        if (d[2] < 16) {
            *out = (uint64_t)d[0] | ((uint64_t)d[1] << 30) | ((uint64_t)d[2] << 60);
            return 0;
        }
        return -1; /* 2**64 or more */
    }
#endif
    unsigned long long u = PyLong_AsUnsignedLongLong(item); /* 2**63 and up */
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear(); /* negative, or 2**64 or more */
        return -1;
    }
    *out = (uint64_t)u;
    return 0;
}

/* 1 for an exact int other than 0 (num_spec_tokens_to_schedule set), else 0. */
static inline int
nonzero_int(PyObject *item)
{
    long long v;
    return PyLong_CheckExact(item) && (as_i64(item, &v) < 0 || v != 0);
}

/* 1 when x departs from its forecast: x != y + z, or (clamped) x != max(y - z, 0). */
static inline int
departs(long long x, long long y, long long z, int clamp)
{
    __int128 want = clamp ? (__int128)y - z : (__int128)y + z;
    return (__int128)x != (clamp && want < 0 ? 0 : want);
}

/* _speedups_lists.c's dict_matches as an int (-2: not taken, -1: an exception is set)
 * and one_group_appends, _speedups.c's packers and _speedups_step.c's packed_appends,
 * for the fused same-step functions of _speedups_step.c, _speedups_counts.c and
 * _speedups_fused.c. */
int dict_match(PyObject *d, PyObject *keys, PyObject *values);
PyObject *one_group_appends(PyObject *self, PyObject *arg);
PyObject *pack_list(PyObject *self, PyObject *arg);
PyObject *pack_values(const uint64_t *values, Py_ssize_t n);
PyObject *pack_plus_one(PyObject *self, PyObject *arg);
PyObject *packed_appends(PyObject *appends, PyObject *handles); /* _speedups_step.c's */

/* The METH_FASTCALL functions the fused ones call as fn(NULL, (PyObject *[]){...}, n), no
 * argument tuple made: _speedups_lists.c's draft_rows and split_rows, _speedups_output.c's
 * step_output, _speedups_counts.c's count_rows, count_lists and lane_rows,
 * _speedups_lane.c's lane_counts and _speedups_step.c's append_rows. */
#define FAST_PARAMS PyObject *self, PyObject *const *args, Py_ssize_t nargs
PyObject *draft_rows(FAST_PARAMS);
PyObject *split_rows(FAST_PARAMS);
PyObject *step_output(FAST_PARAMS);
PyObject *count_rows(FAST_PARAMS);
PyObject *count_lists(FAST_PARAMS);
PyObject *lane_rows(FAST_PARAMS);
PyObject *lane_counts(FAST_PARAMS);
PyObject *append_rows(FAST_PARAMS);

/* PyArg_ParseTuple of a METH_FASTCALL function's arguments for the codes the module
 * uses: O, O! (a type check, subclasses included), n (Py_ssize_t), K (unsigned long long,
 * masked) and p (truth); exactly as many arguments as codes.  0, or -1 with an exception
 * set (TypeError, OverflowError, or what a truth test raised). */
int fast_args(PyObject *const *args, Py_ssize_t nargs, const char *format, ...);
/* _speedups_buffers.c's: a C-contiguous buffer of a given shape, item size and format
 * (0 or -1). */
int typed_buffer(PyObject *obj, Py_buffer *view, int writable, int ndim, Py_ssize_t itemsize,
                 const char *formats);

/* The list of a packed array (raw_list: zigzag 0; raw_signed_list: 1; raw_list_minus_one:
 * 2), at most 2**26 values: a new reference, Py_None when not taken, NULL with an
 * exception set. */
PyObject *unpack_bytes(PyObject *packed, int zigzag);
enum { RAW, SIGNED, MINUS_ONE }; /* unpack_bytes' zigzag */
/* _speedups.c's: the width, count and payload offset of a well-formed packed array of at
 * most ``limit`` values (0), or -1 (and for a limit past 2**56). */
int read_header(const unsigned char *buf, Py_ssize_t len, uint64_t limit, int *width,
                uint64_t *count, Py_ssize_t *pos);
/* The next value ``z`` of a packed array's payload read from ``p`` (advanced) through the
 * bit accumulator ``acc`` holding ``bits`` bits, for read_header's ``width`` and its
 * ``mask``; never past the payload when the caller takes at most the header's count
 * (read_header checked its length).  A macro: the loop keeps its state in registers. */
#define NEXT_PACKED(z, p, acc, bits, width, mask)                      \
    do {                                                               \
        while ((bits) < (width)) {                                     \
            (acc) |= (unsigned __int128)(*(p)++) << (bits);            \
            (bits) += 8;                                               \
        }                                                              \
        (z) = (width) ? (uint64_t)(acc) & (mask) : 0;                  \
        (acc) >>= (width);                                             \
        (bits) -= (width);                                             \
    } while (0)

/* The SchedulerOutput attributes the same-batch steps read (_speedups_step.c's
 * plain_check, _speedups_fused.c's same_batch_scan): attrs[a] once intern_attrs() has
 * returned 0 (-1 with an exception set). */
enum { A_CACHED, A_NEW_BLOCKS, A_REQ_IDS, A_SPEC, A_TOTAL, A_NSPEC, A_NSCHED, A_COMPUTED,
       A_OUTPUTS, A_STRUCTURED, A_PENDING, A_COUNT };
extern PyObject *attrs[A_COUNT];
int intern_attrs(void);

/* Whether a step's rare fields equal ``plain`` as ``tuple == tuple`` compares them: 1,
 * 0 when they do not, -1 with an exception set (_speedups_step.c's).  ``rare`` names
 * them -- a tuple of attribute names of ``so``, a (name, name) pair naming an attribute
 * of one of its attributes -- and they are read until the first that differs; any
 * other ``rare`` is called: rare(so) == plain. */
int rare_equal(PyObject *so, PyObject *rare, PyObject *plain);

/* Field j (0 handles, 1 counts, 2 values) of a Rows, or of the (handles, counts, values)
 * tuple of bytes that lane_view reads in its place: a new reference, NULL with an
 * exception set; _speedups_counts.c's. */
PyObject *rows_item(PyObject *rows, int j);

/* The arguments of _speedups_digest.c's plan_rows: one KV group's appends and the lane's
 * lists (see plan_rows). */
typedef struct {
    PyObject *pos, *counts, *ids, *handles, *lengths;
    unsigned long long salt, k_block, k_pos, k_handle;
    int check;
} PlanArgs;

/* plan_rows' plan of ``a`` (its total in *total; Py_None when not taken, NULL with an
 * exception set), and lane_append's commit of a plan taken (0, or -1 with an exception
 * set), for the steady lane's fused step in _speedups_lane.c. */
PyObject *plan_lists(const PlanArgs *a, uint64_t *total);
int grow_lengths(const PlanArgs *a);

/* The tables of functions of the other protocol/_speedups_*.c files, added to the
 * module at import (_speedups.c's PyInit__speedups). */
extern PyMethodDef step_methods[];
extern PyMethodDef output_methods[];
extern PyMethodDef lane_methods[];
extern PyMethodDef counts_methods[];
extern PyMethodDef buffers_methods[];
extern PyMethodDef digest_methods[];
extern PyMethodDef lists_methods[];
extern PyMethodDef rows_methods[];
extern PyMethodDef fused_methods[];
extern PyMethodDef frame_methods[];
extern PyMethodDef view_methods[];
extern PyMethodDef absorb_methods[];

/* msgpack writers (_speedups_frame.c's): an unsigned int in msgspec's shortest form, and
 * a bytes object (under 4 GiB) as bin; the bytes written. */
Py_ssize_t put_uint(unsigned char *o, unsigned long long v);
Py_ssize_t put_bin(unsigned char *o, PyObject *bin);
/* Writes a Delta frame's head: [4, epoch, seq, digest (``head``), and the body's map16
 * header of ``entries``; the bytes written (the header is the last 3). */
Py_ssize_t put_delta_head(unsigned char *o, const uint64_t *head, int entries);
/* The Delta frame written in ``o`` (PyMem_Malloc'd, freed here; ``at`` bytes, the body's
 * map16 header of ``entries`` at ``body``) as bytes, that header made a fixmap when the
 * frame is at most codec.COMPACT_LIMIT bytes (compact_delta_map); NULL with an exception
 * set. */
PyObject *delta_frame(unsigned char *o, Py_ssize_t at, Py_ssize_t body, int entries);

/* The Delta body entries of a same-batch step with count rows, in DeltaBody's field
 * order (nt, nc, ba, sp, so, ps, ns, x): lane_frame writes them, lane_view reads them. */
enum { E_NT, E_NC, E_BA, E_SP, E_SO, E_PS, E_NS, E_X, E_COUNT };
extern const char *const entry_keys[E_COUNT]; /* their keys (_speedups_frame.c's) */


#endif
