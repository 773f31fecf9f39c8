/* The allocator's per-page loops, compiled: `hold`, `share`, `release` and `pop_cold` of
   allocator.py's `PageAllocator` without the interpreter, on the allocator's own containers:
   `refcounts` (a list of ints, one per page), `is_cached` (a bytearray, one byte per page)
   and the cached queue's links `next` and `prev` (array('i') of num_pages + 1 entries, the
   last being the sentinel).

   The allocator's Python loops (`_share_in_python`, `_release_in_python`, `_pop_cold_in_python`
   and the loop of `_allocate`) are the reference; these do exactly what they do. Where the
   reference would raise (an id that is not a plain int, out of range, not held, freed more
   times than it is held), these change nothing and return None, and the allocator runs the
   reference, which raises the error that names the page. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SMALL_BATCH 32 /* ids a call sorts on the stack, by insertion */

/* The containers of one call, checked against each other. */
typedef struct {
    PyObject *refcounts;
    Py_ssize_t num_pages;
    unsigned char *is_cached;
    Py_buffer next_buf, prev_buf;
    int32_t *next, *prev;
    int32_t sentinel;
} Pages;

static int open_pages(Pages *p, PyObject *const *args) {
    p->refcounts = args[0];
    if (!PyList_CheckExact(p->refcounts) || !PyByteArray_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "expected refcounts (list) and is_cached (bytearray)");
        return -1;
    }
    p->num_pages = PyList_GET_SIZE(p->refcounts);
    p->is_cached = (unsigned char *)PyByteArray_AS_STRING(args[1]);
    if (PyByteArray_GET_SIZE(args[1]) != p->num_pages) {
        PyErr_SetString(PyExc_ValueError, "is_cached must have one byte per page");
        return -1;
    }
    if (PyObject_GetBuffer(args[2], &p->next_buf, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (PyObject_GetBuffer(args[3], &p->prev_buf, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&p->next_buf);
        return -1;
    }
    Py_ssize_t links = (p->num_pages + 1) * 4;
    if (p->next_buf.itemsize != 4 || p->prev_buf.itemsize != 4 || p->next_buf.len != links ||
        p->prev_buf.len != links) {
        PyErr_SetString(PyExc_ValueError, "next and prev must be int32 arrays of num_pages + 1");
        PyBuffer_Release(&p->next_buf);
        PyBuffer_Release(&p->prev_buf);
        return -1;
    }
    p->next = (int32_t *)p->next_buf.buf;
    p->prev = (int32_t *)p->prev_buf.buf;
    p->sentinel = (int32_t)p->num_pages;
    return 0;
}

static void close_pages(Pages *p) {
    PyBuffer_Release(&p->next_buf);
    PyBuffer_Release(&p->prev_buf);
}

static long count_of(Pages *p, Py_ssize_t page) {
    return PyLong_AsLong(PyList_GET_ITEM(p->refcounts, page));
}

static int set_count(Pages *p, Py_ssize_t page, long count) {
    PyObject *value = PyLong_FromLong(count);
    if (value == NULL) {
        return -1;
    }
    return PyList_SetItem(p->refcounts, page, value);  /* steals value, drops the old */
}

/* The id at `pages[i]` if it is a plain int in [0, num_pages), else -1. */
static Py_ssize_t page_at(Pages *p, PyObject *pages, Py_ssize_t i) {
    PyObject *item = PyList_GET_ITEM(pages, i);
    if (!PyLong_CheckExact(item)) {
        return -1;
    }
    Py_ssize_t page = PyLong_AsSsize_t(item);
    if (page == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return page < p->num_pages ? page : -1;
}

static int compare_ids(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* share(refcounts, is_cached, next, prev, pages) -> pages taken off the cached queue. */
static PyObject *share(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError, "share(refcounts, is_cached, next, prev, pages: list)");
        return NULL;
    }
    Pages p;
    if (open_pages(&p, args) < 0) {
        return NULL;
    }
    PyObject *pages = args[4];
    Py_ssize_t n = PyList_GET_SIZE(pages), revived = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t page = page_at(&p, pages, i);
        if (page < 0 || (count_of(&p, page) == 0 && !p.is_cached[page])) {
            close_pages(&p);
            Py_RETURN_NONE;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t page = page_at(&p, pages, i);
        long count = count_of(&p, page);
        if (count == 0) {  /* a cached page: held again, off the queue */
            int32_t before = p.prev[page], after = p.next[page];
            p.next[before] = after;
            p.prev[after] = before;
            revived++;
        }
        if (set_count(&p, page, count + 1) < 0) {
            close_pages(&p);
            return NULL;
        }
    }
    close_pages(&p);
    return PyLong_FromSsize_t(revived);
}

/* Sort `n` ids ascending: by insertion when few (no call per comparison), else qsort. */
static void sort_ids(int32_t *ids, Py_ssize_t n) {
    if (n > SMALL_BATCH) {
        qsort(ids, n, sizeof(int32_t), compare_ids);
        return;
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        int32_t id = ids[i];
        Py_ssize_t j = i;
        for (; j > 0 && ids[j - 1] > id; j--) {
            ids[j] = ids[j - 1];
        }
        ids[j] = id;
    }
}

/* 1 if some id of `ids` (valid ones) is listed more times than it is held, 0 if none is, -1
   with MemoryError set. Ids that only rise or only fall (as a page table's usually do) are
   distinct; only others are sorted, in a copy, and counted. */
static int repeats_exceed_counts(Pages *p, const int32_t *ids, Py_ssize_t n) {
    int rising = 1, falling = 1;
    for (Py_ssize_t i = 1; i < n; i++) {
        rising &= ids[i] > ids[i - 1];
        falling &= ids[i] < ids[i - 1];
    }
    if (rising || falling) {
        return 0;
    }
    int32_t small[SMALL_BATCH];
    int32_t *sorted = n > SMALL_BATCH ? PyMem_Malloc(n * sizeof(int32_t)) : small;
    if (sorted == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(sorted, ids, n * sizeof(int32_t));
    sort_ids(sorted, n);
    int exceed = 0;
    for (Py_ssize_t i = 0, run = 1; i < n; i++, run++) {
        if (i + 1 == n || sorted[i + 1] != sorted[i]) {
            exceed |= run > count_of(p, sorted[i]);
            run = 0;
        }
    }
    if (sorted != small) {
        PyMem_Free(sorted);
    }
    return exceed;
}

/* release(refcounts, is_cached, next, prev, pages) -> (released, queued): drop one
   reference per listed page; pages left with none go to the cached queue's warm end if
   cached (the first to reach 0 warmest), else into `released`, in the order they reached 0. */
static PyObject *release(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError, "release(refcounts, is_cached, next, prev, pages: list)");
        return NULL;
    }
    Pages p;
    if (open_pages(&p, args) < 0) {
        return NULL;
    }
    PyObject *pages = args[4], *released = NULL, *result = NULL;
    Py_ssize_t n = PyList_GET_SIZE(pages), num_queued = 0;
    int32_t small[SMALL_BATCH];  /* the ids, then (a prefix of it) the ids to queue */
    int32_t *ids = n > SMALL_BATCH ? PyMem_Malloc(n * sizeof(int32_t)) : small;
    if (ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t page = page_at(&p, pages, i);
        if (page < 0 || count_of(&p, page) <= 0) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        ids[i] = (int32_t)page;
    }
    int exceed = repeats_exceed_counts(&p, ids, n);
    if (exceed != 0) {
        result = exceed < 0 ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    released = PyList_New(0);
    if (released == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t page = ids[i];
        long count = count_of(&p, page) - 1;
        if (set_count(&p, page, count) < 0) {
            goto done;
        }
        if (count == 0) {
            if (p.is_cached[page]) {
                ids[num_queued++] = page;
            } else if (PyList_Append(released, PyList_GET_ITEM(pages, i)) < 0) {
                goto done;
            }
        }
    }
    for (Py_ssize_t i = num_queued - 1; i >= 0; i--) {  /* the first to reach 0 goes last */
        int32_t page = ids[i], last = p.prev[p.sentinel];
        p.next[last] = page;
        p.prev[page] = last;
        p.next[page] = p.sentinel;
        p.prev[p.sentinel] = page;
    }
    PyObject *count = PyLong_FromSsize_t(num_queued);
    result = count == NULL ? NULL : PyTuple_Pack(2, released, count);
    Py_XDECREF(count);
done:
    if (ids != small) {
        PyMem_Free(ids);
    }
    Py_XDECREF(released);
    close_pages(&p);
    return result;
}

/* pop_cold(refcounts, is_cached, next, prev, n) -> the n coldest queued pages, coldest first, off the
   queue and no longer marked cached; n must not exceed the queue's length. */
static PyObject *pop_cold(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "pop_cold(refcounts, is_cached, next, prev, n)");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[4]);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Pages p;
    if (open_pages(&p, args) < 0) {
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        close_pages(&p);
        return NULL;
    }
    int32_t page = p.next[p.sentinel];
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyLong_FromLong(page);
        if (id == NULL) {
            Py_DECREF(out);
            close_pages(&p);
            return NULL;
        }
        PyList_SET_ITEM(out, i, id);
        p.is_cached[page] = 0;
        page = p.next[page];
    }
    p.next[p.sentinel] = page;
    p.prev[page] = p.sentinel;
    close_pages(&p);
    return out;
}

