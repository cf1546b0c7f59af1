/* routereplay._json_scan: the bounded JSON parser's quick pre-check in one pass, in C.
 *
 * Built at install beside the codec's kernels (setup.py, optional). `routereplay.jsondocument` asks,
 * before `json.loads`, whether a document can possibly pass its depth and number-length limits: fewer
 * '[' and '{' in all than the depth limit, and no run of ASCII digits longer than the digit limit
 * anywhere (strings included, so the answer is conservative). Python answers with two `count`s and a
 * `translate` of the whole document, which together cost as much as parsing it; this answers in one
 * pass over the bytes. Any document it cannot clear still goes to the exact, string-aware scan.
 *
 * counts(data, limit) -> (brackets, longest_digit_run)
 *     data: a bytes-like object. brackets = how many '[' and '{' it holds; longest_digit_run = the
 *     length of its longest run of '0'..'9' when that run is longer than `limit` or `limit` < 64, else
 *     some value <= 64 (64-byte steps: exact for the question "is any run longer than limit?").
 *     No state outlives a call; the GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* The plain loop: exact for any limit. */
static void count_bytes(const unsigned char *data, Py_ssize_t n, Py_ssize_t *brackets, Py_ssize_t *longest) {
    Py_ssize_t open = 0, best = 0, run = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = data[i];
        int digit = (unsigned char)(c - '0') < 10;
        open += (c == '[') | (c == '{');
        run = digit ? run + 1 : 0;
        best = run > best ? run : best;
    }
    *brackets = open;
    *longest = best;
}

#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_WORDS 1
/* 64 bytes a step: a 64-bit mask of digits and a count of brackets. A run of more than 64 digits
 * crosses a word boundary, so for those runs the boundary arithmetic (the ones ending a word, whole
 * words of ones, the ones starting the next) is exact; *longest is the longest such run, or at most
 * 64 when every run stays inside a word: exact whenever the caller's limit is 64 or more. */
static void count_words(const unsigned char *data, Py_ssize_t n, Py_ssize_t *brackets, Py_ssize_t *longest) {
    const __m128i zero = _mm_set1_epi8('0'), bias = _mm_set1_epi8((char)0x80);
    const __m128i ten = _mm_set1_epi8((char)(0x80 + 10)), square = _mm_set1_epi8('['), curly = _mm_set1_epi8('{');
    Py_ssize_t open = 0, best = 0, carry = 0, i = 0;
    for (; i + 64 <= n; i += 64) {
        uint64_t digits = 0;
        for (int q = 0; q < 4; q++) {
            __m128i c = _mm_loadu_si128((const __m128i *)(data + i + 16 * q));
            /* c - '0' < 10 as unsigned bytes: shift both sides by 0x80 and compare signed */
            __m128i d = _mm_cmplt_epi8(_mm_xor_si128(_mm_sub_epi8(c, zero), bias), ten);
            __m128i b = _mm_or_si128(_mm_cmpeq_epi8(c, square), _mm_cmpeq_epi8(c, curly));
            digits |= (uint64_t)(uint16_t)_mm_movemask_epi8(d) << (16 * q);
            open += __builtin_popcount((unsigned)_mm_movemask_epi8(b));
        }
        if (digits == ~UINT64_C(0)) {
            carry += 64;
            continue;
        }
        Py_ssize_t through = carry + __builtin_ctzll(~digits); /* the run reaching into this word */
        best = through > best ? through : best;
        carry = digits >> 63 ? __builtin_clzll(~digits) : 0; /* the run leaving it */
    }
    Py_ssize_t tail_open, tail_best;
    Py_ssize_t lead = 0; /* the run leaving the last whole word goes on into the tail */
    while (i + lead < n && (unsigned char)(data[i + lead] - '0') < 10) lead++;
    count_bytes(data + i, n - i, &tail_open, &tail_best);
    best = carry + lead > best ? carry + lead : best;
    best = tail_best > best ? tail_best : best;
    *brackets = open + tail_open;
    *longest = best;
}
#endif

static PyObject *counts_entry(PyObject *self, PyObject *args) {
    Py_buffer data = {0};
    Py_ssize_t brackets, longest, limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*n", &data, &limit)) return NULL;
    Py_BEGIN_ALLOW_THREADS
#ifdef HAVE_WORDS
    if (limit >= 64)
        count_words((const unsigned char *)data.buf, data.len, &brackets, &longest);
    else
#endif
        count_bytes((const unsigned char *)data.buf, data.len, &brackets, &longest);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    return Py_BuildValue("nn", brackets, longest);
}

static PyMethodDef methods[] = {
    {"counts", counts_entry, METH_VARARGS, "(brackets, longest digit run) of a bytes-like (see the module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_json_scan", "The bounded JSON parser's pre-check in one pass.", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__json_scan(void) { return PyModule_Create(&module); }
