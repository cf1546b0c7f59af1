/* routereplay.wire._base64_kernel: strict base64 decoding at memory speed, for engine route payloads.
 *
 * Built at install beside the set codec's kernel (setup.py, optional). `routereplay.wire.payload`'s
 * b64_to_bytes uses it as a fast path only: text it accepts is text `base64.b64decode(validate=True)`
 * accepts, with the same bytes; anything else goes to `base64.b64decode`, which names the fault.
 *
 * decode(text) -> bytes | None
 *     text: an ASCII str (read in place, no copy) or a bytes-like; any other str gives None. Accepted: a length that is a multiple of 4, every character in the
 *     standard alphabet [A-Za-z0-9+/], except at most two '=' at the very end. Returns the decoded
 *     bytes (bits past the last whole byte are ignored, as binascii does), or None when not accepted.
 *
 * CPython's binascii decodes about 0.5 GB of text a second here. Where the CPU has SSSE3 (chosen at run
 * time), 16 characters are decoded and checked per step with nibble lookups; the rest, and every CPU
 * without it, take a table walk of 4 characters into 3 bytes with one OR to catch any invalid character.
 * The GIL is released while it runs; no state outlives a call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define INVALID 0x100u /* OR-ed into the group: any invalid character sets this bit */

typedef struct {
    uint32_t value[256]; /* 6-bit value of each character, INVALID for others (and for '=') */
} Alphabet;

static void alphabet_init(Alphabet *a) {
    static const char symbols[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int i = 0; i < 256; i++) a->value[i] = INVALID << 18;
    for (int i = 0; i < 64; i++) a->value[(unsigned char)symbols[i]] = (uint32_t)i;
}

