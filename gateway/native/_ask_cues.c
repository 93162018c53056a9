/* The task cues of an ASCII ask in C: the text half of read_cues in gateway/classifier/cues.py.
 *
 * Why: inside the running gateway the Python reading costs ~16 µs of CPU per request, mostly cache misses
 * across the objects it makes and walks (the lowered tail, the translated bytes, the word set, the frozensets).
 * Here a few passes over the characters and one small table of the cue words make no object but the result.
 *
 * cues.read_ask_text is the reference this must agree with exactly (tests/classifier/test_ask_cues.py). The
 * word and phrase lists are not written here: AskReader takes them from cues.py, their one home. What is
 * written here is the Python being matched: str.split's whitespace, the _OPTION pattern on ASCII text, and
 * the rules that combine the lists (read_ask_text's expressions, one for one).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The word lists in AskReader's argument order, one bit each: a word's entry holds every list it is in. */
enum {
    CODE_WORD = 1 << 0,
    CODE_VERB = 1 << 1,
    CODE_NOUN = 1 << 2,
    MATH_WORD = 1 << 3,
    MATH_PHRASE_WORD = 1 << 4,
    OPEN_NOUN = 1 << 5,
    REASONING_WORD = 1 << 6,
    REASONING_PHRASE_WORD = 1 << 7,
    NEGATION = 1 << 8,
    LETTER_ONLY_WORD = 1 << 9,
};
#define WORD_LISTS 10
/* The phrase lists, after the word lists in AskReader's argument order. */
enum { MATH_PHRASES, REASONING_PHRASES, LETTER_ONLY_PHRASES, LATEX_MARKS, OPEN_VERBS, PHRASE_LISTS };
#define LISTS (WORD_LISTS + PHRASE_LISTS)
#define ASK_VALUES 12 /* the length of cues.AskText */

/* Tails up to this many characters (cues.ASK_SCAN_CHARS is 600) are lowered on the stack. */
#define STACK_CHARS 1024

typedef struct {
    const Py_UCS1 *chars; /* in the reader's pool */
    Py_ssize_t length;
} Span;

/* A phrase and what its search skips by: the bloom of its characters and the shift past a miss at its last. */
typedef struct {
    Span span;
    uint64_t bloom; /* bit (c & 63) for each character c it holds */
    Py_ssize_t skip;
} Phrase;

typedef struct {
    Span word; /* length 0 marks an empty slot: str.split() never yields an empty word */
    uint32_t lists;
} WordSlot;

typedef struct {
    PyObject_HEAD
    Py_UCS1 *pool; /* every ASCII word and phrase, back to back */
    WordSlot *words; /* open addressing, linear probing from hash & word_mask; at most half full */
    uint32_t word_mask;
    Py_ssize_t longest_word; /* a longer token is in no list: no lookup */
    Phrase *phrases; /* the phrase lists back to back: list k is phrases[phrase_start[k] .. phrase_start[k + 1]) */
    Py_ssize_t phrase_start[PHRASE_LISTS + 1];
    /* indexed by a raw character (256 entries so any byte reads in bounds), each about the character lowered */
    uint8_t breaks[256]; /* a separator or str.split() whitespace: where words end */
    uint8_t padding[256]; /* what the opening's lstrip drops before its first word */
} AskReader;

/* ---- characters ----------------------------------------------------------------------------- */

static inline Py_UCS1
lower(Py_UCS1 c)
{
    return c >= 'A' && c <= 'Z' ? (Py_UCS1)(c + ('a' - 'A')) : c;
}

