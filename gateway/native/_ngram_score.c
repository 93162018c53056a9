/* The classifier's text logit, w . x / ||x|| over a text's vocabulary character n-grams, in C.
 *
 * Why: inside the running gateway the Python dict walk costs 35-60 µs per short prompt, because each
 * n-gram lookup misses cache and TLB in a ~10 MB web of Python objects. Here the vocabulary is one
 * open-addressing table of 16-byte slots (key and weight side by side, one cache line per probe), built
 * in gateway/classifier/ngrams.py, which also holds the Python paths this must agree with exactly.
 *
 * Keys: each character's 16-bit id (ids start at 1; characters outside the alphabet get an id no key
 * holds) packed little-endian into a uint64, the first character in the low 16 bits. Key 0 marks an
 * empty slot. Home slot: (key * 0x9E3779B97F4A7C15) >> (64 - bits), then linear probing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_NGRAM 4
#define HASH_MULTIPLIER 0x9E3779B97F4A7C15ULL
/* Texts up to this many characters (the default model clips at 1,000) need no heap allocation. */
#define STACK_CHARS 1024
#define STACK_COUNTERS 2048

typedef struct {
    uint64_t key;
    double weight;
} Slot;

/* One found n-gram's occurrences so far; slot_plus_one == 0 marks a free entry. */
typedef struct {
    uint32_t slot_plus_one;
    uint32_t count;
} Counter;

typedef struct {
    PyObject_HEAD
    uint16_t ascii_ids[128];
    uint32_t *alphabet; /* sorted code points; the character alphabet[i] has id i + 1 */
    Py_ssize_t alphabet_size;
    uint16_t unknown_id;
    Slot *slots;
    uint64_t slot_mask;
    int bits;
    int ngram_min;
    int ngram_max;
} Table;

/* ---- the lookup ---------------------------------------------------------------------------- */

static inline uint16_t
id_of(const Table *table, Py_UCS4 code)
{
    if (code < 128) {
        return table->ascii_ids[code];
    }
    Py_ssize_t low = 0, high = table->alphabet_size;
    while (low < high) {
        Py_ssize_t middle = low + (high - low) / 2;
        if (table->alphabet[middle] < code) {
            low = middle + 1;
        }
        else {
            high = middle;
        }
    }
    if (low < table->alphabet_size && table->alphabet[low] == code) {
        return (uint16_t)(low + 1);
    }
    return table->unknown_id;
}

/* ids[0..length) from the text, then MAX_NGRAM - 1 zeros so every n-gram's key reads in bounds. */
static void
fill_ids(const Table *table, PyObject *text, Py_ssize_t length, uint16_t *ids)
{
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    /* one loop per storage kind: PyUnicode_READ's switch would otherwise run per character */
    if (kind == PyUnicode_1BYTE_KIND) {
        const Py_UCS1 *chars = data;
        for (Py_ssize_t i = 0; i < length; i++) {
            ids[i] = id_of(table, chars[i]);
        }
    }
    else if (kind == PyUnicode_2BYTE_KIND) {
        const Py_UCS2 *chars = data;
        for (Py_ssize_t i = 0; i < length; i++) {
            ids[i] = id_of(table, chars[i]);
        }
    }
    else {
        const Py_UCS4 *chars = data;
        for (Py_ssize_t i = 0; i < length; i++) {
            ids[i] = id_of(table, chars[i]);
        }
    }
    memset(ids + length, 0, (MAX_NGRAM - 1) * sizeof(uint16_t));
}

/* The slot holding key, or -1. Terminates: the table always has an empty slot (load <= 0.5). */
static inline Py_ssize_t
find(const Table *table, uint64_t key)
{
    uint64_t slot = (key * HASH_MULTIPLIER) >> (64 - table->bits);
    for (;;) {
        uint64_t held = table->slots[slot].key;
        if (held == key) {
            return (Py_ssize_t)slot;
        }
        if (held == 0) {
            return -1;
        }
        slot = (slot + 1) & table->slot_mask;
    }
}

/* Counts one more occurrence of the n-gram in slot and returns its count so far. */
static inline uint32_t
count_occurrence(Counter *counters, uint32_t counter_mask, Py_ssize_t slot)
{
    uint32_t wanted = (uint32_t)slot + 1;
    uint32_t i = (uint32_t)slot & counter_mask; /* slots are already hash-spread */
    while (counters[i].slot_plus_one != 0 && counters[i].slot_plus_one != wanted) {
        i = (i + 1) & counter_mask;
    }
    counters[i].slot_plus_one = wanted;
    return ++counters[i].count;
}

