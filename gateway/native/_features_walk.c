/* features.extract's walk over a chat request's messages, and its code and math markers, in C.
 *
 * Why: inside the running gateway the Python walk (a list per pass over the messages, a dataclass, the marker
 * window, a regex and 17 substring scans) costs ~25 µs of a small chat request's ~42 in features, most of it
 * cache misses across many small Python objects. gateway/features.py holds the Python walk this must agree with
 * exactly, the reference it is tested against and the path for every shape this one declines (it returns None).
 *
 * Nothing is defined twice: the marker lists, the math symbols and the budgets come from features.py when the
 * Walker is built, and every token count is a call back into features.py (its memoized exact count, or its
 * estimate); only the rule choosing between the two, _Counter.count's, is repeated here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Marker sets are matched through 64-bit masks of candidate markers. */
#define MAX_MARKERS 64

typedef struct {
    int count;
    char *text[MAX_MARKERS]; /* ASCII, at least 2 characters each */
    Py_ssize_t length[MAX_MARKERS];
    uint64_t starts_alpha;     /* markers whose first character is a letter */
    uint64_t by_first[128];    /* markers with this first character */
    uint64_t by_second[128];   /* markers with this second character */
} Markers;

typedef struct {
    PyObject_HEAD
    Markers code;
    Markers math;
    uint8_t bmp_symbols[0x10000 / 8]; /* a bit per math symbol below U+10000 */
    Py_UCS4 *astral_symbols;          /* the others */
    Py_ssize_t astral_symbol_count;
    Py_ssize_t exact_chars_per_message;
    Py_ssize_t scan_chars;
} Walker;

typedef enum { ROLE_OTHER, ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL } Role;

/* One message as the walk reads it: the text the model reads (a strong reference) and its role. */
typedef struct {
    PyObject *text;
    Role role;
} Message;

/* Interned at import: dict keys, role names, "\n", "" and "lower". */
static PyObject *key_role, *key_content, *key_tool_calls, *key_function_call, *key_function, *key_name,
    *key_arguments, *role_system, *role_developer, *role_user, *role_assistant, *role_tool, *role_function,
    *newline, *empty, *method_lower;

/* Returned where the Python walk's answer could differ from a plain reading (see declined()). */
#define DECLINE 1

/* ---- reading one message ----------------------------------------------------------------------------------- */

/* 0, or -1 with an error: strings built by the legacy API need this before their length or data are read. */
static int
ready(PyObject *text)
{
#if PY_VERSION_HEX < 0x030C0000
    return PyUnicode_READY(text);
#else
    (void)text;
    return 0;
#endif
}

/* JSON values that are certainly not Mappings: the Python walk skips them, so can this one. Anything else that is
 * not an exact dict (a dict subclass, a registered Mapping) might answer .get() its own way: decline. */
static int
plain_non_mapping(PyObject *value)
{
    return value == Py_None || PyUnicode_CheckExact(value) || PyLong_CheckExact(value) || PyFloat_CheckExact(value)
           || PyBool_Check(value) || PyList_CheckExact(value) || PyTuple_CheckExact(value);
}

/* dict[key] as a strong reference, or NULL (with no error when the key is absent). */
static PyObject *
get(PyObject *dict, PyObject *key)
{
    PyObject *value = PyDict_GetItemWithError(dict, key);
    Py_XINCREF(value);
    return value;
}

/* A str role's meaning; any other JSON value equals none of the names (the Python tests are ==). */
static int
read_role(PyObject *message, Role *role)
{
    PyObject *value = get(message, key_role);
    int status = 0;
    *role = ROLE_OTHER;
    if (value == NULL) {
        status = PyErr_Occurred() ? -1 : 0;
    }
    else if (PyUnicode_CheckExact(value)) {
        if (PyUnicode_Compare(value, role_user) == 0) {
            *role = ROLE_USER;
        }
        else if (PyUnicode_Compare(value, role_assistant) == 0) {
            *role = ROLE_ASSISTANT;
        }
        else if (PyUnicode_Compare(value, role_system) == 0 || PyUnicode_Compare(value, role_developer) == 0) {
            *role = ROLE_SYSTEM;
        }
        else if (PyUnicode_Compare(value, role_tool) == 0 || PyUnicode_Compare(value, role_function) == 0) {
            *role = ROLE_TOOL;
        }
    }
    else if (!plain_non_mapping(value) && !PyDict_CheckExact(value)) {
        status = DECLINE;
    }
    Py_XDECREF(value);
    return status;
}

