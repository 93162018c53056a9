/* A span's attributes as OTLP JSON text in C: the hot half of _attributes_json in gateway/telemetry/otlp.py.
 *
 * Why: a request span's ~14 attributes cost ~50k instructions to encode in Python (a dict lookup, a tuple hash
 * and an f-string each), most of what a span costs the gateway; here one pass writes them into one buffer.
 *
 * otlp._python_attributes_json is the reference this must agree with exactly (tests/telemetry/test_otlp_native.py):
 * str values as stringValue, bool as boolValue, int as intValue (a string, as protobuf's JSON mapping has it),
 * float as doubleValue (repr, or "NaN"/"Infinity"/"-Infinity"), tuples and lists as arrayValue. A mapping with
 * any other key or value type (a subclass included) gets None: the Python encoder then writes all of it.
 * Strings are escaped as json.encoder.encode_basestring_ascii does; any string that needs an escape is handed
 * to that very function (given to `encoder`), so the two can only agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

typedef struct {
    char *data;
    Py_ssize_t size;
    Py_ssize_t capacity;
} Buffer;

static int buffer_reserve(Buffer *b, Py_ssize_t more) {
    if (b->size + more <= b->capacity) {
        return 0;
    }
    Py_ssize_t capacity = b->capacity ? b->capacity : 512;
    while (capacity < b->size + more) {
        capacity *= 2;
    }
    char *grown = PyMem_Realloc(b->data, (size_t)capacity);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = grown;
    b->capacity = capacity;
    return 0;
}

static int put(Buffer *b, const char *text, Py_ssize_t length) {
    if (buffer_reserve(b, length) < 0) {
        return -1;
    }
    memcpy(b->data + b->size, text, (size_t)length);
    b->size += length;
    return 0;
}

#define PUT_LITERAL(b, literal) put((b), (literal), (Py_ssize_t)(sizeof(literal) - 1))

/* An ASCII str object's text (any str: the caller knows it is ASCII). */
static int put_ascii_str(Buffer *b, PyObject *ascii) {
    return put(b, (const char *)PyUnicode_DATA(ascii), PyUnicode_GET_LENGTH(ascii));
}

typedef struct {
    PyObject *encoder; /* json.encoder.encode_basestring_ascii */
} Encoder;

/* A JSON string literal: written directly when no character needs an escape, else by the encoder. */
static int put_json_string(Buffer *b, Encoder *enc, PyObject *text) {
    if (PyUnicode_IS_ASCII(text)) {
        const unsigned char *chars = PyUnicode_1BYTE_DATA(text);
        Py_ssize_t n = PyUnicode_GET_LENGTH(text), i = 0;
        while (i < n && chars[i] >= 0x20 && chars[i] < 0x7f && chars[i] != '"' && chars[i] != '\\') {
            i++;
        }
        if (i == n) {
            if (buffer_reserve(b, n + 2) < 0) {
                return -1;
            }
            b->data[b->size++] = '"';
            memcpy(b->data + b->size, chars, (size_t)n);
            b->size += n;
            b->data[b->size++] = '"';
            return 0;
        }
    }
    PyObject *escaped = PyObject_CallOneArg(enc->encoder, text);
    if (escaped == NULL) {
        return -1;
    }
    int ok = PyUnicode_Check(escaped) && PyUnicode_IS_ASCII(escaped) ? put_ascii_str(b, escaped) : -2;
    Py_DECREF(escaped);
    if (ok == -2) {
        PyErr_SetString(PyExc_TypeError, "the string encoder must return ASCII text");
        return -1;
    }
    return ok;
}

/* str(x) of an exact int or repr(x) of an exact float: ASCII text. */
static int put_text_of(Buffer *b, PyObject *number, PyObject *(*text_of)(PyObject *)) {
    PyObject *text = text_of(number);
    if (text == NULL) {
        return -1;
    }
    int ok = put_ascii_str(b, text);
    Py_DECREF(text);
    return ok;
}

enum { WRITTEN = 0, FAILED = -1, UNSUPPORTED = 1 };