/* str.isspace() on ASCII, which str.split() and re's \s both use: \x1c-\x1f are whitespace too. */
static inline int
is_space(Py_UCS1 c)
{
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

static inline int
is_blank(Py_UCS1 c) /* the pattern's [ \t] */
{
    return c == ' ' || c == '\t';
}

/* `phrase in text`, searched as CPython searches (Objects/stringlib/fastsearch.h, default_find): compare
 * where the phrase's last character matches, and jump the phrase's length past a character it does not hold.
 * A memchr per candidate start cost more than the whole rest of the reading on some asks. */
static int
contains(const Py_UCS1 *text, Py_ssize_t length, const Phrase *phrase)
{
    Py_ssize_t m = phrase->span.length;
    if (m == 0) { /* "" is in every text, as in Python */
        return 1;
    }
    const Py_UCS1 *chars = phrase->span.chars;
    Py_UCS1 last = chars[m - 1];
    for (Py_ssize_t i = 0; i <= length - m; i++) {
        /* text[i + m] is the character after this window: past a character not in the phrase, no window
         * holding it can match */
        int next_is_out = i + m < length && !(phrase->bloom >> (text[i + m] & 63) & 1);
        if (text[i + m - 1] == last) {
            Py_ssize_t k = 0;
            while (k < m - 1 && text[i + k] == chars[k]) {
                k++;
            }
            if (k == m - 1) {
                return 1;
            }
            i += next_is_out ? m : phrase->skip;
        }
        else if (next_is_out) {
            i += m;
        }
    }
    return 0;
}

/* The phrase with its search's bloom and skip, as default_find sets them up. */
static Phrase
searchable(Span span)
{
    Phrase phrase = {span, 0, 0};
    Py_ssize_t last = span.length - 1;
    phrase.skip = last > 0 ? last : 0; /* no earlier copy of the last character: a whole length */
    for (Py_ssize_t k = 0; k < span.length; k++) {
        phrase.bloom |= (uint64_t)1 << (span.chars[k] & 63);
        if (k < last && span.chars[k] == span.chars[last]) {
            phrase.skip = last - k - 1;
        }
    }
    return phrase;
}

/* cues._any(text, phrases) for the phrase list k. */
static int
contains_any(const AskReader *reader, int k, const Py_UCS1 *text, Py_ssize_t length)
{
    for (Py_ssize_t p = reader->phrase_start[k]; p < reader->phrase_start[k + 1]; p++) {
        if (contains(text, length, &reader->phrases[p])) {
            return 1;
        }
    }
    return 0;
}

/* ---- the ask's words -------------------------------------------------------------------------- */

/* A word's home slot, from its length and three of its letters: no chain of multiplies runs through every
 * letter, and the table is small enough that the few collisions cost less than hashing all of them. */
static inline uint32_t
hash_word(const Py_UCS1 *word, Py_ssize_t length)
{
    uint32_t mixed = (uint32_t)length | (uint32_t)word[0] << 8 | (uint32_t)word[length / 2] << 16
                     | (uint32_t)word[length - 1] << 24;
    return (mixed * 0x9E3779B1u) >> 16;
}

/* The lists a token is in. */
static uint32_t
lists_of(const AskReader *reader, const Py_UCS1 *token, Py_ssize_t length)
{
    for (uint32_t slot = hash_word(token, length) & reader->word_mask;; slot = (slot + 1) & reader->word_mask) {
        const WordSlot *entry = &reader->words[slot];
        if (entry->word.length == 0) { /* ends every miss: the table is at most half full */
            return 0;
        }
        if (entry->word.length == length && memcmp(token, entry->word.chars, (size_t)length) == 0) {
            return entry->lists;
        }
    }
}

/* The lists the lowered text's words are in: cues._words (separators to spaces, str.split()) as lookups. */
static uint32_t
word_lists(const AskReader *reader, const Py_UCS1 *text, Py_ssize_t length)
{
    uint32_t lists = 0;
    Py_ssize_t i = 0;
    while (i < length) {
        while (i < length && reader->breaks[text[i]]) {
            i++;
        }
        Py_ssize_t start = i;
        while (i < length && !reader->breaks[text[i]]) {
            i++;
        }
        if (i > start && i - start <= reader->longest_word) {
            lists |= lists_of(reader, text + start, i - start);
        }
    }
    return lists;
}

/* ---- options: cues._OPTION, (?m)^[ \t]*[(\[]?([A-Ja-j])[.)\]:][ \t]*\S on ASCII ------------------- */

/* The option letter's bit (A = 1) when the line starting at i opens with an option, else 0. The pattern
 * needs no backtracking here: its blanks, brackets, letters and punctuation are disjoint sets. */
static unsigned
option_bit(const Py_UCS1 *text, Py_ssize_t length, Py_ssize_t i)
{
    while (i < length && is_blank(text[i])) {
        i++;
    }
    if (i < length && (text[i] == '(' || text[i] == '[')) {
        i++;
    }
    if (i >= length) {
        return 0;
    }
    Py_UCS1 letter = lower(text[i]);
    if (letter < 'a' || letter > 'j') {
        return 0;
    }
    i++;
    if (i >= length || !(text[i] == '.' || text[i] == ')' || text[i] == ']' || text[i] == ':')) {
        return 0;
    }
    i++;
    while (i < length && is_blank(text[i])) {
        i++;
    }
    return i < length && !is_space(text[i]) ? 1u << (letter - 'a') : 0;
}

/* How many distinct letters (case aside) open options: a match never holds a newline, so each line is
 * tried once at its start, as re.findall's non-overlapping scan would. */
static int
option_count(const Py_UCS1 *text, Py_ssize_t length)
{
    unsigned letters = 0;
    for (Py_ssize_t line = 0; line < length;) {
        letters |= option_bit(text, length, line);
        const Py_UCS1 *newline = memchr(text + line, '\n', (size_t)(length - line));
        if (newline == NULL) {
            break;
        }
        line = newline - text + 1;
    }
    int count = 0;
    for (; letters; letters &= letters - 1) {
        count++;
    }
    return count;
}

/* ---- the cues ----------------------------------------------------------------------------- */

/* The characters the tail is counted for. */
typedef struct {
    Py_ssize_t digits, spaces;
    int dollars; /* 0, 1, or 2 for two or more */
    int question_mark, backslash, caret_brace;
} Counts;

static void
count_chars(const Py_UCS1 *text, Py_ssize_t length, Counts *counts)
{
    Py_ssize_t digits = 0, spaces = 0;
    for (Py_ssize_t i = 0; i < length; i++) { /* branch-free, so the compiler vectorizes it */
        digits += (Py_UCS1)(text[i] - '0') < 10;
        spaces += text[i] == ' ';
    }
    counts->digits = digits;
    counts->spaces = spaces;
    /* the rest are rare characters, found by memchr at memory speed */
    const Py_UCS1 *dollar = memchr(text, '$', (size_t)length);
    counts->dollars = dollar == NULL ? 0 : 1 + (memchr(dollar + 1, '$', (size_t)(text + length - dollar - 1)) != NULL);
    counts->question_mark = memchr(text, '?', (size_t)length) != NULL;
    counts->backslash = memchr(text, '\\', (size_t)length) != NULL;
    counts->caret_brace = 0;
    for (const Py_UCS1 *caret = text; (caret = memchr(caret, '^', (size_t)(text + length - caret))) != NULL;) {
        caret++;
        if (caret < text + length && *caret == '{') {
            counts->caret_brace = 1;
            break;
        }
    }
}

/* Whether the text lowered starts with the span's characters. */
static int
starts_lowered_with(const Py_UCS1 *text, const Span *span)
{
    for (Py_ssize_t k = 0; k < span->length; k++) {
        if (lower(text[k]) != span->chars[k]) {
            return 0;
        }
    }
    return 1;
}

/* opening.lower().lstrip(padding).startswith(OPEN_VERBS) */
static int
opens_with_verb(const AskReader *reader, const Py_UCS1 *opening, Py_ssize_t length)
{
    Py_ssize_t start = 0;
    while (start < length && reader->padding[opening[start]]) {
        start++;
    }
    for (Py_ssize_t p = reader->phrase_start[OPEN_VERBS]; p < reader->phrase_start[OPEN_VERBS + 1]; p++) {
        const Span *verb = &reader->phrases[p].span;
        if (verb->length <= length - start && starts_lowered_with(opening + start, verb)) {
            return 1;
        }
    }
    return 0;
}

/* A new reference to Python's bool of a C truth value. */
static inline PyObject *
boolean(int value)
{
    return Py_NewRef(value ? Py_True : Py_False);
}

/* cues.AskText for an ASCII tail (and that tail lowered) and opening, built as read_ask_text builds it. */
static PyObject *
read_ascii(const AskReader *reader, const Py_UCS1 *tail, const Py_UCS1 *lowered, Py_ssize_t length,
           const Py_UCS1 *opening, Py_ssize_t opening_length)
{
    Counts counts;
    count_chars(tail, length, &counts);
    uint32_t lists = word_lists(reader, lowered, length);
    int options = option_count(tail, length);
    int latex = counts.dollars >= 2
        || ((counts.backslash || counts.caret_brace) && contains_any(reader, LATEX_MARKS, tail, length));
    int word_problem = counts.dollars > 0 || (lists & MATH_WORD)
        || ((lists & MATH_PHRASE_WORD) && contains_any(reader, MATH_PHRASES, lowered, length));
    int code_request = (lists & CODE_WORD) || ((lists & CODE_VERB) && (lists & CODE_NOUN));
    int open_ended = options < 2 && (opens_with_verb(reader, opening, opening_length) || (lists & OPEN_NOUN));
    int letter_only = (lists & LETTER_ONLY_WORD) && contains_any(reader, LETTER_ONLY_PHRASES, lowered, length);
    int reasoning = (lists & REASONING_WORD)
        || ((lists & REASONING_PHRASE_WORD) && contains_any(reader, REASONING_PHRASES, lowered, length));
    PyObject *values = PyTuple_New(ASK_VALUES);
    if (values == NULL) {
        return NULL;
    }
    PyObject *items[ASK_VALUES] = {
        PyLong_FromLong(options), boolean(letter_only), PyLong_FromSsize_t(counts.digits), boolean(latex),
        boolean(word_problem), boolean(code_request), boolean(open_ended), boolean(reasoning),
        boolean(lists & NEGATION), boolean(counts.question_mark), PyFloat_FromDouble(0.0), /* no CJK in ASCII */
        PyFloat_FromDouble((double)length / (double)(counts.spaces + 1)),
    };
    int failed = 0;
    for (int k = 0; k < ASK_VALUES; k++) {
        failed |= items[k] == NULL;
        PyTuple_SET_ITEM(values, k, items[k]); /* a NULL item is allowed: the tuple's dealloc skips it */
    }
    if (failed) {
        Py_DECREF(values);
        return NULL;
    }
    return values;
}

/* The characters of an ASCII str argument, or NULL with an exception set. */
static const Py_UCS1 *
ascii_chars(PyObject *text, const char *name, Py_ssize_t *length)
{
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "%s must be str, not %.100s", name, Py_TYPE(text)->tp_name);
        return NULL;
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(text) < 0) {
        return NULL;
    }