/* text_of(content) for a str, or for a content that is not a list (""); lists of parts are declined. */
static int
read_content(PyObject *message, PyObject **text)
{
    PyObject *value = get(message, key_content);
    if (value == NULL) {
        *text = Py_NewRef(empty);
        return PyErr_Occurred() ? -1 : 0;
    }
    if (PyUnicode_CheckExact(value)) {
        *text = value;
        return ready(value);
    }
    int declined = PyUnicode_Check(value) || PyList_Check(value);
    Py_DECREF(value);
    *text = Py_NewRef(empty);
    return declined ? DECLINE : 0;
}

/* Appends a function's name and arguments (when str) to texts, as _tool_call_text does. */
static int
read_function(PyObject *function, PyObject *texts)
{
    if (function == NULL || plain_non_mapping(function)) {
        return 0;
    }
    if (!PyDict_CheckExact(function)) {
        return DECLINE;
    }
    PyObject *keys[2] = {key_name, key_arguments};
    for (int i = 0; i < 2; i++) {
        PyObject *value = get(function, keys[i]);
        if (value == NULL && PyErr_Occurred()) {
            return -1;
        }
        int failed = value != NULL && PyUnicode_Check(value) && PyList_Append(texts, value) < 0;
        Py_XDECREF(value);
        if (failed) {
            return -1;
        }
    }
    return 0;
}

/* Appends each tool call's function name and arguments to texts. */
static int
read_calls(PyObject *calls, PyObject *texts)
{
    if (calls == NULL || !PyList_Check(calls)) {
        return 0; /* the Python walk reads calls only from a list */
    }
    if (!PyList_CheckExact(calls)) {
        return DECLINE;
    }
    PyObject *snapshot = PyList_AsTuple(calls); /* immune to a list changed by code a lookup runs */
    if (snapshot == NULL) {
        return -1;
    }
    int status = 0;
    for (Py_ssize_t i = 0; status == 0 && i < PyTuple_GET_SIZE(snapshot); i++) {
        PyObject *call = PyTuple_GET_ITEM(snapshot, i);
        if (plain_non_mapping(call)) {
            continue;
        }
        if (!PyDict_CheckExact(call)) {
            status = DECLINE;
            break;
        }
        PyObject *function = get(call, key_function);
        status = function == NULL && PyErr_Occurred() ? -1 : read_function(function, texts);
        Py_XDECREF(function);
    }
    Py_DECREF(snapshot);
    return status;
}

/* _tool_call_text(message): the calls' names and arguments joined by newlines, into *calls_text. */
static int
read_tool_call_text(PyObject *message, PyObject **calls_text)
{
    PyObject *texts = PyList_New(0);
    if (texts == NULL) {
        return -1;
    }
    PyObject *calls = get(message, key_tool_calls);
    int status = calls == NULL && PyErr_Occurred() ? -1 : read_calls(calls, texts);
    Py_XDECREF(calls);
    if (status == 0) {
        /* a falsy legacy function_call adds nothing; a truthy one is read as a call's function */
        PyObject *legacy = get(message, key_function_call);
        status = legacy == NULL && PyErr_Occurred() ? -1 : read_function(legacy, texts);
        Py_XDECREF(legacy);
    }
    if (status == 0) {
        *calls_text = PyUnicode_Join(newline, texts);
        status = *calls_text == NULL ? -1 : 0;
    }
    Py_DECREF(texts);
    return status;
}