/* Decode `groups` whole groups of 4 characters; returns 0 when every character was in the alphabet. */
static uint32_t decode_groups(const Alphabet *a, const unsigned char *in, Py_ssize_t groups, unsigned char *out) {
    uint32_t bad = 0;
    for (Py_ssize_t g = 0; g < groups; g++) {
        const unsigned char *c = in + 4 * g;
        uint32_t v0 = a->value[c[0]], v1 = a->value[c[1]], v2 = a->value[c[2]], v3 = a->value[c[3]];
        bad |= v0 | v1 | v2 | v3;
        uint32_t word = (v0 << 18) | (v1 << 12) | (v2 << 6) | v3;
        out[3 * g] = (unsigned char)(word >> 16);
        out[3 * g + 1] = (unsigned char)(word >> 8);
        out[3 * g + 2] = (unsigned char)word;
    }
    return bad & ~(uint32_t)63; /* any bit above the 6 value bits: an invalid character */
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_SSSE3_PATH 1
/* 16 characters into 12 bytes a step (SSSE3, chosen at run time): each character's 6-bit value comes
 * from nibble lookups (pshufb) that also flag any character outside the alphabet; multiply-adds merge
 * the values into bytes. Returns the groups of 4 it decoded; it stops before a step holding a character
 * it does not accept (the scalar loop then decodes, or refuses, from there) and 24 characters before
 * the end, so its 16-byte stores stay inside `out`. */
__attribute__((target("ssse3"))) static Py_ssize_t decode_ssse3(const unsigned char *in, Py_ssize_t groups,
                                                                unsigned char *out) {
    /* per low / high nibble: bit sets whose AND is non-zero exactly for characters not in the alphabet */
    const __m128i low_bits = _mm_setr_epi8(0x15, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x13, 0x1A,
                                           0x1B, 0x1B, 0x1B, 0x1A);
    const __m128i high_bits = _mm_setr_epi8(0x10, 0x10, 0x01, 0x02, 0x04, 0x08, 0x04, 0x08, 0x10, 0x10, 0x10, 0x10,
                                            0x10, 0x10, 0x10, 0x10);
    /* what to add to a character to get its value, by high nibble ('/' has its own entry) */
    const __m128i shift = _mm_setr_epi8(0, 16, 19, 4, -65, -65, -71, -71, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128i slash = _mm_set1_epi8(0x2F);
    const __m128i order = _mm_setr_epi8(2, 1, 0, 6, 5, 4, 10, 9, 8, 14, 13, 12, -1, -1, -1, -1);
    Py_ssize_t g = 0;
    for (; g + 6 <= groups; g += 4) {
        __m128i text = _mm_loadu_si128((const __m128i *)(in + 4 * g));
        __m128i high = _mm_and_si128(_mm_srli_epi32(text, 4), slash);
        __m128i low = _mm_and_si128(text, slash);
        __m128i invalid = _mm_and_si128(_mm_shuffle_epi8(low_bits, low), _mm_shuffle_epi8(high_bits, high));
        if (_mm_movemask_epi8(_mm_cmpgt_epi8(invalid, _mm_setzero_si128()))) break;
        __m128i values = _mm_add_epi8(text, _mm_shuffle_epi8(shift, _mm_add_epi8(_mm_cmpeq_epi8(text, slash), high)));
        __m128i pairs = _mm_maddubs_epi16(values, _mm_set1_epi32(0x01400140));  /* 12-bit halves */
        __m128i words = _mm_madd_epi16(pairs, _mm_set1_epi32(0x00011000));     /* 24 bits a group */
        _mm_storeu_si128((__m128i *)(out + 3 * g), _mm_shuffle_epi8(words, order));
    }
    return g;
}
#endif

static PyObject *decode_entry(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_buffer text = {0};
    const unsigned char *in;
    Py_ssize_t n;
    PyObject *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    if (PyUnicode_Check(obj)) {
        if (PyUnicode_READY(obj) < 0) return NULL;
        if (!PyUnicode_IS_ASCII(obj)) Py_RETURN_NONE;
        in = (const unsigned char *)PyUnicode_DATA(obj);
        n = PyUnicode_GET_LENGTH(obj);
    } else {
        if (PyObject_GetBuffer(obj, &text, PyBUF_SIMPLE) < 0) return NULL;
        in = (const unsigned char *)text.buf;
        n = text.len;
    }
    if (n % 4) goto refuse;
    int padding = 0;
    if (n && in[n - 1] == '=') padding = (n >= 2 && in[n - 2] == '=') ? 2 : 1;
    Py_ssize_t groups = n / 4, full = padding ? groups - 1 : groups;
    Py_ssize_t size = 3 * groups - padding;
    result = PyBytes_FromStringAndSize(NULL, size);
    if (!result) goto done;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    Alphabet alphabet;
    alphabet_init(&alphabet);
    uint32_t bad;
    int ssse3 = 0;
#ifdef HAVE_SSSE3_PATH
    ssse3 = __builtin_cpu_supports("ssse3");
#endif
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t done = 0;
#ifdef HAVE_SSSE3_PATH
    if (ssse3) done = decode_ssse3(in, full, out);
#endif
    (void)ssse3;
    bad = decode_groups(&alphabet, in + 4 * done, full - done, out + 3 * done);
    Py_END_ALLOW_THREADS
    if (padding) { /* the last group: 2 or 3 characters, then '=' */
        const unsigned char *c = in + 4 * full;
        uint32_t v0 = alphabet.value[c[0]], v1 = alphabet.value[c[1]];
        uint32_t v2 = padding == 1 ? alphabet.value[c[2]] : 0;
        bad |= (v0 | v1 | v2) & ~(uint32_t)63;
        uint32_t word = (v0 << 18) | (v1 << 12) | (v2 << 6);
        out[3 * full] = (unsigned char)(word >> 16);
        if (padding == 1) out[3 * full + 1] = (unsigned char)(word >> 8);
    }
    if (!bad) goto done;
    Py_DECREF(result);
refuse:
    result = Py_None;
    Py_INCREF(result);
done:
    if (text.obj) PyBuffer_Release(&text);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode_entry, METH_VARARGS, "Strict base64 to bytes, or None when not accepted (see the module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_base64_kernel", "Strict base64 decoding for route payloads.", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__base64_kernel(void) { return PyModule_Create(&module); }