#endif
    if (!PyUnicode_IS_ASCII(text)) {
        PyErr_Format(PyExc_ValueError, "%s is not ASCII: cues.read_ask_text reads such asks", name);
        return NULL;
    }
    *length = PyUnicode_GET_LENGTH(text);
    return PyUnicode_1BYTE_DATA(text);
}

static PyObject *
AskReader_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "read() takes the tail and the opening, got %zd arguments", nargs);
    }
    Py_ssize_t length, opening_length;
    const Py_UCS1 *tail = ascii_chars(args[0], "tail", &length);
    if (tail == NULL) {
        return NULL;
    }
    const Py_UCS1 *opening = ascii_chars(args[1], "opening", &opening_length);
    if (opening == NULL) {
        return NULL;
    }
    Py_UCS1 stack_lowered[STACK_CHARS];
    Py_UCS1 *lowered = length <= STACK_CHARS ? stack_lowered : PyMem_Malloc((size_t)length);
    if (lowered == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < length; i++) {
        lowered[i] = lower(tail[i]);
    }
    PyObject *values = read_ascii((const AskReader *)self, tail, lowered, length, opening, opening_length);
    if (lowered != stack_lowered) {
        PyMem_Free(lowered);
    }
    return values;
}

/* ---- building a reader from cues.py's lists ------------------------------------------------------ */