/* _message_text(message): its text and, for an assistant, its tool calls. */
static int
read_message(PyObject *message, Message *read)
{
    int status = read_role(message, &read->role);
    if (status != 0) {
        return status;
    }
    status = read_content(message, &read->text);
    if (status != 0 || read->role != ROLE_ASSISTANT) {
        return status;
    }
    PyObject *calls = NULL;
    status = read_tool_call_text(message, &calls);
    if (status != 0) {
        return status;
    }
    PyObject *text = read->text;
    if (PyUnicode_GET_LENGTH(text) == 0 || PyUnicode_GET_LENGTH(calls) == 0) {
        read->text = PyUnicode_GET_LENGTH(text) ? Py_NewRef(text) : Py_NewRef(calls);
    }
    else {
        PyObject *parts = PyTuple_Pack(2, text, calls);
        read->text = parts == NULL ? NULL : PyUnicode_Join(newline, parts);
        Py_XDECREF(parts);
    }
    Py_DECREF(text);
    Py_DECREF(calls);
    return read->text == NULL ? -1 : 0;
}

/* Every Mapping among the messages, read, into *read (*count of them); the caller releases their texts. */
static int
read_messages(PyObject *messages, Message *read, Py_ssize_t *count)
{
    *count = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(messages); i++) {
        PyObject *message = PyTuple_GET_ITEM(messages, i);
        if (plain_non_mapping(message)) {
            continue;
        }
        if (!PyDict_CheckExact(message)) {
            return DECLINE;
        }
        int status = read_message(message, &read[*count]);
        if (status != 0) {
            return status;
        }
        (*count)++;
    }
    return 0;
}

/* ---- counting ----------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject *count;    /* the exact count (memoized), or None when there is no encoding */
    PyObject *estimate; /* the bytes estimate */
    Py_ssize_t exact_chars_left;
    int exact;
} Budget;

/* _Counter.count: exact while the text fits the per-message and the request's budgets, else estimated. */
static int
count_tokens(const Walker *walker, Budget *budget, PyObject *text, Py_ssize_t *tokens)
{
    Py_ssize_t chars = PyUnicode_GET_LENGTH(text);
    *tokens = 0;
    if (chars == 0) {
        return 0;
    }
    PyObject *counter = budget->count;
    if (counter == Py_None || chars > walker->exact_chars_per_message || chars > budget->exact_chars_left) {
        budget->exact = 0;
        counter = budget->estimate;
    }
    else {
        budget->exact_chars_left -= chars;
    }
    PyObject *result = PyObject_CallOneArg(counter, text);
    if (result == NULL) {
        return -1;
    }
    *tokens = PyLong_AsSsize_t(result);
    Py_DECREF(result);
    return *tokens == -1 && PyErr_Occurred() ? -1 : 0;
}

/* *total += tokens, or OverflowError: a callback's figures are not trusted to stay small. */
static int
add(Py_ssize_t *total, Py_ssize_t tokens)
{
    if ((tokens > 0 && *total > PY_SSIZE_T_MAX - tokens) || (tokens < 0 && *total < PY_SSIZE_T_MIN - tokens)) {
        PyErr_SetString(PyExc_OverflowError, "token counts overflow");
        return -1;
    }
    *total += tokens;
    return 0;
}

typedef struct {
    Py_ssize_t system_tokens, history_tokens, last_user_tokens, user_turns, tool_result_turns, prior_answers;
    Py_ssize_t last_user; /* index of the last user message, or -1 */
} Tally;

/* _tally_chat's totals in one pass: a user turn's tokens move to the history when a later user turn comes. */
static int
tally(const Walker *walker, Budget *budget, const Message *messages, Py_ssize_t count, Tally *totals)
{
    Py_ssize_t assistants = 0;
    *totals = (Tally){.last_user = -1};
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t tokens;
        if (count_tokens(walker, budget, messages[i].text, &tokens) < 0) {
            return -1;
        }
        Role role = messages[i].role;
        if (role == ROLE_SYSTEM) {
            if (add(&totals->system_tokens, tokens) < 0) {
                return -1;
            }
            continue;
        }
        Py_ssize_t to_history = tokens;
        if (role == ROLE_USER) {
            to_history = totals->last_user >= 0 ? totals->last_user_tokens : 0;
            totals->last_user = i;
            totals->last_user_tokens = tokens;
            totals->user_turns++;
            totals->prior_answers = assistants;
        }
        assistants += role == ROLE_ASSISTANT;
        totals->tool_result_turns += role == ROLE_TOOL;
        if (add(&totals->history_tokens, to_history) < 0) {
            return -1;
        }
    }
    return 0;
}