static double
score_ids(const Table *table, const uint16_t *ids, Py_ssize_t length, Counter *counters, uint32_t counter_mask)
{
    double dot = 0.0;
    /* sum over distinct n-grams of count^2, as the sum over occurrences of 2k - 1 (k = count so far) */
    uint64_t squares = 0;
    for (int n = table->ngram_min; n <= table->ngram_max; n++) {
        uint64_t mask = n == MAX_NGRAM ? UINT64_MAX : (((uint64_t)1 << (16 * n)) - 1);
        for (Py_ssize_t i = 0; i + n <= length; i++) {
            uint64_t key = ((uint64_t)ids[i] | (uint64_t)ids[i + 1] << 16 | (uint64_t)ids[i + 2] << 32
                            | (uint64_t)ids[i + 3] << 48) & mask;
            Py_ssize_t slot = find(table, key);
            if (slot >= 0) {
                dot += table->slots[slot].weight;
                squares += 2 * (uint64_t)count_occurrence(counters, counter_mask, slot) - 1;
            }
        }
    }
    return squares ? dot / sqrt((double)squares) : 0.0;
}

static Py_ssize_t
ngram_count(const Table *table, Py_ssize_t length)
{
    Py_ssize_t total = 0;
    for (int n = table->ngram_min; n <= table->ngram_max; n++) {
        total += length >= n ? length - n + 1 : 0;
    }
    return total;
}

/* A power of two at least twice the n-gram count: the counters stay at most half full. */
static uint32_t
counter_capacity(Py_ssize_t ngrams)
{
    uint32_t capacity = 16;
    while ((Py_ssize_t)capacity < 2 * ngrams) {
        capacity <<= 1;
    }
    return capacity;
}

static PyObject *
Table_logit(PyObject *self, PyObject *text)
{
    const Table *table = (const Table *)self;
    if (!PyUnicode_Check(text)) {
        return PyErr_Format(PyExc_TypeError, "text must be str, not %.100s", Py_TYPE(text)->tp_name);
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(text) < 0) {
        return NULL;
    }
#endif
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    if (length > (Py_ssize_t)(UINT32_MAX / 16)) { /* keeps slot and counter arithmetic in 32 bits */
        return PyErr_Format(PyExc_ValueError, "text of %zd characters is too long to score", length);
    }
    uint32_t capacity = counter_capacity(ngram_count(table, length));
    uint16_t stack_ids[STACK_CHARS + MAX_NGRAM - 1];
    Counter stack_counters[STACK_COUNTERS];
    uint16_t *ids = length <= STACK_CHARS ? stack_ids : PyMem_Malloc((length + MAX_NGRAM - 1) * sizeof(uint16_t));
    Counter *counters = capacity <= STACK_COUNTERS ? stack_counters : PyMem_Malloc(capacity * sizeof(Counter));
    PyObject *logit = NULL;
    if (ids == NULL || counters == NULL) {
        PyErr_NoMemory();
    }
    else {
        memset(counters, 0, capacity * sizeof(Counter));
        fill_ids(table, text, length, ids);
        logit = PyFloat_FromDouble(score_ids(table, ids, length, counters, capacity - 1));
    }
    if (ids != stack_ids) {
        PyMem_Free(ids);
    }
    if (counters != stack_counters) {
        PyMem_Free(counters);
    }
    return logit;
}

/* ---- building a Table from numpy (or any buffer) arrays ------------------------------------ */