/* Sizes the lists' ASCII strings need; a str that is not ASCII is skipped, since no ASCII ask holds it. */
static int
measure(PyObject *const *lists, const char *const *names, Py_ssize_t *chars, Py_ssize_t *words,
        Py_ssize_t *phrases)
{
    *chars = *words = *phrases = 0;
    for (int k = 0; k < LISTS; k++) {
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(lists[k]); i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(lists[k], i);
            if (!PyUnicode_Check(item)) {
                PyErr_Format(PyExc_TypeError, "%s must hold str, not %.100s", names[k], Py_TYPE(item)->tp_name);
                return -1;
            }
#if PY_VERSION_HEX < 0x030C0000
            if (PyUnicode_READY(item) < 0) {
                return -1;
            }
#endif
            if (PyUnicode_IS_ASCII(item)) {
                *chars += PyUnicode_GET_LENGTH(item);
                *(k < WORD_LISTS ? words : phrases) += 1;
            }
        }
    }
    return 0;
}

/* Copies an ASCII str into the pool at *fill. */
static Span
pooled(PyObject *text, Py_UCS1 **fill)
{
    Span span = {*fill, PyUnicode_GET_LENGTH(text)};
    memcpy(*fill, PyUnicode_1BYTE_DATA(text), (size_t)span.length);
    *fill += span.length;
    return span;
}