/* ---- the marker window and its tests ------------------------------------------------------------------------- */

/* scan_window: "\n" and the non-system texts newest first, joined by newlines, up to scan_chars of text. */
static PyObject *
scan_window(const Walker *walker, const Message *messages, Py_ssize_t count)
{
    PyObject *pieces = PyList_New(0);
    if (pieces == NULL || PyList_Append(pieces, empty) < 0) {
        Py_XDECREF(pieces);
        return NULL;
    }
    Py_ssize_t budget = walker->scan_chars;
    for (Py_ssize_t i = count - 1; i >= 0 && budget > 0; i--) {
        if (messages[i].role == ROLE_SYSTEM) {
            continue;
        }
        PyObject *text = messages[i].text;
        Py_ssize_t chars = PyUnicode_GET_LENGTH(text);
        PyObject *piece = chars <= budget ? Py_NewRef(text) : PyUnicode_Substring(text, 0, budget);
        if (piece == NULL || PyList_Append(pieces, piece) < 0) {
            Py_XDECREF(piece);
            Py_DECREF(pieces);
            return NULL;
        }
        budget -= PyUnicode_GET_LENGTH(piece);
        Py_DECREF(piece);
    }
    /* "\n" + "\n".join(no pieces) is "\n", which the join of [""] alone is not */
    PyObject *window = PyList_GET_SIZE(pieces) == 1 ? Py_NewRef(newline) : PyUnicode_Join(newline, pieces);
    Py_DECREF(pieces);
    return window;
}

static inline Py_UCS4
fold(Py_UCS4 c, int lower)
{
    return lower && c >= 'A' && c <= 'Z' ? c + ('a' - 'A') : c;
}

static int
marker_at(const Markers *markers, int which, int kind, const void *data, Py_ssize_t length, Py_ssize_t at, int lower)
{
    Py_ssize_t marker_length = markers->length[which];
    if (at + marker_length > length) {
        return 0;
    }
    const char *text = markers->text[which];
    for (Py_ssize_t k = 2; k < marker_length; k++) {
        if (fold(PyUnicode_READ(kind, data, at + k), lower) != (Py_UCS4)(unsigned char)text[k]) {
            return 0;
        }
    }
    return 1;
}

/* Where the first marker at or after `from` starts (-1: none), and which one: at one position the earliest in the
 * list, as the regex alternation picks. `lower` folds ASCII capitals, for a window known to be ASCII. */
static inline Py_ssize_t
find_marker(const Markers *markers, int kind, const void *data, Py_ssize_t length, Py_ssize_t from, int lower,
            int *which)
{
    for (Py_ssize_t at = from; at + 1 < length; at++) {
        Py_UCS4 first = fold(PyUnicode_READ(kind, data, at), lower);
        if (first >= 128 || markers->by_first[first] == 0) {
            continue;
        }
        Py_UCS4 second = fold(PyUnicode_READ(kind, data, at + 1), lower);
        uint64_t candidates = second < 128 ? markers->by_first[first] & markers->by_second[second] : 0;
        for (int i = 0; candidates != 0; i++, candidates >>= 1) {
            if ((candidates & 1) && marker_at(markers, i, kind, data, length, at, lower)) {
                *which = i;
                return at;
            }
        }
    }
    return -1;
}

/* One loop per storage kind: the kind is then a constant inside find_marker. */
static Py_ssize_t
find_in(const Markers *markers, PyObject *text, Py_ssize_t from, int lower, int *which)
{
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    switch (PyUnicode_KIND(text)) {
    case PyUnicode_1BYTE_KIND:
        return find_marker(markers, PyUnicode_1BYTE_KIND, data, length, from, lower, which);
    case PyUnicode_2BYTE_KIND:
        return find_marker(markers, PyUnicode_2BYTE_KIND, data, length, from, lower, which);
    default:
        return find_marker(markers, PyUnicode_4BYTE_KIND, data, length, from, lower, which);
    }
}

