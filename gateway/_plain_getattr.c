/* A policy model's attributes read as a plain object's: its type's attribute lookup set to CPython's generic one.
 *
 * pydantic's BaseModel defines __getattr__ (it serves private attributes and extras). CPython then routes every
 * attribute read of every model class through slot_tp_getattr_hook, and the interpreter never specializes those
 * reads (LOAD_ATTR specializes only types whose tp_getattro is PyObject_GenericGetAttr). The request path reads
 * about 60 policy fields a call: that cost ~33,000 instructions a request under callgrind. A Frozen model has
 * neither private attributes nor extras (gateway/frozen.py refuses them), so the generic lookup gives the same
 * answers, and AttributeError for a name it lacks. Optional, like the other extensions: without it the models
 * keep pydantic's hook (slower, same answers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyTypeObject *
heap_type(PyObject *cls)
{
    if (!PyType_Check(cls) || !PyType_HasFeature((PyTypeObject *)cls, Py_TPFLAGS_HEAPTYPE)) {
        PyErr_SetString(PyExc_TypeError, "a class defined in Python is required");
        return NULL;
    }
    return (PyTypeObject *)cls;
}

static PyObject *
use_generic_getattr(PyObject *module, PyObject *cls)
{
    PyTypeObject *type = heap_type(cls);
    if (type == NULL)
        return NULL;
    type->tp_getattro = PyObject_GenericGetAttr;
    PyType_Modified(type); /* the interpreter's caches keyed on the type's version start over */
    Py_RETURN_NONE;
}

static PyObject *
uses_generic_getattr(PyObject *module, PyObject *cls)
{
    PyTypeObject *type = heap_type(cls);
    if (type == NULL)
        return NULL;
    return PyBool_FromLong(type->tp_getattro == PyObject_GenericGetAttr);
}

static PyMethodDef methods[] = {
    {"use_generic_getattr", use_generic_getattr, METH_O,
     "Read this class's instance attributes with CPython's generic lookup (no __getattr__ fallback)."},
    {"uses_generic_getattr", uses_generic_getattr, METH_O,
     "Whether this class reads attributes with CPython's generic lookup."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_plain_getattr",
    "A policy model's attributes read as a plain object's (see gateway/frozen.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__plain_getattr(void)
{
    return PyModule_Create(&module);
}