/* Adds the word to the table (or its list to the word's entry); hashed as stored, looked up lowered: a word
 * with a capital letter is never found, as no lowered ask's word holds one. */
static void
insert_word(AskReader *reader, Span word, uint32_t list)
{
    uint32_t slot = hash_word(word.chars, word.length) & reader->word_mask;
    while (reader->words[slot].word.length != 0
           && !(reader->words[slot].word.length == word.length
                && memcmp(reader->words[slot].word.chars, word.chars, (size_t)word.length) == 0)) {
        slot = (slot + 1) & reader->word_mask;
    }
    reader->words[slot].word = word;
    reader->words[slot].lists |= list;
    if (word.length > reader->longest_word) {
        reader->longest_word = word.length;
    }
}

static int
fill_lists(AskReader *reader, PyObject *const *lists, const char *const *names)
{
    Py_ssize_t chars, words, phrases;
    if (measure(lists, names, &chars, &words, &phrases) < 0) {
        return -1;
    }
    if (words > (Py_ssize_t)(UINT32_MAX / 4)) {
        PyErr_Format(PyExc_ValueError, "%zd words do not fit the reader's table", words);
        return -1;
    }
    uint32_t capacity = 16;
    while ((Py_ssize_t)capacity < 2 * words) {
        capacity <<= 1;
    }
    reader->pool = PyMem_Malloc(chars ? (size_t)chars : 1);
    reader->words = PyMem_Calloc(capacity, sizeof(WordSlot));
    reader->phrases = PyMem_Malloc((phrases ? (size_t)phrases : 1) * sizeof(Phrase));
    if (reader->pool == NULL || reader->words == NULL || reader->phrases == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    reader->word_mask = capacity - 1;
    Py_UCS1 *fill = reader->pool;
    Py_ssize_t phrase = 0;
    for (int k = 0; k < LISTS; k++) {
        if (k >= WORD_LISTS) {
            reader->phrase_start[k - WORD_LISTS] = phrase;
        }
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(lists[k]); i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(lists[k], i);
            if (!PyUnicode_IS_ASCII(item)) {
                continue;
            }
            Span span = pooled(item, &fill);
            if (k >= WORD_LISTS) {
                reader->phrases[phrase++] = searchable(span);
            }
            else if (span.length > 0) { /* "" is never one of the ask's words */
                insert_word(reader, span, 1u << k);
            }
        }
    }
    reader->phrase_start[PHRASE_LISTS] = phrase;
    return 0;
}

