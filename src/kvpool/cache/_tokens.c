/* Packing token ids, compiled: the loop of tokens.pack_tokens without the interpreter.

   pack_list(ids) takes a list of plain ints and returns them packed as tokens.py packs them,
   little-endian int32, 4 bytes a token. For a list holding anything else (an int subclass,
   a numpy integer, an id outside int32) it returns None, and tokens.py takes its portable
   path, which either packs the list or names the bad id. Only exact ints are read, and
   reading them runs no Python code, so the list cannot change under the loop. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *pack_list(PyObject *module, PyObject *ids) {
    if (!PyList_CheckExact(ids)) {
        PyErr_SetString(PyExc_TypeError, "pack_list takes a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ids);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = PyList_GET_ITEM(ids, i);
        if (!PyLong_CheckExact(id)) {
            goto portable;
        }
        int overflow;
        long value = PyLong_AsLongAndOverflow(id, &overflow);
        if (overflow || value < INT32_MIN || value > INT32_MAX) {
            goto portable;
        }
        uint32_t bits = (uint32_t)(int32_t)value;
        dst[0] = (unsigned char)bits;
        dst[1] = (unsigned char)(bits >> 8);
        dst[2] = (unsigned char)(bits >> 16);
        dst[3] = (unsigned char)(bits >> 24);
        dst += 4;
    }
    return out;
portable: /* not a plain int32 id: tokens.py packs the list, or names the bad id */
    Py_DECREF(out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"pack_list", pack_list, METH_O,
     "A list of int32 ids packed little-endian; None if one is not a plain int in int32."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tokens", "Token id packing, compiled (see tokens.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__tokens(void) {
    return PyModule_Create(&module);
}