/* has_code: the regex's matches in turn (each search resumes after the last match, as finditer does); a marker
 * that starts with a letter counts only at the start of a word. */
static int
has_code(const Walker *walker, PyObject *window)
{
    const Markers *markers = &walker->code;
    int kind = PyUnicode_KIND(window);
    const void *data = PyUnicode_DATA(window);
    int which;
    for (Py_ssize_t at = find_in(markers, window, 0, 0, &which); at >= 0;
         at = find_in(markers, window, at + markers->length[which], 0, &which)) {
        if (at == 0 || !((markers->starts_alpha >> which) & 1)
            || !Py_UNICODE_ISALPHA(PyUnicode_READ(kind, data, at - 1))) {
            return 1;
        }
    }
    return 0;
}

static int
is_math_symbol(const Walker *walker, Py_UCS4 c)
{
    if (c < 0x10000) {
        return (walker->bmp_symbols[c >> 3] >> (c & 7)) & 1;
    }
    for (Py_ssize_t k = 0; k < walker->astral_symbol_count; k++) {
        if (walker->astral_symbols[k] == c) {
            return 1;
        }
    }
    return 0;
}

static int
has_math_symbol(const Walker *walker, PyObject *window)
{
    int kind = PyUnicode_KIND(window);
    const void *data = PyUnicode_DATA(window);
    for (Py_ssize_t i = 0; i < PyUnicode_GET_LENGTH(window); i++) {
        if (is_math_symbol(walker, PyUnicode_READ(kind, data, i))) {
            return 1;
        }
    }
    return 0;
}

/* has_math: a math symbol, or a marker in the lowered window (str.lower() itself when not ASCII: Unicode
 * lowering can make ASCII letters of other characters, and change the length). */
static int
has_math(const Walker *walker, PyObject *window)
{
    int which;
    if (PyUnicode_IS_ASCII(window)) {
        return find_in(&walker->math, window, 0, 1, &which) >= 0;
    }
    if (has_math_symbol(walker, window)) {
        return 1;
    }
    PyObject *lowered = PyObject_CallMethodNoArgs(window, method_lower);
    if (lowered == NULL) {
        return -1;
    }
    int found = find_in(&walker->math, lowered, 0, 0, &which) >= 0;
    Py_DECREF(lowered);
    return found;
}

/* ---- the entry point ------------------------------------------------------------------------------------------ */

static PyObject *
walked(const Walker *walker, const Message *messages, Py_ssize_t count, const Tally *totals, const Budget *budget)
{
    PyObject *window = scan_window(walker, messages, count);
    if (window == NULL) {
        return NULL;
    }
    int code = has_code(walker, window);
    int math = has_math(walker, window);
    Py_DECREF(window);
    if (math < 0) {
        return NULL;
    }
    PyObject *last_user_text = totals->last_user >= 0 ? messages[totals->last_user].text : empty;
    return Py_BuildValue("(nnnnnnnOOO)nO", totals->system_tokens, totals->history_tokens, totals->last_user_tokens,
                         count, totals->user_turns, totals->tool_result_turns, totals->prior_answers, last_user_text,
                         code ? Py_True : Py_False, math ? Py_True : Py_False, budget->exact_chars_left,
                         budget->exact ? Py_True : Py_False);
}