/* _value_json of one value; UNSUPPORTED for a type the Python encoder alone writes (nothing useful is left in b). */
static int put_value(Buffer *b, Encoder *enc, PyObject *value, int depth) {
    PyTypeObject *type = Py_TYPE(value);
    if (type == &PyUnicode_Type) {
        if (PUT_LITERAL(b, "{\"stringValue\":") < 0 || put_json_string(b, enc, value) < 0) {
            return FAILED;
        }
        return PUT_LITERAL(b, "}");
    }
    if (type == &PyBool_Type) {
        return value == Py_True ? PUT_LITERAL(b, "{\"boolValue\":true}") : PUT_LITERAL(b, "{\"boolValue\":false}");
    }
    if (type == &PyLong_Type) {
        if (PUT_LITERAL(b, "{\"intValue\":\"") < 0 || put_text_of(b, value, PyObject_Str) < 0) {
            return FAILED;
        }
        return PUT_LITERAL(b, "\"}");
    }
    if (type == &PyFloat_Type) {
        double x = PyFloat_AS_DOUBLE(value);
        if (PUT_LITERAL(b, "{\"doubleValue\":") < 0) {
            return FAILED;
        }
        int ok;
        if (isnan(x)) {
            ok = PUT_LITERAL(b, "\"NaN\"");
        } else if (isinf(x)) {
            ok = x > 0 ? PUT_LITERAL(b, "\"Infinity\"") : PUT_LITERAL(b, "\"-Infinity\"");
        } else {
            ok = put_text_of(b, value, PyObject_Repr);
        }
        return ok < 0 ? FAILED : PUT_LITERAL(b, "}");
    }
    if (type == &PyTuple_Type || type == &PyList_Type) {
        if (depth > 16) {
            return UNSUPPORTED; /* the Python encoder recurses as deep as it must */
        }
        if (PUT_LITERAL(b, "{\"arrayValue\":{\"values\":[") < 0) {
            return FAILED;
        }
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(value); i++) {
            if (i > 0 && PUT_LITERAL(b, ",") < 0) {
                return FAILED;
            }
            PyObject *item = PySequence_Fast_GET_ITEM(value, i); /* borrowed; a list may change: re-read size */
            Py_INCREF(item);
            int ok = put_value(b, enc, item, depth + 1);
            Py_DECREF(item);
            if (ok != WRITTEN) {
                return ok;
            }
        }
        return PUT_LITERAL(b, "]}}");
    }
    return UNSUPPORTED;
}

static PyObject *attributes_json(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "attributes_json(attributes, encoder) takes 2 arguments");
        return NULL;
    }
    PyObject *attributes = args[0];
    Encoder enc = {args[1]};
    if (!PyDict_CheckExact(attributes)) {
        Py_RETURN_NONE;
    }
    Buffer b = {NULL, 0, 0};
    int status = PUT_LITERAL(&b, "[") < 0 ? FAILED : WRITTEN;
    Py_ssize_t position = 0, written = 0;
    PyObject *key, *value;
    while (status == WRITTEN && PyDict_Next(attributes, &position, &key, &value)) {
        if (Py_TYPE(key) != &PyUnicode_Type) {
            status = UNSUPPORTED;
            break;
        }
        Py_INCREF(key);
        Py_INCREF(value);
        if ((written++ > 0 && PUT_LITERAL(&b, ",") < 0) || PUT_LITERAL(&b, "{\"key\":") < 0 ||
            put_json_string(&b, &enc, key) < 0 || PUT_LITERAL(&b, ",\"value\":") < 0) {
            status = FAILED;
        } else {
            status = put_value(&b, &enc, value, 0);
            if (status == WRITTEN && PUT_LITERAL(&b, "}") < 0) {
                status = FAILED;
            }
        }
        Py_DECREF(key);
        Py_DECREF(value);
    }
    PyObject *result = NULL;
    if (status == WRITTEN && PUT_LITERAL(&b, "]") == 0) {
        result = PyUnicode_DecodeASCII(b.data, b.size, "strict");
    } else if (status == UNSUPPORTED) {
        result = Py_NewRef(Py_None);
    }
    PyMem_Free(b.data);
    return result;
}

static PyMethodDef methods[] = {
    {"attributes_json", (PyCFunction)(void (*)(void))attributes_json, METH_FASTCALL,
     "attributes_json(attributes, encoder) -> str | None: OTLP JSON of a dict of attributes, equal to\n"
     "otlp._python_attributes_json; None for a mapping or value type only the Python encoder writes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_otlp_attributes",
    "A span's attributes as OTLP JSON text (gateway/telemetry/_otlp_attributes.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__otlp_attributes(void) { return PyModule_Create(&module); }