/* table[c] for each ASCII c whose lowered form is one of chars (characters beyond ASCII never occur). */
static void
fill_table(uint8_t *table, PyObject *chars, int with_whitespace)
{
    uint8_t listed[128] = {0};
    for (Py_ssize_t i = 0; i < PyUnicode_GET_LENGTH(chars); i++) {
        Py_UCS4 c = PyUnicode_READ_CHAR(chars, i);
        if (c < 128) {
            listed[c] = 1;
        }
    }
    for (int c = 0; c < 128; c++) {
        Py_UCS1 lowered = lower((Py_UCS1)c);
        table[c] = listed[lowered] || (with_whitespace && is_space(lowered));
    }
}

static void
AskReader_dealloc(PyObject *self)
{
    AskReader *reader = (AskReader *)self;
    PyMem_Free(reader->pool);
    PyMem_Free(reader->words);
    PyMem_Free(reader->phrases);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *
AskReader_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"code_words", "code_verbs", "code_nouns", "math_words", "math_phrase_words",
                            "open_nouns", "reasoning_words", "reasoning_phrase_words", "negations",
                            "letter_only_words", "math_phrases", "reasoning_phrases", "letter_only", "latex",
                            "open_verbs", "separators", "opening_padding", NULL};
    PyObject *given[LISTS], *separators, *padding;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOOOOOOOOUU:AskReader", names, &given[0], &given[1],
                                     &given[2], &given[3], &given[4], &given[5], &given[6], &given[7], &given[8],
                                     &given[9], &given[10], &given[11], &given[12], &given[13], &given[14],
                                     &separators, &padding)) {
        return NULL;
    }
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(separators) < 0 || PyUnicode_READY(padding) < 0) {
        return NULL;
    }
#endif
    PyObject *lists[LISTS] = {NULL};
    AskReader *reader = NULL;
    for (int k = 0; k < LISTS; k++) {
        lists[k] = PySequence_Fast(given[k], "each word and phrase list must be an iterable of str");
        if (lists[k] == NULL) {
            goto done;
        }
    }
    reader = (AskReader *)type->tp_alloc(type, 0); /* zeroed: dealloc can free a half-built reader */
    if (reader == NULL) {
        goto done;
    }
    if (fill_lists(reader, lists, (const char *const *)names) < 0) {
        Py_CLEAR(reader);
        goto done;
    }
    fill_table(reader->breaks, separators, 1);
    fill_table(reader->padding, padding, 0);
done:
    for (int k = 0; k < LISTS; k++) {
        Py_XDECREF(lists[k]);
    }
    return (PyObject *)reader;
}

static PyMethodDef AskReader_methods[] = {
    {"read", (PyCFunction)(void (*)(void))AskReader_read, METH_FASTCALL,
     "read(tail, opening) -> cues.AskText of an ASCII ask, equal to cues.read_ask_text(tail, opening)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AskReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway.native._ask_cues.AskReader",
    .tp_doc = PyDoc_STR("AskReader(code_words, ..., separators, opening_padding): cues.py's word and phrase "
                        "lists, copied, to read ASCII asks with."),
    .tp_basicsize = sizeof(AskReader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = AskReader_new,
    .tp_dealloc = AskReader_dealloc,
    .tp_methods = AskReader_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gateway.native._ask_cues",
    .m_doc = PyDoc_STR("The task cues of an ASCII ask, from the word and phrase lists of cues.py."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__ask_cues(void)
{
    if (PyType_Ready(&AskReaderType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "AskReader", (PyObject *)&AskReaderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