static PyObject *
Walker_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    const Walker *walker = (const Walker *)self;
    if (nargs != 4) {
        return PyErr_Format(PyExc_TypeError, "walk() takes 4 arguments (%zd given)", nargs);
    }
    PyObject *list = args[0];
    Budget budget = {.count = args[2], .estimate = args[3], .exact_chars_left = PyLong_AsSsize_t(args[1])};
    if (budget.exact_chars_left == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyList_CheckExact(list)) {
        Py_RETURN_NONE;
    }
    budget.exact = budget.count != Py_None;
    PyObject *snapshot = PyList_AsTuple(list); /* immune to a list changed by code a lookup or a count runs */
    if (snapshot == NULL) {
        return NULL;
    }
    Py_ssize_t size = PyTuple_GET_SIZE(snapshot), count = 0;
    Message *messages = PyMem_Calloc(size ? size : 1, sizeof(Message));
    PyObject *result = NULL;
    int status = messages == NULL ? (PyErr_NoMemory(), -1) : read_messages(snapshot, messages, &count);
    Tally totals;
    if (status == 0 && tally(walker, &budget, messages, count, &totals) == 0) {
        result = walked(walker, messages, count, &totals, &budget);
    }
    else if (status == DECLINE) {
        result = Py_NewRef(Py_None);
    }
    for (Py_ssize_t i = 0; messages != NULL && i < size; i++) {
        Py_XDECREF(messages[i].text); /* a declined message may hold its text already: calloc'd NULL otherwise */
    }
    PyMem_Free(messages);
    Py_DECREF(snapshot);
    return result;
}

/* The marker tests alone, on a window a walk that goes on from an earlier step's tallies built (features.py). */
static PyObject *
Walker_markers(PyObject *self, PyObject *window)
{
    const Walker *walker = (const Walker *)self;
    if (!PyUnicode_Check(window)) {
        return PyErr_Format(PyExc_TypeError, "markers() takes a str, got %.200s", Py_TYPE(window)->tp_name);
    }
    if (ready(window) < 0) {
        return NULL;
    }
    int code = has_code(walker, window);
    int math = has_math(walker, window);
    if (math < 0) {
        return NULL;
    }
    return Py_BuildValue("(OO)", code ? Py_True : Py_False, math ? Py_True : Py_False);
}

/* ---- building a Walker ---------------------------------------------------------------------------------------- */

static void
free_markers(Markers *markers)
{
    for (int i = 0; i < markers->count; i++) {
        PyMem_Free(markers->text[i]);
    }
    markers->count = 0;
}

static int
add_marker(Markers *markers, PyObject *marker, const char *name)
{
    if (PyUnicode_Check(marker) && ready(marker) < 0) {
        return -1;
    }
    if (!PyUnicode_Check(marker) || !PyUnicode_IS_ASCII(marker) || PyUnicode_GET_LENGTH(marker) < 2) {
        PyErr_Format(PyExc_ValueError, "each of %s must be an ASCII str of 2 or more characters, got %R", name, marker);
        return -1;
    }
    if (markers->count == MAX_MARKERS) {
        PyErr_Format(PyExc_ValueError, "%s: at most %d markers", name, MAX_MARKERS);
        return -1;
    }
    Py_ssize_t length = PyUnicode_GET_LENGTH(marker);
    char *text = PyMem_Malloc(length);
    if (text == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(text, PyUnicode_DATA(marker), length);
    int i = markers->count++;
    markers->text[i] = text;
    markers->length[i] = length;
    markers->by_first[(unsigned char)text[0]] |= (uint64_t)1 << i;
    markers->by_second[(unsigned char)text[1]] |= (uint64_t)1 << i;
    markers->starts_alpha |= (uint64_t)(Py_UNICODE_ISALPHA((Py_UCS4)(unsigned char)text[0]) ? 1 : 0) << i;
    return 0;
}

static int
copy_markers(Markers *markers, PyObject *sequence, const char *name)
{
    PyObject *items = PySequence_Tuple(sequence);
    if (items == NULL) {
        return -1;
    }
    int status = 0;
    for (Py_ssize_t i = 0; status == 0 && i < PyTuple_GET_SIZE(items); i++) {
        status = add_marker(markers, PyTuple_GET_ITEM(items, i), name);
    }
    Py_DECREF(items);
    return status;
}

static int
copy_symbols(Walker *walker, PyObject *symbols)
{
    if (!PyUnicode_Check(symbols) || ready(symbols) < 0) {
        return PyErr_Occurred() ? -1 : (PyErr_SetString(PyExc_TypeError, "math_symbols must be a str"), -1);
    }
    Py_ssize_t length = PyUnicode_GET_LENGTH(symbols);
    walker->astral_symbols = PyMem_Calloc(length ? length : 1, sizeof(Py_UCS4));
    if (walker->astral_symbols == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < length; i++) {
        Py_UCS4 c = PyUnicode_READ_CHAR(symbols, i);
        if (c < 0x10000) {
            walker->bmp_symbols[c >> 3] |= (uint8_t)(1 << (c & 7));
        }
        else {
            walker->astral_symbols[walker->astral_symbol_count++] = c;
        }
    }
    return 0;
}

static void
Walker_dealloc(PyObject *self)
{
    Walker *walker = (Walker *)self;
    free_markers(&walker->code);
    free_markers(&walker->math);
    PyMem_Free(walker->astral_symbols);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *
Walker_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"code_markers", "math_markers", "math_symbols", "exact_chars_per_message", "scan_chars",
                            NULL};
    PyObject *code, *math, *symbols;
    Py_ssize_t exact_chars_per_message, scan_chars;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OOOnn:Walker", names, &code, &math, &symbols,
                                     &exact_chars_per_message, &scan_chars)) {
        return NULL;
    }
    Walker *walker = (Walker *)type->tp_alloc(type, 0); /* zeroed: dealloc can free a half-built walker */
    if (walker == NULL) {
        return NULL;
    }
    walker->exact_chars_per_message = exact_chars_per_message;
    walker->scan_chars = scan_chars;
    if (copy_markers(&walker->code, code, "code_markers") < 0 || copy_markers(&walker->math, math, "math_markers") < 0
        || copy_symbols(walker, symbols) < 0) {
        Py_CLEAR(walker);
    }
    return (PyObject *)walker;
}

