/* Shared by the source files of the optional C kernels (protocol/_kernels*.c, one
 * module, protocol._kernels): the tables of functions _kernels.c adds to the module. */
#ifndef DELTACAST_KERNELS_H
#define DELTACAST_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

extern PyMethodDef rows_methods[];  /* _kernels_rows.c: row scans of integer arrays */
extern PyMethodDef lists_methods[]; /* _kernels_lists.c: one-item lists, dict order */
extern PyMethodDef terms_methods[]; /* _kernels_terms.c: per-row sums of mixed terms */

#endif
