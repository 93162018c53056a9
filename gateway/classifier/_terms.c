/* A classifier's structured terms summed in C: gateway/classifier/inputs.py's compile_terms, as a table.
 *
 * The Python sum (one function compiled from the inputs' expressions) cost ~25,000 instructions a request under
 * callgrind for the default model's 23 terms: a float object made and freed at every step, log1p and float()
 * called through the interpreter. Here each term is a row: which object to read (the features or the cues),
 * which attribute, what to make of it (inputs.py's Source.op, the same operation its Python expression does),
 * then `z += slope * (clamp(value, low, high) - mean)` in the order given. Every step is the IEEE double operation
 * Python's float does (the sum is built with -ffp-contract=off: no fused multiply-add), so the result is the same
 * float as the Python sum, which tests/classifier/test_inputs.py checks on random values.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* inputs.py's Source.op codes, in this order (OPS there) */
enum op { OP_LOG1P, OP_LOG1P_OR_ZERO, OP_FLOAT, OP_IN, OP_MIN, OP_GTE, OP_VALUE, OP_EQ, OP_COUNT };

typedef struct {
    int reads_cues;     /* 0: the features, 1: the cues */
    PyObject *name;     /* the attribute (interned) */
    int op;
    PyObject *arg;      /* OP_IN's tuple, OP_EQ's string (a new reference); else NULL */
    double bound;       /* OP_MIN's and OP_GTE's number */
    double mean, slope, low, high;
} Term;

typedef struct {
    PyObject_HEAD
    Py_ssize_t count;
    Term *terms;
} Terms;

static void
Terms_dealloc(Terms *self)
{
    for (Py_ssize_t i = 0; i < self->count; i++) {
        Py_XDECREF(self->terms[i].name);
        Py_XDECREF(self->terms[i].arg);
    }
    PyMem_Free(self->terms);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
read_row(PyObject *row, Term *term)
{
    PyObject *name, *arg;
    if (!PyArg_ParseTuple(row, "pUiOdddd", &term->reads_cues, &name, &term->op, &arg, &term->mean, &term->slope,
                          &term->low, &term->high))
        return -1;
    if (term->op < 0 || term->op >= OP_COUNT) {
        PyErr_Format(PyExc_ValueError, "unknown operation %d for %R", term->op, name);
        return -1;
    }
    if (term->op == OP_IN && !PyTuple_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "the 'in' operation of %R needs a tuple", name);
        return -1;
    }
    if (term->op == OP_MIN || term->op == OP_GTE) {
        term->bound = PyFloat_AsDouble(arg);
        if (term->bound == -1.0 && PyErr_Occurred())
            return -1;
    }
    Py_INCREF(name);
    PyUnicode_InternInPlace(&name);
    term->name = name;
    if (term->op == OP_IN || term->op == OP_EQ) {
        Py_INCREF(arg);
        term->arg = arg;
    }
    return 0;
}

static PyObject *
Terms_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *rows;
    if (!PyArg_ParseTuple(args, "O!:Terms", &PyTuple_Type, &rows))
        return NULL;
    Terms *self = (Terms *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(rows);
    self->terms = PyMem_Calloc(n ? n : 1, sizeof(Term));
    if (self->terms == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (read_row(PyTuple_GET_ITEM(rows, i), &self->terms[i]) < 0) {
            Py_DECREF(self);
            return NULL;
        }
        self->count = i + 1;
    }
    return (PyObject *)self;
}

/* Python's math.log1p: a zero is returned as it is (its sign kept), as CPython does on every platform */
static double
py_log1p(double x)
{
    return x == 0.0 ? x : log1p(x);
}

/* float(value): the inputs read bools, ints and floats, taken here without PyFloat_AsDouble's detour (for an int
 * it makes a float object and frees it); anything else as float() takes it */
static int
as_double(PyObject *value, double *out)
{
    if (PyFloat_CheckExact(value)) {
        *out = PyFloat_AS_DOUBLE(value);
        return 0;
    }
    if (value == Py_True || value == Py_False) {
        *out = value == Py_True ? 1.0 : 0.0;
        return 0;
    }
    *out = PyLong_CheckExact(value) ? PyLong_AsDouble(value) : PyFloat_AsDouble(value);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static int
truth(int held, double *out)
{
    if (held < 0)
        return -1;
    *out = held ? 1.0 : 0.0;
    return 0;
}

/* The term's input value, as its Python expression in inputs.py computes it */
static int
input_value(const Term *term, PyObject *value, double *out)
{
    double v;
    switch (term->op) {
    case OP_LOG1P_OR_ZERO: /* log1p(max((x or 0), 0)) */
        if (value == Py_None) {
            *out = 0.0; /* log1p(0) */
            return 0;
        }
        /* fall through: a number's `or 0` is itself, 0 when it is 0 */
    case OP_LOG1P: /* log1p(0.0 if x < 0.0 else x) */
        if (as_double(value, &v) < 0)
            return -1;
        *out = py_log1p(v < 0.0 ? 0.0 : v);
        return 0;
    case OP_FLOAT:
    case OP_VALUE:
        return as_double(value, out);
    case OP_IN:
        return truth(PySequence_Contains(term->arg, value), out);
    case OP_EQ:
        return truth(PyObject_RichCompareBool(value, term->arg, Py_EQ), out);
    case OP_MIN: /* min(x, bound): bound only when it is smaller (a NaN x is kept, as min() keeps it) */
        if (as_double(value, &v) < 0)
            return -1;
        *out = term->bound < v ? term->bound : v;
        return 0;
    case OP_GTE:
        if (as_double(value, &v) < 0)
            return -1;
        *out = v >= term->bound ? 1.0 : 0.0;
        return 0;
    }
    PyErr_SetString(PyExc_SystemError, "unknown term operation");
    return -1;
}

static PyObject *
Terms_add(Terms *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add(features, cues, z) takes 3 arguments");
        return NULL;
    }
    double z;
    if (as_double(args[2], &z) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < self->count; i++) {
        const Term *term = &self->terms[i];
        PyObject *value = PyObject_GetAttr(args[term->reads_cues], term->name);
        if (value == NULL)
            return NULL;
        double v;
        int failed = input_value(term, value, &v);
        Py_DECREF(value);
        if (failed)
            return NULL;
        double clamped = v < term->low ? term->low : (v > term->high ? term->high : v);
        double centred = clamped - term->mean;
        double moved = term->slope * centred;
        z = z + moved;
    }
    return PyFloat_FromDouble(z);
}

static PyMethodDef Terms_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Terms_add, METH_FASTCALL,
     "add(features, cues, z): z plus every term's slope * (clamp(value, low, high) - mean), in order."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TermsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway.classifier._terms.Terms",
    .tp_basicsize = sizeof(Terms),
    .tp_dealloc = (destructor)Terms_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A model's terms as rows (reads_cues, attribute, op, arg, mean, slope, low, high).",
    .tp_methods = Terms_methods,
    .tp_new = Terms_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gateway.classifier._terms",
    .m_doc = "A classifier's structured terms summed in C (inputs.py's compile_terms).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__terms(void)
{
    if (PyType_Ready(&TermsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&TermsType);
    if (PyModule_AddObject(m, "Terms", (PyObject *)&TermsType) < 0) {
        Py_DECREF(&TermsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