/* A C-contiguous one-dimensional buffer of native-order items of the given size and kind. */
static int
get_array(PyObject *obj, Py_buffer *view, const char *name, Py_ssize_t itemsize, const char *formats)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *format = view->format ? view->format : "B";
    if (*format == '@' || *format == '=' || (*format == '<' && PY_LITTLE_ENDIAN) || (*format == '>' && PY_BIG_ENDIAN)) {
        format++;
    }
    if (view->ndim != 1 || view->itemsize != itemsize || strlen(format) != 1 || !strchr(formats, *format)) {
        PyErr_Format(PyExc_TypeError, "%s must be a one-dimensional array of %zd-byte items of format '%s', got "
                     "format '%s' with %zd-byte items in %d dimensions",
                     name, itemsize, formats, view->format ? view->format : "B", view->itemsize, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int
copy_ids(Table *table, const Py_buffer *ascii_ids, const Py_buffer *alphabet)
{
    if (ascii_ids->shape[0] != 128) {
        PyErr_Format(PyExc_ValueError, "ascii_ids must hold 128 ids, got %zd", ascii_ids->shape[0]);
        return -1;
    }
    Py_ssize_t size = alphabet->shape[0];
    if (size + 2 > (1 << 16)) { /* the unknown id must fit 16 bits too */
        PyErr_Format(PyExc_ValueError, "an alphabet of %zd characters does not fit 16-bit ids", size);
        return -1;
    }
    const uint32_t *codes = alphabet->buf;
    for (Py_ssize_t i = 1; i < size; i++) {
        if (codes[i - 1] >= codes[i]) {
            PyErr_SetString(PyExc_ValueError, "alphabet must be strictly increasing (it is binary searched)");
            return -1;
        }
    }
    memcpy(table->ascii_ids, ascii_ids->buf, sizeof(table->ascii_ids));
    table->alphabet = PyMem_Malloc((size ? size : 1) * sizeof(uint32_t));
    if (table->alphabet == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(table->alphabet, codes, size * sizeof(uint32_t));
    table->alphabet_size = size;
    table->unknown_id = (uint16_t)(size + 1);
    return 0;
}

static int
copy_slots(Table *table, const Py_buffer *keys, const Py_buffer *weights)
{
    Py_ssize_t capacity = keys->shape[0];
    if (weights->shape[0] != capacity) {
        PyErr_Format(PyExc_ValueError, "%zd keys but %zd weights", capacity, weights->shape[0]);
        return -1;
    }
    if (capacity < 2 || (capacity & (capacity - 1)) != 0 || capacity > ((Py_ssize_t)1 << 32)) {
        PyErr_Format(PyExc_ValueError, "the table's capacity must be a power of two in [2, 2**32], got %zd", capacity);
        return -1;
    }
    const uint64_t *key_values = keys->buf;
    Py_ssize_t used = 0;
    for (Py_ssize_t i = 0; i < capacity; i++) {
        used += key_values[i] != 0;
    }
    if (2 * used > capacity) { /* also guarantees the empty slot that ends every missed lookup */
        PyErr_Format(PyExc_ValueError, "%zd keys in %zd slots: the load factor must be at most 0.5", used, capacity);
        return -1;
    }
    table->slots = PyMem_Malloc(capacity * sizeof(Slot));
    if (table->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    const double *weight_values = weights->buf;
    for (Py_ssize_t i = 0; i < capacity; i++) {
        table->slots[i] = (Slot){key_values[i], weight_values[i]};
    }
    table->slot_mask = (uint64_t)capacity - 1;
    table->bits = 0;
    while (((Py_ssize_t)1 << table->bits) < capacity) {
        table->bits++;
    }
    return 0;
}

static void
Table_dealloc(PyObject *self)
{
    Table *table = (Table *)self;
    PyMem_Free(table->alphabet);
    PyMem_Free(table->slots);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *
Table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"ascii_ids", "alphabet", "keys", "weights", "ngram_min", "ngram_max", NULL};
    PyObject *objects[4];
    int ngram_min, ngram_max;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOii:Table", names, &objects[0], &objects[1],
                                     &objects[2], &objects[3], &ngram_min, &ngram_max)) {
        return NULL;
    }
    if (!(1 <= ngram_min && ngram_min <= ngram_max && ngram_max <= MAX_NGRAM)) {
        return PyErr_Format(PyExc_ValueError, "n-gram sizes must satisfy 1 <= min <= max <= %d, got %d, %d",
                            MAX_NGRAM, ngram_min, ngram_max);
    }
    static const char *labels[] = {"ascii_ids", "alphabet", "keys", "weights"};
    static const Py_ssize_t itemsizes[] = {2, 4, 8, 8};
    static const char *formats[] = {"H", "IL", "LQ", "d"};
    Py_buffer views[4];
    int held = 0;
    Table *table = NULL;
    for (; held < 4; held++) {
        if (get_array(objects[held], &views[held], labels[held], itemsizes[held], formats[held]) < 0) {
            goto done;
        }
    }
    table = (Table *)type->tp_alloc(type, 0); /* zeroed: dealloc can free a half-built table */
    if (table == NULL) {
        goto done;
    }
    table->ngram_min = ngram_min;
    table->ngram_max = ngram_max;
    if (copy_ids(table, &views[0], &views[1]) < 0 || copy_slots(table, &views[2], &views[3]) < 0) {
        Py_CLEAR(table);
    }
done:
    while (held-- > 0) {
        PyBuffer_Release(&views[held]);
    }
    return (PyObject *)table;
}

static PyMethodDef Table_methods[] = {
    {"logit", Table_logit, METH_O, "logit(text) -> float: w . x / ||x|| over the text's vocabulary n-grams."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway._ngram_score.Table",
    .tp_doc = PyDoc_STR("Table(ascii_ids, alphabet, keys, weights, ngram_min, ngram_max): the vocabulary "
                        "as an open-addressing table; the arrays are validated and copied."),
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Table_new,
    .tp_dealloc = Table_dealloc,
    .tp_methods = Table_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gateway.native._ngram_score",
    .m_doc = PyDoc_STR("The classifier's text logit over an open-addressing n-gram table."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__ngram_score(void)
{
    if (PyType_Ready(&TableType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_NGRAM", MAX_NGRAM) < 0
        || PyModule_AddObjectRef(m, "Table", (PyObject *)&TableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