/* hold(refcounts, pages) -> True: give each listed page (free, count 0) its first reference;
   None, changing nothing, for an id that is not a plain int in range. */
static PyObject *hold(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "hold(refcounts: list, pages: list)");
        return NULL;
    }
    PyObject *refcounts = args[0], *pages = args[1];
    Py_ssize_t num_pages = PyList_GET_SIZE(refcounts), n = PyList_GET_SIZE(pages);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(pages, i);
        Py_ssize_t page = PyLong_CheckExact(item) ? PyLong_AsSsize_t(item) : -1;
        if (page < 0 || page >= num_pages) {
            PyErr_Clear();
            Py_RETURN_NONE;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t page = PyLong_AsSsize_t(PyList_GET_ITEM(pages, i));
        if (PyList_SetItem(refcounts, page, PyLong_FromLong(1)) < 0) {
            return NULL;
        }
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"hold", (PyCFunction)(void (*)(void))hold, METH_FASTCALL,
     "Reference count 1 for each listed page: True; None if an id is invalid."},
    {"share", (PyCFunction)(void (*)(void))share, METH_FASTCALL,
     "One more reference per listed page, cached ones taken off the queue; None if invalid."},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL,
     "One reference less per listed page: (released, queued); None if invalid."},
    {"pop_cold", (PyCFunction)(void (*)(void))pop_cold, METH_FASTCALL,
     "The n coldest cached pages, taken off the queue and unmarked."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pages", "The allocator's per-page loops, compiled (see allocator.py).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__pages(void) {
    return PyModule_Create(&module);
}