static PyMethodDef Walker_methods[] = {
    {"walk", (PyCFunction)(void (*)(void))Walker_walk, METH_FASTCALL,
     "walk(messages, exact_chars_left, count, estimate) -> ((system_tokens, history_tokens, last_user_tokens, "
     "message_count, user_turns, tool_result_turns, prior_answers, last_user_text, has_code, has_math), "
     "exact_chars_left, exact), or None for a shape left to the Python walk."},
    {"markers", (PyCFunction)Walker_markers, METH_O,
     "markers(window) -> (has_code, has_math): the walk's marker tests on a window built elsewhere."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WalkerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway.native._features_walk.Walker",
    .tp_doc = PyDoc_STR("Walker(*, code_markers, math_markers, math_symbols, exact_chars_per_message, scan_chars): "
                        "features.extract's chat walk with these markers and budgets (copied)."),
    .tp_basicsize = sizeof(Walker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Walker_new,
    .tp_dealloc = Walker_dealloc,
    .tp_methods = Walker_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gateway.native._features_walk",
    .m_doc = PyDoc_STR("features.extract's walk over a chat request's messages, and its markers."),
    .m_size = -1,
};

static int
intern_strings(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } strings[] = {
        {&key_role, "role"}, {&key_content, "content"}, {&key_tool_calls, "tool_calls"},
        {&key_function_call, "function_call"}, {&key_function, "function"}, {&key_name, "name"},
        {&key_arguments, "arguments"}, {&role_system, "system"}, {&role_developer, "developer"},
        {&role_user, "user"}, {&role_assistant, "assistant"}, {&role_tool, "tool"}, {&role_function, "function"},
        {&newline, "\n"}, {&empty, ""}, {&method_lower, "lower"},
    };
    for (size_t i = 0; i < sizeof(strings) / sizeof(strings[0]); i++) {
        if (*strings[i].slot == NULL && (*strings[i].slot = PyUnicode_InternFromString(strings[i].text)) == NULL) {
            return -1;
        }
    }
    return 0;
}

PyMODINIT_FUNC
PyInit__features_walk(void)
{
    if (intern_strings() < 0 || PyType_Ready(&WalkerType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "Walker", (PyObject *)&WalkerType) < 0) {
        Py_CLEAR(m);
    }
    return m;
}
