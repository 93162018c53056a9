/* A request span as OTLP JSON text in C: span_text and _attributes_json of gateway/telemetry/otlp.py.
 *
 * Why: encoding a request span in Python cost ~100k instructions (per attribute a dict lookup, a tuple hash
 * and an f-string; the ids' hex, the kind's enum property), more than the rest of what a span costs the gateway;
 * here one pass writes the span into one buffer.
 *
 * otlp._python_span_text and _python_attributes_json are the references this must agree with exactly
 * (tests/telemetry/test_otlp_native.py). Attributes:
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

/* The ASCII characters a JSON string holds as they are (encode_basestring_ascii escapes the others): one table
 * lookup a character rather than four comparisons. Filled at import. */
static unsigned char plain_char[128];

static void fill_plain_chars(void) {
    for (int c = 0x20; c < 0x7f; c++) {
        plain_char[c] = c != '"' && c != '\\';
    }
}

/* A JSON string literal: written directly when no character needs an escape, else by the encoder. */
static int put_json_string(Buffer *b, Encoder *enc, PyObject *text) {
    if (PyUnicode_IS_ASCII(text)) {
        const unsigned char *chars = PyUnicode_1BYTE_DATA(text);
        Py_ssize_t n = PyUnicode_GET_LENGTH(text), i = 0;
        while (i < n && plain_char[chars[i]]) { /* an ASCII str's characters are all below 128 */
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

/* The attributes array into b: WRITTEN, FAILED (an exception is set) or UNSUPPORTED. */
static int put_attributes(Buffer *b, Encoder *enc, PyObject *attributes) {
    if (!PyDict_CheckExact(attributes)) {
        return UNSUPPORTED;
    }
    if (PUT_LITERAL(b, "[") < 0) {
        return FAILED;
    }
    int status = WRITTEN;
    Py_ssize_t position = 0, written = 0;
    PyObject *key, *value;
    while (status == WRITTEN && PyDict_Next(attributes, &position, &key, &value)) {
        if (Py_TYPE(key) != &PyUnicode_Type) {
            return UNSUPPORTED;
        }
        Py_INCREF(key);
        Py_INCREF(value);
        if ((written++ > 0 && PUT_LITERAL(b, ",") < 0) || PUT_LITERAL(b, "{\"key\":") < 0 ||
            put_json_string(b, enc, key) < 0 || PUT_LITERAL(b, ",\"value\":") < 0) {
            status = FAILED;
        } else {
            status = put_value(b, enc, value, 0);
            if (status == WRITTEN && PUT_LITERAL(b, "}") < 0) {
                status = FAILED;
            }
        }
        Py_DECREF(key);
        Py_DECREF(value);
    }
    return status != WRITTEN ? status : PUT_LITERAL(b, "]");
}

/* The buffer as a str when written, None when unsupported, NULL on an error; the buffer is freed. */
static PyObject *finish(Buffer *b, int status) {
    PyObject *result = NULL;
    if (status == WRITTEN) {
        result = PyUnicode_DecodeASCII(b->data, b->size, "strict");
    } else if (status == UNSUPPORTED) {
        result = Py_NewRef(Py_None);
    }
    PyMem_Free(b->data);
    return result;
}

static PyObject *attributes_json(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "attributes_json(attributes, encoder) takes 2 arguments");
        return NULL;
    }
    Encoder enc = {args[1]};
    Buffer b = {NULL, 0, 0};
    return finish(&b, put_attributes(&b, &enc, args[0]));
}

/* An id as `digits` lower-case hex digits, as Python's format(id, "0<digits>x") writes one below 16**digits;
 * UNSUPPORTED for anything else (an id that is not an exact int, negative or too wide). */
static int put_hex_id(Buffer *b, PyObject *id, int digits) {
    if (Py_TYPE(id) != &PyLong_Type || _PyLong_Sign(id) < 0 || _PyLong_NumBits(id) > (size_t)digits * 4) {
        if (PyErr_Occurred()) {
            return FAILED;
        }
        return UNSUPPORTED;
    }
    unsigned long long low = PyLong_AsUnsignedLongLongMask(id), high = 0;
    if (digits > 16) {
        PyObject *shift = PyLong_FromLong(64), *upper = shift ? PyNumber_Rshift(id, shift) : NULL;
        Py_XDECREF(shift);
        if (upper == NULL) {
            return FAILED;
        }
        high = PyLong_AsUnsignedLongLongMask(upper);
        Py_DECREF(upper);
    }
    if (buffer_reserve(b, digits) < 0) {
        return FAILED;
    }
    /* zero-padded lower-case hex, as "%016llx%016llx" / "%0*llx" write it, without printf's machinery */
    char *out = b->data + b->size;
    for (int i = digits - 1; i >= 0; i--) {
        unsigned long long word = i >= digits - 16 ? low : high;
        int shift = 4 * ((digits - 1 - i) % 16);
        out[i] = "0123456789abcdef"[(word >> shift) & 0xf];
    }
    b->size += digits;
    return WRITTEN;
}

/* An exact int that fits a long long, in decimal; UNSUPPORTED otherwise. */
static int put_decimal(Buffer *b, PyObject *number) {
    if (Py_TYPE(number) != &PyLong_Type) {
        return UNSUPPORTED;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(number, &overflow);
    if (overflow || (value == -1 && PyErr_Occurred())) {
        return PyErr_Occurred() ? FAILED : UNSUPPORTED;
    }
    /* "%lld" without printf's machinery: digits from the right, through the unsigned magnitude (LLONG_MIN too) */
    char text[24];
    char *end = text + sizeof text, *at = end;
    unsigned long long magnitude = value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value;
    do {
        *--at = (char)('0' + magnitude % 10);
        magnitude /= 10;
    } while (magnitude);
    if (value < 0) {
        *--at = '-';
    }
    return put(b, at, end - at) < 0 ? FAILED : WRITTEN;
}

#define STEP(call)                  \
    do {                            \
        int step_status = (call);   \
        if (step_status != WRITTEN) \
            return step_status;     \
    } while (0)
#define LITERAL(b, literal) STEP(PUT_LITERAL((b), (literal)) < 0 ? FAILED : WRITTEN)

static int put_span(Buffer *b, Encoder *enc, PyObject *const *args) {
    PyObject *trace_id = args[0], *span_id = args[1], *name = args[2], *kind = args[3], *start_ns = args[4],
             *end_ns = args[5], *attributes = args[6], *parent_span_id = args[7], *error = args[8];
    if (Py_TYPE(name) != &PyUnicode_Type || (error != Py_None && Py_TYPE(error) != &PyUnicode_Type)) {
        return UNSUPPORTED;
    }
    LITERAL(b, "{\"traceId\":\"");
    STEP(put_hex_id(b, trace_id, 32));
    LITERAL(b, "\",\"spanId\":\"");
    STEP(put_hex_id(b, span_id, 16));
    LITERAL(b, "\",\"name\":");
    STEP(put_json_string(b, enc, name) < 0 ? FAILED : WRITTEN);
    LITERAL(b, ",\"kind\":");
    STEP(put_decimal(b, kind));
    LITERAL(b, ",\"startTimeUnixNano\":\"");
    STEP(put_decimal(b, start_ns));
    LITERAL(b, "\",\"endTimeUnixNano\":\"");
    STEP(put_decimal(b, end_ns));
    LITERAL(b, "\",\"attributes\":");
    STEP(put_attributes(b, enc, attributes));
    if (parent_span_id != Py_None) {
        LITERAL(b, ",\"parentSpanId\":\"");
        STEP(put_hex_id(b, parent_span_id, 16));
        LITERAL(b, "\"");
    }
    if (error != Py_None) {
        LITERAL(b, ",\"status\":{\"code\":2,\"message\":");
        STEP(put_json_string(b, enc, error) < 0 ? FAILED : WRITTEN);
        LITERAL(b, "}");
    }
    LITERAL(b, "}");
    return WRITTEN;
}

static PyObject *span_text(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "span_text(trace_id, span_id, name, kind, start_ns, end_ns, attributes, parent_span_id, "
                        "error, encoder) takes 10 arguments");
        return NULL;
    }
    Encoder enc = {args[9]};
    Buffer b = {NULL, 0, 0};
    return finish(&b, put_span(&b, &enc, args));
}

static PyMethodDef methods[] = {
    {"attributes_json", (PyCFunction)(void (*)(void))attributes_json, METH_FASTCALL,
     "attributes_json(attributes, encoder) -> str | None: OTLP JSON of a dict of attributes, equal to\n"
     "otlp._python_attributes_json; None for a mapping or value type only the Python encoder writes."},
    {"span_text", (PyCFunction)(void (*)(void))span_text, METH_FASTCALL,
     "span_text(trace_id, span_id, name, kind, start_ns, end_ns, attributes, parent_span_id, error, encoder)\n"
     "-> str | None: one span without events as OTLP JSON, equal to otlp._python_span_text (kind is OTLP's\n"
     "number); None for an argument only the Python encoder writes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_otlp_text",
    "A request span as OTLP JSON text (gateway/telemetry/_otlp_text.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__otlp_text(void) {
    fill_plain_chars();
    return PyModule_Create(&module);
}
